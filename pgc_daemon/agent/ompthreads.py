"""The calling thread's intra-op thread count, and no other thread's.

``torch.set_num_threads`` sets OpenMP's count for the thread that calls it, but torch's
per-thread set-up can undo it, and a process may hold several OpenMP runtimes. What the
thread tuner (:mod:`~pgc_daemon.agent.threadtune`) and the profiling twins set goes through
the ``omp_set_num_threads`` of the runtime torch runs on, found once per process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("pgc.agent")


@functools.cache
def per_thread_setter() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch runs on (None: torch does not run
    on OpenMP here, or no runtime in the process moves torch's count). A process can hold
    several copies (torch's own, and one each for scikit-learn, SciPy, ...): the one chosen is
    the one that, in a throwaway thread, changes what ``torch.get_num_threads`` says."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    torch_lib = str(Path(torch.__file__).parent)
    for path in sorted(paths, key=lambda p: not p.startswith(torch_lib)):  # torch's own first
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        if _moves_torch(fn):
            return fn
    log.debug("no OpenMP runtime here sets torch's intra-op count per thread: %s", sorted(paths))
    return None


def _moves_torch(setter: Callable[[int], None]) -> bool:
    seen: list[int] = []

    def probe() -> None:
        before = torch.get_num_threads()  # (also runs torch's per-thread set-up first)
        setter(before + 1)
        seen.append(torch.get_num_threads() - before)

    t = threading.Thread(target=probe, name="pgc-omp-probe", daemon=True)
    t.start()
    t.join(5.0)
    return seen == [1]


def set_thread_count(n: int) -> None:
    """The calling thread's intra-op thread count (no other thread's)."""
    setter = per_thread_setter()
    if setter is not None:
        torch.get_num_threads()  # torch's per-thread set-up first: it would undo the count
        setter(n)
