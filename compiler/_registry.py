"""The transform registry: one function per recipe-part type, the way torchao registers a
handler per config type. ``compiler.build`` looks each part's type up here."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compiler._errors import BuildError

Example = tuple[tuple[Any, ...], dict[str, Any]]
"""One model input: positional and keyword arguments."""


@dataclass
class BuildReport:
    """What a build did, layer by layer, and why it left anything alone."""

    applied: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    kernel_paths: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    compiled: bool = False
    build_s: float = 0.0
    cache: str = "off"
    """``hit`` (memory or disk), ``miss`` or ``off``: what the compile cache did for this build."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "applied": dict(self.applied),
            "skipped": dict(self.skipped),
            "kernel_paths": dict(self.kernel_paths),
            "notes": list(self.notes),
            "compiled": self.compiled,
            "build_s": round(self.build_s, 3),
            "cache": self.cache,
        }

    def skip(self, layer: str, why: str) -> None:
        """Record that a transform left ``layer`` as it was, and why (first reason wins)."""
        self.applied.pop(layer, None)
        self.kernel_paths.pop(layer, None)
        self.skipped.setdefault(layer, why)


@dataclass
class BuildContext:
    """What a transform may use besides the model: calibration inputs (live traffic), example
    inputs (for export and tracing), the report it writes to, the whole recipe (a transform
    may defer to a later part, as quantization does to the ONNX Runtime backend), and
    ``state``, where a transform leaves what a later one must know (e.g. that the model is now
    a pt2e graph that needs freezing when compiled)."""

    calibration: list[Example]
    example: Example | None
    report: BuildReport
    recipe: Any = None
    state: dict[str, Any] = field(default_factory=dict)

    def first_input(self) -> Example | None:
        return self.example if self.example is not None else (
            self.calibration[0] if self.calibration else None
        )


def run_hooked(model: nn.Module, example: Example, handles: Iterable[RemovableHandle]) -> None:
    """Run ``model`` once on ``example`` (inference mode) with the hooks of ``handles`` on,
    then take them off, also when the run raises: how a transform reads what the example
    makes its modules see."""
    try:
        with torch.inference_mode():
            model(*example[0], **example[1])
    finally:
        for h in handles:
            h.remove()


Transform = Callable[[nn.Module, Any, BuildContext], nn.Module]
Analysis = Callable[[nn.Module, Any, BuildContext], None]
_TRANSFORMS: dict[type, Transform] = {}
_ANALYSES: dict[type, Analysis] = {}
P = TypeVar("P")


def register_transform(part_type: type[P]) -> Callable[[Transform], Transform]:
    def deco(fn: Transform) -> Transform:
        if part_type in _TRANSFORMS:
            raise ValueError(f"a transform for {part_type.__name__} is already registered")
        _TRANSFORMS[part_type] = fn
        return fn

    return deco


def register_analysis(part_type: type[P]) -> Callable[[Analysis], Analysis]:
    """Register a look at the untouched eager model that a part needs before any part changes
    it (shape buckets probe which outputs are token-level before the model is compiled)."""

    def deco(fn: Analysis) -> Analysis:
        _ANALYSES[part_type] = fn
        return fn

    return deco


def analysis_for(part: Any) -> Analysis | None:
    return _ANALYSES.get(type(part))


def transform_for(part: Any) -> Transform:
    try:
        return _TRANSFORMS[type(part)]
    except KeyError:
        raise BuildError(f"no transform registered for {type(part).__name__}") from None


def registered_parts() -> list[type]:
    return list(_TRANSFORMS)
