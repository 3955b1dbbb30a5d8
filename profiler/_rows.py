"""What a closed window holds: one frozen dataclass per kind of row.

These are the profiler's own rows, named for what it measures; they carry more than a store
keeps (``trimmed_ms``, kernels) and the variant as the serving code handed it over (whatever
object identifies a variant there). Mapping them onto a store's rows is the caller's business
(``pgc_daemon.agent.rows``): the profiler does not know the store. Latencies are milliseconds,
times UTC epoch seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRow:
    """End-to-end latency of every call of one (variant, shape bucket) in a window."""

    variant: Any
    shape_bucket: str
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    trimmed_ms: float
    """The mean without the slowest 10% of the (reservoir) sample."""
    errors: int = 0
    fallbacks: int = 0
    sampled: int = 0
    """Calls of this key that were profiled per layer."""
    overhead: float = 0.0
    """The profiler's cost as a fraction of this key's serving time."""
    histogram: tuple[int, ...] = ()
    """Calls per latency bucket (upper bounds in ``LATENCY_BUCKETS_MS``, then the rest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledRow:
    """The sampled calls of one (variant, shape bucket): their own latency, net of the
    profiler's time in them (what layer shares are shares of)."""

    variant: Any
    shape_bucket: str
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    trimmed_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerRow:
    """One layer's latency in the sampled calls of one (variant, shape bucket)."""

    variant: Any
    shape_bucket: str
    layer: str
    op_type: str
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    trimmed_ms: float
    share: float
    """The layer's part of its sampled calls' own time."""
    counters: dict[str, float] | None = None
    """Counter totals (perf events; ``cupti_kernels`` and ``cupti_kernel_ms`` with CUPTI)."""
    kernels: tuple[dict[str, Any], ...] | None = None
    """The layer's longest CUDA kernels by total time (name, grid, block, count, total_ms)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRow:
    """One psutil sample of the serving process."""

    variant: Any
    at: float
    cpu_percent: float
    rss_bytes: int
    threads: int
    ctx_switches: int
    extra: dict[str, Any]
    """vms_bytes, ctx_voluntary/ctx_involuntary, quiet, fds and rss_slope_bytes_per_s when
    known."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilerEvent:
    """Something a person should see: a leak warning, a change of the sampling rate."""

    kind: str
    level: str
    message: str
    data: dict[str, Any] | None = None
