"""The ``pgc`` command: a thin layer over the library. Errors become one readable line on
stderr and an exit code (1: the work failed, 2: bad usage or input, 130: interrupted)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from pgc_daemon.errors import KNOWN_ERRORS, describe
from pgc_daemon.settings import Settings

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


def _settings(args: argparse.Namespace) -> Settings:
    updates = {}
    for key in ("store_url", "host", "port", "api_token"):
        value = getattr(args, key, None)
        if value is not None:
            updates[key] = value
    return Settings().model_copy(update=updates)


def cmd_demo(args: argparse.Namespace) -> int:
    from pgc_daemon.demo import DemoOptions, run_demo

    settings = _settings(args).model_copy(
        update={"window_s": 5.0, "sample_every": 20, "min_profile_calls": 200, "poll_s": 1.0}
    )
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be positive")
    report = run_demo(
        settings,
        DemoOptions(
            duration=args.duration,
            serve=not args.no_serve,
            json=args.json,
            rate=args.rate,
            clients=args.clients,
            trials=args.trials,
            max_drop=args.max_drop,
        ),
    )
    return 0 if report.get("outcome") in ("deployed", "kept") else EXIT_FAILED


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pgc_daemon.api import create_app

    settings = _settings(args)
    app = create_app(settings, run_daemon=True)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level)
    )
    print(f"pgc serve: http://{settings.host}:{settings.port}/ (store {app.state.store.safe_url})", file=sys.stderr)
    server.run()
    return 0 if server.started else EXIT_FAILED


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", dest="store_url", help="store URL (default: sqlite:///pgc.db or PGC_STORE_URL)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgc", description="Profile-guided compilation daemon for PyTorch inference."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what pgc does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the whole loop on all-MiniLM-L6-v2 with live traffic")
    _common(demo)
    demo.add_argument("--duration", type=float, help="stop after this many seconds")
    demo.add_argument("--no-serve", action="store_true", help="do not keep the API up at the end")
    demo.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    demo.add_argument("--host", help="API bind address (default 127.0.0.1)")
    demo.add_argument("--port", type=int, help="API port (default 8765)")
    demo.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    demo.add_argument("--clients", type=int, default=2, help="client threads (default 2)")
    demo.add_argument("--trials", type=int, default=6, help="search trials (default 6)")
    demo.add_argument("--max-drop", type=float, default=0.01, help="accuracy budget (default 0.01)")
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="run the API, metrics, dashboard and optimizer loop")
    _common(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8765)")
    serve.add_argument("--token", dest="api_token", help="bearer token for mutating calls")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=cmd_serve)
    return parser


def run(argv: Sequence[str] | None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as exc:
        print(f"pgc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KNOWN_ERRORS as exc:
        print(f"pgc {args.command}: error: {describe(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"pgc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
