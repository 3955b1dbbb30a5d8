"""Fusion: fold BatchNorm into convolutions, run conv+ReLU / linear+activation as one
kernel, sibling linears as one GEMM (:mod:`compiler._siblings`), and convolutions as one GEMM
each (:mod:`compiler._conv_gemm`).

Which module feeds which is read from ``nn.Sequential`` order, or from an FX trace of the
parent module with its direct children kept as leaves; a pair is fused only when the first
module's output goes to the second alone and the second module is called once. Names of the
remaining modules never change (a folded BatchNorm becomes ``nn.Identity`` in place), so
per-layer rules and profiles still match.

Kernel path, per site: with the Inductor backend the pair is left to Inductor, which folds BN
when freezing and fuses pointwise epilogues into its own kernels; a layer that the recipe
quantizes keeps its quantized kernel. In eager mode on x86, oneDNN's fused pointwise kernels
(``mkldnn._convolution_pointwise`` / ``_linear_pointwise``) and ATen's op-then-activation
are timed on the real input shape and the faster is kept (``compiler._measure``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.fx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from compiler import _measure
from compiler._conv_gemm import convs_as_gemm
from compiler._registry import BuildContext, register_transform, run_hooked
from compiler._siblings import fuse_siblings
from compiler.parts import Fusion

_ACTS: dict[type, tuple[str, str]] = {
    nn.ReLU: ("relu", ""),
    nn.GELU: ("gelu", "none"),
    nn.SiLU: ("swish", ""),
    nn.Tanh: ("tanh", ""),
    nn.Sigmoid: ("sigmoid", ""),
}


def _act_of(mod: nn.Module) -> tuple[str, str] | None:
    """The oneDNN post-op name of an activation module (also transformers' GELU modules)."""
    if isinstance(mod, nn.GELU):
        return ("gelu", "tanh" if mod.approximate == "tanh" else "none")
    for kind, attr in _ACTS.items():
        if isinstance(mod, kind):
            return attr
    fn = getattr(mod, "act", None)
    if type(mod).__name__ == "GELUActivation" and fn is nn.functional.gelu:
        return ("gelu", "none")
    return None


def _apply_act(y: torch.Tensor, attr: str, algorithm: str) -> torch.Tensor:
    if attr == "relu":
        return torch.relu_(y)
    if attr == "gelu":
        return nn.functional.gelu(y, approximate="tanh" if algorithm == "tanh" else "none")
    if attr == "swish":
        return nn.functional.silu(y)
    if attr == "tanh":
        return torch.tanh(y)
    return torch.sigmoid(y)


class FusedConv2d(nn.Conv2d):
    """A Conv2d that applies its activation in the same call (one oneDNN kernel when
    ``kernel == "onednn"``). Same parameters and name as the convolution it replaces."""

    act: str = "relu"
    algorithm: str = ""
    kernel: str = "aten"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "onednn" and x.dtype == torch.float32 and not x.requires_grad:
            return torch.ops.mkldnn._convolution_pointwise(
                x, self.weight, self.bias, list(self.padding), list(self.stride),
                list(self.dilation), self.groups, self.act, [], self.algorithm,
            )
        return _apply_act(super().forward(x), self.act, self.algorithm)


class FusedLinear(nn.Linear):
    """A Linear that applies its activation in the same call (see :class:`FusedConv2d`)."""

    act: str = "relu"
    algorithm: str = ""
    kernel: str = "aten"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "onednn" and x.dtype == torch.float32 and not x.requires_grad:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.weight, self.bias, self.act, [], self.algorithm or ""
            )
        return _apply_act(super().forward(x), self.act, self.algorithm)


def _retype(mod: nn.Module, cls: type, act: tuple[str, str]) -> nn.Module:
    mod.__class__ = cls
    mod.act, mod.algorithm = act  # type: ignore[assignment]
    return mod


class _ChildTracer(torch.fx.Tracer):
    """Traces a module's own forward, keeping its direct children as leaves."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return "." not in qualname


def _pairs(parent: nn.Module) -> Iterator[tuple[str, str]]:
    """(producer, consumer) names of direct children where the producer's output feeds only
    the consumer, skipping ``nn.Identity`` in between."""
    children = dict(parent.named_children())
    if isinstance(parent, nn.Sequential):
        names = [n for n, m in children.items() if not isinstance(m, nn.Identity)]
        yield from zip(names, names[1:])
        return
    try:
        graph = _ChildTracer().trace(parent)
    except Exception:  # noqa: BLE001 - untraceable forward: no pairs found here
        return
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        nxt = node
        while True:
            users = list(nxt.users)
            if len(users) != 1 or users[0].op != "call_module" or len(users[0].args) != 1:
                break
            nxt = users[0]
            if not isinstance(children.get(nxt.target), nn.Identity):
                if calls[nxt.target] == 1:
                    yield node.target, nxt.target
                break


def _parents(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, mod in list(model.named_modules()):
        if any(True for _ in mod.children()):
            yield name, mod


def _full(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _inputs_of(model: nn.Module, names: list[str], ctx: BuildContext) -> dict[str, torch.Tensor]:
    """The first input each named module sees on the example (for timing kernels on it)."""
    example = ctx.first_input()
    if example is None or not names:
        return {}
    mods = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:

        def hook(_m: nn.Module, args: Any, name: str = name) -> None:
            if name not in seen and args and torch.is_tensor(args[0]):
                seen[name] = args[0].detach()

        handles.append(mods[name].register_forward_pre_hook(hook))
    run_hooked(model, example, handles)
    return seen


def _quantized_later(name: str, ctx: BuildContext) -> bool:
    recipe = ctx.recipe
    if recipe is None:
        return False
    return not recipe.quantization.choice_for(name)[0].is_identity


def _choose_kernel(mod: nn.Module, x: torch.Tensor | None, what: str) -> tuple[str, str]:
    """Time the fused oneDNN kernel against ATen on ``x``; the faster and why."""
    if x is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return "aten", "ATen op + activation (no example input of fp32 on CPU to time on)"
    if not torch.backends.mkldnn.is_available():
        return "aten", "ATen op + activation (no oneDNN in this torch build)"
    weight = cast(torch.Tensor, mod.weight)
    shape = f"{what} x{tuple(x.shape)} w{tuple(weight.shape)} {getattr(mod, 'stride', '')}"
    mod.kernel = "onednn"  # type: ignore[assignment]
    fused = lambda: mod(x)
    kernel_fused = "onednn"
    try:
        fused()
    except RuntimeError:
        mod.kernel = "aten"  # type: ignore[assignment]
        return "aten", "ATen op + activation (oneDNN fused kernel refused this layer)"

    def aten() -> Any:
        mod.kernel = "aten"  # type: ignore[assignment]
        return mod(x)

    def onednn() -> Any:
        mod.kernel = kernel_fused  # type: ignore[assignment]
        return mod(x)

    best, ms = _measure.choose(shape, {"aten": aten, "onednn": onednn})
    mod.kernel = best  # type: ignore[assignment]
    label = "oneDNN fused kernel" if best == "onednn" else "ATen op + activation"
    return best, f"{label} (measured {ms['onednn']:.3f} ms oneDNN vs {ms['aten']:.3f} ms ATen)"


@register_transform(Fusion)
def fuse(model: nn.Module, part: Fusion, ctx: BuildContext) -> nn.Module:
    if part.is_identity:
        return model
    report = ctx.report
    if part.linear_siblings:
        model = fuse_siblings(model, ctx)
    folded = 0
    if part.conv_bn:
        for prefix, parent in _parents(model):
            children = dict(parent.named_children())
            for a, b in list(_pairs(parent)):
                conv, bn = children.get(a), children.get(b)
                if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                    if bn.track_running_stats and bn.running_mean is not None:
                        setattr(parent, a, fuse_conv_bn_eval(conv.eval(), bn.eval()))
                        setattr(parent, b, nn.Identity())
                        report.applied[_full(prefix, b)] = f"folded into {_full(prefix, a)}"
                        folded += 1
        report.notes.append(f"fusion: {folded} BatchNorm(s) folded into convolutions")
    if part.conv_gemm:  # after the folding: a folded convolution is one GEMM with its BN
        model = convs_as_gemm(model, ctx)

    recipe = ctx.recipe
    compiled = recipe is not None and recipe.backend.kind != "eager"
    sites: list[tuple[nn.Module, str, str, str, tuple[str, str], type]] = []
    for prefix, parent in _parents(model):
        children = dict(parent.named_children())
        for a, b in list(_pairs(parent)):
            first, second = children.get(a), children.get(b)
            act = _act_of(second) if second is not None else None
            if act is None:
                continue
            if part.conv_bn_relu and type(first) is nn.Conv2d and act[0] == "relu":
                sites.append((parent, prefix, a, b, act, FusedConv2d))
            elif part.linear_act and type(first) is nn.Linear:
                sites.append((parent, prefix, a, b, act, FusedLinear))
    names = [_full(prefix, a) for _, prefix, a, _, _, _ in sites]
    inputs = {} if compiled else _inputs_of(model, names, ctx)
    for parent, prefix, a, b, act, cls in sites:
        name = _full(prefix, a)
        what = "conv+relu" if cls is FusedConv2d else f"linear+{act[0]}"
        if compiled:
            report.kernel_paths.setdefault(
                name, f"{what}: left to Inductor (fuses the activation into its kernel)"
            )
            continue
        if _quantized_later(name, ctx):
            report.skip(_full(prefix, b), f"{name} is quantized; its int8 kernel runs it")
            continue
        fused = _retype(getattr(parent, a), cls, act)
        setattr(parent, b, nn.Identity())
        _, why = _choose_kernel(fused, inputs.get(name), what)
        report.applied[name] = f"fused {what}"
        report.kernel_paths[name] = why
    return model
