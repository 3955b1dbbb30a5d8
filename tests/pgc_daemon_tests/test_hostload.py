"""Cores kept busy outside this process (``agent/hostload.py``), read from the machine's own
counters: a real busy process next door shows, and goes once it ends."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pgc_daemon.agent.hostload import OtherLoad

pytestmark = pytest.mark.serial  # it reads the machine's load, which a parallel worker adds to


SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def _settle(load: OtherLoad, seconds: float) -> float | None:
    end = time.monotonic() + seconds
    value = None
    while time.monotonic() < end:
        value = load.cores()
        time.sleep(0.05)
    return value


def test_a_busy_process_next_door_shows_and_goes() -> None:
    load = OtherLoad(interval_s=0.5, alpha=1.0)  # each reading on its own
    _settle(load, 1.2)
    quiet = load.cores()
    assert quiet is not None
    spin = subprocess.Popen([sys.executable, "-c", SPIN.format(s=4.0)])
    try:
        busy = _settle(load, 3.0)
    finally:
        spin.wait(10)
    after = _settle(load, 1.5)
    assert busy is not None and after is not None
    # this process sleeps, the spinner holds a core: about one more core busy next door
    assert busy - quiet > 0.6, (quiet, busy)
    assert busy - after > 0.6, (busy, after)


def test_this_process_own_work_does_not_count() -> None:
    load = OtherLoad(interval_s=0.5, alpha=1.0)
    _settle(load, 1.2)
    quiet = load.cores()
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # a core busy in this very process
        load.cores()
    own = load.cores()
    assert quiet is not None and own is not None
    assert own < quiet + 0.4, (quiet, own)


def test_smoothing_and_rate_limit_on_given_counters() -> None:
    now = [0.0]
    readings = iter([(0.0, 0.0), (2.0, 0.0), (2.0, 0.0), (3.0, 1.0)])
    load = OtherLoad(interval_s=2.0, alpha=0.5, clock=lambda: now[0], read=lambda: next(readings))
    assert load.cores() is None  # one reading: no rate yet
    now[0] = 1.0
    assert load.cores() is None  # not read again before the interval
    now[0] = 2.0
    assert load.cores() == 1.0  # 2 busy-seconds over 2 s, none of them ours
    now[0] = 4.0
    assert load.cores() == 0.5  # an idle reading, smoothed
    now[0] = 6.0
    assert load.cores() == 0.25  # 1 busy-second, all ours


def test_unreadable_counters_give_no_load() -> None:
    def broken() -> tuple[float, float]:
        raise OSError("no /proc here")

    load = OtherLoad(read=broken)
    assert load.cores() is None and load.cores() is None


def test_request_threads_reading_at_once_read_the_counters_once() -> None:
    """Seen in demo run 16: "6.7 cores busy outside this process" on a 2-core machine. Two
    request threads past the interval both read; the second divided its busy time by the
    microseconds since the first's reading."""
    reads = []

    def one_core_busy() -> tuple[float, float]:  # a slow read of a machine with 1 core busy
        t = time.monotonic()
        reads.append(t)
        time.sleep(0.05)
        return t, 0.0

    load = OtherLoad(interval_s=0.3, alpha=1.0, read=one_core_busy)
    load.cores()
    time.sleep(0.35)
    start = threading.Barrier(8)
    values: list[float | None] = []

    def request() -> None:
        start.wait()
        values.append(load.cores())

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 2, reads
    value = load.cores()
    assert value is not None and 0.8 < value < 1.2, value
    assert all(v is None or v == value for v in values), values


def test_a_reading_never_says_more_cores_than_the_machine_has() -> None:
    now = [0.0]
    readings = iter([(0.0, 0.0), (1000.0, 0.0)])  # a counter that jumped
    load = OtherLoad(interval_s=2.0, alpha=1.0, clock=lambda: now[0], read=lambda: next(readings))
    load.cores()
    now[0] = 2.0
    assert load.cores() == os.cpu_count()
