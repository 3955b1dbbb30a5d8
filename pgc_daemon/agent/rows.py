"""The one mapping from the profiler's windows to the store's statistics rows (the profiler and
the store are leaves that do not know each other; this is where they meet). Field by field:
a column added on either side shows up here, as a type error, rather than being dropped."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import store as st
from profiler import HostRow, LayerRow, ProfilerEvent, RequestRow, Window


@dataclass
class StoreRows:
    requests: list[st.RequestStatRow] = field(default_factory=list)
    layers: list[st.LayerStatRow] = field(default_factory=list)
    host: list[st.HostStatRow] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    """kind, level, message, data: the arguments of ``store.repo.add_event``."""


def window_rows(model_id: int, windows: Iterable[Window]) -> StoreRows:
    """Store rows for a batch of closed windows of one model. The profiler's variant is the
    store's variant id (the agent hands the profiler ids); a window's ``dropped`` (windows
    lost before it) goes on its first request row, so a sum over rows counts each loss once."""
    out = StoreRows()
    for window in windows:
        for i, r in enumerate(window.requests):
            out.requests.append(
                _request(model_id, window, r, dropped=window.dropped if i == 0 else 0)
            )
        layers_start = window.layers_start or window.start
        out.layers.extend(_layer(model_id, layers_start, window.end, r) for r in window.layers)
        out.host.extend(_host(model_id, r) for r in window.host)
        out.events.extend(_event(ev) for ev in window.events)
    return out


def _request(model_id: int, window: Window, r: RequestRow, *, dropped: int) -> st.RequestStatRow:
    return st.RequestStatRow(
        model_id=model_id,
        variant_id=r.variant,
        window_start=window.start,
        window_end=window.end,
        shape_bucket=r.shape_bucket,
        count=r.count,
        mean_ms=r.mean_ms,
        p50_ms=r.p50_ms,
        p95_ms=r.p95_ms,
        p99_ms=r.p99_ms,
        errors=r.errors,
        fallbacks=r.fallbacks,
        sampled=r.sampled,
        overhead=r.overhead,
        dropped=dropped,
        histogram=list(r.histogram),
    )


def _layer(model_id: int, start: float, end: float, r: LayerRow) -> st.LayerStatRow:
    return st.LayerStatRow(
        model_id=model_id,
        variant_id=r.variant,
        window_start=start,
        window_end=end,
        layer=r.layer,
        op_type=r.op_type,
        shape_bucket=r.shape_bucket,
        count=r.count,
        mean_ms=r.mean_ms,
        p50_ms=r.p50_ms,
        p95_ms=r.p95_ms,
        p99_ms=r.p99_ms,
        share=r.share,
        counters=r.counters,
    )


def _host(model_id: int, r: HostRow) -> st.HostStatRow:
    return st.HostStatRow(
        model_id=model_id,
        variant_id=r.variant,
        at=r.at,
        cpu_percent=r.cpu_percent,
        rss_bytes=r.rss_bytes,
        threads=r.threads,
        ctx_switches=r.ctx_switches,
        extra=r.extra,
    )


def _event(ev: ProfilerEvent) -> dict[str, Any]:
    return {"kind": ev.kind, "level": ev.level, "message": ev.message, "data": ev.data}
