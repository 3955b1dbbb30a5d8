"""pgc's live profiler: end-to-end latency of every call, per-layer latency (and perf counters,
CUDA events, CUPTI kernels) of sampled calls under a self-measured overhead budget, process
statistics with leak warnings, aggregated per time window and exported in the background.

A closed :class:`Window` holds typed rows (:class:`RequestRow`, :class:`LayerRow`,
:class:`SampledRow`, :class:`HostRow`, :class:`ProfilerEvent`). The profiler never raises into a
served call; it raises only ``ValueError`` for bad arguments, so it has no error root of its
own."""

from __future__ import annotations

from typing import Any

from profiler._budget import Pacer, Period, RateController
from profiler._calls import KEY, SAMPLE, CallQueue
from profiler._compiled import KernelTimer, NodeKernels
from profiler._compiled import event_cost_ns as kernel_trace_cost
from profiler._config import ProfilerConfig
from profiler._counters import (
    CounterAvailability,
    PerfCounters,
    counter_availability,
    derived,
)
from profiler._exporter import Exporter
from profiler._gpu import cuda_status
from profiler._hooks import LayerTimer, dispatch_cost_ns, foreign_cost_ns
from profiler._host import HostSampler, LeakDetector, LeakWarning
from profiler._offline import OfflineProfile, group_name, layout_conversions, profile_model
from profiler._profiler import Profiler
from profiler._rows import HostRow, LayerRow, ProfilerEvent, RequestRow, SampledRow
from profiler._trace import TraceBusy, exclusive_trace
from profiler._window import LATENCY_BUCKETS_MS, Totals, Window, WindowAggregator
from profiler.shapes import parse_key, seq_bucket, shape_key


def cupti_status() -> tuple[bool, str]:
    """(usable, why) for the CUPTI kernel tracer (imports cupti-python lazily)."""
    from profiler._cupti import cupti_status as status  # noqa: PLC0415

    return status()


def availability() -> dict[str, Any]:
    """What the profiler can use in this process and why anything is off (``pgc doctor``)."""
    counters = counter_availability()
    cuda_ok, cuda_why = cuda_status()
    cupti_ok, cupti_why = cupti_status()
    try:
        import psutil  # noqa: PLC0415

        host: dict[str, Any] = {"available": True, "detail": f"psutil {psutil.__version__}"}
    except ImportError as exc:
        host = {"available": False, "detail": f"psutil is not importable: {exc}"}
    return {
        "perf_counters": counters.to_dict() | {"summary": counters.summary()},
        "cuda_events": {"available": cuda_ok, "detail": cuda_why},
        "cupti": {"available": cupti_ok, "detail": cupti_why},
        "host_stats": host,
        "hook_dispatch_ns": dispatch_cost_ns(),
    }


__all__ = [
    "KEY",
    "LATENCY_BUCKETS_MS",
    "SAMPLE",
    "CallQueue",
    "KernelTimer",
    "NodeKernels",
    "CounterAvailability",
    "Exporter",
    "HostRow",
    "HostSampler",
    "LayerRow",
    "LayerTimer",
    "LeakDetector",
    "LeakWarning",
    "OfflineProfile",
    "PerfCounters",
    "Pacer",
    "Period",
    "Profiler",
    "ProfilerConfig",
    "ProfilerEvent",
    "RateController",
    "RequestRow",
    "SampledRow",
    "TraceBusy",
    "Totals",
    "Window",
    "WindowAggregator",
    "availability",
    "counter_availability",
    "cuda_status",
    "cupti_status",
    "derived",
    "dispatch_cost_ns",
    "exclusive_trace",
    "foreign_cost_ns",
    "group_name",
    "kernel_trace_cost",
    "layout_conversions",
    "parse_key",
    "profile_model",
    "seq_bucket",
    "shape_key",
]
