"""The exporter: hands closed windows to a sink in batches, on its own thread.

Producers (the profiler's ticker, a flush) only ``offer``: a non-blocking append to a bounded
queue. When the sink is slow or failing the queue fills, and the *oldest* queued item is
dropped and counted (recent windows are worth more than old ones). One writer thread takes up
to ``batch`` items at a time and calls ``sink(items)`` once for them, so a store writes them
in one transaction. A sink that raises is retried with the same batch, ``retries`` more times
with a doubling backoff (a store that is briefly locked or restarting loses nothing); only
then is the batch lost (counted as dropped). Every failed call counts as a failure; the
thread carries on. Items still queued when :meth:`Exporter.stop` gives up count as dropped
too, so ``dropped`` is every item offered and never written. Nothing here ever blocks or
raises into a model call.

Threading contract: ``offer``, ``wait_idle`` and the counters are safe from any thread;
``start`` and ``stop`` belong to the owner. ``dropped``, ``exported`` and ``failures`` only
grow.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pgc.profiler")
#: Further attempts at a batch the sink refused, and the wait before the first of them
#: (doubling after each): 0.5 + 1 + 2 s, so a store that is back within seconds loses nothing.
RETRIES = 3
RETRY_BACKOFF_S = 0.5


class Exporter:
    def __init__(
        self,
        sink: Callable[[list[Any]], None],
        *,
        max_queue: int = 64,
        batch: int = 16,
        name: str = "pgc-exporter",
        retries: int = RETRIES,
        backoff_s: float = RETRY_BACKOFF_S,
    ) -> None:
        if max_queue < 1 or batch < 1:
            raise ValueError("max_queue and batch must be >= 1")
        if retries < 0 or backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        self.retries = retries
        self.backoff_s = backoff_s
        self._sink = sink
        self.max_queue = max_queue
        self.batch = batch
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._writing = 0
        self._stop = False
        self.dropped = 0
        self.exported = 0
        self.failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"{name}-write", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._items)

    def offer(self, item: Any) -> bool:
        """Queue an item for the sink; drop (and count) the oldest queued one when full."""
        if item is None:
            return False
        with self._cond:
            while len(self._items) >= self.max_queue:
                self._items.popleft()
                self.dropped += 1
            self._items.append(item)
            self._cond.notify_all()
        return True

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until everything offered so far is written or dropped (best effort)."""
        if not self._thread.is_alive():
            return not self._items
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._writing, timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._items or self._stop)
                if not self._items:
                    return  # stopping, and nothing left
                n = min(self.batch, len(self._items))
                items = [self._items.popleft() for _ in range(n)]
                self._writing = n
            ok = self._write(items)
            with self._cond:
                if ok:
                    self.exported += n
                else:
                    self.dropped += n
                self._writing = 0
                self._cond.notify_all()

    def _write(self, items: list[Any]) -> bool:
        """Hand one batch to the sink, retrying with backoff; whether it was written. While
        stopping, the backoff is not waited out (``stop`` bounds how long it waits)."""
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                self._sink(items)
                return True
            except Exception as exc:  # noqa: BLE001 - a failing store must not kill the thread
                self.last_error = f"{type(exc).__name__}: {exc}"
                with self._cond:
                    self.failures += 1
                if attempt == self.retries:
                    log.warning("profiler export failed %d times (%s); %d window(s) dropped",
                                attempt + 1, self.last_error, len(items))
                    return False
                log.debug("profiler export failed (%s); retrying in %.1fs", self.last_error, wait)
                with self._cond:
                    self._cond.wait_for(lambda: self._stop, wait)
                wait *= 2
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout``), then end the thread. Items of an exporter
        that was never started count as dropped (nothing will write them)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        if self._thread.ident is None:  # never started: nothing will write these
            with self._cond:
                self.dropped += len(self._items)
                self._items.clear()
