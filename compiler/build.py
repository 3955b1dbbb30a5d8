"""``build(model, recipe)``: apply a recipe's parts in order to a copy of the model."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from compiler import _backend, _quant  # noqa: F401  (register their transforms)
from compiler._errors import BuildError, CompilerError
from compiler._registry import BuildContext, BuildReport, Example, transform_for
from compiler.recipe import Recipe


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
) -> BuiltVariant:
    """Build ``recipe`` on a deep copy of ``model`` (the original is never changed).

    ``calibration`` holds real inputs for parts that calibrate (static int8); ``example`` is
    one input for parts that trace. Compilation is lazy: the first call compiles, so callers
    warm a variant before serving it (see :func:`warm`).
    """
    started = time.perf_counter()
    report = BuildReport()
    ctx = BuildContext(calibration=list(calibration), example=example, report=report)
    module = copy.deepcopy(model).eval()
    try:
        with torch.no_grad():
            for part in recipe.parts():
                module = transform_for(part)(module, part, ctx)
    except CompilerError:
        raise
    except Exception as exc:  # a library failed on this model: say which recipe, keep cause
        raise BuildError(f"building {recipe.label()} failed: {type(exc).__name__}: {exc}") from exc
    report.build_s = time.perf_counter() - started
    return BuiltVariant(module=module, recipe=recipe, report=report)


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
