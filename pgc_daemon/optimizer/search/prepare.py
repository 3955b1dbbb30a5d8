"""What a search needs, assembled the same way for a live run (worker process, inputs from the
store) and an offline run (``pgc optimize``, inputs from the MODEL_SPEC)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from compiler import (Backend, CompileCache, Example, Recipe, SensitivityReport, probe,
                      sensitivity, untraceable)
from pgc_daemon.errors import SearchError
from pgc_daemon.policy import Policy
from pgc_daemon.optimizer.search.baselines import baselines_for
from pgc_daemon.optimizer.search.evaluate import for_budget
from pgc_daemon.optimizer.search.hotprofile import time_candidates
from pgc_daemon.optimizer.search.offers import backends_for, choices_for, on_gpu
from pgc_daemon.optimizer.search.space import PEER_BASELINES, SAFE, Space, build_space
from pgc_daemon.optimizer.search.study import Search, TrialRecord
from pgc_daemon.optimizer.search.trial import ServingThreads
from profiler import profile_model, shape_key

log = logging.getLogger("pgc.search")

ACCURACY_INPUTS = 64
TIMING_INPUTS = 16
MAX_HOT = 6
SENSITIVITY_INPUTS = 8


def timing_inputs_for(
    inputs: Sequence[Example], histogram: dict[str, int], n: int = TIMING_INPUTS
) -> list[Example]:
    """Inputs whose shapes follow live traffic: each shape bucket seen in ``inputs`` gets its
    share of ``n`` by the traffic ``histogram`` (calls per bucket)."""
    by_key: dict[str, list[Example]] = {}
    for ex in inputs:
        by_key.setdefault(shape_key(*ex), []).append(ex)
    total = sum(histogram.get(k, 0) for k in by_key)
    if total == 0:
        return list(inputs[:n])
    out: list[Example] = []
    for key, items in sorted(by_key.items(), key=lambda kv: -histogram.get(kv[0], 0)):
        share = histogram.get(key, 0)
        if share:
            out.extend(items[: max(1, round(n * share / total))])
    return out[:n] or list(inputs[:n])


def offline_profile(model: nn.Module, inputs: Sequence[Example], rounds: int = 3) -> list[dict[str, Any]]:
    """Per-layer shares from profiling every call on (up to 16 of) ``inputs``: what live
    sampling gives a served model, through the same profiler code, hottest first."""
    report = profile_model(model, list(inputs[:16]), rounds=rounds, counters=False)
    return [{**r, "share": r["latency_ratio"]} for r in report.layers]


def measure_sensitivity(
    model: nn.Module,
    inputs: Sequence[Example],
    profile: Sequence[dict[str, Any]],
    *,
    metric: str | None = None,
    max_layers: int = 2 * MAX_HOT,
) -> SensitivityReport:
    """Per-layer sensitivity of the layers that carry the live time (the hottest
    ``max_layers`` of them) to the int8 (and fp8) choices the search offers; bf16 and int8
    weight-only are close to lossless and not measured (so never pruned). Costs a few
    seconds a layer."""
    layers = time_candidates(model, profile)[:max_layers]
    choices = [c for c in choices_for(probe(), gpu=on_gpu(model))
               if c == "fp8" or (c.startswith("int8") and "weight_only" not in c)]
    return sensitivity(
        model,
        inputs,
        choices,
        layers=layers,
        metric=metric,
        calibration=inputs,
        max_inputs=SENSITIVITY_INPUTS,
    )


def make_search(
    *,
    base: nn.Module,
    inputs: Sequence[Example],
    profile: Sequence[dict[str, Any]],
    policy: Policy,
    name: str,
    storage: str | None,
    histogram: dict[str, int] | None = None,
    metric: str | None = None,
    accuracy: Callable[[Sequence[Any], Sequence[Any]], float] | None = None,
    labels: Sequence[Any] | None = None,
    on_trial: Callable[[TrialRecord, int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    warm_start: Sequence[Recipe] = (),
    space: Space | None = None,
    sensitivity: SensitivityReport | None = None,
    reference_ms: float | None = None,
    cache: CompileCache | None = None,
    seed: int = 0,
    policy_version: int | None = None,
    early: bool = False,
    timing_threads: int | None = None,
    timing_gap_s: float = 0.0,
    serving_threads: ServingThreads | None = None,
) -> Search:
    """A :class:`Search` over a space shaped by ``profile`` and ``sensitivity``, with
    baselines (and warm-start recipes) enqueued first.

    ``early``: sensitivity is not measured yet. The search gets a space shaped by the profile
    alone and nothing is enqueued; the caller evaluates :func:`first_trials` with
    :meth:`Search.run_first`, measures sensitivity, then gives the search its final space with
    :func:`settle`."""
    evaluator = for_budget(base, inputs, policy.max_accuracy_drop, first=ACCURACY_INPUTS,
                           metric=metric, accuracy=accuracy, labels=labels)
    space = space or shape_space(
        base, profile, policy, sensitivity=None if early else sensitivity, histogram=histogram,
        example=inputs[0] if inputs else None,
    )
    search = Search(
        base=base,
        space=space,
        policy=policy,
        evaluator=evaluator,
        timing_inputs=timing_inputs_for(inputs, histogram or {}),
        calibration=list(inputs),
        storage=storage,
        name=name,
        on_trial=on_trial,
        should_stop=should_stop,
        seed=seed,
        reference_ms=reference_ms,
        cache=cache,
        policy_version=policy_version,
        timing_threads=timing_threads,
        timing_gap_s=timing_gap_s,
        serving_threads=serving_threads,
    )
    if not early:
        settle(search, space, policy=policy, sensitivity=sensitivity, warm_start=warm_start)
    return search


def shape_space(
    base: nn.Module,
    profile: Sequence[dict[str, Any]],
    policy: Policy,
    *,
    sensitivity: SensitivityReport | None,
    histogram: dict[str, int] | None = None,
    example: Example | None = None,
) -> Space:
    """The space of a search on this machine: hot layers from the live ``profile`` (the most
    sensitive of them, with ``sensitivity``), choices pruned by ``sensitivity``, backends
    those installed here that the policy allows and that take ``example``'s inputs."""
    return build_space(
        base,
        profile,
        probe(),
        max_hot=MAX_HOT,
        backends=taking_inputs(allowed_backends(policy), base, example),
        sensitivity=sensitivity,
        max_drop=policy.max_accuracy_drop,
        shapes=histogram,
    )


#: backends that trace the module into their own graph: they take tensor arguments only
TRACED = ("onnxruntime", "openvino")


def taking_inputs(backends: tuple[str, ...], base: nn.Module,
                  example: Example | None) -> tuple[str, ...]:
    """``backends`` less those that cannot trace the model on ``example`` (its inputs, its
    outputs: :func:`compiler.untraceable`; said in the log)."""
    why = untraceable(base, example) if example is not None else None
    if why is None:
        return backends
    out = tuple(b for b in backends if Backend.parse(b).kind not in TRACED)
    if out != backends:
        log.warning("%s left out of the search: %s", ", ".join(sorted(set(backends) - set(out))),
                    why)
    return out


def allowed_backends(policy: Policy, installed: Sequence[str] | None = None) -> tuple[str, ...]:
    """The ``installed`` backends (default: this machine's) that ``policy.backends`` allows,
    all of them when it names none; :class:`SearchError` when it names only backends not
    installed."""
    installed = tuple(installed) if installed is not None else backends_for()
    if policy.backends is None:
        return installed
    out = tuple(b for b in installed if b in policy.backends)
    if not out:
        raise SearchError(
            f"none of the policy's backends ({', '.join(policy.backends)}) is installed here "
            f"(installed: {', '.join(installed)})"
        )
    return out


def settle(
    search: Search,
    space: Space,
    *,
    policy: Policy,
    sensitivity: SensitivityReport | None,
    warm_start: Sequence[Recipe] = (),
) -> None:
    """Give ``search`` its final ``space`` (the trials it evaluated early get its parameters:
    :meth:`Search.set_space`) and enqueue the warm-start recipes and the baselines it can say
    (a recipe the study already evaluated is not evaluated again)."""
    search.set_space(space)
    search.sensitivity = sensitivity
    space = search.space
    queued = [p for p in (space.params_for(r) for r in warm_start) if p is not None]
    search.enqueue(queued + baselines_for(space, policy, sensitivity))


def first_trials(
    space: Space, warm_start: Sequence[Recipe] = (), objective: str = "fastest"
) -> list[tuple[dict[str, Any], Recipe]]:
    """What a search evaluates before per-layer sensitivity is measured, in order: the
    warm-start recipes (what earlier studies of the model chose), then the baselines, every
    layer int8 first (the likeliest large gains, so a first deployment need not wait) and fp32
    compiled last. Among the int8 baselines the installed peers' come first: they build in
    seconds (MiniLM int8 dynamic for ONNX Runtime: 3 s) where an Inductor package takes
    40-200 s on 2 cores beside live traffic, so a first deployment comes early even where
    Inductor builds are slow; where Inductor's int8 then wins, it replaces the peer's (a
    deployment while searching). Seen on a 2-core AVX2 VM: the first variant active after 328 s
    with Inductor's int8 first (a 200 s trial, then pruned on accuracy). For ``objective``
    ``most_accurate`` fp32 compiled comes first instead: where it meets the latency target it
    is the answer (no drop at all), and the int8 baselines after it are a first deployment
    where it does not. Each with the parameters its trial is recorded with."""
    out: list[tuple[dict[str, Any], Recipe]] = []
    for recipe in warm_start:
        out.append((space.params_for(recipe) or {"recipe": recipe.label()}, recipe))
    fp32_first = objective == "most_accurate"
    baselines = sorted(space.baselines(), key=lambda p: (
        (p["default"] == SAFE) is not fp32_first, p.get("backend") not in PEER_BASELINES))
    out += [(p, space.recipe(p)) for p in baselines]
    unique: dict[str, tuple[dict[str, Any], Recipe]] = {}
    for params, recipe in out:
        unique.setdefault(recipe.hash, (params, recipe))
    return list(unique.values())
