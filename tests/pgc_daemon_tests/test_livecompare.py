"""The canary's latency verdict: robust to bimodal live latency, confident before it rolls back."""

from __future__ import annotations

import numpy as np
import pytest

from pgc_daemon.agent.livecompare import compare, trimmed_mean


def _bimodal(rng: np.random.Generator, n: int, fast: float, share_slow: float) -> list[float]:
    """A call overlapping another one takes twice as long: two modes."""
    slow = rng.random(n) < share_slow
    return list(np.where(slow, 2 * fast, fast) * rng.normal(1.0, 0.03, n))


def test_equal_speed_on_bimodal_traffic_is_not_called_slower() -> None:
    rng = np.random.default_rng(1)
    rolled_back = 0
    median_would_have = 0
    for _ in range(200):
        # the same module on both arms, 30 calls each, half of the calls overlapping
        cand, ctrl = _bimodal(rng, 30, 16.0, 0.45), _bimodal(rng, 30, 16.0, 0.45)
        rolled_back += compare(cand, ctrl).slower(0.5)
        median_would_have += np.median(cand) > np.median(ctrl) * 1.5
    assert median_would_have > 10  # what the old median comparison did on such traffic
    assert rolled_back == 0


def test_a_clearly_slower_candidate_is_called_slower_with_confidence() -> None:
    rng = np.random.default_rng(2)
    cand = list(rng.normal(30.0, 2.0, 40))
    ctrl = list(rng.normal(15.0, 1.0, 40))
    c = compare(cand, ctrl)
    assert c.ratio == pytest.approx(2.0, rel=0.1)
    assert c.low <= c.ratio <= c.high
    assert c.slower(0.15) and c.certain(0.15)
    assert c.speedup == pytest.approx(0.5, rel=0.1)


def test_too_few_calls_leave_the_verdict_open() -> None:
    c = compare([16.0, 33.0, 16.5, 32.0], [16.2, 15.9, 33.5, 16.1])
    assert not c.certain(0.15)  # the canary keeps running rather than guess


def test_a_pause_does_not_decide() -> None:
    calls = [16.0] * 30
    assert trimmed_mean(np.array([*calls, 500.0])) == pytest.approx(16.0)


def test_no_calls_is_an_error() -> None:
    with pytest.raises(ValueError, match="need live calls"):
        compare([], [1.0])
