"""Work the swapper hands the launcher runs as the serving threads would: at the priority of
the thread that made the launcher (the user's, at attach), not the swapper's lower one, in a
thread that ends with the work. Real threads; Linux nice values."""

from __future__ import annotations

import threading

import pytest

from pgc_daemon.agent.runtime import SWAPPER_NICE, Launcher, lower_priority, thread_nice


def _in_a_lowered_thread(fn):  # type: ignore[no-untyped-def]
    """``fn()`` from a thread at the swapper's priority, as the swapper calls it."""
    out: list[object] = []

    def run() -> None:
        lower_priority()
        try:
            out.append(("ok", fn()))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(("raised", exc))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_work_runs_at_the_launchers_priority_and_errors_reach_the_caller() -> None:
    if thread_nice() is None:
        pytest.skip("threads have no nice value of their own here")
    launcher = Launcher("pgc-launcher-test")
    here = thread_nice()
    try:
        def where() -> tuple[int | None, str]:
            return thread_nice(), threading.current_thread().name

        lowered = _in_a_lowered_thread(lambda: thread_nice())
        assert lowered == ("ok", max(here, SWAPPER_NICE))  # the swapper's own threads
        kind, (nice, name) = _in_a_lowered_thread(lambda: launcher.run(where))
        assert kind == "ok" and nice == here  # the launcher's, not the caller's
        assert name == "pgc-swapper-work"  # a short thread: no OpenMP team outlives the work

        def fails() -> None:
            raise ValueError("bad input")

        kind, exc = _in_a_lowered_thread(lambda: launcher.run(fails))
        assert kind == "raised" and isinstance(exc, ValueError) and str(exc) == "bad input"
    finally:
        launcher.stop()
    # stopped: work still runs, in a short thread of the caller's (at its priority)
    kind, (nice, _) = _in_a_lowered_thread(lambda: launcher.run(where))
    assert kind == "ok" and nice == max(here, SWAPPER_NICE)
