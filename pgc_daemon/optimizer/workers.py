"""The search worker processes of one daemon: spawning, reaping, liveness, and keeping the
store bounded.

A worker is ``python -m pgc_daemon.optimizer.search.worker --run-id N --parent-pid P`` in its
own session (its own GIL and threads, and a crash takes nothing else down); it leaves its
outcome in the store. Whatever ends a worker without an outcome (a crash, a kill, a lost
machine), the run is marked failed here so the schedule can resume its study with a new one.

A worker does not outlive the daemon that started it: it asks the kernel for ``SIGTERM`` when
its parent goes (``PR_SET_PDEATHSIG``) and watches its parent pid besides, so a ``kill -9`` of
``pgc serve`` leaves no orphan searching beside the next daemon's worker. The kernel sends that
signal when the parent *thread* that forked the worker exits, so every worker of a process is
started by one long-lived thread (:func:`popen_from_spawner`), never by the short-lived thread
of an API request. While it runs, a worker writes its run's ``heartbeat_at`` every
``WORKER_HEARTBEAT_S``; a daemon treats a run whose heartbeat is fresh as alive, so a restarted
daemon never starts a second worker on a study an earlier worker still searches. Where the run
says its worker ran in this daemon's own PID namespace on this host, its pid is the whole
answer: a worker that is gone is gone, and the study resumes at once, not a heartbeat later.

Threading: :class:`Workers` is shared by the daemon's tick thread and the API thread (which
starts searches); its own lock guards the process table, and no store session is held while
it is taken.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

import store as st
from pgc_daemon.states import STALE_AFTER_S
from store import RUN_OPEN, RunState
from pgc_daemon.settings import Settings

log = logging.getLogger("pgc.daemon")

#: How often a worker writes its run's heartbeat.
WORKER_HEARTBEAT_S = 5.0
#: A worker on another host counts as gone when its run's heartbeat is older than this.
STALE_HEARTBEAT_S = 60.0
#: A worker of this host whose process is not seen still counts as alive while its heartbeat
#: is younger than this, unless it ran in this PID namespace (else it may run in another one
#: under the same host name).
LOCAL_HEARTBEAT_S = 3 * WORKER_HEARTBEAT_S
#: A run queued this recently without a pid is being started right now.
STARTING_S = 60.0
#: The module a worker runs (``python -m``).
WORKER_MODULE = "pgc_daemon.optimizer.search.worker"


@dataclass
class Worker:
    run_id: int
    model_id: int
    proc: subprocess.Popen[bytes]
    log_path: Path


class Workers:
    """The worker processes this daemon started, by run id."""

    def __init__(self, settings: Settings, store: st.Store) -> None:
        self.settings = settings
        self.store = store
        self._procs: dict[int, Worker] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._procs)

    def __contains__(self, run_id: object) -> bool:
        with self._lock:
            return run_id in self._procs

    # ------------------------------------------------------------------ spawning

    def spawn(self, run_id: int, model_id: int) -> Worker:
        """Start the worker of a queued run and record its pid and host on the run."""
        log_path = self.settings.work_path() / f"search-{run_id}.log"
        env = dict(os.environ)
        env["PGC_STORE_URL"] = self.settings.store_url
        env["PGC_OPTUNA_URL"] = self.settings.optuna_storage()
        if self.settings.num_threads:
            env["PGC_NUM_THREADS"] = str(self.settings.num_threads)
        # the daemon's work dir (compile cache and artifacts) by its absolute path: a worker
        # that fell back to the default found no artifact where the agents look, and they
        # compiled the variant in the serving process
        env["PGC_WORK_DIR"] = str(self.settings.work_path().resolve())
        if self.settings.artifact_dir:
            env["PGC_ARTIFACT_DIR"] = str(self.settings.artifact_path().resolve())
        # No current directory on the worker's path: it imports the model spec only from the
        # root the serving process recorded, after checking the file's digest (modelspec).
        argv = [sys.executable, "-m", WORKER_MODULE, "--run-id", str(run_id)]
        argv += ["--parent-pid", str(os.getpid())]
        with open(log_path, "wb") as fh:
            proc = popen_from_spawner(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        with self.store.session() as s:
            st.repo.update_search_run(s, run_id, pid=proc.pid, host=socket.gethostname(),
                                      pid_ns=pid_namespace())
        worker = Worker(run_id, model_id, proc, log_path)
        with self._lock:
            self._procs[run_id] = worker
        return worker

    # ------------------------------------------------------------------ watching

    def reap(self) -> list[int]:
        """Forget workers that exited; a run one left open is marked failed with the tail of
        its log. Returns the run ids reaped."""
        with self._lock:
            finished = [w for w in self._procs.values() if w.proc.poll() is not None]
            for w in finished:
                del self._procs[w.run_id]
        for w in finished:
            with self.store.session() as s:
                run = st.repo.get_search_run(s, w.run_id)
                if run.state in RUN_OPEN:
                    mark_failed(
                        s, w.run_id, f"worker exited with code {w.proc.returncode}: {tail(w.log_path)}"
                    )
        return [w.run_id for w in finished]

    def check_alive(self, s: Session, run: st.SearchRun) -> bool:
        """Whether an open run still has a worker. One that is gone (killed, crashed, machine
        restarted) is marked failed so a new worker can resume its study. A worker of another
        host counts as gone only when its heartbeat is stale; one of this host when its process
        is gone (or is another program now) and its heartbeat is not fresh."""
        if run.id in self:
            return True  # ours: reap() sees it exit
        now = time.time()
        silent = now - run.heartbeat_at
        if run.host not in (None, socket.gethostname()):
            alive = silent < STALE_HEARTBEAT_S
        elif run.pid is None:
            alive = now - run.started_at < STARTING_S
        elif run.pid_ns is not None and run.pid_ns == pid_namespace():
            alive = worker_alive(run.pid, run.id)  # its pid is in sight: nothing to wait for
        else:
            alive = worker_alive(run.pid, run.id) or silent < LOCAL_HEARTBEAT_S
        if not alive:
            mark_failed(s, run.id, f"the search worker is gone (last heartbeat {silent:.0f} s ago)")
        return alive

    def stop(self, *, kill: bool = True, timeout_s: float = 10.0) -> None:
        """Terminate the workers (then kill those that outlive ``timeout_s``)."""
        if not kill:
            return
        with self._lock:
            workers = list(self._procs.values())
        for w in workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in workers:
            try:
                w.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                w.proc.kill()


def mark_failed(s: Session, run_id: int, message: str) -> None:
    st.repo.update_search_run(
        s, run_id, state=RunState.FAILED, message=message, finished_at=time.time()
    )


def prune_statistics(store: st.Store, retention_h: float) -> int:
    """Delete statistics and events past the retention, and history past its bounds (old
    trials, finished deployments, events, and variants nothing refers to; never the active or
    an open deployment, the newest runs' trials, or the fp32 base); returns how many rows
    went."""
    with store.session() as s:
        n = st.repo.prune_stats(s, time.time() - retention_h * 3600)
    from pgc_daemon.services.queries import BASELINE_HASH  # noqa: PLC0415 - loads the compiler

    with store.session() as s:
        for model in st.repo.list_models(s):  # stopped or vanished serving processes
            n += st.repo.prune_replicas(s, model.id, within_s=STALE_AFTER_S)
        n += st.repo.prune_history(s, protect_hashes=[BASELINE_HASH]).total
    if n:
        log.info("pruned %d old statistics and history rows", n)
    return n


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[inode]``), or None where procfs does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process runs under ``pid`` (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (or it went meanwhile): trust the signal
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def worker_alive(pid: int, run_id: int) -> bool:
    """Whether ``pid`` is still the search worker of ``run_id`` (not a process that reused
    the pid since). Where the command line cannot be read, a live pid counts."""
    if not pid_alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return WORKER_MODULE.encode() in argv and str(run_id).encode() in argv


class _Spawner:
    """One long-lived thread that starts every worker process of this process (see the module
    docstring: a worker dies with the thread that forked it)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], list[str], dict[str, Any]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pgc-spawner", daemon=True)
                self._thread.start()
        job: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((job, argv, kwargs))
        return job.result()

    def _run(self) -> None:
        while True:
            job, argv, kwargs = self._jobs.get()
            if not job.set_running_or_notify_cancel():
                continue
            try:
                job.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.set_exception(exc)


_SPAWNER = _Spawner()


def popen_from_spawner(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)``, run on this process's spawner thread: the thread
    lives as long as the process, so a worker's parent-death signal fires when the process
    dies, not when the thread that asked for the worker (an API request's) ends."""
    return _SPAWNER.popen(argv, **kwargs)


def tail(path: Path, lines: int = 3) -> str:
    """The last lines of a worker's log, in one line (for a run's message)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:])[-500:]
