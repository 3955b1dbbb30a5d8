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

import bisect
import contextlib
import contextvars
import json
import os
import zipfile
from collections.abc import Container, Iterator
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


_EVENTS: contextvars.ContextVar[bool] = contextvars.ContextVar("pgc_kernel_events", default=False)


def kernel_profiling() -> bool:
    """Whether packages built here carry kernel events: inside :func:`kernel_events`, or with
    :data:`ENV` at 1 in the process's environment."""
    return _EVENTS.get() or os.environ.get(ENV, "0") == "1"


def profile_options() -> dict[str, Any]:
    """The Inductor options that make a package's kernels attributable, when switched on."""
    return dict(PROFILE_OPTIONS) if kernel_profiling() else {}


@contextlib.contextmanager
def kernel_events() -> Iterator[None]:
    """Packages built inside the block carry kernel events, and their cache keys say so (as
    :data:`ENV` at 1 would). For this thread only: it was the process's environment, and a
    twin built in one thread made a variant another thread built meanwhile a package with
    kernel events (3% slower on every call), stored under the twin's key."""
    token = _EVENTS.set(True)
    try:
        yield
    finally:
        _EVENTS.reset(token)


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
    (provenance tracking off, or a torch that writes none). See :func:`assign`."""
    with zipfile.ZipFile(package) as z:
        names = [n for n in z.namelist() if n.endswith("kernel_information.json")]
        if not names:
            return None
        info = json.loads(z.read(names[0]))
    ordered = sorted(info.items(), key=lambda kv: int(kv[0].rpartition(":")[2] or 0))
    kernels = [(key.rpartition(":")[0] or key, entry.get("pre_grad_nodes") or [])
               for key, entry in ordered]
    return assign(kernels, node_layers(program), _graph_of(program))


def assign(kernels: list[tuple[str, list[str]]], layers_of: dict[str, tuple[str, ...] | None],
           graph: dict[str, tuple[str, list[str]]]) -> KernelMap:
    """Each kernel (name, the nodes Inductor says it computes; in call order) -> its layers.
    ``graph``: node -> (op, input nodes).

    Kernels run in graph order, so a kernel is placed at the last of its nodes (its
    *anchor*). Inductor names a fused library call after the last node it replaces (a linear
    with a GELU epilogue after the GELU; an int8 convolution after the quantize op of its
    output, which is no layer's), so a layer no kernel names goes to a kernel it feeds: the
    first anchored at or after it whose nodes it reaches, through no quantize or dequantize
    op (pt2e's ops bound one int8 kernel's computation), else the next anchored kernel.
    Inductor's provenance is not always right: on an int8 ResNet it gave a max-pool the
    anchor of a convolution several kernels later, and a shortcut convolution the anchor of
    the convolution fused with the residual add, and named a linear after no node. So a
    library call whose anchor a later kernel also has is not placed there, and only the
    longest run of anchors that rises with the call order is kept. A kernel off it
    (or with no nodes) is *floating*: it keeps the layers of its own nodes (a mask computed
    once names nodes of every layer), and takes one layer between the anchors around it
    whose op its library call is named after (``aoti_torch_cpu_max_pool2d``:
    ``aten.max_pool2d``), one that feeds no anchored kernel if there is one; at the end of
    the graph it takes what no kernel took."""
    pos = {n: i for i, n in enumerate(layers_of)}
    anchors = [max((pos[n] for n in nodes if n in pos), default=None) for _, nodes in kernels]
    for k, (name, _) in enumerate(kernels):  # one op's library call, named after the output
        if _library_op(name) and anchors[k] in anchors[k + 1:]:  # a later kernel writes
            anchors[k] = None
    at = {k: anchors[k] for k in sorted(_rising(anchors))}  # kept kernel -> its anchor
    taken = {k: [x for n in nodes for x in layers_of.get(n) or ()]
             for k, (_, nodes) in enumerate(kernels)}
    named = {n for _, nodes in kernels for n in nodes}
    covered = {layer for layers in taken.values() for layer in layers}
    unnamed = [n for n, layers in layers_of.items()
               if layers and n not in named and any(x not in covered for x in layers)]
    fed: dict[str, int] = {}  # node -> the first anchored kernel it feeds
    for k, a in at.items():  # in anchor order; what an earlier one reached, it keeps
        for n in _feeding(graph, kernels[k][1], fed):
            if n not in fed and pos.get(n, a + 1) <= a:
                fed[n] = k
    owner: dict[str, int] = {}
    floating = [k for k in range(len(kernels)) if k not in at]
    for k in floating:
        stem = _library_op(kernels[k][0])
        low = max((a for j, a in at.items() if j < k), default=-1)
        high = min((a for j, a in at.items() if j > k), default=len(pos))
        like = [n for n in unnamed if n not in owner and low < pos[n] <= high
                and stem is not None and _op_name(graph[n][0]).startswith(stem)]
        for n in ([n for n in like if n not in fed] or like)[-1:]:
            owner[n] = k
    placed = sorted((a, k) for k, a in at.items())
    last = max(floating[-1:] + list(at)[-1:]) if at else None  # no anchor: nothing to follow
    for n in unnamed:
        if n in owner:
            continue
        i = bisect.bisect_left(placed, (pos[n], -1))
        if n in fed:
            owner[n] = fed[n]
        elif i < len(placed):
            owner[n] = placed[i][1]
        elif last is not None:  # past the last anchor: the last kernel computed it
            owner[n] = last
    extra: dict[int, list[str]] = {}
    for n, k in owner.items():
        extra.setdefault(k, []).extend(x for x in layers_of[n] or () if x not in covered)
    out: KernelMap = {}
    for k, (name, _) in enumerate(kernels):
        layers = list(dict.fromkeys(extra.get(k, []) + taken.get(k, [])))
        out.setdefault(name, []).append(layers or [ROOT])
    return out


def _rising(anchors: list[int | None]) -> set[int]:
    """Indices of the longest strictly rising run of anchors (None: no anchor), O(n log n).
    A kernel with the anchor of the kernel called just before it (one computation Inductor
    split in two) goes with that kernel, in the run or out of it."""
    tails: list[int] = []  # anchor value ending the best run of each length
    tail_at: list[int] = []  # ... and its index
    back: dict[int, int] = {}
    for k, a in enumerate(anchors):
        if a is None or (k and anchors[k - 1] == a):
            continue
        i = bisect.bisect_left(tails, a)
        if i == len(tails):
            tails.append(a)
            tail_at.append(k)
        else:
            tails[i], tail_at[i] = a, k
        back[k] = tail_at[i - 1] if i else -1
    run: set[int] = set()
    k = tail_at[-1] if tail_at else -1
    while k >= 0:
        run.add(k)
        k = back[k]
    for k in range(1, len(anchors)):  # in call order, so a chain of splits follows its head
        if k - 1 in run and anchors[k] is not None and anchors[k - 1] == anchors[k]:
            run.add(k)
    return run


def _graph_of(program: Any) -> dict[str, tuple[str, list[str]]]:
    """node -> (its op, the nodes it reads)."""
    return {n.name: (str(n.target), [i.name for i in n.all_input_nodes])
            for n in program.graph.nodes}


def _feeding(graph: dict[str, tuple[str, list[str]]], nodes: list[str],
             known: Container[str] = ()) -> set[str]:
    """``nodes`` and what feeds them, back to pt2e's quantize and dequantize ops (the edges of
    one int8 kernel's computation); not through ``known`` nodes (an earlier search went on
    from them)."""
    seen: set[str] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n in seen or n not in graph:
            continue
        seen.add(n)
        op, inputs = graph[n]
        if ("quantized_decomposed" not in op or n in nodes) and n not in known:
            todo.extend(inputs)
    return seen


def _op_name(target: str) -> str:
    """``aten.max_pool2d.default`` -> ``max_pool2d``."""
    parts = target.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def _library_op(kernel: str) -> str | None:
    """The aten op a library call through the C shim is named after
    (``aoti_torch_cpu__qlinear_pointwise_tensor`` -> ``linear``,
    ``aoti_torch_cpu_max_pool2d`` -> ``max_pool2d``); None for a generated kernel."""
    prefix = "aoti_torch_cpu_"
    if not kernel.startswith(prefix):
        return None
    op = kernel[len(prefix):].lstrip("_")
    if op.startswith(("qconv", "qlinear")):
        op = op[1:]
    for tail in ("_pointwise", "_out", "_tensor"):
        op = op.split(tail)[0]
    return op or None


def merge(maps: list[KernelMap | None]) -> KernelMap | None:
    """One map for the packages of one variant (one per bucket length): the first package's
    entries, with names only others have added."""
    out: KernelMap = {}
    for m in maps:
        for name, calls in (m or {}).items():
            out.setdefault(name, calls)
    return out or None
