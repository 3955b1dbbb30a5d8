"""Which layers each kernel of an AOTInductor package comes from.

A compiled variant fuses its layers into kernels that module hooks cannot see. Inductor
knows where every kernel came from: with provenance tracking on, a package holds
``kernel_information.json``, every kernel of the wrapper in call order (``name:index``) with
the FX nodes of the exported graph it computes (``pre_grad_nodes``); those nodes carry the
``nn_module_stack`` of the module call they were traced in. With ``cpp.enable_kernel_profile``
each generated C++ kernel also emits a profiler event of its own name (``graph_0_cpp_fused_…``),
as library calls through the C shim do (``aoti_torch_cpu_addmm_out``), so a sampled call run
under ``torch.profiler`` can be split over the model's layers (see ``profiler._kernels``).

Kernel events cost every call of such a package a little (3% of MiniLM's), profiled or not,
so a served variant is not built with them: a worker builds a *profiling twin* of the
deployed variant (the same recipe inside :func:`kernel_events`, ``compiler.build_profiling_twin``)
that the agent runs on sampled calls only. ``PGC_KERNEL_PROFILE=1`` (:data:`ENV`) builds every
package with them (``pgc profile --recipe`` does, for one variant).

The map is ``{event name: [layers of its 1st call, layers of its 2nd call, ...]}``: a name
called several times (one library kernel for every linear) is told apart by its order within
the call. Layers are module paths as ``named_modules`` gives them, ``(root)`` for the model's
own ``forward``.
"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KernelMap = dict[str, list[list[str]]]

#: Inductor options a package is built with so that its kernels can be attributed
PROFILE_OPTIONS: dict[str, Any] = {
    "cpp.enable_kernel_profile": True,
    "trace.provenance_tracking_level": 1,
}
#: the switch (an environment variable, so a search worker inherits it and an artifact's
#: cache key records it): kernel events cost every call of the package a little, profiled or
#: not (see the README), so packages are built with them only when asked
ENV = "PGC_KERNEL_PROFILE"


def kernel_profiling() -> bool:
    """Whether packages are built with kernel events (:data:`ENV` is 1)."""
    return os.environ.get(ENV, "0") == "1"


def profile_options() -> dict[str, Any]:
    """The Inductor options that make a package's kernels attributable, when switched on."""
    return dict(PROFILE_OPTIONS) if kernel_profiling() else {}


@contextlib.contextmanager
def kernel_events() -> Iterator[None]:
    """Packages built inside the block carry kernel events (:data:`ENV` is 1 there, as before
    after). The environment is the process's: for a process whose other threads build
    nothing meanwhile (a search worker between trials)."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def with_kernel_events(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) as :func:`kernel_events` sets it."""
    return {**(os.environ if environ is None else environ), ENV: "1"}


ROOT = "(root)"


def node_layers(program: Any) -> dict[str, tuple[str, ...] | None]:
    """Each computing FX node of an exported program, in graph order -> the layers it
    computes: the innermost module it was traced in (a fused linear's members, for sibling
    linears run as one: ``compiler._siblings``); None for nodes no module call made and for
    the quantize and dequantize ops pt2e inserts (their stack is the root's), which then
    count for no layer."""
    from compiler._autocast import layer_path
    from compiler._siblings import members_of

    out: dict[str, tuple[str, ...] | None] = {}
    for node in program.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack")
        if not stack or "quantized_decomposed" in str(node.target):
            out[node.name] = None  # pt2e's quantize/dequantize: in the root's stack, no layer's
        else:
            out[node.name] = members_of(layer_path(list(stack.values())[-1][0]) or ROOT)
    return out


def kernel_map(program: Any, package: str | Path) -> KernelMap | None:
    """The package's kernels -> layers, or None when the package has no kernel information
    (provenance tracking off, or a torch that writes none).

    Inductor names a fused library call after the last node it replaces (a linear with a GELU
    epilogue after the GELU), so a layer no kernel names is given to the kernel of the next
    node in graph order that one does: the kernel it was fused into."""
    with zipfile.ZipFile(package) as z:
        names = [n for n in z.namelist() if n.endswith("kernel_information.json")]
        if not names:
            return None
        info = json.loads(z.read(names[0]))
    layers_of = node_layers(program)
    ordered = sorted(info.items(), key=lambda kv: int(kv[0].rpartition(":")[2] or 0))
    kernel_of: dict[str, int] = {}  # node -> index of the kernel that computes it
    for k, (_, entry) in enumerate(ordered):
        for n in entry.get("pre_grad_nodes") or []:
            kernel_of.setdefault(n, k)
    covered = {layer for n in kernel_of for layer in layers_of.get(n) or ()}
    extra: dict[int, list[str]] = {}
    pending: list[str] = []
    for n, layers in layers_of.items():
        if n in kernel_of:
            extra.setdefault(kernel_of[n], []).extend(pending)
            pending = []
            continue
        for layer in layers or ():
            if layer not in covered and layer not in pending:
                pending.append(layer)
    if pending and kernel_of:  # unmapped layers at the end: the last kernel computed them
        extra.setdefault(max(kernel_of.values()), []).extend(pending)
    out: KernelMap = {}
    for k, (key, entry) in enumerate(ordered):
        name = key.rpartition(":")[0] or key
        own = [x for n in entry.get("pre_grad_nodes") or [] for x in layers_of.get(n) or ()]
        layers = list(dict.fromkeys(extra.get(k, []) + own))
        out.setdefault(name, []).append(layers or [ROOT])
    return out


def merge(maps: list[KernelMap | None]) -> KernelMap | None:
    """One map for the packages of one variant (one per bucket length): the first package's
    entries, with names only others have added."""
    out: KernelMap = {}
    for m in maps:
        for name, calls in (m or {}).items():
            out.setdefault(name, calls)
    return out or None
