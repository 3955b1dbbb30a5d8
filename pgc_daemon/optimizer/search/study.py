"""The search: an Optuna multi-objective study (latency ratio, accuracy drop) under the
policy's constraints, driven trial by trial with ask/tell so each trial can be pruned on
accuracy before it is timed, and so a recipe already measured is never built twice.

The study lives in Optuna's RDB storage under a name made of the model, its fingerprint, the
hardware, the policy's study terms and the traffic shape (:func:`~.schedule.study_name`): a
restarted worker resumes it with every finished trial kept (see :mod:`.inflight`). What a
search produces (records, result, front, pick) is in :mod:`.results`, re-exported here.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState
from torch import nn

from compiler import CompileCache, Example, Recipe, RecipeError, SensitivityReport, refused
from pgc_daemon.optimizer.schedule import shape_signature, study_name
from pgc_daemon.optimizer.search.baselines import ranked_out, slowdown
from pgc_daemon.optimizer.search.evaluate import Evaluator
from pgc_daemon.optimizer.search.inflight import blamed_until_done, close_unfinished
from pgc_daemon.optimizer.search.neighbors import next_neighbor
from pgc_daemon.optimizer.search.results import (SearchResult, TrialRecord, feasible,
                                                 on_one_reference, pareto_front, pick)
from pgc_daemon.optimizer.search.space import Space
from pgc_daemon.optimizer.search.trial import ServingThreads, evaluate_trial
from pgc_daemon.policy import Policy

__all__ = ["Search", "SearchResult", "TrialRecord", "open_study", "pareto_front", "pick",
           "shape_signature", "study_name"]

log = logging.getLogger("pgc.search")
optuna.logging.set_verbosity(optuna.logging.WARNING)

CALIBRATION_INPUTS = 32


def default_sampler(seed: int = 0) -> optuna.samplers.BaseSampler:
    """TPE, multivariate (layer choices interact), few random start-up trials since the
    enqueued baselines already cover the obvious points. Constraints are set on each trial
    (``Trial.set_constraint``) and TPE reads them."""
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, multivariate=True)


def open_study(
    name: str,
    storage: str | None,
    seed: int = 0,
    sampler: optuna.samplers.BaseSampler | None = None,
) -> optuna.Study:
    """Create or load a study (``storage=None``: in memory, for one-shot offline runs)."""
    sampler = sampler or default_sampler(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=sampler,
            directions=["minimize", "minimize"],
            load_if_exists=True,
        )
        if not study.metric_names:
            study.set_metric_names(["latency_ratio", "accuracy_drop"])
    if blamed := close_unfinished(study):  # each recipe a process died on is not built again
        log.warning("%s: %d trial(s) ended their search process; recorded failed", name, blamed)
    return study


def _record_from_frozen(t: optuna.trial.FrozenTrial) -> TrialRecord | None:
    data = t.user_attrs.get("record")
    if data is None:
        return None
    return TrialRecord.from_dict(data)


#: User attributes of the trials evaluated before the space was final (:meth:`Search.run_first`):
#: ``early`` marks the trial that holds the record (told FAIL, without parameters, so that no
#: sampler reads it: its number is the trial's number in pgc's store), ``adopts`` the trial
#: that gives the sampler the same point in the final space's parameters (complete or pruned,
#: with its values and constraints, and no record of its own: every record is held once).
EARLY = "early"
ADOPTS = "adopts"


class Search:
    """One search run over ``space`` for ``base``."""

    def __init__(
        self,
        *,
        base: nn.Module,
        space: Space,
        policy: Policy,
        evaluator: Evaluator,
        timing_inputs: Sequence[Example],
        calibration: Sequence[Example],
        storage: str | None,
        name: str,
        seed: int = 0,
        on_trial: Callable[[TrialRecord, int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        max_timing_s: float = 20.0,
        sampler: optuna.samplers.BaseSampler | None = None,
        evaluate: Callable[[int, dict[str, Any], Recipe], TrialRecord] | None = None,
        reference_ms: float | None = None,
        cache: CompileCache | None = None,
        policy_version: int | None = None,
        timing_threads: int | None = None,
        timing_gap_s: float = 0.0,
        serving_threads: ServingThreads | None = None,
        rank_backends: bool = True,
        neighbor_moves: bool = True,
    ) -> None:
        """``reference_ms``: the base module's live latency at the policy's percentile. Then
        a candidate's latency is predicted as its measured ratio times that (what the latency
        target, a live SLO, is about); the worker's absolute milliseconds depend on what else
        the machine runs. Without it (offline), the measured milliseconds are used.

        ``sampler`` and ``evaluate`` replace TPE and the real build-and-measure step (the
        search benchmark replays strategies over a table of real measurements with them).
        ``policy_version``: stamped on every trial this search evaluates. ``timing_threads``:
        intra-op threads of both arms while timing (None: as they are; a live search beside
        serving traffic times at one, see :func:`~pgc_daemon.optimizer.search.trial.timing_threads`).
        ``timing_gap_s``: idle time after each timed call, as between live requests.
        ``serving_threads``: fp32 as it serves; trials' ratios are against it (see
        :class:`~pgc_daemon.optimizer.search.trial.ServingThreads`). ``rank_backends``: skip
        samples on backends the trials so far rank out (:func:`ranked_out`; off: plain
        sampling, the benchmark's ablation). ``neighbor_moves``: every other trial the sampler
        would make is a neighbor of the best so far (:mod:`.neighbors`; off: the sampler
        alone)."""
        self.base = base
        self.space = space
        self.policy = policy
        self.evaluator = evaluator
        self.timing_inputs = list(timing_inputs)
        self.calibration = list(calibration)[:CALIBRATION_INPUTS]
        self.name = name
        self.study = open_study(name, storage, seed, sampler)
        self.evaluate = evaluate or self._evaluate
        self.on_trial = on_trial
        self.should_stop = should_stop or (lambda: False)
        self.max_timing_s = max_timing_s
        self.reference_ms = reference_ms
        self.cache = cache
        self.seed = seed
        self.policy_version = policy_version
        self.timing_threads = timing_threads
        self.timing_gap_s = timing_gap_s
        self.serving_threads = serving_threads
        self.rank_backends = rank_backends and policy.objective == "fastest"
        self.neighbor_moves = neighbor_moves
        self.sensitivity: SensitivityReport | None = None  # orders the moves (see settle)

    # ------------------------------------------------------------------ running

    def finished(self) -> list[TrialRecord]:
        """Every record of the study's finished trials, once each."""
        out: list[TrialRecord] = []
        numbers: set[int] = set()
        for t in self.study.get_trials(deepcopy=False):
            rec = _record_from_frozen(t)
            if rec is not None and t.state.is_finished() and rec.number not in numbers:
                numbers.add(rec.number)
                out.append(rec)
        return out

    def enqueue(self, params_list: Sequence[dict[str, Any]]) -> None:
        for params in params_list:
            self.study.enqueue_trial(params, skip_if_exists=True)

    def run(self, n_trials: int, timeout_s: float | None = None) -> SearchResult:
        """Run until ``n_trials`` distinct recipes are evaluated in this study (earlier runs of
        the same study count), the time budget ends, or ``should_stop`` says so."""
        started = time.monotonic()
        records = self.finished()
        seen = {r.recipe_hash: r for r in records if not r.duplicate}
        evaluated, asks, move_next, refusals = len(seen), 0, self.neighbor_moves, set()
        while evaluated < n_trials and asks < 4 * n_trials:
            if self.should_stop():
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                break
            asks += 1
            queued = bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
            out = ranked_out(records, self.space.backends) if self.rank_backends else {}
            # every other trial the sampler would make: one next to the best so far
            move = None if queued or not move_next else next_neighbor(
                self.space, records, self.policy, out, self.sensitivity, refusals)
            if move is not None:
                self.study.enqueue_trial(move)
                queued = True
            trial = self.study.ask()
            recipe = self.space.suggest(trial)
            prior = seen.get(recipe.hash)
            if prior is not None:
                rec = TrialRecord(**{**prior.to_dict(), "number": trial.number, "duplicate": True})
                self._tell(trial, rec)
                continue
            slower = None if queued else slowdown(out, trial.params, recipe)
            if slower is None and refused(recipe, self.base):  # before any build
                refusals.add(recipe.hash)
            if slower is not None or recipe.hash in refusals:  # infeasible at no cost: the
                # sampler learns to leave it, and the moves skip it
                trial.set_constraint("ranked_out" if slower else "refused", (slower or 2.0) - 1.0)
                self.study.tell(trial, state=TrialState.PRUNED)
                continue
            with blamed_until_done(trial, trial.params, recipe):
                rec = self.evaluate(trial.number, trial.params, recipe)
                rec.policy_version = self.policy_version
                rec.origin = "neighbor" if move else "baseline" if queued else "sampler"
                self._tell(trial, rec)
            seen[rec.recipe_hash] = rec
            records.append(rec)
            evaluated += 1
            move_next = self.neighbor_moves and move is None
            if self.on_trial is not None:
                self.on_trial(rec, evaluated, n_trials)
        return self.result([r for r in records if not r.duplicate])

    def run_first(
        self,
        items: Sequence[tuple[dict[str, Any], Recipe]],
        n_trials: int,
        timeout_s: float | None = None,
    ) -> list[TrialRecord]:
        """Evaluate ``items`` (parameters for the record, and the recipe) before the space is
        final: the baselines, while per-layer sensitivity is not measured yet. Recipes the
        study already evaluated are skipped; ``n_trials`` counts the study's earlier trials as
        :meth:`run` does. Returns the new records (each also went to ``on_trial``).

        Optuna keeps a parameter's choices fixed for the life of a study, and sensitivity
        prunes choices: so each record is kept by a trial without parameters (told FAIL, which
        no sampler reads, the record in its user attributes: a worker killed now loses
        nothing), and :meth:`set_space` gives it the final space's parameters later."""
        started = time.monotonic()
        seen = {r.recipe_hash for r in self.finished() if not r.duplicate}
        evaluated = len(seen)
        out: list[TrialRecord] = []
        for params, recipe in items:
            if evaluated >= n_trials or self.should_stop():
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                break
            if recipe.hash in seen:
                continue
            trial = self.study.ask()
            with blamed_until_done(trial, params, recipe, **{EARLY: True}):
                rec = self.evaluate(trial.number, params, recipe)
                rec.policy_version, rec.origin = self.policy_version, "baseline"
                trial.set_user_attr("record", rec.to_dict())
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            seen.add(rec.recipe_hash)
            out.append(rec)
            evaluated += 1
            if self.on_trial is not None:
                self.on_trial(rec, evaluated, n_trials)
        return out

    def set_space(self, space: Space) -> int:
        """Search ``space`` from now on. Where the study already recorded choices for one of its
        parameters (a resumed study whose space changed since), those are kept: Optuna refuses
        other choices under the same name. Then every trial :meth:`run_first` evaluated gets
        this space's parameters (a trial added to the study with its values and constraints),
        so the sampler learns from it; a recipe this space cannot say keeps only its record.
        Returns how many trials were added."""
        self.space = space.reconciled(self.recorded_choices())
        return self.adopt()

    def recorded_choices(self) -> dict[str, tuple[Any, ...]]:
        """The choices the study recorded for each categorical parameter so far."""
        out: dict[str, tuple[Any, ...]] = {}
        for t in self.study.get_trials(deepcopy=False):
            for name, dist in t.distributions.items():
                if name not in out and isinstance(dist, CategoricalDistribution):
                    out[name] = tuple(dist.choices)
        return out

    def adopt(self) -> int:
        """Give the records of :meth:`run_first` the current space's parameters (once each)."""
        trials = self.study.get_trials(deepcopy=False)
        done = {t.user_attrs.get(ADOPTS) for t in trials}
        pools = self.space.distributions()
        added = 0
        for t in trials:
            if not t.user_attrs.get(EARLY) or t.number in done:
                continue
            rec = _record_from_frozen(t)
            if rec is None or rec.state not in ("complete", "pruned"):
                continue
            try:
                params = self.space.params_for(Recipe.from_dict(rec.recipe))
            except RecipeError:
                params = None
            if params is None:
                continue
            dists: dict[str, optuna.distributions.BaseDistribution] = {
                name: CategoricalDistribution(pools[name]) for name in params
            }
            attrs: dict[str, Any] = {ADOPTS: t.number, "label": rec.label}
            if rec.state == "complete":
                frozen = optuna.trial.create_trial(
                    state=optuna.trial.TrialState.COMPLETE,
                    values=[rec.ratio, max(rec.drop or 0.0, 0.0)],
                    params=params,
                    distributions=dists,
                    user_attrs=attrs,
                    constraints=self.policy.violations(rec.drop, rec.latency_ms),
                )
            else:
                frozen = optuna.trial.create_trial(
                    state=optuna.trial.TrialState.PRUNED,
                    params=params,
                    distributions=dists,
                    user_attrs=attrs,
                    constraints={"accuracy_drop": max(rec.drop or 1.0, 1e-9)},
                )
            self.study.add_trial(frozen)
            added += 1
        return added

    def _tell(self, trial: optuna.Trial, rec: TrialRecord) -> None:
        trial.set_user_attr("record", rec.to_dict())
        if rec.state == "complete":
            for key, value in self.policy.violations(rec.drop, rec.latency_ms).items():
                trial.set_constraint(key, value)
            self.study.tell(trial, [rec.ratio, max(rec.drop or 0.0, 0.0)])
        elif rec.state == "pruned":
            trial.set_constraint("accuracy_drop", max(rec.drop or 1.0, 1e-9))
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _evaluate(self, number: int, params: dict[str, Any], recipe: Recipe) -> TrialRecord:
        ratios = [r.ratio for r in self.finished() if r.state == "complete" and r.feasible and r.ratio]
        return evaluate_trial(self, number, params, recipe, incumbent=min(ratios, default=None))

    # ------------------------------------------------------------------ result

    def result(self, records: list[TrialRecord]) -> SearchResult:
        """The front and the policy's pick. fp32 eager itself (ratio 1, no drop) takes part:
        a variant slower than the unmodified model is never chosen over it."""
        complete = [r for r in records if r.state == "complete"]
        baselines = [r.baseline_ms for r in complete if r.baseline_ms]
        baseline_ms = self.reference_ms or (sorted(baselines)[len(baselines) // 2] if baselines else None)
        if baseline_ms and not self.reference_ms:  # offline: every trial timed its own fp32
            on_one_reference(complete, baseline_ms, self.policy)
        base = self._baseline_record(baseline_ms)
        front = pareto_front(complete + [base])
        chosen = pick(complete + [base], self.policy)
        closest: list[TrialRecord] = []
        if chosen is None:
            closest = sorted(complete, key=lambda r: r.violation)[:3]
            message = "no feasible variant under the policy" + (
                "; closest: " + "; ".join(f"{r.label} ({r.message})" for r in closest)
                if closest else "")
        elif chosen is base:
            best = min(complete, key=lambda r: r.ratio, default=None)
            message = "fp32 eager stays fastest: no variant beat it" + (
                f" (best: {best.label}, {best.message})" if best else ""
            )
        else:
            message = f"chose {chosen.label}: {chosen.message}"
        return SearchResult(
            records=records,
            front=front,
            chosen=chosen,
            closest=closest,
            baseline_ms=baseline_ms,
            metric=self.evaluator.metric,
            message=message,
            study_name=self.name,
        )

    def _baseline_record(self, baseline_ms: float | None) -> TrialRecord:
        identity = Recipe()
        rec = TrialRecord(
            number=-1,
            state="complete",
            params={},
            recipe=identity.to_dict(),
            recipe_hash=identity.hash,
            label=identity.label(),
            ratio=1.0,
            speedup=1.0,
            latency_ms=baseline_ms,
            baseline_ms=baseline_ms,
            fidelity=1.0,
            drop=0.0,
            message="the unmodified model",
        )
        rec.feasible = feasible(self.policy, rec)
        rec.violation = self.policy.normalized_violation(rec.drop, rec.latency_ms)
        return rec
