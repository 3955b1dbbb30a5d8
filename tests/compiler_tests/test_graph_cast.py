"""bf16 layers inside an exported int8 graph (``compiler._graph_cast``): the layer really
computes in bf16 (eager graph and compiled package), its neighbours keep their types, and
quantized layers are left alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import Backend, Quantization, Recipe, build, fidelity, probe
from compiler._graph_cast import cast_layers, module_of
from tests.compiler_tests.conftest import examples, outputs

LINEAR = torch.ops.aten.linear.default
CONV = torch.ops.aten.conv2d.default


def _layer_nodes(gm: torch.fx.GraphModule, target: Any) -> dict[str, torch.fx.Node]:
    return {
        module_of(n): n for n in gm.graph.nodes if n.op == "call_function" and n.target == target
    }


def _weight(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor:
    arg = node.args[1]
    assert arg.op == "get_attr"
    return (
        gm.get_buffer(arg.target)
        if arg.target.startswith("_pgc_")
        else gm.get_parameter(arg.target)
    )


def _mix(layer: str, choice: str) -> Recipe:
    return Recipe(quantization=Quantization.of({"_default": "int8-static-pc", layer: choice}))


def test_a_bf16_layer_of_an_int8_recipe_computes_in_bf16_inside_the_graph(
    mlp_spec: dict[str, Any],
) -> None:
    cal, test = examples(mlp_spec, 4), examples(mlp_spec, 20)
    built = build(mlp_spec["model"], _mix("net.3", "bf16"), calibration=cal)
    fp32_kept = build(mlp_spec["model"], _mix("net.3", "fp32"), calibration=cal)
    assert built.report.applied == {
        "net.1": "int8-static-pc",
        "net.3": "bf16",
        "net.5": "int8-static-pc",
    }
    assert built.report.skipped == {}
    assert "inside the int8 graph" in built.report.kernel_paths["net.3"]
    gm = built.module
    assert isinstance(gm, torch.fx.GraphModule)
    node = _layer_nodes(gm, LINEAR)["net.3"]
    assert _weight(gm, node).dtype == torch.bfloat16  # a bf16 constant, not cast per call
    assert node.args[2] is not None and gm.get_buffer(node.args[2].target).dtype == torch.bfloat16
    (user,) = node.users  # the output goes back to fp32 before anything else reads it
    assert user.target == torch.ops.aten.to.dtype and user.args[1] == torch.float32
    assert not any(n.target.startswith("net.3.") for n in gm.graph.nodes if n.op == "get_attr")
    ref, got, kept = (
        outputs(mlp_spec["model"], test),
        outputs(gm, test),
        outputs(fp32_kept.module, test),
    )
    assert all(g.dtype == torch.float32 for g in got)
    assert fidelity("top1", ref, got) >= 0.97
    # bf16 arithmetic shows: close to the same recipe with the layer in fp32, not equal to it
    diff = max(float((g - k).abs().max()) for g, k in zip(got, kept))
    scale = max(float(k.abs().max()) for k in kept)
    assert 0 < diff < 0.05 * scale


def test_a_compiled_bf16_layer_runs_oneDNNs_bf16_kernel_not_an_fp32_one(
    mlp_spec: dict[str, Any],
) -> None:
    hw = probe()
    if (
        hw.arch not in ("x86_64", "AMD64")
        or not hw.bf16_fast
        or not torch.backends.mkldnn.is_available()
    ):
        pytest.skip("bf16 layers compile to oneDNN bf16 kernels on x86 CPUs with bf16 units")
    cal, test = examples(mlp_spec, 4), examples(mlp_spec, 10)
    inductor = Backend("inductor")
    mixed = build(
        mlp_spec["model"],
        Recipe(quantization=_mix("net.3", "bf16").quantization, backend=inductor),
        calibration=cal,
        example=test[0],
    )
    kept = build(
        mlp_spec["model"],
        Recipe(quantization=_mix("net.3", "fp32").quantization, backend=inductor),
        calibration=cal,
        example=test[0],
    )
    kernels = mixed.report.kernel_paths["<compiled>"]
    assert "oneDNN int8 linear x2" in kernels and "oneDNN fused linear x1" in kernels
    assert "2 bf16 constants" in kernels  # its weight and bias, packed for the bf16 kernel
    assert "bf16" not in kept.report.kernel_paths["<compiled>"]
    eager = build(mlp_spec["model"], _mix("net.3", "bf16"), calibration=cal)
    got, want = outputs(mixed.module, test), outputs(eager.module, test)
    assert fidelity("cosine", want, got) >= 0.999


def test_a_bf16_conv_joins_an_int8_cnn(cnn_spec: dict[str, Any]) -> None:
    built = build(cnn_spec["model"], _mix("features.0", "bf16"), calibration=examples(cnn_spec))
    assert built.report.applied["features.0"] == "bf16"
    assert built.report.applied["features.3"] == "int8-static-pc"
    node = _layer_nodes(built.module, CONV)["features.0"]
    assert _weight(built.module, node).dtype == torch.bfloat16
    test = examples(cnn_spec, 20)
    assert fidelity("top1", outputs(cnn_spec["model"], test), outputs(built.module, test)) >= 0.97


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + ids.float().sum()


def test_tied_weights_get_one_constant_and_quantized_or_named_out_layers_are_left_alone() -> None:
    model = _Tied().eval()
    x, ids = torch.randn(2, 8), torch.arange(4)
    gm = torch.export.export(model, (x, ids)).module()
    want = model(x, ids)
    assert cast_layers(gm, {"c": torch.bfloat16}) == set()  # no such layer: nothing changes
    assert cast_layers(gm, {"a": torch.bfloat16, "b": torch.bfloat16}) == {"a", "b"}
    nodes = _layer_nodes(gm, LINEAR)
    assert (
        nodes["a"].args[1].target == nodes["b"].args[1].target
    )  # one bf16 copy of the tied weight
    got = gm(x, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
    assert cast_layers(gm, {"a": torch.bfloat16}) == set()  # already bf16: not cast twice
