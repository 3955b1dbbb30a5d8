"""Sibling linears as one GEMM (``compiler._siblings``) on a real BERT: which linears are
fused, that every member's output is its original linear's in any call order and from any
thread, that the fused linear is quantized and compiled like any other, and that its kernel
is split over the members it computes."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from compiler import (
    Backend,
    CompileCache,
    Fusion,
    Quantization,
    Recipe,
    build,
    compare,
    may_have_sibling_linears,
)
from compiler._pt2e import export
from compiler._kernel_map import node_layers
from compiler._registry import BuildContext, BuildReport
from compiler._siblings import SiblingSlice, fuse_siblings, fused_name, members_of

SELF = "encoder.encoder.layer.0.attention.self"
QKV = [f"{SELF}.query", f"{SELF}.key", f"{SELF}.value"]
SIBLINGS = Fusion(linear_siblings=True)
INT8 = Quantization.of({"_default": "int8-static-pc"})


def _fused(tiny_bert: dict[str, Any], recipe: Recipe) -> tuple[nn.Module, BuildContext]:
    ctx = BuildContext(calibration=[], example=tiny_bert["inputs"][0], report=BuildReport(),
                       recipe=recipe)
    return fuse_siblings(copy.deepcopy(tiny_bert["model"]), ctx), ctx


def test_query_key_and_value_become_one_linear_whose_slices_are_theirs(tiny_bert) -> None:
    model, ctx = _fused(tiny_bert, Recipe(fusion=SIBLINGS, backend=Backend("inductor")))
    mods = dict(model.named_modules())
    fused = mods[fused_name(QKV)]
    assert type(fused) is nn.Linear and fused.out_features == 3 * 64
    assert all(type(mods[n]) is SiblingSlice for n in QKV)
    assert ctx.state["handled"] >= set(QKV)  # the quantizer plans the fused linear, not them
    assert "2 group(s)" in ctx.report.notes[-1]  # one per layer; the FFN's linears are a chain
    original = dict(tiny_bert["model"].named_modules())
    x = torch.randn(1, 32, 64)
    with torch.inference_mode():
        for name in reversed(QKV):  # any order, each from the one fused call
            torch.testing.assert_close(mods[name](x), original[name](x))
        y = torch.randn(1, 32, 64)  # a member called on another tensor computes afresh
        torch.testing.assert_close(mods[QKV[1]](y), original[QKV[1]](y))
        for a, _ in tiny_bert["inputs"]:
            torch.testing.assert_close(model(*a), tiny_bert["model"](*a), atol=1e-5, rtol=1e-5)


def test_each_thread_takes_slices_of_its_own_input(tiny_bert) -> None:
    model, _ = _fused(tiny_bert, Recipe(fusion=SIBLINGS, backend=Backend("inductor")))
    inputs = tiny_bert["inputs"]
    want = [tiny_bert["model"](*a) for a, _ in inputs]
    wrong: list[int] = []
    start = threading.Barrier(4)

    def serve(k: int) -> None:
        start.wait()
        with torch.inference_mode():
            for r in range(20):
                i = (k + r) % len(inputs)
                if not torch.allclose(model(*inputs[i][0]), want[i], atol=1e-5):
                    wrong.append(i)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_siblings_are_left_apart_where_the_recipe_would_split_them(tiny_bert) -> None:
    """Members with different layer choices, or a backend that runs the graph as is."""
    mixed = Quantization.of({"_default": "int8-static-pc", QKV[1]: "fp32"})
    model, ctx = _fused(tiny_bert, Recipe(quantization=mixed, fusion=SIBLINGS,
                                          backend=Backend("inductor")))
    mods = dict(model.named_modules())
    assert type(mods[QKV[1]]) is nn.Linear and fused_name(QKV) not in mods
    assert type(mods[QKV[1].replace("layer.0", "layer.1")]) is SiblingSlice  # other layer: same
    model, ctx = _fused(tiny_bert, Recipe(fusion=SIBLINGS, backend=Backend("onnxruntime")))
    assert not any(type(m) is SiblingSlice for m in model.modules())
    assert "left apart" in ctx.report.notes[-1]


@pytest.mark.parametrize("choice", ["bf16", "int8-dynamic-pc"])
def test_a_choice_made_on_the_module_applies_to_the_fused_linear(tiny_bert, choice) -> None:
    """bf16 casts and torchao's int8 act on the fused linear as on any (its members have no
    weights of their own)."""
    from compiler._quant import quantize

    q = Quantization.of({"_default": choice})
    model, ctx = _fused(tiny_bert, Recipe(quantization=q, fusion=SIBLINGS,
                                          backend=Backend("inductor")))
    model = quantize(model, q, ctx)
    assert ctx.report.applied[fused_name(QKV)] == choice
    assert not set(QKV) & set(ctx.report.skipped)
    with torch.inference_mode():
        for a, _ in tiny_bert["inputs"][:4]:
            assert compare(tiny_bert["model"](*a), model(*a))["cosine"] > 0.99


def test_the_fused_linear_names_its_members_and_the_graph_attributes_it_to_them(tiny_bert) -> None:
    assert members_of(fused_name(QKV)) == tuple(QKV)
    assert members_of(QKV[0]) == (QKV[0],)
    assert may_have_sibling_linears(tiny_bert["model"])
    assert not may_have_sibling_linears(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    model, _ = _fused(tiny_bert, Recipe(fusion=SIBLINGS, backend=Backend("inductor")))
    layers = node_layers(export(model, tiny_bert["inputs"][0]))
    linears = [v for v in layers.values() if v and set(QKV) & set(v)]
    assert tuple(QKV) in linears


class Gate(nn.Module):
    """Three linears reading one tensor, like attention's projections, without attention
    (whose two compiled forms would double the build)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)
        self.out = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.out(torch.relu(self.a(h)) * self.b(h)) + self.c(h)


def test_a_compiled_int8_variant_runs_the_siblings_as_one_int8_kernel_split_over_them(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGC_KERNEL_PROFILE", "1")  # a kernel map to read
    torch.manual_seed(0)
    model = Gate().eval()
    cal = [((torch.randn(16, 64),), {}) for _ in range(8)]
    one = build(model, Recipe(quantization=INT8, backend=Backend("inductor"), fusion=SIBLINGS),
                calibration=cal, cache=CompileCache(tmp_path))
    members = ["a", "b", "c"]
    assert one.report.applied[fused_name(members)] == "int8-static-pc"  # quantized as any linear
    calls = [layers for kernel in one.kernel_layers.values() for layers in kernel]
    assert members in calls  # one kernel computes all three, and the rows split it over them
    assert not [[n] for n in members if [n] in calls]  # none has a kernel of its own
    assert sum(len(c) for k, c in one.kernel_layers.items() if "qlinear" in k) == 2
    with torch.inference_mode():
        for (x,), _ in cal:
            assert compare(model(x), one.module(x))["cosine"] > 0.99
