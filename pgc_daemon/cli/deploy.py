"""``pgc deploy`` and ``pgc rollback``: operator actions on a served model, through the store
(the agent serving the model picks them up), optionally waiting for the outcome."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from pgc_daemon.cli._base import EXIT_FAILED, UsageError, add_store_option, settings_from

ORDER = 50
TERMINAL = ("active", "failed", "rolled_back", "superseded")


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("deploy", help="deploy a variant of a served model (by id or recipe)")
    add_store_option(d)
    d.add_argument("model", help="the model's name")
    what = d.add_mutually_exclusive_group(required=True)
    what.add_argument("--variant", type=int, help="a variant id (see GET /api/models/NAME/front)")
    what.add_argument("--recipe", help="a recipe as JSON, or @FILE holding it")
    d.add_argument("--reason", default="deployed from the command line")
    d.add_argument("--wait", type=float, metavar="SECONDS", help="wait for the outcome")
    d.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    d.set_defaults(func=run_deploy)

    r = sub.add_parser("rollback", help="return a served model to what served before")
    add_store_option(r)
    r.add_argument("model", help="the model's name")
    r.add_argument("--reason", default="rolled back from the command line")
    r.add_argument("--wait", type=float, metavar="SECONDS", help="wait for the outcome")
    r.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    r.set_defaults(func=run_rollback)


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


def _finish(args: argparse.Namespace, store: Any, dep_id: int) -> int:
    import store as st

    state = "candidate"
    if args.wait:
        deadline = time.monotonic() + args.wait
        seen = 1
        while time.monotonic() < deadline:
            with store.session() as s:
                dep = st.repo.get_deployment(s, dep_id)
                for t in dep.transitions[seen:]:
                    print(f"{t.to_state}: {t.reason}", file=sys.stderr)
                seen = len(dep.transitions)
                state = dep.state
            if state in TERMINAL:
                break
            time.sleep(0.5)
    with store.session() as s:
        dep = st.repo.get_deployment(s, dep_id)
        out = {"deployment_id": dep.id, "state": dep.state, "reason": dep.reason, "variant_id": dep.variant_id}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"deployment {dep_id}: {out['state']} ({out['reason']})", file=sys.stderr)
    if args.wait and out["state"] not in ("active",):
        return EXIT_FAILED
    return 0


def run_deploy(args: argparse.Namespace) -> int:
    import store as st
    from pgc_daemon.services.deployments import request_deploy

    store = st.open_store(settings_from(args).store_url)
    recipe = _recipe(args.recipe) if args.recipe else None
    with store.session() as s:
        dep = request_deploy(s, args.model, variant_id=args.variant, recipe=recipe, reason=args.reason)
        dep_id = dep.id
    return _finish(args, store, dep_id)


def run_rollback(args: argparse.Namespace) -> int:
    import store as st
    from pgc_daemon.services.deployments import request_rollback

    store = st.open_store(settings_from(args).store_url)
    with store.session() as s:
        dep_id = request_rollback(s, args.model, reason=args.reason).id
    return _finish(args, store, dep_id)
