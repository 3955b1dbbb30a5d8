"""When a model needs a search: a pure function of what the store says about it.

Nothing here reads the store, the clock or a process table: :class:`Situation` holds plain
values (the daemon fills it from the store each tick) and :func:`decide` returns a
:class:`Wait`, :class:`StartSearch` or :class:`Resume`. The rules, in the order they apply:

1. a search is open for the model: wait (the daemon checks its worker is alive);
2. too few live inputs captured, or calls seen over the last ``PROFILE_WINDOW_S`` (the
   profile a search builds on): wait;
3. the study for the current study terms and traffic shape has not finished:
   - its runs failed ``max_failed_runs`` times: give up (wait);
   - it has runs (a worker died, a budget was cut short): resume it;
   - the model has no runs at all: first search;
   - the newest run had another policy version: the study terms changed, new study;
   - otherwise the traffic shape drifted: a new study, at most once per
     ``reoptimize_interval_s``;
4. the study finished with a smaller trial budget than the policy's now: resume it (a raised
   ``max_trials`` continues the same study with every finished trial kept);
5. live latency of the active variant regressed: a new study, at most once per deployment and
   once per ``reoptimize_interval_s``.

A study is named by the model, its fingerprint, the hardware, the policy's *study terms* and
the traffic shape (:func:`study_name`): budgets and deploy settings do not name a study, so
changing them continues the one that exists.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from store import RUN_FINISHED, RUN_OPEN, RunState
from pgc_daemon.policy import Policy, PolicySnapshot, StudyTerms

__all__ = [
    "PROFILE_WINDOW_S",
    "UP_TO_DATE",
    "Decision",
    "Regression",
    "Resume",
    "RunInfo",
    "Situation",
    "StartSearch",
    "Thresholds",
    "Wait",
    "decide",
    "shape_signature",
    "study_name",
]

#: The live history a search builds on (its per-layer profile), and so the calls that count
#: toward ``min_profile_calls``.
PROFILE_WINDOW_S = 3600.0


def shape_signature(histogram: dict[str, int], *, min_share: float = 0.2, most: int = 3) -> str:
    """The shape buckets that carry live traffic (each at least ``min_share`` of calls, at most
    ``most``), sorted: what the measurements of a study were taken at."""
    total = sum(histogram.values())
    if not total:
        return ""
    top = sorted(histogram.items(), key=lambda kv: -kv[1])[:most]
    return "|".join(sorted(k for k, n in top if n / total >= min_share))


def study_name(
    model: str, graph_hash: str, hardware: str, terms: StudyTerms | Policy, shapes: str = ""
) -> str:
    """One study per (model, base graph, hardware, study terms, live traffic shape). A whole
    :class:`Policy` may be passed: only its study terms count."""
    if isinstance(terms, Policy):
        terms = terms.study
    fields = asdict(terms)
    if fields["backends"] is None:  # the names studies had before backends could be chosen
        del fields["backends"]
    key_src = json.dumps(fields, sort_keys=True)
    key = hashlib.sha256(f"{key_src}|{shapes}".encode()).hexdigest()[:10]
    return f"pgc:{model}:{graph_hash[:12]}:{hardware}:{key}"


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class RunInfo:
    """What the schedule needs of one search run."""

    study_name: str
    state: RunState
    policy_version: int
    trials_budget: int
    started_at: float


@dataclass(frozen=True)
class Regression:
    """The active deployment's live latency got worse than right after it became active."""

    deployment_id: int
    message: str


@dataclass(frozen=True)
class Thresholds:
    """The settings the schedule reads (``Settings`` fields of the same names)."""

    min_reservoir: int = 8
    min_profile_calls: int = 200
    reoptimize_interval_s: float = 3600.0
    max_failed_runs: int = 3


@dataclass(frozen=True)
class Situation:
    """One model, as the daemon sees it on one tick. ``runs``: newest first."""

    model: str
    graph_hash: str
    hardware: str
    policy: PolicySnapshot
    runs: Sequence[RunInfo]
    signature: str
    reservoir_size: int
    calls_seen: int
    now: float
    regression: Regression | None = None
    thresholds: Thresholds = Thresholds()

    @property
    def study_name(self) -> str:
        return study_name(
            self.model, self.graph_hash, self.hardware, self.policy.policy.study, self.signature
        )


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Wait:
    """No search now."""

    reason: str


@dataclass(frozen=True)
class StartSearch:
    """A new study (``study_name`` has no runs yet, or is a regression study)."""

    trigger: str
    study_name: str


@dataclass(frozen=True)
class Resume:
    """Continue a study that has runs: every finished trial of it counts toward the budget."""

    trigger: str
    study_name: str


Decision = Wait | StartSearch | Resume
#: The only decision a latency regression can change (rule 5 comes last): the daemon looks for
#: a regression only when, without one, this is the answer.
UP_TO_DATE = Wait("up to date")


def decide(now: Situation) -> Decision:
    """What to do for one model on this tick (see the module docstring for the rules)."""
    runs, limits = list(now.runs), now.thresholds
    if any(r.state in RUN_OPEN for r in runs):
        return Wait("a search is running")
    if now.reservoir_size < limits.min_reservoir:
        return Wait(f"{now.reservoir_size}/{limits.min_reservoir} live inputs captured")
    if now.calls_seen < limits.min_profile_calls:
        return Wait(f"{now.calls_seen}/{limits.min_profile_calls} calls profiled")
    name = now.study_name
    same = [r for r in runs if r.study_name == name]
    finished = [r for r in same if r.state in RUN_FINISHED]
    newest_start = max((r.started_at for r in runs), default=None)
    recent = newest_start is not None and now.now - newest_start < limits.reoptimize_interval_s
    max_trials = now.policy.policy.max_trials

    if not finished:
        failed = sum(r.state == RunState.FAILED for r in same)
        if failed >= limits.max_failed_runs:
            return Wait(f"gave up on {name}: {failed} runs failed")
        if same:
            return Resume("resuming the study", name)
        if not runs:
            return StartSearch("first search for this model", name)
        if runs[0].policy_version != now.policy.version:
            return StartSearch(f"policy changed (version {now.policy.version})", name)
        if recent:
            return Wait("traffic shape drifted; waiting for the re-search interval")
        return StartSearch(f"traffic shape drifted to {now.signature or 'new shapes'}", name)

    # The study finished. A raised trial budget continues it (failed attempts at that count).
    budget = max(r.trials_budget for r in finished)
    if budget < max_trials:
        latest_done = max(r.started_at for r in finished)
        failed = sum(r.state == RunState.FAILED and r.started_at > latest_done for r in same)
        if failed >= limits.max_failed_runs:
            return Wait(f"gave up raising the budget of {name}: {failed} runs failed")
        return Resume(f"trial budget raised to {max_trials} (was {budget})", name)

    if now.regression is not None:
        regressed = f"{name}:regressed-{now.regression.deployment_id}"
        if any(r.study_name == regressed for r in runs):
            return Wait("a search already answered this regression")
        if recent:
            return Wait("latency regressed; waiting for the re-search interval")
        return StartSearch(now.regression.message, regressed)
    return UP_TO_DATE
