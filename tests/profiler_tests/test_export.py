"""The exporter: batches, a bounded queue that drops the oldest and counts, failures that
never stop it, and the drop count reaching the store's rows."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn

from profiler import Exporter, Profiler, ProfilerConfig, Window


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_slow_sink_makes_the_queue_drop_the_oldest_and_count_them() -> None:
    release = threading.Event()
    written: list[list[int]] = []

    def slow(items: list[int]) -> None:
        release.wait(10)
        written.append(items)

    ex = Exporter(slow, max_queue=3, batch=10)
    ex.start()
    ex.offer(0)
    _wait(lambda: ex.queued == 0)  # the writer holds item 0 and blocks in the sink
    for i in range(1, 11):
        assert ex.offer(i)  # never blocks, never refuses
    assert ex.dropped == 7 and ex.queued == 3
    release.set()
    assert ex.wait_idle(10)
    ex.stop()
    assert written == [[0], [8, 9, 10]]  # the newest survived, in one batch
    assert ex.exported == 4 and ex.failures == 0


def test_a_failing_sink_is_retried_with_backoff_and_loses_nothing() -> None:
    calls: list[tuple[float, list[int]]] = []

    def flaky(items: list[int]) -> None:
        calls.append((time.monotonic(), items))
        if len(calls) <= 2:
            raise RuntimeError("store is down")

    ex = Exporter(flaky, max_queue=8, batch=2, retries=3, backoff_s=0.05)
    ex.offer(1)
    ex.offer(2)
    ex.offer(3)
    ex.start()
    assert ex.wait_idle(10)
    ex.stop()
    assert [items for _, items in calls] == [[1, 2], [1, 2], [1, 2], [3]]
    assert calls[2][0] - calls[1][0] >= 2 * (calls[1][0] - calls[0][0]) * 0.8  # backoff doubles
    assert calls[1][0] - calls[0][0] >= 0.04
    assert ex.failures == 2 and ex.dropped == 0 and ex.exported == 3
    assert ex.last_error == "RuntimeError: store is down"


def test_a_sink_that_keeps_failing_loses_the_batch_after_its_retries_and_keeps_going() -> None:
    calls: list[list[int]] = []

    def down(items: list[int]) -> None:
        calls.append(items)
        if items != [3]:
            raise RuntimeError("store is down")

    ex = Exporter(down, max_queue=8, batch=2, retries=2, backoff_s=0.01)
    for i in (1, 2, 3):
        ex.offer(i)
    ex.start()
    assert ex.wait_idle(10)
    ex.stop()
    assert calls == [[1, 2]] * 3 + [[3]]  # one try and two retries, then the next batch
    assert ex.failures == 3 and ex.dropped == 2 and ex.exported == 1


def test_items_of_an_exporter_never_started_count_as_dropped() -> None:
    ex = Exporter(lambda items: None, max_queue=2)
    for i in range(5):
        ex.offer(i)
    assert ex.dropped == 3  # the queue's own overflow
    ex.stop()
    assert ex.dropped == 5 and ex.queued == 0


def test_wait_idle_waits_for_the_batch_being_written() -> None:
    done: list[int] = []

    def sink(items: list[int]) -> None:
        time.sleep(0.2)
        done.extend(items)

    ex = Exporter(sink)
    ex.start()
    ex.offer(1)
    _wait(lambda: ex.queued == 0)
    assert ex.wait_idle(5) and done == [1]  # not just "the queue is empty"
    ex.stop()


def test_stop_writes_what_is_queued() -> None:
    got: list[int] = []
    ex = Exporter(got.extend, max_queue=100, batch=7)
    for i in range(20):
        ex.offer(i)
    ex.start()
    ex.stop()
    assert got == list(range(20))


def test_none_is_not_offered() -> None:
    ex = Exporter(lambda items: None)
    assert ex.offer(None) is False and ex.queued == 0


def test_windows_lost_to_a_slow_store_are_counted_in_the_next_written_window() -> None:
    release = threading.Event()
    written: list[Window] = []

    def slow(windows: list[Window]) -> None:
        release.wait(10)
        written.extend(windows)

    prof = Profiler(ProfilerConfig(window_s=0.02, max_queue=2, export_batch=1, host_interval_s=None),
                    sink=slow)
    prof.start()
    try:
        deadline = time.monotonic() + 10
        while prof.dropped < 3 and time.monotonic() < deadline:
            prof.aggregator.add_call(1, "b1", 1.0)
            time.sleep(0.01)
        assert prof.dropped >= 3
    finally:
        release.set()
        prof.stop()
    # the first window written after the loss carries the count; the rest say 0
    assert sum(w.dropped for w in written) == prof.dropped
    assert any(w.dropped > 0 for w in written)


def test_model_calls_never_wait_for_a_stuck_store() -> None:
    stuck = threading.Event()
    model = nn.Sequential(nn.Linear(8, 8))
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, window_s=0.01, max_queue=1,
                                   host_interval_s=None), sink=lambda ws: stuck.wait(30))
    prof.watch(model)
    prof.start()
    x = torch.ones(1, 8)
    worst = 0.0
    try:
        for _ in range(200):
            t0 = time.perf_counter()
            token = prof.begin(model)
            (token.module if token is not None else model)(x)
            prof.end(token, 1, (x,), {}, 1000)
            worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.1)
    finally:
        stuck.set()
        prof.stop(flush=False)
    assert prof.dropped > 0
    assert worst < 0.5  # never blocked on the sink (which waits up to 30 s)


def test_window_rows_are_written_in_bulk_and_read_back(store: Any) -> None:
    import store as st

    with store.session() as s:
        mid = st.repo.upsert_model(s, "bulk").id
        base = {"model_id": mid, "variant_id": None, "window_start": 0.0, "window_end": 1.0}
        layer = {**base, "layer": "fc", "op_type": "Linear", "shape_bucket": "b1", "count": 2,
                 "mean_ms": 1.0, "p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": 2.0, "share": 0.5}
        n = st.repo.add_window_stats(
            s,
            requests=[st.RequestStatRow(**base, shape_bucket="b1", count=4, mean_ms=2.0,
                                        p50_ms=2.0, p95_ms=3.0, p99_ms=3.0, overhead=0.004,
                                        sampled=2)],
            layers=[st.LayerStatRow(**layer, counters={"task_clock_ns": 5.0}),
                    st.LayerStatRow(**{**layer, "layer": "act"})],
            host=[st.HostStatRow(model_id=mid, variant_id=None, at=1.0, cpu_percent=50.0,
                                 rss_bytes=1 << 30, threads=9, ctx_switches=100,
                                 extra={"fds": 3})],
        )
    assert n == 4
    with store.session() as s:
        assert st.repo.request_summary(s, mid)["overhead"] == 0.004
        assert {r["layer"] for r in st.repo.layer_profile(s, mid)} == {"fc", "act"}
        assert st.repo.layer_counters(s, mid) == {"fc": {"task_clock_ns": 5.0}}
        assert st.repo.host_stats(s, mid)[0].extra == {"fds": 3}


def test_the_drop_count_waits_for_a_window_with_request_rows() -> None:
    """The store takes the count on a window's first request row: a batch whose windows have
    none (an idle model: host samples only) must not swallow it."""
    from pgc_daemon.agent.rows import window_rows

    written: list[Window] = []
    fail = threading.Event()
    fail.set()

    def sink(windows: list[Window]) -> None:
        if fail.is_set():
            raise RuntimeError("store is down")
        written.extend(windows)

    prof = Profiler(ProfilerConfig(window_s=60, max_queue=4, export_batch=1, host_interval_s=None),
                    sink=sink)
    prof._exporter.retries = 0  # type: ignore[union-attr]
    prof.start()
    try:
        prof.aggregator.add_call(1, "b1", 1.0)
        prof.flush()  # refused: one window lost
        assert prof.dropped == 1
        fail.clear()
        prof.flush()  # idle: no request rows to carry the count
        assert written and not written[-1].requests
        prof.aggregator.add_call(1, "b1", 1.0)
        prof.flush()
    finally:
        prof.stop(flush=False)
    rows = window_rows(7, written)
    assert sum(r.dropped for r in rows.requests) == prof.dropped == 1


def test_a_call_queue_that_filled_before_it_was_drained_says_so() -> None:
    from profiler._calls import CallQueue

    prof = Profiler(ProfilerConfig(sample_every=1000, budget=None, host_interval_s=None))
    prof.calls = CallQueue(1000, maxlen=10)
    for _ in range(25):
        prof.end(None, 1, (torch.ones(1),), {}, 1000)
    assert prof.status()["call_queue_overflows"] == 1  # the 15 oldest went uncounted
    assert prof.close_window().requests[0].count == 10
    for _ in range(5):
        prof.end(None, 1, (torch.ones(1),), {}, 1000)
    assert prof.status()["call_queue_overflows"] == 1  # not full this time
