"""A live search run: what the worker process does for one ``pgc_search_runs`` row.

It searches under the policy snapshot stored on the run (the version the run was queued
for, whatever the API changed since), rebuilds the model from its MODEL_SPEC and refuses,
before searching, a spec that builds another model than the one served (fingerprint). It
takes the captured live inputs, the live per-layer profile and the traffic's shape histogram
from the store, runs the study (resuming it if it exists, warm-started from the best recipes
of this model's earlier studies if it is new) and records every trial.

A model version searched for the first time has no per-layer sensitivity yet: the baselines
(and warm-start recipes) are evaluated first, then sensitivity is measured and shapes the
space of the trials after them. Every trial good enough is deployed while the search goes on
(:mod:`.progressive`); at the end the policy's final choice is proposed under the model's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from sqlalchemy.orm import Session

import store as st
from store import RunState
from compiler import (
    CompileCache,
    LayerSensitivity,
    Recipe,
    RecipeError,
    SensitivityReport,
    fingerprint,
)
from pgc_daemon.errors import SearchError
from pgc_daemon.modelspec import SpecOrigin, load_spec
from pgc_daemon.policy import Policy, PolicySnapshot, load_policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.optimizer.schedule import PROFILE_WINDOW_S
from pgc_daemon.optimizer.search.hotprofile import search_profile
from pgc_daemon.optimizer.search.prepare import (
    first_trials,
    make_search,
    measure_sensitivity,
    settle,
    shape_space,
)
from pgc_daemon.optimizer.search.progressive import Progressive
from pgc_daemon.optimizer.search.study import SearchResult, TrialRecord
from pgc_daemon.optimizer.search.trial import ServingThreads
from pgc_daemon.optimizer.search.twin import build_twin
from pgc_daemon.settings import Settings
from pgc_daemon.services.queries import busy_intervals

log = logging.getLogger("pgc.search")

MIN_INPUTS = 8
#: A live search shares the host with the serving processes: it times at one intra-op thread
#: (see :func:`~pgc_daemon.optimizer.search.trial.timing_threads`).
LIVE_TIMING_THREADS = 1
#: The longest idle gap left between timed calls (a slow arrival rate must not make every
#: trial minutes long; caches are as cold at 100 ms as at a second).
MAX_TIMING_GAP_S = 0.1
#: ... and at most this many times the mean live call: a 0.5 ms call spaced by 40 ms would
#: spend 99% of its timing budget asleep and come out of it with too few calls to decide.
MAX_GAP_PER_CALL = 4.0


def live_gap_s(live: dict[str, Any] | None) -> float:
    """The idle time between one serving process's live requests: its inter-arrival time
    less the mean call, within ``[0, MAX_TIMING_GAP_S]`` and at most ``MAX_GAP_PER_CALL``
    mean calls (0: no live traffic to go by)."""
    if not live or not live.get("count") or not live.get("seconds"):
        return 0.0
    call_s = live["mean_ms"] / 1000
    idle = live["seconds"] / live["count"] - call_s
    return min(max(idle, 0.0), MAX_TIMING_GAP_S, MAX_GAP_PER_CALL * call_s)


def serving_threads(s: Session, model_id: int, base_id: int) -> ServingThreads | None:
    """fp32 as it serves, from the latest thread decision a serving process made for it
    (None: none made, e.g. thread tuning off or no executor)."""
    for ev in st.repo.list_events(s, model_id, kind="threads", limit=50):
        if (ev.data or {}).get("variant_id") == base_id:
            found = ServingThreads.from_event(ev.data)
            if found is not None:
                return found
    return None


def warm_start_recipes(s: Session, model_id: int, study_name: str, limit: int = 3) -> list[Recipe]:
    """The recipes earlier studies of this model chose (newest first): a new model version or
    a new policy starts from what worked before."""
    out: list[Recipe] = []
    for run in st.repo.list_search_runs(s, model_id):
        if run.study_name == study_name or run.chosen_variant_id is None:
            continue
        try:
            recipe = Recipe.from_dict(st.repo.get_variant(s, run.chosen_variant_id).recipe)
        except RecipeError:
            continue
        if recipe not in out:
            out.append(recipe)
        if len(out) >= limit:
            break
    return out


def run_snapshot(s: Session, run: st.SearchRun) -> PolicySnapshot:
    """The policy a run searches under: the snapshot stored when it was queued; for runs
    queued before runs kept one, the model's stored policy now."""
    if run.policy is None:
        return load_policy(s, run.model_id)
    return PolicySnapshot.from_json(run.policy)


def run_live_search(settings: Settings, run_id: int) -> SearchResult:
    store = st.open_store(settings.store_url)
    since = time.time() - PROFILE_WINDOW_S
    with store.session() as s:
        run = st.repo.get_search_run(s, run_id)
        model = s.get(st.Model, run.model_id)
        snapshot = run_snapshot(s, run)
        reservoir = st.repo.load_reservoir(s, model.id)
        baseline = next(
            (v for v in st.repo.list_variants(s, model.id) if v.recipe_hash == Recipe().hash), None
        )
        profile, ranked_by = search_profile(s, model.id, baseline.id if baseline else None, since)
        if ranked_by != "fp32":
            st.repo.add_event(s, model.id, "search", f"hot layers ranked by the live profile of "
                              f"{ranked_by}: where the deployed variant spends its time")
        histogram = st.repo.shape_histogram(s, model.id, since=since)
        live = (
            st.repo.request_summary(
                s, model.id, variant_id=baseline.id, since=since, exclude=busy_intervals(s, model.id)
            )
            if baseline is not None
            else None
        )
        warm = warm_start_recipes(s, model.id, run.study_name)
        serving = serving_threads(s, model.id, baseline.id) if baseline is not None else None
        st.repo.update_search_run(s, run_id, state=RunState.RUNNING, message="loading the model")
    policy = snapshot.policy
    reference_ms = live[f"{policy.latency_percentile}_ms"] if live else None
    if not model.spec:
        refuse(store, run_id, model.id, f"model {model.name!r} was attached without a spec; nothing to rebuild")
    if not model.spec_origin:
        refuse(
            store,
            run_id,
            model.id,
            f"refused: the serving process did not record where {model.spec} comes from (its "
            "module was not found there); a worker imports a spec only from the file the "
            "serving process registered",
        )
    spec = load_spec(model.spec, SpecOrigin.from_json(model.spec_origin))
    if model.graph_hash:
        built = fingerprint(spec.model)
        if built != model.graph_hash:
            refuse(
                store,
                run_id,
                model.id,
                f"refused: {model.spec} builds a different model than the one served "
                f"(fingerprint {built[:12]}, served {model.graph_hash[:12]}); "
                "fix the spec or attach the model again",
            )
    threads = settings.num_threads or (model.input_signature or {}).get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    inputs = InputReservoir.deserialize(reservoir.payload) if reservoir else []
    source = "live traffic"
    if len(inputs) < MIN_INPUTS:
        inputs, source = spec.examples, "the spec's example inputs"

    report = stored_sensitivity(store, model.id, model.graph_hash or "")
    progressive = Progressive(store, model.id, run_id, policy, run.trials_budget)

    def on_trial(rec: TrialRecord, done: int, budget: int) -> None:
        with store.session() as s:
            record_trial(s, model.id, run_id, rec)
            best = _best(s, model.id, run_id)
            st.repo.update_search_run(
                s,
                run_id,
                trials_done=done,
                best_speedup=best[0],
                best_fidelity=best[1],
                message=f"trial {done}/{budget}{rec.origin_note}: {rec.label}: {rec.message}",
            )
        progressive.offer(rec, done)

    search = make_search(
        base=spec.model,
        inputs=inputs,
        profile=profile,
        policy=policy,
        policy_version=snapshot.version,
        name=run.study_name,
        storage=settings.optuna_storage(),
        histogram=histogram,
        metric=model.metric or spec.metric,
        accuracy=spec.accuracy if spec.labels is None else None,
        on_trial=on_trial,
        warm_start=warm,
        sensitivity=report,
        reference_ms=reference_ms,
        cache=CompileCache(settings.compile_cache_path(), artifacts=settings.artifact_path()),
        early=report is None,
        timing_threads=LIVE_TIMING_THREADS,
        timing_gap_s=live_gap_s(live),
        serving_threads=serving,
    )
    finished = search.finished()
    resumed = len(finished)
    with store.session() as s:
        record_resumed(s, model.id, run_id, run.study_name, finished)
        st.repo.update_search_run(s, run_id, trials_done=min(resumed, run.trials_budget))
    spent = 0.0  # in trials: the time budget leaves the sensitivity pass out, as it always has
    progressive.start()
    try:
        if report is None:
            # Baselines first: a first deployment need not wait for the sensitivity pass,
            # which then shapes the space of the trials after them.
            first = first_trials(search.space, warm, policy.objective)
            with store.session() as s:
                st.repo.update_search_run(
                    s,
                    run_id,
                    message=(
                        f"trying {len(first)} baseline recipes before measuring per-layer "
                        f"sensitivity, on {len(inputs)} inputs from {source}"
                    ),
                )
            started = time.monotonic()
            early = search.run_first(first, run.trials_budget, timeout_s=policy.time_budget_s)
            spent = time.monotonic() - started
            serving = deployed_while_searching(early, progressive)
            if serving is not None:  # what now serves gets per-layer rows before the search ends
                with store.session() as s:
                    st.repo.update_search_run(
                        s, run_id, message=f"building the profiling twin of {serving.label}, "
                        "deployed while searching")
                build_twin(store, model.id, search, serving)
            with store.session() as s:
                st.repo.update_search_run(
                    s,
                    run_id,
                    message=f"measuring per-layer sensitivity (after {len(early)} baseline trials)",
                )
            report = measure_sensitivity(
                spec.model, inputs, profile, metric=model.metric or spec.metric
            )
            with store.session() as s:
                st.repo.save_sensitivity(s, model.id, model.graph_hash or "", report.to_rows())
            space = shape_space(spec.model, profile, policy, sensitivity=report,
                                histogram=histogram, example=inputs[0])
            settle(search, space, policy=policy, sensitivity=report, warm_start=warm)
        with store.session() as s:
            st.repo.update_search_run(
                s,
                run_id,
                message=(
                    f"searching {search.space.size} variants ({len(search.space.hot_layers)} hot "
                    f"layers, {len(search.space.pruned)} choices pruned by sensitivity) on "
                    f"{len(inputs)} inputs from {source} under policy version {snapshot.version}"
                    + (f"; resuming with {resumed} finished trials" if resumed else "")
                    + (f"; warm-started from {len(warm)} earlier recipes" if warm else "")
                ),
            )
        result = search.run(run.trials_budget, timeout_s=max(policy.time_budget_s - spent, 0.0))
    finally:
        progressive.stop()
    finish_run(store, model.id, run_id, result, policy, progressive)
    if result.feasible:  # after the run ended (already built: skipped)
        build_twin(store, model.id, search, result.chosen)
    return result


def deployed_while_searching(
    records: list[TrialRecord], progressive: Progressive
) -> TrialRecord | None:
    """The trial among ``records`` this run deployed last while searching (None: none)."""
    by_hash = {r.recipe_hash: r for r in records}
    for recipe_hash in reversed(list(progressive.proposed)):
        if recipe_hash in by_hash:
            return by_hash[recipe_hash]
    return None


def refuse(store: st.Store, run_id: int, model_id: int, message: str) -> NoReturn:
    """End a run before it searches: failed, with ``message`` on the run and as an event."""
    with store.session() as s:
        st.repo.update_search_run(
            s, run_id, state=RunState.FAILED, message=message, finished_at=time.time()
        )
        st.repo.add_event(s, model_id, "search_failed", message, level="error")
    raise SearchError(message)


def stored_sensitivity(store: st.Store, model_id: int, graph_hash: str) -> SensitivityReport | None:
    """The sensitivity measured earlier for this version of the model, if any (measured
    once per model version: resumed and later searches see the same space)."""
    with store.session() as s:
        rows = st.repo.load_sensitivity(s, model_id, graph_hash)
    if not rows:
        return None
    report = SensitivityReport(metric=rows[0].metric, inputs=rows[0].inputs,
                               samples=rows[0].samples or 0)
    for r in rows:
        report.rows.append(
            LayerSensitivity(
                layer=r.layer, choice=r.choice, fidelity=r.fidelity, rms=r.rms, sqnr_db=r.sqnr_db,
                max_abs=r.max_abs, layer_sqnr_db=r.layer_sqnr_db, status=r.status,
            )
        )
    return report


def _best(s: Session, model_id: int, run_id: int) -> tuple[float | None, float | None]:
    best = None
    for t in st.repo.list_trials(s, model_id, run_id=run_id):
        if t.feasible and t.speedup is not None and (best is None or t.speedup > best.speedup):
            best = t
    return (best.speedup, best.fidelity) if best else (None, None)


def record_trial(s: Session, model_id: int, run_id: int, rec: TrialRecord) -> None:
    """Record a trial in the store; the artifact its build saved, if any, goes on the variant
    (serving processes load it instead of compiling)."""
    variant = st.repo.get_or_create_variant(s, model_id, rec.recipe_hash, rec.recipe, rec.label)
    if rec.artifact is not None and variant.artifact != rec.artifact:
        st.repo.set_variant_artifact(s, variant.id, rec.artifact)
    st.repo.add_trial(
        s,
        run_id=run_id,
        model_id=model_id,
        variant_id=variant.id,
        number=rec.number,
        state=rec.state,
        latency_ms=rec.latency_ms,
        baseline_ms=rec.baseline_ms,
        speedup=rec.speedup,
        fidelity=rec.fidelity,
        accuracy_drop=rec.drop,
        feasible=rec.feasible,
        params=rec.params,
        message=rec.message,
        duration_s=rec.duration_s,
    )


def record_resumed(
    s: Session, model_id: int, run_id: int, study_name: str, finished: Sequence[TrialRecord]
) -> int:
    """Give this run the trials its study finished before that pgc's store does not hold (a
    store started afresh beside a kept Optuna storage, or a worker killed between Optuna's
    tell and pgc's record), so the front shows every point the search builds on. Returns how
    many were added."""
    runs = [r.id for r in st.repo.list_search_runs(s, model_id, limit=10_000) if r.study_name == study_name]
    known = {t.number for rid in runs for t in st.repo.list_trials(s, model_id, run_id=rid)}
    added = 0
    for rec in finished:
        if rec.number not in known:
            record_trial(s, model_id, run_id, rec)
            added += 1
    return added


def finish_run(
    store: st.Store,
    model_id: int,
    run_id: int,
    result: SearchResult,
    policy: Policy,
    progressive: Progressive | None = None,
) -> None:
    """Record how the run ended, then propose its final choice (unless the run deployed that
    one while it searched: see :class:`Progressive`)."""
    with store.session() as s:
        chosen_variant = None
        if result.chosen is not None:
            chosen_variant = st.repo.get_or_create_variant(
                s, model_id, result.chosen.recipe_hash, result.chosen.recipe, result.chosen.label
            ).id
        st.repo.update_search_run(
            s,
            run_id,
            state=RunState.DONE if result.feasible else RunState.INFEASIBLE,
            chosen_variant_id=chosen_variant,
            message=result.message,
            finished_at=time.time(),
        )
        if not result.feasible:
            st.repo.add_event(s, model_id, "infeasible", result.message, level="warning")
    progressive = progressive or Progressive(store, model_id, run_id, policy, len(result.records))
    progressive.finish(result.chosen)
