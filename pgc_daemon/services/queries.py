"""What pgc knows about a model, read from the store in one place, so that the API, the
dashboard, ``pgc demo`` and the tests all report the same numbers."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

import store as st
from compiler import Recipe
from pgc_daemon.policy import Policy

BASELINE_HASH = Recipe().hash


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
        start = next((t.at for t in d.transitions if t.to_state == "building"), None)
        if start is None:
            continue
        end = next(
            (t.at for t in d.transitions if t.to_state in ("canary", "active", "failed", "rolled_back")),
            now,
        )
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
            (t.at for t in reversed(active.transitions) if t.to_state == "active"), active.created_at
        )
        out["current"] = summary(active.variant_id, since)
    b, c = out["baseline"], out["current"]
    if b and c and c["p50_ms"] > 0:
        out["speedup"] = b["p50_ms"] / c["p50_ms"]
    return out


def active_summary(s: Session, model: st.Model) -> dict[str, Any] | None:
    active = st.repo.active_deployment(s, model.id)
    if active is None or active.variant_id is None:
        return None
    variant = st.repo.get_variant(s, active.variant_id)
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
    }


def search_summary(run: st.SearchRun | None) -> dict[str, Any] | None:
    if run is None:
        return None
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
    }


def model_summary(s: Session, model: st.Model) -> dict[str, Any]:
    policy_row = st.repo.get_policy(s, model.id)
    runs = st.repo.list_search_runs(s, model.id, limit=1)
    return {
        "name": model.name,
        "spec": model.spec,
        "metric": model.metric,
        "hardware": model.hardware,
        "graph_hash": model.graph_hash,
        "created_at": model.created_at,
        "last_seen_at": model.last_seen_at,
        "online": time.time() - model.last_seen_at < 120,
        "policy": Policy.parse(policy_row.settings).model_dump() if policy_row else None,
        "policy_version": policy_row.version if policy_row else None,
        "active": active_summary(s, model),
        "latency": latency_summary(s, model),
        "search": search_summary(runs[0] if runs else None),
    }


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
        r["suggestion"] = suggestion(r)
    return {
        "model": model.name,
        "variant_id": vid,
        "layers": rows,
        "shapes": st.repo.shape_histogram(s, model.id, since=since),
        "requests": st.repo.request_summary(s, model.id, since=since),
    }


def suggestion(row: dict[str, Any]) -> str | None:
    op = row.get("op_type", "")
    share = row.get("share", 0.0)
    if share >= 0.15:
        return "hot: a quantization or fusion candidate"
    if op in ("Linear", "Conv1d", "Conv2d", "Conv3d") and share >= 0.02:
        return "int8 candidate"
    return None


# --------------------------------------------------------------------------- read-only views
# (appended for the dashboard and /metrics; the functions above are unchanged)

#: Marker kinds of :func:`timeline_summary`, by the state a transition reached.
_MARKERS = {"active": "deployed", "rolled_back": "rolled_back", "failed": "failed"}


def timeline_summary(
    s: Session, model: st.Model, *, since: float = 0.0, until: float | None = None, points: int = 300
) -> dict[str, Any]:
    """Live request latency over time, one series per variant, with deployment markers.

    Windows are merged into at most ``points`` steps per variant; a step's percentiles are
    the count-weighted mean of its windows' percentiles (as :func:`store.repo.request_summary`
    does). Markers: a variant became active (``deployed``, or ``rollback`` when a rollback
    did it), a variant was reverted (``rolled_back``), a deployment ``failed``.
    """
    windows = list(st.repo.request_windows(s, model.id, since=since))
    # windows a little ahead of this host's clock (another host's agent) still show
    until = max(time.time() if until is None else until, max((w.window_end for w in windows), default=0.0))
    start = max(since, min((w.window_start for w in windows), default=since))
    step = max((until - start) / max(points, 1), 1e-3)
    variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
    groups: dict[tuple[int | None, int], list[st.RequestStat]] = {}
    for w in windows:
        idx = min(int((w.window_end - start) // step), points - 1)
        groups.setdefault((w.variant_id, idx), []).append(w)
    series: dict[int | None, dict[str, Any]] = {}
    for (vid, _idx), ws in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        n = sum(w.count for w in ws)
        if n == 0:
            continue
        v = variants.get(vid) if vid is not None else None
        entry = series.setdefault(
            vid,
            {
                "variant_id": vid,
                "label": v.label if v else "before registration",
                "is_baseline": v is not None and v.recipe_hash == BASELINE_HASH,
                "points": [],
            },
        )
        entry["points"].append(
            {
                "t": max(w.window_end for w in ws),
                "count": n,
                "errors": sum(w.errors for w in ws),
                **{
                    k: sum(getattr(w, k) * w.count for w in ws) / n
                    for k in ("mean_ms", "p50_ms", "p95_ms", "p99_ms")
                },
            }
        )
    markers = []
    for d in st.repo.list_deployments(s, model.id, limit=1000):
        v = variants.get(d.variant_id) if d.variant_id is not None else None
        for t in d.transitions:
            kind = _MARKERS.get(t.to_state)
            if kind is None or not since <= t.at <= until:
                continue
            if kind == "deployed" and d.source == "rollback":
                kind = "rollback"
            markers.append(
                {
                    "at": t.at,
                    "kind": kind,
                    "deployment_id": d.id,
                    "variant_id": d.variant_id,
                    "label": v.label if v else None,
                    "source": d.source,
                    "reason": t.reason,
                }
            )
    markers.sort(key=lambda m: m["at"])
    busy = [
        {"start": max(a, start), "end": min(b, until)}
        for a, b in busy_intervals(s, model.id)
        if b >= start and a <= until
    ]
    row = st.repo.get_policy(s, model.id)
    policy = Policy.parse(row.settings if row else {})
    return {
        "model": model.name,
        "since": start,
        "until": until,
        "step_s": step,
        "latency_target_ms": policy.latency_target_ms,
        "latency_percentile": policy.latency_percentile,
        "series": sorted(series.values(), key=lambda e: (not e["is_baseline"], e["variant_id"] or 0)),
        "markers": markers,
        "busy": sorted(busy, key=lambda b: b["start"]),
    }


def deployment_outcomes(deployment: st.Deployment) -> set[str]:
    """What a deployment came to, for counting: ``deployed`` once it was ever active, and
    ``rolled_back`` or ``failed`` when it ended so. These only ever get added to, so counts
    of them are proper Prometheus counters."""
    out = set()
    for t in deployment.transitions:
        if t.to_state == "active":
            out.add("deployed")
        elif t.to_state in ("rolled_back", "failed"):
            out.add(t.to_state)
    return out
