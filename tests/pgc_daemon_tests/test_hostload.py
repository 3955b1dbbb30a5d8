"""Cores kept busy outside this process (``agent/hostload.py``), read from the machine's own
counters: a real busy process next door shows, and goes once it ends."""

from __future__ import annotations

import subprocess
import sys
import time

from pgc_daemon.agent.hostload import OtherLoad

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
