"""Fusion and layout on real models: what they change, that outputs stay the same, and the
kernel path each site reports."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compiler import Backend, Fusion, Layout, Quantization, Recipe, build, compare
from compiler._fusion import FusedConv2d, FusedLinear
from tests.compiler_tests.conftest import examples, outputs


def test_conv_bn_folding_removes_every_batchnorm_and_keeps_outputs(cnn_spec: dict[str, Any]) -> None:
    built = build(cnn_spec["model"], Recipe(fusion=Fusion(conv_bn=True)))
    mods = dict(built.module.named_modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in mods.values())
    assert isinstance(mods["features.1"], nn.Identity)
    assert built.report.applied["features.1"] == "folded into features.0"
    test = examples(cnn_spec, 4)
    for ref, out in zip(outputs(cnn_spec["model"], test), outputs(built.module, test)):
        assert compare(ref, out)["max_abs"] < 1e-3
    # the original keeps its BatchNorms
    assert isinstance(dict(cnn_spec["model"].named_modules())["features.1"], nn.BatchNorm2d)


def test_conv_bn_relu_and_linear_act_fuse_with_a_measured_kernel(cnn_spec: dict[str, Any]) -> None:
    recipe = Recipe(fusion=Fusion(conv_bn=True, conv_bn_relu=True, linear_act=True))
    built = build(cnn_spec["model"], recipe, example=examples(cnn_spec, 1)[0])
    mods = dict(built.module.named_modules())
    assert type(mods["features.0"]) is FusedConv2d and type(mods["head.1"]) is FusedLinear
    assert isinstance(mods["features.2"], nn.Identity) and isinstance(mods["head.2"], nn.Identity)
    for name in ("features.0", "features.3", "features.7", "head.1"):
        assert "measured" in built.report.kernel_paths[name]
        assert mods[name].kernel in ("aten", "onednn")
    test = examples(cnn_spec, 4)
    for ref, out in zip(outputs(cnn_spec["model"], test), outputs(built.module, test)):
        assert compare(ref, out)["max_abs"] < 1e-3


def test_both_kernel_paths_of_a_fused_layer_agree(cnn_spec: dict[str, Any]) -> None:
    built = build(cnn_spec["model"], Recipe(fusion=Fusion(conv_bn=True, conv_bn_relu=True)),
                  example=examples(cnn_spec, 1)[0])
    conv = dict(built.module.named_modules())["features.3"]
    x = torch.randn(8, 32, 8, 8)
    with torch.inference_mode():
        conv.kernel = "aten"
        a = conv(x)
        conv.kernel = "onednn"
        b = conv(x)
    assert (a >= 0).all() and torch.allclose(a, b, atol=1e-4)


def test_linear_act_in_a_custom_forward_is_found_by_tracing(tiny_bert: dict[str, Any]) -> None:
    built = build(tiny_bert["model"], Recipe(fusion=Fusion(linear_act=True)), example=tiny_bert["inputs"][0])
    mods = dict(built.module.named_modules())
    name = "encoder.encoder.layer.0.intermediate.dense"
    assert type(mods[name]) is FusedLinear and mods[name].act == "gelu"
    assert isinstance(mods["encoder.encoder.layer.0.intermediate.intermediate_act_fn"], nn.Identity)
    ins = tiny_bert["inputs"][:3]
    for ref, out in zip(outputs(tiny_bert["model"], ins), outputs(built.module, ins)):
        assert compare(ref, out)["cosine"] > 0.99999


def test_fusion_leaves_quantized_layers_and_compiled_backends_to_their_own_kernels(
    cnn_spec: dict[str, Any],
) -> None:
    recipe = Recipe(fusion=Fusion(True, True, True), quantization=Quantization.of({"head.1": "int8-dynamic-pc"}))
    built = build(cnn_spec["model"], recipe, example=examples(cnn_spec, 1)[0])
    assert "head.2" in built.report.skipped and type(dict(built.module.named_modules())["head.1"]) is not FusedLinear
    compiled = build(cnn_spec["model"], Recipe(fusion=Fusion(True, True), backend=Backend("inductor")))
    assert "left to Inductor" in compiled.report.kernel_paths["features.0"]
    assert not any(type(m) is FusedConv2d for m in compiled.module.modules())


def test_channels_last_converts_conv_weights_and_inputs(cnn_spec: dict[str, Any]) -> None:
    built = build(cnn_spec["model"], Recipe(layout=Layout("channels_last")))
    conv = dict(built.module.named_modules())["features.0"]
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    seen: list[bool] = []
    conv.register_forward_pre_hook(lambda _m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last)))
    test = examples(cnn_spec, 2)
    for ref, out in zip(outputs(cnn_spec["model"], test), outputs(built.module, test)):
        assert compare(ref, out)["max_abs"] < 1e-4
    assert seen and all(seen)
    assert built.report.applied["features.0"] == "channels_last"


def test_channels_last_on_a_model_without_convolutions_changes_nothing(mlp_spec: dict[str, Any]) -> None:
    built = build(mlp_spec["model"], Recipe(layout=Layout("channels_last")))
    assert built.report.applied == {} and any("no 2-D convolutions" in n for n in built.report.notes)
