"""One trial of a search: build the recipe (or load the artifact another trial built), warm
it, prune it on a quick accuracy check, score it on every input, time it interleaved with
fp32 eager."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from compiler import (
    BuildError,
    CompileCache,
    Example,
    Recipe,
    at_threads,
    brief_error,
    build,
    recompile_limit_hits,
    silence_recompile_limit,
    warm,
)
from pgc_daemon.optimizer.search.evaluate import Evaluator, quick_verdict
from pgc_daemon.optimizer.search.measure import interleaved
from pgc_daemon.optimizer.search.results import TrialRecord, feasible
from pgc_daemon.policy import Policy

log = logging.getLogger("pgc.search")



class TrialContext(Protocol):
    """What a trial needs of its search (:class:`~pgc_daemon.optimizer.search.study.Search`)."""

    base: nn.Module
    cache: CompileCache | None
    calibration: Sequence[Example]
    timing_inputs: Sequence[Example]
    evaluator: Evaluator
    policy: Policy
    max_timing_s: float
    seed: int
    reference_ms: float | None
    timing_threads: int | None
    timing_gap_s: float
    serving_threads: ServingThreads | None

#: Backends whose thread pool is torch's (the timing thread count applies to both arms).
TORCH_THREADED = ("inductor", "eager")
#: A trial whose timed calls ran the original model more often than this is not measured.
MAX_FALLBACK_SHARE = 0.1


@dataclass(frozen=True)
class ServingThreads:
    """fp32 eager as it serves: the intra-op count the serving process's thread tuner chose
    for it, and its live latency at each other count it tried over its latency at that one
    (ratio, 95% interval), measured interleaved at one time.

    A trial is timed against fp32 at the trial's count (one, beside live traffic), but fp32
    serves at the count fastest for it live, and a deployment is judged against that. Seen in
    the demo on 2 cores: int8 static · Inductor timed 3.35x fp32 at one thread; live, fp32
    served at two (35.9 ms, 44.6 at one) and int8 at one (13.3 ms: 44.6 / 3.35), so 2.7-3.0x.
    :meth:`scale` turns a trial's timed ratio into one against fp32 as it serves."""

    serves_at: int
    vs_chosen: Mapping[int, tuple[float, float, float]]

    def scale(self, timed_at: int) -> float:
        """fp32's live latency at ``timed_at`` threads over its latency as it serves, where
        it is slower there with confidence; else 1.0 (not measured, or a difference the tuner
        itself would not act on: seen at a noisy start, fp32 at 60.2 ms on one thread and 64.9
        on two, kept at two, would have raised a trial's 3.41x to 3.68x against 3.43x live)."""
        got = self.vs_chosen.get(timed_at)
        if timed_at == self.serves_at or got is None or got[1] <= 1.0:
            return 1.0
        return got[0]

    @classmethod
    def from_event(cls, data: Mapping[str, Any] | None) -> ServingThreads | None:
        """From a thread tuner's decision (a ``threads`` event's data); None where it is not
        one."""
        if not data or not isinstance(data.get("threads"), int) or "vs_chosen" not in data:
            return None
        try:
            against = {int(n): (float(r), float(lo), float(hi))
                       for n, (r, lo, hi) in data["vs_chosen"].items()}
        except (TypeError, ValueError, AttributeError):
            return None
        return cls(data["threads"], against)


def arm_threads(threads: int | None, recipe: Recipe, resized: bool = False) -> int:
    """The intra-op count fp32 is timed at beside ``recipe`` (see :func:`timing_threads`);
    ``resized``: the recipe's own thread pool was made ``threads`` wide for timing."""
    if threads is None or (recipe.backend.kind not in TORCH_THREADED and not resized):
        return torch.get_num_threads()
    return threads


@contextlib.contextmanager
def timing_threads(threads: int | None, recipe: Recipe, resized: bool = False) -> Iterator[None]:
    """Time both arms with ``threads`` intra-op threads (None: as they are). A worker beside
    live traffic times at one: its OpenMP teams, preempted by the serving process, stall at
    every barrier, and fp32 eager (hundreds of parallel regions a call) far more than a
    compiled variant: measured on 2 cores, MiniLM int8 timed at 7.1x fp32 eager with two
    threads under serving load, 3.4x alone with one and 3.6x alone with two (live: 2.8x).
    A backend with its own thread pool (ONNX Runtime, OpenVINO) is timed at ``threads`` too
    when its pool could be ``resized`` for timing (:func:`timing_module`); otherwise fp32 is
    timed with the same count as its pool."""
    before = torch.get_num_threads()
    n = arm_threads(threads, recipe, resized)
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timing_clock(threads: int | None, recipe: Recipe, resized: bool = False) -> str:
    """The clock a trial is timed on: at one intra-op thread both arms of a torch-threaded
    recipe run wholly on the timing thread, so its CPU clock times them free of preemption
    by the serving processes beside it (measured on 2 cores under the demo's load: MiniLM
    int8 dynamic timed 3.39x on wall time, 2.85x alone, 2.98x live at two threads); so do
    ONNX Runtime and OpenVINO with a pool ``resized`` to one (both compute on the calling
    thread then: measured, the thread's CPU time was all of the process's); else wall time."""
    on_caller = recipe.backend.kind in TORCH_THREADED or resized
    return "thread" if threads == 1 and on_caller else "wall"


def timing_module(module: nn.Module, threads: int | None, recipe: Recipe) -> nn.Module | None:
    """For a backend with its own thread pool, timed beside live traffic (``threads`` given):
    the variant made again with a pool of ``threads``, so it is timed as torch's backends
    are, at one thread on the thread's CPU clock, against fp32 as it serves. Timed at its
    pool's own size on wall time, against fp32 eager at that size, a peer came out far ahead
    of what it served at: fp32's two-thread team stalls at its barriers beside the serving
    process, ONNX Runtime's hardly (demo on the AVX-512 EPYC: searched 4.70x, live 3.19x).
    None where nothing is resized (torch's backends, offline searches, a module without a
    pool of its own)."""
    if threads is None or recipe.backend.kind in TORCH_THREADED:
        return None
    return at_threads(module, threads)


def evaluate_trial(
    self: TrialContext,
    number: int,
    params: dict[str, Any],
    recipe: Recipe,
    incumbent: float | None = None,
) -> TrialRecord:
    """Build, warm, check accuracy (quick, then full) and time one trial's recipe against
    fp32 eager; the record says how far it got and why (a broken candidate is a failed
    trial, never an exception). ``incumbent``: the ratio of the best feasible trial so far;
    timing stops once it is clear which side of it (and of fp32 by ``min_speedup``) the
    candidate falls."""
    t0 = time.monotonic()
    rec = TrialRecord(
        number=number,
        state="failed",
        params=dict(params),
        recipe=recipe.to_dict(),
        recipe_hash=recipe.hash,
        label=recipe.label(),
    )
    policy = self.policy
    variant = None
    phases = rec.phases
    silence_recompile_limit()  # this is a search process: the trial reports it instead
    limit_hits = recompile_limit_hits()[0]
    try:
        t = time.monotonic()
        example = self.calibration[0] if self.calibration else None
        variant = build(
            self.base, recipe, calibration=self.calibration, example=example, cache=self.cache
        )
        phases["build"] = time.monotonic() - t
        rec.artifact = getattr(variant, "artifact", None)
        unloadable = _compiled_without_artifact(variant, self.cache)
        if unloadable:
            rec.message = unloadable
            return rec
        t = time.monotonic()
        warm(variant, self.timing_inputs[:1], rounds=1)
        phases["warm"] = time.monotonic() - t
        t = time.monotonic()
        steps = self.evaluator.quick(variant.module, policy.max_accuracy_drop)
        phases["quick"] = time.monotonic() - t
        prune, step = quick_verdict(steps, policy.max_accuracy_drop)
        rec.quick_drop, rec.quick_steps = step.drop, [dataclasses.astuple(s) for s in steps]
        if prune:
            rec.state, rec.drop = "pruned", step.drop
            rec.fidelity = 1.0 - step.drop if self.evaluator.accuracy is None else None
            rec.message = (f"pruned before timing: drop {step.drop:.4f} on {step.n} inputs, "
                           f"over the budget {policy.max_accuracy_drop:g} with 95% confidence "
                           f"(lower bound {step.low:.4f})")
            return rec
        t = time.monotonic()
        full = self.evaluator.score(variant.module)
        phases["full"] = time.monotonic() - t
        rec.fidelity, rec.drop = full.fidelity, full.drop
        # thresholds and results are against fp32 as it serves; timing is against fp32 at the
        # trial's count, so the thresholds go into timing's units and the result comes out
        resized = timing_module(variant.module, self.timing_threads, recipe)
        timed_at = arm_threads(self.timing_threads, recipe, resized is not None)
        scale = self.serving_threads.scale(timed_at) if self.serving_threads is not None else 1.0
        misses = getattr(variant.module, "shape_misses", 0)
        t = time.monotonic()
        with timing_threads(self.timing_threads, recipe, resized is not None):
            timing = interleaved(
                self.base,
                resized if resized is not None else variant.module,
                self.timing_inputs,
                percentile=policy.latency_percentile,
                max_seconds=self.max_timing_s,
                seed=self.seed + number,
                decide_at=[r / scale for r in
                           [1 / policy.min_speedup] + ([incumbent] if incumbent else [])],
                gap_s=self.timing_gap_s,
                clock=timing_clock(self.timing_threads, recipe, resized is not None),
            )
        phases["timing"] = time.monotonic() - t
        unfit = _shape_fallback(variant.module, misses, timing.calls, limit_hits)
        if unfit:
            rec.timing = timing.to_dict()
            rec.message = unfit
            return rec
        pct = policy.latency_percentile
        rec.ratio = timing.ratio * scale
        rec.speedup = 1 / rec.ratio
        if self.reference_ms:
            rec.baseline_ms = self.reference_ms
            rec.latency_ms = rec.ratio * self.reference_ms
        else:
            rec.baseline_ms = timing.baseline_ms[pct]
            rec.latency_ms = timing.candidate_ms[pct]
        rec.timing = timing.to_dict() | {"serving_scale": scale}
        rec.state = "complete"
        rec.feasible = feasible(policy, rec)
        rec.violation = policy.normalized_violation(rec.drop, rec.latency_ms)
        pace = "faster" if rec.speedup >= 1 else "slower"
        factor = rec.speedup if rec.speedup >= 1 else 1 / rec.speedup
        served = "" if scale == 1.0 else (
            f" as it serves ({timing.speedup:.2f}x against fp32 at the same "
            f"{timed_at} thread(s))")
        rec.message = (
            f"{factor:.2f}x {pace} than fp32 eager{served}, {self.evaluator.metric} "
            f"{rec.fidelity:.4f}" + ("" if rec.feasible else " (infeasible)")
        )
    except BuildError as exc:
        rec.message = str(exc)
        log.debug("trial %s: %s", rec.label, exc, exc_info=True)  # the cause in full
    except Exception as exc:  # noqa: BLE001 - a broken candidate is a failed trial
        rec.message = brief_error(exc)
        log.debug("trial %s failed", rec.label, exc_info=True)
    finally:
        rec.duration_s = time.monotonic() - t0
        del variant
        torch._dynamo.reset()
        gc.collect()
    return rec



def _compiled_without_artifact(variant: Any, cache: CompileCache | None) -> str | None:
    """Why a variant cannot be deployed (None: it can): serving processes load what a worker
    built and never compile (a compile takes 20-60 s of a serving host's cores beside its
    requests), so a compiled variant that saved no artifact (its AOTInductor package failed
    to export, compile or pass its output check, and ``torch.compile`` stood in) is not
    deployed, nor timed. Only a search whose cache shares artifacts with serving processes
    (the live one) asks; offline the variant serves where it was built."""
    if cache is None or cache.artifacts is None or variant.artifact is not None \
            or not variant.report.compiled:
        return None
    why = next((n for n in variant.report.notes if n.startswith("AOTInductor package not")),
               "no artifact was saved")
    return (f"not deployable: {why.split('; compiled with')[0]}; a serving process would "
            "have to compile it itself, and pgc deploys only what a worker built")


def _shape_fallback(module: Any, misses_before: int, calls: int, limit_hits: int) -> str | None:
    """Why a trial's timing did not measure its variant (None: it did). A static-shape
    variant fed inputs of other shapes runs them on something else: a package runs the fp32
    model (``shape_misses``), ``torch.compile`` compiles each new length and, past Dynamo's
    recompile limit, runs eagerly. Either way the ratio would be fp32's, not the recipe's."""
    hits, reason = recompile_limit_hits()
    if hits > limit_hits:
        return ("torch.compile hit its recompile limit: inputs of other shapes ran eagerly, so "
                f"the timing measured fp32, not this recipe ({reason or 'new shapes'}); "
                "dynamic shapes or shape buckets serve variable-length inputs")
    missed = getattr(module, "shape_misses", 0) - misses_before
    if calls and missed / calls > MAX_FALLBACK_SHARE:
        return (f"{missed} of {calls} timed calls had shapes the variant was not compiled for "
                "and ran the original fp32 model, so the timing measured fp32, not this recipe; "
                "dynamic shapes or shape buckets serve variable-length inputs")
    return None
