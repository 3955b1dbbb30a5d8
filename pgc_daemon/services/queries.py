"""Read models: what pgc knows about a model, read from the store in one place, so that the
API, the dashboard, ``pgc status``, ``pgc demo`` and the tests all report the same numbers.

Each function takes the caller's session and returns plain JSON-able data shaped as the API's
``*Public`` schema of the same name (``model_summary`` → ``ModelPublic``); the API validates
it against that schema on the way out. The timeline lives in :mod:`.timeline`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

import store as st
from store import RUN_OPEN
from compiler import Recipe
from pgc_daemon import states
from pgc_daemon.policy import load_policy
from pgc_daemon.services.suggest import for_layer
from pgc_daemon.states import D

BASELINE_HASH = Recipe().hash
#: The Optuna trial state of a timed trial (the store keeps Optuna's words for trials).
TRIAL_COMPLETE = "complete"
#: A model whose agent reported within this long is ``online``.
ONLINE_S = 120.0
#: The states that end a deployment's build/warm/verify phase (see :func:`busy_intervals`).
_BUILD_ENDS = frozenset({D.CANARY, D.ACTIVE, D.FAILED, D.ROLLED_BACK, D.CANCELLED})
#: ``services.deployments.Source.SEARCH`` (that module imports this one).
_SEARCH_SOURCE = "search"
#: How many runs and deployments the read models look through to say which deployments were
#: made while a search was still searching.
RECENT = 50


def baseline_variant(s: Session, model_id: int) -> st.Variant | None:
    return next(
        (v for v in st.repo.list_variants(s, model_id) if v.recipe_hash == BASELINE_HASH), None
    )


def busy_intervals(s: Session, model_id: int) -> list[tuple[float, float]]:
    """When pgc itself loaded the machine: search runs, and deployments from building to the
    end of verification (compiles run in the serving process). Live latency measured then
    says more about pgc's work than about the variant, so summaries leave it out."""
    now = time.time()
    out = [(r.started_at, r.finished_at or now) for r in st.repo.list_search_runs(s, model_id, limit=1000)]
    for d in st.repo.list_deployments(s, model_id, limit=1000):
        start = next((t.at for t in d.transitions if t.to_state == D.BUILDING), None)
        if start is None:
            continue
        end = next((t.at for t in d.transitions if t.to_state in _BUILD_ENDS), now)
        out.append((start, end))
    return out


def latency_summary(s: Session, model: st.Model) -> dict[str, Any]:
    """Live latency of the base module and of what serves now (count-weighted over windows).

    The base module's numbers come from every window it served, the active variant's from the
    windows since it became active; both leave out the windows in which pgc was searching or
    building (``quiet``: true), unless no other windows exist. ``speedup`` is base p50 over
    current p50 on live traffic.
    """
    base = baseline_variant(s, model.id)
    active = st.repo.active_deployment(s, model.id)
    busy = busy_intervals(s, model.id)
    out: dict[str, Any] = {"baseline": None, "current": None, "speedup": None, "quiet": True}

    def summary(variant_id: int, since: float = 0.0) -> dict[str, Any] | None:
        quiet = st.repo.request_summary(s, model.id, variant_id=variant_id, since=since, exclude=busy)
        if quiet is not None:
            return quiet
        out["quiet"] = False
        return st.repo.request_summary(s, model.id, variant_id=variant_id, since=since)

    if base is not None:
        out["baseline"] = summary(base.id)
    if active is not None and active.variant_id is not None:
        since = next(
            (t.at for t in reversed(active.transitions) if t.to_state == D.ACTIVE), active.created_at
        )
        out["current"] = summary(active.variant_id, since)
    b, c = out["baseline"], out["current"]
    if b and c and c["p50_ms"] > 0:
        out["speedup"] = b["p50_ms"] / c["p50_ms"]
    return out


def while_searching(
    deployments: Sequence[st.Deployment], runs: Sequence[st.SearchRun]
) -> dict[int, int]:
    """Deployment id -> the search run that proposed it while that run was still searching
    (a deployment of source ``search`` created after the run started and before it finished;
    a run's final choice is proposed after its end is recorded)."""
    spans = []
    for r in runs:
        if r.finished_at is not None:
            spans.append((r.started_at, r.finished_at, r.id))
        elif r.state in RUN_OPEN:
            spans.append((r.started_at, math.inf, r.id))
    out: dict[int, int] = {}
    for d in deployments:
        if d.source != _SEARCH_SOURCE:
            continue
        run_id = next((rid for start, end, rid in spans if start <= d.created_at < end), None)
        if run_id is not None:
            out[d.id] = run_id
    return out


def active_summary(
    s: Session, model: st.Model, runs: Sequence[st.SearchRun] | None = None
) -> dict[str, Any] | None:
    active = st.repo.active_deployment(s, model.id)
    if active is None or active.variant_id is None:
        return None
    variant = st.repo.get_variant(s, active.variant_id)
    if runs is None:
        runs = st.repo.list_search_runs(s, model.id, limit=RECENT)
    return {
        "deployment_id": active.id,
        "variant_id": variant.id,
        "label": variant.label,
        "recipe": variant.recipe,
        "recipe_hash": variant.recipe_hash,
        "source": active.source,
        "since": active.updated_at,
        "expected_speedup": active.expected_speedup,
        "expected_fidelity": active.expected_fidelity,
        "live_speedup": active.live_speedup,
        "live_fidelity": active.live_fidelity,
        "is_baseline": variant.recipe_hash == BASELINE_HASH,
        "while_searching": active.id in while_searching([active], runs),
    }


def search_summary(
    run: st.SearchRun | None, deployments: Sequence[st.Deployment] = ()
) -> dict[str, Any] | None:
    """A run's progress (``SearchPublic``); ``deployments``: the model's recent ones, of which
    those the run proposed while it was still searching are listed."""
    if run is None:
        return None
    made = while_searching(deployments, [run])
    return {
        "run_id": run.id,
        "state": run.state,
        "trigger": run.trigger,
        "trials_done": run.trials_done,
        "trials_budget": run.trials_budget,
        "best_speedup": run.best_speedup,
        "best_fidelity": run.best_fidelity,
        "message": run.message,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "study_name": run.study_name,
        "deployed_while_searching": sorted(made),
    }


def replicas(s: Session, model: st.Model) -> list[dict[str, Any]]:
    """The model's serving processes, newest first: what each serves and how fast."""
    now = time.time()
    labels = {v.id: v.label for v in st.repo.list_variants(s, model.id)}
    return [
        {
            "name": r.name,
            "host": r.host,
            "pid": r.pid,
            "alive": r.stopped_at is None and now - r.seen_at < states.STALE_AFTER_S,
            "state": r.state,
            "serving": labels.get(r.variant_id) if r.variant_id is not None else None,
            "variant_id": r.variant_id,
            "deployment_id": r.deployment_id,
            "calls": r.calls,
            "live_ms": r.live_ms,
            "compiles": r.compiles,
            "loads": r.loads,
            "message": r.message,
            "started_at": r.started_at,
            "seen_at": r.seen_at,
        }
        for r in st.repo.list_replicas(s, model.id, limit=50)
    ]


def replica_counts(s: Session, model: st.Model, active_variant_id: int | None) -> dict[str, int]:
    live = st.repo.live_replicas(s, model.id, states.STALE_AFTER_S)
    return {
        "live": len(live),
        "on_active": sum(1 for r in live if active_variant_id is not None and r.variant_id == active_variant_id),
        "compiles": sum(r.compiles for r in live),
    }


def model_summary(s: Session, model: st.Model) -> dict[str, Any]:
    policy_row = st.repo.get_policy(s, model.id)
    snapshot = load_policy(s, model.id)
    runs = st.repo.list_search_runs(s, model.id, limit=RECENT)
    recent = st.repo.list_deployments(s, model.id, limit=RECENT) if runs else []
    return {
        "name": model.name,
        "spec": model.spec,
        "metric": model.metric,
        "hardware": model.hardware,
        "graph_hash": model.graph_hash,
        "created_at": model.created_at,
        "last_seen_at": model.last_seen_at,
        "online": time.time() - model.last_seen_at < ONLINE_S,
        # None, not the defaults, while no policy is stored (what the API has always said)
        "policy": snapshot.policy.model_dump() if policy_row else None,
        "policy_version": snapshot.version if policy_row else None,
        "active": active_summary(s, model, runs),
        "latency": latency_summary(s, model),
        "search": search_summary(runs[0] if runs else None, recent),
        "replicas": replica_counts(s, model, _active_variant_id(s, model.id)),
    }


def _active_variant_id(s: Session, model_id: int) -> int | None:
    dep = st.repo.active_deployment(s, model_id)
    return dep.variant_id if dep is not None else None


def profile_summary(
    s: Session, model: st.Model, *, variant_id: int | None = None, since: float = 0.0
) -> dict[str, Any]:
    """Per-layer breakdown (hottest first) with suggestions, and the shapes traffic had."""
    base = baseline_variant(s, model.id)
    vid = variant_id if variant_id is not None else (base.id if base else None)
    rows = st.repo.layer_profile(s, model.id, variant_id=vid, since=since)
    counters = st.repo.layer_counters(s, model.id, since=since)
    for r in rows:
        r["counters"] = counters.get(r["layer"])
        r["suggestion"] = for_layer(r.get("op_type", ""), r.get("share", 0.0))
    return {
        "model": model.name,
        "variant_id": vid,
        "layers": rows,
        "shapes": st.repo.shape_histogram(s, model.id, since=since),
        "requests": st.repo.request_summary(s, model.id, since=since),
        "active": active_profile(s, model, vid, since) if variant_id is None else None,
    }


def active_profile(
    s: Session, model: st.Model, shown: int | None, since: float
) -> dict[str, Any] | None:
    """The serving variant's per-layer rows, when it is not the one shown (a compiled variant:
    its kernels' time split over the layers they fuse), beside its live latency over the
    windows those rows were sampled in (``live_ms``; ``live_ms_all``: every window). Seen in
    the demo: rows from 4 calls sampled while the search worker held a core (live 13.4 ms
    then) set against the whole run's live mean (10.6 ms) read 1.36x, 1.07x against their
    own windows."""
    dep = st.repo.active_deployment(s, model.id)
    if dep is None or dep.variant_id is None or dep.variant_id == shown:
        return None
    rows = st.repo.layer_profile(s, model.id, variant_id=dep.variant_id, since=since)
    if not rows:
        return None
    live = st.repo.request_summary(s, model.id, variant_id=dep.variant_id, since=since)
    sampled = st.repo.request_summary(s, model.id, variant_id=dep.variant_id, since=since,
                                      sampled_only=True)
    variant = s.get(st.Variant, dep.variant_id)
    return {
        "variant_id": dep.variant_id,
        "label": variant.label if variant is not None else None,
        "layers": [{**r, "counters": None, "suggestion": None} for r in rows],
        "layer_sum_ms": sum(r["mean_ms"] for r in rows),
        "live_ms": sampled["mean_ms"] if sampled else None,
        "live_ms_all": live["mean_ms"] if live else None,
        "sampled_calls": sampled["sampled"] if sampled else 0,
    }


# --------------------------------------------------------------------------- trials, front


def trial_public(t: st.Trial, variant: st.Variant | None) -> dict[str, Any]:
    """A trial row as the API shows it (``TrialPublic``): the one mapping of a trial."""
    return {
        "id": t.id,
        "run_id": t.run_id,
        "number": t.number,
        "state": t.state,
        "variant_id": t.variant_id,
        "label": variant.label if variant else None,
        "recipe": variant.recipe if variant else None,
        "latency_ms": t.latency_ms,
        "baseline_ms": t.baseline_ms,
        "speedup": t.speedup,
        "fidelity": t.fidelity,
        "accuracy_drop": t.accuracy_drop,
        "feasible": t.feasible,
        "params": t.params,
        "message": t.message,
        "duration_s": t.duration_s,
        "created_at": t.created_at,
    }


def trials(s: Session, model: st.Model, *, run_id: int | None = None) -> list[dict[str, Any]]:
    variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
    return [
        trial_public(t, variants.get(t.variant_id) if t.variant_id else None)
        for t in st.repo.list_trials(s, model.id, run_id=run_id)
    ]


def _dominated(p: dict[str, Any], points: list[dict[str, Any]]) -> bool:
    return any(
        o is not p
        and o["speedup"] >= p["speedup"]
        and o["accuracy_drop"] <= p["accuracy_drop"]
        and (o["speedup"] > p["speedup"] or o["accuracy_drop"] < p["accuracy_drop"])
        for o in points
    )


def front_summary(s: Session, model: st.Model) -> dict[str, Any]:
    """One point per variant (its latest timed trial), with the Pareto front and the
    deployed point marked, fastest first (``FrontPublic``)."""
    policy = load_policy(s, model.id).policy
    variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
    active = st.repo.active_deployment(s, model.id)
    runs = st.repo.list_search_runs(s, model.id, limit=1)
    latest: dict[int, st.Trial] = {}
    for t in st.repo.list_trials(s, model.id):
        if t.state == TRIAL_COMPLETE and t.variant_id is not None:
            latest[t.variant_id] = t
    points = [trial_public(t, variants.get(vid)) for vid, t in latest.items()]
    for p in points:
        p["pareto"] = not _dominated(p, points)
        p["deployed"] = active is not None and active.variant_id == p["variant_id"]
    points.sort(key=lambda p: -(p["speedup"] or 0))
    return {
        "model": model.name,
        "metric": model.metric,
        "max_accuracy_drop": policy.max_accuracy_drop,
        "latency_target_ms": policy.latency_target_ms,
        "latency_percentile": policy.latency_percentile,
        "min_speedup": policy.min_speedup,
        "points": points,
        "chosen_variant_id": runs[0].chosen_variant_id if runs else None,
        "feasible": sum(p["feasible"] for p in points),
        "message": runs[0].message if runs else None,
    }
