"""``pgc deploy``: deploy a variant of a served model, through the store (the agent serving
the model picks it up), optionally waiting for the outcome."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pgc_daemon.cli._base import UsageError, add_store_option, existing_store
from pgc_daemon.cli._outcome import add_outcome_options, report

ORDER = 50


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("deploy", help="deploy a variant of a served model (by id or recipe)")
    add_store_option(d)
    d.add_argument("model", help="the model's name")
    what = d.add_mutually_exclusive_group(required=True)
    what.add_argument("--variant", type=int, help="a variant id (see GET /api/models/NAME/front)")
    what.add_argument("--recipe", help="a recipe as JSON, or @FILE holding it")
    d.add_argument("--reason", default="deployed from the command line")
    add_outcome_options(d)
    d.set_defaults(func=run)


def _recipe(text: str) -> dict[str, Any]:
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise UsageError(f"cannot read {text[1:]}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--recipe is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError("--recipe must be a JSON object")
    return data


def run(args: argparse.Namespace) -> int:
    from pgc_daemon.services.deployments import request_deploy  # noqa: PLC0415

    store = existing_store(args)
    recipe = _recipe(args.recipe) if args.recipe else None
    with store.session() as s:
        dep = request_deploy(s, args.model, variant_id=args.variant, recipe=recipe, reason=args.reason)
        dep_id = dep.id
    return report(args, store, dep_id)
