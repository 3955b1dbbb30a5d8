"""A trial that ends its search process (a native crash inside a build) is recorded failed and
never built again by its study; one interrupted in order (``SIGTERM``, Ctrl-C) is not blamed.

Each search here runs in a real child process on a real SQLite study; the child crashes with
a real segfault inside its trial, as a heap corruption in a compiler ends a worker (seen on
``nn.TransformerEncoder`` under max-autotune). Before the fix the resumed study was handed the
same recipe again (the same neighbor of the same best, or the same baseline) and crashed
again, until the schedule gave up on the study.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pgc_daemon.optimizer.search.inflight import ENDED, interrupt_on_sigterm
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.optimizer.search.study import Search
from tests.pgc_daemon_tests.test_neighbors import BEST_BASELINE, FASTEST, SPACE, _flat, _record

ROOT = Path(__file__).resolve().parents[2]
FP32 = SPACE.params("fp32", "inductor")


def _search(storage: str, evaluate: Any, evaluated: list[TrialRecord]) -> Search:
    return Search(base=None,  # type: ignore[arg-type]
                  space=SPACE, policy=FASTEST, timing_inputs=[],
                  evaluator=SimpleNamespace(metric="cosine"),  # type: ignore[arg-type]
                  calibration=[], storage=storage, name="crashes", seed=0, evaluate=evaluate,
                  rank_backends=False, on_trial=lambda rec, done, budget: evaluated.append(rec))


def _evaluate(calls: list[str], fault_at: int = 0, marker: Path | None = None) -> Any:
    """Each trial's record from a flat landscape (the best baseline far ahead); the call
    numbered ``fault_at`` writes its recipe's hash to ``marker`` first, then faults: a
    segfault, or (``SIGTERM`` on, see :func:`child`) a wait for the parent's signal."""
    def evaluate(number: int, params: dict[str, Any], recipe: Any) -> TrialRecord:
        calls.append(recipe.hash)
        if len(calls) == fault_at and marker is not None:
            marker.write_text(recipe.hash)
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                ctypes.string_at(0)  # a segfault: the process ends without running Python
            if "native" in marker.name:  # stuck in native code: Python's handler never runs
                mutex, libc = ctypes.create_string_buffer(64), ctypes.CDLL(None)
                libc.pthread_mutex_lock(mutex)
                libc.pthread_mutex_lock(mutex)  # a self-deadlock no signal interrupts
            time.sleep(120)  # the parent's SIGTERM interrupts this
        return _record(params, number, 0.5 if params == BEST_BASELINE else _flat(params))
    return evaluate


def child(storage: str, how: str, fault_at: int, marker: str) -> None:
    """Run in the child process: a search whose ``fault_at``-th build faults."""
    if how.endswith("sigterm"):
        interrupt_on_sigterm()
    search = _search(storage, _evaluate([], fault_at, Path(marker)), [])
    if how.startswith("first"):
        search.run_first([(p, SPACE.recipe(p)) for p in (FP32, BEST_BASELINE)], 8)
    else:
        search.enqueue([FP32, BEST_BASELINE])
        search.run(8)


def _run_child(tmp_path: Path, how: str, fault_at: int) -> tuple[str, int]:
    storage, marker = f"sqlite:///{tmp_path / 'study.db'}", tmp_path / f"faulted-{how}"
    code = (f"from tests.pgc_daemon_tests.test_crashed_trials import child; "
            f"child({storage!r}, {how!r}, {fault_at}, {str(marker)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if how.endswith("sigterm"):
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert marker.exists(), err.decode()[-2000:]
    return marker.read_text(), proc.returncode


@pytest.mark.parametrize("how", ["run", "first"])
def test_a_recipe_that_crashed_its_process_is_recorded_failed_and_never_built_again(
        tmp_path: Path, how: str) -> None:
    # the first neighbor move (the third build), or the best baseline (the second)
    crashed, code = _run_child(tmp_path, how, 3 if how == "run" else 2)
    assert code == -signal.SIGSEGV

    calls: list[str] = []
    evaluated: list[TrialRecord] = []
    search = _search(f"sqlite:///{tmp_path / 'study.db'}", _evaluate(calls), evaluated)
    failed = [r for r in search.finished() if r.state == "failed"]
    assert [(r.recipe_hash, r.message) for r in failed] == [(crashed, ENDED)]
    if how == "first":
        added = search.run_first([(p, SPACE.recipe(p)) for p in (FP32, BEST_BASELINE)], 8)
        assert added == []  # fp32 was recorded, the best baseline crashed: neither again
    else:
        search.enqueue([FP32, BEST_BASELINE])
        result = search.run(8)
        assert crashed not in calls
        assert len(calls) == 8 - 3  # the crashed trial counts against the budget
        assert crashed in {r.recipe_hash for r in result.records if r.state == "failed"}
        assert result.chosen is not None and result.chosen.params == BEST_BASELINE


@pytest.mark.parametrize("inside", ["python", "native"])
def test_a_trial_interrupted_by_sigterm_is_withdrawn_and_tried_again(
        tmp_path: Path, inside: str) -> None:
    started = time.monotonic()
    interrupted, code = _run_child(tmp_path, f"run-{inside}-sigterm", 3)
    assert code == 128 + signal.SIGTERM
    # a main thread in a 120 s native call ends after the backstop's grace, not the call
    assert time.monotonic() - started < 30

    calls: list[str] = []
    search = _search(f"sqlite:///{tmp_path / 'study.db'}", _evaluate(calls), [])
    assert [r for r in search.finished() if r.state == "failed"] == []
    search.enqueue([FP32, BEST_BASELINE])
    search.run(3)
    assert calls == [interrupted]  # the same neighbor of the same best, built this time
