"""Which layers each node of a compiled OpenVINO model computes: the map a per-layer profile of
an OpenVINO variant splits its nodes' times with (``pgc profile --recipe``; the times are
OpenVINO's own per-node counters, ``OvModule.with_counters``).

The CPU plugin fuses nodes (a convolution takes its BatchNorm, activation and requantization)
and says which original nodes each executed node was made from (its runtime ``rt_info``,
``originalLayersNames``). An original node is named after the module it ran in
(``__module.encoder.layer.0.output.dense/aten::linear/MatMul``). NNCF renames the convolutions
it quantizes (``Multiply_2634``) and folds their BatchNorms, so such a node may name only the
BatchNorm or activation after it: the modules before its first layer that no node names are
walked back, through at most one, to the convolution (or linear) they start from (one forward
pass with hooks, as ``compiler._openvino_nncf`` finds convolutions). A convolution whose node
names none of its modules (a ResNet's shortcut, whose output goes straight into an addition;
a block's second convolution, fused with the block's addition) is matched by its weight
shape to the one unnamed module that has it (inside the modules the node names, if any);
where none or several fit, the node keeps what it names (``(root)`` when nothing): its row's
op type still says it is a convolution. Nodes of no
module (the input's quantization, layout reorders) are ``(root)``'s.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from compiler._openvino_nncf import QUANT_TYPES, producers, traced_path
from compiler._registry import Example

ROOT = "(root)"
_NOT_NODES = frozenset({"Const", "Input", "Output"})
#: the modules a renamed node may be (NNCF renames the convolutions and linears it quantizes)
_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
#: the most unnamed modules walked back from a node's first layer (a BatchNorm, then its conv)
MAX_FOLDED = 2


def module_path(node_name: str, modules: set[str]) -> str:
    """``__module.net.5/aten::linear/MatMul`` -> ``net.5``: the module a traced node ran in,
    or the nearest enclosing one that is a module ("" when none is)."""
    path = traced_path(node_name)
    while path and path not in modules:
        path = path.rpartition(".")[0]
    return path


def node_layers(compiled: Any, model: nn.Module, example: Example,
                ov_model: Any = None) -> dict[str, list[list[str]]]:
    """``{executed node: [layers]}`` for every node of ``compiled`` (an OpenVINO compiled
    model converted from ``model``), in the kernel map's shape (one call per node).
    ``ov_model`` (the model ``compiled`` was compiled from) gives the weight shapes a
    convolution whose node names none of its modules is matched by (:func:`_by_weights`)."""
    modules = dict(model.named_modules())
    names = set(modules) - {""}
    found: dict[str, list[str]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in _NOT_NODES:
            continue
        layers: list[str] = []
        for original in info["originalLayersNames"].astype(str).split(","):
            layer = module_path(original, names)
            if layer and layer not in layers:
                layers.append(layer)
        found[op.get_friendly_name()] = layers
    named = {layer for layers in found.values() for layer in layers}
    weighted = {name for name, m in modules.items() if isinstance(m, _WEIGHTED)}
    fed = producers(model, example) if found else {}
    for node, layers in found.items():
        if layers:  # a convolution NNCF renamed, with its folded BatchNorm
            before = _unnamed_producers(layers[0], fed, weighted, named)
            named.update(before)
            found[node] = [*before, *layers]
    if ov_model is not None:
        _by_weights(found, _weight_shapes(ov_model), modules, weighted, named, fed)
    return {node: [layers or [ROOT]] for node, layers in found.items()}


def _weight_shapes(ov_model: Any) -> dict[str, tuple[int, ...]]:
    """The weight shape of every convolution and matmul node, by name."""
    out = {}
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() in QUANT_TYPES and op.get_input_size() > 1:
            shape = op.input_value(1).get_partial_shape()
            if shape.is_static:
                out[op.get_friendly_name()] = tuple(d.get_length() for d in shape)
    return out


def _by_weights(found: dict[str, list[str]], shapes: dict[str, tuple[int, ...]],
                modules: dict[str, nn.Module], weighted: set[str], named: set[str],
                fed: dict[str, str]) -> None:
    """A node with weights that names no convolution or linear (a ResNet's shortcut, whose
    output goes straight into an addition; a block's second convolution, fused with the
    block's addition) gets the one unnamed module with its weight shape, inside the modules
    the node names if it names any, and that module's folded BatchNorm after it. Where two
    modules fit, the node keeps what it names."""
    for node, layers in found.items():
        shape = shapes.get(node)
        if shape is None or any(layer in weighted for layer in layers):
            continue
        fits = [n for n in sorted(weighted - named)
                if tuple(modules[n].weight.shape) == shape  # type: ignore[union-attr]
                and (not layers or any(n.startswith(f"{layer}.") for layer in layers))]
        if len(fits) != 1:
            continue
        after = [k for k, v in fed.items() if v == fits[0] and k not in named][:1]
        named.update((fits[0], *after))
        found[node] = [fits[0], *after, *layers]


def _unnamed_producers(layer: str, fed: dict[str, str], weighted: set[str],
                       named: set[str]) -> list[str]:
    """The modules before ``layer`` that no node names, back to a convolution or linear
    (``[conv, batchnorm]`` before an activation), or none when the chain does not reach one
    within :data:`MAX_FOLDED` steps."""
    chain: list[str] = []
    while len(chain) < MAX_FOLDED and (prev := fed.get(layer)) is not None and prev not in named:
        chain.insert(0, prev)
        if prev in weighted:
            return chain
        layer = prev
    return []
