"""Kernels part: put pgc's hand-written Triton kernel where the recipe asks for it.

Runs before quantization: Linear layers that the quantization part makes int8 weight-only
become :class:`compiler._triton.TritonInt8Linear` (the quantization part then leaves them
alone). Only on a CUDA model with Triton installed; ``compiler._triton`` (and Triton itself)
is imported only then, so a CPU build never loads it.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from compiler._registry import BuildContext, register_transform
from compiler.parts import Kernels


def triton_usable(model: nn.Module) -> str | None:
    """None when the Triton kernel can run this model, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (the Triton kernel is a GPU kernel)"
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "the model is not on a CUDA device"
    return None


@register_transform(Kernels)
def apply_kernels(model: nn.Module, part: Kernels, ctx: BuildContext) -> nn.Module:
    if part.is_identity:
        return model
    recipe = ctx.recipe
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod) is nn.Linear
        and recipe is not None
        and recipe.quantization.choice_for(name)[0].scheme == "weight_only"
    ]
    why = triton_usable(model)
    if why is not None:
        ctx.report.notes.append(f"kernels.linear=triton not used: {why}; default kernels kept")
        return model
    if not targets:
        ctx.report.notes.append("kernels.linear=triton: no int8 weight-only Linear layers")
        return model
    from compiler._triton import TritonInt8Linear

    handled = ctx.state.setdefault("handled", set())
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TritonInt8Linear(mod))
        handled.add(name)
        ctx.report.applied[name] = "int8-weight_only-pc"
        ctx.report.kernel_paths[name] = "pgc Triton int8 weight-only linear (fused dequant+bias)"
    return model
