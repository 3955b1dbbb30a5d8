"""``build(model, recipe)``: apply a recipe's parts in order to a copy of the model."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compiler import _backend, _buckets, _fusion, _kernels, _layout, _quant  # noqa: F401
from compiler._errors import BuildError, CompilerError
from compiler._registry import BuildContext, BuildReport, Example, analysis_for, transform_for
from compiler.cache import CacheKey, CompileCache, cache_key
from compiler.recipe import Recipe

_AFTER_QUANTIZATION = Recipe.APPLY_ORDER[Recipe.APPLY_ORDER.index("quantization") + 1 :]


@dataclass
class BuiltVariant:
    """A built variant: the module to serve, the recipe it came from, and what was done."""

    module: nn.Module
    recipe: Recipe
    report: BuildReport

    @property
    def hookable(self) -> bool:
        """Whether per-layer forward hooks see this module's layers. Compiled modules inline
        their layers (and adding hooks would force a recompile), so they are profiled end to
        end only."""
        return not self.report.compiled


def build(
    model: nn.Module,
    recipe: Recipe,
    *,
    calibration: Sequence[Example] = (),
    example: Example | None = None,
    cache: CompileCache | None = None,
) -> BuiltVariant:
    """Build ``recipe`` on a deep copy of ``model`` (the original is never changed).

    ``calibration`` holds real inputs for parts that calibrate (static int8); ``example`` is
    one input for parts that trace (the first calibration input when not given). With an
    input to run, a compiled variant is compiled here and the report names the kernels it
    runs; without one, the first call compiles, so callers warm a variant before serving it
    (see :func:`warm`). With a ``cache``, the same key (see ``compiler.cache``) returns the
    variant built before in this process, or rebuilds it from the quantized graph saved on
    disk by another process.
    """
    key: CacheKey | None = None
    if cache is not None:
        key = cache_key(model, recipe, calibration)
        hit = cache.get(key)
        if hit is not None:  # the very same compiled module; a report of its own
            report = dataclasses.replace(copy.deepcopy(hit.report), cache="hit")
            return BuiltVariant(module=hit.module, recipe=hit.recipe, report=report)
    started = time.perf_counter()
    report = BuildReport()
    ctx = BuildContext(
        calibration=list(calibration), example=example, report=report, recipe=recipe
    )
    try:
        with torch.no_grad(), (cache.inductor_dir() if cache is not None else contextlib.nullcontext()):
            loaded = cache.load(key) if cache is not None and key is not None else None
            if loaded is not None:
                module, meta = loaded
                _restore(ctx, meta)
                report.cache = "hit"
                names = list(_AFTER_QUANTIZATION)
            else:
                module = copy.deepcopy(model).eval()
                if cache is not None:
                    cache.miss()
                    report.cache = "miss"
                names = list(Recipe.APPLY_ORDER)
                for part in recipe.parts():
                    analysis = analysis_for(part)
                    if analysis is not None:
                        analysis(module, part, ctx)
            for name in names:
                part = getattr(recipe, name)
                module = transform_for(part)(module, part, ctx)
                if name == "quantization" and cache is not None and key is not None:
                    _save(cache, key, module, ctx)
    except CompilerError:
        raise
    except Exception as exc:  # a library failed on this model: say which recipe, keep cause
        raise BuildError(f"building {recipe.label()} failed: {type(exc).__name__}: {exc}") from exc
    report.build_s = time.perf_counter() - started
    variant = BuiltVariant(module=module, recipe=recipe, report=report)
    if cache is not None and key is not None:
        cache.put(key, variant)
    return variant


def _save(cache: CompileCache, key: CacheKey, module: nn.Module, ctx: BuildContext) -> None:
    """Keep the quantized graph when it is a whole-model pt2e graph (what calibration made)."""
    if not ctx.state.get("pt2e") or not isinstance(module, torch.fx.GraphModule):
        return
    example = ctx.first_input()
    if example is None:
        return
    from compiler._pt2e import export_program

    try:
        program = export_program(module, example)
    except Exception as exc:  # noqa: BLE001 - not cached, only slower next time
        ctx.report.notes.append(f"compile cache: quantized graph not saved ({type(exc).__name__})")
        return
    token = ctx.state.get("token_leaves")
    cache.save(
        key,
        program,
        {
            "report": ctx.report.to_dict(),
            "state": {
                "pt2e": True,
                "token_leaves": sorted(token) if token is not None else None,
            },
        },
    )


def _restore(ctx: BuildContext, meta: dict[str, Any]) -> None:
    saved = meta.get("report", {})
    ctx.report.applied.update(saved.get("applied", {}))
    ctx.report.skipped.update(saved.get("skipped", {}))
    ctx.report.kernel_paths.update(
        {k: v for k, v in saved.get("kernel_paths", {}).items() if not k.startswith("<")}
    )
    ctx.report.notes.extend(n for n in saved.get("notes", []) if not n.startswith("torch.compile"))
    ctx.report.notes.append("compile cache: quantized graph loaded from disk (no calibration)")
    state = meta.get("state", {})
    ctx.state["pt2e"] = bool(state.get("pt2e"))
    if state.get("token_leaves") is not None:
        ctx.state["token_leaves"] = frozenset(state["token_leaves"])


def run(module: nn.Module, example: Example) -> object:
    args, kwargs = example
    return module(*args, **kwargs)


def warm(variant: BuiltVariant, examples: Sequence[Example], *, rounds: int = 2) -> float:
    """Call the variant on each example ``rounds`` times (compiling it if it compiles).

    Returns the seconds spent. Raises :class:`BuildError` when the variant cannot run.
    """
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for ex in examples:
                    run(variant.module, ex)
    except Exception as exc:
        raise BuildError(
            f"variant {variant.recipe.label()} failed on warm-up: {type(exc).__name__}: {exc}"
        ) from exc
    return time.perf_counter() - started
