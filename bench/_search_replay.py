"""Replaying search strategies over a measured table (see ``bench/search.py``).

A *table* holds every recipe of a space measured once for real (ratio to fp32 eager, accuracy
drop, the quick check's steps, the seconds each step took). A *scenario* is a policy over a
table (an accuracy budget, an objective, a latency target). A *strategy* is what a search
brings to it; the four here separate pgc's prior from its sampler:

- ``pgc``: the sensitivity-pruned space, the baselines first, the quick accuracy check and
  no more samples on backends the trials rank out (``ranked_out``), then TPE with every other
  trial a neighbor of the best so far (``neighbors``);
- ``pgc_no_baselines``: the same without the baselines (what pgc's sampler finds on its own);
- ``pgc_tpe_only``: pgc without the neighbor moves (TPE alone after the baselines);
- ``random_baselines``: the same help as pgc (pruned space, baselines, quick check, ranked
  backends), random sampling (what pgc's sampler adds over chance);
- ``random``: Optuna's random search over the whole space, nothing else.

Every strategy is charged what its trials really cost: a trial pruned on the quick check
pays for its build and the check, not for timing; the strategies that use the pruned space
also pay for the sensitivity pass that pruned it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from compiler import Recipe, SensitivityReport
from pgc_daemon.optimizer.search.evaluate import QuickStep, quick_verdict
from pgc_daemon.optimizer.search.space import Space
from pgc_daemon.optimizer.search.study import Search, TrialRecord
from pgc_daemon.policy import Policy

#: A strategy has reached the target with a feasible trial within 5% of the best feasible.
TARGET = 1.05


@dataclass(frozen=True)
class Strategy:
    name: str
    sampler: str  # "tpe" | "random"
    baselines: bool
    prune: bool
    pruned_space: bool
    neighbors: bool = False


STRATEGIES = (
    Strategy("pgc", "tpe", baselines=True, prune=True, pruned_space=True, neighbors=True),
    Strategy("pgc_no_baselines", "tpe", baselines=False, prune=True, pruned_space=True,
             neighbors=True),
    Strategy("pgc_tpe_only", "tpe", baselines=True, prune=True, pruned_space=True),
    Strategy("random_baselines", "random", baselines=True, prune=True, pruned_space=True),
    Strategy("random", "random", baselines=False, prune=False, pruned_space=False),
)


@dataclass(frozen=True)
class Scenario:
    """A policy over one table. ``target_speedup``: for ``most_accurate``, the latency target
    as a speedup over fp32 eager (the table's fp32 latency divided by it).
    ``target_over_fp32_compiled``: the target instead as this much faster than the table's
    fp32 compiled recipe, a target fp32 compiled just misses whatever the day's ratios
    (:meth:`Table.speedup_of` gives ``target_speedup`` from it)."""

    name: str
    table: str
    max_drop: float = 0.01
    objective: str = "fastest"
    target_speedup: float | None = None
    note: str = ""
    target_over_fp32_compiled: float | None = None

    def policy(self, baseline_ms: float, max_trials: int) -> Policy:
        target = baseline_ms / self.target_speedup if self.target_speedup else None
        return Policy(max_accuracy_drop=self.max_drop, objective=self.objective,
                      latency_target_ms=target, max_trials=max_trials)


@dataclass
class Table:
    """Measured recipes by hash, and fp32 eager's latency on the table's inputs.

    A *lazy* table (``measure`` given) measures a recipe the first time a strategy visits it:
    for spaces too large to measure whole (six hot layers: 4^7 recipes). Its best is then the
    best of what any strategy (or an anchor) visited, not of the space."""

    entries: dict[str, dict[str, Any]]
    baseline_ms: float
    measure: Callable[[dict[str, Any], Recipe], dict[str, Any]] | None = field(
        default=None, compare=False)

    def entry(self, params: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
        e = self.entries.get(recipe.hash)
        if e is None:
            if self.measure is None:
                raise KeyError(f"{recipe.label()} is not in the table")
            e = self.entries[recipe.hash] = self.measure(params, recipe)
        return e

    def scored(self, policy: Policy, key: str) -> float | None:
        """The score (lower is better: the ratio to fp32 for ``fastest``, the accuracy drop
        for ``most_accurate``) of the recipe with hash ``key`` as the table stands, or None
        where it is not in the table, not complete or not feasible."""
        e = self.entries.get(key)
        if e is None or e["state"] != "complete" or \
                not _meets(policy, e["drop"], e["ratio"] * self.baseline_ms):
            return None
        return score(policy, e["ratio"], e["drop"] or 0.0)

    def speedup_of(self, recipe: Recipe) -> float:
        """``recipe``'s measured speedup over fp32 eager (KeyError where not measured)."""
        e = self.entries[recipe.hash]
        if e["state"] != "complete":
            raise KeyError(f"{recipe.label()} did not complete: {e['message']}")
        return 1 / e["ratio"]

    def feasible(self, policy: Policy) -> list[dict[str, Any]]:
        return [e for k, e in self.entries.items() if self.scored(policy, k) is not None]

    def best(self, policy: Policy) -> tuple[float, str]:
        """The best feasible score and its recipe. fp32 eager itself (ratio 1, drop 0) counts
        where it meets the policy."""
        scored = [(v, self.entries[k]["label"]) for k in self.entries
                  if (v := self.scored(policy, k)) is not None]
        if _meets(policy, 0.0, self.baseline_ms):
            scored.append((score(policy, 1.0, 0.0), "fp32 · eager"))
        return min(scored) if scored else (math.inf, "none")

    def answered_by(self, policy: Policy, recipes: Sequence[Recipe], best: float) -> str | None:
        """The first of ``recipes`` (a strategy's baselines) that is feasible and within the
        target of ``best``: where one is, every strategy given the baselines reaches the
        target at the same trial, and the sampler has nothing left to show."""
        for recipe in recipes:
            value = self.scored(policy, recipe.hash)
            if value is not None and reached(policy, value, best):
                return self.entries[recipe.hash]["label"]
        return None


def _meets(policy: Policy, drop: float, latency_ms: float) -> bool:
    return all(v <= 0.0 for v in policy.violations(drop, latency_ms).values())


def score(policy: Policy, ratio: float, drop: float) -> float:
    return drop if policy.objective == "most_accurate" else ratio


def reached(policy: Policy, value: float, best: float) -> bool:
    """Whether a feasible trial's score is within the target of the best: 5% of the latency,
    or for accuracy 5% of the budget above the best drop."""
    if policy.objective == "most_accurate":
        return value <= best + (TARGET - 1) * policy.max_accuracy_drop
    return value <= best * TARGET


def replay_evaluate(table: Table, policy: Policy, prune: bool) -> Callable[..., TrialRecord]:
    """A Search ``evaluate`` that looks recipes up in the table instead of measuring."""

    def evaluate(number: int, params: dict[str, Any], recipe: Recipe) -> TrialRecord:
        e = table.entry(params, recipe)
        rec = TrialRecord(
            number=number, state="failed", params=dict(params), recipe=recipe.to_dict(),
            recipe_hash=recipe.hash, label=recipe.label(), message=e["message"],
        )
        ph = e["phases"]
        if e["state"] != "complete":
            rec.duration_s = sum(ph.values())
            return rec
        steps = [QuickStep(*step) for step in e.get("quick_steps") or []]
        pruned, step = quick_verdict(steps, policy.max_accuracy_drop) if steps else (False, None)
        if prune and pruned:
            rec.state, rec.drop = "pruned", step.drop
            rec.duration_s = ph.get("build", 0) + ph.get("warm", 0) + ph.get("quick", 0)
            return rec
        rec.state = "complete"
        rec.ratio, rec.speedup = e["ratio"], 1 / e["ratio"]
        rec.drop, rec.fidelity = e["drop"], e["fidelity"]
        rec.baseline_ms, rec.latency_ms = table.baseline_ms, e["ratio"] * table.baseline_ms
        rec.feasible = _meets(policy, e["drop"], rec.latency_ms)
        rec.violation = policy.normalized_violation(rec.drop, rec.latency_ms)
        rec.duration_s = sum(ph.values())
        return rec

    return evaluate


@dataclass(frozen=True)
class Replayed:
    """What a replayed search names as its evaluator in its result: nothing is evaluated, the
    table's figures are looked up, but the result still says which metric they are in."""

    metric: str


@dataclass
class Run:
    """One strategy, one seed: the trials and seconds until the target (None: not reached
    within the cap), and the best feasible score and seconds spent after each trial."""

    trials: int | None
    wall_s: float
    curve: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def trials(strategy: Strategy, table: Table, policy: Policy, spaces: Mapping[str, Space],
           baselines: Sequence[dict[str, Any]], seed: int, cap: int,
           metric: str = "accuracy",
           sensitivity: SensitivityReport | None = None) -> list[TrialRecord]:
    """The trials ``strategy`` makes in ``cap`` over ``table`` (``spaces``: ``pruned`` and
    ``full``), in order."""
    records: list[TrialRecord] = []
    space = spaces["pruned" if strategy.pruned_space else "full"]
    search = Search(
        base=None, space=space, policy=policy, evaluator=Replayed(metric),  # type: ignore[arg-type]
        timing_inputs=[], calibration=[], storage=None,
        name=f"bench-{strategy.name}-{seed}", seed=seed,
        on_trial=lambda rec, done, budget: records.append(rec),
        sampler=optuna.samplers.RandomSampler(seed=seed) if strategy.sampler == "random" else None,
        evaluate=replay_evaluate(table, policy, prune=strategy.prune),
        rank_backends=strategy.prune, neighbor_moves=strategy.neighbors,
    )
    if strategy.pruned_space:  # what pruned it orders the neighbor moves, as in settle()
        search.sensitivity = sensitivity
    if strategy.baselines:
        search.enqueue(baselines)
    search.run(cap)
    return records


def judge(records: Sequence[TrialRecord], table: Table, policy: Policy, best: float,
          overhead_s: float) -> Run:
    """Trials and seconds until a feasible trial within the target of ``best``, and the
    best-so-far after each trial. Scores are the table's as it stands (a lazy table's top
    recipes are re-timed after every strategy visited them); ``overhead_s`` is charged first."""
    spent = overhead_s
    run = Run(trials=None, wall_s=math.inf)
    so_far = math.inf
    for i, r in enumerate(records, start=1):
        spent += r.duration_s
        value = table.scored(policy, r.recipe_hash) if r.state == "complete" else None
        if value is not None:
            so_far = min(so_far, value)
            if run.trials is None and reached(policy, value, best):
                run.trials, run.wall_s = i, spent
        run.curve.append(so_far)
        run.seconds.append(spent)
    return run


def replay(strategy: Strategy, table: Table, policy: Policy, spaces: Mapping[str, Space],
           baselines: Sequence[dict[str, Any]], seed: int, cap: int, overhead_s: float,
           best: float, metric: str = "accuracy") -> Run:
    """Run ``strategy`` for ``cap`` trials over a whole ``table`` and judge it against
    ``best``. ``overhead_s``: what the pruned space cost to make (charged to the strategies
    that use it)."""
    records = trials(strategy, table, policy, spaces, baselines, seed, cap, metric)
    return judge(records, table, policy, best, overhead_s if strategy.pruned_space else 0.0)


def median(values: Sequence[float | None]) -> float:
    return statistics.median([math.inf if v is None else v for v in values])


def quantile(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def curves(runs: Sequence[Run], cap: int) -> dict[str, list[float | None]]:
    """Best-so-far across seeds after each trial: median, 25th and 75th percentile of the
    score, and the median seconds spent. A seed that stopped early (its space exhausted)
    keeps its last value."""
    out: dict[str, list[float | None]] = {"median": [], "p25": [], "p75": [], "seconds": []}
    for k in range(cap):
        vals = [r.curve[min(k, len(r.curve) - 1)] for r in runs if r.curve]
        secs = [r.seconds[min(k, len(r.seconds) - 1)] for r in runs if r.seconds]
        for key, v in (("median", statistics.median(vals)), ("p25", quantile(vals, 0.25)),
                       ("p75", quantile(vals, 0.75)), ("seconds", statistics.median(secs))):
            out[key].append(None if math.isinf(v) else round(v, 4))
    return out


def summarize(name: str, runs: Mapping[str, Sequence[Run]], policy: Policy, best: float,
              budget: int, cap: int) -> dict[str, Any]:
    """A scenario's JSON: per strategy the median trials and seconds to the target, its
    best-so-far curves, and how close pgc got inside the default ``budget`` of trials."""
    out: dict[str, Any] = {"scenario": name, "best_score": best}
    for strategy, rs in runs.items():
        out[f"{strategy}_trials_median"] = median([r.trials for r in rs])
        out[f"{strategy}_wall_s_median"] = round(median([r.wall_s for r in rs]), 1)
        out[f"{strategy}_trials"] = [r.trials for r in rs]
        out.setdefault("curves", {})[strategy] = curves(rs, cap)
    pgc = runs["pgc"]
    at_budget = [r.curve[min(budget, len(r.curve)) - 1] if r.curve else math.inf for r in pgc]
    out["pgc_within_target_at_budget"] = sum(reached(policy, v, best) for v in at_budget) / len(pgc)
    random_b, pgc_t = out["random_baselines_trials_median"], out["pgc_trials_median"]
    out["ratio_vs_random_baselines"] = (
        pgc_t / random_b if math.isfinite(random_b) and random_b else None)
    # random with baselines not there in ``cap`` trials (on the median seed) and pgc there:
    # the ratio is at most pgc's trials over the cap (censored, an upper bound)
    out["ratio_vs_random_baselines_at_most"] = (
        pgc_t / cap if not math.isfinite(random_b) and math.isfinite(pgc_t) else None)
    return out


def worst_ratio(results: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest pgc/random-with-baselines trial ratio over scenarios (``summarize``'s
    output). Where random with baselines never reached the target within the trial cap and
    pgc did, its bound stands in (``ratio_vs_random_baselines_at_most``: the true ratio is
    lower); where pgc never reached it and random did, the ratio is infinite; a scenario
    neither reached says nothing. None without any ratio."""
    ratios = []
    for r in results:
        v = r["ratio_vs_random_baselines"]
        v = v if v is not None else r.get("ratio_vs_random_baselines_at_most")
        if v is not None:
            ratios.append(v)
    return max(ratios) if ratios else None
