"""Process and thread tricks that keep pgc's background work off the request path.

The swapper builds, warms and verifies variants inside the user's serving process, next to
the threads that answer requests. Every helper here exists because a measurement showed that
background work slowed requests down in a way that lower thread priority alone did not fix;
each docstring says which. torch.fx tracing is here too: it patches ``nn.Module.__call__``
for the whole process, and the request path has to notice.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger("pgc.swapper")
T = TypeVar("T")

SWAPPER_NICE = 10
#: Python's thread switch interval while a deployment runs in this process. Compiling, the
#: store's ORM and the canary's statistics hold the GIL for long stretches; a serving thread
#: waits up to one interval for it after every torch op or compiled kernel (each releases it),
#: so at the default 5 ms an eager forward pass of a few hundred ops can take seconds while a
#: variant compiles, and a compiled one (its Python wrapper calls ~100 kernels) 2-3x longer
#: while the swapper records transitions. At 0.1 ms that wait is small.
SWITCH_INTERVAL_S = 1e-4
#: torch.fx tracing (export, quantization, some compiler passes; pgc builds variants in this
#: process) patches ``nn.Module.__call__`` for the whole process while it traces, and a call
#: another thread makes at that moment can fail inside the tracer's bookkeeping. Such a call
#: is served again once the tracer is done, waiting at most this long.
TRACING_WAIT_S = 5.0
_ORIGINAL_MODULE_CALL = getattr(
    torch.fx._symbolic_trace, "_orig_module_call", torch.nn.Module.__call__
)


def tracing_now() -> bool:
    return torch.nn.Module.__call__ is not _ORIGINAL_MODULE_CALL


def traced_while_serving(exc: BaseException) -> bool:
    """Whether a failure of the user's module came from torch.fx tracing in another thread
    rather than from the module or its input."""
    return tracing_now() or "not installed as a submodule" in str(exc)


def wait_out_tracing() -> None:
    """Wait (at most ``TRACING_WAIT_S``) until no torch.fx tracer patches module calls."""
    deadline = time.monotonic() + TRACING_WAIT_S
    while tracing_now() and time.monotonic() < deadline:
        time.sleep(0.005)


def call_after_tracing(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
    """Serve a call again (in inference mode) once torch.fx tracing elsewhere in the process
    is over: what a call that :func:`traced_while_serving` failed does."""
    wait_out_tracing()
    with torch.inference_mode():
        return module(*args, **kwargs)


def in_short_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread that ends when it returns (and re-raise what it raised).

    A thread that has run parallel torch work keeps an OpenMP team; while it lives, libgomp
    counts more threads than cores and stops spin-waiting at its barriers, and every forward
    pass in the process slows down: measured on MiniLM with 2 cores, serving threads ran 2x
    slower (17 -> 28 ms fp32, 7 -> 16 ms int8) for as long as the thread that had built a
    variant lived, idle or not, and recovered the moment it ended. The swapper lives as long
    as the model is served, so its torch work runs in threads like this one (which inherit
    its lower priority)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            error.append(exc)

    worker = threading.Thread(target=run, name="pgc-swapper-work", daemon=True)
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]


class Launcher:
    """Runs work as the serving threads would: in a short thread (``in_short_thread``) that
    a thread of its own starts, at the priority of the thread that made the launcher (the
    user's, at ``attach``), not the swapper's lower one (Linux threads take their creator's
    nice value, and a thread cannot raise its own without privileges). For measurements that
    stand for serving: the profiling twin's calibration ran in a swapper thread while the
    search worker held a core and measured 7.11 ms for what costs 1.2 ms when quiet (demo
    run 27); the rows it corrected then read 0 ms between kernels."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()  # now, in the thread making the launcher: its priority

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float = 300.0) -> T:
        """``fn(*args)`` in a short thread at the launcher's priority; re-raises what it
        raised. A launcher that has stopped runs it in a short thread of the caller's."""
        if not self._thread.is_alive():
            return in_short_thread(fn, *args)
        done, box = threading.Event(), []
        self._jobs.put((fn, args, done, box))
        if not done.wait(timeout_s):
            name = getattr(fn, "__name__", "work")
            raise TimeoutError(f"{name} did not end in {timeout_s:.0f} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self, wait_s: float = 5.0) -> None:
        """End the launcher's thread once the work in hand is done (waiting up to ``wait_s``)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            del job  # not kept till the next job: it holds what it ran on (a twin, its variant)

    @staticmethod
    def _run(fn: Callable[..., Any], args: tuple[Any, ...], done: threading.Event,
             box: list[Any]) -> None:
        try:
            box.append((True, in_short_thread(fn, *args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))
        done.set()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch work in this thread without an OpenMP team: a second team beside the serving
    threads' makes every thread's barriers sleep instead of spin (more threads than cores).
    Only for eager modules: compiled code was generated for the serving thread count.
    ``torch.set_num_threads`` also sets the count that threads starting meanwhile take, so it
    is put back before the short-lived thread this runs in ends."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_turns_lock = threading.Lock()
_turns_depth = 0
_turns_before = 0.0


@contextlib.contextmanager
def short_gil_turns() -> Iterator[None]:
    """While a deployment runs here, serving threads get the GIL back quickly. The interval is
    one per process, and the swappers of several served models may overlap: the first to
    enter sets it, the last to leave puts it back."""
    global _turns_depth, _turns_before
    with _turns_lock:
        if _turns_depth == 0:
            _turns_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_turns_before, SWITCH_INTERVAL_S))
        _turns_depth += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns_depth -= 1
            if _turns_depth == 0:
                sys.setswitchinterval(_turns_before)


_unfreeze_at_exit = False


def settle_heap() -> None:
    """Collect what compiling left behind, then freeze what survives (``gc.freeze``).

    Compiling a variant leaves millions of long-lived Python objects (the FX graphs, guards and
    generated code it keeps), and every full collection afterwards scans them all with the GIL
    held: measured 100-540 ms stalls of every serving thread on MiniLM. Frozen objects are
    left out of collections. This is one long collection now, while deploying, instead of one
    on the request path every few seconds. Unfreezing first lets a variant dropped from the
    warm set (or anything else frozen last time) be collected."""
    global _unfreeze_at_exit
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:  # let the interpreter's last collections free frozen objects
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    log.debug("heap settled in %.0f ms; %d objects frozen", (time.perf_counter() - started) * 1e3,
              gc.get_freeze_count())


def thread_nice() -> int | None:
    """The calling thread's nice value (None where threads have none of their own)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


def lower_priority() -> None:
    """Run this thread (and the compiler processes it starts) at a lower CPU priority than
    the serving threads: building, compiling and verifying must not take the cores from
    requests. Linux applies nice values per thread; elsewhere this does nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SWAPPER_NICE)
    except (AttributeError, OSError):
        log.debug("could not lower the swapper's priority", exc_info=True)


# ---------------------------------------------------------------------- yielding to requests

POLL_S = 0.0002


class YieldToRequests(TorchFunctionMode):
    """Background torch work that steps aside while requests run.

    The swapper computes fp32 reference outputs in the serving process (the verification set,
    and the canary's shadow checks on live inputs). On a machine whose cores the requests
    already use, every millisecond of that work that overlaps a request stretches the request:
    measured in ``bench/hotswap.py`` (MiniLM, 2 cores, 2 clients), four shadow forwards per
    canary lifted the request p99 from 24 to 44 ms. Lower thread priority alone does not help
    much: a request's OpenMP barriers wait for whichever of its threads was preempted.

    A torch function mode is active in the thread that enters it and nowhere else: before each
    torch operation of that thread it waits while any request is in flight (up to
    ``max_wait_s`` per operation, ``budget_s`` in all, so that saturating traffic delays the
    background work but cannot stall it). Only for eager modules: a compiled module would see
    the mode while tracing.
    """

    def __init__(
        self, requests_in_flight: Callable[[], bool], *, max_wait_s: float = 0.02, budget_s: float = 2.0
    ) -> None:
        super().__init__()
        self.requests_in_flight = requests_in_flight
        self.max_wait_s = max_wait_s
        self.budget_s = budget_s
        self.waited_s = 0.0

    def wait(self) -> None:
        """Wait for a moment with no request in flight (within the limits)."""
        if self.waited_s >= self.budget_s or not self.requests_in_flight():
            return
        started = time.monotonic()
        deadline = started + min(self.max_wait_s, self.budget_s - self.waited_s)
        while self.requests_in_flight() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.waited_s += time.monotonic() - started

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.wait()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def background_reference(requests_in_flight: Callable[[], bool]) -> Iterator[None]:
    """For fp32 reference forwards of the eager base in a swapper thread: one intra-op
    thread (no second OpenMP team beside the serving threads'), and every op waits for a
    moment without requests (:class:`YieldToRequests`)."""
    with one_thread(), YieldToRequests(requests_in_flight):
        yield
