"""OpenVINO backend (optional: ``pip install pgc[openvino]``): convert with
``openvino.convert_model``, quantize int8 layers with NNCF (``compiler._openvino_nncf``), and
serve a CPU ``CompiledModel`` wrapped as an ``nn.Module``.

The model is converted from the module with the build's example input (OpenVINO traces it):
measured on all-MiniLM-L6-v2 and the digits models, as fast as converting a ``torch.export``
program, and its nodes keep the names of the modules they came from, which is how layers the
recipe keeps out of int8 are named to NNCF. Every input dimension stays dynamic, so one
compiled model serves every shape.

The mode sets the precision: ``default`` leaves OpenVINO's own choice for the device (bf16 on
CPUs with bf16 units, else f32), ``f32`` asks for f32 throughout. The compiled model uses
``torch.get_num_threads()`` threads and the latency hint. Each serving thread gets its own
infer request (one request must not run two calls at once).

The converted (and quantized) model is saved as OpenVINO IR (``model.xml``/``model.bin``,
weights as they are, not compressed to fp16), which a compile cache keeps as the variant's
artifact; :func:`load_openvino` reads and compiles it, nothing converted or quantized.

OpenVINO's model converter and NNCF send usage telemetry unless the user opted out
(``opt_in_out --opt_out``); pgc switches both to stubs while it converts and quantizes (a
serving process should not call out). ``import openvino`` itself still sends one event and
importing NNCF writes a client id under ``~/intel``, unless the user opted out.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps

from compiler._errors import BuildError
from compiler._ort import _flat_inputs
from compiler._outputs import flat_forward, loads_spec
from compiler._pt2e import quiet
from compiler._registry import BuildContext, Example
from compiler._trace_check import check_trace
from compiler._tracing import plain_transformer_layers
from compiler.parts import Backend, BackendKind, BackendMode

INSTALL = "the openvino backend needs `pip install pgc[openvino]`"
FILES = ("model.xml", "model.bin")
_BUILD_LOCK = threading.Lock()  # one conversion at a time: the telemetry switch is global


def openvino() -> ModuleType:
    """The ``openvino`` package, or ``BuildError`` saying how to install it."""
    try:
        import openvino as ov
    except ImportError:
        raise BuildError(INSTALL) from None
    return ov


def available() -> bool:
    try:
        openvino()
    except BuildError:
        return False
    return True


def openvino_version() -> str:
    return str(openvino().get_version()).split("-")[0]


@functools.cache
def core() -> Any:
    """One OpenVINO ``Core`` per process (it is thread-safe; it loads the CPU plugin once)."""
    return openvino().Core()


def default_precision() -> str:
    """The inference precision OpenVINO picks on this CPU by default (``bf16``, ``f32``)."""
    return str(core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string())


def search_backends() -> tuple[Backend, ...]:
    """OpenVINO backends worth searching here: none without OpenVINO; its default mode; and
    ``f32`` too where the default precision is not f32 already."""
    if not available():
        return ()
    default = Backend(BackendKind.OPENVINO)
    if default_precision() == "f32":
        return (default,)
    return default, Backend(BackendKind.OPENVINO, BackendMode.F32)


class _Silent:
    """Stands in for NNCF's telemetry object: every call does nothing."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *_a, **_k: None


@contextlib.contextmanager
def no_telemetry() -> Iterator[None]:
    """OpenVINO's converter with its telemetry switched to the stub it ships for when
    ``openvino_telemetry`` is not installed, and NNCF's to one that does nothing, while inside
    (under one lock: the switch is process-wide)."""
    patches: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from openvino.tools.ovc import convert_impl, telemetry_stub, telemetry_utils, utils

            patches += [mock.patch.object(m, "tm", telemetry_stub)
                        for m in (convert_impl, telemetry_utils, utils) if hasattr(m, "tm")]
        except ImportError:
            pass
        try:
            from nncf.telemetry import decorator

            patches.append(mock.patch.object(decorator, "telemetry", _Silent()))
        except ImportError:
            pass
    with _BUILD_LOCK, contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@dataclass
class Converted:
    """A converted model: the OpenVINO model, the module's tensor inputs by name (the model's
    inputs, in order) and the tree spec of the module's output."""

    model: Any
    input_names: list[str]
    out_spec: Any


def convert(module: nn.Module, example: Example) -> Converted:
    ov = openvino()
    names, tensors = _flat_inputs(module, example, "openvino")
    with torch.no_grad():
        out = module(*example[0], **example[1])
    leaves, spec = tree_flatten(out)
    with torch.no_grad(), quiet(), no_telemetry(), plain_transformer_layers(), \
            flat_forward(module, out):
        model = ov.convert_model(module, example_input=dict(zip(names, tensors)))
    got = [i.get_any_name() if i.get_names() else "" for i in model.inputs]
    if len(got) != len(names) or len(model.outputs) != len(leaves):
        raise BuildError(
            f"openvino backend: the converted model takes {got} and gives {len(model.outputs)} "
            f"outputs; the module takes {names} and gives {len(leaves)}"
        )
    return Converted(model, got if set(got) == set(names) else names, spec)


def compile_config(mode: BackendMode, threads: int, counters: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    if mode is BackendMode.F32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    if counters:  # OpenVINO times every node of every call: for profiling copies only
        config["PERF_COUNT"] = True
    return config


class OvModule(nn.Module):
    """An OpenVINO compiled model that is called like the module it was converted from."""

    def __init__(
        self, model: Any, input_names: list[str], out_spec: Any, mode: BackendMode, threads: int,
        counters: bool = False,
    ) -> None:
        super().__init__()
        self.compiled = core().compile_model(model, "CPU", compile_config(mode, threads, counters))
        self.model, self.mode, self.threads, self.counters = model, mode, threads, counters
        self.precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string())
        self.input_names = input_names
        self.signature: inspect.Signature | None = None
        self.out_spec = out_spec
        self._local = threading.local()
        self.calls = 0  # of this compiled model, every thread's (an estimate under contention)
        #: the calls and node means (ns) when node times began (:meth:`count_from_here`)
        self._since: tuple[int, dict[str, float]] = (0, {})

    def at_threads(self, threads: int) -> OvModule:
        """The same model compiled again for ``threads`` inference threads (at one, OpenVINO
        computes on the calling thread)."""
        return self._compiled_again(threads, self.counters)

    def with_counters(self) -> OvModule:
        """The same model compiled again with OpenVINO's per-node counters (``PERF_COUNT``),
        for a per-layer profile (:meth:`node_times`, ``compiler._openvino_layers``)."""
        return self._compiled_again(self.threads, counters=True)

    def _compiled_again(self, threads: int, counters: bool) -> OvModule:
        other = OvModule(self.model, self.input_names, self.out_spec, self.mode, threads,
                         counters)
        other.signature = self.signature
        return other

    def node_times(self) -> list[tuple[str, int, str]]:
        """``(node, ns, "type (implementation)")`` per executed node (compiled
        :meth:`with_counters`): each node's **mean over the calls since**
        :meth:`count_from_here` (or since compiled). OpenVINO's CPU plugin keeps a mean per
        node over every call of the compiled model, from all threads, each call's time cut to
        whole microseconds (``PerfCount::avg``), not one call's; the mean since is worked out
        from two of them and the calls counted here (within a microsecond). Nodes fused away,
        or under 1 us on average, are left out."""
        n0, before = self._since
        n = self.calls
        out = []
        for name, mean, label in self._node_means():
            if n0 and n > n0:
                mean = (mean * n - before.get(name, 0.0) * n0) / (n - n0)
            out.append((name, int(max(mean, 0.0)), label))
        return out

    def count_from_here(self) -> None:
        """Node times leave out the calls so far: a compiled model's first call allocates its
        buffers (ResNet-18 int8: nodes 3.4 ms against 1.5 ms after), and OpenVINO's means
        would carry it."""
        self._since = (self.calls, {name: mean for name, mean, _ in self._node_means()})

    def _node_means(self) -> list[tuple[str, float, str]]:
        executed = openvino().ProfilingInfo.Status.EXECUTED
        return [(p.node_name, p.real_time.total_seconds() * 1e9,
                 f"{p.node_type} ({p.exec_type})")
                for p in self._request().get_profiling_info() if p.status == executed]

    def _request(self) -> Any:
        req = getattr(self._local, "request", None)
        if req is None:
            req = self._local.request = self.compiled.create_infer_request()
        return req

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.signature is not None
        bound = self.signature.bind(*args, **kwargs)
        feed = [bound.arguments[n].detach().cpu().numpy() for n in self.input_names]
        self.calls += 1
        result = self._request().infer(feed, share_inputs=True, share_outputs=False)
        outs = [torch.from_numpy(result[o]) for o in self.compiled.outputs]
        return tree_unflatten(outs, self.out_spec)


def _wrap(model: Any, names: list[str], spec: Any, mode: BackendMode, signature_of: nn.Module) -> OvModule:
    wrapped = OvModule(model, names, spec, mode, threads=torch.get_num_threads())
    wrapped.signature = inspect.signature(signature_of.forward)
    return wrapped


def ir_files(model: Any) -> dict[str, bytes]:
    """The model as OpenVINO IR: ``model.xml`` and ``model.bin``, weights not compressed."""
    ov = openvino()
    with tempfile.TemporaryDirectory(prefix="pgc-ov-") as tmp:
        ov.save_model(model, str(Path(tmp) / FILES[0]), compress_to_fp16=False)
        return {name: (Path(tmp) / name).read_bytes() for name in FILES}


def _check(model: nn.Module, converted: Converted, inputs: list[Example]) -> None:
    """The converted model, compiled in f32, gives the module's outputs (see _trace_check)."""
    fp32 = _wrap(converted.model, converted.input_names, converted.out_spec, BackendMode.F32,
                 model)
    check_trace("openvino", model, lambda ex: fp32(*ex[0], **ex[1]), inputs)


def to_openvino(model: nn.Module, ctx: BuildContext) -> nn.Module:
    ov_version = openvino_version()  # BuildError first if OpenVINO is not installed
    recipe = ctx.recipe
    mode = recipe.backend.mode if recipe is not None else BackendMode.DEFAULT
    example = ctx.first_input()
    if example is None:
        raise BuildError("the openvino backend converts the model: give an example input")
    converted = convert(model, example)
    _check(model, converted, ctx.calibration or [example])
    ov_model = converted.model
    part = ctx.state.get("openvino_quantization")
    if part is not None:
        from compiler._openvino_nncf import quantize_nncf

        ov_model = quantize_nncf(converted, model, part, ctx, example)
    wrapped = _wrap(ov_model, converted.input_names, converted.out_spec, mode, model)
    ctx.report.compiled = True
    ctx.report.kernel_paths["<compiled>"] = f"OpenVINO {ov_version} CPU plugin, {wrapped.precision}"
    ctx.report.notes.append(
        f"openvino {ov_version}: converted from the module (traced), CPU, inference precision "
        f"{wrapped.precision} ({'asked' if mode is BackendMode.F32 else 'the device default'}), "
        f"{torch.get_num_threads()} threads, latency hint; dynamic shapes"
    )
    try:  # what a compile cache keeps as an artifact (``compiler.build``)
        out_spec = treespec_dumps(converted.out_spec)
        files = ir_files(ov_model)
    except Exception as exc:  # noqa: BLE001 - no artifact, the variant still serves
        ctx.report.notes.append(f"openvino: no artifact ({type(exc).__name__}: {exc})")
    else:
        ctx.state["artifact"] = {
            "kind": "openvino", "files": files, "input_names": converted.input_names,
            "out_spec": out_spec, "mode": mode.value,
        }
    return wrapped


def load_openvino(
    folder: Path, input_names: list[str], out_spec: str, mode: str, model: nn.Module
) -> OvModule:
    """An OpenVINO variant from stored IR: read and compiled, nothing converted or quantized.
    ``model`` gives the call signature."""
    ov_model = core().read_model(str(folder / FILES[0]), str(folder / FILES[1]))
    return _wrap(ov_model, list(input_names), loads_spec(out_spec), BackendMode(mode), model)
