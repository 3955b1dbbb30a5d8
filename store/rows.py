"""What the store keeps of a profiler window: one frozen dataclass per statistics table, with
exactly that table's columns (less the row id). Whoever writes statistics builds these, and
:func:`store.repo.add_window_stats` inserts them; ``pgc_daemon.agent.rows`` maps the profiler's
own rows onto them field by field. Times are UTC epoch seconds, latencies milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestStatRow:
    """End-to-end latency of one (variant, shape bucket) over one window (``pgc_request_stats``)."""

    model_id: int
    variant_id: int | None
    window_start: float
    window_end: float
    shape_bucket: str
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int = 0
    fallbacks: int = 0
    sampled: int = 0
    overhead: float = 0.0
    """The profiler's cost as a fraction of this key's serving time."""
    dropped: int = 0
    """Windows lost (queue full or a failed write) before this one."""
    histogram: list[int] | None = None
    """Request counts per latency bucket (bounds in ``profiler.LATENCY_BUCKETS_MS``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerStatRow:
    """One layer's latency for one (variant, shape bucket) over a window (``pgc_layer_stats``)."""

    model_id: int
    variant_id: int | None
    window_start: float
    window_end: float
    layer: str
    op_type: str
    shape_bucket: str
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    share: float
    """The layer's part of its sampled calls' own time."""
    counters: dict[str, float] | None = None
    """Counter totals over the window (perf events, CUPTI kernel counts and time)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostStatRow:
    """One process sample of the serving process (``pgc_host_stats``)."""

    model_id: int
    variant_id: int | None
    at: float
    cpu_percent: float
    rss_bytes: int
    threads: int
    ctx_switches: int
    extra: dict[str, Any] | None = None


StatRow = RequestStatRow | LayerStatRow | HostStatRow


def field_names(row_type: type[StatRow]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(row_type))
