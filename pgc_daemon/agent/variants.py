"""The variants a swapper deploys: building them, warming them up, verifying their fidelity
against the base on live inputs, and keeping the last few warm.

Threading: everything here runs in the swapper's thread or the short-lived threads it starts
for torch work (:func:`~pgc_daemon.agent.runtime.in_short_thread`), one call at a time.
"""

from __future__ import annotations

import collections
import logging
import time
import weakref
from typing import Any

import torch

from compiler import BuiltVariant, CompileCache, Recipe, build, fidelity
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.runtime import background_reference
from pgc_daemon.agent.slot import Slot
from pgc_daemon.errors import DeployFailed
from profiler import shape_key

log = logging.getLogger("pgc.swapper")
VERIFY_INPUTS = 32
WARM_SHAPES = 8
CALIBRATION_INPUTS = 32
KEEP_BUILT = 3
#: The verification set (live inputs and their fp32 outputs) is kept this long even while the
#: reservoir changes: recomputing fp32 on every deployment would take cores from requests.
REFS_MAX_AGE_S = 600.0



class Variants:
    """Built variants of one served model and the verification set they are checked on."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self._built: collections.OrderedDict[int, Slot] = collections.OrderedDict()
        self._refs: tuple[int, float, list[Any], list[Any]] | None = None
        """(reservoir version, taken at, inputs, fp32 outputs) of the verification set."""
        self._scores: weakref.WeakKeyDictionary[torch.nn.Module, tuple[float, float]] = (
            weakref.WeakKeyDictionary()
        )
        """Fidelity of modules on the verification set taken at that time."""
        self._cache: CompileCache | None = None
        self.compiles = 0
        """Compiled variants this process built itself (a worker's artifact was missing or
        unfit); eager variants, which only quantize a copy, are not counted."""
        self.loads = 0
        """Variants that came as an artifact a worker built (nothing compiled here)."""
        self.last_source = ""
        self.build_cpu_s = 0.0
        """CPU seconds this process's builds and artifact loads took, in all (the thread that
        ran them; compiler subprocesses not included)."""

    def in_memory(self, variant_id: int) -> Slot | None:
        """A warm module for this variant, if one was built recently (or is the base)."""
        if variant_id == self.served.registry.baseline_variant_id:
            return self.served.base_slot()
        return self._built.get(variant_id)

    def remember(self, slot: Slot) -> None:
        """Keep the last few built variants warm, so going back and forth between them (a
        rollback, an operator's A/B) swaps in milliseconds instead of recompiling."""
        if slot.variant_id is None:
            return
        self._built[slot.variant_id] = slot
        self._built.move_to_end(slot.variant_id)
        while len(self._built) > KEEP_BUILT:
            self._built.popitem(last=False)

    def cache(self) -> CompileCache:
        if self._cache is None:
            self._cache = CompileCache(
                self.served.registry.settings.compile_cache_path(),
                artifacts=self.served.registry.settings.artifact_path(),
            )
        return self._cache

    def build(self, recipe_data: dict[str, Any], artifact: str | None = None) -> BuiltVariant:
        """A recipe's variant of the base module: the artifact a worker built for it when
        there is one that fits this process (loaded, nothing compiled), else built here and
        calibrated on live inputs (counted in ``compiles``)."""
        started = time.thread_time()
        try:
            return self._obtain(recipe_data, artifact)
        finally:
            self.build_cpu_s += time.thread_time() - started

    def _obtain(self, recipe_data: dict[str, Any], artifact: str | None) -> BuiltVariant:
        from compiler import ArtifactUnavailable, load_artifact  # noqa: PLC0415

        recipe = Recipe.from_dict(recipe_data)
        if artifact:
            try:
                built = load_artifact(self.served.base, recipe, artifact, cache=self.cache())
            except ArtifactUnavailable as exc:
                log.warning("artifact of %s not loaded (%s); building it here", recipe.label(), exc)
                self.last_source = f"artifact unavailable ({exc}); compiled here"
            else:
                self.loads += 1
                self.last_source = f"artifact loaded in {built.report.build_s:.1f}s"
                return built
        samples = self.served.registry.reservoir.snapshot()
        built = build(
            self.served.base,
            recipe,
            calibration=samples[:CALIBRATION_INPUTS],
            example=samples[0] if samples else None,
            cache=self.cache(),
        )
        if built.report.cache == "artifact":
            self.loads += 1
            self.last_source = f"artifact loaded in {built.report.build_s:.1f}s"
        else:
            self.compiles += int(built.report.compiled)  # eager builds (quantize a copy) are cheap
            if not artifact:
                self.last_source = f"built here in {built.report.build_s:.1f}s (no artifact)"
        return built

    def load_twin(self, recipe_data: dict[str, Any], digest: str) -> BuiltVariant:
        """The profiling twin a worker built for a variant (:mod:`~pgc_daemon.agent.twins`),
        loaded; never compiled here. Raises ``ArtifactUnavailable`` when it cannot be."""
        from compiler import load_artifact  # noqa: PLC0415

        started = time.thread_time()
        try:
            return load_artifact(self.served.base, Recipe.from_dict(recipe_data), digest,
                                 cache=self.cache(), profiled=True)
        finally:
            self.build_cpu_s += time.thread_time() - started

    def warm_examples(self) -> list[Any]:
        """Live inputs to warm a variant up with, one per shape seen."""
        samples = self.served.registry.reservoir.snapshot()
        if not samples:
            raise DeployFailed("no live inputs captured yet to warm up and verify with")
        by_shape: dict[str, Any] = {}
        for args, kwargs in samples:
            by_shape.setdefault(shape_key(args, kwargs), (args, kwargs))
        return list(by_shape.values())[:WARM_SHAPES]

    def references_stale(self) -> bool:
        reservoir = self.served.registry.reservoir
        return self._refs is None or (
            self._refs[0] != reservoir.version and time.monotonic() - self._refs[1] > REFS_MAX_AGE_S
        )

    def prepare_references(self) -> None:
        """Compute the verification set's fp32 outputs if they are missing or stale. The
        swapper also calls this while idle, once enough live inputs exist, so that the first
        deployment does not wait for it (30 s of yielding fp32 forwards on a busy 2-core
        machine)."""
        if not self.references_stale():
            return
        served, reservoir = self.served, self.served.registry.reservoir
        samples = reservoir.snapshot()[:VERIFY_INPUTS]
        with torch.inference_mode(), background_reference(served.serving_now):
            refs = [served.base(*a, **k) for a, k in samples]
        self._refs = (reservoir.version, time.monotonic(), samples, refs)

    def verify(self, module: torch.nn.Module, min_fidelity: float) -> float:
        """Fidelity of ``module`` against the base on live inputs. The verification set (the
        inputs and the base's outputs) is kept for a while (``REFS_MAX_AGE_S``); a module
        already scored on the same set (one kept warm, deployed again) is not run again: the
        same module on the same inputs gives the same outputs."""
        self.prepare_references()
        assert self._refs is not None
        _, taken_at, samples, refs = self._refs
        metric = self.served.registry.metric or "sqnr"
        known = self._scores.get(module)
        if known is not None and known[0] == taken_at:
            score = known[1]
        else:
            with torch.inference_mode():
                outs = [module(*a, **k) for a, k in samples]
            score = fidelity(metric, refs, outs)
            self._scores[module] = (taken_at, score)
        if score < min_fidelity:
            raise DeployFailed(
                f"verification failed: {metric} fidelity {score:.4f} < required {min_fidelity:.4f}"
            )
        return score
