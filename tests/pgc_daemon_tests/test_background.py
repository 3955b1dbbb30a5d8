"""The swapper's background work keeps out of the requests' way: fp32 reference forwards wait
for moments without a request in flight (in their own thread only), run without an OpenMP
team, and Python's switch interval is short while any deployment runs."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
import torch

from pgc_daemon import attach
from pgc_daemon.settings import Settings
from pgc_daemon.agent.runtime import YieldToRequests, one_thread, short_gil_turns

from .helpers import wait_for


pytestmark = pytest.mark.serial  # its waits are checked to a tenth of a second


def test_ops_in_the_mode_wait_until_no_request_is_in_flight() -> None:
    busy = threading.Event()
    busy.set()
    threading.Timer(0.3, busy.clear).start()
    x = torch.ones(4)
    started = time.monotonic()
    with YieldToRequests(busy.is_set, max_wait_s=1.0) as mode:
        y = x + 1
    waited = time.monotonic() - started
    assert torch.equal(y, torch.full((4,), 2.0))
    assert 0.25 <= waited < 0.9
    assert 0.25 <= mode.waited_s < 0.9


def test_saturating_traffic_delays_background_work_within_its_budget() -> None:
    x = torch.ones(4)
    started = time.monotonic()
    with YieldToRequests(lambda: True, max_wait_s=0.05, budget_s=0.2) as mode:
        for _ in range(20):  # 20 ops x 50 ms would be 1 s without the budget
            x = x + 1
    assert time.monotonic() - started < 0.6
    assert 0.2 <= mode.waited_s < 0.3
    assert x[0].item() == 21.0


def test_only_the_thread_inside_the_mode_waits() -> None:
    inside, done = threading.Event(), threading.Event()
    other_ms: list[float] = []

    def background() -> None:
        with YieldToRequests(lambda: True, max_wait_s=2.0, budget_s=2.0):
            inside.set()
            torch.ones(2) + 1  # waits its full 2 s: always busy
        done.set()

    t = threading.Thread(target=background)
    t.start()
    assert inside.wait(5)
    t0 = time.perf_counter()
    torch.ones(2) + 1  # this thread is not in the mode
    other_ms.append((time.perf_counter() - t0) * 1e3)
    assert not done.is_set()
    t.join(5)
    assert other_ms[0] < 100


def test_served_model_is_busy_exactly_while_a_request_runs(mlp_spec: dict[str, Any], settings: Settings) -> None:
    seen: list[bool] = []

    class Probe(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(served.serving_now())
            return self.inner(x)

    served = attach(Probe(mlp_spec["model"]), name="probe", settings=settings)
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        assert not served.serving_now()
        served(mlp_spec["example_inputs"][0][0])
        assert seen == [True]
        assert not served.serving_now()
    finally:
        served.close()


def test_one_thread_puts_the_thread_count_back() -> None:
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_overlapping_deployments_restore_the_switch_interval() -> None:
    original = sys.getswitchinterval()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with short_gil_turns():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    t = threading.Thread(target=first)
    t.start()
    assert first_in.wait(5)
    with short_gil_turns():
        second_in.set()
        assert first_out.wait(5)
        assert sys.getswitchinterval() < original  # the other swapper left; this one still runs
    t.join(5)
    assert sys.getswitchinterval() == original


def test_every_call_runs_in_inference_mode_and_leaves_the_busy_count_as_it_was(
        mlp_spec: dict[str, Any], settings: Settings) -> None:
    """The request path enters inference mode only where the caller is not in it (entering it
    again cost 1-4 µs a call), and counts a call in flight until it returns or raises."""
    modes: list[bool] = []

    class Probe(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            modes.append(torch.is_inference_mode_enabled())
            if x.shape[0] == 3:
                raise ValueError("the caller's bad input")
            return self.inner(x)

    served = attach(Probe(mlp_spec["model"]), name="probe", settings=settings)
    try:
        x = mlp_spec["example_inputs"][0][0]
        out = served(x)  # the caller in no mode
        assert not out.requires_grad and out.is_inference()
        with torch.no_grad():
            assert served(x).is_inference()
        with torch.inference_mode():
            assert served(x).is_inference()
        assert modes == [True, True, True] and not torch.is_inference_mode_enabled()
        for _ in range(3):
            with pytest.raises(ValueError, match="bad input"):
                served(x[:3])
        assert not served.serving_now() and served._in_flight == []
    finally:
        served.close()
