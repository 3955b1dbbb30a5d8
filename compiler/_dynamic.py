"""Dynamic shapes: one compiled graph for every length along one input axis.

Variable-length text served unpadded has as many shapes as lengths. Compiled for static
shapes, each length is a compile (``torch.compile``) or a miss that runs the original model
(a package): measured on all-MiniLM-L6-v2 fp32 served unpadded, a static variant timed ~1.1x
fp32 eager. With the axis symbolic one package serves every length: at length 22 on one
thread, fp32 7.4 ms (static package 7.2, eager 16.0) and pt2e int8 static 3.2 ms (static 3.1).

A dynamic package is checked at several lengths (those of the calibration inputs and a few
made from the example), not at one: against the fp32 model its outputs must be as close as
the graph it was compiled from is (int8 kernels round differently from one length to another,
so it is not compared with that graph bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from compiler._buckets import _length as length
from compiler._buckets import pad_inputs
from compiler._registry import BuildContext, Example, register_transform
from compiler.parts import DynamicShapes

#: At most this many lengths are checked after a dynamic compile.
PROBES = 6


@register_transform(DynamicShapes)
def apply_dynamic(model: nn.Module, part: DynamicShapes, ctx: BuildContext) -> nn.Module:
    """Carried out by the backend, which compiles; this records the axis."""
    if part.is_identity:
        return model
    ctx.state["dynamic_dim"] = part.dim
    if ctx.recipe is not None and ctx.recipe.backend.kind in ("onnxruntime", "openvino"):
        ctx.report.notes.append(
            f"dynamic dim {part.dim}: the {ctx.recipe.backend.kind} graph has every axis dynamic"
        )
    return model


def _varies(t: Any, dim: int, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == n


def export_shapes(model: nn.Module, example: Example, dim: int) -> Any:
    """``dynamic_shapes`` for ``torch.export``: ``dim`` of every tensor input as long as the
    first's along it is ``Dim.DYNAMIC`` (export infers the range and that they are equal;
    it raises where the model fixes the axis)."""
    args, kwargs = example
    n = length(args, kwargs, dim)
    if n is None:
        raise ValueError(f"dynamic dim {dim}: no tensor input has that many dimensions")
    shapes = torch.export.ShapesCollection()
    for t in tree_flatten((args, kwargs))[0]:
        if _varies(t, dim, n):
            shapes[t] = {dim: torch.export.Dim.DYNAMIC}
    return shapes.dynamic_shapes(model, tuple(args), dict(kwargs))


def at_length(example: Example, dim: int, to: int, pad_value: int = 0) -> Example:
    """The example cut or padded (with ``pad_value``, by ``compiler._buckets.pad_inputs``) to
    ``to`` along ``dim``."""
    args, kwargs = example
    n = length(args, kwargs, dim)
    if n is None or to == n:
        return example
    if to > n:
        got_args, got_kwargs = pad_inputs(args, kwargs, dim, n, to, pad_value)
        return tuple(got_args), dict(got_kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    cut = [t.narrow(dim, 0, to).contiguous() if _varies(t, dim, n) else t for t in leaves]
    got_args, got_kwargs = tree_unflatten(cut, spec)
    return tuple(got_args), dict(got_kwargs)


def probes(ctx: BuildContext, dim: int, low: int, high: int | None) -> list[Example]:
    """Inputs at up to :data:`PROBES` lengths inside [low, high]: the calibration inputs'
    lengths (shortest, longest and between), and the example's at half, same and +7."""
    found: dict[int, Example] = {}
    for ex in ctx.calibration:
        n = length(*ex, dim)
        if n is not None:
            found.setdefault(n, ex)
    example = ctx.first_input()
    assert example is not None
    n = length(*example, dim)
    assert n is not None
    for want in (max(low, n // 2), n, n + 7):
        if want not in found and want >= low and (high is None or want <= high):
            found[want] = at_length(example, dim, want)
    lengths = sorted(k for k in found if k >= low and (high is None or k <= high))
    if len(lengths) > PROBES:  # keep the ends and spread the rest
        step = (len(lengths) - 1) / (PROBES - 1)
        lengths = sorted({lengths[round(i * step)] for i in range(PROBES)})
    return [found[k] for k in lengths]


def range_of(program: Any, example: Example, dim: int) -> tuple[int, int | None]:
    """The lengths an exported program accepts along ``dim`` (upper None: unbounded); raises
    when export made the axis a constant."""
    args, kwargs = example
    user = [n for n in program.graph.nodes if n.op == "placeholder"
            and n.name in set(program.graph_signature.user_inputs)]
    n = length(args, kwargs, dim)
    for node in user:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > dim:
            size = val.shape[dim]
            if isinstance(size, int):
                raise ValueError(f"export fixed dim {dim} to {size}: the model does not allow "
                                 "another length there")
            bounds = program.range_constraints.get(size.node.expr)
            if bounds is None:
                return 2, None
            upper = bounds.upper
            hi = int(upper) if upper.is_finite else None  # type: ignore[union-attr]
            return max(int(bounds.lower), 1), hi
    raise ValueError(f"dynamic dim {dim}: no input of length {n} along it")


@dataclass(frozen=True)
class DynamicMatch:
    """Which calls a dynamic package serves: those whose signature, with the dynamic axis
    left out, is ``masked`` and whose length along it is within [low, high]."""

    dim: int
    low: int
    high: int | None
    masked: tuple[Any, ...]

    def accepts(self, sig: tuple[Any, ...], args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether this package serves a call of signature ``sig``
        (``compiler._aoti.signature``)."""
        n = length(args, kwargs, self.dim)
        if n is None or n < self.low or (self.high is not None and n > self.high):
            return False
        return mask_signature(sig, self.dim, n) == self.masked

    def to_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "min": self.low, "max": self.high}


def mask_signature(sig: tuple[Any, ...], dim: int, n: int) -> tuple[Any, ...]:
    """A call's signature with ``dim`` of every input of length ``n`` along it written -1."""
    out = []
    for leaf in sig:
        if isinstance(leaf, tuple) and len(leaf) == 4 and isinstance(leaf[0], tuple) \
                and len(leaf[0]) > dim and leaf[0][dim] == n:
            leaf = (leaf[0][:dim] + (-1,) + leaf[0][dim + 1:], *leaf[1:])
        out.append(leaf)
    return tuple(out)
