"""``pgc optimize``: the same search as the live loop, for any model given by a MODEL_SPEC,
on its example inputs, without a store or a running server."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiler import fingerprint, judgments, probe
from pgc_daemon.modelspec import load_spec
from pgc_daemon.policy import Policy
from pgc_daemon.optimizer.search.prepare import make_search, measure_sensitivity, offline_profile
from pgc_daemon.optimizer.search.study import SearchResult, TrialRecord, study_name

METRIC_REASONS = {
    "cosine": "mean cosine of output vectors (L2-normalized rows look like embeddings)",
    "top1": "top-1 agreement with fp32 (2-D outputs look like logits)",
    "sqnr": "1 - noise/signal power against fp32 (SQNR)",
    "accuracy": "the spec's accuracy function on its labels",
    "custom": "the spec's accuracy function against fp32 outputs",
}


@dataclass
class OfflineResult:
    spec: str
    result: SearchResult
    profile: list[dict[str, Any]]
    hot_layers: list[str]
    space_size: int
    pruned: list[tuple[str, str, str]]
    elapsed_s: float
    metric_source: str

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        chosen = r.chosen
        seconds = [sum(t.phases.values()) for t in r.records if not t.duplicate]
        return {
            "spec": self.spec,
            "metric": r.metric,
            "metric_reason": self.metric_source,
            "baseline_ms": r.baseline_ms,
            "best_ms": chosen.latency_ms if chosen else None,
            "speedup": chosen.speedup if chosen else None,
            "accuracy_drop": chosen.drop if chosen else None,
            "fidelity": chosen.fidelity if chosen else None,
            "recipe": chosen.recipe if chosen else None,
            "label": chosen.label if chosen else None,
            "feasible": r.feasible,
            "message": r.message,
            "trials": len(r.records),
            # wall seconds each evaluated trial took (build, checks, timing), in trial order
            "trial_s": [round(s, 1) for s in seconds],
            "trial_s_median": round(statistics.median(seconds), 1) if seconds else None,
            "front": [_point(t) for t in r.front],
            "closest": [_point(t) for t in r.closest],
            # trials whose recipe could not be built or run here, and why
            "failed": [{"label": t.label, "message": t.message} for t in r.records
                       if t.state == "failed" and not t.duplicate],
            "hot_layers": self.hot_layers,
            "space_size": self.space_size,
            "pruned": [list(p) for p in self.pruned],
            "elapsed_s": round(self.elapsed_s, 1),
        }


def _point(t: TrialRecord) -> dict[str, Any]:
    return {
        "label": t.label,
        "speedup": t.speedup,
        "latency_ms": t.latency_ms,
        "accuracy_drop": t.drop,
        "fidelity": t.fidelity,
        "feasible": t.feasible,
        "recipe": t.recipe,
    }


def optimize(
    spec_path: str,
    policy: Policy,
    *,
    storage: str | None = None,
    seed: int = 0,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
    with_sensitivity: bool = True,
) -> OfflineResult:
    started = time.monotonic()
    spec = load_spec(spec_path)
    profile = offline_profile(spec.model, spec.examples)
    report = (
        measure_sensitivity(spec.model, spec.examples, profile, metric=spec.metric)
        if with_sensitivity
        else None
    )
    name = study_name(spec_path, fingerprint(spec.model), probe().key(), policy)
    search = make_search(
        base=spec.model,
        inputs=spec.examples,
        profile=profile,
        policy=policy,
        name=name,
        storage=storage,
        metric=spec.metric,
        accuracy=spec.accuracy,
        labels=spec.labels,
        on_trial=on_trial,
        sensitivity=report,
        seed=seed,
    )
    metric = search.evaluator.metric
    source = METRIC_REASONS.get(metric, metric) + (" (set by the spec)" if spec.metric else "")
    if rows := judgments(metric, search.evaluator.references):
        # what a budget finer than one row means is easy to miss: say it where it shows
        source += f", over {rows} rows: one row changed is a drop of {1 / rows:.4f}"
    result = search.run(policy.max_trials, timeout_s=policy.time_budget_s)
    return OfflineResult(
        spec=spec_path,
        result=result,
        profile=profile,
        hot_layers=list(search.space.hot_layers),
        space_size=search.space.size,
        pruned=list(search.space.pruned),
        elapsed_s=time.monotonic() - started,
        metric_source=source,
    )
