"""``pgc cancel MODEL DEPLOYMENT_ID``: cancel an open deployment (a candidate, or one the
agent is still building, verifying or running on canary). Exit 1 when it has already
finished."""

from __future__ import annotations

import argparse

from pgc_daemon.cli._base import add_store_option, existing_store
from pgc_daemon.cli._outcome import add_outcome_options, report

ORDER = 52


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cancel", help="cancel an open deployment of a served model")
    add_store_option(c)
    c.add_argument("model", help="the model's name")
    c.add_argument("deployment_id", type=int, metavar="DEPLOYMENT_ID",
                   help="the deployment (see pgc deploy's output or GET /api/models/NAME/deployments)")
    c.add_argument("--reason", default="cancelled from the command line")
    add_outcome_options(c, wait=False)
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pgc_daemon.services.deployments import request_cancel  # noqa: PLC0415

    store = existing_store(args)
    with store.session() as s:
        dep_id = request_cancel(s, args.model, args.deployment_id, args.reason).id
    return report(args, store, dep_id)
