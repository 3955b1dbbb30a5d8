"""A bounded, uniform-ish sample of live inputs: what search, calibration and verification
run on, so they see real traffic rather than made-up examples.

Reservoir sampling (Algorithm R) with a floor on the replacement rate: once ``stale_after``
calls have been seen, every call keeps at least ``capacity / stale_after`` odds of entering,
so the sample follows traffic that drifts instead of freezing on the first hours.

Every call is offered, so an offer the reservoir does not take costs one comparison: once
it is full, the index of the next call it takes is drawn in advance (a geometric skip at the
current odds, thinned to the lower odds of the calls in between: the same law as a draw per
call). Until then every call is taken.

Bounded twice: by count (``capacity``, the ``reservoir_size`` setting) and by bytes
(``max_bytes``, :data:`MAX_BYTES` unless given). The count alone is no bound on memory: 128
batches of images can be gigabytes, copied out of the requests into the serving process and
rewritten whole to the store every 30 s. Once the bytes are at the bound the reservoir
stops growing and only replaces (so it holds fewer, larger inputs), a replacement that would
pass the bound evicts other inputs at random, and one input larger than the whole bound is
not kept (a call drawn to be taken whose inputs are: counted in ``too_large``).
"""

from __future__ import annotations

import io
import math
import random
import threading
from typing import Any

import torch

from compiler import Example


#: Bytes of tensor data the reservoir holds at most (its ``torch.save`` payload is about as
#: large): enough for 128 batches of 64 x 3 x 32 x 32 float images or thousands of text batches,
#: small enough to copy, keep and rewrite inside someone's server without noticing.
MAX_BYTES = 64 * 1024 * 1024


def _nbytes(value: Any) -> int:
    """Bytes of tensor data in a call's arguments (what a copy of them costs)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _detach(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


class InputReservoir:
    def __init__(
        self,
        capacity: int = 128,
        *,
        max_bytes: int = MAX_BYTES,
        stale_factor: int = 100,
        seed: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.stale_after = capacity * stale_factor
        self.seen = 0
        self.version = 0
        self.too_large = 0
        self._items: list[Example] = []
        self._sizes: list[int] = []
        self._bytes = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        #: the index (``seen``) of the next call taken: every call until the reservoir is full
        self._next = 1

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held now (at most ``max_bytes``)."""
        return self._bytes

    def offer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Maybe keep this call's inputs (copied, so the caller may reuse its tensors). On the
        request path: a call not taken costs an increment and a comparison (``seen`` is
        counted without a lock: request threads racing may drop an increment, never a call's
        answer)."""
        self.seen += 1
        if self.seen >= self._next:
            self._take(args, kwargs)

    def _take(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        size = _nbytes(args) + _nbytes(kwargs)
        with self._lock:
            seen = self.seen
            if size > self.max_bytes:
                self.too_large += 1
                self._schedule(seen, size)
                return
            n = len(self._items)
            if n < self.capacity and self._bytes + size <= self.max_bytes:
                slot = n
            else:  # full, by count or by bytes: replace one, at random (this call's odds were
                slot = self._rng.randrange(n)  # n / seen, drawn in advance)
        item = (_detach(tuple(args)), _detach(dict(kwargs)))
        with self._lock:
            if slot < len(self._items):
                self._bytes -= self._sizes[slot]
                self._items[slot], self._sizes[slot] = item, size
            else:
                slot = len(self._items)
                self._items.append(item)
                self._sizes.append(size)
            self._bytes += size
            self._evict(keep=slot)
            self.version += 1
            self._schedule(seen, size)

    def _schedule(self, seen: int, size: int) -> None:
        """Set the next call taken after call ``seen``: the next one while there is room (for
        another input of ``size`` bytes), else one drawn at the odds of reservoir sampling.
        Under the lock."""
        n = len(self._items)
        full = n >= self.capacity or self._bytes + size > self.max_bytes
        self._next = self._next_taken(seen) if full and n else seen + 1

    def _odds(self, index: int) -> float:
        """The odds the call numbered ``index`` is taken when full: n / seen, at least
        n / ``stale_after``."""
        return min(1.0, len(self._items) / min(index, self.stale_after))

    def _next_taken(self, after: int) -> int:
        """The index of the next call taken when full, after call ``after``: a geometric skip
        at the odds of the call after it (the highest of those to come, as odds fall with
        ``seen``), thinned to the odds at the call it lands on. Under the lock."""
        rng, index = self._rng, after
        while True:
            bound = self._odds(index + 1)
            if bound >= 1.0:
                return index + 1
            u = 1.0 - rng.random()  # in (0, 1]
            index += 1 + int(math.log(u) / math.log1p(-bound))
            if rng.random() * bound < self._odds(index):
                return index

    def _evict(self, keep: int | None = None) -> None:
        """Drop inputs at random (never ``keep``) until within both bounds; under the lock."""
        while len(self._items) > self.capacity or (self._bytes > self.max_bytes and len(self._items) > 1):
            i = self._rng.randrange(len(self._items) - (keep is not None))
            if keep is not None and i >= keep:
                i += 1
            last = len(self._items) - 1
            self._bytes -= self._sizes[i]
            # swap with the last and pop: O(1), and the order of a sample means nothing
            self._items[i], self._sizes[i] = self._items[last], self._sizes[last]
            self._items.pop()
            self._sizes.pop()
            if keep == last:
                keep = i

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
        """Replace the sample (a saved one, read back), within both bounds."""
        kept = [item for item in items if _nbytes(item) <= self.max_bytes][: self.capacity]
        with self._lock:
            self._items = kept
            self._sizes = [_nbytes(item) for item in kept]
            self._bytes = sum(self._sizes)
            self._evict()
            self.seen = max(seen or 0, len(self._items))
            self.version += 1
            self._schedule(self.seen, max(self._sizes, default=0))
