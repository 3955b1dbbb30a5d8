"""Compiled variants that write into their inputs, found at build and served copies.

Inductor fuses a residual add into the int8 linear before it as an in-place sum on the
residual's buffer (oneDNN's ``sum`` post-op, and the max-autotune GEMM templates alike; torch
2.13, pt2e graphs). Where the residual is an input of the graph (a model whose ``forward`` is
``self.proj(x) + x``), a call writes its sum into the caller's tensor: the request's input
changes under the server, and a canary's second arm would run on what the first one wrote.

A build therefore calls the compiled variant on its example and compares the tensors with
copies taken before (putting back what changed); a variant that wrote them is given copies of
its inputs on every call from then on (a memory copy of the inputs; every other variant is
called as it was), and the choice is stored with a package, so a process that loads it does
the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from compiler._registry import Example

NOTE = ("writes into its inputs (Inductor's in-place residual sum on an input tensor); "
        "served copies of them")


def copies(example: Example) -> Example:
    """The example with every tensor cloned (other leaves as they are)."""
    args, kwargs = example
    out: Example = tree_map_only(torch.Tensor, torch.clone, (tuple(args), dict(kwargs)))
    return out


def call_checked(call: Callable[[tuple[Any, ...], dict[str, Any]], Any],
                 example: Example) -> tuple[Any, bool]:
    """``call(args, kwargs)`` on ``example``: its output, and whether the call changed any of
    the tensors it was given (they are put back as they were). The example's own tensors are
    passed, not copies: what Dynamo marked on them (a dynamic axis) must reach the compile."""
    before = copies(example)
    out = call(*example)
    now, _ = tree_flatten(tuple(example))
    then, _ = tree_flatten(tuple(before))
    changed = [(a, b) for a, b in zip(now, then) if isinstance(a, torch.Tensor) and not _same(a, b)]
    if changed:  # the output may be the very tensor written into: keep it before putting back
        out = tree_map_only(torch.Tensor, torch.clone, out)
        with torch.no_grad():
            for a, b in changed:
                a.copy_(b)
    return out, bool(changed)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (
        a.is_floating_point() and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


class CopiedInputs(torch.nn.Module):
    """A compiled module that writes into its inputs, called on copies of them."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = copies((args, kwargs))
        return self.inner(*args, **kwargs)
