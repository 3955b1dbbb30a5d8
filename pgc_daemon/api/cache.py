"""A value recomputed at most once per ``ttl_s``, shared by concurrent callers: the dashboard
polls ``GET /api/models`` every few seconds per open tab and Prometheus scrapes ``/metrics``,
and each computation reads every model's history, so one computation per tick serves all."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

TTL_S = 1.0


class TickCache(Generic[T]):
    def __init__(self, compute: Callable[[], T], ttl_s: float = TTL_S) -> None:
        self._compute = compute
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._value: T | None = None
        self._at = float("-inf")

    def get(self) -> T:
        """The value computed within the last ``ttl_s``, else a new one. Callers arriving
        while it is computed wait for that computation instead of starting their own; an
        error is not cached."""
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.ttl_s or self._value is None:
                self._value = self._compute()
                self._at = time.monotonic()
            return self._value
