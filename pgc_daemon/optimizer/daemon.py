"""The optimizer loop of ``pgc serve``: each tick reads every model's situation from the store,
asks :func:`~pgc_daemon.optimizer.schedule.decide` whether it needs a search, and starts the
search's worker through :class:`~pgc_daemon.optimizer.workers.Workers`.

Each tick also fails the deployments an agent left behind (:mod:`.stranded`), and reads only
what is bounded by time, never by how much history the store keeps.

Threading: one background thread runs :meth:`Daemon.tick` every ``poll_s``; the API thread
may call :meth:`Daemon.start_search` at any time (one lock serializes starting searches; the
worker process itself is started on the workers' long-lived spawner thread, so it does not die
with the request's thread). Workers are separate processes that end with the daemon: a crashed
worker marks nothing but its own run, and a new worker resumes the same Optuna study with every
finished trial kept.

The policy travels with the work: a run stores the :class:`PolicySnapshot` it was queued
under, and its worker searches under that snapshot whatever the API changes meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from sqlalchemy.orm import Session

import store as st
from store import RunState
from pgc_daemon.errors import SearchError
from pgc_daemon.optimizer.schedule import (
    PROFILE_WINDOW_S,
    UP_TO_DATE,
    Regression,
    RunInfo,
    Situation,
    Thresholds,
    Wait,
    decide,
    shape_signature,
    study_name,
)
from pgc_daemon.optimizer.stranded import fail_stranded
from pgc_daemon.optimizer.workers import Workers, prune_statistics
from pgc_daemon.policy import PolicySnapshot, load_policy
from pgc_daemon.services.queries import BASELINE_HASH
from pgc_daemon.settings import Settings

log = logging.getLogger("pgc.daemon")

MIN_RESERVOIR = 8
MAX_FAILED_RUNS = 3
PRUNE_EVERY_S = 3600.0
#: Live windows a latency comparison needs on each side (fewer calls are noise).
MIN_REGRESSION_CALLS = 50
#: How often a model's live latency is compared for a regression (the answer is kept between).
REGRESSION_EVERY_S = 60.0


class Daemon:
    def __init__(self, settings: Settings, store: st.Store | None = None) -> None:
        self.settings = settings
        self.store = store or st.open_store(settings.store_url)
        self.workers = Workers(settings, self.store)
        self.thresholds = Thresholds(
            min_reservoir=MIN_RESERVOIR,
            min_profile_calls=settings.min_profile_calls,
            reoptimize_interval_s=settings.reoptimize_interval_s,
            max_failed_runs=MAX_FAILED_RUNS,
        )
        self._start_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_prune = 0.0
        self._regressions: dict[int, tuple[float, Regression | None]] = {}
        self.ticks = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pgc-daemon", daemon=True)
        self._thread.start()

    def stop(self, *, kill_workers: bool = True) -> None:
        """Stop the loop; with ``kill_workers``, end the search workers at once (a search
        must not go on for the seconds the loop's last tick may take), then any that tick
        started."""
        self._stop.set()
        self.workers.stop(kill=kill_workers)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.workers.stop(kill=kill_workers)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a bad tick
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("daemon tick failed: %s", self.last_error)
            self._stop.wait(self.settings.poll_s)

    # ------------------------------------------------------------------ one tick

    def tick(self) -> None:
        """Reap workers, fail stranded deployments, then consider every model. What a tick
        reads is bounded by time (the drift and profile windows, the span a regression check
        compares), never by how much history the store keeps: a tick costs the same at 72 h of
        windows as at one."""
        self.ticks += 1
        self.workers.reap()
        now = time.time()
        fail_stranded(self.store, now)
        with self.store.session() as s:
            models = list(st.repo.list_models(s))
        for model in models:
            try:
                self._consider(model, now)
            except st.StoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - one model must not stop the others
                log.warning("considering %s failed: %s", model.name, exc)
        if time.time() - self._last_prune > PRUNE_EVERY_S:
            prune_statistics(self.store, self.settings.retention_h)
            self._last_prune = time.time()

    def _consider(self, model: st.Model, now: float | None = None) -> None:
        """Start or resume a search when the schedule says the model needs one."""
        if not model.spec:
            return
        now = time.time() if now is None else now
        with self.store.session() as s:
            running = st.repo.running_search(s, model.id)
            if running is not None:
                self.workers.check_alive(s, running)
                return
            situation = self.situation(s, model, now)
            decision = decide(situation)
            if decision == UP_TO_DATE:  # the one answer a regression can change
                regression = self._regression(s, model, now)
                if regression is not None:
                    decision = decide(replace(situation, regression=regression))
        if isinstance(decision, Wait):
            log.debug("%s: %s", model.name, decision.reason)
            return
        self.start_search(
            model.id, decision.trigger, snapshot=situation.policy, name=decision.study_name
        )

    def situation(self, s: Session, model: st.Model, now: float) -> Situation:
        """What the schedule needs to know about ``model``, read from the store: the reservoir's
        count (not its payload), the calls of the profile window, the runs' schedule columns
        and the drift window's shapes. No regression: :meth:`_regression` is asked only when
        the decision without one is :data:`UP_TO_DATE`."""
        runs = [
            RunInfo(
                r.study_name, RunState(r.state), r.policy_version, r.trials_budget, r.started_at
            )
            for r in st.repo.run_rows(s, model.id, limit=200)
        ]
        shapes = st.repo.shape_histogram(s, model.id, since=now - self.settings.drift_window_s)
        return Situation(
            model=model.name,
            graph_hash=model.graph_hash or "",
            hardware=model.hardware or "",
            policy=load_policy(s, model.id),
            runs=runs,
            signature=shape_signature(shapes),
            reservoir_size=st.repo.reservoir_count(s, model.id) or 0,
            calls_seen=st.repo.calls_since(s, model.id, now - PROFILE_WINDOW_S),
            now=now,
            thresholds=self.thresholds,
        )

    def _regression(self, s: Session, model: st.Model, now: float) -> Regression | None:
        """:meth:`regression`, at most once per ``REGRESSION_EVERY_S`` for a model (latency
        drifts over minutes; the answer is kept in between)."""
        checked = self._regressions.get(model.id)
        if checked is not None and now - checked[0] < REGRESSION_EVERY_S:
            return checked[1]
        found = self.regression(s, model, now)
        self._regressions[model.id] = (now, found)
        return found

    def regression(self, s: Session, model: st.Model, now: float) -> Regression | None:
        """The active variant's live p50 over the last ``drift_window_s`` is worse than over the
        first ``drift_window_s`` after it became active by more than the tolerance; quiet
        windows only (not while pgc searched or built). The base module is never checked (it
        is what a regression would be measured against). Reads the two windows and the busy
        intervals that overlap them only, whatever the history holds."""
        active = st.repo.active_variant(s, model.id)
        if active is None or active.recipe_hash == BASELINE_HASH:
            return None
        window, since = self.settings.drift_window_s, active.since
        if now - since < 2 * window:
            return None
        spans = ((since, since + window), (now - window, now))
        (early_n, early_p50), (recent_n, recent_p50) = (
            st.repo.latency_between(
                s, model.id, active.variant_id, start, end,
                exclude=st.repo.busy_between(s, model.id, start, end, now=now),
            )
            for start, end in spans
        )
        if min(early_n, recent_n) < MIN_REGRESSION_CALLS or early_p50 is None or recent_p50 is None:
            return None
        if recent_p50 > early_p50 * (1 + self.settings.regression_tolerance):
            return Regression(
                active.deployment_id,
                f"live latency regressed: p50 {early_p50:.2f} -> {recent_p50:.2f} ms",
            )
        return None

    # ------------------------------------------------------------------ starting searches

    def start_search(
        self,
        model_id: int,
        trigger: str,
        *,
        snapshot: PolicySnapshot | None = None,
        name: str | None = None,
        trials: int | None = None,
    ) -> int:
        """Queue a search run for a model under ``snapshot`` (default: its stored policy now)
        and start its worker; returns the run id. The run keeps the snapshot: its worker
        searches under it even if the policy changes meanwhile."""
        with self._start_lock:
            with self.store.session() as s:
                # several pgc serve on one store (a fleet) start one search per model
                st.repo.lock_model(s, model_id)
                if st.repo.running_search(s, model_id) is not None:
                    raise SearchError("a search is already running for this model")
                model = s.get(st.Model, model_id)
                if model is None or not model.spec:
                    raise SearchError("this model was attached without a spec; pgc cannot rebuild it")
                if (st.repo.reservoir_count(s, model_id) or 0) < MIN_RESERVOIR:
                    raise SearchError("not enough live inputs captured yet to search")
                snapshot = snapshot or load_policy(s, model_id)
                if name is None:
                    shapes = st.repo.shape_histogram(
                        s, model_id, since=time.time() - self.settings.drift_window_s
                    )
                    name = study_name(
                        model.name, model.graph_hash or "", model.hardware or "",
                        snapshot.policy.study, shape_signature(shapes),
                    )
                run = st.repo.create_search_run(
                    s,
                    model_id,
                    study_name=name,
                    policy_version=snapshot.version,
                    trigger=trigger,
                    trials_budget=trials or snapshot.policy.max_trials,
                    policy=snapshot.to_json(),
                )
                run_id = run.id
            worker = self.workers.spawn(run_id, model_id)
        log.info("search run %d started (%s), worker pid %d", run_id, trigger, worker.proc.pid)
        return run_id
