"""The optimizer loop of ``pgc serve``: decides when a model needs a search, runs each search
in a worker process, watches the workers, and keeps the store bounded.

Threading: one background thread runs :meth:`Daemon.tick` every ``poll_s``; the API thread
may call :meth:`Daemon.request_search` at any time (guarded by a lock). Workers are separate
processes: a crashed worker marks nothing but its own run, and a new worker resumes the same
Optuna study with every finished trial kept.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import store as st
from pgc_daemon.errors import SearchError
from pgc_daemon.policy import Policy
from pgc_daemon.optimizer.search.study import shape_signature, study_name
from pgc_daemon.services.queries import busy_intervals
from pgc_daemon.settings import Settings

log = logging.getLogger("pgc.daemon")

MIN_RESERVOIR = 8
MAX_FAILED_RUNS = 3
STALE_HEARTBEAT_S = 600.0


@dataclass
class _Worker:
    run_id: int
    model_id: int
    proc: subprocess.Popen[bytes]
    log_path: Path


class Daemon:
    def __init__(self, settings: Settings, store: st.Store | None = None) -> None:
        self.settings = settings
        self.store = store or st.open_store(settings.store_url)
        self.workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_prune = 0.0
        self.ticks = 0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pgc-daemon", daemon=True)
        self._thread.start()

    def stop(self, *, kill_workers: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if kill_workers:
            with self._lock:
                for w in self.workers.values():
                    if w.proc.poll() is None:
                        w.proc.terminate()
                for w in self.workers.values():
                    try:
                        w.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        w.proc.kill()

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
        self.ticks += 1
        self._reap()
        with self.store.session() as s:
            models = list(st.repo.list_models(s))
        for model in models:
            try:
                self._consider(model)
            except st.StoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - one model must not stop the others
                log.warning("considering %s failed: %s", model.name, exc)
        if time.time() - self._last_prune > 3600:
            with self.store.session() as s:
                n = st.repo.prune_stats(s, time.time() - self.settings.retention_h * 3600)
            self._last_prune = time.time()
            if n:
                log.info("pruned %d old statistics rows", n)

    def _consider(self, model: st.Model) -> None:
        """Start a search when the model needs one: a first search for its current policy and
        traffic shape, resuming a study whose worker died, after the traffic shape drifted,
        or after live latency of the active variant regressed (those two rate-limited)."""
        if not model.spec:
            return
        now = time.time()
        with self.store.session() as s:
            running = st.repo.running_search(s, model.id)
            if running is not None:
                self._check_alive(s, running)
                return
            reservoir = st.repo.load_reservoir(s, model.id)
            summary = st.repo.request_summary(s, model.id)
            policy_row = st.repo.get_policy(s, model.id)
            runs = list(st.repo.list_search_runs(s, model.id, limit=200))
            shapes = st.repo.shape_histogram(s, model.id, since=now - self.settings.drift_window_s)
            regression = self._regression(s, model)
        if reservoir is None or reservoir.count < MIN_RESERVOIR:
            return
        if summary is None or summary["count"] < self.settings.min_profile_calls:
            return
        policy = Policy.parse(policy_row.settings if policy_row else {})
        version = policy_row.version if policy_row else 0
        signature = shape_signature(shapes)
        name = study_name(model.name, model.graph_hash or "", model.hardware or "", policy, signature)
        same = [r for r in runs if r.study_name == name]
        finished = any(r.state in ("done", "infeasible") for r in same)
        recent = runs and now - runs[0].started_at < self.settings.reoptimize_interval_s
        if not finished:
            if sum(r.state == "failed" for r in same) >= MAX_FAILED_RUNS:
                return
            if same:
                trigger = "resuming the study"
            elif not runs:
                trigger = "first search for this model"
            elif runs[0].policy_version != version:
                trigger = f"policy changed (version {version})"
            else:
                if recent:
                    return  # a drift re-search waits for the rate limit
                trigger = f"traffic shape drifted to {signature or 'new shapes'}"
            self.start_search(model.id, trigger, policy=policy, name=name)
            return
        if regression is not None and not recent:
            dep_id, message = regression
            regressed = f"{name}:regressed-{dep_id}"
            if not any(r.study_name == regressed for r in runs):
                self.start_search(model.id, message, policy=policy, name=regressed)

    def _regression(self, s: Any, model: st.Model) -> tuple[int, str] | None:
        """(deployment id, reason) when the active variant's live p50 over the last
        ``drift_window_s`` is worse than right after it became active by more than the
        tolerance; quiet windows only (not while pgc searched or built)."""
        active = st.repo.active_deployment(s, model.id)
        if active is None or active.variant_id is None:
            return None
        since = next((t.at for t in active.transitions if t.to_state == "active"), active.updated_at)
        window = self.settings.drift_window_s
        now = time.time()
        if now - since < 2 * window:
            return None
        busy = busy_intervals(s, model.id)
        first = st.repo.request_summary(s, model.id, variant_id=active.variant_id, since=since, exclude=busy)
        recent = st.repo.request_summary(
            s, model.id, variant_id=active.variant_id, since=now - window, exclude=busy
        )
        if not first or not recent or first["count"] < 50 or recent["count"] < 50:
            return None
        early = [
            w for w in st.repo.request_windows(s, model.id, since=since, variant_id=active.variant_id)
            if w.window_end <= since + window
        ]
        if sum(w.count for w in early) < 50:
            return None
        early_p50 = sum(w.p50_ms * w.count for w in early) / sum(w.count for w in early)
        if recent["p50_ms"] > early_p50 * (1 + self.settings.regression_tolerance):
            return active.id, (
                f"live latency regressed: p50 {early_p50:.2f} -> {recent['p50_ms']:.2f} ms"
            )
        return None

    def _check_alive(self, s: object, run: st.SearchRun) -> None:
        """A run whose worker is gone (killed, crashed, machine restarted) is marked failed so
        a new worker can resume its study. A worker of another host counts as gone only when
        its heartbeat is stale."""
        with self._lock:
            if run.id in self.workers:
                return  # ours: _reap sees it exit
        now = time.time()
        if run.host not in (None, socket.gethostname()):
            if now - run.heartbeat_at < STALE_HEARTBEAT_S:
                return
        elif run.pid is None:
            if now - run.started_at < 60:
                return  # being started right now
        elif _pid_alive(run.pid):
            return
        st.repo.update_search_run(  # type: ignore[arg-type]
            s, run.id, state="failed", message="the search worker is gone", finished_at=now
        )

    # ------------------------------------------------------------------ workers

    def start_search(
        self,
        model_id: int,
        trigger: str,
        *,
        policy: Policy | None = None,
        name: str | None = None,
        trials: int | None = None,
    ) -> int:
        """Queue a search run for a model and start its worker; returns the run id."""
        with self._lock:
            with self.store.session() as s:
                if st.repo.running_search(s, model_id) is not None:
                    raise SearchError("a search is already running for this model")
                model = s.get(st.Model, model_id)
                if model is None or not model.spec:
                    raise SearchError("this model was attached without a spec; pgc cannot rebuild it")
                reservoir = st.repo.load_reservoir(s, model_id)
                if reservoir is None or reservoir.count < MIN_RESERVOIR:
                    raise SearchError("not enough live inputs captured yet to search")
                if policy is None:
                    row = st.repo.get_policy(s, model_id)
                    policy = Policy.parse(row.settings if row else {})
                if name is None:
                    shapes = st.repo.shape_histogram(
                        s, model_id, since=time.time() - self.settings.drift_window_s
                    )
                    name = study_name(
                        model.name, model.graph_hash or "", model.hardware or "", policy,
                        shape_signature(shapes),
                    )
                policy_row = st.repo.get_policy(s, model_id)
                run = st.repo.create_search_run(
                    s,
                    model_id,
                    study_name=name,
                    policy_version=policy_row.version if policy_row else 0,
                    trigger=trigger,
                    trials_budget=trials or policy.max_trials,
                )
                run_id = run.id
            proc, log_path = self._spawn(run_id)
            with self.store.session() as s:
                st.repo.update_search_run(s, run_id, pid=proc.pid, host=socket.gethostname())
            self.workers[run_id] = _Worker(run_id, model_id, proc, log_path)
        log.info("search run %d started (%s), worker pid %d", run_id, trigger, proc.pid)
        return run_id

    def _spawn(self, run_id: int) -> tuple[subprocess.Popen[bytes], Path]:
        log_path = self.settings.work_path() / f"search-{run_id}.log"
        env = dict(os.environ)
        env["PGC_STORE_URL"] = self.settings.store_url
        env["PGC_OPTUNA_URL"] = self.settings.optuna_storage()
        if self.settings.num_threads:
            env["PGC_NUM_THREADS"] = str(self.settings.num_threads)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.getcwd(), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        )
        with open(log_path, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pgc_daemon.optimizer.search.worker", "--run-id", str(run_id)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return proc, log_path

    def _reap(self) -> None:
        with self._lock:
            finished = [w for w in self.workers.values() if w.proc.poll() is not None]
            for w in finished:
                del self.workers[w.run_id]
        for w in finished:
            with self.store.session() as s:
                run = st.repo.get_search_run(s, w.run_id)
                if run.state in ("queued", "running"):
                    tail = _tail(w.log_path)
                    st.repo.update_search_run(
                        s,
                        w.run_id,
                        state="failed",
                        message=f"worker exited with code {w.proc.returncode}: {tail}",
                        finished_at=time.time(),
                    )

    def cancel(self, run_id: int) -> None:
        with self.store.session() as s:
            st.repo.update_search_run(s, run_id, state="cancelled", finished_at=time.time())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:])[-500:]
