"""The request path's marks and call queue: which calls are sampled and keyed, and how unkeyed
calls are counted. Real tensors, a real profiler, the agent's inline steps."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from profiler import KEY, SAMPLE, CallQueue, Profiler, ProfilerConfig
from profiler._calls import KEY_EVERY, MAX_CYCLE, MIN_ONE_SHAPE


def _marks(q: CallQueue, n: int) -> list[Any]:
    return [q.mark() for _ in range(n)]


def test_one_call_in_n_is_marked_for_sampling_and_dense_keying_marks_every_call() -> None:
    q = CallQueue(100)
    marks = _marks(q, 1000)
    assert marks.count(SAMPLE) == 10 and marks[0] == SAMPLE
    assert None not in marks  # dense until enough keyed calls in a row had one shape


def test_one_shape_alone_switches_to_sparse_keying_and_a_new_shape_back() -> None:
    q = CallQueue(100)
    a, b = (torch.Size([1, 8]), torch.int64), (torch.Size([1, 40]), torch.int64)
    for _ in range(50):
        q.record((1, a, 1000, False, False, 0))
    q.drain()  # the first key seen, alone: sparse from here
    assert not q.dense
    marks = _marks(q, 1600)
    assert marks.count(SAMPLE) == 16
    assert marks.count(KEY) + marks.count(SAMPLE) == 16 * len(range(0, 100, KEY_EVERY))
    # the agent records unkeyed calls as None: they count under the last key drained
    for i in range(40):
        q.record((1, b if i == 20 else None, 1000, False, False, 0))
    entries, keys = q.drain()
    assert len(entries) == 40
    assert keys[:20] == ["b1 s16"] * 20 and keys[20:] == ["b1 s64"] * 20
    assert q.dense and None not in _marks(q, 200)


def test_a_drain_of_a_few_calls_of_one_shape_keeps_every_call_keyed() -> None:
    """Seen in a test run: a window closed two calls into a stream alternating two shapes; the drain
    saw one shape "alone", keying went sparse, and two calls were counted under the other
    shape's key."""
    q = CallQueue(100)
    a, b = (torch.Size([1, 8]), torch.int64), (torch.Size([1, 40]), torch.int64)
    for shape in (a, b, a):
        q.record((1, shape, 1000, False, False, 0))
    q.drain()
    for _ in range(2):
        q.record((1, a, 1000, False, False, 0))
    q.drain()  # two calls of the last shape: no evidence of a one-shape stream
    assert q.dense and None not in _marks(q, 200)
    for _ in range(MIN_ONE_SHAPE):
        q.record((1, a, 1000, False, False, 0))
    q.drain()
    assert not q.dense


def test_one_shape_over_many_small_drains_switches_to_sparse_keying() -> None:
    """A model serving fewer than MIN_ONE_SHAPE calls between two drains (drains come every
    window: a model slower than 3.2 calls a second) stayed keyed on every call: the keyed
    calls in a row count across drains, and a change starts the count again."""
    q = CallQueue(100)
    a, b = (torch.Size([1, 8]), torch.int64), (torch.Size([1, 40]), torch.int64)
    for _ in range(MIN_ONE_SHAPE // 8 - 1):
        for _ in range(8):
            q.record((1, a, 1000, False, False, 0))
        q.drain()
        assert q.dense
    for _ in range(7):
        q.record((1, a, 1000, False, False, 0))
    q.record((1, b, 1000, False, False, 0))  # a change just short of the count
    q.drain()
    assert q.dense and q.run == 1
    for _ in range(MIN_ONE_SHAPE // 8):
        assert q.dense
        for _ in range(8):
            q.record((1, b, 1000, False, False, 0))
        q.drain()
    assert not q.dense and None in _marks(q, 100)


def test_a_rate_rarer_than_the_longest_cycle_samples_one_sample_mark_in_k() -> None:
    every = 3 * MAX_CYCLE + 7
    q = CallQueue(every)
    sampled = sum(1 for _ in range(10 * every) if q.mark() == SAMPLE and q.due())
    assert sampled in (9, 10, 11)
    q.set_every(50)
    assert sum(1 for _ in range(500) if q.mark() == SAMPLE and q.due()) == 10


def test_the_agents_inline_steps_count_every_call_under_its_own_shape() -> None:
    """The serving path's steps (as in ``profiler._profiler``'s docstring) on mixed shapes
    and then on one shape: every call is counted once, each under its own key."""
    prof = Profiler(ProfilerConfig(sample_every=7, budget=None, host_interval_s=None))
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 2))
    prof.watch(model)

    def call(x: torch.Tensor) -> None:
        calls = prof.calls
        mark = next(calls.marks)
        token = prof.sample(model) if mark else None
        t0 = time.perf_counter_ns()
        (token.module if token is not None else model)(x)
        t1 = time.perf_counter_ns()
        if mark is None:
            calls.queue.append((1, None, t1 - t0, False, False, 0))
        else:
            prof.end(token, 1, (x,), {}, t1 - t0)

    short, long_ = torch.zeros(1, 10, dtype=torch.long), torch.zeros(1, 100, dtype=torch.long)
    for i in range(300):
        call(short if i % 3 else long_)
    win = prof.close_window()
    assert {r.shape_bucket: r.count for r in win.requests} == {"b1 s16": 200, "b1 s128": 100}
    for _ in range(400):
        call(short)
        if _ == MIN_ONE_SHAPE:
            prof.status()  # a drain that sees one shape alone: sparse keying from here
    assert not prof.calls.dense
    win = prof.close_window()
    assert {r.shape_bucket: r.count for r in win.requests} == {"b1 s16": 400}
    assert sum(r.sampled for r in win.requests) >= 400 // 7 - 2


def test_the_ticker_drains_early_only_when_that_can_end_dense_keying() -> None:
    """Drains come every window; while one shape is queued, the ticker drains once enough
    calls are in to switch to sparse keying (MiniLM in the overhead bench, a few calls a
    second, was keyed on every call for a whole window). Mixed shapes wait for the window."""
    prof = Profiler(ProfilerConfig(sample_every=1000, budget=None, host_interval_s=None,
                                   control_s=0.05, window_s=600.0), sink=lambda ws: None)
    a, b = (torch.Size([1, 8]), torch.int64), (torch.Size([1, 40]), torch.int64)
    prof.start()
    try:
        for i in range(MIN_ONE_SHAPE - 1):
            prof.calls.record((1, a if i % 2 else b, 1000, False, False, 0))
        time.sleep(0.3)
        assert len(prof.calls) == MIN_ONE_SHAPE - 1  # too few to prove anything: not drained
        prof.calls.record((1, b, 1000, False, False, 0))
        deadline = time.monotonic() + 5
        while len(prof.calls) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(prof.calls) == 0 and prof.calls.dense  # drained: it saw two shapes
        for _ in range(2 * MIN_ONE_SHAPE):  # one shape now, but the last drain saw a change
            prof.calls.record((1, a, 1000, False, False, 0))
        time.sleep(0.3)
        assert len(prof.calls) == 2 * MIN_ONE_SHAPE and prof.calls.dense
        prof.status()  # a window's drain: it sees the change from the last key...
        prof.calls.record((1, a, 1000, False, False, 0))
        prof.status()  # ... and the next one the same shape throughout: sparse
        assert not prof.calls.dense
    finally:
        prof.stop()
    fresh = Profiler(ProfilerConfig(sample_every=1000, budget=None, host_interval_s=None,
                                    control_s=0.05, window_s=600.0), sink=lambda ws: None)
    fresh.start()
    try:
        for _ in range(MIN_ONE_SHAPE):
            fresh.calls.record((1, a, 1000, False, False, 0))
        deadline = time.monotonic() + 5
        while fresh.calls.dense and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not fresh.calls.dense  # sparse within a tick, not a window
    finally:
        fresh.stop()


def test_calls_recorded_by_many_threads_while_draining_are_each_counted_once() -> None:
    """A drain takes what is in and leaves what is appended meanwhile for the next one."""
    q = CallQueue(100)
    threads, per_thread = 4, 20_000
    drained: list[int] = []
    done = threading.Event()

    def serve(t: int) -> None:
        for i in range(per_thread):
            q.mark()
            q.record((t, None, i, False, False, 0))

    def drain() -> None:
        while not done.is_set():
            drained.extend(e[0] * per_thread + e[2] for e in q.drain()[0])
        drained.extend(e[0] * per_thread + e[2] for e in q.drain()[0])

    workers = [threading.Thread(target=serve, args=(t,)) for t in range(threads)]
    drainer = threading.Thread(target=drain)
    drainer.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    drainer.join()
    assert sorted(drained) == list(range(threads * per_thread))
    assert q.overflows == 0 and len(q) == 0


def test_a_drain_keeps_the_newest_calls_past_the_cap_and_says_so() -> None:
    q = CallQueue(100, maxlen=1000)
    for i in range(2500):
        q.record((1, None, i, False, False, 0))
    entries, keys = q.drain()
    assert [e[2] for e in entries] == list(range(1500, 2500)) and len(keys) == 1000
    assert q.overflows == 1 and len(q) == 0

