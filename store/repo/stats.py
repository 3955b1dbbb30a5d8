"""Live statistics: the profiler's window rows in, per-layer profiles, request summaries, shape
histograms and host samples out, the retention policy, and the input reservoir.

Reads aggregate in SQL where they can: a model's history grows by a row per (variant, shape
bucket) per window, and a summary should cost the database a scan, not Python a loop over
ORM objects.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, delete, func, insert, not_, select
from sqlalchemy.orm import Session, defer

from store._schema import Event, HostStat, LayerStat, RequestStat, Reservoir
from store.rows import HostStatRow, LayerStatRow, RequestStatRow, StatRow, field_names

# --------------------------------------------------------------------------- writes


def add_window_stats(
    s: Session,
    *,
    requests: Sequence[RequestStatRow] = (),
    layers: Sequence[LayerStatRow] = (),
    host: Sequence[HostStatRow] = (),
) -> int:
    """Request, layer and host rows of profiler windows, one bulk insert per table (Core
    executemany). The profiler charges its export time to its overhead budget, and this takes
    a fraction of the CPU the ORM's unit of work needs for the same rows. Returns the number
    of rows written."""
    n = 0
    for table, row_type, rows in (
        (RequestStat, RequestStatRow, requests),
        (LayerStat, LayerStatRow, layers),
        (HostStat, HostStatRow, host),
    ):
        if rows:
            s.execute(insert(table.__table__), [_values(row, row_type) for row in rows])
            n += len(rows)
    return n


_FIELDS = {t: field_names(t) for t in (RequestStatRow, LayerStatRow, HostStatRow)}


def _values(row: StatRow, row_type: type[StatRow]) -> dict[str, Any]:
    """A row's columns, shallow (``dataclasses.asdict`` deep-copies every counters dict and
    histogram, on the exporter's budget, for an insert that only reads them)."""
    if type(row) is not row_type:
        raise TypeError(f"expected {row_type.__name__}, got {type(row).__name__}")
    return {name: getattr(row, name) for name in _FIELDS[row_type]}


# --------------------------------------------------------------------------- layers


def layer_profile(
    s: Session,
    model_id: int,
    *,
    since: float = 0.0,
    variant_id: int | None = None,
    shape_bucket: str | None = None,
) -> list[dict[str, Any]]:
    """Per-layer totals over every window since ``since``, hottest first.

    Means are weighted by call counts; a percentile over several windows is reported as the
    count-weighted mean of the windows' percentiles (an approximation, close when windows are
    alike). ``share`` is the layer's part of the summed per-layer time.
    """
    q = (
        select(
            LayerStat.layer,
            LayerStat.op_type,
            func.sum(LayerStat.count),
            func.sum(LayerStat.mean_ms * LayerStat.count),
            func.sum(LayerStat.p50_ms * LayerStat.count),
            func.sum(LayerStat.p95_ms * LayerStat.count),
            func.sum(LayerStat.p99_ms * LayerStat.count),
        )
        .where(LayerStat.model_id == model_id, LayerStat.window_end >= since)
        .group_by(LayerStat.layer, LayerStat.op_type)
    )
    if variant_id is not None:
        q = q.where(LayerStat.variant_id == variant_id)
    if shape_bucket is not None:
        q = q.where(LayerStat.shape_bucket == shape_bucket)
    rows = []
    for layer, op_type, count, tot, p50, p95, p99 in s.execute(q):
        if not count:
            continue
        rows.append(
            {
                "layer": layer,
                "op_type": op_type,
                "count": int(count),
                "mean_ms": tot / count,
                "p50_ms": p50 / count,
                "p95_ms": p95 / count,
                "p99_ms": p99 / count,
                "total_ms": tot,
            }
        )
    grand = sum(r["total_ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["total_ms"] / grand
    rows.sort(key=lambda r: r["total_ms"], reverse=True)
    return rows


def layer_counters(s: Session, model_id: int, *, since: float = 0.0) -> dict[str, dict[str, float]]:
    """Per-layer counter totals (perf events) summed over windows since ``since``."""
    out: dict[str, dict[str, float]] = {}
    q = select(LayerStat.layer, LayerStat.counters).where(
        LayerStat.model_id == model_id, LayerStat.window_end >= since, LayerStat.counters.is_not(None)
    )
    for layer, counters in s.execute(q):
        if not counters:  # JSON null, written before the column stored None as SQL NULL
            continue
        acc = out.setdefault(layer, {})
        for k, v in counters.items():
            acc[k] = acc.get(k, 0.0) + float(v)
    return out


# --------------------------------------------------------------------------- requests


def shape_histogram(s: Session, model_id: int, *, since: float = 0.0) -> dict[str, int]:
    """Calls per shape bucket seen by live traffic since ``since``."""
    q = (
        select(RequestStat.shape_bucket, func.sum(RequestStat.count))
        .where(RequestStat.model_id == model_id, RequestStat.window_end >= since)
        .group_by(RequestStat.shape_bucket)
    )
    return {bucket: int(n) for bucket, n in s.execute(q)}


def request_windows(
    s: Session, model_id: int, *, since: float = 0.0, variant_id: int | None = None
) -> Sequence[RequestStat]:
    q = select(RequestStat).where(
        RequestStat.model_id == model_id, RequestStat.window_end >= since
    )
    if variant_id is not None:
        q = q.where(RequestStat.variant_id == variant_id)
    return s.scalars(q.order_by(RequestStat.window_end)).all()


def request_window_numbers(s: Session, model_id: int, *, since: float = 0.0) -> Sequence[Any]:
    """Per window: ``variant_id``, ``count``, ``errors``, ``mean_ms`` and ``histogram`` only
    (named rows, no ORM objects: what ``/metrics`` sums per variant)."""
    r = RequestStat
    q = (
        select(r.variant_id, r.count, r.errors, r.mean_ms, r.histogram)
        .where(r.model_id == model_id, r.window_end >= since)
        .order_by(r.window_end)
    )
    return s.execute(q).all()


def request_summary(
    s: Session,
    model_id: int,
    *,
    since: float = 0.0,
    variant_id: int | None = None,
    exclude: Sequence[tuple[float, float]] = (),
    sampled_only: bool = False,
) -> dict[str, float] | None:
    """Count-weighted request latency over windows since ``since`` (None without traffic).
    Windows that overlap any ``exclude`` interval (start, end) are left out; with
    ``sampled_only``, so are windows without a sampled call (those without per-layer rows).

    One aggregate query: percentiles over several windows are the count-weighted means of the
    windows' percentiles, and ``overhead`` is weighted by serving time (mean × count)."""
    r = RequestStat
    weighted = r.mean_ms * r.count
    q = select(
        func.count(),
        func.sum(r.count),
        func.sum(r.errors),
        func.sum(r.fallbacks),
        func.sum(weighted),
        func.sum(r.p50_ms * r.count),
        func.sum(r.p95_ms * r.count),
        func.sum(r.p99_ms * r.count),
        func.sum(r.sampled),
        func.sum(r.dropped),
        func.sum(r.overhead * weighted),
        func.sum(r.window_end - r.window_start),
    ).where(r.model_id == model_id, r.window_end >= since)
    if variant_id is not None:
        q = q.where(r.variant_id == variant_id)
    for start, end in exclude:
        q = q.where(not_(and_(r.window_start < end, r.window_end > start)))
    if sampled_only:
        q = q.where(r.sampled > 0)
    windows, n, errors, fallbacks, busy, p50, p95, p99, sampled, dropped, cost, span = s.execute(q).one()
    if not n:
        return None
    n = int(n)
    busy = float(busy)
    return {
        "count": n,
        "windows": int(windows),
        "errors": int(errors or 0),
        "fallbacks": int(fallbacks or 0),
        "mean_ms": busy / n,
        "p50_ms": float(p50) / n,
        "p95_ms": float(p95) / n,
        "p99_ms": float(p99) / n,
        "sampled": int(sampled or 0),
        "dropped": int(dropped or 0),
        "overhead": float(cost or 0.0) / busy if busy else 0.0,
        # window time summed over windows, each of one serving process: count / seconds is
        # a process's arrival rate
        "seconds": float(span or 0.0),
    }


# --------------------------------------------------------------------------- host


def host_stats(s: Session, model_id: int, *, since: float = 0.0) -> Sequence[HostStat]:
    q = select(HostStat).where(HostStat.model_id == model_id, HostStat.at >= since)
    return s.scalars(q.order_by(HostStat.at)).all()


def prune_stats(s: Session, older_than: float) -> int:
    """Delete statistics and events older than ``older_than`` (the retention policy)."""
    n = 0
    for table, col in (
        (LayerStat, LayerStat.window_end),
        (RequestStat, RequestStat.window_end),
        (HostStat, HostStat.at),
        (Event, Event.at),
    ):
        n += s.execute(delete(table).where(col < older_than)).rowcount or 0
    return n


# --------------------------------------------------------------------------- reservoir


def save_reservoir(s: Session, model_id: int, payload: bytes, count: int, seen: int) -> None:
    """Replace a model's reservoir (the old payload is overwritten, never read)."""
    row = s.get(Reservoir, model_id, options=[defer(Reservoir.payload)])
    now = time.time()
    if row is None:
        s.add(Reservoir(model_id=model_id, payload=payload, count=count, seen=seen, updated_at=now))
    else:
        row.payload, row.count, row.seen, row.updated_at = payload, count, seen, now


def load_reservoir(s: Session, model_id: int) -> Reservoir | None:
    return s.get(Reservoir, model_id)


def reservoir_count(s: Session, model_id: int) -> int | None:
    """How many inputs a model's reservoir holds (None without one), without loading the
    payload."""
    return s.scalar(select(Reservoir.count).where(Reservoir.model_id == model_id))
