"""Whether the executor micro-batches concurrent calls now, chosen on live traffic.

Why: a batch of four calls is not always cheaper than four calls. Measured on a 2-core VM
(MiniLM, 128 tokens): fp32 eager runs a batch of 4 in 98 ms against 4 x 37 ms alone, so
batching raises its throughput 1.5x; the int8 dynamic · Inductor variant, compiled for batch 1,
runs a batch of 4 in 96 ms against 4 x 9.4 ms (the other shapes leave its static kernels), so
batching cut the served throughput to 0.6x (``bench/threads.py``, 4 client threads). And under
light traffic no call waits for another: gathering only adds ``max_delay_ms`` to every call.
So the user's ``max_batch`` (their promise that rows are independent) allows batching; this
decides whether it serves.

How: the inference thread alternates blocks of ``block_calls`` calls with batching on and off,
and records per block the inference thread's busy time per call (its capacity: time spent
waiting for a batch to fill is not busy) and every call's latency from arrival to answer.
Once each arm has ``blocks_per_arm`` blocks, batching serves if its busy time per call is
lower than without by ``margin`` with confidence (trimmed means over blocks, bootstrap; see
:mod:`~pgc_daemon.agent.livecompare`) and, where the policy has a latency target, the
batching arm's latency at the target's percentile meets it; otherwise calls are served one by
one. Traffic changes, so it decides again every ``reprobe_s``.

Threading: :meth:`BatchChoice.batching` and :meth:`BatchChoice.record` run on the inference
thread only; :meth:`BatchChoice.status` reads from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pgc_daemon.agent.livecompare import LiveComparison, compare

log = logging.getLogger("pgc.agent")

#: Calls per block of one arm.
BLOCK_CALLS = 32
#: Blocks per arm before deciding.
BLOCKS_PER_ARM = 4
#: Batching must lower the busy time per call by this much, with confidence.
MARGIN = 0.05
#: Decide again after this long.
REPROBE_S = 300.0

Target = tuple[float, str]
"""A latency target: (milliseconds, percentile such as "p95")."""


class BatchChoice:
    def __init__(
        self,
        *,
        block_calls: int = BLOCK_CALLS,
        blocks_per_arm: int = BLOCKS_PER_ARM,
        margin: float = MARGIN,
        reprobe_s: float = REPROBE_S,
        target: Callable[[], Target | None] = lambda: None,
        notify: Callable[[str, dict[str, Any]], None] = lambda message, data: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``target()``: the policy's latency target now (None: none). ``notify(message,
        data)`` hears every decision, on the inference thread (keep it cheap)."""
        self.block_calls = block_calls
        self.blocks_per_arm = blocks_per_arm
        self.margin = margin
        self.reprobe_s = reprobe_s
        self._target = target
        self._notify = notify
        self._clock = clock
        self._lock = threading.Lock()  # status() reads from other threads
        self.chosen: bool | None = None
        self.decided_at = 0.0
        self.last: dict[str, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self._arm = True  # the arm of the block being served
        self._calls = self._busy_ns = 0
        self._costs: dict[bool, list[float]] = {True: [], False: []}  # busy ms per call, by block
        self._latency: dict[bool, list[float]] = {True: [], False: []}  # ms, every call

    def batching(self) -> bool:
        """Whether the next call taken gathers a batch."""
        if self.chosen is not None:
            if self._clock() - self.decided_at <= self.reprobe_s:
                return self.chosen
            with self._lock:
                self.chosen = None  # traffic may have changed: probe again
            self._reset()
        return self._arm

    def record(self, arrivals: list[float], busy_ns: int, answered_at: float) -> None:
        """One run of the inference thread: the arrival times (``time.monotonic``) of the
        calls it answered, how long it ran, and when it was done."""
        if self.chosen is not None or not arrivals:
            return
        arm = self._arm
        self._calls += len(arrivals)
        self._busy_ns += busy_ns
        self._latency[arm].extend((answered_at - at) * 1e3 for at in arrivals)
        if self._calls < self.block_calls:
            return
        self._costs[arm].append(self._busy_ns / self._calls / 1e6)
        self._calls = self._busy_ns = 0
        self._arm = not arm
        if min(len(c) for c in self._costs.values()) >= self.blocks_per_arm:
            self._decide()

    def _decide(self) -> None:
        c = compare(self._costs[True], self._costs[False])
        target = self._target()
        on_ms = _percentile(self._latency[True], target[1] if target else "p95")
        off_ms = _percentile(self._latency[False], target[1] if target else "p95")
        cheaper = c.high < 1.0 - self.margin
        within = target is None or on_ms <= target[0]
        chosen = cheaper and within
        last = {"batching": chosen,
                "busy_ms_per_call": {"on": c.candidate_ms, "off": c.control_ms},
                "latency_ms": {"on": on_ms, "off": off_ms},
                "percentile": target[1] if target else "p95",
                "target_ms": target[0] if target else None}
        with self._lock:
            self.chosen, self.decided_at, self.last = chosen, self._clock(), last
        message = _describe(chosen, c, cheaper, target, on_ms)
        log.info("%s", message)
        self._notify(message, last)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"batching": self.chosen, "probing": self.chosen is None, **self.last}


def _percentile(ms: list[float], q: str) -> float:
    return float(np.percentile(ms, float(q.lstrip("p")))) if ms else float("nan")


def _describe(
    chosen: bool, c: LiveComparison, cheaper: bool, target: Target | None, on_ms: float
) -> str:
    cost = (f"{c.candidate_ms:.2f} ms of inference per call with batching, "
            f"{c.control_ms:.2f} without ({1 / c.ratio:.2f}x throughput, "
            f"95% interval {1 / c.high:.2f}-{1 / c.low:.2f}x)")
    if chosen:
        return f"micro-batching serves: {cost}"
    if not cheaper:
        return f"micro-batching off: it does not raise throughput here: {cost}"
    assert target is not None
    return (f"micro-batching off: {target[1]} latency with it {on_ms:.1f} ms is over the "
            f"policy's target {target[0]:.1f} ms ({cost})")


def choice_for(
    options: dict[str, Any] | None, policy: Callable[[], Any], profiler: Any
) -> BatchChoice | None:
    """The choice of a served model whose executor may batch (None where it may not):
    the latency target is the policy's (``policy()`` returns the latest one read), and its
    decisions become the profiler's ``batching`` events (stored with the model's events)."""
    if not options or options.get("max_batch", 1) <= 1:
        return None

    def target() -> Target | None:
        p = policy()
        return None if p.latency_target_ms is None else (p.latency_target_ms, p.latency_percentile)

    return BatchChoice(
        target=target,
        notify=lambda message, data: profiler.event("batching", "info", message, data),
    )
