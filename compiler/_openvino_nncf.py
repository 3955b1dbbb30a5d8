"""int8 on the OpenVINO backend: NNCF post-training quantization of the converted model.

Layers whose choice is int8 static or int8 dynamic are quantized by ``nncf.quantize``, which
calibrates activation scales on the build's calibration inputs (all of them, up to 32; the
example input when there are none): a dynamic choice is built as a static one, since
OpenVINO's CPU plugin runs int8 convolutions and matmuls with calibrated activation scales.
Weights are per channel or per tensor as the first int8 choice says (the default's, if any):
NNCF takes one granularity per model, so layers asking otherwise stay float, with the reason
in the report. Models with softmax attention get NNCF's transformer preset.

Every other MatMul/Convolution node goes into NNCF's ``IgnoredScope`` by name. OpenVINO names
a traced node after the module it ran in (``__module.encoder.layer.0.output.dense/
aten::linear/MatMul``); a convolution whose BatchNorm OpenVINO folded loses its name and is
found as the module whose output that BatchNorm's module took (one forward pass with hooks).
Nodes of no leaf module (attention's own matmuls) follow the default. A layer the recipe names
that no node can be matched to is reported as not honoured. fp16/bf16 and weight-only choices
are not built: the rest of the graph runs in the mode's precision. Which nodes really run
int8 is read back from the quantized graph (a ``FakeQuantize`` on their input).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compiler._openvino import Converted, default_precision, no_telemetry
from compiler._ort import _flat_inputs
from compiler._pt2e import MAX_CALIBRATION
from compiler._registry import BuildContext, Example
from compiler.parts import BackendMode
from compiler.recipe import DEFAULT_KEY, FP32, REGEX_PREFIX, Granularity, LayerQuant, Quantization

QUANT_TYPES = ("MatMul", "Convolution", "GroupConvolution")
_ATTENTION = ("ScaledDotProductAttention", "Softmax")
_PASS_THROUGH = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "AvgPool", "Convert")


def traced_path(node_name: str) -> str:
    """``__module.net.5/aten::linear/MatMul`` -> ``net.5``: the module path OpenVINO's
    converter named a node after ("" for a node it named after no module)."""
    head = node_name.split("/", 1)[0]
    return head[len("__module."):] if head.startswith("__module.") else ""


def module_of(node_name: str, leaves: set[str]) -> str:
    """The leaf module a node ran in (:func:`traced_path`, when it is a leaf), else ""."""
    head = traced_path(node_name)
    return head if head in leaves else ""


def producers(model: nn.Module, example: Example) -> dict[str, str]:
    """Leaf module -> the leaf module whose output it took as input (a BatchNorm -> its conv)."""
    made: dict[int, str] = {}
    kept: list[torch.Tensor] = []  # alive until the end, so no id is reused
    fed: dict[str, str] = {}
    handles = []
    for name, mod in model.named_modules():
        if not name or any(True for _ in mod.children()):
            continue

        def pre(_m: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            if args and torch.is_tensor(args[0]) and id(args[0]) in made:
                fed[name] = made[id(args[0])]

        def post(_m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
            if torch.is_tensor(out):
                made[id(out)] = name
                kept.append(out)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(*example[0], **example[1])
    finally:
        for h in handles:
            h.remove()
    return fed


def node_layers(ov_model: Any, model: nn.Module, example: Example) -> dict[str, list[str]]:
    """The MatMul/Convolution nodes of each leaf module ("" for nodes of none)."""
    leaves = {n for n, m in model.named_modules() if n and not any(True for _ in m.children())}
    by_layer: dict[str, list[str]] = {}
    unnamed = []
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() in QUANT_TYPES:
            layer = module_of(op.get_friendly_name(), leaves)
            if layer:
                by_layer.setdefault(layer, []).append(op.get_friendly_name())
            else:
                unnamed.append(op)
    fed = producers(model, example) if unnamed else {}
    for op in unnamed:
        targets = op.output(0).get_target_inputs()
        users = {module_of(t.get_node().get_friendly_name(), leaves) for t in targets}
        owners = {fed[u] for u in users if u in fed}
        layer = owners.pop() if len(owners) == 1 else ""
        by_layer.setdefault(layer, []).append(op.get_friendly_name())
    return by_layer


@dataclass
class Plan:
    """Which nodes NNCF quantizes, which it leaves alone, and with which weight granularity."""

    include: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    granularity: Granularity | None = None
    attention: bool = False
    """Attention's own int8 inputs are quantized too (the default is int8)."""


def plan(by_layer: dict[str, list[str]], part: Quantization, ctx: BuildContext, precision: str) -> Plan:
    default = dict(part.rules).get(DEFAULT_KEY)
    int8_default = default is not None and default.scheme in ("static", "dynamic")
    chosen: LayerQuant | None = default if int8_default else None
    out = Plan(attention=int8_default)
    for layer, nodes in by_layer.items():
        choice = part.choice_for(layer)[0] if layer else (default or FP32)
        ok = choice.precision == "int8" and choice.scheme in ("static", "dynamic")
        if choice.precision in ("bf16", "fp16", "fp8") and layer:
            ctx.report.skip(layer, f"{choice.label()}: the openvino backend runs every float layer "
                            f"in the mode's precision ({precision})")
        elif choice.scheme == "weight_only" and layer:
            ctx.report.skip(layer, "int8 weight-only is not built by the openvino backend")
        if ok:
            chosen = chosen or choice
            if choice.granularity != chosen.granularity:
                ok = False
                if layer:
                    ctx.report.skip(layer, f"{choice.label()}: NNCF quantizes a model with one weight "
                                    f"granularity ({chosen.granularity} here); kept float")
        (out.include if ok else out.ignore).extend(nodes)
        if ok and layer:
            ctx.report.applied[layer] = choice.label()
            how = "calibrated static" + (" (asked dynamic)" if choice.scheme == "dynamic" else "")
            ctx.report.kernel_paths[layer] = f"openvino int8 {how} (NNCF)"
    out.granularity = chosen.granularity if chosen is not None else None
    return out


def _unmatched(
    part: Quantization, by_layer: dict[str, list[str]], model: nn.Module, ctx: BuildContext
) -> None:
    """Layers the recipe names exactly that no OpenVINO node was matched to."""
    modules = dict(model.named_modules())
    for key, choice in part.rules:
        if key == DEFAULT_KEY or key.startswith(REGEX_PREFIX) or key in by_layer:
            continue
        if isinstance(modules.get(key), (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            ctx.report.skip(key, f"{choice.label()} not honoured: no node of the converted model "
                            "could be matched to this layer (renamed by OpenVINO, or never run)")


def _from_fake_quantize(value: Any) -> bool:
    node = value.get_node()
    for _ in range(6):
        kind = node.get_type_name()
        if kind == "FakeQuantize":
            return True
        if kind not in _PASS_THROUGH:
            return False
        node = node.input_value(0).get_node()
    return False


def int8_nodes(ov_model: Any) -> set[str]:
    """MatMul/Convolution nodes whose input is quantized (a ``FakeQuantize`` upstream)."""
    return {
        op.get_friendly_name() for op in ov_model.get_ops()
        if op.get_type_name() in QUANT_TYPES and _from_fake_quantize(op.input_value(0))
    }


@contextlib.contextmanager
def _quiet_nncf() -> Iterator[None]:
    """NNCF logs at INFO and draws progress bars on stdout; keep both out of the user's logs."""
    import nncf

    logger = logging.getLogger("nncf")
    level = logger.level
    nncf.set_log_level(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        nncf.set_log_level(level)


def quantize_nncf(
    converted: Converted, model: nn.Module, part: Quantization, ctx: BuildContext, example: Example
) -> Any:
    """The converted model with the recipe's int8 layers quantized by NNCF (or as it was, with
    the reasons in the report, when nothing is to be quantized)."""
    recipe = ctx.recipe
    f32 = recipe is not None and recipe.backend.mode is BackendMode.F32
    precision = "f32" if f32 else default_precision()
    ov_model = converted.model
    by_layer = node_layers(ov_model, model, example)
    _unmatched(part, by_layer, model, ctx)
    todo = plan(by_layer, part, ctx, precision)
    if not todo.include:
        return ov_model
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import nncf
            from nncf.quantization.advanced_parameters import (
                AdvancedQuantizationParameters,
                QuantizationParameters,
            )
    except ImportError:
        for layer in list(ctx.report.applied):
            ctx.report.skip(layer, "int8 on the openvino backend needs NNCF (`pip install pgc[openvino]`)")
        return ov_model
    inputs = list(ctx.calibration[:MAX_CALIBRATION]) or [example]
    items = []
    for ex in inputs:
        names, tensors = _flat_inputs(model, ex, "openvino")
        by_name = dict(zip(names, tensors))
        items.append([by_name[n].detach().cpu().numpy() for n in converted.input_names])
    kinds = {op.get_type_name() for op in ov_model.get_ops()}
    transformer = any(k in kinds for k in _ATTENTION)
    advanced = None
    if todo.granularity == "per_tensor":
        advanced = AdvancedQuantizationParameters(
            weights_quantization_params=QuantizationParameters(per_channel=False)
        )
    ignored = nncf.IgnoredScope(
        names=todo.ignore, types=[] if todo.attention else ["ScaledDotProductAttention"], validate=False
    )
    with _quiet_nncf(), no_telemetry(), torch.no_grad():
        quantized = nncf.quantize(
            ov_model, nncf.Dataset(items), subset_size=len(items), ignored_scope=ignored,
            model_type=nncf.ModelType.TRANSFORMER if transformer else None,
            advanced_parameters=advanced,
        )
    done = int8_nodes(quantized)
    for layer, nodes in by_layer.items():
        if layer in ctx.report.applied and not any(n in done for n in nodes):
            ctx.report.skip(layer, "NNCF left it float")
    ctx.report.notes.append(
        f"NNCF {nncf.__version__}: int8 ({todo.granularity} weights, calibrated on {len(items)} "
        f"input{'s' if len(items) > 1 else ''}{', transformer preset' if transformer else ''}) on "
        f"{len(done & set(todo.include))} of {len(todo.include) + len(todo.ignore)} MatMul/Convolution "
        f"nodes, {len(todo.ignore)} kept out by name; the rest runs in {precision}"
    )
    return quantized
