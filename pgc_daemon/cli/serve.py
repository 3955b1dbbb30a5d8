"""``pgc serve``: the API, metrics, dashboard and optimizer loop (the sidecar)."""

from __future__ import annotations

import argparse
import sys

from pgc_daemon.cli._base import EXIT_FAILED, add_store_option, settings_from

ORDER = 20


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the API, metrics, dashboard and optimizer loop")
    add_store_option(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8765)")
    serve.add_argument("--token", dest="api_token", help="bearer token for mutating calls")
    serve.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pgc_daemon.api import create_app

    settings = settings_from(args)
    app = create_app(settings, run_daemon=True)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level)
    )
    print(
        f"pgc serve: http://{settings.host}:{settings.port}/ (store {app.state.store.safe_url})",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    return 0 if server.started else EXIT_FAILED
