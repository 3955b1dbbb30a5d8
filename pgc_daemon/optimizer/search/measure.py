"""Latency that holds on a noisy, shared machine: candidate and baseline measured
interleaved in one process, in short blocks in random order, repeated until the confidence
interval of their ratio is tight or a cap is reached.

Drift (another process waking up, thermal changes) hits both arms alike, so the *ratio* is
stable even when absolute milliseconds are not; that is what pgc compares and reports.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compiler import Example

# two-sided 95% Student t quantiles by degrees of freedom (normal beyond 30)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


def t95(df: int) -> float:
    if df <= 0:
        return math.inf
    if df > 30:
        return 1.96
    key = max(k for k in _T95 if k <= df)
    return _T95[key]


@dataclass(frozen=True)
class Timing:
    ratio: float
    """candidate / baseline latency at the requested percentile (below 1: faster)."""
    ratio_low: float
    ratio_high: float
    rounds: int
    baseline_ms: dict[str, float]
    candidate_ms: dict[str, float]
    clock: str = "wall"
    """What the milliseconds are: ``wall`` time or the calling ``thread``'s CPU time."""
    calls: int = 0
    """How many times the candidate was called (warm-up included)."""

    @property
    def speedup(self) -> float:
        return 1.0 / self.ratio if self.ratio > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio,
            "ratio_ci": [self.ratio_low, self.ratio_high],
            "rounds": self.rounds,
            "speedup": self.speedup,
            "baseline_ms": self.baseline_ms,
            "candidate_ms": self.candidate_ms,
            "clock": self.clock,
            "calls": self.calls,
        }


def _pcts(samples: Sequence[float]) -> dict[str, float]:
    a = np.asarray(samples)
    p50, p95, p99 = np.percentile(a, (50, 95, 99))
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(a.mean())}


#: What a call's time is read from: ``wall`` (``perf_counter``), or ``thread``: the CPU time
#: of the calling thread, for arms that run wholly on it (one intra-op thread). A thread's CPU
#: clock does not run while another process holds its core, so a preempted call costs what it
#: would alone; on wall time a preemption lands more often in a long call than a short one
#: (fp32 rather than int8), and a block's median then flatters the short arm.
CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def _call(fn: Callable[..., Any], example: Example, clock: Callable[[], int] = time.perf_counter_ns) -> float:
    args, kwargs = example
    t0 = clock()
    fn(*args, **kwargs)
    return (clock() - t0) / 1e6


def _decided(mean_log: float, half: float, thresholds: Sequence[float]) -> bool:
    """Whether the interval ``exp(mean_log ± half)`` lies wholly above or below each ratio,
    and above at least one: a candidate that beats every threshold becomes the best, and its
    figure is what a deployment then promises, so it is not settled by being ahead."""
    low, high = mean_log - half, mean_log + half
    ts = [math.log(t) for t in thresholds if t > 0]
    return all(high < t or low > t for t in ts) and any(low > t for t in ts)


def interleaved(
    baseline: Callable[..., Any],
    candidate: Callable[..., Any],
    inputs: Sequence[Example],
    *,
    percentile: str = "p50",
    block: int = 3,
    min_rounds: int = 6,
    max_rounds: int = 40,
    rel_halfwidth: float = 0.03,
    max_seconds: float = 30.0,
    warmup: int = 2,
    seed: int = 0,
    decide_at: Sequence[float] = (),
    min_decided_rounds: int = 3,
    gap_s: float = 0.0,
    clock: str = "wall",
) -> Timing:
    """Measure ``candidate`` against ``baseline`` on the same inputs, interleaved.

    Each round runs one block of each arm (order shuffled) over rotating inputs; the round's
    ratio is the ratio of block medians. Stops once the 95% interval of the mean log-ratio is
    within ``rel_halfwidth`` (after ``min_rounds``), or at ``max_rounds`` / ``max_seconds``.
    For p95/p99 the ratio is of the arms' percentiles over all calls.

    ``decide_at``: the ratios a decision hangs on (what the candidate must beat: fp32 by the
    policy's margin, the best variant so far). A sequential test: once the interval lies
    wholly on one side of every one of them and above one (after ``min_decided_rounds``),
    the candidate loses whatever more rounds say, and timing stops. A close call, and a
    candidate ahead of them all (the new best, whose figure a deployment promises: stopped
    at three rounds, the best of a search's early-stopped figures came out 10-20% above what
    it then did live), are timed to full precision.

    ``gap_s``: idle time after each call, as between live requests (caches and thread pools
    go cold in it). ``clock``: one of :data:`CLOCKS`.
    """
    if not inputs:
        raise ValueError("no inputs to time")
    read = CLOCKS[clock]
    rng = random.Random(seed)
    arms = {"base": baseline, "cand": candidate}
    samples: dict[str, list[float]] = {"base": [], "cand": []}
    log_ratios: list[float] = []
    i = 0
    started = time.monotonic()
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in arms.values():
                _call(fn, inputs[0], read)
        rounds = 0
        while rounds < max_rounds:
            order = ["base", "cand"]
            rng.shuffle(order)
            block_ms: dict[str, list[float]] = {}
            for arm in order:
                times = []
                for b in range(block):
                    times.append(_call(arms[arm], inputs[(i + b) % len(inputs)], read))
                    if gap_s > 0:
                        time.sleep(gap_s)
                block_ms[arm] = times
                samples[arm].extend(times)
            i += block
            rounds += 1
            log_ratios.append(
                math.log(statistics.median(block_ms["cand"]) / statistics.median(block_ms["base"]))
            )
            if rounds >= max(2, min(min_rounds, min_decided_rounds if decide_at else min_rounds)):
                mean = statistics.fmean(log_ratios)
                half = t95(rounds - 1) * statistics.stdev(log_ratios) / math.sqrt(rounds)
                if rounds >= min_rounds and half <= math.log1p(rel_halfwidth):
                    break
                if decide_at and _decided(mean, half, decide_at):
                    break
            if time.monotonic() - started > max_seconds and rounds >= 2:
                break
    mean = statistics.fmean(log_ratios)
    half = (
        t95(len(log_ratios) - 1) * statistics.stdev(log_ratios) / math.sqrt(len(log_ratios))
        if len(log_ratios) > 1
        else math.inf
    )
    base, cand = _pcts(samples["base"]), _pcts(samples["cand"])
    if percentile == "p50":
        ratio = math.exp(mean)
        low, high = math.exp(mean - half), math.exp(mean + half)
    else:
        ratio = cand[percentile] / base[percentile]
        low, high = ratio * math.exp(-half), ratio * math.exp(half)
    return Timing(ratio, low, high, len(log_ratios), base, cand, clock,
                  warmup + len(samples["cand"]))
