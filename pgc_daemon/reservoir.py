"""A bounded, uniform-ish sample of live inputs: what search, calibration and verification
run on, so they see real traffic rather than made-up examples.

Reservoir sampling (Algorithm R) with a floor on the replacement rate: once ``stale_after``
calls have been seen, every call keeps at least ``capacity / stale_after`` odds of entering,
so the sample follows traffic that drifts instead of freezing on the first hours.
"""

from __future__ import annotations

import io
import random
import threading
from typing import Any

import torch

from compiler import Example


def _detach(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


class InputReservoir:
    def __init__(self, capacity: int = 128, *, stale_factor: int = 100, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.stale_after = capacity * stale_factor
        self.seen = 0
        self.version = 0
        self._items: list[Example] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def offer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Maybe keep this call's inputs (copied, so the caller may reuse its tensors)."""
        with self._lock:
            self.seen += 1
            if len(self._items) < self.capacity:
                slot = len(self._items)
            else:
                j = self._rng.randrange(min(self.seen, self.stale_after))
                if j >= self.capacity:
                    return
                slot = j
        item = (_detach(tuple(args)), _detach(dict(kwargs)))
        with self._lock:
            if slot < len(self._items):
                self._items[slot] = item
            else:
                self._items.append(item)
            self.version += 1

    def __len__(self) -> int:
        return len(self._items)

    def snapshot(self) -> list[Example]:
        with self._lock:
            return list(self._items)

    def serialize(self) -> bytes:
        buf = io.BytesIO()
        torch.save([[list(a), k] for a, k in self.snapshot()], buf)
        return buf.getvalue()

    @staticmethod
    def deserialize(payload: bytes) -> list[Example]:
        items = torch.load(io.BytesIO(payload), weights_only=True)
        return [(tuple(a), dict(k)) for a, k in items]

    def load(self, items: list[Example], seen: int | None = None) -> None:
        with self._lock:
            self._items = list(items)[: self.capacity]
            self.seen = max(seen or 0, len(self._items))
            self.version += 1
