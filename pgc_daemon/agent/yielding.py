"""Background torch work that steps aside while requests run.

The swapper computes fp32 reference outputs in the serving process (the verification set, and
the canary's shadow checks on live inputs). On a machine whose cores the requests already use,
every millisecond of that work that overlaps a request stretches the request: measured in
``bench/hotswap.py`` (MiniLM, 2 cores, 2 clients), four shadow forwards per canary lifted the
request p99 from 24 to 44 ms. Lower thread priority alone does not help much: a request's
OpenMP barriers wait for whichever of its threads was preempted.

:class:`YieldToRequests` is a torch function mode, so it is active in the thread that enters it
and nowhere else: before each torch operation of that thread it waits while any request is in
flight (up to ``max_wait_s`` per operation, ``budget_s`` in all, so that saturating traffic
delays the background work but cannot stall it). Only for eager modules: a compiled module
would see the mode while tracing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode

POLL_S = 0.0002


class YieldToRequests(TorchFunctionMode):
    def __init__(self, requests_in_flight: Callable[[], bool], *, max_wait_s: float = 0.02, budget_s: float = 2.0) -> None:
        super().__init__()
        self.requests_in_flight = requests_in_flight
        self.max_wait_s = max_wait_s
        self.budget_s = budget_s
        self.waited_s = 0.0

    def wait(self) -> None:
        """Wait for a moment with no request in flight (within the limits)."""
        if self.waited_s >= self.budget_s or not self.requests_in_flight():
            return
        started = time.monotonic()
        deadline = started + min(self.max_wait_s, self.budget_s - self.waited_s)
        while self.requests_in_flight() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.waited_s += time.monotonic() - started

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.wait()
        return func(*args, **(kwargs or {}))
