"""Search workers end with the daemon that started them, and a restarted daemon leaves a run
alone while its worker's heartbeat is fresh: real processes, a real ``kill -9``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import update

import store as st
from pgc_daemon.optimizer import workers as workers_mod
from pgc_daemon.optimizer.workers import Workers, pid_alive, worker_alive
from pgc_daemon.modelspec import spec_origin
from pgc_daemon.policy import Policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings

from .helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]

#: The "pgc serve" of the test: a Daemon that starts a search from another thread, as the API
#: does from a request's thread; that thread ends when the test says (as a server's pooled
#: thread ends once idle), and the daemon lives on until killed.
DAEMON = textwrap.dedent(
    """
    import sys, threading, time
    from pgc_daemon.optimizer.daemon import Daemon
    from pgc_daemon.settings import Settings

    daemon = Daemon(Settings(store_url=sys.argv[1], work_dir=sys.argv[2]))

    def request():
        daemon.start_search(int(sys.argv[3]), "test")
        print("started", flush=True)
        sys.stdin.readline()

    thread = threading.Thread(target=request)
    thread.start()
    thread.join()
    print("request thread ended", flush=True)
    time.sleep(600)
    """
)


def _model(store: st.Store) -> int:
    """The digits MLP with a full reservoir and a budget no worker finishes in a test."""
    reservoir = InputReservoir(16)
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        reservoir.offer((torch.rand(8, 1, 8, 8, generator=g),), {})
    with store.session() as s:
        spec = "pgc_daemon.examples.digits:mlp"
        origin = spec_origin(spec)
        assert origin is not None
        mid = st.repo.upsert_model(s, "mlp", spec=spec, spec_origin=origin.to_json()).id
        st.repo.put_policy(s, mid, Policy(max_trials=200, time_budget_s=3600).model_dump())
        st.repo.save_reservoir(s, mid, reservoir.serialize(), len(reservoir), reservoir.seen)
    return mid


def _run(store: st.Store, mid: int) -> st.SearchRun | None:
    with store.session() as s:
        runs = st.repo.list_search_runs(s, mid)
        return runs[0] if runs else None


@pytest.mark.slow
def test_a_worker_ends_when_its_daemon_is_killed(
    settings: Settings, store: st.Store, tmp_path: Path
) -> None:
    mid = _model(store)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PGC_NUM_THREADS": "1"}
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, settings.store_url, str(tmp_path / "work"), str(mid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
    )
    worker_pid = None
    try:
        assert daemon.stdin is not None and daemon.stdout is not None
        assert daemon.stdout.readline().strip() == b"started", daemon.stdout.read()
        run = wait_for(
            lambda: (r := _run(store, mid)) is not None and r.state == "running" and r, timeout=120,
            what="the worker to load the model",
        )
        worker_pid = run.pid
        assert worker_pid is not None and worker_alive(worker_pid, run.id)
        daemon.stdin.write(b"\n")
        daemon.stdin.flush()
        assert daemon.stdout.readline().strip() == b"request thread ended"
        # the thread that asked for the worker ended: the worker lives on, and beats
        beat = run.heartbeat_at
        wait_for(lambda: (r := _run(store, mid)) is not None and r.heartbeat_at > beat + 1.0,
                 timeout=3 * workers_mod.WORKER_HEARTBEAT_S, what="a heartbeat")
        assert worker_alive(worker_pid, run.id), f"worker died: {_run(store, mid).message}"

        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait(timeout=10)
        wait_for(lambda: not pid_alive(worker_pid), timeout=10, what="the orphaned worker to end")
        after = _run(store, mid)
        assert after is not None and after.state == "running"  # killed, not finished or failed
        assert after.trials_done < after.trials_budget
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        for pipe in (daemon.stdin, daemon.stdout):
            if pipe is not None:
                pipe.close()
        if worker_pid is not None and pid_alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_restarted_daemon_leaves_a_run_alone_while_its_heartbeat_is_fresh(
    settings: Settings, store: st.Store
) -> None:
    with store.session() as s:
        mid = st.repo.upsert_model(s, "m", spec="pgc_daemon.examples.digits:mlp").id
        run_id = st.repo.create_search_run(s, mid, study_name="x", policy_version=1,
                                           trigger="t", trials_budget=4).id
        st.repo.update_search_run(
            s, run_id, state="running", pid=_dead_pid(), host=socket.gethostname()
        )
    workers = Workers(settings, store)

    def check(age_s: float, pid: int | None = None) -> tuple[bool, str]:
        with store.session() as s:
            values = {"heartbeat_at": time.time() - age_s, **({"pid": pid} if pid else {})}
            s.execute(update(st.SearchRun).where(st.SearchRun.id == run_id).values(**values))
        with store.session() as s:
            alive = workers.check_alive(s, st.repo.get_search_run(s, run_id))
        with store.session() as s:
            return alive, st.repo.get_search_run(s, run_id).state

    # its process is not visible here (another PID namespace, or it is just exiting): a fresh
    # heartbeat still says a worker searches this study
    assert check(1.0) == (True, "running")
    # a pid some other program reuses now is not the worker
    assert not worker_alive(os.getpid(), run_id)
    assert check(1.0, pid=os.getpid()) == (True, "running")
    assert check(workers_mod.LOCAL_HEARTBEAT_S + 5, pid=os.getpid()) == (False, "failed")


def test_a_worker_gone_from_this_pid_namespace_is_failed_at_once(
    settings: Settings, store: st.Store
) -> None:
    """A daemon restarted beside a worker that died with the last one: the run says its
    worker ran in this PID namespace, so its pid is the whole answer and the study resumes
    without waiting out the heartbeat (it waited 15 s)."""
    here = workers_mod.pid_namespace()
    if here is None:
        pytest.skip("procfs does not name this process's PID namespace")
    workers = Workers(settings, store)

    def run_with(pid_ns: str | None) -> tuple[bool, str, str | None]:
        with store.session() as s:
            mid = st.repo.upsert_model(s, "m", spec="pgc_daemon.examples.digits:mlp").id
            run_id = st.repo.create_search_run(s, mid, study_name="x", policy_version=1,
                                               trigger="t", trials_budget=4).id
            st.repo.update_search_run(s, run_id, state="running", pid=_dead_pid(),
                                      host=socket.gethostname(), pid_ns=pid_ns)
        with store.session() as s:  # its heartbeat is fresh: written just now
            alive = workers.check_alive(s, st.repo.get_search_run(s, run_id))
        with store.session() as s:
            run = st.repo.get_search_run(s, run_id)
            return alive, run.state, run.message

    alive, state, message = run_with(here)
    assert (alive, state) == (False, "failed")
    assert message is not None and message.startswith("the search worker is gone")
    # in another namespace (another container under this host name), or not recorded (a
    # run from before the column): a fresh heartbeat still says a worker searches
    assert run_with("pid:[1]")[:2] == (True, "running")
    assert run_with(None)[:2] == (True, "running")
