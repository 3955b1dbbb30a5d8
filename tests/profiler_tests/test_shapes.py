"""Traffic shape: the shape-bucket key of a call, and per-layer statistics kept per bucket."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from profiler import Profiler, ProfilerConfig, WindowAggregator, parse_key, seq_bucket, shape_key
from profiler._window import MAX_BUCKETS, OTHER_BUCKET


CASES = [
    ((torch.zeros(1, 100, dtype=torch.long), torch.ones(1, 100)), {}, "b1 s128"),
    ((torch.zeros(8, 20, dtype=torch.long),), {}, "b8 s32"),
    ((torch.zeros(4, 1, 8, 8),), {}, "b4 1x8x8"),
    ((), {"input_ids": torch.zeros(2, 600, dtype=torch.long)}, "b2 s1024"),
    ((torch.zeros(3, 50, 80),), {}, "b3 s64 f80"),  # float sequences: frames x features
    (({"input_ids": torch.zeros(2, 17, dtype=torch.long)},), {}, "b2 s32"),  # a batch dict
    (([torch.zeros(5, 9, dtype=torch.long)],), {}, "b5 s16"),  # a list of tensors
    ((torch.zeros(7),), {}, "b7"),
    ((torch.tensor(1.0),), {}, "-"),
    (("text",), {}, "-"),
    ((torch.zeros(1, 5000, dtype=torch.long),), {}, "b1 s5000"),  # past the largest bucket
    ((torch.zeros(2, 3, 4, dtype=torch.complex64),), {}, "b2 3x4"),
    ((torch.zeros(6, 40, dtype=torch.bool),), {}, "b6 s64"),
]


@pytest.mark.parametrize("args,kwargs,key", CASES)
def test_shape_keys(args: tuple[Any, ...], kwargs: dict[str, Any], key: str) -> None:
    assert shape_key(args, kwargs) == key
    assert shape_key(args, kwargs) == key  # and the cached answer is the same


def test_the_profiler_keys_served_calls_as_shape_key_does() -> None:
    """``end`` queues a plain tensor first argument's (shape, dtype) and keys it when the
    calls are drained, off the request path: the window's buckets are shape_key's."""
    prof = Profiler(ProfilerConfig(sample_every=1 << 30, max_sample_every=1 << 30))
    for i, (args, kwargs, _) in enumerate(CASES):
        prof.end(None, i, args, kwargs, 1_000_000)
    window = prof.close_window()
    assert {(r.variant, r.shape_bucket) for r in window.requests} == {
        (i, key) for i, (_, _, key) in enumerate(CASES)}


@pytest.mark.parametrize("length,bucket", [(1, 16), (16, 16), (17, 32), (512, 512), (513, 1024),
                                           (2048, 2048), (2049, 2049)])
def test_seq_buckets(length: int, bucket: int) -> None:
    assert seq_bucket(length) == bucket


def test_parse_key() -> None:
    assert parse_key("b8 s256") == {"batch": 8, "seq": 256}
    assert parse_key("b4 1x8x8") == {"batch": 4, "dims": "1x8x8"}
    assert parse_key("b3 s64 f80") == {"batch": 3, "seq": 64, "features": 80}
    assert parse_key("-") == {}


def test_variable_lengths_make_a_handful_of_keys() -> None:
    keys = {shape_key((torch.zeros(1, n, dtype=torch.long),), {}) for n in range(1, 300)}
    assert keys == {"b1 s16", "b1 s32", "b1 s64", "b1 s128", "b1 s256", "b1 s512"}


def test_unbounded_shapes_cannot_grow_a_window() -> None:
    agg = WindowAggregator()
    for i in range(MAX_BUCKETS + 50):
        agg.add_call(1, f"b1 {i}x3", 1.0)
    win = agg.close()
    buckets = {r.shape_bucket for r in win.requests}
    assert len(buckets) == MAX_BUCKETS + 1 and OTHER_BUCKET in buckets
    assert next(r for r in win.requests if r.shape_bucket == OTHER_BUCKET).count == 50


class SeqModel(nn.Module):
    """An embedding and a projection: time grows with the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        # wide enough that the long bucket's projection (2000 x 512 x 512) takes milliseconds
        # while the short one's takes microseconds: the comparison below is not the hooks' noise
        self.embed = nn.Embedding(100, 512)
        self.proj = nn.Linear(512, 512)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids)).sum(1)


def _profile_buckets(model: nn.Module, prof: Profiler, traffic: list[torch.Tensor]) -> Any:
    with torch.inference_mode():
        for ids in traffic[::-1][:4]:  # warm (first calls of a shape allocate), not profiled
            model(ids)
        for ids in traffic:
            token = prof.begin(model)
            t0 = time.perf_counter_ns()
            (token.module if token is not None else model)(ids)
            prof.end(token, 3, (ids,), {}, time.perf_counter_ns() - t0)
    return prof.close_window()


def test_layer_statistics_are_kept_per_shape_bucket() -> None:
    model = SeqModel().eval()
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None))
    prof.watch(model)
    traffic = [torch.zeros(1, 10, dtype=torch.long)] * 6 + [torch.zeros(4, 500, dtype=torch.long)] * 3
    # one intra-op thread: with two on a CI box that runs two test workers, a 10-row matmul
    # waits for a descheduled OpenMP thread (7.7 ms seen, slower than the 2000-row one)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        win = _profile_buckets(model, prof, traffic)
    finally:
        torch.set_num_threads(threads)
    requests = {r.shape_bucket: r.count for r in win.requests}
    assert requests == {"b1 s16": 6, "b4 s512": 3}
    proj = {r.shape_bucket: r for r in win.layers if r.layer == "proj"}
    assert set(proj) == {"b1 s16", "b4 s512"}
    assert proj["b1 s16"].count == 6 and proj["b4 s512"].count == 3
    assert proj["b4 s512"].p50_ms > proj["b1 s16"].p50_ms  # the long bucket is slower
    # shares are within each bucket: every bucket's layers add up to (about) its calls, not
    # to a fraction of all traffic (tens of microseconds per call: bookkeeping shows)
    for bucket in requests:
        total = sum(r.share for r in win.layers if r.shape_bucket == bucket)
        assert total == pytest.approx(1.0, abs=0.3)
