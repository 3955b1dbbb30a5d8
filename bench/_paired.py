"""Bootstrap intervals of paired timings (the same rounds measured two ways), shared by
``bench/profiler_overhead.py`` and its cases."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(instr: np.ndarray, plain: np.ndarray, seed: int = 0, n: int = 2000) -> tuple[float, float]:
    """95% interval of the paired sum ratio - 1 (rounds resampled with replacement)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(plain), size=(n, len(plain)))
    ratios = instr[idx].sum(1) / plain[idx].sum(1) - 1
    lo, hi = np.percentile(ratios, (2.5, 97.5))
    return float(lo), float(hi)


def median_diff_ci(instr: np.ndarray, plain: np.ndarray, seed: int = 0, n: int = 2000) -> tuple[float, float]:
    """95% interval of the median paired difference, in the timings' unit."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(plain), size=(n, len(plain)))
    lo, hi = np.percentile(np.median(instr[idx] - plain[idx], axis=1), (2.5, 97.5))
    return float(lo), float(hi)
