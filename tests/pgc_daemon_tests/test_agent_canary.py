"""The canary's verdict from live numbers alone (no threads, no store): latency judged with
confidence, shadow fidelity against the policy's canary floor, and no promotion without
evidence (too little traffic, too few shadow samples)."""

from __future__ import annotations

from pgc_daemon.agent.canary import MIN_CANARY_CALLS, tolerance_for, verdict
from pgc_daemon.policy import Policy
from pgc_daemon.states import D

POLICY = Policy(max_accuracy_drop=0.02, canary_latency_tolerance=0.15, canary_shadow_samples=2)
NO_SHADOW = Policy(max_accuracy_drop=0.02, canary_latency_tolerance=0.15, canary_shadow_samples=0)
CALLS = 3 * MIN_CANARY_CALLS


def _ms(value: float, n: int = CALLS) -> list[float]:
    return [value * (1 + 0.01 * (i % 5)) for i in range(n)]


def test_a_candidate_as_fast_and_as_accurate_is_kept() -> None:
    v = verdict(_ms(10.0), _ms(10.0), [0.999, 1.0], POLICY, "top1")
    assert v.keep and v.reason.startswith("canary passed: live latency")
    assert abs(v.live["live_speedup"] - 1.0) < 0.01
    assert v.live["live_fidelity"] > 0.99


def test_a_candidate_slower_beyond_the_tolerance_is_rolled_back() -> None:
    keep, reason, live, end = verdict(_ms(13.0), _ms(10.0), [], POLICY, "top1")
    assert not keep and end == D.ROLLED_BACK and "slower than the 15% tolerance" in reason
    assert live["live_speedup"] < 1 / 1.15


def test_shadow_fidelity_below_the_canary_floor_rolls_back() -> None:
    assert POLICY.canary_floor == POLICY.min_fidelity - 0.5 * POLICY.max_accuracy_drop
    below = POLICY.canary_floor - 0.01
    keep, reason, live, end = verdict(_ms(10.0), _ms(10.0), [below], NO_SHADOW, "cosine")
    assert not keep and end == D.ROLLED_BACK
    assert f"shadow cosine fidelity {below:.4f} on 1 live inputs" in reason
    # between the floor and the verification bound: a noisy live sample, still kept
    assert verdict(_ms(10.0), _ms(10.0), [POLICY.canary_floor + 0.001] * 2, POLICY, "cosine").keep


def test_too_little_traffic_is_no_evidence_and_fails_the_canary() -> None:
    keep, reason, live, end = verdict(_ms(50.0, 5), _ms(10.0), [1.0, 1.0], POLICY, "top1")
    assert not keep and end == D.FAILED
    assert reason.startswith("too little traffic to judge: 5 calls")
    assert "live_speedup" not in live
    # no traffic at all (a shutdown, a pause): never a promotion
    v = verdict([], [], [], NO_SHADOW, "top1")
    assert not v.keep and v.end == D.FAILED and "too little traffic to judge: 0 calls" in v.reason


def test_too_few_shadow_samples_do_not_count_as_checked() -> None:
    keep, reason, _live, end = verdict(_ms(10.0), _ms(10.0), [1.0], POLICY, "top1")
    assert not keep and end == D.FAILED
    assert "too few shadow samples to check fidelity: 1 of 2" in reason
    # without shadow checks asked for, latency alone decides
    assert verdict(_ms(10.0), _ms(10.0), [], NO_SHADOW, "top1").keep


def test_a_deployment_made_to_be_faster_must_not_be_slower_live() -> None:
    """11% slower live: within the 15% tolerance for what is deployed for other reasons, not
    for the search's deployments under ``fastest``."""
    assert verdict(_ms(11.1), _ms(10.0), [], NO_SHADOW, "top1").keep
    keep, reason, live, end = verdict(_ms(11.1), _ms(10.0), [], NO_SHADOW, "top1", 0.0)
    assert not keep and end == D.ROLLED_BACK and "must not be" in reason
    assert verdict(_ms(9.5), _ms(10.0), [], NO_SHADOW, "top1", 0.0).keep
    assert tolerance_for("search", NO_SHADOW) == 0.0
    assert tolerance_for("search", Policy(canary_search_tolerance=0.3)) == 0.3
    assert tolerance_for("manual", NO_SHADOW) is None
    assert tolerance_for("rollback", NO_SHADOW) is None
    most_accurate = Policy(objective="most_accurate", latency_target_ms=50.0)
    assert tolerance_for("search", most_accurate) is None
