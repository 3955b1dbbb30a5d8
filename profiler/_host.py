"""Process statistics of the serving process (psutil) and the RSS trend per variant.

A :class:`HostSampler` takes one sample when the profiler's background thread asks (every
``host_interval_s``, spaced out when serving is light: ``profiler._budget.Pacer``): CPU percent since the last sample, RSS, threads, context switches (voluntary and
involuntary), open files. Each sample is kept for the store and fed to a
:class:`LeakDetector`, which keeps the RSS of the last ``window_s`` seconds per variant and
warns when it grew *steadily* across the whole window: a least-squares slope that explains
most of the variance (R² ≥ 0.8), most steps up, and a total growth past a floor. A warm-up
step, a cache filling once or a one-off spike is not steady; a leak is.

Samples taken while pgc itself builds or verifies a candidate in this process (``quiet`` is
false) restart the trend: that memory is pgc's, not a leak of the variant serving.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from profiler._rows import HostRow

MIB = 1024 * 1024


@dataclass(frozen=True)
class LeakWarning:
    variant: Any
    growth_bytes: float
    slope_bytes_per_s: float
    span_s: float
    samples: int
    r2: float
    first_rss: int
    last_rss: int

    def message(self) -> str:
        return (
            f"RSS grew steadily by {self.growth_bytes / MIB:.1f} MiB over {self.span_s:.0f} s "
            f"({self.slope_bytes_per_s * 60 / MIB:.2f} MiB/min, R² {self.r2:.2f}, "
            f"{self.samples} samples) while variant {self.variant} served: a possible leak"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "growth_bytes": self.growth_bytes,
            "slope_bytes_per_s": self.slope_bytes_per_s,
            "span_s": self.span_s,
            "samples": self.samples,
            "r2": self.r2,
            "first_rss": self.first_rss,
            "last_rss": self.last_rss,
        }


def _fit(points: list[tuple[float, int]]) -> tuple[float, float]:
    """Least-squares slope (bytes/s) and R² of RSS over time."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    stt = sum((t - mt) ** 2 for t, _ in points)
    srr = sum((r - mr) ** 2 for _, r in points)
    if stt <= 0:
        return 0.0, 0.0
    str_ = sum((t - mt) * (r - mr) for t, r in points)
    slope = str_ / stt
    r2 = (str_ * str_) / (stt * srr) if srr > 0 else 0.0
    return slope, r2


class LeakDetector:
    """Steady RSS growth per variant over a trailing window.

    ``window_s``: how long the growth must last; ``min_growth_bytes``: how much it must add
    up to; ``min_samples``: samples needed inside the window; ``steadiness``: fraction of
    steps that must not go down. After a warning the variant's trend restarts, so a leak
    warns once per window, not on every sample.
    """

    def __init__(
        self,
        window_s: float = 600.0,
        min_growth_bytes: float = 64 * MIB,
        *,
        min_samples: int = 8,
        steadiness: float = 0.8,
        min_r2: float = 0.8,
    ) -> None:
        if window_s <= 0 or min_growth_bytes <= 0 or min_samples < 3:
            raise ValueError("window_s and min_growth_bytes must be > 0, min_samples >= 3")
        if not 0 < steadiness <= 1 or not 0 < min_r2 <= 1:
            raise ValueError("steadiness and min_r2 must be in (0, 1]")
        self.window_s = window_s
        self.min_growth_bytes = min_growth_bytes
        self.min_samples = min_samples
        self.steadiness = steadiness
        self.min_r2 = min_r2
        self._series: dict[Any, collections.deque[tuple[float, int]]] = {}
        self._current: Any = object()

    def trend(self, variant: Any) -> float | None:
        """The variant's RSS slope in bytes per second over its series (None: too few)."""
        points = list(self._series.get(variant, ()))
        if len(points) < 3:
            return None
        return _fit(points)[0]

    def reset(self, variant: Any | None = None) -> None:
        if variant is None:
            self._series.clear()
        else:
            self._series.pop(variant, None)

    def add(self, variant: Any, at: float, rss: int, *, quiet: bool = True) -> LeakWarning | None:
        """One sample; returns a warning when the window shows a steady growth."""
        if variant != self._current:
            # a swap: the new variant's trend starts now (the old one's module may be freed)
            self._series.pop(variant, None)
            self._current = variant
        if not quiet:
            self._series.pop(variant, None)
            return None
        series = self._series.setdefault(variant, collections.deque())
        series.append((at, rss))
        horizon = at - self.window_s
        # keep one point at or before the window's start, so the span can cover the window
        while len(series) > 1 and series[1][0] <= horizon:
            series.popleft()
        span = series[-1][0] - series[0][0]
        if len(series) < self.min_samples or span < 0.95 * self.window_s:
            return None
        points = list(series)
        slope, r2 = _fit(points)
        growth = slope * span
        ups = sum(1 for (_, a), (_, b) in zip(points, points[1:]) if b >= a)
        steady = ups / (len(points) - 1)
        if growth < self.min_growth_bytes or r2 < self.min_r2 or steady < self.steadiness:
            return None
        self._series.pop(variant, None)
        return LeakWarning(
            variant=variant,
            growth_bytes=growth,
            slope_bytes_per_s=slope,
            span_s=span,
            samples=len(points),
            r2=r2,
            first_rss=points[0][1],
            last_rss=points[-1][1],
        )


class HostSampler:
    """psutil statistics of this process, one row per sample, ready for ``pgc_host_stats``."""

    def __init__(self, leak: LeakDetector | None = None) -> None:
        import psutil  # noqa: PLC0415 - only processes that sample host stats need it

        self.leak = leak
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only starts the measurement
        self.samples = 0
        self.last: HostRow | None = None

    def sample(self, variant: Any, *, quiet: bool = True) -> tuple[HostRow, LeakWarning | None]:
        """Take one sample now. Returns the row and a leak warning (or None)."""
        p = self._proc
        with p.oneshot():
            cpu = p.cpu_percent(None)
            mem = p.memory_info()
            threads = p.num_threads()
            ctx = p.num_ctx_switches()
            try:
                fds: int | None = p.num_fds()
            except (AttributeError, OSError):
                fds = None
        at = time.time()
        warning = None
        if self.leak is not None:
            warning = self.leak.add(variant, at, int(mem.rss), quiet=quiet)
        extra: dict[str, Any] = {
            "vms_bytes": int(mem.vms),
            "ctx_voluntary": int(ctx.voluntary),
            "ctx_involuntary": int(ctx.involuntary),
            "quiet": quiet,
        }
        if fds is not None:
            extra["fds"] = fds
        if self.leak is not None:
            slope = self.leak.trend(variant)
            if slope is not None:
                extra["rss_slope_bytes_per_s"] = slope
        row = HostRow(
            variant=variant,
            at=at,
            cpu_percent=float(cpu),
            rss_bytes=int(mem.rss),
            threads=int(threads),
            ctx_switches=int(ctx.voluntary + ctx.involuntary),
            extra=extra,
        )
        self.samples += 1
        self.last = row
        return row, warning
