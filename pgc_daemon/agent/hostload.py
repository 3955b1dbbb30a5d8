"""How many CPU cores everything but this process keeps busy, smoothed over a few seconds.

The thread count that serves a variant fastest depends on what else runs on the machine: seen
in the demo on 2 cores, int8 static · Inductor served at 13.8 ms on one thread and 18.2 on two
while the search worker held a core, and the choice of one thread then stood for the rest of
the run, after the worker had finished and two threads took 9-11 ms. The thread tuner reads
this to decide again when the load it decided under has gone (or come).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psutil

log = logging.getLogger("pgc.agent")

#: Seconds between readings (each reads /proc/stat and this process's CPU times).
INTERVAL_S = 2.0
#: Weight of the newest reading in the smoothed value (about two readings' memory).
ALPHA = 0.5


def _read() -> tuple[float, float]:
    """(CPU seconds the whole machine spent busy, CPU seconds this process spent) so far."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    busy = sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    own = psutil.Process().cpu_times()
    return busy, own.user + own.system


class OtherLoad:
    """``cores()``: the smoothed number of cores busy outside this process (None until two
    readings are in, or when the machine's counters cannot be read). Cheap to call on every
    request, from any number of request threads at once: one of them reads the counters, at
    most every ``interval_s``, while the others take the value as it stands."""

    def __init__(
        self,
        *,
        interval_s: float = INTERVAL_S,
        alpha: float = ALPHA,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], tuple[float, float]] = _read,
    ) -> None:
        self.interval_s = interval_s
        self.alpha = alpha
        self._clock = clock
        self._read = read
        self._at = -float("inf")
        self._last: tuple[float, float] | None = None
        self._value: float | None = None
        self._broken = False
        self._reading = threading.Lock()
        #: no reading is taken above the machine's cores (/proc/stat's iowait may go backwards)
        self._most = float(os.cpu_count() or 1)

    def cores(self) -> float | None:
        if self._clock() - self._at < self.interval_s or self._broken:
            return self._value
        # Two request threads reading at once once took the second's interval from the first's
        # new timestamp: microseconds of wall against a 10 ms tick of busy time, "6.7 cores
        # busy" on a 2-core machine (demo run 16). One reader; the others do not wait.
        if not self._reading.acquire(blocking=False):
            return self._value
        try:
            now = self._clock()
            if now - self._at < self.interval_s:
                return self._value  # another thread read while this one came in
            try:
                busy, own = self._read()
            except Exception as exc:  # noqa: BLE001 - no load reading, no load-driven decision
                log.info("host load unreadable, thread choices not tied to it: %s", exc)
                self._broken, self._value = True, None
                return None
            if self._last is not None:
                wall = now - self._at
                other = ((busy - self._last[0]) - (own - self._last[1])) / wall
                other = min(max(0.0, other), self._most)
                self._value = other if self._value is None else (
                    self.alpha * other + (1 - self.alpha) * self._value)
            self._at, self._last = now, (busy, own)
            return self._value
        finally:
            self._reading.release()
