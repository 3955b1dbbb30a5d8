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
names no module (a ResNet's shortcut, whose output goes straight into an addition) stays
``(root)``'s: its row's op type still says it is a convolution. Nodes of no
module (the input's quantization, layout reorders) are ``(root)``'s.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from compiler._openvino_nncf import producers
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
    head = node_name.split("/", 1)[0]
    if not head.startswith("__module."):
        return ""
    path = head[len("__module."):]
    while path and path not in modules:
        path = path.rpartition(".")[0]
    return path


def node_layers(compiled: Any, model: nn.Module, example: Example) -> dict[str, list[list[str]]]:
    """``{executed node: [layers]}`` for every node of ``compiled`` (an OpenVINO compiled
    model converted from ``model``), in the kernel map's shape (one call per node)."""
    modules = {name for name, _ in model.named_modules() if name}
    found: dict[str, list[str]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in _NOT_NODES:
            continue
        layers: list[str] = []
        for original in info["originalLayersNames"].astype(str).split(","):
            layer = module_path(original, modules)
            if layer and layer not in layers:
                layers.append(layer)
        found[op.get_friendly_name()] = layers
    named = {layer for layers in found.values() for layer in layers}
    weighted = {name for name, m in model.named_modules() if isinstance(m, _WEIGHTED)}
    fed = producers(model, example) if found else {}
    out: dict[str, list[list[str]]] = {}
    for node, layers in found.items():
        if layers:  # a convolution NNCF renamed, with its folded BatchNorm
            before = _unnamed_producers(layers[0], fed, weighted, named)
            named.update(before)
            layers = [*before, *layers]
        out[node] = [layers or [ROOT]]
    return out


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
