"""Layout: ``channels_last`` converts 4-D convolution weights and 4-D inputs to NHWC, the
format oneDNN (CPU) and cuDNN (GPU) convolutions run natively; ``contiguous`` leaves the model
alone. A model without 4-D convolutions is left alone too, and the report says why."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compiler._registry import BuildContext, register_transform
from compiler.parts import Layout


def _to_channels_last(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def conv(a: Any) -> Any:
        if torch.is_tensor(a) and a.dim() == 4 and a.is_floating_point():
            return a.contiguous(memory_format=torch.channels_last)
        return a

    return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}


@register_transform(Layout)
def apply_layout(model: nn.Module, part: Layout, ctx: BuildContext) -> nn.Module:
    if part.is_identity:
        return model
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        ctx.report.notes.append("layout channels_last: no 2-D convolutions, nothing to change")
        return model
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    model.register_forward_pre_hook(_to_channels_last, with_kwargs=True)
    device = next(model.parameters()).device.type
    library = "cuDNN" if device == "cuda" else "oneDNN" if torch.backends.mkldnn.is_available() else "ATen"
    for name in convs:
        ctx.report.applied.setdefault(name, "channels_last")
        ctx.report.kernel_paths.setdefault(name, f"{library} convolution, NHWC")
    return model
