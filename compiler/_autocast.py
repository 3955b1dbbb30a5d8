"""A backend's ``autocast``: the model run under CPU autocast, so what a recipe's precisions
leave float (attention's matmuls, the glue between int8 kernels) computes in bf16 where
autocast's op lists say so.

``torch.compile`` traces through the context, and Inductor lowers a pt2e int8 graph under it
to int8 kernels with bf16 between them (its int8-mixed-bf16 patterns). A package is exported
and compiled *inside* the context instead (:func:`context_of`; the wrapper then enters none of
its own): export records an autocast entered in ``forward`` as one higher-order op, whose
nodes lose the module paths the kernel map attributes time by, while an outer context leaves
every node where it was and the package compile inserts the casts.

Measured on a 2-core Xeon with AMX (``bench/variants.py``, MiniLM, all linears int8 static as
one package, cosine 0.9936 against 0.9933 without): 4.97x fp32 eager at batch 1 through
max-autotune against 4.10x without autocast, 3.91x against 3.64x through the default mode.
On an AVX-512-BF16 EPYC without AMX it ran 0.96x, which is why the search offers it only
where the CPU has AMX.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

DTYPES = {"bf16": torch.bfloat16}
#: The wrapper's attribute for the module it runs: layer paths in a graph exported through the
#: wrapper start with it, and :func:`layer_path` takes it off again.
INNER = "pgc_autocast_inner"


class Autocast(nn.Module):
    """``module`` called under CPU autocast in ``dtype`` (a word of :data:`DTYPES`); floating
    outputs in that dtype come back as float32, so callers see the dtypes they saw before."""

    def __init__(self, module: nn.Module, dtype: str) -> None:
        super().__init__()
        setattr(self, INNER, module)
        self.dtype = DTYPES[dtype]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = getattr(self, INNER)
        if entered(self.dtype):  # exported inside :meth:`context` (see the module docstring)
            out = inner(*args, **kwargs)
        else:
            with self.context():
                out = inner(*args, **kwargs)
        low = self.dtype
        return tree_map(
            lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype == low else x, out)


    def context(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=self.dtype)


def entered(dtype: torch.dtype) -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype


def exportable(module: nn.Module) -> nn.Module:
    """What to export for ``module`` (inside :func:`context_of`). A pt2e graph under
    :class:`Autocast` is exported as the root, with its floating outputs cast to float32 in
    the graph: called as a child, its nodes would carry the wrapper's module path only."""
    if not isinstance(module, Autocast):
        return module
    inner = getattr(module, INNER)
    if not isinstance(inner, torch.fx.GraphModule):
        return module
    graph = copy.deepcopy(inner.graph)
    out = next(n for n in reversed(graph.nodes) if n.op == "output")

    def to_float(arg: Any) -> Any:
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            return arg
        with graph.inserting_before(out):
            cast = graph.call_function(torch.ops.aten.to.dtype, (arg, torch.float32))
        cast.meta = {**arg.meta, "val": val.float()}
        return cast

    out.args = torch.fx.node.map_arg(out.args, to_float)
    return torch.fx.GraphModule(inner, graph)


def context_of(module: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """What to export and compile ``module`` inside: its autocast, if it is an
    :class:`Autocast`."""
    return module.context() if isinstance(module, Autocast) else contextlib.nullcontext()


def layer_path(path: str) -> str:
    """A module path of a graph traced through :class:`Autocast`, as the model names it."""
    if path == INNER:
        return ""
    return path.removeprefix(INNER + ".")
