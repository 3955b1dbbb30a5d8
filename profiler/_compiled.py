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
makes a sampled call somewhat slower than others: rows say where a call's time goes. A
sampled call far slower than live calls stalled (:meth:`KernelTimer.stalled`): a kernel it
was preempted in would be given the time, so it gives no rows.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from profiler._hooks import RawCall
from profiler._trace import TraceBusy, end_trace, exclusive_trace, try_trace

_perf_ns = time.perf_counter_ns
BETWEEN = "(between kernels)"
#: the longest op type a row carries (the store's column)
OP_TYPE_MAX = 100
#: the most a calibration may say one recorded event costs (a preempted call is not one)
MAX_EVENT_NS = 50_000
#: a sampled call this many times slower than live calls, over what its sampled calls
#: usually read against them, stalled (see :meth:`KernelTimer.stalled`)
STALL_RATIO = 1.5
#: the sampled calls whose ratio to live calls say what is usual
STALL_HISTORY = 16


#: what Inductor's C++ GEMM templates (max-autotune) put between the graph prefix and the
#: kernel's name in its event: ``graph_0_gemm_m32n64k64_cpp_fused_…``
_TEMPLATE_PREFIX = re.compile(r"^(?:grouped_gemm_g\d+|gemm_)m\d+n\d+k\d+_(?=cpp_)")


def event_name(name: str) -> str:
    """An event's name as a kernel map keys it (generated kernels carry a graph prefix, and a
    GEMM template's the shape of its blocks as well)."""
    if name.startswith("graph_"):
        head, _, rest = name[6:].partition("_")
        if head.isdigit():
            return _TEMPLATE_PREFIX.sub("", rest, count=1)
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
            with exclusive_trace(), profile(activities=[ProfilerActivity.CPU]):
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
        self.target = module  # what a sampled call runs (the caller may run a twin instead)
        self.kernel_layers = {k: [list(v) for v in calls] for k, calls in kernel_layers.items()}
        self._seq = 0
        self._trace: Any = None
        self._last: Any = None
        self._fixed_ns, self._event_ns = event_cost_ns()
        self._twin_ns = 0  # what the twin costs over the variant (``calibrate``)
        #: sampled calls' time over live calls' (``stalled``), the last STALL_HISTORY
        self.ratios: collections.deque[float] = collections.deque(maxlen=STALL_HISTORY)

    def close(self) -> None:
        """Nothing to let go of (a ``LayerTimer`` lets go of its hook twin)."""

    def attach(self, counters: bool = False) -> None:  # noqa: ARG002 - no counters per kernel
        """Trace this call; ``TraceBusy`` (the call is not sampled) while another trace in
        this process is in flight: two at once end the process (``profiler._trace``)."""
        self._seq += 1
        self._trace = try_trace()
        if self._trace is None:
            raise TraceBusy("another torch.profiler trace is in flight")

    def calibrate(self, twin: Callable[[], Any], variant: Callable[[], Any],
                  repeats: int = 12) -> int:
        """Measure, on this process's own calls (``twin`` and ``variant`` each run one call
        of the module sampled calls run and of the one every other call runs), what a sampled
        call costs that the live call does not, and take it out of sampled calls from then
        on; returns it (ns). Calls are timed interleaved, in rounds: the variant, the twin
        without the profiler, the variant again (untimed), the twin with it: each twin call
        follows a variant call, as a sampled call does (the twin right after itself runs
        warmer than live). Two parts, each the median over rounds of a
        difference within the round (a round a burst of other work hits moves one
        difference, not the estimate): what recording costs per event (the twin with and
        without the profiler), and what the twin costs over the variant without it: a
        package built with kernel events ran 9% slower than the variant itself (MiniLM int8
        static at 2 threads: 7.63 against 6.99 ms), which the rows had read as time between
        kernels (7-12% over live in the demos)."""
        from torch.autograd.profiler import profile  # noqa: PLC0415

        recording, twin_extra, events = [], [], []
        for _ in range(repeats):
            plain = _timed(variant)
            off = _timed(twin)
            variant()
            with exclusive_trace(), profile(use_cpu=True) as trace:
                t = _perf_ns()
                twin()
                on = _perf_ns() - t
            events.append(sum(1 for _ in trace.kineto_results.events()))
            recording.append(on - off)
            twin_extra.append(off - plain)
        n = statistics.median(events)
        if n > 0:
            extra = statistics.median(recording) - self._fixed_ns
            self._event_ns = int(min(max(extra / n, 0.0), MAX_EVENT_NS))
        self._twin_ns = int(max(statistics.median(twin_extra), 0.0))
        return self._fixed_ns + int(n * self._event_ns) + self._twin_ns

    def stalled(self, call_ms: float, typical_ms: float | None) -> bool:
        """Whether a sampled call that took ``call_ms`` (net of the profiler's cost) stalled:
        it ran over :data:`STALL_RATIO` times the live calls' median (``typical_ms``), times
        what this module's sampled calls usually read against it when that is over 1. A call
        preempted in a kernel gives that kernel milliseconds it did not compute: in a demo
        the twin's first two sampled calls, while other processes kept 1.5 of 2 cores busy,
        read 18.5 ms of rows against 8.2 ms live, a layer norm's kernel 1.9 ms (0.02 ms
        otherwise), and with 5 calls from quiet moments the rows came to 1.32x live. A twin
        slower than its variant every time raises what is usual after a few calls, so its
        calls are kept, not all dropped. Without live calls to compare with (an offline
        profile samples every call) nothing is judged stalled."""
        if typical_ms is None or typical_ms <= 0:
            return False
        ratios = self.ratios
        usual = statistics.median(ratios) if len(ratios) >= 3 else 1.0
        ratio = call_ms / typical_ms
        ratios.append(ratio)
        return ratio > STALL_RATIO * max(usual, 1.0)

    def detach(self) -> None:
        trace, self._trace = self._trace, None
        if trace is not None:
            end_trace(trace)
            self._last = trace

    def take(self) -> RawCall:
        raw = RawCall(self._seq)
        raw.trace, self._last = self._last, None
        return raw

    def count_events(self, raw: RawCall) -> None:
        """The profiler's cost inside the call: its events (background thread). Reads the
        trace's records as the profiler left them, ``(name, start ns, end ns, thread)``:
        ``events()`` would build a tree of Python objects first, 18× the cost (MiniLM's 213
        events: 8.7 ms against 0.48 ms on a 2-core VM), charged to the budget."""
        raw.trace = [(e.name(), e.start_ns(), e.end_ns(), e.start_thread_id())
                     for e in raw.trace.kineto_results.events()]
        raw.overhead_ns = self._fixed_ns + len(raw.trace) * self._event_ns + self._twin_ns

    def label(self, kernel: str) -> str:
        """What a kernel's rows give as their op type: its name."""
        return kernel

    def results(self, raw: RawCall | None = None, gpu_ms: Any = None,
                kernels: Any = None) -> list[tuple[Any, ...]]:
        """(layer, op type, milliseconds, None) per layer, plus ``(between kernels)``."""
        if raw is None or raw.trace is None:
            return []
        ms: dict[tuple[str, str], float] = {}
        seen: dict[str, int] = {}
        kernel_total = 0.0
        for _start, name, elapsed_ns, nested in _outermost_kernels(raw.trace, self.kernel_layers):
            calls = self.kernel_layers[name]
            i = seen.get(name, 0)
            seen[name] = i + 1
            layers = calls[min(i, len(calls) - 1)]
            net = max(elapsed_ns - nested * self._event_ns, 0.0) / 1e6
            kernel_total += net
            for layer in layers:
                others = [x for x in layers if x != layer]
                op = _op_type(self.label(name), others)
                key = (layer, op)
                ms[key] = ms.get(key, 0.0) + net / len(layers)
        if not ms:
            return []
        out: list[tuple[Any, ...]] = [(layer, op, v, None) for (layer, op), v in ms.items()]
        call_ms = raw.call_ms
        if call_ms is not None:  # every call has the row (0 where the profiler's cost taken
            # out left less than its kernels: left out, the row's mean counted only the
            # calls where the wrapper read long, and its count fell behind the kernels')
            out.append((BETWEEN, "wrapper", max(call_ms - kernel_total, 0.0), None))
        return out


@dataclasses.dataclass(frozen=True)
class NodeKernels:
    """What a profiler needs of a compiled module that times its own nodes (an OpenVINO model
    compiled with ``PERF_COUNT``), given to ``Profiler.watch`` as its ``kernels``: which layers
    each node computes (``layers``, the kernel map's shape) and how to read the nodes' times
    after a sampled call (``read``: ``(node, ns, label)`` per executed node, in order; the
    module's own figures: OpenVINO's are each node's mean over the calls it ran)."""

    layers: Mapping[str, Sequence[Sequence[str]]]
    read: Callable[[], list[tuple[str, int, str]]]


class NodeTimer(KernelTimer):
    """Times a compiled module through its own per-node times (:class:`NodeKernels`), read in
    ``end``, on the serving thread, after a sampled call. Rows as :class:`KernelTimer`'s: a
    node's time split over the layers it was made from, the rest of the call (the runtime
    between nodes, the module's own Python) as ``(between kernels)``. No trace runs; what a
    sampled call costs over a live one is the counting copy's own (its twin) cost, measured by
    :meth:`calibrate` and taken out. OpenVINO's node times are means over every call the
    counting copy ran, so a sampled call's node rows are those means (its ``(between
    kernels)`` is the call's own rest)."""

    def __init__(self, module: nn.Module, kernels: NodeKernels) -> None:
        super().__init__(module, kernels.layers)
        self._read = kernels.read
        self._fixed_ns = self._event_ns = 0
        self._armed = False
        self.labels: dict[str, str] = {}

    def attach(self, counters: bool = False) -> None:  # noqa: ARG002 - no counters per node
        self._seq += 1
        self._armed = True

    def calibrate(self, twin: Callable[[], Any], variant: Callable[[], Any],
                  repeats: int = 12) -> int:
        """What a call of the counting twin costs over one of the variant (median over rounds
        of the difference within each round), taken out of sampled calls from then on."""
        extra = []
        for _ in range(repeats):
            plain = _timed(variant)
            extra.append(_timed(twin) - plain)
        self._twin_ns = int(max(statistics.median(extra), 0.0))
        return self._twin_ns

    def detach(self) -> None:
        if self._armed:
            self._armed = False
            self._last = self._read()

    def count_events(self, raw: RawCall) -> None:
        """The nodes, laid end to end as events (the counters give durations, not starts)."""
        events, t = [], 0
        for name, ns, label in raw.trace:
            events.append((name, t, t + ns, 0))
            self.labels[name] = label
            t += ns
        raw.trace, raw.overhead_ns = events, self._twin_ns

    def label(self, kernel: str) -> str:
        """A node's type and implementation (``Convolution (brgconv_avx512_amx_I8)``)."""
        return self.labels.get(kernel, kernel)


def _timed(call: Callable[[], Any]) -> int:
    """One call's wall time, ns."""
    t = _perf_ns()
    call()
    return _perf_ns() - t


def _outermost_kernels(
    events: Sequence[tuple[str, int, int, int]], names: Mapping[str, Any]
) -> list[tuple[int, str, int, int]]:
    """``(start ns, kernel, elapsed ns, events nested in it)`` for every event of a mapped
    kernel that no other mapped kernel encloses, in the order they started. Nesting is read
    from the intervals, per thread: an event that starts before an enclosing one ends is
    inside it."""
    out: list[tuple[int, str, int, int]] = []
    thread = None
    open_ends: list[int] = []  # ends of the events enclosing the current one, innermost last
    outer: list[Any] | None = None  # the enclosing mapped kernel: [start, name, elapsed, nested]
    outer_depth = 0
    for name, start, end, tid in sorted(events, key=lambda e: (e[3], e[1], -e[2])):
        if tid != thread:
            if outer is not None:
                out.append(tuple(outer))  # type: ignore[arg-type]
            thread, open_ends, outer = tid, [], None
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        if outer is not None and len(open_ends) < outer_depth:
            out.append(tuple(outer))  # type: ignore[arg-type]
            outer = None
        if outer is not None:
            outer[3] += 1
        else:
            key = event_name(name)
            if key in names:
                outer, outer_depth = [start, key, end - start, 0], len(open_ends) + 1
        open_ends.append(end)
    if outer is not None:
        out.append(tuple(outer))  # type: ignore[arg-type]
    out.sort()
    return out


def _op_type(kernel: str, others: list[str]) -> str:
    """``kernel (fused with a, b)``, at most :data:`OP_TYPE_MAX` characters (the store's
    column): a generated kernel's name lists every op it fuses and can run long."""
    fused = f" (fused with {', '.join(others)})" if others else ""
    if len(fused) > OP_TYPE_MAX // 2 and len(others) > 1:
        fused = f" (fused with {others[0]} and {len(others) - 1} more)"
    room = OP_TYPE_MAX - len(fused)
    name = kernel if len(kernel) <= room else kernel[: room - 1] + "…"
    return (name + fused)[:OP_TYPE_MAX]
