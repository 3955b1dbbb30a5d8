"""pgc's live profiler: end-to-end latency of every call, per-layer latency of sampled calls,
aggregated per time window and exported in the background."""

from profiler._errors import ProfilerError
from profiler._exporter import Exporter
from profiler._hooks import LayerTimer
from profiler._profiler import Profiler, ProfilerConfig
from profiler._window import LATENCY_BUCKETS_MS, Window, WindowAggregator
from profiler.shapes import parse_key, seq_bucket, shape_key

__all__ = [
    "LATENCY_BUCKETS_MS",
    "Exporter",
    "LayerTimer",
    "Profiler",
    "ProfilerConfig",
    "ProfilerError",
    "Window",
    "WindowAggregator",
    "parse_key",
    "seq_bucket",
    "shape_key",
]
