"""Per-layer precision: int8 (torchao) and fp16/bf16 casts, layer by layer.

int8 dynamic and weight-only use torchao's tensor-subclass configs, applied with
``quantize_`` and a filter on qualified names, so module names stay what the profile saw.
torchao is told not to touch global Inductor settings (``set_inductor_config=False``): the
serving process belongs to the user; the backend transform sets what it needs per compile.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from compiler._errors import BuildError
from compiler._registry import BuildContext, register_transform
from compiler.recipe import DEFAULT_KEY, LayerQuant, Quantization

log = logging.getLogger("pgc.compiler")

INT8_MODULES = (nn.Linear,)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _torchao() -> Any:
    """Import torchao quietly: it logs missing GPU extensions on CPU-only machines."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.quantization as q
            from torchao.quantization import granularity
        return q, granularity
    finally:
        quiet.setLevel(level)


def _int8_config(choice: LayerQuant) -> Any:
    q, gran = _torchao()
    g = gran.PerRow() if choice.granularity == "per_channel" else gran.PerTensor()
    if choice.scheme == "dynamic":
        return q.Int8DynamicActivationInt8WeightConfig(granularity=g, set_inductor_config=False)
    if choice.scheme == "weight_only":
        return q.Int8WeightOnlyConfig(granularity=g, set_inductor_config=False)
    raise BuildError(f"int8 scheme {choice.scheme!r} is not built by the torchao path")


def _cast_hooks(module: nn.Module, dtype: torch.dtype) -> None:
    """Run ``module`` in ``dtype``: cast its parameters, cast floating inputs in and floating
    outputs back to the dtype they came in with, so neighbours see no change of type."""
    module.to(dtype)

    def pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first = next((a for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
        mod._pgc_in_dtype = first.dtype if first is not None else torch.float32  # type: ignore[assignment]
        cast = tuple(
            a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args
        )
        return cast, kwargs

    def post(mod: nn.Module, _args: Any, _kwargs: Any, out: Any) -> Any:
        back = getattr(mod, "_pgc_in_dtype", torch.float32)
        if torch.is_tensor(out) and out.is_floating_point():
            return out.to(back)
        return out

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


@register_transform(Quantization)
def quantize(model: nn.Module, part: Quantization, ctx: BuildContext) -> nn.Module:
    if part.is_identity:
        return model
    groups: dict[LayerQuant, list[str]] = defaultdict(list)
    for name, mod in model.named_modules():
        if not name or any(True for _ in mod.children()):
            continue  # containers: their leaves decide
        choice, key = part.choice_for(name)
        if choice.is_identity:
            continue
        if choice.precision == "int8":
            if not isinstance(mod, INT8_MODULES):
                if key not in (None, DEFAULT_KEY):  # a rule named it: say why nothing happened
                    ctx.report.skipped[name] = (
                        f"{type(mod).__name__} has no int8 path here (nn.Linear only)"
                    )
                continue
            if choice.scheme == "static":
                ctx.report.skipped[name] = "static int8 needs the pt2e path (not in this build)"
                continue
        elif not any(p.is_floating_point() for p in mod.parameters(recurse=False)):
            continue
        groups[choice].append(name)

    q, _ = _torchao()
    for choice, names in groups.items():
        selected = frozenset(names)
        if choice.precision in _DTYPES:
            modules = dict(model.named_modules())
            for name in names:
                _cast_hooks(modules[name], _DTYPES[choice.precision])
                ctx.report.applied[name] = choice.label()
                ctx.report.kernel_paths[name] = f"aten {choice.precision}"
            continue
        config = _int8_config(choice)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q.quantize_(model, config, filter_fn=lambda _m, fqn: fqn in selected)
        for name in names:
            ctx.report.applied[name] = choice.label()
            ctx.report.kernel_paths[name] = f"torchao {type(config).__name__}"
    return model
