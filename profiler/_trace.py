"""One ``torch.profiler`` trace at a time in a process.

Kineto keeps one activity profiler per process. Two traces that overlap, from two threads,
end the process (SIGSEGV, after Kineto's "External init callback must run in same thread as
registerClient"): on torch 2.13, two models sampled on every call in one process crashed
within 3 s in 3 tries of 3. A server with two attached models samples each on its own, and
a twin's calibration traces beside the other model's sampled calls, so every trace pgc
takes holds this lock: a call that finds it held is not sampled (``try_trace``); the rest
wait (``exclusive_trace``).

Torch cannot tell whether another thread traces (its "enabled" flag is per thread), so a
trace of the application's own is only safe inside ``exclusive_trace`` too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_LOCK = threading.Lock()


class TraceBusy(TimeoutError):
    """Another trace in this process holds the profiler (past the wait, where there is one)."""


@contextlib.contextmanager
def exclusive_trace(timeout_s: float = 30.0) -> Iterator[None]:
    """Run the block as the process's only ``torch.profiler`` trace: waits up to
    ``timeout_s`` for one in flight (pgc's own hold it for one call), else ``TraceBusy``."""
    if not _LOCK.acquire(timeout=timeout_s):
        raise TraceBusy(f"another torch.profiler trace in this process held it for {timeout_s} s")
    try:
        yield
    finally:
        _LOCK.release()


def try_trace() -> Any | None:
    """A started CPU trace (``torch.autograd.profiler.profile``), or None at once if another
    is in flight; ``end_trace`` stops it and lets the next one start."""
    from torch.autograd.profiler import profile  # noqa: PLC0415

    if not _LOCK.acquire(blocking=False):
        return None
    try:
        trace = profile(use_cpu=True)  # CPU ops only (torch.profiler's own front end adds
        trace.__enter__()  # 60 µs a call for schedules this does not use)
    except BaseException:
        _LOCK.release()
        raise
    return trace


def end_trace(trace: Any) -> None:
    """Stop a trace ``try_trace`` started."""
    try:
        trace.__exit__(None, None, None)
    finally:
        _LOCK.release()
