"""What ``deploy``, ``rollback`` and ``cancel`` share: reporting a deployment, optionally
after waiting for the agent to finish it."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from pgc_daemon.cli._base import EXIT_FAILED

if TYPE_CHECKING:
    import store as st


def add_outcome_options(p: argparse.ArgumentParser, *, wait: bool = True) -> None:
    if wait:
        p.add_argument("--wait", type=float, metavar="SECONDS", help="wait for the outcome")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def report(args: argparse.Namespace, store: st.Store, dep_id: int) -> int:
    """Print the deployment's state (after waiting up to ``--wait`` seconds for a terminal
    one, printing each transition); with ``--wait``, exit 1 unless it became active."""
    import store as st  # noqa: PLC0415
    from pgc_daemon.states import TERMINAL, D  # noqa: PLC0415

    wait = getattr(args, "wait", None)
    if wait:
        deadline = time.monotonic() + wait
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
    if wait and out["state"] != D.ACTIVE:
        return EXIT_FAILED
    return 0
