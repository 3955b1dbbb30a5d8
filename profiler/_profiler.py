"""The live profiler of one served model.

Contract with the serving path: ``begin`` and ``end`` bracket every call and never raise.
The serving path of ``pgc_daemon.agent.served`` takes the same steps inline, where an
unsampled call runs none of the profiler's Python (see :mod:`profiler._calls`)::

    calls = profiler.calls                                # bound once
    mark = next(calls.marks)                              # None, KEY or SAMPLE (true)
    token = profiler.sample(module) if mark else None
    ... the call of token.module (a sampled call) or module, timed: elapsed ns ...
    if mark is None:                                      # unkeyed, not sampled
        calls.queue.append((variant, None, elapsed, False, fallback, 0))
    else:
        profiler.end(token, variant, args, kwargs, elapsed, fallback=fallback)

At most one call per profiler is sampled
at a time; its hooks record raw timings only, and turning them into layer rows (and, on a
GPU, waiting for CUDA events and CUPTI records) happens on the profiler's background thread.

Sampling is "one call in N" (N adapts to the overhead budget, see :mod:`profiler._budget`),
optionally restricted to duty-cycle windows: the first ``duty_on_s`` seconds of every
``duty_period_s``. On a CUDA model the CUPTI tracer is enabled only inside sampling windows
(for the duty window, or for the one sampled call without a duty cycle).

Threads: the caller's (``begin``/``end``), one ticker (drains sampled calls, samples host
statistics, adapts the rate, closes windows every ``window_s``, or less often when what an
export costs would take more than its share of the budget at this traffic) and the
exporter's writer.
Both background threads start with :meth:`Profiler.start` and only when a sink is given.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from profiler._budget import Pacer, Period, RateController
from profiler._calls import CallQueue, inline_cost_ns
from profiler._compiled import KernelTimer, NodeKernels, NodeTimer
from profiler._config import ProfilerConfig
from profiler._exporter import Exporter
from profiler._hooks import LayerTimer, RawCall
from profiler._rows import HostRow, ProfilerEvent
from profiler._window import Totals, Window, WindowAggregator
from profiler.shapes import shape_key

log = logging.getLogger("pgc.profiler")
_perf_ns = time.perf_counter_ns
#: what the profiler's own threads spend is read on their CPU clock, not the wall's: a drain, an
#: export or a sampled call's processing that waits for the GIL or is preempted (by a search
#: worker on a 2-core machine) costs serving nothing while it waits. On the wall clock those
#: waits were charged to the budget: in a demo the per-call and background costs came to
#: 0.93% of serving and starved per-layer sampling, and the CNN's self-measured overhead read
#: 0.56-0.81% where the benchmark's CPU clocks measured 0.38-0.47%.
_cpu_ns = time.thread_time_ns
_Tensor = torch.Tensor

MIB = 1024 * 1024
#: Sampled calls waiting for the background thread; past this the oldest are discarded.
MAX_PENDING = 4096
#: Events held for the next window at most (rate changes, leak warnings).
MAX_EVENTS = 64
#: A change of the sampling rate becomes an event at most this often (the rate itself moves
#: with load far more often; the events are for a person to read).
RATE_EVENT_EVERY_S = 600.0
#: The controller looks at the costs once this many calls were sampled since it last did,
#: or after ``window_s`` in any case, but never before this much serving time went by: a
#: ratio over a few milliseconds of serving is noise (first calls, cold caches).
MIN_SAMPLED_PER_UPDATE = 8
MIN_SERVING_NS_PER_UPDATE = 1_000_000_000
#: The ticker moves served calls into the window in batches: once this many are queued, when
#: the controller is due to look, when a window closes (``status`` drains too), and when a
#: drain could switch one-shape traffic to sparse keying (``CallQueue.switch_due``). A drain
#: has a fixed cost (~70 µs of numpy calls on a 2-core VM): draining every second cost a 2 ms
#: model's calls more than their own bookkeeping.
DRAIN_AT_CALLS = 4096
#: The share of the budget a window's export and a host sample may each take, against the
#: serving time since they last ran (``profiler._budget.Pacer``), and how far light traffic
#: may space them out (× ``window_s``, × ``host_interval_s``). The sampling gets what the
#: controller's target leaves after them. Exports every ``window_s`` whatever the traffic
#: cost MiniLM at 20 calls a second (a 13 ms variant) more of the budget than its sampled
#: calls were allowed, and per-layer sampling stopped.
EXPORT_SHARE, EXPORT_MAX_STRETCH = 0.25, 6.0
HOST_SHARE, HOST_MAX_STRETCH = 0.05, 10.0


class _Token:
    """A sampled call. ``module``: what the call must run (the hook twin of the module
    ``sample`` was given, see :mod:`profiler._twin`, or that module itself)."""

    __slots__ = ("timer", "cost_ns", "module")

    def __init__(self, timer: LayerTimer, cost_ns: int) -> None:
        self.timer = timer
        self.cost_ns = cost_ns
        self.module = timer.target


@dataclass
class _Pending:
    timer: LayerTimer
    raw: RawCall
    variant: Any
    bucket: str
    elapsed_ns: int
    cost_ns: int
    error: bool


class Profiler:
    def __init__(
        self,
        config: ProfilerConfig | None = None,
        *,
        sink: Callable[[list[Window]], None] | None = None,
        key_fn: Callable[[tuple[Any, ...], dict[str, Any]], str] = shape_key,
        quiet: Callable[[], bool] | None = None,
        serving: Callable[[], Any] | None = None,
    ) -> None:
        """``sink`` receives closed windows in batches on the exporter's thread (without one,
        close windows yourself with :meth:`close_window`). ``quiet`` says whether the process
        is free of pgc's own heavy work right now (builds, verification); host samples taken
        while it is not do not count toward a leak. ``serving`` names the variant serving now
        (host samples are kept per variant); by default, the variant of the last call."""
        self.config = cfg = config or ProfilerConfig()
        self.aggregator = WindowAggregator(
            layer_min_calls=cfg.layer_window_calls, layer_max_s=cfg.layer_window_max_s
        )
        self.aggregator.before_close = lambda: self._drain(wait=True)
        self.controller = RateController(cfg.sample_every, cfg.budget, cfg.max_sample_every)
        self._every = cfg.sample_every
        #: the request path's marks and the queue of served calls (``profiler._calls``)
        self.calls = CallQueue(cfg.sample_every)
        self._key_fn = key_fn
        self._defer_key = key_fn is shape_key  # a (shape, dtype) queued, keyed when drained
        self._quiet = quiet
        self._serving = serving
        self._sampling = threading.Lock()
        self._paused = 0  # > 0: no call is sampled (see ``paused``)
        self._pause_lock = threading.Lock()
        self._sampled_seq = 0
        self._timers: dict[int, LayerTimer] = {}
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self.discarded = 0  # sampled calls discarded because the background thread lagged
        self.stalled = 0  # sampled calls of compiled modules left out: they stalled
        self._kernels: dict[int, dict[int, list[Any]]] = {}
        self._events: list[ProfilerEvent] = []
        self._host_rows: list[HostRow] = []
        self._last_variant: Any = None
        self._last_totals = Totals()
        self._sampled_costs: collections.deque[int] = collections.deque(maxlen=4096)
        self._last_adapt = time.monotonic()
        self._reported_every = cfg.sample_every
        self._reported_at = -RATE_EVENT_EVERY_S
        self._duty_epoch = time.monotonic()
        self._counters: Any = None
        self._counters_reason: str | None = "off (counters=False)" if not cfg.counters else None
        self._tracer: Any = None
        self.gpu_reason: str | None = None
        self.cupti_reason: str | None = None
        self._host: Any = None
        self._user_sink = sink
        self._reported_dropped = 0
        self._exporter = (
            Exporter(self._write, max_queue=cfg.max_queue, batch=cfg.export_batch)
            if sink is not None else None
        )
        now = time.monotonic()
        budget = cfg.budget
        self._export_pace = Pacer(budget and EXPORT_SHARE * budget, cfg.window_s,
                                  EXPORT_MAX_STRETCH * cfg.window_s, now=now)
        host_s = cfg.host_interval_s or cfg.window_s
        self._host_pace = Pacer(budget and HOST_SHARE * budget, host_s, HOST_MAX_STRETCH * host_s,
                                now=now - host_s)  # the first sample at once
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._inline_cost_ns = inline_cost_ns()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the background threads (only with a sink)."""
        if self._exporter is None or self._ticker is not None:
            return
        cfg = self.config
        if cfg.host_interval_s is not None:
            try:
                from profiler._host import HostSampler, LeakDetector  # noqa: PLC0415

                self._host = HostSampler(
                    LeakDetector(cfg.leak_window_s, cfg.leak_min_growth_mb * MIB)
                )
            except Exception as exc:  # noqa: BLE001 - no psutil: no host statistics
                log.warning("host statistics are off: %s", exc)
        self._exporter.start()
        self._ticker = threading.Thread(target=self._tick_loop, name="pgc-profiler", daemon=True)
        self._ticker.start()

    def stop(self, flush: bool = True) -> None:
        """Stop the threads (writing the current window first when ``flush``), close the
        counters and tear the CUPTI tracer down."""
        self._stop.set()
        if self._ticker is not None and self._ticker.is_alive():
            self._ticker.join(timeout=10)
        if self._exporter is not None:
            if flush and self._ticker is not None:
                self._exporter.offer(self.close_window())
            self._exporter.stop()
        if self._tracer is not None:
            self._tracer.shutdown()
        if self._counters is not None:
            self._counters.close()

    def flush(self, timeout: float = 10.0) -> None:
        """Close the current window now and wait until it is written (best effort)."""
        if self._exporter is None:
            return
        self._exporter.offer(self.close_window())
        self._exporter.wait_idle(timeout)

    @property
    def dropped(self) -> int:
        return self._exporter.dropped if self._exporter is not None else 0

    @property
    def export_failures(self) -> int:
        return self._exporter.failures if self._exporter is not None else 0

    @property
    def sample_every(self) -> int:
        """The current N of "one call in N" (the budget may have raised it)."""
        return self._every

    # ----------------------------------------------------------------- models

    def watch(self, module: nn.Module, kernels: Any = None) -> None:
        """Prepare per-layer timing of ``module`` (the modules that may serve): through hooks,
        or for a compiled module through its kernels, given which layers each computes
        (``kernels``, see :mod:`profiler._compiled`; ``NodeKernels`` for a module that times
        its own nodes). The profiler holds it (its timer
        references every layer) until :meth:`forget` or :meth:`retain` lets go of it."""
        timer = self._timers.get(id(module))
        if timer is not None and timer.modules and timer.modules[0] is module:
            return
        # a new module, or one that reuses the id of a module collected without ``forget``
        self._drop(timer)
        self._timers[id(module)] = (
            NodeTimer(module, kernels) if isinstance(kernels, NodeKernels)
            else KernelTimer(module, kernels) if kernels
            else LayerTimer(module, self._counter_source(), self._gpu_for(module),
                            twin=self.config.hook_twin))

    def calibrate(self, module: nn.Module, twin: Callable[[], Any],
                  variant: Callable[[], Any]) -> int | None:
        """For a module watched with ``kernels`` (its sampled calls run a profiling twin):
        measure what a sampled call costs over a live one (``twin`` and ``variant`` run one
        call each; see ``KernelTimer.calibrate``), with sampling paused meanwhile (one trace
        at a time in a process). Returns that cost (ns), or None for a module timed by hooks
        or not watched."""
        timer = self._timers.get(id(module))
        if not isinstance(timer, KernelTimer):
            return None
        with self.paused():
            return timer.calibrate(twin, variant)

    def forget(self, module: nn.Module) -> None:
        self._drop(self._timers.pop(id(module), None))

    def retain(self, modules: Iterable[nn.Module]) -> None:
        """Forget every watched module but ``modules`` (what serves now): a module that stopped
        serving must not be kept alive by its timer."""
        keep = {id(m) for m in modules}
        for key in list(self._timers):
            if key not in keep:
                self._drop(self._timers.pop(key, None))

    @staticmethod
    def _drop(timer: LayerTimer | KernelTimer | None) -> None:
        if timer is not None:
            timer.close()  # a LayerTimer's twin holds a reference cycle (LayerTimer.close)

    @property
    def watched(self) -> int:
        """How many modules the profiler holds timers for."""
        return len(self._timers)

    def _counter_source(self) -> Any:
        if not self.config.counters:
            return None
        if self._counters is None and self._counters_reason is None:
            try:
                from profiler._counters import PerfCounters  # noqa: PLC0415

                counters = PerfCounters()
            except Exception as exc:  # noqa: BLE001 - counters are optional
                self._counters_reason = f"off ({type(exc).__name__}: {exc})"
                return None
            if counters.available:
                self._counters = counters
            else:
                self._counters_reason = counters.availability.summary()
        return self._counters

    def _gpu_for(self, module: nn.Module) -> Any:
        from profiler._gpu import module_device  # noqa: PLC0415 - no CUDA import here

        if module_device(module) != "cuda":
            return None
        if not self.config.gpu:
            self.gpu_reason = "off (gpu=False): layers are timed on the host only"
            return None
        from profiler._gpu import CudaLayerEvents, cuda_status  # noqa: PLC0415

        ok, why = cuda_status()
        if not ok:
            self.gpu_reason = why
            return None
        self.gpu_reason = None
        if self.config.cupti and self._tracer is None and self.cupti_reason is None:
            from profiler._cupti import CuptiTracer, cupti_status  # noqa: PLC0415

            ok, why = cupti_status()
            if ok:
                try:
                    self._tracer = CuptiTracer()
                except Exception as exc:  # noqa: BLE001
                    self.cupti_reason = f"{type(exc).__name__}: {exc}"
            else:
                self.cupti_reason = why
        elif not self.config.cupti:
            self.cupti_reason = "off (cupti=False)"
        return CudaLayerEvents(self._tracer)

    # ----------------------------------------------------------------- request path

    def begin(self, module: nn.Module) -> _Token | None:
        """Decide whether this call is profiled per layer; if so attach the hooks. (``end``
        keys every call; the serving path's inline form keys only marked calls.)"""
        if not self.calls.mark():
            return None
        return self.sample(module)

    @contextlib.contextmanager
    def paused(self, wait_s: float = 5.0) -> Iterator[None]:
        """No per-layer sampling inside the block: the block starts once a sampled call in
        flight has taken its hooks off (or after ``wait_s``), and no call is sampled until it
        ends. Per-layer hooks are global while a call is sampled, so code that traces modules
        in this process (``torch.compile``, ``torch.export``) runs inside such a block: it
        must not trace the profiler's hooks (graph breaks) or guard on them (recompiles when
        they are gone). End-to-end timing of every call carries on."""
        with self._pause_lock:
            self._paused += 1
        try:
            if self._sampling.acquire(timeout=wait_s):
                self._sampling.release()
            yield
        finally:
            with self._pause_lock:
                self._paused -= 1

    def _duty_on(self) -> bool:
        cfg = self.config
        if cfg.duty_on_s is None:
            return True
        return (time.monotonic() - self._duty_epoch) % cfg.duty_period_s < cfg.duty_on_s

    def sample(self, module: nn.Module) -> _Token | None:
        """Profile this call of ``module`` per layer, if it may be now (a watched module, no
        other sampled call in flight, not paused, inside the duty window): attach the hooks
        and return the token ``end`` takes."""
        t0 = _perf_ns()
        if not self.calls.due() or not self._duty_on():
            return None
        timer = self._timers.get(id(module))
        if timer is None or not self._sampling.acquire(blocking=False):
            return None
        if self._paused:  # checked while holding the lock: ``paused`` waits on that lock
            self._sampling.release()
            return None
        try:
            tracer = self._tracer
            if tracer is not None and timer.gpu is not None and not tracer.is_open:
                try:
                    tracer.open()
                except Exception as exc:  # noqa: BLE001 - CUPTI off, timing carries on
                    self.cupti_reason = f"disabled after an error: {type(exc).__name__}: {exc}"
                    self._tracer = None
                    timer.gpu.tracer = None
            self._sampled_seq += 1
            timer.attach(counters=self._sampled_seq % self.config.counter_every == 1
                         or self.config.counter_every == 1)
        except Exception:  # noqa: BLE001
            timer.detach()
            self._sampling.release()
            return None
        return _Token(timer, _perf_ns() - t0)

    def end(
        self,
        token: _Token | None,
        variant: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        elapsed_ns: int,
        *,
        error: bool = False,
        fallback: bool = False,
    ) -> None:
        """Record one call (never raises)."""
        try:
            t0 = _perf_ns()
            if token is None:
                # One append: the background thread aggregates in bulk, and keys the shape of
                # a plain tensor first argument (the common call).
                a = args[0] if args else None
                bucket = ((a.shape, a.dtype) if self._defer_key and type(a) is _Tensor
                          else self._key_fn(args, kwargs))
                self.calls.record((variant, bucket, elapsed_ns, error, fallback, _perf_ns() - t0))
                return
            bucket = self._key_fn(args, kwargs)
            timer = token.timer
            try:
                timer.detach()
                raw = timer.take()
                tracer = self._tracer
                if (tracer is not None and tracer.is_open and self.config.duty_on_s is None
                        and raw.gpu is not None and raw.gpu.end.query()):
                    # Without a duty cycle the window is this one call; once its kernels are
                    # done, stop recording. Not done yet (an asynchronous call): the
                    # background thread closes the window when they are, never waiting here.
                    tracer.close()
            finally:
                self._sampling.release()
            cost = token.cost_ns + raw.overhead_ns + raw.foreign_ns + (_perf_ns() - t0)
            item = _Pending(timer, raw, variant, bucket, elapsed_ns, cost, error)
            with self._pending_lock:
                if len(self._pending) >= MAX_PENDING:
                    old = self._pending.popleft()
                    self.discarded += 1
                    self.aggregator.add_overhead(old.variant, old.bucket, old.cost_ns)
                self._pending.append(item)
            self.calls.record((variant, bucket, elapsed_ns, error, fallback, -1))
        except Exception:  # noqa: BLE001 - profiling must never fail a request
            log.debug("profiler.end failed", exc_info=True)

    # ----------------------------------------------------------------- background work

    def _drain_calls(self) -> None:
        """Move the calls ``end`` queued into the window (and the cost ledger), in bulk."""
        if not len(self.calls):
            return
        with self._drain_lock:
            t0 = _cpu_ns()
            batch, keys = self.calls.drain()
            if not batch:
                return
            self._last_variant = batch[-1][0]
            self.aggregator.add_calls(batch, self._inline_cost_ns, keys=keys)
            self.aggregator.add_background(_cpu_ns() - t0)

    def _drain(self, wait: bool) -> None:
        """Turn queued calls into window rows and sampled calls into layer rows (see
        :meth:`_process_pending`)."""
        self._drain_calls()
        self._process_pending(wait)

    def _process_pending(self, wait: bool) -> None:
        """Turn sampled calls into layer rows. GPU calls whose events are not done yet stay
        pending unless ``wait`` (then this thread waits for them; the device is never
        synchronized)."""
        with self._pending_lock:
            items = list(self._pending)
            self._pending.clear()
        if not items:
            return
        ready: list[_Pending] = []
        keep: list[_Pending] = []
        for p in items:
            gpu = p.raw.gpu
            if gpu is None or wait or gpu.end.query():
                ready.append(p)
            else:
                keep.append(p)
        if self._tracer is not None and any(p.raw.gpu is not None for p in ready):
            for p in ready:
                if p.raw.gpu is not None:
                    p.raw.gpu.end.synchronize()  # its kernels are done: their records flush
            self._collect_kernels()
        for p in ready:
            t0 = _cpu_ns()
            try:
                self._process(p)
            except Exception:  # noqa: BLE001 - one bad call must not stop the others
                log.debug("processing a sampled call failed", exc_info=True)
                self.aggregator.add_overhead(p.variant, p.bucket, p.cost_ns + _cpu_ns() - t0)
        if keep:
            with self._pending_lock:
                self._pending.extendleft(reversed(keep))
        self._close_tracer_window(gpu_pending=any(p.raw.gpu is not None for p in keep))

    def _close_tracer_window(self, gpu_pending: bool) -> None:
        """Stop CUPTI recording once a sampling window is over and its kernels are done (never
        while a sampled call is in flight)."""
        tracer = self._tracer
        if tracer is None or not tracer.is_open or gpu_pending:
            return
        if self.config.duty_on_s is not None and self._duty_on():
            return
        if self._sampling.acquire(blocking=False):
            try:
                tracer.close()
            finally:
                self._sampling.release()

    def _collect_kernels(self) -> None:
        from profiler._gpu import EXT_MASK, EXT_SHIFT  # noqa: PLC0415

        t0 = _cpu_ns()
        try:
            by_ext = self._tracer.collect()
        except Exception as exc:  # noqa: BLE001
            self.cupti_reason = f"disabled after an error: {type(exc).__name__}: {exc}"
            self._tracer = None
            return
        for ext, kernels in by_ext.items():
            seq, idx = ext >> EXT_SHIFT, (ext & EXT_MASK) - 1
            self._kernels.setdefault(seq, {}).setdefault(idx, []).extend(
                (k.name, k.duration_ns, k.grid, k.block) for k in kernels
            )
        while len(self._kernels) > 4 * MAX_PENDING:  # calls that never got processed
            self._kernels.pop(next(iter(self._kernels)))
        self.aggregator.add_background(_cpu_ns() - t0)

    def _process(self, p: _Pending) -> None:
        t0 = _cpu_ns()
        if p.error:  # layer times of a failed call say nothing about the model
            self.aggregator.add_overhead(p.variant, p.bucket, p.cost_ns)
            return
        raw = p.raw
        gpu_ms = None
        kernels = None
        if raw.trace is not None:  # a compiled variant's kernels: the trace's own cost first
            p.timer.count_events(raw)
            p.cost_ns += raw.overhead_ns
        elapsed_ms = raw.call_ms = (p.elapsed_ns - raw.overhead_ns) / 1e6
        if raw.gpu is not None and p.timer.gpu is not None:
            gpu_ms, elapsed_ms = p.timer.gpu.resolve(raw.gpu)
            kernels = self._kernels.pop(raw.seq, None)
        # a compiled call that stalled: its rows would give a kernel time spent off the CPU
        stalled = raw.trace is not None and p.timer.stalled(
            elapsed_ms, self.aggregator.typical_ms(p.variant, p.bucket))
        layers = [] if stalled else p.timer.results(raw, gpu_ms, kernels)
        cost = p.cost_ns + (_cpu_ns() - t0)
        self._sampled_costs.append(cost)
        if stalled:
            self.stalled += 1
            self.aggregator.add_overhead(p.variant, p.bucket, cost)
            return
        self.aggregator.add_sampled_call(
            p.variant, p.bucket, max(elapsed_ms, 0.0), layers, cost, incall_ns=raw.overhead_ns
        )

    def _tick_loop(self) -> None:
        cfg = self.config
        every = min(cfg.control_s, cfg.window_s, cfg.host_interval_s or cfg.control_s)
        while not self._stop.wait(every):
            try:
                self._tick()
                now, serving = time.monotonic(), self.aggregator.totals().serving_ns
                if self._export_pace.due(now, serving):
                    self._export_pace.ran(now, serving)
                    window = self.close_window(wait=False, flush_layers=False)
                    self._exporter.offer(window)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - the profiler thread must outlive any bad tick
                log.exception("profiler background tick failed")

    def _tick(self) -> None:
        self._process_pending(wait=False)
        self._close_tracer_window(gpu_pending=bool(self._pending))
        if self._host is not None:
            now, serving = time.monotonic(), self.aggregator.totals().serving_ns
            if self._host_pace.due(now, serving):
                self._host_pace.ran(now, serving)
                self.sample_host()
        # sampled calls are counted as they are processed; served calls only once drained
        now = time.monotonic()
        last = self._last_totals
        due = (self.aggregator.totals().sampled - last.sampled >= MIN_SAMPLED_PER_UPDATE
               or now - self._last_adapt >= self.config.window_s)
        if due or len(self.calls) >= DRAIN_AT_CALLS or self.calls.switch_due():
            self._drain_calls()
        if due:
            self._last_adapt = now
            if self.aggregator.totals().serving_ns - last.serving_ns >= MIN_SERVING_NS_PER_UPDATE:
                self.adapt()

    def sample_host(self) -> HostRow | None:
        """Take one host sample now (the ticker does this every ``host_interval_s``)."""
        if self._host is None:
            return None
        t0 = _cpu_ns()
        quiet = True
        if self._quiet is not None:
            try:
                quiet = bool(self._quiet())
            except Exception:  # noqa: BLE001
                quiet = True
        variant = self._last_variant
        if self._serving is not None:
            try:
                variant = self._serving()
            except Exception:  # noqa: BLE001
                variant = self._last_variant
        row, warning = self._host.sample(variant, quiet=quiet)
        self._host_rows.append(row)
        del self._host_rows[:-1000]
        if warning is not None:
            self.event("leak", "warning", warning.message(), warning.to_dict())
        cost = _cpu_ns() - t0
        self._host_pace.cost(cost)
        self.aggregator.add_background(cost)
        return row

    def event(self, kind: str, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        """Add an event to the next window (the sink stores it with the model's events)."""
        self._events.append(ProfilerEvent(kind=kind, level=level, message=message, data=data))
        del self._events[:-MAX_EVENTS]

    def adapt(self) -> int:
        """Look at the costs since the last look and set the sampling rate; returns N."""
        self._drain_calls()
        t = self.aggregator.totals()
        prev = self._last_totals
        sampled = t.sampled - prev.sampled
        sampled_cost = t.sampled_cost_ns - prev.sampled_cost_ns
        costs = sorted(self._sampled_costs)
        self._sampled_costs.clear()
        if len(costs) >= 10 and sampled > 0:
            # The cost of a typical sampled call, without the slowest 10%: a hook preempted
            # by another process looks expensive in wall time without costing any CPU, and
            # would otherwise push the rate down for nothing.
            kept = costs[: len(costs) - len(costs) // 10]
            sampled_cost = int(sum(kept) / len(kept) * sampled)
        period = Period(
            calls=t.calls - prev.calls,
            serving_ns=t.serving_ns - prev.serving_ns,
            sampled=sampled,
            sampled_cost_ns=sampled_cost,
            fixed_cost_ns=(t.call_cost_ns - prev.call_cost_ns) + (t.background_ns - prev.background_ns),
        )
        self._last_totals = t
        self._last_adapt = time.monotonic()
        new = self.controller.update(period)
        self._every = new
        self.calls.set_every(new)
        budget = self.config.budget
        big = new >= 4 * self._reported_every or 4 * new <= self._reported_every
        quiet = time.monotonic() - self._reported_at < RATE_EVENT_EVERY_S
        if budget is not None and big and not quiet:
            direction = "lowered" if new > self._reported_every else "raised"
            self.event(
                "profiler",
                "info",
                f"per-layer sampling {direction} to 1 call in {new}: measured overhead "
                f"{period.overhead:.3%} against a budget of {budget:.2%} ({self.controller.state})",
                {"sample_every": new, "overhead": period.overhead, "budget": budget},
            )
            self._reported_every = new
            self._reported_at = time.monotonic()
        return new

    def close_window(self, *, wait: bool = True, flush_layers: bool = True) -> Window:
        """Turn pending sampled calls into rows, end the current window and return it, with
        the host samples and events taken since the last one (and the layer rows, when
        ``flush_layers`` or when they are due)."""
        self._drain(wait=wait)
        before, self.aggregator.before_close = self.aggregator.before_close, None
        try:
            win = self.aggregator.close(flush_layers=flush_layers)
        finally:
            self.aggregator.before_close = before
        win.host, self._host_rows = self._host_rows, []
        win.events, self._events = self._events, []
        win.profiler = self.status()
        return win

    def _write(self, batch: list[Window]) -> None:
        """The exporter's sink: the user's sink, with drop accounting and its cost charged.

        The windows lost since the last accepted write (queue overflow, batches refused after
        their retries) go on the first window of the batch that has request rows, the rows
        that carry the count into the store; a batch without request rows leaves the count
        for the next one, so it is reported once and never lost."""
        t0 = _cpu_ns()
        dropped = self.dropped
        for window in batch:
            window.dropped = 0
        carrier = next((w for w in batch if w.requests), None)
        if carrier is not None:
            carrier.dropped = dropped - self._reported_dropped
        try:
            self._user_sink(batch)  # type: ignore[misc]
            if carrier is not None:
                self._reported_dropped = dropped
        finally:
            cost = _cpu_ns() - t0
            self._export_pace.cost(cost)
            self.aggregator.add_background(cost)

    # ----------------------------------------------------------------- reporting

    def status(self) -> dict[str, Any]:
        """Where the profiler stands: rate, budget, measured overhead, what is on and why."""
        self._drain_calls()
        t = self.aggregator.totals()
        last = self.controller.last
        counters = self._counters
        return {
            "sample_every": self._every,
            "base_sample_every": self.config.sample_every,
            "budget": self.config.budget,
            "overhead": t.overhead,
            "last_overhead": last.overhead if last is not None else None,
            "state": self.controller.state,
            "calls": t.calls,
            "sampled": t.sampled,
            "discarded": self.discarded,
            "stalled": self.stalled,
            "call_queue_overflows": self.calls.overflows,
            "dropped": self.dropped,
            "exported": self._exporter.exported if self._exporter is not None else 0,
            "export_failures": self.export_failures,
            "counters": counters.availability.summary() if counters is not None
            else (self._counters_reason or self._counters_unused()),
            "gpu": self.gpu_reason or ("CUDA events" if any(
                t.gpu is not None for t in list(self._timers.values())) else "no CUDA module watched"),
            "cupti": self.cupti_reason or ("on" if self._tracer is not None else "not in use"),
            "host_samples": self._host.samples if self._host is not None else 0,
            "hooks": self._hooks_status(),
        }

    def _counters_unused(self) -> str:
        """Why no counters were opened though they are on: they are read per hooked layer."""
        if self._timers:  # compiled modules only: their layers are timed from their kernels
            return "not used (compiled variants' layers are timed from their kernels)"
        return "not started (no model watched yet)"

    def _hooks_status(self) -> str:
        """How sampled calls are timed: through hook twins, or why not."""
        why = {t.twin_reason for t in list(self._timers.values())
               if isinstance(t, LayerTimer) and t.twin is None}
        if not why:
            return "hook twin (no other call runs a hook)"
        return "process-wide while a call is sampled: " + "; ".join(sorted(map(str, why)))
