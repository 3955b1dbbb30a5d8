"""Which layers a search gives a choice of their own, and the live profile it ranks them by.

The first search ranks layers by fp32's time. Once a variant serves, that ranking is stale:
int8 linears may leave attention, layer norms and the glue between kernels carrying the time.
A compiled variant's sampled calls are split over the layers its kernels were generated from
(``profiler._compiled``), so a re-search ranks by where the deployed variant spends its time,
when that profile exists; fp32's otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session
from torch import nn

import store as st
from compiler import SensitivityReport

#: sampled calls of the serving variant its profile needs before a search trusts it
MIN_SAMPLED_CALLS = 8
#: the layers a search can give a precision of its own
QUANTIZABLE = (nn.Linear,)


def by_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per layer: a compiled variant has one per (layer, kernel); their times add."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        had = out.get(r["layer"])
        if had is None:
            out[r["layer"]] = dict(r)
        else:
            for k in ("mean_ms", "total_ms", "share"):
                had[k] = had.get(k, 0.0) + r.get(k, 0.0)
            had["count"] = max(had["count"], r["count"])
    return sorted(out.values(), key=lambda r: r.get("total_ms", 0.0), reverse=True)


def search_profile(
    s: Session, model_id: int, baseline_id: int | None, since: float
) -> tuple[list[dict[str, Any]], str]:
    """(per-layer rows, whose they are): the serving variant's when it is not fp32 and was
    sampled enough, else fp32's."""
    base = st.repo.layer_profile(s, model_id, variant_id=baseline_id, since=since)
    dep = st.repo.active_deployment(s, model_id)
    if dep is None or dep.variant_id is None or dep.variant_id == baseline_id:
        return base, "fp32"
    rows = st.repo.layer_profile(s, model_id, variant_id=dep.variant_id, since=since)
    if not rows or max(r["count"] for r in rows) < MIN_SAMPLED_CALLS:
        return base, "fp32"
    variant = s.get(st.Variant, dep.variant_id)
    return by_layer(rows), f"the serving variant ({variant.label if variant else dep.variant_id})"


def quantizable_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, QUANTIZABLE)]


def time_candidates(
    model: nn.Module, profile: Sequence[dict[str, Any]], *, coverage: float = 0.8
) -> list[str]:
    """The smallest set of quantizable layers covering ``coverage`` of their live time,
    hottest first."""
    candidates = set(quantizable_layers(model))
    rows = [r for r in profile if r["layer"] in candidates]
    rows.sort(key=lambda r: r.get("share", 0.0), reverse=True)
    total = sum(r.get("share", 0.0) for r in rows)
    chosen, acc = [], 0.0
    for r in rows:
        if total and acc >= coverage * total:
            break
        chosen.append(r["layer"])
        acc += r.get("share", 0.0)
    return chosen


def hot_layers(
    model: nn.Module,
    profile: Sequence[dict[str, Any]],
    *,
    coverage: float = 0.8,
    max_hot: int = 6,
    sensitivity: SensitivityReport | None = None,
) -> list[str]:
    """At most ``max_hot`` of the time candidates: the most sensitive ones when a sensitivity
    report is given (they need a choice of their own), else the hottest."""
    candidates = time_candidates(model, profile, coverage=coverage)
    if sensitivity is None:
        return candidates[:max_hot]
    return sorted(candidates, key=lambda n: _worst_fidelity(sensitivity, n))[:max_hot]


def _worst_fidelity(report: SensitivityReport, layer: str) -> float:
    values = [r.fidelity for r in report.rows if r.layer == layer and r.fidelity is not None]
    return min(values) if values else math.inf
