"""``pgc serve``: the API, metrics, dashboard and optimizer loop (the sidecar)."""

from __future__ import annotations

import argparse
import sys

from pgc_daemon.cli._base import EXIT_FAILED, UsageError, add_store_option, add_token_option, settings_from

ORDER = 20


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        allow_abbrev=False,  # "--token" must not pass for "--token-file"
        help="run the API, metrics, dashboard and optimizer loop",
        description="Mutating API calls need a bearer token: PGC_API_TOKEN, --token-file, or the "
        "one the first pgc serve creates in the work dir (pgc token shows it).",
    )
    add_store_option(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1; another one needs --allow-remote)")
    serve.add_argument("--port", type=int, help="port (default 8765)")
    add_token_option(serve)
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        default=None,
        help="allow --host off loopback: the API is then reachable from the network (token required)",
    )
    serve.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pgc_daemon.settings import is_loopback

    settings = settings_from(args)
    if not is_loopback(settings.host):
        if not settings.allow_remote:
            raise UsageError(
                f"--host {settings.host} is reachable from the network: pass --allow-remote "
                "(PGC_ALLOW_REMOTE=1) to mean it, or bind 127.0.0.1"
            )
        print(
            f"pgc serve: warning: the API on {settings.host}:{settings.port} is reachable from the "
            "network; every mutating call needs the token",
            file=sys.stderr,
            flush=True,
        )
    import store as st

    store = st.open_store(settings.store_url)  # a bad store is the one error the user sees
    token, created = settings.load_token(create=True)
    if created:
        print(
            f"pgc serve: created the API token in {settings.token_path()} (mode 0600); clients send "
            f"'Authorization: Bearer {token}' ('pgc token' shows it again)",
            file=sys.stderr,
            flush=True,
        )
    # after every check: the API's imports take seconds (torch), a refusal should not
    import uvicorn

    from pgc_daemon.api import create_app

    app = create_app(settings, store=store, run_daemon=True)
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
