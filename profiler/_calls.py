"""The request path's share of the profiler: which calls are marked, and the queue every
call's timing goes into until the background thread counts it.

After a forward pass the CPU's caches hold the model's kernels and data, not the
interpreter's: every line of Python run then costs cache misses, and a method call alone
costs about a microsecond (measured on the digits CNN: ``begin`` and ``end`` as methods took
9-16 µs a call, the same work inline 3-6 µs, and reading ``tensor.shape`` and ``.dtype`` half
of that). The interpreter's own paths are cold too, unless the forward pass ran them: on
MiniLM (2026-12-06, Xeon with AMX), calling a stored method-wrapper (``cycle.__next__``) cost
3.3 µs where ``next(cycle)`` cost 1.0, and a stored bound ``deque.append`` 2.5 µs where
``deque.append`` looked up on the deque, the path every ``list.append`` takes, cost 0.5. So
the unsampled call does no Python of the profiler's at all, and takes the interpreter's
hottest paths:

- ``next(calls.marks)``: a C-level ``next`` on a cycle of marks, one entry per call:
  ``SAMPLE`` once every N calls (this call is a candidate for per-layer sampling), ``KEY`` on
  calls whose shape is to be keyed, ``None`` on the rest;
- ``calls.queue.append(entry)``: a C-level ``deque.append`` of ``(variant, bucket, elapsed
  ns, error, fallback, cost ns)``; an unkeyed call's bucket is ``None`` and its cost 0: timing
  these two steps in place would cost as much again, so every call is charged what they cost
  with the caches cold, measured once per process (:func:`inline_cost_ns`).

``mark()`` and ``record(entry)`` are the same steps as methods, for callers off the request
path.

Every call is keyed (``dense``) until :data:`MIN_ONE_SHAPE` keyed calls in a row, over
one drain or several, have had one shape; then, while live traffic
keeps that shape, one call in :data:`KEY_EVERY` is keyed and the calls between are counted
under the key before them; as soon as a drain sees another shape, every call is keyed again.
A shape change in a one-shape stream is therefore counted under the old key for at most
``KEY_EVERY - 1`` calls.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from profiler.shapes import key_of

#: marks: ``SAMPLE`` is the only true one, so ``if mark:`` asks for it; an unmarked call's
#: mark is ``None`` (compared with ``is``)
KEY = 0
SAMPLE = 1
#: while traffic keeps one shape, one call in this many is keyed
KEY_EVERY = 16
#: keyed calls of one shape in a row (over any number of drains) before keying sparsely
MIN_ONE_SHAPE = 2 * KEY_EVERY
#: the longest cycle of marks kept; a rarer rate takes every k-th ``SAMPLE`` mark (``due``)
MAX_CYCLE = 4096
#: calls queued between two drains at most (the background drains every ``control_s``);
#: past this the oldest are dropped, and the drain says so (``overflows``)
MAX_QUEUED_CALLS = 262_144

#: what is written between two timings of the calibration: more than a 2-core VM's caches
#: hold, as a forward pass of a real model leaves them
_EVICT_BYTES = 16 * 1024 * 1024

Entry = tuple[Any, Any, int, bool, bool, int]
_bucket = operator.itemgetter(1)


@functools.lru_cache(maxsize=1)
def inline_cost_ns() -> int:
    """What an unsampled call's two steps (``mark`` and ``record``) cost with cold caches, in
    ns: each timing follows a write over more memory than the caches hold, as the call's
    forward pass does. Measured once per process (median of repeats)."""
    q = CallQueue(1 << 12)
    evict = np.zeros(_EVICT_BYTES // 8)
    pc = time.perf_counter_ns
    runs = []
    for _ in range(12):
        evict += 1.0
        t0 = pc()
        next(q.marks)
        t1 = pc()
        q.queue.append((1, None, t1 - t0, False, False, 0))
        runs.append(pc() - t0)
    return int(statistics.median(runs))


class CallQueue:
    """Marks for the request path and the queue of served calls (see the module docstring).
    Read ``marks`` from the queue on every call: ``set_every`` and the switch between sparse
    and dense keying replace it. Slots, not a ``__dict__``: the request path reads two of them
    with the caches cold, and a slot is one load where an instance dict is a lookup (0.6 µs a
    call less on MiniLM)."""

    __slots__ = ("queue", "every", "dense", "_skip", "_left", "marks", "last_key", "run",
                 "last_changes", "overflows")

    def __init__(self, every: int, maxlen: int = MAX_QUEUED_CALLS) -> None:
        #: served calls, appended by the request path (``queue.append``) and drained here
        self.queue: collections.deque[Entry] = collections.deque(maxlen=maxlen)
        self.every = every
        self.dense = True  # until MIN_ONE_SHAPE keyed calls in a row had one shape
        self._skip = self._left = 1
        #: the marks of the calls to come: ``next(marks)`` is the next call's
        self.marks: Iterator[int | None] = self._cycle()
        #: the key of the last keyed call drained (unkeyed calls are counted under it)
        self.last_key: str | None = None
        #: keyed calls in a row, up to the last drained, that had ``last_key``
        self.run = 0
        #: shape changes the last drain saw
        self.last_changes = 0
        #: drains that found the queue full: older calls were dropped uncounted
        self.overflows = 0

    def __len__(self) -> int:
        return len(self.queue)

    def mark(self) -> int | None:
        """The next call's mark (the request path inlines this as ``next(calls.marks)``)."""
        return next(self.marks)

    def record(self, entry: Entry) -> None:
        """Queue one served call (the request path inlines this as ``calls.queue.append``)."""
        self.queue.append(entry)

    def set_every(self, every: int) -> None:
        if every != self.every:
            self.every = every
            self.marks = self._cycle()

    def switch_due(self) -> bool:
        """Whether a drain now could switch to sparse keying: dense, the last drain saw one
        shape, and enough calls are queued to complete the run. (Drains otherwise come every
        window: a model serving a few calls a second, MiniLM in the overhead bench, stayed
        keyed on every call for a window, 13 µs a call against 6.7 µs unkeyed.)"""
        return self.dense and not self.last_changes and self.run + len(self.queue) >= MIN_ONE_SHAPE

    def due(self) -> bool:
        """Whether a ``SAMPLE`` mark is to be sampled: every one, unless the rate is rarer than
        one call in :data:`MAX_CYCLE` (then one in k, the cycle being ``every // k`` long)."""
        self._left -= 1
        if self._left > 0:
            return False
        self._left = self._skip
        return True

    def _cycle(self) -> Iterator[int | None]:
        self._skip = -(-self.every // MAX_CYCLE)
        self._left = min(self._left, self._skip)
        n = self.every // self._skip
        pattern: list[int | None] = [KEY if self.dense else None] * n
        if not self.dense:
            pattern[::KEY_EVERY] = [KEY] * len(range(0, n, KEY_EVERY))
        pattern[0] = SAMPLE
        return itertools.cycle(tuple(pattern))

    def drain(self) -> tuple[list[Entry], list[str]]:
        """Every queued call, oldest first, with its bucket key (unkeyed calls: the key of the
        last keyed call before them). Switches between sparse and dense keying by what the
        keyed calls showed."""
        queue = self.queue
        n = len(queue)
        if not n:
            return [], []
        if n >= (queue.maxlen or n + 1):
            self.overflows += 1
        entries = list(itertools.starmap(queue.popleft, itertools.repeat((), n)))  # in C
        buckets = list(map(_bucket, entries))
        keyed = itertools.compress(range(n), map(operator.is_not, buckets, itertools.repeat(None)))
        last = self.last_key
        run = self.run
        changes = filled = 0
        keys: list[str] = []
        for i in keyed:  # in sparse keying one call in KEY_EVERY: the loop stays short
            b = buckets[i]
            b = b if b.__class__ is str else key_of(*b)
            if b != last:
                keys.extend([last or "-"] * (i - filled))
                filled = i
                changes += last is not None
                last = b
                run = 0
            run += 1
        keys.extend([last or "-"] * (n - filled))
        # a change against the previous drain's last key counts too: a one-shape stream that
        # moved to another shape is keyed densely again. Sparse keying starts once enough
        # keyed calls in a row had one shape, counted across drains: a drain of a call or two
        # (a window closing mid-stream) proves nothing alone (keying sparsely from there
        # counted alternating shapes under each other's keys, seen in a test run), and a
        # model serving fewer calls than that between two drains (they come every window,
        # sooner once sampled calls pile up) would otherwise be keyed on every call
        dense = changes > 0 or (self.dense and run < MIN_ONE_SHAPE)
        if dense != self.dense:
            self.dense = dense
            self.marks = self._cycle()
        self.last_key, self.run, self.last_changes = last, run, changes
        return entries, keys
