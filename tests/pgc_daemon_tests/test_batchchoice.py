"""Micro-batching serves only where it raises throughput, measured on live calls
(``agent/batchchoice.py``): the decision on recorded runs, the policy's latency target, the
re-probe, and the whole path through a real executor with concurrent callers and through a
served model into the store's events."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import store as st
from pgc_daemon import attach
from pgc_daemon.agent.batchchoice import BatchChoice
from pgc_daemon.agent.executor import Executor
from pgc_daemon.settings import Settings

from .helpers import wait_for


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _feed(choice: BatchChoice, clock: _Clock, run_ms: dict[bool, float], rows: dict[bool, int],
          runs: int, wait_ms: float = 0.0) -> list[bool]:
    """``runs`` runs of the inference thread: with batching on, ``rows[True]`` calls per run
    taking ``run_ms[True]``; off, ``rows[False]`` and ``run_ms[False]``. Returns the arm of
    each run."""
    arms = []
    for i in range(runs):
        on = choice.batching()
        arms.append(on)
        ms = run_ms[on] * (1 + 0.03 * (i % 4))
        arrivals = [clock.now - wait_ms / 1e3] * rows[on]
        clock.now += ms / 1e3
        choice.record(arrivals, int(ms * 1e6), clock.now)
    return arms


def test_batching_serves_where_a_batch_costs_less_per_call() -> None:
    clock = _Clock()
    choice = BatchChoice(block_calls=16, blocks_per_arm=3, clock=clock)
    arms = _feed(choice, clock, {True: 12.0, False: 9.0}, {True: 4, False: 1}, 400)
    assert choice.chosen is True
    assert set(arms[:20]) == {True, False}  # both arms probed
    assert set(arms[-50:]) == {True}
    status = choice.status()
    assert status["busy_ms_per_call"]["on"] < status["busy_ms_per_call"]["off"]


def test_batching_is_off_where_a_batch_costs_more_per_call() -> None:
    """The static-shape Inductor variant measured on 2 cores: 4 x 9.4 ms alone, 96 ms as a
    batch of 4."""
    clock = _Clock()
    choice = BatchChoice(block_calls=16, blocks_per_arm=3, clock=clock)
    arms = _feed(choice, clock, {True: 96.0, False: 9.4}, {True: 4, False: 1}, 400)
    assert choice.chosen is False
    assert set(arms[-50:]) == {False}


def test_batching_is_off_under_light_traffic() -> None:
    """No call waits for another: every batch is of one call, and costs as much."""
    clock = _Clock()
    choice = BatchChoice(block_calls=16, blocks_per_arm=3, clock=clock)
    _feed(choice, clock, {True: 9.0, False: 9.0}, {True: 1, False: 1}, 400)
    assert choice.chosen is False


def test_batching_is_off_where_it_misses_the_policys_latency_target() -> None:
    clock = _Clock()
    choice = BatchChoice(block_calls=16, blocks_per_arm=3, clock=clock, target=lambda: (20.0, "p95"))
    # cheaper per call, but each call of a batch waited 30 ms in the queue
    _feed(choice, clock, {True: 12.0, False: 9.0}, {True: 4, False: 1}, 400, wait_ms=30.0)
    assert choice.chosen is False
    assert choice.status()["target_ms"] == 20.0
    met = BatchChoice(block_calls=16, blocks_per_arm=3, clock=clock, target=lambda: (100.0, "p95"))
    _feed(met, clock, {True: 12.0, False: 9.0}, {True: 4, False: 1}, 400, wait_ms=30.0)
    assert met.chosen is True


def test_the_choice_is_probed_again_after_a_while() -> None:
    clock = _Clock()
    choice = BatchChoice(block_calls=16, blocks_per_arm=3, clock=clock, reprobe_s=60.0)
    _feed(choice, clock, {True: 96.0, False: 9.4}, {True: 4, False: 1}, 400)
    assert choice.chosen is False
    clock.now += 61.0
    _feed(choice, clock, {True: 12.0, False: 9.0}, {True: 4, False: 1}, 400)  # traffic changed
    assert choice.chosen is True


def _run_clients(ex: Executor, n: int, calls: int) -> list[Any]:
    errors: list[BaseException] = []

    def client(i: int) -> None:
        for k in range(calls):
            x = torch.full((1, 3), float(i * 1000 + k))
            try:
                out = ex.submit((x,), {})
                assert torch.equal(out, x + 1), "a caller got another's rows"
            except BaseException as exc:  # noqa: BLE001 - the test looks at them
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a caller hung"
    return errors


@pytest.mark.parametrize(("batch_row_ms", "expected"), [(1.0, True), (6.0, False)])
def test_a_real_executor_batches_only_where_it_pays(batch_row_ms: float, expected: bool) -> None:
    """Four callers at once; a model that runs one row in 4 ms and a batch in ``batch_row_ms``
    per row: batching pays for the first, not for the second (like a variant compiled for
    batch 1, whose other shapes leave its fast kernels)."""

    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        (x,) = args
        rows = x.shape[0]
        time.sleep((4.0 if rows == 1 else batch_row_ms * rows) / 1e3)
        return x + 1

    choice = BatchChoice(block_calls=16, blocks_per_arm=3)
    ex = Executor(fn, max_batch=4, max_delay_ms=1.0, choice=choice).start()
    try:
        assert _run_clients(ex, 4, 60) == []
        assert choice.chosen is expected, choice.status()
        batches = ex.batches
        assert _run_clients(ex, 4, 20) == []
        assert (ex.batches > batches) is expected  # after the decision, it holds
        assert ex.status()["batching"]["batching"] is expected
    finally:
        ex.stop()


class _FixedCost(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)
        return x * 2


def test_a_served_model_stores_its_batching_decision(settings: Settings, store: st.Store) -> None:
    served = attach(_FixedCost(), name="batching", settings=settings, max_batch=4, max_delay_ms=1.0)
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        assert served.executor.choice is not None
        served.executor.choice.block_calls = 16

        def client(i: int) -> None:
            for k in range(80):
                x = torch.full((1, 2), float(i * 100 + k))
                assert torch.equal(served(x), x * 2)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert served.executor.choice.chosen is True
        assert served.status()["executor"]["batching"]["batching"] is True

        def stored() -> list[Any]:
            with store.session() as s:
                return list(st.repo.list_events(s, served.model_id, kind="batching"))

        events = wait_for(stored, what="the batching event in the store")
        assert events[0].message.startswith("micro-batching serves")
        assert events[0].data["busy_ms_per_call"]["on"] < events[0].data["busy_ms_per_call"]["off"]
    finally:
        served.close()


def test_a_choice_that_fails_turns_batching_off_and_serving_goes_on() -> None:
    def boom(message: str, data: dict[str, Any]) -> None:
        raise RuntimeError("the event sink failed")

    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        time.sleep(0.001)
        return args[0] + 1

    ex = Executor(fn, max_batch=4, max_delay_ms=1.0,
                  choice=BatchChoice(block_calls=4, blocks_per_arm=1, notify=boom)).start()
    try:
        assert _run_clients(ex, 4, 20) == []
        assert ex.choice is None and ex.alive and ex.inline == 0
        batches = ex.batches
        assert _run_clients(ex, 4, 10) == []
        assert ex.batches == batches
    finally:
        ex.stop()
