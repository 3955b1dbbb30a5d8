"""ONNX Runtime backend (optional): export with ``torch.onnx``, quantize int8 layers with ONNX
Runtime's own quantizer, serve through an ``InferenceSession`` wrapped as an ``nn.Module``.

The quantization part defers to this backend (``ctx.state["ort_quantization"]``): layers the
recipe makes int8 are quantized by ``quantize_dynamic`` (dynamic) or ``quantize_static``
(QDQ, calibrated on the given live inputs), per-channel or per-tensor; every other MatMul/Gemm/
Conv node is excluded by name. ONNX Runtime takes one scheme and one granularity per model,
so the first int8 choice (the default's, if any) decides and layers asking otherwise stay
fp32, with the reason in the report. fp16/bf16 layer choices are not built here.

The final model file (quantized or not) is what a compile cache keeps as the variant's
artifact; :func:`load_onnx` makes a session from it again, nothing exported or quantized.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps

from compiler._errors import BuildError
from compiler._outputs import flat_forward, forward_replaced, loads_spec
from compiler._registry import BuildContext, Example
from compiler._trace_check import check_trace
from compiler._tracing import plain_transformer_layers
from compiler.fidelity import output_leaves
from compiler.recipe import DEFAULT_KEY, LayerQuant, Quantization

_QUANT_OPS = ("MatMul", "Gemm", "Conv")


def untraceable(module: nn.Module, example: Example) -> str | None:
    """Why the backends that trace the module (ONNX Runtime, OpenVINO) cannot take it, or None
    when they can: each argument a tensor or None, float ones and the weights in float32, and
    an output of tensors only (in tuples, dicts, model hub outputs, dataclasses). A search
    leaves them out for such a model instead of failing a trial on each (7 of 12 trials on a
    model called with a list of tensors, 5 of 12 on one served in bfloat16, 4 on a GPT-2
    returning its key-value cache)."""
    try:
        names, tensors = _flat_inputs(module, example, "traced")
    except BuildError as exc:
        return str(exc).removeprefix("traced backend: ")
    except TypeError as exc:  # the example does not bind to forward's signature
        return f"the example does not bind to forward: {exc}"
    for name, t in zip(names, tensors):
        if t.is_floating_point() and t.dtype != torch.float32:
            return f"input {name!r} is {t.dtype}, not torch.float32"
    weight = next((p for p in module.parameters()
                   if p.is_floating_point() and p.dtype != torch.float32), None)
    if weight is not None:
        return f"the model's weights are {weight.dtype}, not torch.float32"
    try:
        with torch.inference_mode():
            out = module(*example[0], **example[1])
    except Exception:  # noqa: BLE001 - not the tracers' concern: every build will say why
        return None
    other = next((leaf for leaf in output_leaves(out) if not torch.is_tensor(leaf)), None)
    if other is None:
        return None
    return f"the output holds a value of type {type(other).__name__}, not only tensors"


def _flat_inputs(
    module: nn.Module, example: Example, backend: str = "onnxruntime"
) -> tuple[list[str], list[torch.Tensor]]:
    args, kwargs = example
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    names, tensors = [], []
    for name, value in bound.arguments.items():
        if torch.is_tensor(value):
            names.append(name)
            tensors.append(value)
        elif value is not None:
            raise BuildError(f"{backend} backend: input {name!r} is a {type(value).__name__}, "
                             f"not a tensor")
    return names, tensors


def export_onnx(module: nn.Module, example: Example) -> tuple[bytes, list[str], Any]:
    """ONNX bytes (every input dimension dynamic), input names and the output's tree spec."""
    names, tensors = _flat_inputs(module, example)
    with torch.no_grad():
        out = module(*example[0], **example[1])
    leaves, spec = tree_flatten(out)
    outputs = [f"output_{i}" for i in range(len(leaves))]
    axes = {n: {d: f"{n}_{d}" for d in range(t.dim())} for n, t in zip(names, tensors)}
    axes.update({o: {d: f"{o}_{d}" for d in range(t.dim())} for o, t in zip(outputs, leaves)})
    buf = io.BytesIO()
    with plain_transformer_layers(), named_inputs(module, names), flat_forward(module, out), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, tuple(tensors), buf,  # type: ignore[arg-type]
            dynamo=False, input_names=names, output_names=outputs,
            dynamic_axes=axes, opset_version=17, do_constant_folding=True,
        )
    return buf.getvalue(), names, spec


@contextlib.contextmanager
def named_inputs(module: nn.Module, names: list[str]) -> Iterator[None]:
    """While in the block, ``module``'s forward takes exactly the tensors ``names`` says, in
    that order, and passes them on by name. The exporter binds its inputs to the forward's
    signature and appends every later parameter's default: a GPT-2 export took its
    ``logits_to_keep=0`` as a second graph input that no call feeds, and a tensor given by
    keyword after a skipped parameter would have been bound to that one. The same module is
    traced, so its layers keep their names."""
    forward = module.forward

    def named(*tensors: torch.Tensor) -> Any:
        return forward(**dict(zip(names, tensors)))

    named.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    with forward_replaced(module, named):
        yield


def onnx_module_name(node_name: str) -> str:
    """``/encoder/layer.0/output/dense/MatMul`` -> ``encoder.layer.0.output.dense``;
    ``/net/net.0/Gemm`` -> ``net.0`` (the TorchScript exporter's scope names)."""
    parts = node_name.strip("/").split("/")[:-1]
    out: list[str] = []
    for i, p in enumerate(parts):
        if i and p.startswith(parts[i - 1] + "."):
            p = p[len(parts[i - 1]) + 1 :]
        out.append(p)
    return ".".join(out)


class _Reader:
    """ONNX Runtime calibration reader over live inputs."""

    def __init__(self, module: nn.Module, inputs: Sequence[Example]) -> None:
        self._items = []
        for ex in inputs:
            names, tensors = _flat_inputs(module, ex)
            self._items.append({n: t.detach().cpu().numpy() for n, t in zip(names, tensors)})
        self._it = iter(self._items)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._items)


def _quantize(
    onnx_bytes: bytes, module: nn.Module, part: Quantization, ctx: BuildContext
) -> bytes:
    with tempfile.TemporaryDirectory(prefix="pgc-ort-") as tmp:
        return _quantize_in(tmp, onnx_bytes, module, part, ctx)


def _quantize_in(
    tmp: str, onnx_bytes: bytes, module: nn.Module, part: Quantization, ctx: BuildContext
) -> bytes:
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    src, dst = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "model.int8.onnx")
    with open(src, "wb") as fh:
        fh.write(onnx_bytes)
    try:  # shape inference and graph clean-up, as ONNX Runtime's quantizer advises
        from onnxruntime.quantization.shape_inference import quant_pre_process

        pre = os.path.join(tmp, "model.pre.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quant_pre_process(src, pre, skip_symbolic_shape=True)
        src = pre
    except Exception:  # noqa: BLE001 - quantize the exported graph as it is
        pass
    proto = onnx.load(src)
    modules = {n for n, _ in module.named_modules()}
    by_layer: dict[str, list[str]] = {}
    conv_layers: set[str] = set()
    for node in proto.graph.node:
        if node.op_type in _QUANT_OPS:
            name = onnx_module_name(node.name)
            name = name if name in modules else ""
            by_layer.setdefault(name, []).append(node.name)
            if node.op_type == "Conv":
                conv_layers.add(name)
    default = dict(part.rules).get(DEFAULT_KEY)
    chosen: LayerQuant | None = default if default is not None and default.precision == "int8" else None
    include: list[str] = []
    for layer, nodes in by_layer.items():
        choice = part.choice_for(layer)[0] if layer else (default or LayerQuant())
        if choice.precision != "int8":
            if choice.precision != "fp32" and layer:
                ctx.report.skip(layer, f"{choice.label()} is not built by the onnxruntime backend")
            continue
        if choice.scheme == "weight_only":
            if layer:
                ctx.report.skip(layer, "int8 weight-only is not built by the onnxruntime backend")
            continue
        if choice.scheme == "dynamic" and layer in conv_layers:
            if layer and part.choice_for(layer)[1] not in (None, DEFAULT_KEY):
                ctx.report.skip(layer, "int8 dynamic is for Linear layers (as on the torch path)")
            continue
        chosen = chosen or choice
        if choice != chosen:
            if layer:
                ctx.report.skip(
                    layer, f"{choice.label()}: ONNX Runtime quantizes a model with one scheme "
                    f"and granularity ({chosen.label()} here); kept fp32"
                )
            continue
        include.extend(nodes)
        if layer:
            ctx.report.applied[layer] = choice.label()
            ctx.report.kernel_paths[layer] = f"onnxruntime int8 {choice.scheme} (MLAS)"
    if chosen is None or not include:
        return onnx_bytes
    exclude = [n.name for n in proto.graph.node if n.op_type in _QUANT_OPS and n.name not in include]
    per_channel = chosen.granularity == "per_channel"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if chosen.scheme == "dynamic":
            quantize_dynamic(
                src, dst, per_channel=per_channel, weight_type=QuantType.QInt8,
                nodes_to_exclude=exclude, op_types_to_quantize=list(_QUANT_OPS),
            )
        else:
            if not ctx.calibration:
                for layer in list(ctx.report.applied):
                    ctx.report.skip(layer, "static int8 calibrates on live inputs; none were given")
                return onnx_bytes
            reader = _Reader(module, ctx.calibration[:32])
            CalibrationDataReader.register(_Reader)
            quantize_static(
                src, dst, reader, quant_format=QuantFormat.QDQ, per_channel=per_channel,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                nodes_to_exclude=exclude, op_types_to_quantize=list(_QUANT_OPS),
            )
    done = _quantized_nodes(onnx.load(dst))
    for layer, nodes in by_layer.items():
        if layer in ctx.report.applied and not any(d.startswith(n) for n in nodes for d in done):
            ctx.report.skip(layer, "ONNX Runtime's quantizer left it float")
    with open(dst, "rb") as fh:
        return fh.read()


_INTEGER_OPS = {"MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul"}


def _quantized_nodes(proto: Any) -> set[str]:
    """Names of the nodes that really run int8: integer ops, or a MatMul/Gemm/Conv whose
    weight comes out of a DequantizeLinear (QDQ format)."""
    producer = {out: node for node in proto.graph.node for out in node.output}
    done = set()
    for node in proto.graph.node:
        if node.op_type in _INTEGER_OPS:
            done.add(node.name)
        elif node.op_type in _QUANT_OPS and len(node.input) > 1:
            src = producer.get(node.input[1])
            if src is not None and src.op_type == "DequantizeLinear":
                done.add(node.name)
    return done


class OrtModule(nn.Module):
    """An ONNX Runtime session that is called like the module it was exported from."""

    def __init__(self, onnx: bytes | str, input_names: list[str], out_spec: Any, threads: int,
                 source: Callable[[], bytes | str] | None = None) -> None:
        """``onnx``: the model, or the path of its file. ``source`` gives it again when a
        session of another size is asked for (:meth:`at_threads`). A variant loaded from an
        artifact is made from the file's (checked) path: ONNX Runtime's Python session keeps
        the bytes it is made from, so every serving process held each variant's whole model
        (22 MB for MiniLM int8, 90 MB fp32) besides the session's own weights. None: keep
        ``onnx``."""
        super().__init__()
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        # Idle intra-op threads sleep instead of spinning. On a 2-core AVX2 EPYC, MiniLM int8
        # at 2 threads: 28.6 ms spinning against 30.8 ms sleeping on a quiet machine, but 64.1
        # against 39.7 ms with one core busy (pgc's own search worker, or the server's other
        # threads), where spinning threads fight for the core they wait on.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(onnx, opts, providers=["CPUExecutionProvider"])
        self._source = source if source is not None else (lambda: onnx)
        self.threads = threads
        self.input_names = input_names
        self.signature: inspect.Signature | None = None
        self.out_spec = out_spec

    def at_threads(self, threads: int) -> OrtModule:
        """The same model in a session of its own with ``threads`` intra-op threads (at one,
        ONNX Runtime computes on the calling thread)."""
        other = OrtModule(self._source(), self.input_names, self.out_spec, threads, self._source)
        other.signature = self.signature
        return other

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.signature is not None
        bound = self.signature.bind(*args, **kwargs)
        feed = {
            n: bound.arguments[n].detach().cpu().numpy()
            for n in self.input_names
        }
        outs = self.session.run(None, feed)
        return tree_unflatten([torch.from_numpy(o) for o in outs], self.out_spec)


def to_onnxruntime(model: nn.Module, ctx: BuildContext) -> nn.Module:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise BuildError("the onnxruntime backend needs `pip install pgc[onnx]`") from None
    example = ctx.first_input()
    if example is None:
        raise BuildError("the onnxruntime backend exports the model: give an example input")
    onnx_bytes, names, spec = export_onnx(model, example)
    wrapped = OrtModule(onnx_bytes, names, spec, threads=torch.get_num_threads())
    wrapped.signature = inspect.signature(model.forward)
    check_trace("onnxruntime", model, lambda ex: wrapped(*ex[0], **ex[1]),
                ctx.calibration or [example])
    part = ctx.state.get("ort_quantization")
    if part is not None:
        quantized = _quantize(onnx_bytes, model, part, ctx)
        if quantized is not onnx_bytes:
            onnx_bytes = quantized
            wrapped = OrtModule(onnx_bytes, names, spec, threads=torch.get_num_threads())
            wrapped.signature = inspect.signature(model.forward)
    ctx.report.compiled = True
    ctx.report.notes.append(f"onnxruntime {onnxruntime_version()} CPU session, all graph optimizations")
    try:  # what a compile cache keeps as an artifact (``compiler.build``)
        out_spec = treespec_dumps(spec)
    except Exception as exc:  # noqa: BLE001 - an output type pytree cannot name: no artifact
        why = type(exc).__name__
        ctx.report.notes.append(f"onnxruntime: no artifact (outputs not serializable: {why})")
    else:
        ctx.state["artifact"] = {
            "kind": "onnx", "onnx": onnx_bytes, "input_names": names, "out_spec": out_spec,
        }
    return wrapped


def load_onnx(
    source: Callable[[], str], input_names: list[str], out_spec: str, model: nn.Module
) -> OrtModule:
    """An ONNX Runtime variant from a stored model file (``source`` checks it and gives its
    path): a session is created, nothing is exported or quantized. ``model`` gives the call
    signature."""
    spec = loads_spec(out_spec)
    wrapped = OrtModule(source(), list(input_names), spec, threads=torch.get_num_threads(),
                        source=source)
    wrapped.signature = inspect.signature(model.forward)
    return wrapped


def onnxruntime_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)
