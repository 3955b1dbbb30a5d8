"""Per-layer precision: int8 (torchao or pt2e), fp8 (torchao, on GPUs with float8 tensor
cores) and fp16/bf16 casts, layer by layer.

int8 dynamic and weight-only use torchao's tensor-subclass configs, applied with
``quantize_`` and a filter on qualified names, so module names stay what the profile saw.
A recipe with static int8 layers goes through pt2e (``_pt2e``): the model is exported and
becomes a graph, and its dynamic int8 layers join the static ones in that graph.
torchao is told not to touch global Inductor settings (``set_inductor_config=False``): the
serving process belongs to the user; the backend transform sets what it needs per compile.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from compiler._errors import BuildError
from compiler._pt2e import PT2E_MODULES as STATIC_MODULES
from compiler._pt2e import quantize_pt2e
from compiler._registry import BuildContext, register_transform
from compiler.hardware import FP8_CAPABILITY, probe
from compiler.parts import BackendMode
from compiler.recipe import DEFAULT_KEY, LayerQuant, Quantization, Recipe

log = logging.getLogger("pgc.compiler")

#: Inductor's max-autotune benchmarks its C++ GEMM template on made-up inputs, and for a
#: dynamically quantized linear those include the activation's scale and zero point: on
#: all-MiniLM-L6-v2 (torch 2.13, 2-core AVX-512 EPYC) int8 dynamic per-channel ended the
#: process with a segfault, per-tensor with "corrupted double-linked list", padded or not.
#: Refused before anything is built, so a search trial fails in a moment instead of taking
#: its worker down; the default mode builds the same layers through oneDNN.
MAX_AUTOTUNE_DYNAMIC = (
    "int8 dynamic layers are not built through max-autotune: its GEMM autotuning crashes the "
    "process on dynamically quantized linears (torch 2.13); the inductor backend builds them"
)



def refused(recipe: Recipe, model: nn.Module) -> str | None:
    """Why :func:`~compiler.build` refuses ``recipe`` for ``model`` before building anything,
    or None: a search skips such a recipe without spending a trial on it (5 of 12 trials of
    one search on a transformer went to max-autotune recipes with an int8 dynamic layer)."""
    if recipe.backend.mode != BackendMode.MAX_AUTOTUNE or recipe.backend.kind != "inductor":
        return None
    quant = recipe.quantization
    read = _read_by_parent(model)
    for name, mod in model.named_modules():
        if isinstance(mod, INT8_MODULES) and name not in read:
            choice = quant.choice_for(name)[0]
            if choice.precision == "int8" and choice.scheme == "dynamic":
                return MAX_AUTOTUNE_DYNAMIC
    return None


def _read_by_parent(model: nn.Module) -> set[str]:
    """Children of ``nn.MultiheadAttention``: it passes ``out_proj``'s weight to its functional
    form and never calls it, so cast hooks never fire (a bf16 weight met fp32 activations and
    the build failed) and its matmul follows the attention's own (int8 under a static
    default): they get no layer choice of their own."""
    return {f"{p}.{n}" if p else n for p, m in model.named_modules()
            if isinstance(m, nn.MultiheadAttention) for n, _ in m.named_children()}


INT8_MODULES = (nn.Linear,)
"""Modules with an int8 dynamic / weight-only path (torchao)."""
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


def fp8_unusable(model: nn.Module) -> str | None:
    """None when float8 layers can run on this model's device, else why not."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        where = param.device.type if param is not None else "no parameters"
        return f"fp8 needs a CUDA GPU of compute capability 8.9 or newer; the model is on {where}"
    cap = torch.cuda.get_device_capability(param.device)
    if cap < FP8_CAPABILITY:
        return (f"fp8 needs compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(param.device)} has {cap[0]}.{cap[1]}")
    return None


def _fp8_config() -> Any:
    q, gran = _torchao()
    return q.Float8DynamicActivationFloat8WeightConfig(granularity=gran.PerRow(),
                                                       set_inductor_config=False)


def _int8_config(choice: LayerQuant) -> Any:
    q, gran = _torchao()
    g = gran.PerRow() if choice.granularity == "per_channel" else gran.PerTensor()
    if choice.scheme == "dynamic":
        return q.Int8DynamicActivationInt8WeightConfig(granularity=g, set_inductor_config=False)
    if choice.scheme == "weight_only":
        return q.Int8WeightOnlyConfig(granularity=g, set_inductor_config=False)
    raise BuildError(f"int8 scheme {choice.scheme!r} is not built by the torchao path")  # pragma: no cover


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


def plan_layers(
    model: nn.Module, part: Quantization, ctx: BuildContext
) -> tuple[dict[str, LayerQuant], dict[str, str]]:
    """Each leaf module's choice where it is not fp32 and the module can take it, and the
    leaves a rule names explicitly that cannot (with why). Leaves only ``_default`` reaches and
    cannot take it are left alone silently: the default means "wherever it applies"."""
    plan: dict[str, LayerQuant] = {}
    cannot: dict[str, str] = {}
    handled = ctx.state.get("handled", set())
    read_by_parent = _read_by_parent(model)
    for name, mod in model.named_modules():
        if not name or any(True for _ in mod.children()) or name in handled:
            continue  # containers: their leaves decide; handled: an earlier part took it
        choice, key = part.choice_for(name)
        if choice.is_identity:
            continue
        if name in read_by_parent:
            if key not in (None, DEFAULT_KEY):
                cannot[name] = ("nn.MultiheadAttention reads its weight directly and never "
                                "calls it: no layer choice of its own")
            continue
        if choice.precision == "fp8" and type(mod) is not nn.Linear:
            if key not in (None, DEFAULT_KEY):
                cannot[name] = f"{type(mod).__name__} has no fp8 path (Linear only)"
            continue
        if choice.precision == "int8":
            kinds = STATIC_MODULES if choice.scheme == "static" else INT8_MODULES
            if not isinstance(mod, kinds):
                if key not in (None, DEFAULT_KEY):
                    allowed = " and ".join(k.__name__ for k in kinds)
                    cannot[name] = (
                        f"{type(mod).__name__} has no int8 {choice.scheme} path ({allowed} only)"
                    )
                continue
        elif not any(p.is_floating_point() for p in mod.parameters(recurse=False)):
            continue
        plan[name] = choice
    return plan, cannot


@register_transform(Quantization)
def quantize(model: nn.Module, part: Quantization, ctx: BuildContext) -> nn.Module:
    if part.is_identity:
        return model
    recipe = ctx.recipe
    if recipe is not None and recipe.backend.kind == "onnxruntime":
        ctx.state["ort_quantization"] = part
        return model  # ONNX Runtime's quantizer does it on the exported graph
    if recipe is not None and recipe.backend.kind == "openvino":
        ctx.state["openvino_quantization"] = part
        return model  # NNCF does it on the converted model
    plan, cannot = plan_layers(model, part, ctx)
    for name, why in cannot.items():
        ctx.report.skip(name, why)
    if recipe is not None and recipe.backend.mode == BackendMode.MAX_AUTOTUNE and \
            any(c.scheme == "dynamic" for c in plan.values()):
        raise BuildError(MAX_AUTOTUNE_DYNAMIC)
    pt2e_plan = {n: c for n, c in plan.items() if c.scheme in ("static",)}
    dynamic = {n: c for n, c in plan.items() if c.scheme == "dynamic"}
    if dynamic and not pt2e_plan and recipe is not None and recipe.backend.kind == "inductor":
        fused = _in_fused_attention(model, dynamic)
        path, why = ("pt2e", f"pt2e path: {fused}") if fused else dynamic_path(model, dynamic, ctx)
        ctx.state["dynamic_path"] = why
        if path == "pt2e":
            pt2e_plan = dict(dynamic)
    if pt2e_plan:
        # dynamic layers join the static ones in the exported graph (one graph, one compile)
        pt2e_plan.update({n: c for n, c in plan.items() if c.scheme == "dynamic"})
        default = dict(part.rules).get(DEFAULT_KEY)
        keep_float: set[str] = set()
        halves: dict[str, nn.Module] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, STATIC_MODULES) and name not in pt2e_plan:
                keep_float.add(name)
                choice = plan.get(name)
                if choice is not None and choice.precision in _DTYPES:
                    halves[name] = mod  # cast inside the graph (compiler._graph_cast)
                elif choice is not None:
                    ctx.report.skip(
                        name,
                        f"{choice.label()} cannot join a pt2e (static int8) graph: the x86 "
                        "quantizer matches plain aten.linear/conv only; kept fp32",
                    )
        dtypes = {n: _DTYPES[plan[n].precision] for n in halves}
        ctx.state["float_beside_int8"] = bool(keep_float)  # see _backend.NO_QUANT_EPILOGUE
        model = quantize_pt2e(model, pt2e_plan, keep_float, default, ctx, dtypes)
        cast = ctx.state.get("cast", set())
        for name, mod in halves.items():
            if name in cast:
                ctx.report.applied[name] = plan[name].label()
                ctx.report.kernel_paths[name] = (
                    _half_path(plan[name].precision, mod) + ", inside the int8 graph"
                )
        # layers outside every exported region stay eager modules and take the cast hooks
        plan = {n: c for n, c in plan.items()
                if n not in pt2e_plan and (n not in keep_float or (n in halves and n not in cast))}
    _quantize_eager(model, plan, ctx)
    if "dynamic_path" in ctx.state:
        for name in dynamic:
            if name in ctx.report.kernel_paths:
                ctx.report.kernel_paths[name] += f"; {ctx.state['dynamic_path']}"
    return model


#: PyTorch's own attention and transformer layers, whose fused paths read their linears'
#: weights instead of calling them
_FUSED_ATTENTION = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _in_fused_attention(model: nn.Module, names: Iterable[str]) -> str | None:
    """Why torchao's int8 tensors cannot go inside this model's compiled graph, or None.
    ``nn.MultiheadAttention`` passes ``out_proj.weight`` into its functional form and
    ``nn.TransformerEncoderLayer`` its linears' weights into one fused op: with torchao's
    tensor subclass there, Dynamo's fake tensors fail, the graph breaks at every such layer and
    the rest runs eagerly (a 2-layer ``nn.TransformerEncoder`` on digits rows, int8 dynamic:
    1.98 ms a call compiled through torchao against 0.29 ms through pt2e and 0.35 ms fp32
    eager). Exported with pt2e they are plain linears."""
    wanted = set(names)
    for parent, mod in model.named_modules():
        if isinstance(mod, _FUSED_ATTENTION):
            inside = sorted(f"{parent}.{n}" for n, _ in mod.named_modules() if n and
                            f"{parent}.{n}" in wanted)
            if inside:
                return (f"{inside[0]} is inside {type(mod).__name__} {parent!r}, whose fused "
                        "path reads its weights directly (torchao's int8 tensors there break "
                        "the compiled graph)")
    return None


def dynamic_path(
    model: nn.Module, dynamic: dict[str, LayerQuant], ctx: BuildContext
) -> tuple[str, str]:
    """Which int8 dynamic path is faster compiled on this machine: torchao's tensor subclass
    or pt2e (oneDNN ``qlinear`` with per-call activation scales). Timed once per machine and
    layer shape on the model's largest dynamic layer (``compiler._measure``), so rebuilds
    take the same path."""
    example = ctx.first_input()
    modules = dict(model.named_modules())
    name = max(dynamic, key=lambda n: modules[n].weight.numel())
    if example is None:
        return "torchao", "torchao path (no example input to time the paths on)"
    seen: list[torch.Tensor] = []
    handle = modules[name].register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
    try:
        with torch.inference_mode():
            model(*example[0], **example[1])
    finally:
        handle.remove()
    if not seen:
        return "torchao", "torchao path (the layer did not run on the example)"
    from compiler import _measure
    from compiler._backend import FreezingCompiled, compile_options, inductor
    from compiler._pt2e import export, quantize_region, quiet
    from compiler.recipe import Backend

    x = seen[0].clone()
    layer = modules[name]
    choice = dynamic[name]

    def torchao_path() -> nn.Module:
        micro = nn.Sequential(copy.deepcopy(layer)).eval()
        q, _ = _torchao()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q.quantize_(micro, _int8_config(choice))
        return inductor(micro, compile_options(Backend("inductor")))

    def pt2e_path() -> nn.Module:
        micro = nn.Sequential(copy.deepcopy(layer)).eval()
        with torch.no_grad():
            gm = quantize_region(export(micro, ((x,), {})), {"": choice}, set(), None, [((x,), {})])
        return FreezingCompiled(inductor(gm, {}))

    built: dict[str, nn.Module] = {}

    def runner(key: str, make: Any) -> Any:
        def run() -> Any:
            if key not in built:
                with quiet():
                    built[key] = make()
            return built[key](x)

        return run

    what = f"int8 dynamic {choice.granularity} linear x{tuple(x.shape)} w{tuple(layer.weight.shape)}"
    try:
        best, ms = _measure.choose(
            what, {"torchao": runner("torchao", torchao_path), "pt2e": runner("pt2e", pt2e_path)}
        )
    except Exception as exc:  # noqa: BLE001 - a path that fails here is not taken
        return "torchao", f"torchao path (timing the paths failed: {type(exc).__name__})"
    return best, (
        f"{best} path chosen by measurement on {name} "
        f"({ms['pt2e']:.3f} ms pt2e vs {ms['torchao']:.3f} ms torchao)"
    )


def _half_path(precision: str, module: nn.Module) -> str:
    """What runs a fp16/bf16 layer here, from the one hardware probe."""
    param = next(module.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return f"aten {precision} (CUDA tensor cores)"
    hw = probe()
    if precision == "bf16":
        units = "AMX-BF16" if hw.features.get("amx_bf16") else "AVX512-BF16" if hw.bf16_fast else None
    else:
        units = "AVX512-FP16" if hw.features.get("avx512_fp16") else None
    if units:
        return f"aten {precision} (oneDNN, {units})"
    return f"aten {precision} (no {precision} units on this CPU: converted in software, slow)"


def _quantize_eager(model: nn.Module, plan: dict[str, LayerQuant], ctx: BuildContext) -> None:
    """fp16/bf16 casts and torchao int8 (dynamic, weight-only) on eager modules, in place."""
    if not plan:
        return
    groups: dict[LayerQuant, list[str]] = defaultdict(list)
    for name, choice in plan.items():
        groups[choice].append(name)
    q, _ = _torchao()
    modules = dict(model.named_modules())
    for choice in list(groups):
        gone = [n for n in groups[choice] if n not in modules]
        for name in gone:
            ctx.report.skip(name, f"{choice.label()}: the layer is inside an exported pt2e graph")
        groups[choice] = [n for n in groups[choice] if n in modules]
    for choice, names in groups.items():
        if not names:
            continue
        selected = frozenset(names)
        if choice.precision in _DTYPES:
            for name in names:
                _cast_hooks(modules[name], _DTYPES[choice.precision])
                ctx.report.applied[name] = choice.label()
                ctx.report.kernel_paths[name] = _half_path(choice.precision, modules[name])
            continue
        if choice.precision == "fp8":
            why = fp8_unusable(model)
            if why is not None:
                raise BuildError(why)
        config = _fp8_config() if choice.precision == "fp8" else _int8_config(choice)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q.quantize_(model, config, filter_fn=lambda _m, fqn: fqn in selected)
        for name in names:
            ctx.report.applied[name] = choice.label()
            ctx.report.kernel_paths[name] = f"torchao {type(config).__name__}"
