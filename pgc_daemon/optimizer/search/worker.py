"""Search worker process: ``python -m pgc_daemon.optimizer.search.worker --run-id N
[--parent-pid P]``.

Runs one search run outside the API and serving processes (its own GIL and threads), reads
settings from ``PGC_*`` like every pgc process, and leaves its outcome in the store.

With ``--parent-pid`` (the daemon that started it) the worker ends when that process does: on
Linux the kernel sends it ``SIGTERM`` (``PR_SET_PDEATHSIG``, set before anything slow is
imported), and everywhere a watchdog thread sends it when the parent pid changes. The trial
it was evaluating is lost; every finished one is in Optuna's storage and the store, and the
next daemon resumes the study. The same thread writes the run's heartbeat every
``WORKER_HEARTBEAT_S``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback

import store as st
from store import RUN_OPEN, RunState
from pgc_daemon.errors import describe
from pgc_daemon.optimizer.workers import WORKER_HEARTBEAT_S
from pgc_daemon.settings import Settings

log = logging.getLogger("pgc.search")

#: ``prctl`` option: the signal this process gets when its parent thread exits (linux/prctl.h).
PR_SET_PDEATHSIG = 1
#: Niceness of a search worker (serving processes keep theirs).
WORKER_NICE = 10
#: How often the watchdog compares the parent pid.
PARENT_POLL_S = 0.5


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` ends: ``SIGTERM`` from the kernel on Linux, and a
    check here in case the parent already went before the request took effect."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the watchdog still watches
            pass
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def lower_priority() -> None:
    """Below the serving processes on the same host: a search is background work, and its
    trials are timed as ratios interleaved with fp32 in this process, so priority cancels out.

    The worker runs in a session of its own (the daemon starts it so), and on Linux with
    scheduler autogroups (``/proc/sys/kernel/sched_autogroup_enabled``, on by default) a new
    session is a new group: groups share the CPU equally whatever their threads' nice. The
    thread's nice alone then did nothing against a serving process in another session:
    measured in ``pgc demo`` on 2 cores, the worker took a whole core and fp32 MiniLM served
    at 900 ms p50 instead of 25 ms. So the group's nice is set as well."""
    os.nice(WORKER_NICE)
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(WORKER_NICE))
    except OSError:  # no autogroups (other kernels, other systems): the thread's nice is it
        pass


def watchdog(settings: Settings, run_id: int, parent_pid: int | None) -> threading.Thread:
    """A daemon thread that ends the process when the parent pid changes (the daemon died and
    the worker was re-parented) and writes the run's heartbeat every ``WORKER_HEARTBEAT_S``."""

    def watch() -> None:
        store: st.Store | None = None
        beat = 0.0
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("the daemon (pid %d) is gone: stopping", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if time.monotonic() - beat >= WORKER_HEARTBEAT_S:
                beat = time.monotonic()
                try:
                    store = store or st.open_store(settings.store_url)
                    with store.session() as s:
                        st.repo.update_search_run(s, run_id)  # sets heartbeat_at
                except Exception as exc:  # noqa: BLE001 - a missed beat is retried
                    log.warning("heartbeat of run %d failed: %s", run_id, exc)
            time.sleep(PARENT_POLL_S)

    thread = threading.Thread(target=watch, name="pgc-worker-watchdog", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pgc-search-worker")
    parser.add_argument("--run-id", type=int, required=True)
    parser.add_argument("--store", default=None, help="store URL (default: PGC_STORE_URL)")
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="end when this process (the daemon) ends"
    )
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    # stopping (pgc serve ends, the watchdog) withdraws the trial in flight, where a native
    # crash leaves it blamed on its recipe (see .inflight)
    from pgc_daemon.optimizer.search.inflight import interrupt_on_sigterm  # noqa: PLC0415

    interrupt_on_sigterm()
    lower_priority()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    if args.store:
        settings = settings.model_copy(update={"store_url": args.store})
    watchdog(settings, args.run_id, args.parent_pid)
    try:
        from pgc_daemon.optimizer.search.runner import run_live_search  # noqa: PLC0415 - torch

        result = run_live_search(settings, args.run_id)
        print(result.message, flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - record why, then exit non-zero
        traceback.print_exc()
        try:
            store = st.open_store(settings.store_url)
            with store.session() as s:
                run = st.repo.get_search_run(s, args.run_id)
                if run.state in RUN_OPEN:  # else the runner recorded why already
                    st.repo.update_search_run(
                        s, args.run_id, state=RunState.FAILED, message=describe(exc),
                        finished_at=time.time(),
                    )
                    st.repo.add_event(s, run.model_id, "search_failed", describe(exc), level="error")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
