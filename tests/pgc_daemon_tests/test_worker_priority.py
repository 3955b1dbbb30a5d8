"""A search worker is niced as a whole: its threads, and (in a session of its own, as the
daemon starts it) its scheduler autogroup, which otherwise shares the CPU equally with the
serving process whatever the threads' nice (a collapse of live latency while searching)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pgc_daemon.optimizer.search.worker import WORKER_NICE

SCRIPT = """
import os
from pgc_daemon.optimizer.search.worker import lower_priority
lower_priority()
print(os.getpriority(os.PRIO_PROCESS, 0))
print(open("/proc/self/autogroup").read().strip() if os.path.exists("/proc/self/autogroup") else "-")
"""


def test_a_worker_in_its_own_session_lowers_its_threads_and_its_autogroup() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    nice, group = proc.stdout.split("\n")[:2]
    assert int(nice) >= WORKER_NICE
    if group == "-" or not Path("/proc/sys/kernel/sched_autogroup_enabled").exists():
        pytest.skip("this kernel has no scheduler autogroups")
    assert group.endswith(f"nice {WORKER_NICE}"), group
