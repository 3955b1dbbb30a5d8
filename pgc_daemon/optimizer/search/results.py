"""What a search produces, apart from how it got there: one :class:`TrialRecord` per evaluated
recipe, the :class:`SearchResult` of a run, and the choice among records: feasibility under a
policy, the Pareto front (latency ratio, accuracy drop) and the policy's pick. Plain data and
pure functions (no Optuna, no torch), shared by the live worker, ``pgc optimize`` and the
search benchmark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pgc_daemon.policy import Policy

__all__ = ["SearchResult", "TrialRecord", "feasible", "on_one_reference", "pareto_front", "pick"]


@dataclass
class TrialRecord:
    number: int
    state: str  # complete | pruned | failed
    params: dict[str, Any]
    recipe: dict[str, Any]
    recipe_hash: str
    label: str
    ratio: float | None = None
    speedup: float | None = None
    latency_ms: float | None = None
    baseline_ms: float | None = None
    fidelity: float | None = None
    drop: float | None = None
    feasible: bool = False
    violation: float = 1e9
    message: str = ""
    duration_s: float = 0.0
    duplicate: bool = False
    timing: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per step: build, warm (compiles), quick and full accuracy, timing."""
    quick_drop: float | None = None
    """The drop on the quick accuracy check (a few inputs), before timing."""
    quick_steps: list[tuple[int, float, float, float]] = field(default_factory=list)
    """The quick check's steps: (inputs, drop, lower bound, upper bound) each
    (:class:`~pgc_daemon.optimizer.search.evaluate.QuickStep`)."""
    policy_version: int | None = None
    """The version of the policy the trial was evaluated under (None: offline, no store)."""
    origin: str = ""
    """Why the search tried it: ``baseline`` (queued before the sampler: a baseline or an
    earlier study's choice), ``neighbor`` (one choice from the best so far), ``sampler``."""
    artifact: str | None = None
    """Digest of the compiled artifact the build saved in the shared artifact folder (an
    AOTInductor package or an ONNX model; None: nothing saved). Recorded on the variant, so
    a serving process loads it instead of compiling."""

    @property
    def origin_note(self) -> str:
        """What a progress line says of why the search tried it (after the trial count)."""
        return {"baseline": " (baseline)", "neighbor": " (next to the best so far)"}.get(
            self.origin, "")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRecord:
        """A record as :meth:`to_dict` wrote it, by this or another version of pgc (fields
        this version does not know are left out, missing ones take their defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchResult:
    records: list[TrialRecord]
    front: list[TrialRecord]
    chosen: TrialRecord | None
    closest: list[TrialRecord]
    baseline_ms: float | None
    metric: str
    message: str
    study_name: str

    @property
    def feasible(self) -> bool:
        return self.chosen is not None


def feasible(policy: Policy, rec: TrialRecord) -> bool:
    """Whether a record meets every constraint of the policy (accuracy drop, latency target)."""
    return all(v <= 0.0 for v in policy.violations(rec.drop, rec.latency_ms).values())


def on_one_reference(records: Sequence[TrialRecord], baseline_ms: float, policy: Policy) -> None:
    """Restate complete records' latencies as their ratio times one fp32 latency, in place, and
    judge the latency target on them. Offline, each trial times fp32 beside its candidate and
    the machine's speed moves between trials: on a digits GRU fp32 took 0.55-0.90 ms from one
    trial to the next, so a trial's own milliseconds contradicted the ratios (0.64 ms at 1.42x
    beside 0.39 ms at 1.40x). The live search does the same with fp32's live latency."""
    for r in records:
        if r.state == "complete" and r.ratio:
            r.latency_ms = r.ratio * baseline_ms
            r.feasible = feasible(policy, r)
            r.violation = policy.normalized_violation(r.drop, r.latency_ms)


def pareto_front(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Trials no other trial beats on both latency ratio and accuracy drop."""
    front = []
    for r in records:
        dominated = any(
            o is not r
            and o.ratio <= r.ratio
            and (o.drop or 0.0) <= (r.drop or 0.0)
            and (o.ratio < r.ratio or (o.drop or 0.0) < (r.drop or 0.0))
            for o in records
        )
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r.ratio)


#: Two trials within this of each other's latency are a tie on speed...
SPEED_TIE = 1.02
#: ...broken for the more accurate only where its drop is lower by this share of the budget
#: (a demo's search chose a variant 2% slower for a cosine 0.0001 higher, which the
#: deployment then refused as no faster than what served)
ACCURACY_MARGIN = 0.1


def pick(records: Sequence[TrialRecord], policy: Policy) -> TrialRecord | None:
    """The policy's point of the front: the fastest feasible variant (a tie on speed goes to
    a clearly more accurate one), or the most accurate one under the latency target."""
    ok = [r for r in records if r.state == "complete" and r.feasible]
    if not ok:
        return None
    if policy.objective == "most_accurate":
        return min(ok, key=lambda r: ((r.drop or 0.0), r.ratio))
    fastest = min(ok, key=lambda r: r.ratio)
    margin = ACCURACY_MARGIN * policy.max_accuracy_drop
    better = [r for r in ok if r.ratio <= fastest.ratio * SPEED_TIE
              and (r.drop or 0.0) < (fastest.drop or 0.0) - margin]
    return min(better, key=lambda r: ((r.drop or 0.0), r.ratio)) if better else fastest
