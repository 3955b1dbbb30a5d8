"""An offline per-layer profile of a model on given inputs, through the live profiler's own code
(every call sampled, no budget), plus a pass that finds time lost to layout conversions.

``latency_ratio`` is a layer's share of the call: its mean time without its slowest 10% of
calls, over the sum of those over every layer (the layers of a call add up to the whole call,
net of the profiler's own time). Trimmed, because on a shared machine one preempted call
would otherwise move a layer up or down the ranking by itself.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from profiler._config import ProfilerConfig
from profiler._counters import derived
from profiler._profiler import Profiler
from profiler._trace import exclusive_trace
from profiler.shapes import shape_key

Example = tuple[tuple[Any, ...], dict[str, Any]]

#: Ops that only move data into another layout (or copy it to make it contiguous).
LAYOUT_OPS = frozenset({
    "aten::contiguous", "aten::clone", "aten::_reshape_copy", "aten::to_mkldnn",
    "aten::to_dense", "aten::_to_dense", "aten::_mkldnn_reshape", "aten::_mkldnn_transpose",
})
#: Ops that copy only when their input's layout requires it; their copies count.
LAYOUT_PARENTS = frozenset({"aten::reshape", "aten::flatten", "aten::view_as", "aten::permute"})
COPY_OPS = frozenset({"aten::copy_", "aten::clone"})
_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass
class OfflineProfile:
    calls: int
    call: dict[str, float]
    layers: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    shapes: dict[str, int]
    counters: str
    device: str
    overhead: float
    layout: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_name(layer: str) -> str:
    """The layer's role across repeated blocks: ``encoder.layer.3.output.dense`` ->
    ``encoder.layer.*.output.dense``."""
    return _INDEX.sub(".*", layer)


def _call(model: nn.Module, ex: Example) -> Any:
    args, kwargs = ex
    return model(*args, **kwargs)


def profile_model(
    model: nn.Module,
    examples: Sequence[Example],
    *,
    rounds: int = 3,
    warmup: int = 2,
    counters: bool = True,
    progress: Callable[[int, int], None] | None = None,
    kernels: Any = None,
) -> OfflineProfile:
    """Profile every call of ``rounds`` passes over ``examples`` (after ``warmup`` calls);
    a compiled module through its kernels, given which layers each computes (``kernels``,
    see :mod:`profiler._compiled`)."""
    if not examples:
        raise ValueError("no example inputs to profile")
    cfg = ProfilerConfig(
        sample_every=1, budget=None, window_s=3600.0, host_interval_s=None, counters=counters,
        counter_every=1,
    )
    prof = Profiler(cfg, key_fn=lambda a, k: "all")
    prof.watch(model, kernels=kernels)
    cuda = any(p.is_cuda for p in model.parameters())
    total = rounds * len(examples)
    shapes: dict[str, int] = {}
    with torch.inference_mode():
        for i in range(warmup):
            _call(model, examples[i % len(examples)])
        if cuda:
            torch.cuda.synchronize()
        done = 0
        for _ in range(rounds):
            for ex in examples:
                args, kwargs = ex
                shapes[shape_key(args, kwargs)] = shapes.get(shape_key(args, kwargs), 0) + 1
                token = prof.begin(model)
                run = token.module if token is not None else model
                t0 = time.perf_counter_ns()
                run(*args, **kwargs)
                elapsed = time.perf_counter_ns() - t0
                prof.end(token, None, args, kwargs, elapsed)
                done += 1
                if progress is not None:
                    progress(done, total)
    status = prof.status()
    win = prof.close_window()
    prof.stop(flush=False)
    net = win.sampled[0] if win.sampled else None
    attributed = sum(row.trimmed_ms for row in win.layers) or 1e-9
    layers = []
    for row in win.layers:
        count = row.count
        sums = dict(row.counters or {})
        calls = sums.pop("calls", count) or count
        per_call = {k: v / calls for k, v in sums.items()}
        layers.append({
            "layer": row.layer,
            "op_type": row.op_type,
            "count": count,
            "mean_ms": row.mean_ms,
            "p50_ms": row.p50_ms,
            "p95_ms": row.p95_ms,
            "latency_ratio": row.trimmed_ms / attributed,
            "share": row.share,
            "counters": per_call or None,
            "derived": derived(per_call) or None,
            "kernels": list(row.kernels) if row.kernels is not None else None,
        })
    layers.sort(key=lambda r: r["latency_ratio"], reverse=True)
    groups: dict[str, dict[str, Any]] = {}
    for r in layers:
        g = groups.setdefault(group_name(r["layer"]), {
            "group": group_name(r["layer"]), "op_type": r["op_type"], "layers": 0,
            "latency_ratio": 0.0, "p50_ms": 0.0,
        })
        g["layers"] += 1
        g["latency_ratio"] += r["latency_ratio"]
        g["p50_ms"] += r["p50_ms"]
    return OfflineProfile(
        calls=net.count if net is not None else 0,
        call={k: float(getattr(net, k)) if net is not None else 0.0
              for k in ("mean_ms", "p50_ms", "p95_ms", "p99_ms")},
        layers=layers,
        groups=sorted(groups.values(), key=lambda g: g["latency_ratio"], reverse=True),
        shapes=shapes,
        counters=status["counters"],
        device="cuda" if cuda else "cpu",
        overhead=status["overhead"],
    )


def layout_conversions(model: nn.Module, examples: Sequence[Example], calls: int = 3) -> dict[str, Any]:
    """Time spent converting layouts (contiguous copies, reorders to and from MKL-DNN
    layouts, copies made by reshape/flatten of non-contiguous tensors), per call, with the
    layers it happens in. One torch.profiler pass with a named range per module."""
    import torch.nn.modules.module as _module  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

    names = {id(m): n or "(root)" for n, m in model.named_modules()}
    ranges: list[Any] = []

    def pre(mod: nn.Module, _args: Any) -> None:
        name = names.get(id(mod))
        if name is not None:
            rf = record_function(f"pgc.layer::{name}")
            rf.__enter__()
            ranges.append(rf)

    def post(mod: nn.Module, _args: Any, _out: Any) -> None:
        if id(mod) in names and ranges:
            ranges.pop().__exit__(None, None, None)

    n = max(1, min(calls, len(examples)))
    with torch.inference_mode():
        _call(model, examples[0])
        h1 = _module.register_module_forward_pre_hook(pre)
        h2 = _module.register_module_forward_hook(post, always_call=True)
        try:
            with exclusive_trace(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(n):
                    _call(model, examples[i % len(examples)])
        finally:
            h1.remove()
            h2.remove()
    events = list(prof.events())
    total_us = 0.0
    by_op: dict[str, float] = {}
    by_layer: dict[str, float] = {}
    counted: set[int] = set()
    for ev in events:
        name = ev.name
        parent = ev.cpu_parent
        chain = []
        inside_counted = False
        p = parent
        while p is not None:
            chain.append(p.name)
            inside_counted = inside_counted or id(p) in counted
            p = p.cpu_parent
        if inside_counted:
            continue  # counted at the outermost conversion
        is_layout = name in LAYOUT_OPS or (
            name in COPY_OPS and parent is not None and parent.name in LAYOUT_PARENTS
        )
        if not is_layout:
            continue
        counted.add(id(ev))
        us = float(ev.cpu_time_total)
        total_us += us
        key = name if name in LAYOUT_OPS else f"{parent.name} -> {name}"  # type: ignore[union-attr]
        by_op[key] = by_op.get(key, 0.0) + us
        layer = next((c.split("::", 1)[1] for c in chain if c.startswith("pgc.layer::")), "(outside layers)")
        by_layer[layer] = by_layer.get(layer, 0.0) + us
    root = [ev for ev in events if ev.name == "pgc.layer::(root)"]
    call_us = sum(float(ev.cpu_time_total) for ev in root) or 1.0
    return {
        "ms_per_call": total_us / 1e3 / n,
        "ratio": total_us / call_us,
        "ops": {k: v / 1e3 / n for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
        "layers": {k: v / 1e3 / n for k, v in sorted(by_layer.items(), key=lambda kv: -kv[1])[:10]},
    }
