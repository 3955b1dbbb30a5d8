"""What the request path records for the canary: live latency per variant, and shadow samples
(live inputs with the serving variant's outputs) that the canary checks against fp32.

Threading: request threads append (``deque.append`` is atomic, so no lock on the request
path); the swapper thread clears, reads and drains. ``shadow_wanted`` is read without a lock:
a request that races with :meth:`LiveRecord.request_shadow` captures one sample more or less.
"""

from __future__ import annotations

import collections
import random
from typing import Any

from pgc_daemon.reservoir import _detach

#: Live latencies kept per variant (bounded, append-only).
LATENCY_KEPT = 4096
SHADOW_KEPT = 256
#: The share of eligible calls whose input and output are captured while samples are wanted.
SHADOW_RATE = 0.25

ShadowSample = tuple[int | None, tuple[Any, Any], Any]
"""(variant id, (args, kwargs), output) of one live call, detached from the caller's tensors."""


class LiveRecord:
    def __init__(self, seed: int = 0) -> None:
        self.latency_ms: collections.defaultdict[int | None, collections.deque[float]] = (
            collections.defaultdict(lambda: collections.deque(maxlen=LATENCY_KEPT))
        )
        self.shadow_wanted = 0
        self._shadow: collections.deque[ShadowSample] = collections.deque(maxlen=SHADOW_KEPT)
        self._rng = random.Random(seed)

    def offer_shadow(self, variant_id: int | None, args: Any, kwargs: Any, out: Any) -> None:
        """Request path: keep this call as a shadow sample (one in ``1 / SHADOW_RATE``)."""
        if self._rng.random() < SHADOW_RATE:
            self.shadow_wanted -= 1
            self._shadow.append((variant_id, (_detach(tuple(args)), _detach(dict(kwargs))), _detach(out)))

    def request_shadow(self, n: int) -> None:
        """Drop the samples taken so far and capture ``n`` more (0: stop capturing)."""
        self._shadow.clear()
        self.shadow_wanted = n

    def take_shadow(self) -> list[ShadowSample]:
        items = []
        while self._shadow:
            items.append(self._shadow.popleft())
        return items
