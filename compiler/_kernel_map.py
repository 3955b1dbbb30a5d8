"""Which layers each kernel of an AOTInductor package comes from.

A compiled variant fuses its layers into kernels that module hooks cannot see. Inductor
knows where every kernel came from: with provenance tracking on, a package holds
``kernel_information.json``, every kernel of the wrapper in call order (``name:index``) with
the FX nodes of the exported graph it computes (``pre_grad_nodes``); those nodes carry the
``nn_module_stack`` of the module call they were traced in. With ``cpp.enable_kernel_profile``
each generated C++ kernel also emits a profiler event of its own name (``graph_0_cpp_fused_…``),
as library calls through the C shim do (``aoti_torch_cpu_addmm_out``), so a sampled call run
under ``torch.profiler`` can be split over the model's layers (see ``profiler._kernels``).

The map is ``{event name: [layers of its 1st call, layers of its 2nd call, ...]}``: a name
called several times (one library kernel for every linear) is told apart by its order within
the call. Layers are module paths as ``named_modules`` gives them, ``(root)`` for the model's
own ``forward``.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

KernelMap = dict[str, list[list[str]]]

#: Inductor options a package is built with so that its kernels can be attributed
PROFILE_OPTIONS: dict[str, Any] = {
    "cpp.enable_kernel_profile": True,
    "trace.provenance_tracking_level": 1,
}
ROOT = "(root)"
_GRAPH_PREFIX = re.compile(r"^graph_\d+_")


def event_name(name: str) -> str:
    """A profiler event's name as the map keys it (generated kernels carry a graph prefix)."""
    return _GRAPH_PREFIX.sub("", name)


def node_layers(program: Any) -> dict[str, str]:
    """Each computing FX node of an exported program, in graph order -> the innermost module
    it was traced in."""
    out: dict[str, str] = {}
    for node in program.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack")
        out[node.name] = (list(stack.values())[-1][0] or ROOT) if stack else ROOT
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
    layer_of = node_layers(program)
    ordered = sorted(info.items(), key=lambda kv: int(kv[0].rpartition(":")[2] or 0))
    kernel_of: dict[str, int] = {}  # node -> index of the kernel that computes it
    for k, (_, entry) in enumerate(ordered):
        for n in entry.get("pre_grad_nodes") or []:
            kernel_of.setdefault(n, k)
    covered = {layer_of.get(n, ROOT) for n in kernel_of}
    extra: dict[int, list[str]] = {}
    pending: list[str] = []
    for n, layer in layer_of.items():
        if n in kernel_of:
            extra.setdefault(kernel_of[n], []).extend(pending)
            pending = []
        elif layer not in covered and layer not in pending:
            pending.append(layer)
    if pending and kernel_of:  # unmapped layers at the end: the last kernel computed them
        extra.setdefault(max(kernel_of.values()), []).extend(pending)
    out: KernelMap = {}
    for k, (key, entry) in enumerate(ordered):
        name = key.rpartition(":")[0] or key
        own = [layer_of.get(n, ROOT) for n in entry.get("pre_grad_nodes") or []]
        layers = list(dict.fromkeys(extra.get(k, []) + own)) or [ROOT]
        out.setdefault(name, []).append(layers)
    return out


def merge(maps: list[KernelMap | None]) -> KernelMap | None:
    """One map for the packages of one variant (one per bucket length): the first package's
    entries, with names only others have added."""
    out: KernelMap = {}
    for m in maps:
        for name, calls in (m or {}).items():
            out.setdefault(name, calls)
    return out or None
