"""Backend: eager, Inductor through ``torch.compile``, ONNX Runtime or OpenVINO; and the partition
strategy that decides what one compiled graph holds.

Compiled variants are built with weight freezing (constant folding and prepacked weights),
which is what makes int8 fast on CPU. For ordinary modules it is passed per compile. A pt2e
graph needs it set in ``torch._inductor.config`` itself (the per-compile option is ignored on
that path and the compile fails on ``onednn.qlinear_prepack``), so such a variant is wrapped
in :class:`FreezingCompiled`, which sets the flag for the calling thread only while one of its
calls runs (compiles, and recompiles for a new shape, happen inside calls) and restores it
after: the serving process's settings are never left changed. Shapes are static
(``dynamic=False``) unless the recipe makes an axis dynamic (``compiler._dynamic``): serving
sees few shapes, and shape buckets keep it that way.

When the build has an example input the variant is compiled during ``build`` and the code
Inductor generated is read back, so the report says which kernels really run (oneDNN int8
``qlinear_pointwise``, MKL fp32 ``_mkl_linear``, ...) rather than which were hoped for.

With an example input and the ``latency`` partition, the variant is built as AOTInductor
packages instead (``compiler._aoti``): as fast or faster, and another process loads them in
seconds without compiling. ``torch.compile`` remains for the ``memory`` partition (blocks
compiled one by one, unfrozen), for builds without an example, and wherever export, the
package compile or the check of its outputs fails (the report says why).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any, cast
from unittest import mock

import torch
from torch import nn

from compiler._autocast import Autocast
from compiler._errors import BuildError
from compiler._inputs import NOTE as INPUTS_NOTE
from compiler._inputs import CopiedInputs, call_checked
from compiler._pt2e import quiet
from compiler._registry import BuildContext, register_transform
from compiler.parts import Partition
from compiler.recipe import Backend

_FREEZE_LOCK = threading.Lock()
_freeze_depth = 0
_freeze_saved: bool | None = None


@functools.cache
def _config_is_per_thread() -> bool:
    """Whether a write to ``torch._inductor.config`` holds for the writing thread only.

    Since torch 2.10 or so every setting lives in a ``ContextVar``: a thread that sets
    ``freezing`` sets it for itself, and every other thread still reads its own value."""
    from torch._inductor import config

    entry = getattr(config, "_config", {}).get("freezing")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


@contextlib.contextmanager
def freezing_enabled() -> Iterator[None]:
    """``torch._inductor.config.freezing`` set for the calling thread while inside.

    Where the config is per thread (current torch) this is a plain ``config.patch``. A shared
    counter here would be wrong there: a thread that entered while another was inside took
    the flag as set, left its own value unset, and compiled without freezing, to fp32
    ``addmm`` on dequantized weights, 2-3x slower than the int8 kernels (measured on MiniLM
    when a variant was built while serving threads ran another pt2e variant). Where the config
    is one global (older torch), the flag is set while any caller is inside and restored when
    the last one leaves."""
    from torch._inductor import config

    if _config_is_per_thread():
        with config.patch(freezing=True):
            yield
        return
    global _freeze_depth, _freeze_saved
    with _FREEZE_LOCK:
        if _freeze_depth == 0:
            _freeze_saved = config.freezing
            config.freezing = True
        _freeze_depth += 1
    try:
        yield
    finally:
        with _FREEZE_LOCK:
            _freeze_depth -= 1
            if _freeze_depth == 0:
                config.freezing = bool(_freeze_saved)


class FreezingCompiled(nn.Module):
    """A compiled pt2e graph that compiles (and runs) with Inductor's freezing flag set."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with freezing_enabled():
            return self.compiled(*args, **kwargs)


#: Inductor's buffer planning off for max-autotune. With its C++ GEMM templates (torch 2.13),
#: a pt2e int8 linear whose residual add is fused as an in-place sum writes into the residual's
#: buffer through an alias whose life the planner does not track: the buffer is freed and
#: reused (or updated in place) while the alias is still read, and MiniLM's output came out
#: wrong (cosine -0.09 against fp32; 2 of its layers are enough, 1 is not). Either flag alone
#: fixed it; both are off, at no measured cost (MiniLM int8 package 3.82 ms a call either way).
NO_BUFFER_PLANNING = {"allow_buffer_reuse": False, "inplace_buffers": False}


#: Inductor writes every autotuning's choices and timings straight to ``sys.stderr``; a search
#: on a 2-layer transformer printed 40 such lines into the user's terminal from a compile that
#: ran outside pgc's redirection (``bench/foreign.py``)
QUIET_AUTOTUNE = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


#: Epilogue fusion off for max-autotune where float linears sit beside pt2e int8 ones. With
#: its C++ GEMM templates (torch 2.13), an fp32 linear whose output feeds an int8 static
#: linear gets the next layer's quantize (fp32 -> uint8) fused into its epilogue, and that
#: kernel corrupts the heap: ``malloc(): invalid size (unsorted)`` or ``free(): invalid
#: pointer`` on the first calls, every time, for a 3-layer MLP with one int8 layer (and the
#: native crashes of searches on ``nn.TransformerEncoder`` and a dataclass-output MLP, each
#: in a mixed fp32/bf16 + int8 static max-autotune trial). All layers int8 static, or the
#: same mix in the default mode, run clean under glibc's heap checker; so does the mix with
#: this flag off.
NO_QUANT_EPILOGUE = {"epilogue_fusion": False}


def compile_options(part: Backend, *, freezing: bool = True,
                    float_beside_int8: bool = False) -> dict[str, Any]:
    options: dict[str, Any] = {"freezing": freezing}
    if part.mode == "max-autotune":
        from torch._inductor import list_mode_options

        options.update(list_mode_options("max-autotune"))
        options.update(NO_BUFFER_PLANNING)
        options.update(QUIET_AUTOTUNE)
        if float_beside_int8:
            options.update(NO_QUANT_EPILOGUE)
    return options


def _options(part: Backend, ctx: BuildContext, *, freezing: bool = True) -> dict[str, Any]:
    """:func:`compile_options` for what the build made of the model so far."""
    return compile_options(part, freezing=freezing,
                           float_beside_int8=bool(ctx.state.get("float_beside_int8")))


_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)|extern_kernels\.(\w+)")
_NAMES = {
    "onednn.qlinear_pointwise": "oneDNN int8 linear",
    "onednn.qconv_pointwise": "oneDNN int8 conv",
    "onednn.qconv2d_pointwise": "oneDNN int8 conv",
    "mkl._mkl_linear": "MKL fp32 linear",
    "mkldnn._linear_pointwise": "oneDNN fused linear",
    "mkldnn._convolution_pointwise": "oneDNN fused conv",
}


@contextlib.contextmanager
def capture_code() -> Iterator[list[str]]:
    """Collect the wrapper code Inductor generates while inside. Unlike
    ``torch._inductor.utils.run_and_get_code`` this does not reset Dynamo (which would throw
    away every compiled model of the serving process)."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


def summarize_kernels(codes: list[str]) -> str:
    """``oneDNN int8 linear x36, MKL fp32 linear x2, 41 generated C++/Triton kernels``."""
    calls: Counter[str] = Counter()
    generated = 0
    for code in codes:
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
        for m in _OP.finditer(code):
            name = f"{m.group(1)}.{m.group(2)}" if m.group(1) else f"extern.{m.group(3)}"
            if name.startswith(("inductor.", "aten.empty", "extern.reinterpret")):
                continue
            calls[_NAMES.get(name, name)] += 1
        generated += len(re.findall(r"^cpp_fused_\w+ = |^triton_\w+ = ", code, re.MULTILINE))
    parts = [f"{k} x{v}" for k, v in calls.most_common()]
    if generated:
        parts.append(f"{generated} generated fused kernels")
    return ", ".join(parts) or "no kernels found in the generated code"


def inductor(module: nn.Module, options: dict[str, Any], dynamic: bool = False) -> nn.Module:
    """``torch.compile`` with Inductor, static shapes unless ``dynamic``."""
    return cast(nn.Module, torch.compile(module, dynamic=dynamic, options=options))


def _blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """The repeated blocks of a model: items of the shallowest ModuleLists/Sequentials that
    hold two or more modules of one type (transformer layers, residual stages)."""
    found: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(mod: nn.Module) -> None:
        for name, child in mod.named_children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                kids = list(child.named_children())
                types = Counter(type(k) for _, k in kids)
                if kids and max(types.values()) >= 2 and any(
                    any(True for _ in k.children()) for _, k in kids
                ):
                    found.extend((child, n, k) for n, k in kids)
                    continue
            visit(child)

    visit(model)
    return found


def _compile_memory(model: nn.Module, part: Backend, ctx: BuildContext) -> nn.Module:
    blocks = _blocks(model)
    dynamic = ctx.state.get("dynamic_dim") is not None
    if not blocks:
        ctx.report.notes.append("memory partition: no repeated blocks; compiled whole, unfrozen")
        return inductor(model, _options(part, ctx, freezing=False), dynamic)
    for parent, name, block in blocks:
        compiled = inductor(block, _options(part, ctx, freezing=False), dynamic)
        if isinstance(parent, nn.ModuleList | nn.Sequential) and name.isdigit():
            parent[int(name)] = compiled
        else:
            setattr(parent, name, compiled)
    ctx.report.notes.append(
        f"memory partition: {len(blocks)} blocks compiled one by one without freezing "
        "(weights stay the module's parameters, no prepacked copies); glue runs eagerly"
    )
    return model


def _try_aoti(model: nn.Module, part: Backend, ctx: BuildContext) -> nn.Module | None:
    """The variant as AOTInductor packages (``compiler._aoti``), or None (with a note) when
    export, compile or the check of its outputs fails."""
    from compiler._aoti import to_aoti

    try:
        packaged = to_aoti(model, _options(part, ctx), ctx)
    except Exception as exc:  # noqa: BLE001 - torch.compile serves it instead
        text = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {text[0][:200] if text else ''}"
        ctx.report.notes.append(
            f"AOTInductor package not built ({why}); compiled with torch.compile instead"
        )
        return None
    shapes = len(packaged.runners)
    how = "dynamic shapes" if packaged.dynamic else (
        f"static shapes: {shapes} input signature{'s' if shapes > 1 else ''}")
    ctx.report.notes.append(
        f"AOTInductor package ({part.mode}, freezing, {how}; other shapes run the original model)"
    )
    return packaged


@register_transform(Partition)
def apply_partition(model: nn.Module, part: Partition, ctx: BuildContext) -> nn.Module:
    """The strategy is carried out by the backend, which compiles; this records it."""
    ctx.state["partition"] = part.strategy
    return model


@register_transform(Backend)
def apply_backend(model: nn.Module, part: Backend, ctx: BuildContext) -> nn.Module:
    pt2e = bool(ctx.state.get("pt2e"))
    if part.kind == "onnxruntime":
        from compiler._ort import to_onnxruntime

        return to_onnxruntime(model, ctx)
    if part.kind == "openvino":
        from compiler._openvino import to_openvino

        return to_openvino(model, ctx)
    if part.kind == "eager":
        if pt2e:
            ctx.report.kernel_paths["<model>"] = (
                "pt2e reference quantize/dequantize around fp32 ops (eager: no int8 kernels; "
                "use the inductor backend)"
            )
        return model
    ctx.report.compiled = True
    if part.autocast is not None:
        model = Autocast(model, part.autocast)
        ctx.report.notes.append(f"run under CPU autocast ({part.autocast}): what stays float "
                                "between the recipe's layers computes in it where autocast allows")
    strategy = ctx.state.get("partition", "latency")
    if strategy == "latency" and ctx.first_input() is not None:
        packaged = _try_aoti(model, part, ctx)
        if packaged is not None:
            return packaged
    if strategy == "memory" and not pt2e:
        compiled = _compile_memory(model, part, ctx)
    else:
        if strategy == "memory":
            ctx.report.notes.append(
                "memory partition does not apply to a pt2e graph (its int8 kernels need "
                "frozen, prepacked weights); compiled whole"
            )
        options = _options(part, ctx)
        dynamic = ctx.state.get("dynamic_dim") is not None
        if pt2e:
            options.pop("freezing")  # set globally around each call instead (see module doc)
            compiled = FreezingCompiled(inductor(model, options, dynamic))
        else:
            compiled = inductor(model, options, dynamic)
        ctx.report.notes.append(
            f"torch.compile inductor ({part.mode}, freezing{', global flag per call' if pt2e else ''}, "
            f"{'dynamic' if dynamic else 'static'} shapes)"
        )
    example = ctx.first_input()
    if example is not None:
        args, kwargs = example
        try:
            with torch.inference_mode(), capture_code() as codes, quiet("torch._guards"):
                _, wrote = call_checked(lambda a, k: compiled(*a, **k), (args, kwargs))
        except torch.fx.experimental.symbolic_shapes.ConstraintViolationError as exc:
            dim = ctx.state.get("dynamic_dim")
            first = str(exc).strip().splitlines()[0][:200]
            raise BuildError(f"dynamic dim {dim}: the model fixes the length of that axis, so "
                             f"it cannot be compiled dynamic ({first})") from None
        ctx.report.kernel_paths["<compiled>"] = summarize_kernels(codes)
        ctx.state["compiled_on"] = example
        if wrote:
            ctx.report.notes.append(f"the compiled module {INPUTS_NOTE}")
            compiled = CopiedInputs(compiled)
    return compiled
