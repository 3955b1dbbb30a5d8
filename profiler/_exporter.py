"""The exporter: closes windows on a timer and hands them to a sink in the background.

Two threads: a ticker that closes a window every ``window_s`` (cheap, never blocks on I/O) and
a writer that drains a bounded queue into the sink. When the sink is slow or failing, the
queue fills and the oldest windows are dropped and counted; nothing ever reaches the model
call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pgc.profiler")


class Exporter:
    def __init__(
        self,
        produce: Callable[[], Any],
        sink: Callable[[Any], None],
        *,
        interval_s: float,
        max_queue: int = 64,
        name: str = "pgc-exporter",
    ) -> None:
        self._produce = produce
        self._sink = sink
        self.interval_s = interval_s
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self.dropped = 0
        self.exported = 0
        self.failures = 0
        self.last_error: str | None = None
        self._ticker = threading.Thread(target=self._tick_loop, name=f"{name}-tick", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-write", daemon=True)

    def start(self) -> None:
        self._ticker.start()
        self._writer.start()

    def offer(self, item: Any) -> bool:
        """Queue an item for the sink; drop the oldest queued one when full."""
        if item is None:
            return False
        while True:
            try:
                self._queue.put_nowait(item)
                return True
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def flush(self, timeout: float = 10.0) -> None:
        """Close the current window now and wait until the queue is written (best effort)."""
        self.offer(self._produce())
        deadline = threading.Event()
        waited = 0.0
        while not self._queue.empty() and waited < timeout:
            deadline.wait(0.05)
            waited += 0.05

    def _tick_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.offer(self._produce())
            except Exception:  # noqa: BLE001 - the exporter must outlive any bad window
                log.exception("closing a profiler window failed")

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                self._sink(item)
                self.exported += 1
            except Exception as exc:  # noqa: BLE001 - a failing store must not kill the thread
                self.failures += 1
                self.dropped += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("profiler export failed (%s); window dropped", self.last_error)

    def stop(self, flush: bool = True) -> None:
        if flush and self._ticker.is_alive():
            self.flush()
        self._stop.set()
        for t in (self._ticker, self._writer):
            if t.is_alive():
                t.join(timeout=5)
