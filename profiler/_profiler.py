"""The live profiler of one served model.

Contract with the serving path (see ``pgc_daemon.agent``): ``begin`` and ``end`` bracket every
call; both are cheap for unsampled calls (a counter, a shape key, one locked append) and never
raise. At most one call is profiled per layer at a time.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from profiler._exporter import Exporter
from profiler._hooks import LayerTimer
from profiler._window import Window, WindowAggregator
from profiler.shapes import shape_key

log = logging.getLogger("pgc.profiler")
_perf_ns = time.perf_counter_ns


@dataclass(frozen=True)
class ProfilerConfig:
    """``sample_every``: profile one call in N per layer; ``window_s``: aggregation window;
    ``max_queue``: closed windows held while the sink is slow before the oldest are dropped."""

    sample_every: int = 100
    window_s: float = 10.0
    max_queue: int = 64

    def __post_init__(self) -> None:
        if self.sample_every < 1:
            raise ValueError("sample_every must be >= 1")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")


class _Token:
    __slots__ = ("timer", "started_ns", "overhead_ns")

    def __init__(self, timer: LayerTimer, started_ns: int, overhead_ns: int) -> None:
        self.timer = timer
        self.started_ns = started_ns
        self.overhead_ns = overhead_ns


class Profiler:
    def __init__(
        self,
        config: ProfilerConfig | None = None,
        *,
        sink: Callable[[Window], None] | None = None,
        key_fn: Callable[[tuple[Any, ...], dict[str, Any]], str] = shape_key,
    ) -> None:
        self.config = config or ProfilerConfig()
        self.aggregator = WindowAggregator()
        self._key_fn = key_fn
        self._counter = itertools.count(1)
        self._sampling = threading.Lock()
        self._timers: dict[int, LayerTimer] = {}
        self._exporter: Exporter | None = None
        if sink is not None:
            self._exporter = Exporter(
                self.aggregator.close,
                sink,
                interval_s=self.config.window_s,
                max_queue=self.config.max_queue,
            )

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._exporter is not None:
            self._exporter.start()

    def stop(self, flush: bool = True) -> None:
        if self._exporter is not None:
            self._exporter.stop(flush=flush)

    def flush(self) -> None:
        if self._exporter is not None:
            self._exporter.flush()

    @property
    def dropped(self) -> int:
        return self._exporter.dropped if self._exporter is not None else 0

    @property
    def export_failures(self) -> int:
        return self._exporter.failures if self._exporter is not None else 0

    # ----------------------------------------------------------------- models

    def watch(self, module: nn.Module) -> None:
        """Prepare per-layer timing of ``module`` (the eager modules that may serve)."""
        if id(module) not in self._timers:
            self._timers[id(module)] = LayerTimer(module)

    def forget(self, module: nn.Module) -> None:
        self._timers.pop(id(module), None)

    # ----------------------------------------------------------------- request path

    def begin(self, module: nn.Module) -> _Token | None:
        """Decide whether this call is profiled per layer; if so attach the hooks."""
        if next(self._counter) % self.config.sample_every:
            return None
        timer = self._timers.get(id(module))
        if timer is None or not self._sampling.acquire(blocking=False):
            return None
        t0 = _perf_ns()
        try:
            timer.attach()
        except Exception:  # noqa: BLE001
            timer.detach()
            self._sampling.release()
            return None
        now = _perf_ns()
        return _Token(timer, now, now - t0)

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
            bucket = self._key_fn(args, kwargs)
            if token is not None:
                try:
                    token.timer.detach()
                    layers = token.timer.results()
                finally:
                    self._sampling.release()
                overhead = token.overhead_ns + (_perf_ns() - t0)
                self.aggregator.add_sampled_call(
                    variant, bucket, elapsed_ns / 1e6, layers, overhead
                )
            self.aggregator.add_call(
                variant, bucket, elapsed_ns / 1e6, error=error, fallback=fallback
            )
        except Exception:  # noqa: BLE001 - profiling must never fail a request
            log.debug("profiler.end failed", exc_info=True)
