"""The canary: a verified candidate serves beside the control (what served before) on live
traffic, and is kept or rolled back.

While the candidate's slot carries a ``control``, the request path alternates blocks of calls
between the two (:meth:`~pgc_daemon.agent.slot.Slot.arm`) and records their latencies;
comparing latencies measured at the same moment on the same traffic is what makes the
comparison hold on a shared, noisy machine. The candidate's outputs are also shadow-checked
against the fp32 base on a sample of live inputs. The comparison itself is
:mod:`~pgc_daemon.agent.livecompare`; :func:`verdict` turns it into a decision.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch

from compiler import fidelity
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.live import ShadowSample
from pgc_daemon.agent.livecompare import compare as compare_live
from pgc_daemon.agent.runtime import background_reference, in_short_thread
from pgc_daemon.agent.slot import Slot
from pgc_daemon.policy import Policy
from pgc_daemon.states import D

MIN_CANARY_CALLS = 20
#: The canary runs ``canary_s``, and up to this many times as long while the latency
#: comparison is still uncertain.
MAX_EXTENSION = 3
#: A canary without enough evidence at its hard deadline (too few live calls per arm, or too
#: few shadow samples) keeps waiting for traffic, up to this many times ``canary_s``
#: (at least ``MIN_EVIDENCE_WAIT_S``); then it fails. Promotion needs evidence: a pause in
#: traffic must not promote a candidate nobody has seen serve.
EVIDENCE_WAIT = 10
MIN_EVIDENCE_WAIT_S = 5.0
POLL_S = 0.2
STOPPED = "agent stopped during the canary"


class Verdict(NamedTuple):
    keep: bool
    reason: str
    live: dict[str, float]
    """Live numbers to record on the deployment (``live_speedup``, ``live_fidelity``)."""
    end: D = D.ROLLED_BACK
    """Where a candidate that is not kept goes: ``rolled_back`` when the canary judged it
    worse, ``failed`` when it could not judge it (too little traffic, the agent stopping)."""


def run(
    served: Served,
    candidate: Slot,
    control: Slot,
    policy: Policy,
    stop: threading.Event,
    abandoned: threading.Event | None = None,
    tolerance: float | None = None,
) -> Verdict:
    """Serve live calls in alternating blocks by the candidate and the control, compare
    them on the same traffic at the same time; shadow-check the candidate's outputs against the
    fp32 base on a sample of live inputs. The caller has swapped in the candidate (with
    ``control`` set) and swaps back what the verdict says.

    The comparison (and its ``canary_s``) starts once both arms serve at the intra-op thread
    counts measured for them (a new variant's count is probed on its first calls, about 30 to
    100 of them). The canary ends with a verdict only on evidence: at least
    ``MIN_CANARY_CALLS`` live calls per arm and, when shadow checks are asked for,
    ``canary_shadow_samples`` of them. Short of that at the hard deadline it waits for
    traffic (bounded, see ``EVIDENCE_WAIT``), then fails. ``stop`` (the agent shutting down)
    and ``abandoned`` (someone else moved the deployment, e.g. an operator's cancel) end it
    at once without a promotion. ``tolerance``:
    how much slower than the control the candidate may be in the verdict (default: the
    policy's ``canary_latency_tolerance``; see :func:`tolerance_for`). How long the canary
    runs is set by ``canary_latency_tolerance`` alone: between two variants of about the same
    speed, a stricter tolerance would run every canary to its longest for a coin flip."""
    live = served.live
    live.latency_ms[control.variant_id].clear()
    live.latency_ms[candidate.variant_id].clear()
    served.take_variant_failure()
    live.request_shadow(policy.canary_shadow_samples)
    started = time.monotonic()
    evidence_deadline = started + max(EVIDENCE_WAIT * policy.canary_s, MIN_EVIDENCE_WAIT_S)
    # The comparison starts once both arms serve at their thread counts (an arm not yet
    # decided is probed on its own calls first, see agent.threadtune): latencies of an arm
    # served at a count it will not serve at would judge something that never serves.
    compared_from: float | None = None
    deadline = hard_deadline = evidence_deadline
    shadow_scores: list[float] = []
    metric = served.registry.metric or "sqnr"
    try:
        while True:
            if stop.is_set():
                return Verdict(False, STOPPED, {}, D.FAILED)
            if abandoned is not None and abandoned.is_set():
                return Verdict(False, "the deployment was moved elsewhere during the canary", {}, D.FAILED)
            stop.wait(POLL_S)
            failure = served.take_variant_failure()
            if failure is not None:
                return Verdict(False, f"canary failed live requests: {failure}", {})
            shadow = live.take_shadow()
            if shadow:
                shadow_scores.extend(in_short_thread(shadow_scores_of, served, shadow, metric))
            if stop.is_set():
                continue  # said above, before a verdict on what was seen so far
            now = time.monotonic()
            if compared_from is None:
                if not at_their_threads(served, candidate, control):
                    if now >= evidence_deadline:
                        break  # the verdict says what was missing
                    continue
                compared_from = now
                live.latency_ms[control.variant_id].clear()
                live.latency_ms[candidate.variant_id].clear()
                deadline = now + policy.canary_s
                hard_deadline = now + MAX_EXTENSION * policy.canary_s
                evidence_deadline = max(evidence_deadline, hard_deadline)
            if now < deadline:
                continue
            after = list(live.latency_ms[candidate.variant_id])
            before = list(live.latency_ms[control.variant_id])
            if not _enough(after, before, shadow_scores, policy):
                if now >= evidence_deadline:
                    break  # the verdict says what was missing
                continue
            if now >= hard_deadline or compare_live(after, before).certain(
                policy.canary_latency_tolerance
            ):
                break  # more calls would not change the verdict
    finally:
        live.request_shadow(0)
    after = list(live.latency_ms[candidate.variant_id])
    before = list(live.latency_ms[control.variant_id])
    judged = verdict(after, before, shadow_scores, policy, metric, tolerance)
    if compared_from is None and not judged.keep:
        judged = judged._replace(
            reason=f"{judged.reason}; the arms' thread counts were still being measured")
    return judged


def at_their_threads(served: Served, *arms: Slot) -> bool:
    """Whether every arm serves at the intra-op thread count measured for it: what a
    side-by-side comparison of live latencies waits for."""
    return all(served.at_its_threads(arm) for arm in arms)


def tolerance_for(source: str, policy: Policy) -> float | None:
    """A deployment the search made because it measured the candidate faster (objective
    ``fastest``) gets ``canary_search_tolerance`` (0 by default: it must not be slower live
    than what serves). Seen in the demo: a second search deployment, int8 dynamic (3.33x in
    the search), ran 11% slower live than the int8 static variant it replaced (95% interval
    8-15%) and passed the 15% tolerance meant for variants deployed for other reasons. Others
    (manual, rollback, most accurate): ``canary_latency_tolerance`` (None)."""
    if source == "search" and policy.objective == "fastest":
        return policy.canary_search_tolerance
    return None


def _enough(after: list[float], before: list[float], shadow_scores: list[float], policy: Policy) -> bool:
    """Whether there is evidence to judge by: live calls on both arms, and the shadow samples
    asked for."""
    return min(len(after), len(before)) >= MIN_CANARY_CALLS and len(shadow_scores) >= max(
        policy.canary_shadow_samples, 0
    )


def shadow_scores_of(served: Served, shadow: list[ShadowSample], metric: str) -> list[float]:
    """Fidelity of live canary outputs against the fp32 base on the same inputs."""
    scores = []
    with torch.inference_mode(), background_reference(served.serving_now):
        for _variant, (args, kwargs), out in shadow:
            scores.append(fidelity(metric, [served.base(*args, **kwargs)], [out]))
    return scores


def verdict(
    after: list[float],
    before: list[float],
    shadow_scores: list[float],
    policy: Policy,
    metric: str,
    tolerance: float | None = None,
) -> Verdict:
    """Keep the candidate or not, from its live latencies (``after``, ms), the control's
    (``before``) and the shadow fidelity scores. Without evidence (too few calls on either
    arm, or fewer shadow samples than the policy asks for) the candidate is not kept: the
    verdict is ``failed`` with what was missing, never a promotion. ``tolerance``: as for
    :func:`run`."""
    tol = policy.canary_latency_tolerance if tolerance is None else tolerance
    live: dict[str, float] = {}
    notes = []
    calls = min(len(after), len(before))
    if calls < MIN_CANARY_CALLS:
        return Verdict(
            False,
            f"too little traffic to judge: {calls} calls (candidate {len(after)}, control "
            f"{len(before)}; {MIN_CANARY_CALLS} needed on each)",
            live,
            D.FAILED,
        )
    c = compare_live(after, before)
    live["live_speedup"] = c.speedup
    said = (
        f"live latency {c.candidate_ms:.2f} ms vs {c.control_ms:.2f} ms for the control "
        f"(trimmed means of {c.calls[0]} and {c.calls[1]} calls; ratio {c.ratio:.2f}, "
        f"95% CI {c.low:.2f}-{c.high:.2f})"
    )
    if c.too_slow(tol):
        why = (f"slower than the {tol:.0%} tolerance" if tol > 0 else
               "slower than what serves, which a deployment made to be faster must not be")
        return Verdict(False, f"{said}: {why}", live)
    notes.append(said)
    wanted = policy.canary_shadow_samples
    if shadow_scores:
        live_fid = sum(shadow_scores) / len(shadow_scores)
        live["live_fidelity"] = live_fid
        floor = policy.canary_floor
        if live_fid < floor:
            return Verdict(
                False,
                f"shadow {metric} fidelity {live_fid:.4f} on {len(shadow_scores)} live inputs < {floor:.4f}",
                live,
            )
    if len(shadow_scores) < wanted:
        return Verdict(
            False,
            f"too few shadow samples to check fidelity: {len(shadow_scores)} of {wanted}",
            live,
            D.FAILED,
        )
    if shadow_scores:
        notes.append(f"shadow {metric} {live['live_fidelity']:.4f} on {len(shadow_scores)} inputs")
    return Verdict(True, "canary passed: " + "; ".join(notes), live)
