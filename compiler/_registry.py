"""The transform registry: one function per recipe-part type, the way torchao registers a
handler per config type. ``compiler.build`` looks each part's type up here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "applied": dict(self.applied),
            "skipped": dict(self.skipped),
            "kernel_paths": dict(self.kernel_paths),
            "notes": list(self.notes),
            "compiled": self.compiled,
            "build_s": round(self.build_s, 3),
        }


@dataclass
class BuildContext:
    """What a transform may use besides the model: calibration inputs (live traffic), example
    inputs (for export and tracing), and the report it writes to."""

    calibration: list[Example]
    example: Example | None
    report: BuildReport


Transform = Callable[[nn.Module, Any, BuildContext], nn.Module]
_TRANSFORMS: dict[type, Transform] = {}
P = TypeVar("P")


def register_transform(part_type: type[P]) -> Callable[[Transform], Transform]:
    def deco(fn: Transform) -> Transform:
        if part_type in _TRANSFORMS:
            raise ValueError(f"a transform for {part_type.__name__} is already registered")
        _TRANSFORMS[part_type] = fn
        return fn

    return deco


def transform_for(part: Any) -> Transform:
    try:
        return _TRANSFORMS[type(part)]
    except KeyError:
        raise BuildError(f"no transform registered for {type(part).__name__}") from None


def registered_parts() -> list[type]:
    return list(_TRANSFORMS)
