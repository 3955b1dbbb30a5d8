"""Convolutions as one GEMM each (im2col): a ``Conv2d`` (or ``Conv1d``) becomes a linear over
its receptive fields, the input's k×k shifted views laid side by side with channels last,
times the kernel as an (out, k·k·in) matrix (a ``Conv1d`` is the case of one row).

Where this pays: convolutions over small feature maps, whose oneDNN convolution is mostly
fixed cost per call. Through Inductor the shifted views become one gather kernel and the
linear takes Inductor's own GEMM (its C++ micro-kernel templates under max-autotune, AMX
where the CPU has it), with the bias and the activation after it in the GEMM's epilogue.
Measured on the digits CNN (three 3×3 convolutions over 8×8 and 4×4 maps) at batch 1, 2
threads, a 2-core Xeon with AMX: fp32 through max-autotune 74 µs a call against 142 µs as
convolutions; under bf16 autocast 50-55 µs, and int8 static 62 µs, against ONNX Runtime
int8's 67-75 µs (and 159 µs fp32 eager). Over large feature maps the copies of every input
pixel k·k times cost more than they save: the same CNN at batch 256 ran 2.3-3.6 ms as GEMMs
against 0.83 ms int8 static as convolutions, and at batch 16 it was even at best. So a
convolution is replaced only where its GEMM has at most :data:`MAX_ROWS` rows (batch ×
output positions) on the build's example; the search measures the whole package either way.

Each replaced convolution keeps its name, and is an ``nn.Linear`` (:class:`GemmConv`), so
per-layer quantization rules, sensitivity, the kernel map and the profile treat it as the
linear it now is. It takes and returns what the convolution did (NCHW, or the channels-last
strides a channels-last input gives). Compiled (Inductor) recipes only: other backends run
the graph as it is, where the copies would not be fused away.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from compiler._registry import BuildContext, run_hooked

#: the most GEMM rows (batch × output height × width, on the build's example) a convolution
#: is replaced at. The digits CNN's first two have 64 a batch row: at batch 1 and 4 the GEMMs
#: won (fp32 under bf16 autocast 76 against 122 µs int8 static as convolutions at 4), at 16
#: they tied in bf16 and lost 1.9x in int8, at 256 they lost 3-4x
MAX_ROWS = 512


def eligible(conv: nn.Module) -> bool:
    """A plain 1-D or 2-D convolution without groups, zero-padded by a fixed amount."""
    return (type(conv) in (nn.Conv1d, nn.Conv2d) and conv.groups == 1
            and conv.padding_mode == "zeros" and conv.padding != "same")


def has_eligible_convs(model: nn.Module) -> bool:
    return any(eligible(m) for m in model.modules())


class GemmConv(nn.Linear):
    """A ``Conv2d`` or ``Conv1d`` computed as a linear over its receptive fields (see the
    module doc); a ``Conv1d`` as a ``Conv2d`` of one row."""

    def __init__(self, conv: nn.Conv1d | nn.Conv2d) -> None:
        one_d = isinstance(conv, nn.Conv1d)
        lift = (lambda t, pad: (pad, *t)) if one_d else (lambda t, _pad: tuple(t))
        weight = conv.weight.unsqueeze(2) if one_d else conv.weight
        kh, kw = weight.shape[2:]
        super().__init__(conv.in_channels * kh * kw, conv.out_channels,
                         bias=conv.bias is not None, device=conv.weight.device,
                         dtype=conv.weight.dtype)
        self.one_d = one_d
        with torch.no_grad():  # columns ordered (row of the kernel, column, input channel)
            self.weight.copy_(weight.permute(0, 2, 3, 1).reshape(conv.out_channels, -1))
            if self.bias is not None:
                self.bias.copy_(conv.bias)  # type: ignore[arg-type]
        padding = (0,) * (1 if one_d else 2) if conv.padding == "valid" else conv.padding
        self.kernel_size: tuple[int, int] = (kh, kw)
        self.stride: tuple[int, int] = lift(conv.stride, 1)
        self.padding: tuple[int, int] = lift(padding, 0)
        self.dilation: tuple[int, int] = lift(conv.dilation, 1)
        self.train(conv.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == (2 if self.one_d else 3):  # unbatched, as the convolution takes it
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if self.one_d:  # (N, C, L) as (N, C, 1, L)
            return self._gemm(x.unsqueeze(2)).squeeze(2)
        return self._gemm(x)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (
            self.kernel_size, self.stride, self.padding, self.dilation)
        _, _, h, w = x.shape
        ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        nhwc = x.permute(0, 2, 3, 1)
        if ph or pw:
            nhwc = F.pad(nhwc, (0, 0, pw, pw, ph, ph))
        views = [nhwc[:, i * dh:i * dh + (ho - 1) * sh + 1:sh, j * dw:j * dw + (wo - 1) * sw + 1:sw]
                 for i in range(kh) for j in range(kw)]
        cols = views[0] if len(views) == 1 else torch.cat(views, dim=-1)
        out = F.linear(cols, self.weight, self.bias).permute(0, 3, 1, 2)
        # what the convolution gives: NCHW for an NCHW input (a later ``view`` needs it)
        return out.contiguous() if x.is_contiguous() else out

    def extra_repr(self) -> str:
        kind = "1d" if self.one_d else "2d"
        return (f"{kind}, {self.in_features // (self.kernel_size[0] * self.kernel_size[1])}, "
                f"{self.out_features}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, as one GEMM")


_GEMM_CONV = f"{__name__}.GemmConv"
_LINEAR = f"{nn.Linear.__module__}.{nn.Linear.__qualname__}"


def as_linears(gm: torch.fx.GraphModule) -> None:
    """Name the module of the linear a :class:`GemmConv` computes ``nn.Linear`` in the
    graph's metadata, in place (its gather stays the GemmConv's). Quantizers find linears
    by their module's class, by its exact name where export keeps no source functions
    (non-strict export): without this, pt2e's X86InductorQuantizer left every such layer
    float (the digits CNN's convolutions)."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack or node.target is not torch.ops.aten.linear.default:
            continue
        key = next(reversed(stack))
        fqn, cls = stack[key]
        if cls == _GEMM_CONV or cls is GemmConv:
            stack[key] = (fqn, _LINEAR)


def convs_as_gemm(model: nn.Module, ctx: BuildContext) -> nn.Module:
    """Replace every eligible convolution of ``model`` in place; the report says which."""
    recipe = ctx.recipe
    if recipe is not None and recipe.backend.kind != "inductor":
        ctx.report.notes.append(
            f"fusion: convolutions left as they are ({recipe.backend.kind} runs the graph as is)")
        return model
    rows = _rows(model, ctx)
    replaced, large = 0, 0
    for name, parent in list(model.named_modules()):
        for leaf, child in list(parent.named_children()):
            full = f"{name}.{leaf}" if name else leaf
            if not eligible(child):
                continue
            if rows.get(full, 0) > MAX_ROWS:
                large += 1
                continue
            setattr(parent, leaf, GemmConv(child))  # type: ignore[arg-type]
            ctx.report.applied[full] = "convolution as one GEMM (im2col)"
            replaced += 1
    tail = f"; {large} over {MAX_ROWS} rows left as convolutions" if large else ""
    ctx.report.notes.append(f"fusion: {replaced} convolution(s) run as one GEMM each{tail}")
    return model


def _rows(model: nn.Module, ctx: BuildContext) -> dict[str, int]:
    """The GEMM rows each eligible convolution would have on the build's example (none
    without an example: every one is replaced)."""
    example = ctx.first_input()
    if example is None:
        return {}
    rows: dict[str, int] = {}
    handles = []
    for name, mod in model.named_modules():
        if eligible(mod):

            def hook(m: nn.Module, _args: object, out: torch.Tensor, name: str = name) -> None:
                rows[name] = max(rows.get(name, 0), out.numel() // m.out_channels)

            handles.append(mod.register_forward_hook(hook))
    run_hooked(model, example, handles)
    return rows
