"""``pgc rollback``: return a served model to what served before its active variant (the
fp32 base if nothing else), optionally waiting for the outcome."""

from __future__ import annotations

import argparse

from pgc_daemon.cli._base import add_store_option, existing_store
from pgc_daemon.cli._outcome import add_outcome_options, report

ORDER = 51


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("rollback", help="return a served model to what served before")
    add_store_option(r)
    r.add_argument("model", help="the model's name")
    r.add_argument("--reason", default="rolled back from the command line")
    add_outcome_options(r)
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pgc_daemon.services.deployments import request_rollback  # noqa: PLC0415

    store = existing_store(args)
    with store.session() as s:
        dep_id = request_rollback(s, args.model, reason=args.reason).id
    return report(args, store, dep_id)
