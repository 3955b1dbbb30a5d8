"""Backend: eager, or Inductor through ``torch.compile``.

Compiled variants are built with weight freezing (constant folding and prepacked weights),
which is what makes int8 fast on CPU; it is passed per compile, never set globally, and it
needs inference mode, which is how pgc calls every variant. Shapes are static
(``dynamic=False``): serving sees few shapes, and shape buckets keep it that way.
"""

from __future__ import annotations

import torch
from torch import nn

from compiler._registry import BuildContext, register_transform
from compiler.recipe import Backend


def compile_options(part: Backend) -> dict[str, object]:
    options: dict[str, object] = {"freezing": True}
    if part.mode == "max-autotune":
        from torch._inductor import list_mode_options

        options.update(list_mode_options("max-autotune"))
    return options


@register_transform(Backend)
def apply_backend(model: nn.Module, part: Backend, ctx: BuildContext) -> nn.Module:
    if part.kind == "eager":
        return model
    ctx.report.compiled = True
    ctx.report.notes.append(f"torch.compile inductor ({part.mode}, freezing, static shapes)")
    return torch.compile(model, dynamic=False, options=compile_options(part))  # type: ignore[return-value]
