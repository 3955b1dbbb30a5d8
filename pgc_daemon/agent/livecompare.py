"""Is a canary slower than the module it would replace, on the same live traffic?

Live latency on a busy server is often bimodal: a call that overlaps another one gets half the
cores and takes twice as long. With the few dozen calls a canary sees per arm, the *median*
then lands on either mode by chance, and comparing medians flips a 1.0x ratio to 2x now and
then (measured on MiniLM with two clients: canaries of identical speed rolled back). The
comparison here uses trimmed means (the middle 80%: a garbage-collection pause does not
decide) and a bootstrap confidence interval of their ratio, and only calls a candidate slower
when it is slower beyond the tolerance with confidence; when the interval straddles the
tolerance the canary should run longer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TRIM = 0.1
RESAMPLES = 400


@dataclass(frozen=True)
class LiveComparison:
    ratio: float
    """Candidate / control, trimmed means of live latency (below 1: the candidate is faster)."""
    low: float
    high: float
    """95% bootstrap interval of ``ratio``."""
    candidate_ms: float
    control_ms: float
    calls: tuple[int, int]

    @property
    def speedup(self) -> float:
        return 1.0 / self.ratio if self.ratio > 0 else 0.0

    def slower(self, tolerance: float) -> bool:
        """Slower than the tolerance allows, with confidence."""
        return self.low > 1.0 + tolerance

    def certain(self, tolerance: float) -> bool:
        """The interval is on one side of the tolerance: more calls would not change the call."""
        return self.low > 1.0 + tolerance or self.high <= 1.0 + tolerance

    def too_slow(self, tolerance: float) -> bool:
        """The verdict once the canary is over: slower with confidence, or, when the interval
        still straddles the tolerance, slower by the point estimate."""
        if self.certain(tolerance):
            return self.slower(tolerance)
        return self.ratio > 1.0 + tolerance


def trimmed_mean(xs: np.ndarray, trim: float = TRIM) -> np.ndarray | float:
    """Mean of the middle of ``xs`` along its last axis (one value, or one per row)."""
    xs = np.sort(xs, axis=-1)
    n = xs.shape[-1]
    k = int(n * trim)
    kept = xs[..., k : n - k] if n > 2 * k else xs
    means = kept.mean(axis=-1)
    return float(means) if np.ndim(means) == 0 else means


def compare(candidate: Sequence[float], control: Sequence[float], seed: int = 0) -> LiveComparison:
    """Compare live latencies (ms) of the candidate and the control; both need calls."""
    a = np.asarray(candidate, dtype=float)
    b = np.asarray(control, dtype=float)
    if len(a) == 0 or len(b) == 0:
        raise ValueError("both the candidate and the control need live calls to compare")
    ta, tb = trimmed_mean(a), trimmed_mean(b)
    rng = np.random.default_rng(seed)
    # all resamples at once: one row per resample (this runs every 0.2 s during a canary)
    ra = trimmed_mean(a[rng.integers(0, len(a), (RESAMPLES, len(a)))])
    rb = trimmed_mean(b[rng.integers(0, len(b), (RESAMPLES, len(b)))])
    with np.errstate(divide="ignore"):
        ratios = np.where(rb > 0, ra / rb, np.inf)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return LiveComparison(
        ratio=ta / tb if tb > 0 else float("inf"),
        low=float(low),
        high=float(high),
        candidate_ms=ta,
        control_ms=tb,
        calls=(len(a), len(b)),
    )
