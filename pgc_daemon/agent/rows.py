"""The one mapping from the profiler's windows to the store's statistics rows (the profiler and
the store are leaves that do not know each other; this is where they meet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import store as st
from profiler import Window

# What the store keeps of the profiler's window rows (rows may carry more, e.g. trimmed means).
_REQUEST_COLUMNS = frozenset(c.key for c in st.RequestStat.__table__.columns)
_LAYER_COLUMNS = frozenset(c.key for c in st.LayerStat.__table__.columns)
_HOST_COLUMNS = frozenset(c.key for c in st.HostStat.__table__.columns)


@dataclass
class StoreRows:
    requests: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    host: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def window_rows(model_id: int, windows: list[Window]) -> StoreRows:
    out = StoreRows()
    for window in windows:
        base = {"model_id": model_id, "window_start": window.start, "window_end": window.end}
        for i, r in enumerate(window.requests):
            row = {k: v for k, v in r.items() if k in _REQUEST_COLUMNS}
            row["variant_id"] = r["variant"]
            row["dropped"] = window.dropped if i == 0 else 0  # windows lost before this one
            out.requests.append({**base, **row})
        for r in window.layers:
            row = {k: v for k, v in r.items() if k in _LAYER_COLUMNS}
            row["variant_id"] = r["variant"]
            out.layers.append({**base, "window_start": window.layers_start or window.start, **row})
        for r in window.host:
            row = {k: v for k, v in r.items() if k in _HOST_COLUMNS}
            out.host.append({**row, "model_id": model_id, "variant_id": r["variant"]})
        out.events.extend(window.events)
    return out
