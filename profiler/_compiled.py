"""Per-layer time of a compiled variant: its kernels, timed on a sampled call and split over
the layers they were generated from.

Hooks cannot see inside a compiled module. Its kernels can be seen: a sampled call runs under
``torch.profiler`` (CPU activity, this call only), whose events name every generated kernel
and library call; a map from event names to layers, made when the variant was compiled
(``compiler._kernel_map``: ``{name: [layers of its 1st call, of its 2nd, ...]}``), says which
layers each computes. A kernel that covers several layers is split evenly over them, and
their rows say so (``fused with ...``); the time between kernels (the wrapper) is a row of its
own, ``(between kernels)``, so a call's rows add up to the call.

The profiler's own cost inside the call (a fixed part and a cost per event it records) is
measured once per process (:func:`event_cost_ns`) and taken out: of every kernel's time, for
the events nested in it, and of the call's, for all of them. Events are read on the
background thread. What is left of the profiler's effect (caches it evicted before the call)
makes a sampled call somewhat slower than others: rows say where a call's time goes.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from profiler._hooks import RawCall

_perf_ns = time.perf_counter_ns
BETWEEN = "(between kernels)"
#: the longest op type a row carries (the store's column)
OP_TYPE_MAX = 100


def event_name(name: str) -> str:
    """An event's name as a kernel map keys it (generated kernels carry a graph prefix)."""
    if name.startswith("graph_"):
        head, _, rest = name[6:].partition("_")
        if head.isdigit():
            return rest
    return name


@functools.lru_cache(maxsize=1)
def event_cost_ns() -> tuple[int, int]:
    """What ``torch.profiler`` adds inside a call, in ns: (a fixed part, the cost of each
    event it records), from ops timed with the profiler on and off (median of repeats)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    # kineto prints two lines per trace ("profiler_start", "profiler_stop") unless its log
    # level is raised before its first trace in the process; a user's own setting stands
    os.environ.setdefault("KINETO_LOG_LEVEL", "10")
    x = torch.zeros(1)

    def run(n: int) -> int:
        t = _perf_ns()
        for _ in range(n):
            torch.neg(x)
        return _perf_ns() - t

    extra = {}
    for n in (1, 101):
        plain, profiled = [], []
        for _ in range(5):
            plain.append(run(n))
            with profile(activities=[ProfilerActivity.CPU]):
                profiled.append(run(n))
        extra[n] = statistics.median(profiled) - statistics.median(plain)
    per_event = max(0.0, (extra[101] - extra[1]) / 100)
    return max(0, int(extra[1] - per_event)), int(per_event)


class KernelTimer:
    """Times one compiled module per sampled call (the interface of ``LayerTimer``)."""

    gpu = None
    counters = None

    def __init__(self, module: nn.Module,
                 kernel_layers: Mapping[str, Sequence[Sequence[str]]]) -> None:
        self.modules = [module]
        self.kernel_layers = {k: [list(v) for v in calls] for k, calls in kernel_layers.items()}
        self._seq = 0
        self._trace: Any = None
        self._last: Any = None
        self._fixed_ns, self._event_ns = event_cost_ns()

    def attach(self, counters: bool = False) -> None:  # noqa: ARG002 - no counters per kernel
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        self._seq += 1
        self._trace = profile(activities=[ProfilerActivity.CPU])
        self._trace.__enter__()

    def detach(self) -> None:
        trace, self._trace = self._trace, None
        if trace is not None:
            trace.__exit__(None, None, None)
            self._last = trace

    def take(self) -> RawCall:
        raw = RawCall(self._seq)
        raw.trace, self._last = self._last, None
        return raw

    def count_events(self, raw: RawCall) -> None:
        """The profiler's cost inside the call: its events (background thread)."""
        raw.trace = list(raw.trace.events())
        raw.overhead_ns = self._fixed_ns + len(raw.trace) * self._event_ns

    def results(self, raw: RawCall | None = None, gpu_ms: Any = None,
                kernels: Any = None) -> list[tuple[Any, ...]]:
        """(layer, op type, milliseconds, None) per layer, plus ``(between kernels)``."""
        if raw is None or raw.trace is None:
            return []
        events = raw.trace
        ms: dict[tuple[str, str], float] = {}
        seen: dict[str, int] = {}
        kernel_total = 0.0
        for ev in sorted(events, key=lambda e: e.time_range.start):
            name = event_name(ev.name)
            calls = self.kernel_layers.get(name)
            if calls is None or _inside_kernel(ev, self.kernel_layers):
                continue
            i = seen.get(name, 0)
            seen[name] = i + 1
            layers = calls[min(i, len(calls) - 1)]
            nested = _count_nested(ev)
            net = max(ev.time_range.elapsed_us() * 1e3 - nested * self._event_ns, 0.0) / 1e6
            kernel_total += net
            for layer in layers:
                others = [x for x in layers if x != layer]
                op = _op_type(name, others)
                key = (layer, op)
                ms[key] = ms.get(key, 0.0) + net / len(layers)
        if not ms:
            return []
        out: list[tuple[Any, ...]] = [(layer, op, v, None) for (layer, op), v in ms.items()]
        call_ms = raw.call_ms
        if call_ms is not None and call_ms > kernel_total:
            out.append((BETWEEN, "wrapper", call_ms - kernel_total, None))
        return out


def _op_type(kernel: str, others: list[str]) -> str:
    """``kernel (fused with a, b)``, at most :data:`OP_TYPE_MAX` characters (the store's
    column): a generated kernel's name lists every op it fuses and can run long."""
    fused = f" (fused with {', '.join(others)})" if others else ""
    if len(fused) > OP_TYPE_MAX // 2:
        fused = f" (fused with {others[0]} and {len(others) - 1} more)"
    room = OP_TYPE_MAX - len(fused)
    name = kernel if len(kernel) <= room else kernel[: room - 1] + "…"
    return (name + fused)[:OP_TYPE_MAX]


def _count_nested(ev: Any) -> int:
    n, stack = 0, list(ev.cpu_children)
    while stack:
        c = stack.pop()
        n += 1
        stack.extend(c.cpu_children)
    return n


def _inside_kernel(ev: Any, names: Mapping[str, Any]) -> bool:
    """Whether an event runs inside another mapped kernel (counted with it already)."""
    parent = ev.cpu_parent
    while parent is not None:
        if event_name(parent.name) in names:
            return True
        parent = parent.cpu_parent
    return False
