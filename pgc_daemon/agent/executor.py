"""The serving executor: one inference thread per served model, which request threads hand
their calls to.

Why: libgomp keeps an OpenMP team (a pool of helper threads) for every thread that has run
parallel torch work, for as long as that thread lives. Once the process holds more such
threads than cores, every team's barriers stop spin-waiting and sleep instead, and every
forward pass slows down: ``bench/threads.py`` measured a compiled MiniLM 1.44-1.82x slower
from a server's request thread than from the thread that built it, on 2 cores. A server with
several request threads calling the model directly grows a team per thread. Through the
executor, only its thread runs the model, so the model has one team however many request
threads call it. That pays where the inference thread's team is the only one in the process:
a team started by the user's main thread (loading, warming the model there) or by any other
long-lived thread counts too. And a lone team's barriers spin: on a host where other processes
keep the cores busy they wait out preempted team-mates, and were measured slower there than
several sleeping teams (on 2 busy cores: 60-360 ms against 16-30 ms for MiniLM int8, 8-10 ms
when quiet); such a host wants ``OMP_WAIT_POLICY=PASSIVE``, set before the process starts.
``pgc doctor`` measures which case a machine is in.

The hand-off copies nothing: the request thread queues its ``(args, kwargs)`` objects and
blocks until the inference thread has run ``fn(args, kwargs)`` (the request path,
:meth:`~pgc_daemon.agent.served.ServedModel._serve`), then returns its result or raises the
very exception object it raised. Everything the request path does (slot pick, canary, per-layer
profiling, fallback, reservoir) therefore happens on the inference thread.

It never hangs a caller: a call runs inline, in the caller's own thread, when the executor is
not started or is stopped, when the call comes from the inference thread itself (a model that
calls its served object, re-entrantly), when the inference thread has died, or when its call
was still queued while the inference thread was stuck on one call for ``stall_s`` (say a
model that waits for another thread calling the served object). :meth:`stop` serves what was
queued before it, then ends the thread; calls arriving meanwhile run inline.

**Micro-batching** (``max_batch`` > 1; off by default; where allowed, it serves only while it
raises throughput, measured live: :mod:`~pgc_daemon.agent.batchchoice`): calls waiting together
(the first waits up to ``max_delay_ms`` from its arrival for others) whose inputs have the same
structure, the same non-tensor values and tensors of the same dtype, device and shape but for
dim 0, are concatenated along dim 0 and run as one call; every output tensor is split back
along dim 0. Only for models whose rows are independent (each output row depends on its input
row alone), which is the user's promise in asking for it. Calls that do not match run one by
one; a batched run that raises, or whose outputs are not tensors with the batch's total on dim
0, is run again call by call, so each caller gets its own result or error (the latter also
turns batching off for the executor). The request path sees one call per batch (profiling, the
reservoir and the canary see the batched inputs, which are what the model really runs).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from pgc_daemon.agent.batchchoice import BatchChoice

log = logging.getLogger("pgc.agent")

#: How often a waiting caller checks that the inference thread is alive and not stuck.
POLL_S = 0.25
#: A call still queued while the inference thread has run one call for this long runs inline.
STALL_S = 10.0

_QUEUED, _TAKEN, _RECLAIMED, _ANSWERED = 0, 1, 2, 3
_STOP = object()


class _Call:
    __slots__ = ("args", "kwargs", "at", "state", "out", "error", "done")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs
        self.at = time.monotonic()
        self.state = _QUEUED
        self.out: Any = None
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()  # released once the call is answered (or handed back)


class Executor:
    """Run ``fn(args, kwargs)`` for request threads on one inference thread.

    Threading: :meth:`submit` from any thread; :meth:`start` and :meth:`stop` from the
    owner (the served model's start-up and shut-down). ``fn`` runs on the inference thread,
    or inline in the caller as described in the module docstring."""

    def __init__(
        self,
        fn: Callable[[tuple[Any, ...], dict[str, Any]], Any],
        *,
        name: str = "model",
        max_batch: int = 1,
        max_delay_ms: float = 2.0,
        stall_s: float = STALL_S,
        choice: BatchChoice | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if max_delay_ms < 0:
            raise ValueError("max_delay_ms must not be negative")
        self._fn = fn
        self.max_batch = max_batch
        self.max_delay_s = max_delay_ms / 1e3
        self.stall_s = stall_s
        self.threads = torch.get_num_threads()
        """The intra-op thread count the inference thread uses (the creating thread's)."""
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the state of queued calls
        self._thread = threading.Thread(target=self._loop, name=f"pgc-infer-{name}", daemon=True)
        self._ident: int | None = None
        self._accepting = False
        self._busy_since: float | None = None
        self.batching_off: str | None = None
        """Why micro-batching was turned off (a model whose outputs cannot be split)."""
        self.calls = self.inline = self.batches = self.batched_calls = 0
        self.choice = (choice or BatchChoice()) if max_batch > 1 else None
        """Whether micro-batching serves now, chosen on live traffic (None: it may not)."""
        self.batch_calls = 1
        """Calls in the run on the inference thread now (more than one: a batch)."""

    # ------------------------------------------------------------------ owner

    def start(self) -> Self:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._accepting = True
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Serve the calls queued so far, then end the thread; later calls run inline."""
        if not self._accepting:
            return
        self._accepting = False
        self._queue.put(_STOP)
        if self._thread.is_alive() and threading.get_ident() != self._ident:
            self._thread.join(timeout)

    @property
    def ident(self) -> int | None:
        """The inference thread's ``threading.get_ident()`` (None before it started)."""
        return self._ident

    @property
    def alive(self) -> bool:
        return self._accepting and self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        return {
            "alive": self.alive, "threads": self.threads, "calls": self.calls,
            "inline": self.inline, "queued": self._queue.qsize(), "max_batch": self.max_batch,
            "batches": self.batches, "batched_calls": self.batched_calls,
            "batching_off": self.batching_off,
            "batching": None if self.choice is None else self.choice.status(),
        }

    # ------------------------------------------------------------------ request threads

    def submit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(args, kwargs)`` on the inference thread; its result, or its exception raised."""
        if not self._accepting or threading.get_ident() == self._ident:
            self.inline += 1
            return self._fn(args, kwargs)
        call = _Call(args, kwargs)
        self._queue.put(call)
        if not call.done.acquire(timeout=POLL_S):
            self._await(call)
        if call.state == _RECLAIMED:
            self.inline += 1
            return self._fn(args, kwargs)
        error = call.error
        if error is not None:
            call.error = None
            try:
                raise error  # the object the model raised, unchanged
            finally:
                del error
        return call.out

    def _await(self, call: _Call) -> None:
        """Wait for ``call`` to be answered; take it back (to run inline) if it is still queued
        while the inference thread is gone or stuck, or if the thread died running it."""
        while not call.done.acquire(timeout=POLL_S):
            alive = self._thread.is_alive()
            since = self._busy_since
            if alive and (since is None or time.monotonic() - since <= self.stall_s):
                continue
            with self._lock:
                if call.state == _QUEUED or (not alive and call.state == _TAKEN):
                    call.state = _RECLAIMED
                    return

    # ------------------------------------------------------------------ inference thread

    def _claim(self, item: Any) -> bool:
        if item is _STOP:
            return False
        with self._lock:
            if item.state != _QUEUED:
                return False
            item.state = _TAKEN
            return True

    def _loop(self) -> None:
        self._ident = threading.get_ident()
        if torch.get_num_threads() != self.threads:  # a thread started while another had
            torch.set_num_threads(self.threads)     # set it lower (runtime.one_thread)
        pending: list[_Call] = []
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    break
                if not self._claim(item):
                    continue
                pending = [item]
                choice = self.choice if self.batching_off is None else None
                if choice is not None and choice.batching():
                    self._gather(pending)
                self._busy_since = time.monotonic()
                t0 = time.perf_counter_ns()
                self._run(pending)
                self._busy_since = None
                if choice is not None:
                    busy_ns = time.perf_counter_ns() - t0
                    try:
                        choice.record([c.at for c in pending], busy_ns, time.monotonic())
                    except Exception:  # noqa: BLE001 - never the end of the inference thread
                        log.warning("the micro-batching choice failed; batching off", exc_info=True)
                        self.choice = None
                pending = []  # let the last batch's tensors go
            while True:  # stopped: serve what was queued before the stop
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if self._claim(item):
                    pending = [item]
                    self._run(pending)
                    pending = []
        finally:
            self._busy_since = None
            self._accepting = False
            self._hand_back(pending)

    def _gather(self, batch: list[_Call]) -> None:
        """Add to ``batch`` the calls waiting, or arriving by the first one's deadline."""
        deadline = batch[0].at + self.max_delay_s
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    return
            if item is _STOP:
                self._queue.put(_STOP)  # after what is queued: those are still served
                return
            if self._claim(item):
                batch.append(item)

    def _hand_back(self, calls: list[_Call]) -> None:
        """The thread ends: every call not answered goes back to its caller, to run inline."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                calls.append(item)
        for call in calls:
            with self._lock:
                if call.state not in (_QUEUED, _TAKEN):
                    continue
                call.state = _RECLAIMED
            call.done.release()

    def _run(self, calls: list[_Call]) -> None:
        self.calls += len(calls)
        if len(calls) == 1:
            return self._run_one(calls[0])
        try:
            groups = _groups(calls)
        except Exception:  # noqa: BLE001 - inputs pytree cannot take apart: one by one
            groups = [[(call, [], None)] for call in calls]
        for group in groups:
            if len(group) == 1 or not self._run_batched(group):
                for call, _, _ in group:
                    self._run_one(call)
        return None

    def _run_one(self, call: _Call) -> None:
        try:
            call.out = self._fn(call.args, call.kwargs)
        except BaseException as exc:  # noqa: BLE001 - the caller's to raise
            call.error = exc
        call.state = _ANSWERED
        call.done.release()

    def _run_batched(self, group: list[tuple[_Call, list[Any], Any]]) -> bool:
        """One run for the group; False (nothing answered) when it must be run call by call."""
        sizes = [_rows(leaves) or 0 for _, leaves, _ in group]
        first, spec = group[0][1], group[0][2]
        try:
            merged = [_cat([leaves[i] for _, leaves, _ in group]) if torch.is_tensor(x) else x
                      for i, x in enumerate(first)]
            args, kwargs = tree_unflatten(merged, spec)
            self.batch_calls = len(group)
            try:
                out = self._fn(args, kwargs)
            finally:
                self.batch_calls = 1
        except BaseException:  # noqa: BLE001 - run alone, each caller gets its own error
            log.debug("a batched call failed; serving its calls one by one", exc_info=True)
            return False
        try:
            outs, out_spec = tree_flatten(out)
            total = sum(sizes)
            if not outs or not all(torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == total
                                   for t in outs):
                raise ValueError("the model's outputs are not tensors with the batch on dim 0")
            parts = [t.split(sizes) for t in outs]
            answers = [tree_unflatten([p[j] for p in parts], out_spec) for j in range(len(group))]
        except Exception as exc:  # noqa: BLE001 - served call by call from now on
            self.batching_off = str(exc)
            log.warning("micro-batching off for this model: %s", exc)
            return False
        self.batches += 1
        self.batched_calls += len(group)
        for (call, _, _), answer in zip(group, answers, strict=True):
            call.out = answer
            call.state = _ANSWERED
            call.done.release()
        return True


def executor_for(
    fn: Callable[[tuple[Any, ...], dict[str, Any]], Any], name: str, options: dict[str, Any] | None,
    choice: BatchChoice | None = None,
) -> Executor | None:
    """An executor for ``fn`` with ``options`` (:class:`Executor`'s keywords); None for None."""
    return None if options is None else Executor(fn, name=name, choice=choice, **options)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 into the kind of tensor the callers passed: an inference tensor
    only if they all are (a compiled model guards on it, and would recompile)."""
    if all(t.is_inference() for t in tensors):
        with torch.inference_mode():
            return torch.cat(tensors)
    with torch.inference_mode(False):
        return torch.cat(tensors)


def _rows(leaves: list[Any]) -> int | None:
    """The batch size of one call's inputs: dim 0 of every tensor, if they all agree."""
    rows = {int(t.shape[0]) if t.dim() > 0 else None for t in leaves if torch.is_tensor(t)}
    return rows.pop() if len(rows) == 1 else None


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype
                and a.device == b.device and a.layout == b.layout == torch.strided
                and a.shape[1:] == b.shape[1:])
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b) is True
    except Exception:  # noqa: BLE001 - not comparable: not batchable
        return False


def _groups(calls: list[_Call]) -> list[list[tuple[_Call, list[Any], Any]]]:
    """Calls in groups that can run as one (in arrival order); a call that matches no group's
    first call, or whose inputs have no common batch size, is a group of its own."""
    groups: list[list[tuple[_Call, list[Any], Any]]] = []
    for call in calls:
        leaves, spec = tree_flatten((call.args, call.kwargs))
        entry = (call, leaves, spec)
        if _rows(leaves) is None:
            groups.append([entry])
            continue
        for group in groups:
            _, head, head_spec = group[0]
            if (head_spec == spec and _rows(head) is not None and len(head) == len(leaves)
                    and all(_same(a, b) for a, b in zip(head, leaves, strict=True))):
                group.append(entry)
                break
        else:
            groups.append([entry])
    return groups
