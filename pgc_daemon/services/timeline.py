"""Live latency over time per variant, with deployment markers, and what each deployment
came to (for the dashboard, ``GET /timeline`` and ``/metrics``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from sqlalchemy.orm import Session

import store as st
from pgc_daemon.policy import load_policy
from pgc_daemon.services.deployments import Source
from pgc_daemon.services.queries import BASELINE_HASH, busy_intervals, while_searching
from pgc_daemon.states import D

Outcome = Literal["deployed", "rolled_back", "failed"]
#: Marker kinds of :func:`timeline_summary`, by the state a transition reached.
_MARKERS: dict[D, Outcome] = {D.ACTIVE: "deployed", D.ROLLED_BACK: "rolled_back", D.FAILED: "failed"}
_STEP_STATS = ("mean_ms", "p50_ms", "p95_ms", "p99_ms")


def _series(
    windows: list[st.RequestStat], variants: dict[int, st.Variant], start: float, step: float, points: int
) -> list[dict[str, Any]]:
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
                **{k: sum(getattr(w, k) * w.count for w in ws) / n for k in _STEP_STATS},
            }
        )
    return sorted(series.values(), key=lambda e: (not e["is_baseline"], e["variant_id"] or 0))


def _markers(
    s: Session, model_id: int, variants: dict[int, st.Variant], since: float, until: float
) -> list[dict[str, Any]]:
    markers = []
    deployments = st.repo.list_deployments(s, model_id, limit=1000)
    searching = while_searching(deployments, st.repo.list_search_runs(s, model_id, limit=1000))
    for d in deployments:
        v = variants.get(d.variant_id) if d.variant_id is not None else None
        for t in d.transitions:
            kind: str | None = _MARKERS.get(t.to_state)  # type: ignore[call-overload]
            if kind is None or not since <= t.at <= until:
                continue
            if kind == "deployed" and d.source == Source.ROLLBACK:
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
                    "while_searching": d.id in searching,
                }
            )
    return sorted(markers, key=lambda m: m["at"])


def timeline_summary(
    s: Session, model: st.Model, *, since: float = 0.0, until: float | None = None, points: int = 300
) -> dict[str, Any]:
    """Live request latency over time, one series per variant, with deployment markers
    (``TimelinePublic``).

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
    busy = [
        {"start": max(a, start), "end": min(b, until)}
        for a, b in busy_intervals(s, model.id)
        if b >= start and a <= until
    ]
    policy = load_policy(s, model.id).policy
    return {
        "model": model.name,
        "since": start,
        "until": until,
        "step_s": step,
        "latency_target_ms": policy.latency_target_ms,
        "latency_percentile": policy.latency_percentile,
        "series": _series(windows, variants, start, step, points),
        "markers": _markers(s, model.id, variants, since, until),
        "busy": sorted(busy, key=lambda b: b["start"]),
    }


def deployment_outcomes(deployment: st.Deployment) -> set[Outcome]:
    """What a deployment came to, for counting: ``deployed`` once it was ever active, and
    ``rolled_back`` or ``failed`` when it ended so. These only ever get added to, so counts
    of them are proper Prometheus counters."""
    out: set[Outcome] = set()
    for t in deployment.transitions:
        if t.to_state == D.ACTIVE:
            out.add("deployed")
        elif t.to_state == D.ROLLED_BACK:
            out.add("rolled_back")
        elif t.to_state == D.FAILED:
            out.add("failed")
    return out
