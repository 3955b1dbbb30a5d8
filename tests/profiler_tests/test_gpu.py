"""The GPU path: off (with the reason) on a machine without one, attribution logic tested on
CPU with recorded values, and the real thing under ``@pytest.mark.gpu``."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from profiler import (
    LayerTimer,
    Profiler,
    ProfilerConfig,
    WindowAggregator,
    availability,
    cuda_status,
    cupti_status,
)
from profiler._cupti import Kernel
from profiler._gpu import EXT_MASK, EXT_SHIFT, module_device
from profiler._hooks import RawCall

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@no_cuda
def test_the_gpu_path_is_off_and_says_why() -> None:
    ok, why = cuda_status()
    assert not ok and ("CPU-only build" in why or "no CUDA device" in why)
    ok, why = cupti_status()
    assert not ok and why
    av = availability()
    assert av["cuda_events"] == {"available": False, "detail": cuda_status()[1]}
    assert av["cupti"]["available"] is False


@no_cuda
def test_a_cpu_model_is_timed_on_the_host_and_imports_no_gpu_code() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None))
    prof.watch(model)
    timer = prof._timers[id(model)]
    assert timer.gpu is None and prof._tracer is None
    assert module_device(model) == "cpu"
    status = prof.status()
    assert status["gpu"] == "no CUDA module watched" and status["cupti"] == "not in use"


def test_gpu_times_make_container_self_times_and_keep_host_time_as_a_counter() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    timer = LayerTimer(model)
    idx = {name: i for i, name in enumerate(timer.names)}
    raw = RawCall(seq=1, incl={idx["(root)"]: 9_000_000, idx["0"]: 6_000_000,
                               idx["0.0"]: 4_000_000, idx["0.1"]: 1_000_000, idx["1"]: 2_000_000})
    gpu_ms = {idx["(root)"]: 10.0, idx["0"]: 7.0, idx["0.0"]: 5.0, idx["0.1"]: 1.5, idx["1"]: 2.5}
    kernels = {idx["0.0"]: [("ampere_sgemm_32x32", 4_800_000, (4, 1, 1), (128, 1, 1))]}
    rows = {r[0]: r for r in timer.results(raw, gpu_ms, kernels)}
    assert rows["0.0"][2] == 5.0 and rows["0.0"][4] == kernels[idx["0.0"]]
    assert rows["0"][1] == "Sequential (self)" and rows["0"][2] == pytest.approx(0.5)
    assert rows["(root)"][2] == pytest.approx(0.5)
    assert rows["0.0"][3]["cpu_ms"] == pytest.approx(4.0)  # host-side launch time
    assert rows["0"][3]["cpu_ms"] == pytest.approx(1.0)


class _RecordedTracer:
    """Stands in for CUPTI (which cannot run without a GPU): returns recorded kernel records
    by external correlation id, as :meth:`CuptiTracer.collect` does."""

    is_open = False

    def __init__(self, by_ext: dict[int, list[Kernel]]) -> None:
        self.by_ext = by_ext

    def collect(self) -> dict[int, list[Kernel]]:
        out, self.by_ext = self.by_ext, {}
        return out


def test_kernels_are_attributed_to_the_layer_and_call_that_launched_them() -> None:
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None))
    gemm = Kernel("sm90_xmma_gemm", 100, 2_100, (8, 4, 1), (256, 1, 1), correlation=11, stream=7)
    relu = Kernel("vectorized_elementwise", 3_000, 3_500, (16, 1, 1), (128, 1, 1), 12, 7)
    seq = 5
    prof._tracer = _RecordedTracer({
        (seq << EXT_SHIFT) | (3 + 1): [gemm],   # layer index 3 of call 5
        (seq << EXT_SHIFT) | (4 + 1): [relu],
    })
    prof._collect_kernels()
    assert prof._kernels == {seq: {3: [("sm90_xmma_gemm", 2_000, (8, 4, 1), (256, 1, 1))],
                                   4: [("vectorized_elementwise", 500, (16, 1, 1), (128, 1, 1))]}}
    assert ((seq << EXT_SHIFT) | 4) & EXT_MASK == 4


def _record(kind: Any, **fields: Any) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(kind=kind, **fields)


def test_cupti_records_are_joined_to_kernels_by_correlation_id_across_flushes() -> None:
    """The tracer's own parsing, with records shaped like cupti-python's (the fields an H200
    delivered): API records are counted and dropped, a correlation record may come a flush
    before its kernel, and a kernel nobody pushed an id for is left out."""
    cupti = pytest.importorskip("cupti.cupti")
    from profiler._cupti import CuptiTracer

    kind = cupti.ActivityKind
    tracer = CuptiTracer()

    def kernel(name: str, corr: int) -> Any:
        return _record(kind.CONCURRENT_KERNEL, name=name, start=1_000, end=3_000, grid_x=8,
                       grid_y=1, grid_z=1, block_x=128, block_y=1, block_z=1,
                       correlation_id=corr, stream_id=7)

    ext = (5 << EXT_SHIFT) | 4
    tracer._completed([
        _record(kind.RUNTIME, correlation_id=41),
        _record(kind.EXTERNAL_CORRELATION, correlation_id=41, external_id=ext, external_kind=3),
        _record(kind.EXTERNAL_CORRELATION, correlation_id=42, external_id=ext + 1, external_kind=3),
        kernel("gemm", 41),
        kernel("other_thread", 99),
    ])
    first = tracer._take()
    assert list(first) == [ext] and first[ext][0].name == "gemm"
    assert first[ext][0].duration_ns == 2_000 and first[ext][0].grid == (8, 1, 1)
    tracer._completed([kernel("relu", 42)])  # its correlation record came in the last flush
    assert {e: [k.name for k in ks] for e, ks in tracer._take().items()} == {ext + 1: ["relu"]}
    assert tracer.delivered == {int(kind.RUNTIME): 1, int(kind.EXTERNAL_CORRELATION): 2,
                                int(kind.CONCURRENT_KERNEL): 3}
    assert tracer.error is None
    tracer._completed([_record(kind.CONCURRENT_KERNEL, name="broken")])  # fields missing
    assert tracer.error is not None and "AttributeError" in tracer.error


def test_cupti_records_only_kernel_launch_apis() -> None:
    """The API records the tracer needs for correlation are kept to kernel launches (the
    tables are cupti-python's own; only the switch calls are recorded here)."""
    cupti = pytest.importorskip("cupti.cupti")
    from types import SimpleNamespace

    from profiler._cupti import CuptiTracer

    switched: dict[str, dict[str, int]] = {"runtime": {}, "driver": {}}
    runtime = getattr(cupti, "RuntimeApiTraceCbid", None) or cupti.runtime_api_trace_cbid
    driver = getattr(cupti, "DriverApiTraceCbid", None) or cupti.driver_api_trace_cbid
    names = {"runtime": {int(v): k for k, v in runtime.__members__.items()},
             "driver": {int(v): k for k, v in driver.__members__.items()}}
    tracer = CuptiTracer()
    tracer._c = SimpleNamespace(
        RuntimeApiTraceCbid=runtime, DriverApiTraceCbid=driver,
        activity_enable_runtime_api=lambda cbid, on: switched["runtime"].__setitem__(names["runtime"][cbid], on),
        activity_enable_driver_api=lambda cbid, on: switched["driver"].__setitem__(names["driver"][cbid], on),
    )
    assert tracer._launches_only().startswith("kernel launches only")
    rt, drv = switched["runtime"], switched["driver"]
    assert rt["cudaLaunchKernel_v7000"] == 1 and drv["cuLaunchKernel"] == 1
    assert rt["cudaEventRecord_v3020"] == 0 and drv["cuCtxGetDevice"] == 0
    assert drv["cuLaunchHostFunc"] == 0  # a host function launches no kernel
    assert sum(rt.values()) + sum(drv.values()) < 40 < len(rt) + len(drv)
    # CUPTI forgets the switches when the API kinds are disabled: they are set at every open
    rt.clear()
    tracer._launches_only()
    assert rt["cudaLaunchKernel_v7000"] == 1 and rt["cudaEventRecord_v3020"] == 0


def test_window_rows_carry_the_longest_kernels_of_each_layer() -> None:
    agg = WindowAggregator()
    k1 = ("gemm_a", 3_000_000, (8, 1, 1), (128, 1, 1))
    k2 = ("gemm_b", 1_000_000, (2, 1, 1), (64, 1, 1))
    for _ in range(2):
        agg.add_sampled_call(1, "b1", 5.0, [("fc", "Linear", 4.0, None, [k1, k2])], 1000)
    row = agg.close().layers[0]
    assert row.kernels is not None
    assert row.kernels[0] == {"name": "gemm_a", "grid": [8, 1, 1], "block": [128, 1, 1],
                              "count": 2, "total_ms": 6.0}
    assert [k["name"] for k in row.kernels] == ["gemm_a", "gemm_b"]
    # what the store keeps of them: summable numbers beside the layer's other counters
    assert row.counters == {"cupti_kernels": 4.0, "cupti_kernel_ms": 8.0}


def _cuda_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048)).cuda().eval()


@pytest.mark.gpu
def test_cuda_events_time_layers_without_syncing_the_request_path() -> None:
    model = _cuda_model()
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, cupti=False))
    prof.watch(model)
    x = torch.randn(4096, 2048, device="cuda")
    with torch.inference_mode():
        model(x)
        torch.cuda.synchronize()
        token = prof.begin(model)
        t0 = time.perf_counter_ns()
        for _ in range(20):  # a long queue of GPU work
            (token.module if token is not None else model)(x)
        prof.end(token, 1, (x,), {}, time.perf_counter_ns() - t0)
    pending = prof._pending[0].raw.gpu
    assert pending is not None and not pending.end.query()  # end() did not wait for the GPU
    win = prof.close_window()
    rows = {r.layer: r for r in win.layers}
    assert rows["0"].mean_ms > 0 and "cpu_ms" in rows["0"].counters
    assert rows["0"].mean_ms > rows["1"].mean_ms  # a GEMM outweighs a ReLU
    prof.stop()


@pytest.mark.gpu
def test_cupti_kernels_are_attributed_to_their_layers() -> None:
    if not cupti_status()[0]:
        pytest.skip(cupti_status()[1])
    model = _cuda_model()
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None))
    prof.watch(model)
    x = torch.randn(1024, 2048, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            token = prof.begin(model)
            t0 = time.perf_counter_ns()
            (token.module if token is not None else model)(x)
            prof.end(token, 1, (x,), {}, time.perf_counter_ns() - t0)
    win = prof.close_window()
    assert not prof._tracer.is_open  # recording stopped once the sampled calls were done
    rows: dict[str, Any] = {r.layer: r for r in win.layers}
    kernels = rows["0"].kernels
    assert kernels, f"no kernels attributed: {prof.status()}"
    k = kernels[0]
    assert k["count"] == 3 and k["total_ms"] > 0 and all(d >= 1 for d in k["grid"])
    event_ms = rows["0"].mean_ms * rows["0"].count
    assert sum(k["total_ms"] for k in kernels) <= event_ms * 1.1
    prof.stop()
    assert prof._tracer.error is None
