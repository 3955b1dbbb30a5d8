"""Per-layer timing through forward hooks, run only by the call being sampled.

A sampled call runs through the model's hook twin (:mod:`profiler._twin`): the same modules
copied shallowly (parameters and every attribute shared), with the timer's hooks on every
twin module. Other calls, in this thread or others, run the original, which has no hooks, so
sampling one call costs no other call anything; attaching costs nothing per module. Where
the model cannot be twinned (TorchScript modules) or its structure changed since it was
watched, the call runs the original with two process-wide module hooks
(``register_module_forward_pre_hook`` / ``register_module_forward_hook``) registered for its
length: then every module call in the process takes torch's hooked path meanwhile, and what
that costs other threads is charged to the sampled call (``RawCall.foreign_ns``), so the
budget sees it. The caller runs whatever :attr:`LayerTimer.target` names.

Inclusive times are taken for every module; a leaf reports its inclusive time and a
container reports its *self* time (inclusive minus its children), which is where functional
code such as attention matmuls and pooling runs. The layer times of one call therefore add up
to (nearly) the whole call.

Every time is net of the profiler's own work: each hook times itself, and a module's
inclusive time has the hook time spent inside it taken out, together with the dispatch cost
torch adds per hooked module call (measured once per process, :func:`dispatch_cost_ns`).
That same sum is the sampled call's overhead, which the budget is charged with.

Optional per-layer extras: ``counters`` (anything with ``read() -> dict``, e.g.
:class:`~profiler.PerfCounters`) gives counter deltas per layer, with ``calls: 1`` beside
them (summed over calls, it says how many calls the sums cover: counters may be read on only
some sampled calls); ``gpu`` (a
:class:`~profiler._gpu.CudaLayerEvents`) records CUDA events around each layer and pushes
CUPTI external correlation ids, resolved after the call by the profiler's background thread.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.modules.module as _module
from torch import nn

from profiler._twin import HookTwin, TwinUnavailable

_perf_ns = time.perf_counter_ns
_ident = threading.get_ident

#: torch warns on every call of a ``torch.compile``-d module made while any process-wide hook
#: exists: while one thread's call is sampled, another thread calling a compiled variant
#: would warn (and fail under ``-W error``). The hooks ignore other threads and modules not
#: watched, so the extra call the warning is about does nothing: silence just that warning.
GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
warnings.filterwarnings("ignore", message=GLOBAL_HOOK_WARNING, category=UserWarning)


def _hooked_cost_ns(hook: Any, unhook: Any, mod: nn.Module | None = None) -> int:
    """What hooks add to one call of a module, in ns: ``mod`` (an ``nn.Identity``) called with
    and without them (``hook()`` puts them on, ``unhook()`` takes them off), median of
    repeats."""
    mod = mod if mod is not None else nn.Identity()
    x = torch.zeros(1)
    n = 300

    def run() -> int:
        t = _perf_ns()
        for _ in range(n):
            mod(x)
        return _perf_ns() - t

    plain, hooked = [], []
    for _ in range(5):
        plain.append(run())
        hook()
        try:
            hooked.append(run())
        finally:
            unhook()
    return max(0, int((statistics.median(hooked) - statistics.median(plain)) / n))


@functools.lru_cache(maxsize=2)
def dispatch_cost_ns(per_module: bool = False) -> int:
    """What a pair of (empty) forward hooks adds to one module call, in ns: torch's slow path
    with hooks present, process-wide ones or (``per_module``) the module's own, as a twin
    has. Measured once per process, so the overhead ledger can charge it without timing it
    on every call."""
    handles: list[Any] = []

    def hook() -> None:
        if per_module:
            handles[:] = [probe.register_forward_pre_hook(lambda m, a: None),
                          probe.register_forward_hook(lambda m, a, o: None)]
            return
        handles[:] = [
            _module.register_module_forward_pre_hook(lambda m, a: None),
            _module.register_module_forward_hook(lambda m, a, o: None, always_call=True),
        ]

    def unhook() -> None:
        for h in handles:
            h.remove()

    probe = nn.Identity()
    return _hooked_cost_ns(hook, unhook, probe)


@functools.lru_cache(maxsize=1)
def foreign_cost_ns() -> int:
    """What the hooks of a call being timed add to one module call of another thread (torch's
    hooked path, and both hooks returning at once on seeing another thread), in ns. Measured
    once per process with a real timer attached for no thread."""
    timer = LayerTimer(nn.Identity(), foreign_ns=0, twin=False)

    def hook() -> None:
        timer.attach(counters=False)
        timer._thread = -1  # noqa: SLF001 - every call is another thread's

    return _hooked_cost_ns(hook, timer.detach)


@dataclass
class RawCall:
    """What one sampled call measured, before it is turned into layer rows (that happens off
    the request path). Times in ns; ``overhead_ns`` is the profiler's own time inside the call."""

    seq: int
    incl: dict[int, int] = field(default_factory=dict)
    counters: dict[int, dict[str, float]] = field(default_factory=dict)
    overhead_ns: int = 0
    hooks: int = 0
    #: what the hooks cost other threads' module calls meanwhile (the hooks are process-wide:
    #: each such call takes torch's hooked path and returns from the hooks at once), charged
    #: to this call: that path's cost per call, calibrated (:func:`foreign_cost_ns`)
    foreign_ns: int = 0
    gpu: Any = None
    counter_names: tuple[str, ...] | None = None
    #: a compiled module's call: the ``torch.profiler`` trace of its kernels, and the call's
    #: time net of the profiler (set on the background thread)
    trace: Any = None
    call_ms: float | None = None


class LayerTimer:
    """Times the modules of one model for one call at a time."""

    def __init__(self, model: nn.Module, counters: Any | None = None, gpu: Any | None = None,
                 *, foreign_ns: int | None = None, twin: bool = True) -> None:
        """``foreign_ns``: what another thread's module call costs while process-wide hooks
        are on (default: :func:`foreign_cost_ns`, calibrated once per process); ``twin``:
        False times the original through process-wide hooks even where a twin could be
        made."""
        self._index: dict[int, int] = {}
        self.names: list[str] = []
        self.op_types: list[str] = []
        self.modules: list[nn.Module] = []
        for name, mod in model.named_modules():
            if id(mod) in self._index:
                continue  # a shared module is timed under its first name
            self._index[id(mod)] = len(self.names)
            self.names.append(name or "(root)")
            self.op_types.append(type(mod).__name__)
            self.modules.append(mod)
        self.children: list[list[int]] = [
            [self._index[id(c)] for c in mod.children() if id(c) in self._index]
            for mod in self.modules
        ]
        #: the twin sampled calls run (None: the original, through process-wide hooks)
        self.twin: HookTwin | None = None
        self.twin_reason: str | None = None
        self._global_index = self._index
        if twin:
            try:
                self.twin = HookTwin(model, self._pre, self._post)
                self._index = {id(self.twin.twin_of(m)): i for i, m in enumerate(self.modules)}
            except TwinUnavailable as exc:
                self.twin_reason = str(exc)
        else:
            self.twin_reason = "off (hook_twin=False)"
        self._foreign_given = foreign_ns
        #: the module the sampled call must run: the twin, or the original
        self.target: nn.Module = self.twin.root if self.twin is not None else model
        self.counters = counters
        self.gpu = gpu
        self._read: Any = counters.read if counters is not None else None
        #: counter names when the reader returns tuples (PerfCounters.reader), else None
        self._names: tuple[str, ...] | None = None
        self._dispatch = dispatch_cost_ns(per_module=self.twin is not None)
        self._foreign = 0 if self.twin is not None else self._global_foreign()
        self._thread: int | None = None
        self._handles: list[Any] = []
        self._seq = 0
        self._raw = RawCall(0)
        self._stack: list[tuple[Any, ...]] = []

    # ----------------------------------------------------------------- hooks

    def _pre(self, mod: nn.Module, _args: Any) -> None:
        t0 = _perf_ns()
        if _ident() != self._thread:
            self._raw.foreign_ns += self._foreign  # racy between threads: an estimate
            return
        i = self._index.get(id(mod))
        if i is None:
            return
        read = self._read
        snap = read() if read is not None else None
        ev = self.gpu.pre(i) if self.gpu is not None else None
        raw = self._raw
        t1 = _perf_ns()
        raw.overhead_ns += t1 - t0 + self._dispatch
        raw.hooks += 1
        self._stack.append((i, t1, raw.overhead_ns, snap, ev))

    def _post(self, mod: nn.Module, _args: Any, _out: Any) -> None:
        t0 = _perf_ns()
        if _ident() != self._thread:
            return
        i = self._index.get(id(mod))
        if i is None:
            return
        stack = self._stack
        while stack:  # an exception may have skipped inner frames: unwind to ours
            frame = stack.pop()
            if frame[0] == i:
                break
        else:
            return
        _, start, ovh_start, snap, ev = frame
        raw = self._raw
        raw.incl[i] = raw.incl.get(i, 0) + (t0 - start) - (raw.overhead_ns - ovh_start)
        if snap is not None:
            now = self._read()
            acc = raw.counters.get(i)
            if self._names is not None:  # tuples: summed in place, named in results()
                if acc is None:
                    raw.counters[i] = [a - b for a, b in zip(now, snap)]  # type: ignore[assignment]
                else:
                    for j, (a, b) in enumerate(zip(now, snap)):
                        acc[j] += a - b  # type: ignore[index]
            elif acc is None:
                raw.counters[i] = {k: v - snap.get(k, 0.0) for k, v in now.items()}
            else:
                for k, v in now.items():
                    acc[k] = acc.get(k, 0.0) + (v - snap.get(k, 0.0))
        if ev is not None:
            self.gpu.post(i, ev)  # type: ignore[union-attr]
        raw.overhead_ns += _perf_ns() - t0

    # ----------------------------------------------------------------- one call

    def attach(self, counters: bool = True) -> None:
        """Start timing this thread's next call through the model (reading the counters per
        layer too, unless ``counters`` is false)."""
        self._seq += 1
        self._raw = RawCall(self._seq)
        self._stack = []
        self._thread = _ident()
        source = self.counters if counters else None
        fast = getattr(source, "reader", None)
        reader = fast() if fast is not None else None
        if reader is not None:
            self._read, self._names = reader, tuple(source.names)  # type: ignore[union-attr]
        elif source is not None:
            self._read, self._names = source.read, None
        else:
            self._read, self._names = None, None
        if self.gpu is not None:
            self.gpu.start_call(self._seq)
        if self.twin is not None:
            if self.twin.refresh():
                return
            self._untwin("the model's modules changed after it was watched")
        self._handles = [
            _module.register_module_forward_pre_hook(self._pre),
            _module.register_module_forward_hook(self._post, always_call=True),
        ]

    def close(self) -> None:
        """Let go of the twin (the profiler no longer times this model). Its modules carry
        this timer's hooks, a reference cycle that a ``gc.freeze`` in the serving process
        would keep, with the model's weights, until the next unfreeze; this breaks it."""
        twin, self.twin = self.twin, None
        if twin is not None:
            twin.close()
            self.twin_reason = "closed"

    def _untwin(self, reason: str) -> None:
        """From now on, time this model through process-wide hooks on the original."""
        self.close()
        self.twin_reason = reason
        self._index = self._global_index
        self.target = self.modules[0]
        self._dispatch = dispatch_cost_ns()
        self._foreign = self._global_foreign()

    def _global_foreign(self) -> int:
        return foreign_cost_ns() if self._foreign_given is None else self._foreign_given

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._thread = None
        twin = self.twin
        if twin is not None:
            twin.write_back()
        if self.gpu is not None:
            self.gpu.end_call()

    @property
    def foreign_ns(self) -> int:
        """What the call being timed has cost other threads' module calls so far."""
        return self._raw.foreign_ns

    def take(self) -> RawCall:
        """The measurements of the call just timed (the timer is ready for the next one)."""
        raw = self._raw
        raw.counter_names = self._names  # tuples until results() names them, off the request path
        if self.gpu is not None:
            raw.gpu = self.gpu.take()
        self._raw = RawCall(self._seq)
        return raw

    # ----------------------------------------------------------------- results

    def _called_below(self, key: int, called: dict[int, Any]) -> list[int]:
        """The nearest descendants of ``key`` that ran in this call (containers such as
        ``ModuleList`` are never called themselves, so look through them)."""
        out: list[int] = []
        stack = list(self.children[key])
        while stack:
            k = stack.pop()
            if k in called:
                out.append(k)
            else:
                stack.extend(self.children[k])
        return out

    def results(self, raw: RawCall | None = None, gpu_ms: dict[int, float] | None = None,
                kernels: dict[int, list[Any]] | None = None) -> list[tuple[Any, ...]]:
        """(name, op type, milliseconds, counters, kernels) per layer for one call: leaves
        with their inclusive time, containers with their self time when it is positive.

        With ``gpu_ms`` (CUDA-event times per module, resolved) the milliseconds are GPU
        time and the host-side time goes into the counters as ``cpu_ms``."""
        raw = raw if raw is not None else self._raw
        names = raw.counter_names if raw is not self._raw else self._names
        if names is not None:  # counts were kept as tuples during the call
            raw.counters = {i: dict(zip(names, v)) for i, v in raw.counters.items()}  # type: ignore[arg-type]
            raw.counter_names = None
            if raw is self._raw:
                self._names = None
        incl_ms = {k: v / 1e6 for k, v in raw.incl.items()}
        times = gpu_ms if gpu_ms is not None else incl_ms
        out: list[tuple[Any, ...]] = []
        for key, total in times.items():
            counters = raw.counters.get(key)
            below = self._called_below(key, times)
            self_ms = total - sum(times[k] for k in below) if below else total
            if below and counters is not None:
                counters = dict(counters)
                for k in below:
                    for ck, cv in raw.counters.get(k, {}).items():
                        counters[ck] = counters.get(ck, 0.0) - cv
            if counters is not None:
                counters = {**counters, "calls": 1.0}  # sums over this many calls, once added up
            if gpu_ms is not None:
                cpu_self = incl_ms.get(key, 0.0) - sum(incl_ms.get(k, 0.0) for k in below)
                counters = {**(counters or {}), "cpu_ms": max(cpu_self, 0.0)}
            if below and self_ms <= 0:
                continue
            op = self.op_types[key] + (" (self)" if below else "")
            out.append((self.names[key], op, self_ms, counters, (kernels or {}).get(key)))
        return out
