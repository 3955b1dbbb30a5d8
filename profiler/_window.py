"""Streaming aggregation per time window.

Each key (variant, shape bucket[, layer]) keeps a count, a sum and a bounded uniform sample
(reservoir sampling) of its values, so memory stays bounded however busy a window is and
quantiles come from the sample when the window closes. The number of shape buckets per
window is bounded too (:data:`MAX_BUCKETS`; the rest is counted under ``other``), so traffic
with unbounded shapes cannot grow the window or the store.

The aggregator also keeps the profiler's cost ledger: cumulative serving time and calls, the
measured cost of every call's bookkeeping, of sampled calls and of background work. Window
rows carry the cost as ``overhead`` (a fraction of that key's serving time); the rate
controller reads the cumulative totals (:meth:`WindowAggregator.totals`).
"""

from __future__ import annotations

import bisect
import operator
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from profiler._rows import HostRow, LayerRow, ProfilerEvent, RequestRow, SampledRow

#: the columns of a queued call (see ``WindowAggregator.add_calls``)
_col = [operator.itemgetter(i) for i in range(6)]

RESERVOIR = 512
#: Most shape buckets kept per window; calls of further buckets are counted as ``other``.
MAX_BUCKETS = 64
OTHER_BUCKET = "other"
#: Kernels kept per layer row (the longest by total time).
TOP_KERNELS = 8
#: a window's median latency stands for a (variant, bucket)'s live calls (:meth:`WindowAggregator.
#: typical_ms`) once it holds this many calls, at most a tenth of them sampled
TYPICAL_MIN_CALLS = 20
#: Upper bounds (ms) of the request-latency histogram buckets; a last bucket holds the rest.
#: Fixed, so windows from every process and every day add up (Prometheus histograms).
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000,
)

_LATENCY_EDGES = np.asarray(LATENCY_BUCKETS_MS)
_perf_ns = time.perf_counter_ns

#: One layer of one sampled call: (name, op type, milliseconds, counters[, kernels]), where
#: kernels are CUPTI records attributed to the layer: (name, duration ns, grid, block).
LayerSample = tuple[Any, ...]


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

    def add_many(self, values: np.ndarray, rng: np.random.Generator) -> None:
        """``add`` for each of ``values`` (ms), in bulk: what ``add`` does per value but the
        reservoir's replacements run as numpy operations."""
        m = len(values)
        if not m:
            return
        if self.buckets is not None:
            hist = np.bincount(np.searchsorted(_LATENCY_EDGES, values, side="left"),
                               minlength=len(self.buckets))
            self.buckets = [a + int(b) for a, b in zip(self.buckets, hist, strict=True)]
        self.total += float(values.sum())
        room = max(0, RESERVOIR - len(self.sample))
        self.sample.extend(values[:room].tolist())
        rest = values[room:]
        first = self.count + min(room, m)  # values counted before the first of ``rest``
        self.count += m
        if len(rest):
            # the k-th value of the stream replaces a uniform slot j < k when j < RESERVOIR
            slots = rng.integers(0, np.arange(first + 1, first + len(rest) + 1))
            for i in np.flatnonzero(slots < RESERVOIR).tolist():
                self.sample[int(slots[i])] = float(rest[i])

    def stats(self) -> dict[str, Any]:
        """count, mean_ms, p50_ms, p95_ms, p99_ms and trimmed_ms: the latency fields of every
        row type."""
        s = sorted(self.sample)
        p90 = _quantile(s, 0.90)
        kept = [v for v in s if v <= p90]
        return {
            "count": self.count,
            "mean_ms": self.total / self.count,
            "p50_ms": _quantile(s, 0.50),
            "p95_ms": _quantile(s, 0.95),
            "p99_ms": _quantile(s, 0.99),
            # the mean without the slowest 10%: a preempted call on a busy machine adds
            # time to one layer only, and would otherwise reorder a ranking by itself
            "trimmed_ms": sum(kept) / len(kept),
        }


def _typical(calls: int, sampled: int) -> bool:
    """Whether a window's calls say how live calls run: enough of them, few sampled."""
    return calls >= TYPICAL_MIN_CALLS and sampled * 10 <= calls


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method), in plain Python:
    a window closes hundreds of series, and numpy's per-call cost dwarfs a handful of values."""
    x = (len(ordered) - 1) * q
    i = int(x)
    if i + 1 >= len(ordered):
        return float(ordered[-1])
    return float(ordered[i] + (ordered[i + 1] - ordered[i]) * (x - i))


@dataclass
class Window:
    """One closed window: request rows, layer rows, host samples and events, ready for the
    store. ``dropped``: windows lost (queue full, or a write refused after its retries) since
    the last count the sink accepted; set by the profiler just before the sink sees this
    window, on the first window of a batch with request rows (the others say 0)."""

    start: float
    end: float
    requests: list[RequestRow] = field(default_factory=list)
    layers: list[LayerRow] = field(default_factory=list)
    host: list[HostRow] = field(default_factory=list)
    events: list[ProfilerEvent] = field(default_factory=list)
    dropped: int = 0
    profiler: dict[str, Any] = field(default_factory=dict)
    layers_start: float | None = None
    """Where the layer rows' own window starts (they may span several request windows)."""
    sampled: list[SampledRow] = field(default_factory=list)
    """Per (variant, shape bucket): the sampled calls' own latency, net of the profiler's
    time in them (what layer shares are shares of)."""

    @property
    def empty(self) -> bool:
        return not (self.requests or self.layers or self.host or self.events or self.dropped)


@dataclass
class Totals:
    """Cumulative since the aggregator was made (never reset by a window)."""

    calls: int = 0
    serving_ns: int = 0
    call_cost_ns: int = 0
    sampled: int = 0
    sampled_cost_ns: int = 0
    background_ns: int = 0

    @property
    def cost_ns(self) -> int:
        return self.call_cost_ns + self.sampled_cost_ns + self.background_ns

    @property
    def overhead(self) -> float:
        return self.cost_ns / self.serving_ns if self.serving_ns else 0.0


class WindowAggregator:
    """Thread-safe accumulation of call and layer timings for the current window."""

    def __init__(
        self,
        seed: int = 0,
        max_buckets: int = MAX_BUCKETS,
        *,
        layer_min_calls: int = 1,
        layer_max_s: float = 0.0,
    ) -> None:
        """``layer_min_calls`` / ``layer_max_s``: when windows close on a timer (``close(...,
        flush_layers=False)``), layer statistics are emitted once this many sampled calls
        accumulated, or this long after their last emission; until then they keep
        accumulating across request windows (layer rows carry their own start). At a low
        sampling rate most request windows hold one sampled call or none, and a row per layer
        per window would cost more to store than it tells."""
        self.layer_min_calls = layer_min_calls
        self.layer_max_s = layer_max_s
        #: Called at the start of :meth:`close` (the profiler turns its pending sampled calls
        #: into layer rows there, so closing the aggregator directly misses none).
        self.before_close: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)
        self.max_buckets = max_buckets
        self._totals = Totals()
        now = time.time()
        #: per (variant, bucket): the median latency of the last window that could say it
        self._typical: dict[tuple[Any, str], float] = {}
        self._reset(now)
        self._reset_layers(now)
        self._layer_calls = 0

    def _reset(self, now: float) -> None:
        self._start = now
        self._calls: dict[tuple[Any, str], _Series] = {}
        self._errors: dict[tuple[Any, str], int] = {}
        self._fallbacks: dict[tuple[Any, str], int] = {}
        self._sampled_n: dict[tuple[Any, str], int] = {}
        self._overhead_ns: dict[tuple[Any, str], int] = {}
        self._incall_ns: dict[tuple[Any, str], int] = {}
        self._background_ns = 0
        self._buckets: set[str] = set()

    def _reset_layers(self, now: float) -> None:
        self._layers_start = now
        self._sampled: dict[tuple[Any, str], _Series] = {}
        self._layers: dict[tuple[Any, str, str, str], _Series] = {}
        self._counters: dict[tuple[Any, str, str, str], dict[str, float]] = {}
        self._kernels: dict[tuple[Any, str, str, str], dict[tuple[str, Any, Any], list[int]]] = {}

    def _bucket(self, bucket: str) -> str:
        """The bucket to count under (``other`` past :attr:`max_buckets`); under the lock."""
        key = self._counted_as(bucket)
        if key == bucket:
            self._buckets.add(bucket)
        return key

    def _counted_as(self, bucket: str) -> str:
        """The bucket a call of ``bucket`` would count under, taking no room; under the lock."""
        if bucket in self._buckets or len(self._buckets) < self.max_buckets:
            return bucket
        return OTHER_BUCKET

    def add_call(
        self,
        variant: Any,
        bucket: str,
        elapsed_ms: float,
        *,
        error: bool = False,
        fallback: bool = False,
        started_ns: int | None = None,
        extra_cost_ns: int = 0,
    ) -> None:
        """One served call. ``started_ns`` (a ``perf_counter_ns`` reading): when the caller's
        bookkeeping for this call began; the time from then until this method is done is
        charged as profiler cost, plus ``extra_cost_ns``."""
        with self._lock:
            key = (variant, self._bucket(bucket))
            series = self._calls.get(key)
            if series is None:
                series = self._calls[key] = _Series(self._rng, histogram=True)
            series.add(elapsed_ms)
            if error:
                self._errors[key] = self._errors.get(key, 0) + 1
            if fallback:
                self._fallbacks[key] = self._fallbacks.get(key, 0) + 1
            t = self._totals
            t.calls += 1
            t.serving_ns += int(elapsed_ms * 1e6)
            if started_ns is not None or extra_cost_ns:
                cost = extra_cost_ns + (_perf_ns() - started_ns if started_ns is not None else 0)
                self._overhead_ns[key] = self._overhead_ns.get(key, 0) + cost
                t.call_cost_ns += cost

    def add_calls(self, calls: list[tuple[Any, ...]], extra_cost_ns: int = 0, *,
                  keys: list[str] | None = None) -> None:
        """Many served calls at once: (variant, bucket, elapsed ns, error, fallback, cost ns)
        each; every call but a sampled one (cost < 0: charged with its sampled cost) is
        charged ``extra_cost_ns`` more (the calibrated cost of the steps no one timed in
        place, see ``profiler._calls.inline_cost_ns``). ``keys``: each call's bucket,
        where the entries' own are not keys yet (the profiler's call queue). In bulk, per
        (variant, bucket): on a 1 ms model this runs for every call served, so its per-call
        cost is part of the profiler's overhead."""
        if not calls:
            return
        n = len(calls)
        variants = list(map(_col[0], calls))
        buckets = keys if keys is not None else list(map(_col[1], calls))
        if variants.count(variants[0]) == n and buckets.count(buckets[0]) == n:
            groups: dict[tuple[Any, str], Any] = {(variants[0], buckets[0]): slice(None)}
        else:
            groups = {}
            for i, pair in enumerate(zip(variants, buckets)):
                groups.setdefault(pair, []).append(i)
        elapsed_ns = np.fromiter(map(_col[2], calls), np.int64, n)
        cost_ns = np.fromiter(map(_col[5], calls), np.int64, n)
        # errors and fallbacks are rare: an array only when there are any
        error_a = np.fromiter(map(_col[3], calls), bool, n) if any(map(_col[3], calls)) else None
        fallback_a = (np.fromiter(map(_col[4], calls), bool, n)
                      if any(map(_col[4], calls)) else None)
        with self._lock:
            t = self._totals
            for (variant, bucket), idx in groups.items():
                key = (variant, self._bucket(bucket))
                series = self._calls.get(key)
                if series is None:
                    series = self._calls[key] = _Series(self._rng, histogram=True)
                el = elapsed_ns[idx]
                series.add_many(el / 1e6, self._np_rng)
                if error_a is not None and (nerr := int(error_a[idx].sum())):
                    self._errors[key] = self._errors.get(key, 0) + nerr
                if fallback_a is not None and (nfb := int(fallback_a[idx].sum())):
                    self._fallbacks[key] = self._fallbacks.get(key, 0) + nfb
                t.calls += len(el)
                t.serving_ns += int(el.sum())
                c = cost_ns[idx]
                own = c >= 0  # negative: a sampled call, charged with its sampled cost
                if cost := int(c[own].sum()) + extra_cost_ns * int(np.count_nonzero(own)):
                    self._overhead_ns[key] = self._overhead_ns.get(key, 0) + cost
                    t.call_cost_ns += cost

    def add_sampled_call(
        self,
        variant: Any,
        bucket: str,
        elapsed_ms: float,
        layers: list[Any],
        overhead_ns: int,
        *,
        incall_ns: int = 0,
    ) -> None:
        """A call that was profiled per layer: its total (net of the profiler's own time) and
        each layer's (name, op type, milliseconds, counters[, kernels]). ``overhead_ns``: all
        the profiler spent on it; ``incall_ns``: the part spent inside the timed call (hooks),
        which is not serving time."""
        with self._lock:
            key = (variant, self._bucket(bucket))
            s = self._sampled.get(key)
            if s is None:
                s = self._sampled[key] = _Series(self._rng)
            s.add(elapsed_ms)
            self._sampled_n[key] = self._sampled_n.get(key, 0) + 1
            self._layer_calls += 1
            self._overhead_ns[key] = self._overhead_ns.get(key, 0) + overhead_ns
            self._incall_ns[key] = self._incall_ns.get(key, 0) + incall_ns
            self._totals.sampled += 1
            self._totals.sampled_cost_ns += overhead_ns
            self._totals.serving_ns -= incall_ns
            for layer in layers:
                name, op_type, ms, counters = layer[0], layer[1], layer[2], layer[3]
                lkey = (variant, key[1], name, op_type)
                ls = self._layers.get(lkey)
                if ls is None:
                    ls = self._layers[lkey] = _Series(self._rng)
                ls.add(ms)
                if counters:
                    acc = self._counters.setdefault(lkey, {})
                    for k, v in counters.items():
                        acc[k] = acc.get(k, 0.0) + v
                kernels = layer[4] if len(layer) > 4 else None
                if kernels:
                    kacc = self._kernels.setdefault(lkey, {})
                    for kname, dur_ns, grid, block in kernels:
                        slot = kacc.setdefault((kname, grid, block), [0, 0])
                        slot[0] += 1
                        slot[1] += dur_ns

    def add_overhead(self, variant: Any, bucket: str, overhead_ns: int) -> None:
        """Cost that belongs to one key (e.g. a sampled call whose layers were discarded)."""
        with self._lock:
            key = (variant, self._bucket(bucket))
            self._overhead_ns[key] = self._overhead_ns.get(key, 0) + overhead_ns
            self._totals.sampled_cost_ns += overhead_ns

    def typical_ms(self, variant: Any, bucket: str) -> float | None:
        """The median latency of the calls served at ``variant`` and ``bucket``, mostly not
        sampled: the current window's once it holds :data:`TYPICAL_MIN_CALLS` such calls, or
        the last window's that did; None before any did (a profile where every call is
        sampled has none)."""
        with self._lock:
            key = (variant, self._counted_as(bucket))
            series = self._calls.get(key)
            if series is not None and _typical(series.count, self._sampled_n.get(key, 0)):
                return _quantile(sorted(series.sample), 0.5)
            return self._typical.get(key)

    def add_background(self, cost_ns: int) -> None:
        """Cost of background work (export, host samples, window processing): spread over the
        window's request rows in proportion to their serving time when it closes."""
        with self._lock:
            self._background_ns += cost_ns
            self._totals.background_ns += cost_ns

    def totals(self) -> Totals:
        with self._lock:
            t = self._totals
            return Totals(t.calls, t.serving_ns, t.call_cost_ns, t.sampled,
                          t.sampled_cost_ns, t.background_ns)

    def close(self, now: float | None = None, *, flush_layers: bool = True) -> Window:
        """End the current window and start the next; returns the closed one. Layer rows come
        with it when ``flush_layers`` or when they are due (see the constructor)."""
        if self.before_close is not None:
            self.before_close()
        now = time.time() if now is None else now
        with self._lock:
            start = self._start
            calls, errors, fallbacks = self._calls, self._errors, self._fallbacks
            sampled_n = self._sampled_n
            overhead = self._overhead_ns
            incall = self._incall_ns
            background = self._background_ns
            self._reset(now)
            due = (
                flush_layers
                or self._layer_calls >= self.layer_min_calls
                or now - self._layers_start >= self.layer_max_s
            )
            layers_start = self._layers_start
            if due:
                sampled, layers, counters = self._sampled, self._layers, self._counters
                kernels = self._kernels
                self._reset_layers(now)
                self._layer_calls = 0
            else:
                sampled, layers, counters, kernels = {}, {}, {}, {}
        win = Window(start=start, end=now, layers_start=layers_start)
        busy_all = sum(s.total for s in calls.values()) * 1e6
        for (variant, bucket), series in calls.items():
            stats = series.stats()
            if _typical(series.count, sampled_n.get((variant, bucket), 0)):
                self._typical[(variant, bucket)] = stats["p50_ms"]
            busy_ns = series.total * 1e6
            cost = float(overhead.get((variant, bucket), 0))
            if busy_all:
                cost += background * busy_ns / busy_all
            busy_ns = max(busy_ns - incall.get((variant, bucket), 0), 1.0)  # hooks: not serving
            win.requests.append(RequestRow(
                **stats,
                variant=variant,
                shape_bucket=bucket,
                errors=errors.get((variant, bucket), 0),
                fallbacks=fallbacks.get((variant, bucket), 0),
                sampled=sampled_n.get((variant, bucket), 0),
                overhead=cost / busy_ns if busy_ns else 0.0,
                histogram=tuple(series.buckets or ()),
            ))
        for (variant, bucket), series in sampled.items():
            win.sampled.append(SampledRow(**series.stats(), variant=variant, shape_bucket=bucket))
        for lkey, series in layers.items():
            variant, bucket, name, op_type = lkey
            call_total = sampled[(variant, bucket)].total
            layer_counters = counters.get(lkey)
            top_kernels = None
            if lkey in kernels:
                # numbers the store keeps with the layer's counters (summed like them) ...
                ks = kernels[lkey].values()
                layer_counters = {
                    **(layer_counters or {}),
                    "cupti_kernels": float(sum(v[0] for v in ks)),
                    "cupti_kernel_ms": sum(v[1] for v in ks) / 1e6,
                }
                # ... and the kernels themselves (name, grid, block) for reports
                top = sorted(kernels[lkey].items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
                top_kernels = tuple(
                    {"name": k[0], "grid": list(k[1]), "block": list(k[2]), "count": v[0],
                     "total_ms": v[1] / 1e6}
                    for k, v in top
                )
            win.layers.append(LayerRow(
                **series.stats(),
                variant=variant,
                shape_bucket=bucket,
                layer=name,
                op_type=op_type,
                share=series.total / call_total if call_total else 0.0,
                counters=layer_counters,
                kernels=top_kernels,
            ))
        return win
