"""Fault campaign: does pgc keep serving, and recover, when its parts fail?

Drives a real served model (the digits MLP by default) from client threads in a real agent
process (``bench/_faults/agent.py``: every failed call is re-run on a private copy of the plain
model, and only failures the plain model would not have had count as ``failed``), real
``pgc serve`` processes and the search workers they start, injects one fault per scenario
and checks what must hold. Scenarios (``--only`` takes these names, comma-separated)::

    agent_kill_build    kill -9 the agent mid-build, restart: it serves, nothing stuck in flight
    agent_kill_canary   the same, mid-canary
    daemon_kill_search  kill -9 pgc serve (and its worker) mid-search, restart: 0 lost trials, resumed
    store_deleted       SQLite file deleted while serving: serving goes on, /healthz not "ok"
    store_readonly      store file and dir read-only 10 s: serving goes on, exports resume
    store_locked        another process holds BEGIN EXCLUSIVE 10 s: no stall, exports resume
    postgres_restart    PostgreSQL stopped 20 s (needs --postgres-url and --postgres-dir)
    disk_full           store on an 8 MB tmpfs, filled 10 s (needs mount; skipped otherwise)
    malformed_canary    1% wrong-shape calls during a healthy canary: no rollback, no pgc failure
    deploy_churn        50 deployments under 4 clients: agent RSS after #50 / after #5 <= 1.05
    regex_key           catastrophic-backtracking ``re:`` keys: refused, or matched in bounded time
    concurrent_deploys  16 concurrent POST /deployments: exactly one 202, fifteen 409
    hostile_api         no token -> 401, wrong Host -> 4xx, form -> 4xx, 10 MB -> 413; nothing changes
    tick_72h            CPU of one optimizer tick over 72 h of 10 s windows (target <= 20 ms)

    python bench/faults.py [--json] [--only NAME[,NAME]] [--model mlp|cnn|minilm]
                           [--postgres-url URL --postgres-dir DIR] [--churn 50]

Progress goes to stderr (and the table to stdout without ``--json``); the last line of stdout
is one JSON object: ``scenarios``, ``passed``, ``failed``, ``skipped``, ``failed_requests``,
``stuck_deployments``, ``rss_growth_ratio``, ``tick_cpu_ms_at_72h``, ``cpu``, ``duration_s``.
The exit code is 0 unless the harness itself broke. ``PGC_FAULTS_KEEP=1`` keeps each
scenario's temp dir (logs, store) for a post-mortem.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._faults.harness import cpu_info, kill_all, log  # noqa: E402
from bench._faults.scenarios import SCENARIOS  # noqa: E402


def _table(rows: list[dict]) -> str:
    out = [f"{'scenario':<20} {'result':<7} {'requests':>8} {'failed':>6} {'recov':>5} {'rec_s':>6}  notes"]
    for r in rows:
        verdict = "SKIP" if r.get("skipped") else ("pass" if r["passed"] else "FAIL")
        rec_s = f"{r['recovery_s']:.1f}" if isinstance(r.get("recovery_s"), (int, float)) else "-"
        out.append(f"{r['name']:<20} {verdict:<7} {r['requests']:>8} {r['failed']:>6} "
                   f"{'yes' if r['recovered'] else 'no':>5} {rec_s:>6}  {r['notes']}")
    return "\n".join(out)


def _summary(rows: list[dict], broken: list[str], opts: argparse.Namespace, started: float) -> dict:
    ran = [r for r in rows if not r.get("skipped")]
    churn = next((r for r in rows if r["name"] == "deploy_churn"), {})
    tick = next((r for r in rows if r["name"] == "tick_72h"), {})
    return {
        "scenarios": rows,
        "passed": sum(1 for r in ran if r["passed"]),
        "failed": sum(1 for r in ran if not r["passed"]),
        "skipped": [r["name"] for r in rows if r.get("skipped")],
        "failed_requests": sum(r.get("failed", 0) for r in rows),
        "stuck_deployments": sum(r.get("stuck_deployments", 0) or 0 for r in rows),
        "rss_growth_ratio": churn.get("rss_growth_ratio"),
        "tick_cpu_ms_at_72h": tick.get("tick_cpu_ms_at_72h"),
        "harness_errors": broken,
        "cpu": cpu_info(),
        "model": opts.model,
        "duration_s": round(time.time() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="only the final JSON line on stdout")
    p.add_argument("--only", help="comma-separated scenario names")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "minilm"])
    p.add_argument("--postgres-url", default=None)
    p.add_argument("--postgres-dir", default=None, help="the DIR given to .ci/postgres.sh start")
    p.add_argument("--churn", type=int, default=50, help="deployments of deploy_churn")
    p.add_argument("--churn-budget-s", type=float, default=240.0)
    p.add_argument("--search-wait-s", type=float, default=420.0,
                   help="daemon_kill_search: how long to wait for the first finished trial")
    opts = p.parse_args(argv)
    names = list(SCENARIOS)
    if opts.only:
        names = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            print(f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
            return 2

    started = time.time()
    rows: list[dict] = []
    broken: list[str] = []

    def on_signal(signum, _frame):  # noqa: ANN001
        kill_all()  # then report what ran, so a timeout still leaves a JSON line
        broken.append(f"interrupted by signal {signum}")
        print(json.dumps(_summary(rows, broken, opts, started)), flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    for name in names:
        log(f"{name}: starting")
        t0 = time.time()
        try:
            row = SCENARIOS[name](opts)
        except Exception as exc:  # noqa: BLE001 - the harness broke on this one: say so, go on
            broken.append(name)
            row = {"name": name, "requests": 0, "failed": 0, "recovered": False, "recovery_s": None,
                   "passed": False, "harness_error": True,
                   "notes": f"harness error: {type(exc).__name__}: {exc}"[:600]}
            traceback.print_exc(file=sys.stderr)
        finally:
            kill_all()
        row["duration_s"] = round(time.time() - t0, 1)
        rows.append(row)
        verdict = "SKIP" if row.get("skipped") else ("pass" if row["passed"] else "FAIL")
        log(f"{name}: {verdict} in {row['duration_s']}s: {row['notes']}")
    summary = _summary(rows, broken, opts, started)
    if not opts.json:
        print(_table(rows))
    else:
        print(_table(rows), file=sys.stderr)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
