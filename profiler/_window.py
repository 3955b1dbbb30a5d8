"""Streaming aggregation per time window.

Each key (variant, shape bucket[, layer]) keeps a count, a sum and a bounded uniform sample
(reservoir sampling) of its values, so memory stays bounded however busy a window is and
quantiles come from the sample when the window closes.
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RESERVOIR = 512
#: Upper bounds (ms) of the request-latency histogram buckets; a last bucket holds the rest.
#: Fixed, so windows from every process and every day add up (Prometheus histograms).
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000,
)


class _Series:
    __slots__ = ("count", "total", "sample", "_rng", "buckets")

    def __init__(self, rng: random.Random, histogram: bool = False) -> None:
        self.count = 0
        self.total = 0.0
        self.sample: list[float] = []
        self._rng = rng
        self.buckets = [0] * (len(LATENCY_BUCKETS_MS) + 1) if histogram else None

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        if self.buckets is not None:
            self.buckets[bisect.bisect_left(LATENCY_BUCKETS_MS, value)] += 1
        if len(self.sample) < RESERVOIR:
            self.sample.append(value)
        else:
            j = self._rng.randrange(self.count)
            if j < RESERVOIR:
                self.sample[j] = value

    def stats(self) -> dict[str, float]:
        p50, p95, p99 = np.percentile(np.asarray(self.sample), (50, 95, 99))
        return {
            "count": self.count,
            "mean_ms": self.total / self.count,
            "p50_ms": float(p50),
            "p95_ms": float(p95),
            "p99_ms": float(p99),
        }


@dataclass
class Window:
    """One closed window: request rows and layer rows, ready for the store."""

    start: float
    end: float
    requests: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.requests and not self.layers


class WindowAggregator:
    """Thread-safe accumulation of call and layer timings for the current window."""

    def __init__(self, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._reset(time.time())

    def _reset(self, now: float) -> None:
        self._start = now
        self._calls: dict[tuple[Any, str], _Series] = {}
        self._errors: dict[tuple[Any, str], int] = {}
        self._fallbacks: dict[tuple[Any, str], int] = {}
        self._sampled: dict[tuple[Any, str], _Series] = {}
        self._layers: dict[tuple[Any, str, str, str], _Series] = {}
        self._counters: dict[tuple[Any, str, str, str], dict[str, float]] = {}
        self._overhead_ns: dict[tuple[Any, str], int] = {}

    def add_call(
        self,
        variant: Any,
        bucket: str,
        elapsed_ms: float,
        *,
        error: bool = False,
        fallback: bool = False,
    ) -> None:
        key = (variant, bucket)
        with self._lock:
            series = self._calls.get(key)
            if series is None:
                series = self._calls[key] = _Series(self._rng, histogram=True)
            series.add(elapsed_ms)
            if error:
                self._errors[key] = self._errors.get(key, 0) + 1
            if fallback:
                self._fallbacks[key] = self._fallbacks.get(key, 0) + 1

    def add_sampled_call(
        self,
        variant: Any,
        bucket: str,
        elapsed_ms: float,
        layers: list[tuple[str, str, float, dict[str, float] | None]],
        overhead_ns: int,
    ) -> None:
        """A call that was profiled per layer: its total and each layer's (name, op type,
        milliseconds, counters)."""
        key = (variant, bucket)
        with self._lock:
            s = self._sampled.get(key)
            if s is None:
                s = self._sampled[key] = _Series(self._rng)
            s.add(elapsed_ms)
            self._overhead_ns[key] = self._overhead_ns.get(key, 0) + overhead_ns
            for name, op_type, ms, counters in layers:
                lkey = (variant, bucket, name, op_type)
                ls = self._layers.get(lkey)
                if ls is None:
                    ls = self._layers[lkey] = _Series(self._rng)
                ls.add(ms)
                if counters:
                    acc = self._counters.setdefault(lkey, {})
                    for k, v in counters.items():
                        acc[k] = acc.get(k, 0.0) + v

    def add_overhead(self, variant: Any, bucket: str, overhead_ns: int) -> None:
        key = (variant, bucket)
        with self._lock:
            self._overhead_ns[key] = self._overhead_ns.get(key, 0) + overhead_ns

    def close(self, now: float | None = None) -> Window:
        """End the current window and start the next; returns the closed one."""
        now = time.time() if now is None else now
        with self._lock:
            start = self._start
            calls, errors, fallbacks = self._calls, self._errors, self._fallbacks
            sampled, layers, counters = self._sampled, self._layers, self._counters
            overhead = self._overhead_ns
            self._reset(now)
        win = Window(start=start, end=now)
        for (variant, bucket), series in calls.items():
            row = series.stats()
            busy_ns = series.total * 1e6
            row.update(
                variant=variant,
                shape_bucket=bucket,
                errors=errors.get((variant, bucket), 0),
                fallbacks=fallbacks.get((variant, bucket), 0),
                sampled=sampled[(variant, bucket)].count if (variant, bucket) in sampled else 0,
                overhead=overhead.get((variant, bucket), 0) / busy_ns if busy_ns else 0.0,
                histogram=list(series.buckets or ()),
            )
            win.requests.append(row)
        for (variant, bucket, name, op_type), series in layers.items():
            call_total = sampled[(variant, bucket)].total
            row = series.stats()
            row.update(
                variant=variant,
                shape_bucket=bucket,
                layer=name,
                op_type=op_type,
                share=series.total / call_total if call_total else 0.0,
                counters=counters.get((variant, bucket, name, op_type)),
            )
            win.layers.append(row)
        return win
