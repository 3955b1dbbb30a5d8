"""Static int8 (and dynamic int8 beside it) through PyTorch 2 export quantization (pt2e).

``torch.export`` → ``X86InductorQuantizer`` → ``prepare_pt2e`` → calibration on the given live
inputs → ``convert_pt2e``. The result is a graph of quantize/dequantize ops around float ops;
Inductor with weight freezing then lowers each pattern to oneDNN int8 kernels (``qlinear`` /
``qconv`` with the following ReLU/GELU/add fused) — see ``_backend``.

Per-layer choices go through the quantizer's module-name configs. One quantizer instance
refuses to mix static and dynamic configs, so dynamic layers get a second quantizer composed in
front (``ComposableQuantizer``); layers meant to stay float are configured ``None``. bf16/fp16
layers are left to the quantizer as float and cast inside the converted graph
(``_graph_cast``); int8 weight-only (which changes the op pattern the quantizer matches) stays
fp32 in a pt2e recipe, and the report says so.

Whole-model export fails on data-dependent Python control flow. Then each child module that
holds a target layer is exported on its own (recursively, with inputs captured from the
calibration run), so only the layers inside code that cannot be exported stay as they were.

Two traps handled here: unused parameters and submodules leave dead nodes in the exported
graph that break ``prepare_pt2e``, so dead code is removed first; and an example of batch 1
would specialize the batch dimension, so export sees the example twice over (batch 2) with
every dimension ``Dim.AUTO``, and the variant serves any batch size.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import io
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from compiler._conv_gemm import as_linears
from compiler._graph_cast import cast_layers, is_dequantized
from compiler._graph_cast import module_of as _module_of
from compiler._registry import BuildContext, Example
from compiler.hardware import probe
from compiler.recipe import LayerQuant

PT2E_MODULES = (nn.Linear, nn.Conv2d)
MAX_CALIBRATION = 32
"""Calibration inputs used at most (histogram observers are slow; 32 live inputs suffice)."""

_LAYER_OPS = {"aten.linear.default", "aten.conv2d.default"}


@contextlib.contextmanager
def quiet(*silenced: str) -> Iterator[None]:
    """torchao and export warn and log about things pgc handles; keep the user's logs clean.
    Loggers named in ``silenced`` log nothing at all inside (their errors are ones pgc raises
    itself, with a shorter message)."""
    names = ("torchao", "torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes")
    loggers = [logging.getLogger(n) for n in names + silenced]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1 if lg.name in silenced else logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _xiq() -> Any:
    with quiet():
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    return xiq


def _shared_scale_observer() -> Any:
    """A per-channel weight observer whose channels all share the tensor's range: per-tensor
    values in the per-channel layout that Inductor's oneDNN int8 kernels take (a plain
    per-tensor weight spec is constant-folded back to fp32 and gets no int8 kernel)."""
    with quiet():
        from torchao.quantization.pt2e.observer import PerChannelMinMaxObserver

    class SharedScalePerChannelObserver(PerChannelMinMaxObserver):  # type: ignore[misc, valid-type]
        def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
            lo = self.min_val.min().expand_as(self.min_val)
            hi = self.max_val.max().expand_as(self.max_val)
            return self._calculate_qparams(lo, hi)

    return SharedScalePerChannelObserver


def qconfig(choice: LayerQuant) -> Any:
    """The X86InductorQuantizer config for one int8 choice. Activations are uint8 per tensor;
    on CPUs without VNNI/AMX the activation range is halved (``reduce_range``), as PyTorch
    advises, because their int8 dot products saturate."""
    xiq = _xiq()
    reduce_range = not probe().int8_fast
    cfg = xiq.get_default_x86_inductor_quantization_config(
        is_dynamic=choice.scheme == "dynamic", reduce_range=reduce_range
    )
    if choice.granularity == "per_tensor":
        from dataclasses import replace

        weight = cfg.weight
        ctr = _shared_scale_observer().with_args(eps=2**-12)
        cfg = replace(cfg, weight=replace(weight, observer_or_fake_quant_ctr=ctr))
    return cfg


# --------------------------------------------------------------------------- export


def _batch_of_two(example: Example) -> Example | None:
    """The example with every tensor repeated along dim 0, when they all have batch 1."""
    args, kwargs = example
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [t for t in leaves if torch.is_tensor(t)]
    if not tensors or any(t.dim() == 0 or t.shape[0] != 1 for t in tensors):
        return None
    twice = tree_map(lambda t: torch.cat([t, t]) if torch.is_tensor(t) else t, (args, kwargs))
    return twice[0], twice[1]


def _auto_shapes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    sig = inspect.signature(module.forward)
    bound = sig.bind(*args, **kwargs)
    auto = torch.export.Dim.AUTO
    return {
        name: tree_map(
            lambda t: {i: auto for i in range(t.dim())} if torch.is_tensor(t) else None, value
        )
        for name, value in bound.arguments.items()
    }


#: Exported graphs kept for the next build of the same module (a search quantizes one model
#: in many ways, and each pt2e trial exported it again: 2-3 s of a MiniLM trial). Two at most:
#: a graph holds a copy of the weights.
_EXPORTS: OrderedDict[str, torch.fx.GraphModule] = OrderedDict()
_EXPORTS_LOCK = threading.Lock()


def _export_key(module: nn.Module, example: Example) -> str:
    """The module's fingerprint (structure and weights) with its weights' strides (a
    channels-last layout exports another graph), and the example's signature."""
    from compiler.fingerprint import fingerprint

    strides = [tuple(t.stride()) for t in module.state_dict().values() if torch.is_tensor(t)]
    leaves, spec = tree_flatten(example)
    sig = [(tuple(t.shape), t.dtype, tuple(t.stride())) if torch.is_tensor(t) else repr(t)
           for t in leaves]
    text = repr((fingerprint(module), strides, str(spec), sig, type(module).__qualname__))
    return hashlib.sha256(text.encode()).hexdigest()


def export(module: nn.Module, example: Example) -> torch.fx.GraphModule:
    """Export ``module`` with every input dimension free where the model allows it, dead code
    removed; a copy of the graph kept from an earlier export of the same module and example
    when there is one. Raises what export raises when the module cannot be exported."""
    key = _export_key(module, example)
    with _EXPORTS_LOCK:
        kept = _EXPORTS.get(key)
        if kept is not None:
            _EXPORTS.move_to_end(key)
            with quiet():  # copying a graph module warns of torch's own pytree deprecations
                return copy.deepcopy(kept)
    gm = export_program(module, example).module()
    as_linears(gm)  # a convolution computed as a GEMM is a linear to the quantizer
    gm.graph.eliminate_dead_code()
    gm.recompile()
    with _EXPORTS_LOCK, quiet():
        _EXPORTS[key] = copy.deepcopy(gm)  # prepare_pt2e changes the graph it is given
        while len(_EXPORTS) > 2:
            _EXPORTS.popitem(last=False)
    return gm


def export_program(module: nn.Module, example: Example) -> Any:
    """The ``torch.export`` program of ``module``: the example at batch 2 first (a batch of 1
    would fix the batch dimension), then as given; every dimension ``Dim.AUTO``."""
    tries = [e for e in (_batch_of_two(example), example) if e is not None]
    error: Exception | None = None
    for args, kwargs in tries:
        try:
            # export prints the partial graph of a failure to stderr itself; pgc reports why
            with quiet(), contextlib.redirect_stderr(io.StringIO()):
                shapes = _auto_shapes(module, tuple(args), dict(kwargs))
                return torch.export.export(
                    module, tuple(args), dict(kwargs), dynamic_shapes=shapes, strict=False
                )
        except Exception as exc:  # noqa: BLE001 - try the next form
            error = error or exc
    assert error is not None
    raise error


def _capture(
    module: nn.Module, children: Sequence[str], inputs: Sequence[Example]
) -> dict[str, list[Example]]:
    """The inputs each named child receives while ``module`` runs ``inputs``."""
    mods = dict(module.named_modules())
    got: dict[str, list[Example]] = {c: [] for c in children}
    handles = []
    for name in children:

        def hook(_m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            if len(got[name]) < MAX_CALIBRATION:
                got[name].append((tuple(args), dict(kwargs)))

        handles.append(mods[name].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            for args, kwargs in inputs:
                module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return got


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def find_regions(
    model: nn.Module, targets: set[str], inputs: Sequence[Example]
) -> tuple[dict[str, tuple[torch.fx.GraphModule, list[Example]]], dict[str, str]]:
    """Exportable regions that hold the ``targets``: the whole model if it exports, else the
    largest exportable descendants. Returns ``{region: (graph, its inputs)}`` and
    ``{target: why it is in no region}``."""
    regions: dict[str, tuple[torch.fx.GraphModule, list[Example]]] = {}
    failures: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module, mine: set[str], ins: list[Example]) -> None:
        if not ins:
            for t in mine:
                failures[t] = "not reached by any calibration input (export needs one)"
            return
        try:
            regions[prefix] = (export(module, ins[0]), ins)
            return
        except Exception as exc:  # noqa: BLE001 - any export failure: try the children
            why = _first_line(exc)
        groups: dict[str, set[str]] = {}
        for t in mine:
            rel = t[len(prefix) + 1 :] if prefix else t
            if rel == "":
                failures[t] = f"export failed: {why}"
                continue
            groups.setdefault(rel.split(".")[0], set()).add(t)
        if not groups:
            return
        captured = _capture(module, list(groups), ins)
        children = dict(module.named_children())
        for child, child_targets in groups.items():
            full = f"{prefix}.{child}" if prefix else child
            if not captured[child]:
                for t in child_targets:
                    failures[t] = (
                        f"export of {prefix or 'the model'} failed ({why}) and "
                        f"{full} ran on no calibration input"
                    )
                continue
            visit(full, children[child], child_targets, captured[child])

    visit("", model, set(targets), list(inputs))
    return regions, failures


# --------------------------------------------------------------------------- quantize


def layer_status(gm: torch.fx.GraphModule) -> dict[str, str]:
    """For each Linear/Conv node of a converted graph: ``static``, ``dynamic`` or ``float``,
    by its module name (what convert_pt2e really did, not what was asked)."""
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or str(node.target) not in _LAYER_OPS:
            continue
        name = _module_of(node)
        if name is None:
            continue
        act, weight = node.args[0], node.args[1]
        w_q = is_dequantized(weight)
        a_q = is_dequantized(act)
        if w_q and a_q:
            out[name] = "dynamic" if str(act.target).endswith(".tensor") else "static"
        else:
            out[name] = "float"
    return out


def quantize_region(
    gm: torch.fx.GraphModule,
    plan: dict[str, LayerQuant],
    keep_float: set[str],
    default: LayerQuant | None,
    inputs: Sequence[Example],
) -> torch.fx.GraphModule:
    """Annotate, calibrate and convert one exported region. ``plan`` maps region-relative
    layer names to int8 static/dynamic choices; ``keep_float`` names layers to leave alone;
    ``default`` (static) also covers the region's functional ops (matmul, add, pooling)."""
    with quiet():
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer

        xiq = _xiq()
        static_q = xiq.X86InductorQuantizer()
        dynamic_q = xiq.X86InductorQuantizer()
        if default is not None and default.scheme == "static":
            static_q.set_global(qconfig(default))
        has_static = default is not None and default.scheme == "static"
        has_dynamic = False
        if "" in plan:  # the region is one layer: its choice is the region's
            choice = plan[""]
            (dynamic_q if choice.scheme == "dynamic" else static_q).set_global(qconfig(choice))
            has_static, has_dynamic = choice.scheme == "static", choice.scheme == "dynamic"
            plan = {}
        for name, choice in sorted(plan.items()):
            if choice.scheme == "dynamic":
                dynamic_q.set_module_name_qconfig(name, qconfig(choice))
                has_dynamic = True
            elif choice != default:
                static_q.set_module_name_qconfig(name, qconfig(choice))
                has_static = True
        for name in sorted(keep_float):
            static_q.set_module_name_qconfig(name, None)
        quantizers = ([dynamic_q] if has_dynamic else []) + ([static_q] if has_static else [])
        if not quantizers:
            return gm
        quantizer = quantizers[0] if len(quantizers) == 1 else ComposableQuantizer(quantizers)
        prepared = prepare_pt2e(gm, quantizer)
        with torch.no_grad():
            for args, kwargs in list(inputs)[:MAX_CALIBRATION]:
                prepared(*args, **kwargs)
        converted = convert_pt2e(prepared)
    if POOL_UINT8:
        pool_uint8(converted)
    clamp_narrow_quantize(converted)
    return converted


#: Whether :func:`pool_uint8` runs (off: the int8 max-pool stays ``quantized::max_pool2d``)
POOL_UINT8 = True

#: The version of pgc's own rewrites of a graph (this module's clamps of narrow quantizes,
#: ``compiler._attention``'s lowering, ``compiler._graph_cast``'s bf16 layers), part of every
#: cache key: a graph or package saved by an older pgc is not reused when these change.
GRAPH_PASSES = "4"


def pool_uint8(gm: torch.fx.GraphModule) -> int:
    """Max-pool int8 activations as uint8: ``quantize(max_pool2d(dequantize(x)))`` with one
    scale and zero point on both sides (pt2e shares them across a max-pool) becomes
    ``max_pool2d(x)`` on the uint8 tensor, the same values (dequantizing is monotonic).
    Left as it was, Inductor makes the pattern ``quantized::max_pool2d``, an op it calls
    through its proxy executor: such a package is not plain, so it runs through torch's
    loader, which holds the GIL for the whole call (:mod:`compiler._aoti_native`). Inductor
    lowers the uint8 max-pool to a generated kernel. A channels-last pool is left as it was:
    ATen's uint8 max-pool, which runs where the graph runs eagerly (calibration, the package
    check), refuses channels-last input of more than 255 elements a channel (torch 2.13).
    Returns how many were rewritten."""
    qd = torch.ops.quantized_decomposed
    rewritten = 0
    for pool in list(gm.graph.nodes):
        if pool.op != "call_function" or pool.target is not torch.ops.aten.max_pool2d.default:
            continue
        dq, users = pool.args[0], list(pool.users)
        if not (isinstance(dq, torch.fx.Node) and dq.target is qd.dequantize_per_tensor.default
                and len(users) == 1 and users[0].target is qd.quantize_per_tensor.default):
            continue
        q = users[0]
        if tuple(dq.args[1:]) != tuple(q.args[1:]) or dq.kwargs != q.kwargs:
            continue
        val = pool.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.is_contiguous()):
            continue  # ATen's uint8 max-pool fails on channels-last input, run eagerly
        with gm.graph.inserting_before(pool):
            pooled = gm.graph.call_function(
                torch.ops.aten.max_pool2d.default, (dq.args[0], *pool.args[1:]), dict(pool.kwargs))
        pooled.meta.update({k: v for k, v in pool.meta.items() if k not in ("val", "tensor_meta")})
        q.replace_all_uses_with(pooled)
        gm.graph.erase_node(q)
        gm.graph.erase_node(pool)
        if not dq.users:
            gm.graph.erase_node(dq)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def clamp_narrow_quantize(gm: torch.fx.GraphModule) -> int:
    """Clamp the input of every static per-tensor ``quantize`` whose range is narrower than
    its dtype's (``reduce_range``: uint8 in 0..127 on CPUs without VNNI) to the float range
    it can represent. The result is the same, and it keeps Inductor correct: its fusion of a
    quantize into the int8 kernel before it writes the full 0..255 (it ignores the quantize's
    ``quant_max``), and the next int8 kernel then saturates where VNNI is absent. Measured on
    an AVX2-only EPYC, MiniLM's intermediate and output dense layers in a row as one
    AOTInductor package: relative error 0.038 against their q/dq graph without the clamp,
    0.0002 with it, at the same speed (1.8x fp32); all of MiniLM: 0.183 and refused. Returns
    how many were clamped."""
    target = torch.ops.quantized_decomposed.quantize_per_tensor.default
    full = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != target or len(node.args) != 6:
            continue
        x, scale, zero_point, qmin, qmax, dtype = node.args
        if not isinstance(scale, float) or not isinstance(zero_point, int):
            continue
        if full.get(dtype, (qmin, qmax)) == (qmin, qmax):
            continue
        with gm.graph.inserting_before(node):
            low, high = (qmin - zero_point) * scale, (qmax - zero_point) * scale
            clamped = gm.graph.call_function(torch.ops.aten.clamp.default, (x, low, high))
        node.replace_input_with(x, clamped)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantize_pt2e(
    model: nn.Module,
    plan: dict[str, LayerQuant],
    keep_float: set[str],
    default: LayerQuant | None,
    ctx: BuildContext,
    halves: dict[str, torch.dtype] | None = None,
) -> nn.Module:
    """Quantize the layers in ``plan`` (int8 static or dynamic, by module name) through pt2e,
    and run the float layers in ``halves`` in their bf16/fp16 inside the same graph
    (``_graph_cast``). Returns the new model (a GraphModule when the whole model exported);
    layers that could not be quantized are left as they were and recorded in
    ``ctx.report.skipped``; the names of the layers cast are added to ``ctx.state["cast"]``."""
    halves = halves or {}
    report = ctx.report
    inputs = list(ctx.calibration) or ([ctx.example] if ctx.example is not None else [])
    statics = {n for n, c in plan.items() if c.scheme == "static"}
    if not ctx.calibration and statics:
        for n in sorted(statics):
            report.skip(n, "static int8 calibrates on live inputs; none were given")
        plan = {n: c for n, c in plan.items() if n not in statics}
        if default is not None and default.scheme == "static":
            default = None
    if not plan or not inputs:
        for n in plan:
            report.skip(n, "pt2e needs an example input to export the model")
        return model

    regions, failures = find_regions(model, set(plan), inputs)
    for name, why in failures.items():
        report.skip(name, why)
    if "" not in regions and regions:
        report.notes.append(
            "whole-model export failed; quantized exportable parts: " + ", ".join(sorted(regions))
        )
    for region, (gm, region_inputs) in sorted(regions.items(), key=lambda kv: -len(kv[0])):
        prefix = f"{region}." if region else ""
        inside = lambda n: not region or n == region or n.startswith(prefix)
        rel = lambda n: "" if n == region else n[len(prefix) :]
        mine = {rel(n): c for n, c in plan.items() if inside(n)}
        floats = {rel(n) for n in keep_float if inside(n)}
        # the region's own functional ops follow the default only when the whole region is
        # under it (the whole model, or a region whose every layer is planned static)
        region_default = default if default is not None and default.scheme == "static" else None
        converted = quantize_region(gm, mine, floats, region_default, region_inputs)
        cast = cast_layers(converted, {rel(n): d for n, d in halves.items() if inside(n)})
        ctx.state.setdefault("cast", set()).update(f"{prefix}{n}" if n else region for n in cast)
        status = layer_status(converted)
        for name, choice in plan.items():
            if not inside(name):
                continue
            got = status.get(rel(name))
            if got == choice.scheme:
                report.applied[name] = choice.label()
                report.kernel_paths[name] = f"pt2e int8 {choice.scheme} (q/dq until compiled)"
            else:
                report.skip(
                    name,
                    f"X86InductorQuantizer left it {got}" if got else
                    "not used by the model's forward (removed with the dead code before quantizing)",
                )
        if region:
            _set_submodule(model, region, converted)
        else:
            model = converted
        ctx.state["pt2e"] = True
    return model
