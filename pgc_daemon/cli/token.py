"""``pgc token``: print the API's bearer token (PGC_API_TOKEN, or the token file)."""

from __future__ import annotations

import argparse
import sys

from pgc_daemon.cli._base import EXIT_FAILED, add_token_option, settings_from

ORDER = 25


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "token",
        allow_abbrev=False,  # "--token" must not pass for "--token-file"
        help="print the API token that mutating calls need",
        description="Prints the bearer token of pgc serve: PGC_API_TOKEN if set, else the token "
        "file (--token-file, or <PGC_WORK_DIR>/token, which the first pgc serve creates).",
    )
    add_token_option(p)
    p.add_argument("--create", action="store_true", help="create the token file if it is missing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    token, created = settings.load_token(create=args.create)
    if token is None:
        print(
            f"pgc token: error: no token yet: {settings.token_path()} is created by the first "
            "pgc serve (or pgc token --create)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if created:
        print(f"pgc token: created {settings.token_path()} (mode 0600)", file=sys.stderr)
    print(token)
    return 0
