"""bf16 (or fp16) layers inside an exported int8 graph: per-layer mixes of int8, bf16 and fp32.

A recipe with static int8 layers becomes one exported pt2e graph, and the x86 quantizer only
takes plain ``aten.linear``/``aten.conv2d``: a layer it is told to leave alone stays fp32.
A layer the recipe wants in bf16 is rewritten here, after ``convert_pt2e``: its weight and
bias become bf16 constants of the graph (so nothing is cast per call, and Inductor's freezing
packs them for oneDNN's bf16 kernels), its input is cast to bf16 on the way in and its output
back to the dtype it came in with on the way out, so its neighbours see no change of type.
Inductor fuses those casts into the kernels next to them. This is what an eager layer gets
from ``_quant._cast_hooks``, in the form a graph needs.
"""

from __future__ import annotations

import re

import torch

#: The float layer ops a cast applies to, and how many of their leading arguments are
#: tensors to cast (input, weight, bias).
LAYER_OPS = {
    torch.ops.aten.linear.default: 3,
    torch.ops.aten.conv2d.default: 3,
}
_TO = torch.ops.aten.to.dtype
_DEQUANT = "quantized_decomposed.dequantize_per"


def module_of(node: torch.fx.Node) -> str | None:
    """The module path an exported node came from (relative to the exported module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].")


def is_dequantized(arg: object) -> bool:
    return isinstance(arg, torch.fx.Node) and str(arg.target).startswith(_DEQUANT)


def _constant(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    dtype: torch.dtype,
    made: dict[tuple[str, torch.dtype], str],
) -> str:
    """A graph constant holding ``node``'s tensor in ``dtype`` (one per tensor and dtype)."""
    key = (str(node.target), dtype)
    if key not in made:
        value = _fetch(gm, key[0])
        name = f"_pgc_{str(dtype).removeprefix('torch.')}_{re.sub(r'[^0-9A-Za-z_]', '_', key[0])}"
        gm.register_buffer(name, value.detach().to(dtype))
        made[key] = name
    return made[key]


def _fetch(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    owner, _, attr = target.rpartition(".")
    value = getattr(gm.get_submodule(owner) if owner else gm, attr)
    if not torch.is_tensor(value):
        raise TypeError(f"{target} is not a tensor")
    return value


def _meta(new: torch.fx.Node, layer: torch.fx.Node, val: object, dtype: torch.dtype) -> None:
    """The layer's module path, and the (fake) value ``val`` in ``dtype``, on ``new``: later
    passes read both (the profile's attribution, this pass's own dtype check)."""
    if "nn_module_stack" in layer.meta:
        new.meta["nn_module_stack"] = layer.meta["nn_module_stack"]
    if torch.is_tensor(val):
        new.meta["val"] = val if val.dtype == dtype else val.to(dtype)


def cast_layers(gm: torch.fx.GraphModule, dtypes: dict[str, torch.dtype]) -> set[str]:
    """Run the float layers named in ``dtypes`` (module path → dtype) in that dtype. Layers
    that are quantized, or whose input is not a float tensor, are left alone. Returns the
    names of the layers cast."""
    done: set[str] = set()
    made: dict[tuple[str, torch.dtype], str] = {}
    graph = gm.graph
    for node in list(graph.nodes):
        n_tensors = LAYER_OPS.get(node.target) if node.op == "call_function" else None
        name = module_of(node) if n_tensors else None
        dtype = dtypes.get(name) if name is not None else None
        if dtype is None or any(is_dequantized(a) for a in node.args[:2]):
            continue
        val = getattr(node.args[0], "meta", {}).get("val")
        if val is None or not val.dtype.is_floating_point or val.dtype == dtype:
            continue
        back = val.dtype
        args = list(node.args)
        with graph.inserting_before(node):
            for i in range(min(n_tensors, len(args))):
                arg = args[i]
                if not isinstance(arg, torch.fx.Node):
                    continue
                if arg.op == "get_attr":
                    args[i] = graph.get_attr(_constant(gm, arg, dtype, made))
                else:
                    args[i] = graph.call_function(_TO, (arg, dtype))
                    _meta(args[i], node, arg.meta.get("val"), dtype)
        node.args = tuple(args)
        with graph.inserting_after(node):
            out = graph.call_function(_TO, (node, back))
        _meta(out, node, node.meta.get("val"), back)  # what the layer's readers saw before
        _meta(node, node, node.meta.get("val"), dtype)
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
        done.add(name)
    if done:
        graph.eliminate_dead_code()
        still = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
        for target, _ in made:
            if target not in still:  # the fp32 copy nothing reads any more
                owner, _, attr = target.rpartition(".")
                delattr(gm.get_submodule(owner) if owner else gm, attr)
        graph.lint()
        gm.recompile()
    return done
