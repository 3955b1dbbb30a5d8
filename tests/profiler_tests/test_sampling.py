"""The live profiler: sampling, per-layer attribution, windows, export."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from profiler import LayerTimer, Profiler, ProfilerConfig, Window, WindowAggregator, parse_key, shape_key


class Slow(nn.Module):
    """A leaf whose time we know."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.ms / 1e3)
        return x


class Block(nn.Module):
    """A container with functional work of its own (like attention) and two leaves in a
    ModuleList (which is never called itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([Slow(4), Slow(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)  # the block's own work
        for p in self.parts:
            x = p(x)
        return x


def test_layer_timer_attributes_leaves_and_container_self_time() -> None:
    model = nn.Sequential(Block(), Slow(1))
    timer = LayerTimer(model)
    timer.attach()
    model(torch.ones(1))
    timer.detach()
    got = {name: (op, ms) for name, op, ms, _ in timer.results()}
    assert got["0.parts.0"][1] == pytest.approx(4, abs=2)
    assert got["0.parts.1"][1] == pytest.approx(2, abs=2)
    assert got["1"][1] == pytest.approx(1, abs=2)
    assert got["0"][0] == "Block (self)" and got["0"][1] == pytest.approx(3, abs=2)
    assert sum(ms for _, ms in got.values()) == pytest.approx(10, abs=3)


def test_hooks_are_present_only_while_sampling() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    timer = LayerTimer(model)
    timer.attach()
    assert model[0]._forward_hooks and model[0]._forward_pre_hooks
    timer.detach()
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


def test_other_threads_are_not_timed() -> None:
    model = nn.Sequential(Slow(1))
    timer = LayerTimer(model)
    timer.attach()
    t = threading.Thread(target=model, args=(torch.ones(1),))
    t.start()
    t.join()
    timer.detach()
    assert timer.results() == []


def test_one_call_in_n_is_sampled() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    prof = Profiler(ProfilerConfig(sample_every=10, window_s=60))
    prof.watch(model)
    x = torch.ones(1, 4)
    for _ in range(100):
        token = prof.begin(model)
        model(x)
        prof.end(token, 1, (x,), {}, 1_000_000)
    win = prof.aggregator.close()
    req = win.requests[0]
    assert req["count"] == 100 and req["sampled"] == 10
    layer = next(r for r in win.layers if r["layer"] == "0")
    assert layer["count"] == 10 and layer["op_type"] == "Linear"
    assert req["overhead"] > 0


def test_unwatched_modules_are_never_hooked() -> None:
    model = nn.Linear(2, 2)
    prof = Profiler(ProfilerConfig(sample_every=1, window_s=60))
    token = prof.begin(model)
    assert token is None and not model._forward_hooks


def test_only_one_call_is_profiled_per_layer_at_a_time() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    prof = Profiler(ProfilerConfig(sample_every=1, window_s=60))
    prof.watch(model)
    first = prof.begin(model)
    second = prof.begin(model)
    assert first is not None and second is None
    prof.end(first, 1, (torch.ones(1, 2),), {}, 1000)
    third = prof.begin(model)
    assert third is not None
    prof.end(third, 1, (torch.ones(1, 2),), {}, 1000)


def test_profiler_end_never_raises() -> None:
    prof = Profiler(ProfilerConfig(sample_every=1), key_fn=lambda a, k: 1 / 0)  # type: ignore[arg-type,return-value]
    prof.end(None, 1, (), {}, 1000)  # a broken key function must not fail the request


def test_window_quantiles_match_numpy_and_memory_is_bounded() -> None:
    agg = WindowAggregator()
    values = np.random.default_rng(0).gamma(2.0, 5.0, 5000)
    for v in values:
        agg.add_call(7, "b1", float(v))
    win = agg.close()
    row = win.requests[0]
    assert row["count"] == 5000
    assert row["mean_ms"] == pytest.approx(values.mean())
    for q, key in ((50, "p50_ms"), (95, "p95_ms"), (99, "p99_ms")):
        assert row[key] == pytest.approx(np.percentile(values, q), rel=0.15)
    series = agg._calls  # after close, the next window starts empty
    assert series == {}


def test_windows_are_keyed_by_variant_and_shape_bucket() -> None:
    agg = WindowAggregator()
    agg.add_call(1, "b1 s128", 5.0)
    agg.add_call(1, "b8 s128", 9.0)
    agg.add_call(2, "b1 s128", 3.0, fallback=True)
    win = agg.close()
    keys = {(r["variant"], r["shape_bucket"]) for r in win.requests}
    assert keys == {(1, "b1 s128"), (1, "b8 s128"), (2, "b1 s128")}
    assert next(r for r in win.requests if r["variant"] == 2)["fallbacks"] == 1


@pytest.mark.parametrize(
    "args,kwargs,key",
    [
        ((torch.zeros(1, 100, dtype=torch.long), torch.ones(1, 100)), {}, "b1 s128"),
        ((torch.zeros(8, 20, dtype=torch.long),), {}, "b8 s32"),
        ((torch.zeros(4, 1, 8, 8),), {}, "b4 1x8x8"),
        ((), {"input_ids": torch.zeros(2, 600, dtype=torch.long)}, "b2 s1024"),
        (("text",), {}, "-"),
    ],
)
def test_shape_keys(args: tuple[Any, ...], kwargs: dict[str, Any], key: str) -> None:
    assert shape_key(args, kwargs) == key


def test_parse_key() -> None:
    assert parse_key("b8 s256") == {"batch": 8, "seq": 256}
    assert parse_key("b4 1x8x8") == {"batch": 4, "dims": "1x8x8"}


def test_exporter_writes_windows_in_the_background() -> None:
    got: list[Window] = []
    prof = Profiler(ProfilerConfig(sample_every=1, window_s=0.05), sink=got.append)
    prof.start()
    prof.aggregator.add_call(1, "b1", 2.0)
    time.sleep(0.3)
    prof.stop()
    assert sum(len(w.requests) for w in got) == 1


def test_slow_sink_drops_oldest_windows_and_counts_them() -> None:
    release = threading.Event()
    written: list[Window] = []

    def slow(w: Window) -> None:
        release.wait(5)
        written.append(w)

    prof = Profiler(ProfilerConfig(window_s=0.01, max_queue=2), sink=slow)
    prof.start()
    for _ in range(30):
        prof.aggregator.add_call(1, "b1", 1.0)
        time.sleep(0.01)
    assert prof.dropped > 0
    release.set()
    prof.stop(flush=False)
    assert len(written) >= 1


def test_failing_sink_is_counted_and_the_exporter_keeps_going() -> None:
    calls = []

    def broken(w: Window) -> None:
        calls.append(w)
        raise RuntimeError("store is down")

    prof = Profiler(ProfilerConfig(window_s=0.02), sink=broken)
    prof.start()
    for _ in range(5):
        prof.aggregator.add_call(1, "b1", 1.0)
        time.sleep(0.03)
    prof.stop(flush=False)
    assert len(calls) >= 2
    assert prof.export_failures == len(calls)
