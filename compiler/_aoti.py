"""Inductor variants as AOTInductor packages: compiled once, loaded by any process without
compiling.

A ``torch.compile`` variant lives only in the process that compiled it, so the serving
process used to rebuild what a worker had already built and measured (20-60 s of compile on
MiniLM). An AOTInductor package (``torch._inductor.aoti_compile_and_package``) is a ``.pt2``
zip holding the generated C++ (``wrapper.cpp``, ``kernel.cpp``) and the shared library built
from it, weights included; it loads in a fraction of a second, nothing compiled, no C++
compiler needed. Measured on all-MiniLM-L6-v2 static int8 (pt2e), against fp32 eager: 3.4-3.5x as a
package, 2.7-3.0x through ``torch.compile``.

Three rules come from measurements:

- **Freezing, under ``torch.no_grad()``.** Without it the quantized linears of a pt2e graph
  never reach oneDNN's ``qlinear_pointwise`` (1.2x instead of 3.4x); with it, weights are
  constant-folded and prepacked into the package.
- **Static shapes.** pt2e packages compiled with dynamic shapes gave wrong outputs, so each
  package is exported for the exact shapes (and strides, dtypes, devices) of one example,
  checked after compiling against the module it came from, and :class:`AotiModule` serves a
  call from a package only when the call's inputs have those shapes. Any other call is served
  by the original model given to ``build`` (exact fp32 outputs), counted in
  ``shape_misses``: never an error, never a compile. A recipe with shape buckets gets one
  package per bucket length.
- **No GIL held through a call.** torch's loader holds the GIL for a whole call (torch 2.13),
  starving every other thread of the serving process (an fp32 model beside it: 7 ms a call
  became 283 ms). Packages run through their library's C interface instead, which releases
  it (:mod:`compiler._aoti_native`); the loader remains for packages that need more.

A package is extracted into this process's folder, removed when the variant is released or,
at the latest, when the process exits (see :func:`compiler._aoti_native.extract_folder`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import zipfile
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import (
    tree_flatten,
    tree_unflatten,
    treespec_dumps,
)

from compiler import _attention
from compiler._aoti_native import NativePackage, extract_folder, plain_package
from compiler._autocast import context_of, exportable
from compiler._dynamic import (
    DynamicMatch,
    at_length,
    export_shapes,
    length,
    mask_signature,
    probes,
    range_of,
)
from compiler._inputs import NOTE as INPUTS_NOTE
from compiler._inputs import call_checked, copies
from compiler._kernel_map import KernelMap, kernel_map, merge, profile_options
from compiler._outputs import loads_spec
from compiler._pt2e import quiet
from compiler._registry import BuildContext, Example

if TYPE_CHECKING:
    from compiler._autotune_picks import Pick, Picking

log = logging.getLogger("pgc.compiler")

Signature = tuple[Any, ...]
"""What a package was compiled for: per input its shape, strides, dtype and device, when the
inputs are positional tensors; otherwise the inputs' tree structure first, then the same per
leaf (or the value of a non-tensor leaf). Hashable; a few microseconds to compute."""

MAX_REL_ERROR = 0.1
"""A package whose outputs differ from its module's by more (relative L2) is not used."""


def _leaf(x: Any) -> tuple[Any, ...]:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), _layout(x), x.dtype, x.device)
    return ("value", repr(x))


def _layout(x: torch.Tensor) -> str | tuple[int, ...]:
    """``contiguous``, or the strides that matter: a dimension of size 1 is never stepped
    along, so its stride (which varies with how the tensor was made) is left out."""
    if x.is_contiguous():
        return "contiguous"
    return tuple(st if n != 1 else 0 for n, st in zip(x.shape, x.stride()))


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> Signature:
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the usual call, quickly
        return tuple(map(_leaf, args))
    leaves, spec = tree_flatten((tuple(args), kwargs))
    return (spec, *map(_leaf, leaves))


MAX_MISSED_SHAPES = 16


def shape_label(sig: Signature) -> str:
    """The input shapes of a call, for people: ``1x37, 1x37``."""
    leaves = sig if sig and isinstance(sig[0], tuple) else sig[1:]
    return ", ".join("x".join(map(str, leaf[0])) if leaf[0] != "value" else leaf[1]
                     for leaf in leaves)


def signature_to_json(sig: Signature) -> dict[str, Any]:
    if sig and isinstance(sig[0], tuple):  # tensors only, positional: no tree structure
        spec, leaves = None, list(sig)
    else:
        spec, leaves = sig[0], list(sig[1:])
    out: list[dict[str, Any]] = []
    for leaf in leaves:
        if leaf[0] == "value":
            out.append({"value": leaf[1]})
        else:
            shape, stride, dtype, device = leaf
            out.append({
                "shape": list(shape), "stride": stride if isinstance(stride, str) else list(stride),
                "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            })
    return {"spec": treespec_dumps(spec) if spec is not None else None, "leaves": out}


def signature_from_json(data: dict[str, Any]) -> Signature:
    leaves: list[Any] = []
    for leaf in data["leaves"]:
        if "value" in leaf:
            leaves.append(("value", leaf["value"]))
        else:
            dtype = getattr(torch, leaf["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"not a dtype: {leaf['dtype']!r}")
            stride = leaf["stride"]
            stride = stride if isinstance(stride, str) else tuple(stride)
            leaves.append((tuple(leaf["shape"]), stride, dtype, torch.device(leaf["device"])))
    if data["spec"] is None:
        return tuple(leaves)
    return (loads_spec(data["spec"]), *leaves)


_TMPDIR_LOCK = threading.Lock()


def _package_loader(path: str | Path) -> Any:
    """The package's C++ loader. ``aoti_load_package`` would first compare the package's CPU
    ISA with this machine's, which Inductor finds by compiling probe programs: a C++ compiler
    on every serving host, and seconds in a fresh cache folder. An artifact's key already pins
    the CPU model and its ISA features, so the loader is made directly (MiniLM int8, 61 MB:
    0.1 s, without importing Inductor)."""
    make = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if make is None:  # a torch without it: the public way
        with quiet():
            from torch._inductor.package import load_package

            return load_package(str(path)).loader
    folder = extract_folder()
    with _TMPDIR_LOCK:  # the loader reads TMPDIR; set it for this call only
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = folder
        try:  # (model name, single-threaded, runners, device)
            return make(str(path), "model", False, 1, -1)
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before


@functools.cache
def allow_amx() -> bool:
    """Ask Linux for the AMX tile registers (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), once per
    process; False on a CPU without AMX. A process must ask before its first AMX instruction
    or that instruction kills it (SIGILL). Inductor asks when it probes the CPU and oneDNN
    when it first runs an AMX primitive, but a serving process that only loads packages does
    neither: a bf16 max-autotune package (Inductor's AMX GEMM template) ended such a process
    on its first call, MiniLM's and a two-layer MLP's alike, unless an int8 oneDNN layer
    happened to run before the template's kernel."""
    init = getattr(torch.cpu, "_init_amx", None)
    return bool(init()) if init is not None else False


class PackageRunner:
    """One loaded package. A plain package runs through its library's C interface, the GIL
    released for the call (:mod:`compiler._aoti_native`); any other through torch's loader,
    called directly (``AOTICompiledModel`` parses the call spec again on every call)."""

    def __init__(self, path: str | Path, *, copy_inputs: bool = False) -> None:
        #: the package writes into its inputs: it is called on copies (``compiler._inputs``)
        self.copy_inputs = copy_inputs
        allow_amx()
        self.native = NativePackage(path) if plain_package(path) else None
        #: constants copied to aligned memory at load (``NativePackage.align_constants``)
        self.aligned = self.native.align_constants() if self.native is not None else (0, 0)
        self.loader = None if self.native is not None else _package_loader(path)
        spec = self.native.call_spec if self.native is not None else self.loader.get_call_spec()
        in_spec, out_spec = (loads_spec(s) for s in spec)
        self.kwarg_order = list(in_spec.child(1).context or [])
        self.out_spec = out_spec

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            flat = list(args)
        else:
            kwargs = {k: kwargs[k] for k in self.kwarg_order}  # in the order exported
            leaves = tree_flatten((tuple(args), kwargs))[0]
            flat = [x for x in leaves if isinstance(x, torch.Tensor)]
        if self.copy_inputs:
            flat = [x.clone() for x in flat]
        outputs = self.native.run(flat) if self.native is not None else self.loader.boxed_run(flat)
        return tree_unflatten(outputs, self.out_spec)


class AotiModule(nn.Module):
    """Loaded packages, one per input signature, and the original model for every other call.

    The original model is not registered as a submodule: the variant's layers are compiled
    away, and profiling or ``state_dict`` must not see the fp32 model's as its own. Which
    layers each kernel computes is ``kernel_layers`` (None when unknown): the live profiler
    splits a sampled call's kernel times over them."""

    def __init__(self, runners: dict[Signature, PackageRunner], fallback: nn.Module,
                 kernel_layers: KernelMap | None = None,
                 dynamic: Sequence[tuple[DynamicMatch, PackageRunner]] = ()) -> None:
        super().__init__()
        self.runners = runners
        self.dynamic = tuple(dynamic)
        self.kernel_layers = kernel_layers
        self.__dict__["fallback"] = fallback
        self.shape_misses = 0
        #: calls per input shape that missed (the first :data:`MAX_MISSED_SHAPES` shapes)
        self.missed_shapes: dict[str, int] = {}
        self._misses_lock = threading.Lock()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sig = signature(args, kwargs)
        runner = self.runners.get(sig)
        if runner is not None:
            return runner(args, kwargs)
        for match, dynamic in self.dynamic:
            if match.accepts(sig, args, kwargs):
                return dynamic(args, kwargs)
        shapes = shape_label(sig)
        with self._misses_lock:
            self.shape_misses += 1
            if shapes in self.missed_shapes or len(self.missed_shapes) < MAX_MISSED_SHAPES:
                self.missed_shapes[shapes] = self.missed_shapes.get(shapes, 0) + 1
        return self.__dict__["fallback"](*args, **kwargs)


# --------------------------------------------------------------------------- building


def aoti_options(options: dict[str, Any]) -> dict[str, Any]:
    """Inductor options for a package: the ``torch.compile`` ones (freezing, max-autotune)
    less CUDA graphs, which a package does not capture."""
    return {k: v for k, v in options.items() if k != "triton.cudagraphs"}


def compile_package(
    module: nn.Module, example: Example, path: Path, options: dict[str, Any],
    dynamic_dim: int | None = None, notes: list[str] | None = None,
    picks: dict[str, list[Pick]] | None = None,
) -> tuple[KernelMap | None, tuple[int, int | None] | None]:
    """Export ``module`` with the example's shapes (static, or ``dynamic_dim`` symbolic) and
    compile it into ``path``; returns which layers each of its kernels computes
    (:mod:`compiler._kernel_map`) and, for a dynamic package, the lengths it accepts. Attention
    is lowered where that is faster (:mod:`compiler._attention`); what was chosen is appended
    to ``notes``. The GEMM kernels max-autotune kept go to ``picks[path.name]``
    (:mod:`compiler._autotune_picks`; replayed inside its ``replaying``)."""

    args, kwargs = example
    accepts = None
    with _one_build_per_folder(notes), torch.no_grad(), context_of(module), quiet(), \
            contextlib.redirect_stderr(io.StringIO()):
        module = exportable(module)
        shapes = None if dynamic_dim is None else export_shapes(module, example, dynamic_dim)
        program = torch.export.export(module, tuple(args), dict(kwargs), strict=False,
                                      dynamic_shapes=shapes)
        if dynamic_dim is not None:
            accepts = range_of(program, example, dynamic_dim)
        configs = {**options, **profile_options()}
        attention = _attention.find(program)
        note = None
        if attention is not None and attention.choice is None:
            program, choice, ms, picked = _compile_both_ways(program, attention, example, path,
                                                             configs)
            note = attention.note(choice, ms)
        else:
            if attention is not None:
                note = attention.note(attention.choice or "fused", attention.ms)
                if attention.choice == "math":
                    program = _attention.lower(program)
            picked = _compile(program, path, configs)
        _drop_build_outputs(path)
    for line in (note, picked.describe()):
        if line is not None and notes is not None and line not in notes:
            notes.append(line)
    if picks is not None:
        picks[path.name] = picked.picks
    try:
        return kernel_map(program, path), accepts
    except Exception:  # noqa: BLE001 - no attribution, the package serves all the same
        return None, accepts


def _compile(program: Any, path: Path, configs: dict[str, Any], package: str | None = None,
             ) -> Picking:
    """AOTInductor-compile ``program`` into ``path``, recording (or replaying) the kernel
    max-autotune keeps for each GEMM as package ``package`` (default: ``path``'s name)."""
    from torch._inductor import aoti_compile_and_package

    from compiler._autotune_picks import picking

    with picking(package or path.name) as picked:
        aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    return picked


def _compile_both_ways(
    program: Any, attention: _attention.Attention, example: Example, path: Path,
    configs: dict[str, Any],
) -> tuple[Any, str, dict[str, float], Picking]:
    """Compile ``program`` with its attention fused and plain, time the two packages on the
    example, keep the faster at ``path`` and remember the choice (:mod:`compiler._attention`).
    Returns the program compiled, the form, the milliseconds measured and its GEMM picks."""
    plain_program = _attention.lower(program)
    plain_path = path.with_name(path.stem + ".plain.pt2")
    try:
        picked = _compile(program, path, configs)
        plain_picked = _compile(plain_program, plain_path, configs, package=path.name)
        fused, plain = PackageRunner(path), PackageRunner(plain_path)
        args, kwargs = copies(example)  # a package may write into its inputs (compiler._inputs)
        choice, ms = _attention.choose(attention, lambda: fused(args, kwargs), lambda: plain(args, kwargs))
        if choice == "math":
            _drop_build_outputs(path)
            os.replace(plain_path, path)
            return plain_program, choice, ms, plain_picked
        return program, choice, ms, picked
    finally:
        if plain_path.exists():
            _drop_build_outputs(plain_path)
            plain_path.unlink()


@contextlib.contextmanager
def _one_build_per_folder(notes: list[str] | None) -> Iterator[None]:
    """Held while a package is compiled in Inductor's cache folder and its outputs dropped
    (a file lock in that folder). AOTInductor writes a graph's objects into a folder named
    after the graph, so two processes compiling the same graph with one cache folder (a
    search and ``pgc profile --recipe``, two services on one model) shared it, and the first
    to drop it took the second's objects away mid-link (its package failed:
    FileNotFoundError on ``wrapper.o``). A build that waits says so, in the log and in
    ``notes``."""
    from filelock import FileLock, Timeout
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / "pgc-aoti-build.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another AOTInductor build in %s to finish", root)
        started = time.monotonic()
        lock.acquire()
        waited = (f"waited {time.monotonic() - started:.1f}s for another build in the kernel "
                  "cache folder")
        log.info("%s", waited)
        if notes is not None:
            notes.append(waited)
    try:
        yield
    finally:
        lock.release()


def _drop_build_outputs(package: Path) -> None:
    """AOTInductor leaves what it packaged (the shared library, as large as the weights, and
    its sources) in a folder of Inductor's cache; the package holds a copy, and a search that
    builds many variants would fill the disk with them. Only that folder is removed."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    with zipfile.ZipFile(package) as z:
        names = {Path(n).name for n in z.namelist() if n.endswith(".wrapper.so")}
    for name in names:
        for found in root.glob(f"*/{name}"):
            own = found.parent.name not in ("locks", "aotautograd", "fxgraph")
            if found.parent.parent == root and own:
                shutil.rmtree(found.parent, ignore_errors=True)


def relative_error(expected: Any, got: Any) -> float:
    """Largest relative L2 error over the floating-point output leaves (inf: other structure)."""
    a, spec_a = tree_flatten(expected)
    b, spec_b = tree_flatten(got)
    if spec_a != spec_b:
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if not isinstance(x, torch.Tensor):
            continue
        if not isinstance(y, torch.Tensor) or x.shape != y.shape:
            return float("inf")
        if not x.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(x, y) else float("inf"))
            continue
        x, y = x.detach().float(), y.detach().float()
        norm = max(float(torch.linalg.vector_norm(x)), 1e-12)
        err = float(torch.linalg.vector_norm(x - y)) / norm
        worst = max(worst, err if err == err else float("inf"))  # NaN counts as wrong
    return worst


def shape_examples(example: Example, recipe: Any) -> list[Example]:
    """The examples to compile packages for: the given one, or with shape buckets the example
    at each bucket length (padded with the bucket's pad value, or cut)."""
    buckets = getattr(recipe, "buckets", None)
    if buckets is None or buckets.is_identity:
        return [example]
    if length(*example, buckets.dim) is None:
        return [example]
    return [at_length(example, buckets.dim, size, buckets.pad_value) for size in buckets.sizes]


def to_aoti(model: nn.Module, options: dict[str, Any], ctx: BuildContext) -> AotiModule:
    """Compile ``model`` into one package per shape example (see :func:`shape_examples`),
    check each against ``model``, load them and serve them. The packages stay in a temporary
    folder named in ``ctx.state["artifact"]`` (``build`` saves them to the compile cache and
    removes it). Raises when any step fails; the caller then compiles with ``torch.compile``."""
    example = ctx.first_input()
    assert example is not None
    if ctx.state.get("dynamic_dim") is not None:
        return _to_dynamic_aoti(model, options, ctx, example, ctx.state["dynamic_dim"])
    folder = Path(tempfile.mkdtemp(prefix="pgc-aoti-"))
    try:
        runners: dict[Signature, PackageRunner] = {}
        files: list[str] = []
        inputs: list[dict[str, Any]] = []
        maps: list[KernelMap | None] = []
        picks: dict[str, list[Pick]] = {}
        for i, ex in enumerate(shape_examples(example, ctx.recipe)):
            sig = signature(*ex)
            if sig in runners:
                continue
            name = f"model{i}.pt2"
            maps.append(compile_package(model, ex, folder / name, aoti_options(options),
                                        notes=ctx.report.notes, picks=picks)[0])
            runner = PackageRunner(folder / name)
            with torch.no_grad():
                got, runner.copy_inputs = call_checked(runner, ex)
                _check_package(got, model, ctx.state.get("original", model), ex)
            runners[sig] = runner
            files.append(name)
            inputs.append(_with_copy(signature_to_json(sig), runner, ctx))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    kernels = merge(maps)
    ctx.state["artifact"] = {"kind": "aoti", "folder": folder, "files": files, "inputs": inputs,
                             "kernels": kernels, "autotune": picks}
    summary = summarize_package(folder / files[0])
    if len(files) > 1:
        summary += f" ({len(files)} packages, one per bucket length)"
    ctx.report.kernel_paths["<compiled>"] = summary
    return AotiModule(runners, ctx.state.get("original", model), kernels)


def _check_package(got: Any, module: nn.Module, original: nn.Module, example: Example) -> None:
    """Raise unless ``got`` (the package on ``example``) is what ``module`` computes, within
    :data:`MAX_REL_ERROR`, or is as close to the fp32 ``original`` as ``module`` is. The
    second holds a package whose own low-precision kernels round differently from the
    module's: an int8 static, bf16 MiniLM package read 0.102 from its module (cosine 0.995
    to fp32, like the module's), and its variant was compiled with ``torch.compile``."""
    args, kwargs = example
    computed = module(*args, **kwargs)
    err = relative_error(computed, got)
    if err <= MAX_REL_ERROR:
        return
    want = original(*args, **kwargs)
    theirs, ours = relative_error(want, computed), relative_error(want, got)
    if ours <= 1.25 * theirs + 0.01:
        return
    raise ValueError(
        f"the package's outputs differ from the module's (relative error {err:.3g}; "
        f"{ours:.3g} from fp32 against the module's {theirs:.3g})")


def _to_dynamic_aoti(model: nn.Module, options: dict[str, Any], ctx: BuildContext,
                     example: Example, dim: int) -> AotiModule:
    """One package with ``dim`` symbolic, checked at several lengths against the fp32 model
    (:mod:`compiler._dynamic`); raises when export fixes the axis or a length is off."""
    folder = Path(tempfile.mkdtemp(prefix="pgc-aoti-"))
    picks: dict[str, list[Pick]] = {}
    try:
        kernels, accepts = compile_package(model, example, folder / "model0.pt2",
                                           aoti_options(options), dynamic_dim=dim,
                                           notes=ctx.report.notes, picks=picks)
        assert accepts is not None
        low, high = accepts
        runner = PackageRunner(folder / "model0.pt2")
        original = ctx.state.get("original", model)
        checked = probes(ctx, dim, low, high)
        with torch.no_grad():
            for ex in checked:
                want = original(*ex[0], **ex[1])
                theirs = relative_error(want, model(*ex[0], **ex[1]))
                got, wrote = call_checked(runner, ex)
                runner.copy_inputs |= wrote
                err = relative_error(want, got)
                if err > 1.25 * theirs + 0.01:
                    raise ValueError(
                        f"the dynamic package is off at length {_length_of(ex, dim)}: relative "
                        f"error {err:.3g} against fp32, the graph it came from {theirs:.3g}")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    n = _length_of(example, dim)
    match = DynamicMatch(dim, low, high, mask_signature(signature(*example), dim, n))
    ctx.state["artifact"] = {
        "kind": "aoti", "folder": folder, "files": ["model0.pt2"], "kernels": kernels,
        "autotune": picks,
        "inputs": [_with_copy(signature_to_json(match.masked) | {"dynamic": match.to_json()},
                              runner, ctx)],
    }
    span = f"{low}-{high if high is not None else 'any'}"
    ctx.report.kernel_paths["<compiled>"] = summarize_package(folder / "model0.pt2")
    ctx.report.notes.append(
        f"dynamic dim {dim}: one package for lengths {span}, checked against fp32 at lengths "
        + ", ".join(str(_length_of(ex, dim)) for ex in checked))
    return AotiModule({}, original, kernels, [(match, runner)])


def _with_copy(entry: dict[str, Any], runner: PackageRunner, ctx: BuildContext) -> dict[str, Any]:
    """A package's stored entry, saying whether it is served copies of its inputs."""
    if not runner.copy_inputs:
        return entry
    ctx.report.notes.append(f"the package {INPUTS_NOTE}")
    return entry | {"copy_inputs": True}


def _length_of(example: Example, dim: int) -> int:
    n = length(*example, dim)
    assert n is not None
    return n


def load_aoti(
    folder: Path, files: Sequence[str], inputs: Sequence[dict[str, Any]], fallback: nn.Module,
    kernels: KernelMap | None = None,
) -> AotiModule:
    """Load stored packages (nothing is compiled) and serve them as :func:`to_aoti` did."""
    runners: dict[Signature, PackageRunner] = {}
    dynamic: list[tuple[DynamicMatch, PackageRunner]] = []
    for name, sig in zip(files, inputs):
        copy = sig.get("copy_inputs") is True
        if "dynamic" in sig:
            d = sig["dynamic"]
            match = DynamicMatch(int(d["dim"]), int(d["min"]),
                                 None if d["max"] is None else int(d["max"]),
                                 signature_from_json(sig))
            dynamic.append((match, PackageRunner(folder / name, copy_inputs=copy)))
        else:
            runners[signature_from_json(sig)] = PackageRunner(folder / name, copy_inputs=copy)
    return AotiModule(runners, fallback, kernels, dynamic)


# --------------------------------------------------------------------------- reading


_KERNEL_NAMES = (  # (part of a C shim's name, what it is), first match wins
    ("qlinear_pointwise", "oneDNN int8 linear"),
    ("qconv", "oneDNN int8 conv"),
    ("mkl_linear", "MKL fp32 linear"),
    ("linear_pointwise", "oneDNN fused linear"),
    ("convolution_pointwise", "oneDNN fused conv"),
)
_SHIM = re.compile(r"AOTI_TORCH_ERROR_CODE_CHECK\(aoti_torch_(?:cpu|cuda|xpu|mps)_(\w+)\(")


def package_code(path: str | Path) -> tuple[str, str]:
    """The generated wrapper (C++) and kernel code inside a package."""
    wrapper, kernels = [], []
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.endswith("wrapper.cpp"):
                wrapper.append(z.read(name).decode(errors="replace"))
            elif name.endswith(("kernel.cpp", ".ptx", ".cubin.py")) or "triton" in name:
                kernels.append(z.read(name).decode(errors="replace"))
    return "\n".join(wrapper), "\n".join(kernels)


def summarize_package(path: str | Path) -> str:
    """``oneDNN int8 linear x36, aten._scaled_dot_product_flash_attention_for_cpu x6, 4 bf16
    constants, 21 generated fused kernels``: which library kernels the package's wrapper
    calls, and its weights in half precision."""
    wrapper, kernels = package_code(path)
    calls: Counter[str] = Counter()
    for m in _SHIM.finditer(wrapper):
        op = m.group(1)
        calls[next((label for part, label in _KERNEL_NAMES if part in op), f"aten.{op}")] += 1
    proxied = wrapper.count("proxy_executor->call_function")
    parts = [f"{k} x{v}" for k, v in calls.most_common()]
    for dtype in ("bfloat16", "float16"):  # half weights (compiler._graph_cast), if any
        pattern = rf"constants_info_\[\d+\]\.dtype = cached_torch_dtype_{dtype};"
        n = len(re.findall(pattern, wrapper))
        if n:
            parts.append(f"{n} {'bf16' if dtype == 'bfloat16' else 'fp16'} constants")
    if proxied:
        parts.append(f"{proxied} ops through the proxy executor")
    generated = len(set(re.findall(r"\b(?:cpp_fused|triton)_\w+", kernels + wrapper)))
    if generated:
        parts.append(f"{generated} generated fused kernels")
    return "AOTInductor package: " + (", ".join(parts) or "no kernels found in the generated code")
