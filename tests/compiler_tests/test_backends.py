"""Backends and what wraps them: shape buckets, partition strategy, ONNX Runtime."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import (
    Backend,
    Partition,
    Quantization,
    Recipe,
    ShapeBuckets,
    build,
    compare,
    fidelity,
    warm,
)
from compiler._ort import onnx_module_name
from tests.compiler_tests.conftest import examples, outputs, token_batch

BUCKETS = ShapeBuckets((16, 32, 64))


def _unpadded(g: torch.Generator, length: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 200, (batch, length), generator=g)
    return ids, torch.ones(batch, length, dtype=torch.long)


def test_buckets_pad_pooled_models_and_give_the_unpadded_answer(tiny_bert: dict[str, Any]) -> None:
    model = tiny_bert["model"]
    built = build(model, Recipe(buckets=BUCKETS), example=tiny_bert["inputs"][0])
    seen: list[int] = []
    built.module.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[1]))  # after the pad
    assert type(built.module) is type(model)  # no wrapper: module names stay the model's
    g = torch.Generator().manual_seed(7)
    for length in (5, 16, 20, 70):
        ids, mask = _unpadded(g, length)
        with torch.inference_mode():
            ref, out = model(ids, mask), built.module(ids, mask)
        assert out.shape == ref.shape
        assert compare(ref, out)["max_abs"] < 1e-5
    assert seen == [16, 16, 32, 70]  # beyond the largest bucket: unpadded


def test_buckets_cut_token_level_outputs_back_and_leave_pooled_ones(tiny_bert: dict[str, Any]) -> None:
    encoder = tiny_bert["encoder"]
    ids, mask = tiny_bert["inputs"][0][0]
    built = build(encoder, Recipe(buckets=BUCKETS), example=((ids, mask), {}))
    assert built.module._pgc_buckets.token_leaves == frozenset({0})  # last_hidden_state, not pooled
    g = torch.Generator().manual_seed(8)
    ids, mask = _unpadded(g, 11)
    with torch.inference_mode():
        ref, out = encoder(ids, mask), built.module(ids, mask)
    assert out.last_hidden_state.shape == ref.last_hidden_state.shape == (2, 11, 64)
    assert torch.allclose(out.last_hidden_state, ref.last_hidden_state, atol=1e-5)
    assert torch.allclose(out.pooler_output, ref.pooler_output, atol=1e-5)


def test_memory_partition_compiles_block_by_block_without_frozen_copies(tiny_bert: dict[str, Any]) -> None:
    model = tiny_bert["model"]
    recipe = Recipe(backend=Backend("inductor"), partition=Partition("memory"))
    built = build(model, recipe, example=tiny_bert["inputs"][0])
    layers = built.module.encoder.encoder.layer
    assert all(type(layer).__name__ == "OptimizedModule" for layer in layers)
    assert type(built.module).__name__ == "SentenceEmbedder"  # glue stays eager
    assert isinstance(layers[0]._orig_mod.attention.self.query.weight, torch.nn.Parameter)
    assert any("2 blocks compiled" in n for n in built.report.notes)
    ins = tiny_bert["inputs"][:3]
    assert fidelity("cosine", outputs(model, ins), outputs(built.module, ins)) > 0.99999
    latency = build(model, Recipe(backend=Backend("inductor")))
    assert type(latency.module).__name__ == "OptimizedModule"


def test_onnxruntime_backend_runs_the_exported_model(cnn_spec: dict[str, Any]) -> None:
    pytest.importorskip("onnxruntime")
    test = examples(cnn_spec, 4)
    built = build(cnn_spec["model"], Recipe(backend=Backend("onnxruntime")), example=test[0])
    assert built.report.compiled
    # its own thread pool: the agent's thread tuner leaves it alone (torch's count doesn't reach it)
    assert built.own_pool
    assert not build(cnn_spec["model"], Recipe(), example=test[0]).own_pool
    for ref, out in zip(outputs(cnn_spec["model"], test), outputs(built.module, test)):
        assert compare(ref, out)["max_abs"] < 1e-4
    warm(built, [((torch.cat([test[0][0][0]] * 3),), {})])  # any batch size
    # idle intra-op threads sleep: spinning ones fight a busy core (see compiler/_ort.py)
    options = built.module.session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_onnxruntime_quantizes_the_recipes_int8_layers_only(cnn_spec: dict[str, Any], scheme: str) -> None:
    pytest.importorskip("onnxruntime")
    rules = {"_default": f"int8-{scheme}-pc", "head.3": "fp32"}
    cal = examples(cnn_spec, 8)
    built = build(cnn_spec["model"], Recipe(quantization=Quantization.of(rules), backend=Backend("onnxruntime")),
                  calibration=cal)
    expected = {"head.1"} if scheme == "dynamic" else {"features.0", "features.3", "features.7", "head.1"}
    assert set(built.report.applied) == expected
    assert all("onnxruntime int8" in built.report.kernel_paths[n] for n in expected)
    test = examples(cnn_spec, 10)
    assert fidelity("top1", outputs(cnn_spec["model"], test), outputs(built.module, test)) >= 0.97


def test_onnxruntime_maps_transformer_layer_names(tiny_bert: dict[str, Any]) -> None:
    pytest.importorskip("onnxruntime")
    model = tiny_bert["model"]
    rules = {"_default": "int8-dynamic-pc", r"re:.*\.output\.dense": "fp32"}
    built = build(model, Recipe(quantization=Quantization.of(rules), backend=Backend("onnxruntime")),
                  example=tiny_bert["inputs"][0])
    applied = set(built.report.applied)
    assert "encoder.encoder.layer.1.intermediate.dense" in applied
    assert "encoder.encoder.layer.0.attention.self.query" in applied
    assert not any(n.endswith("output.dense") and "attention" not in n for n in applied)
    g = torch.Generator().manual_seed(3)
    ids, mask = token_batch(g, 2, 24)
    with torch.inference_mode():
        assert compare(model(ids, mask), built.module(ids, mask))["cosine"] > 0.99


def test_onnx_node_names_map_back_to_module_names() -> None:
    assert onnx_module_name("/net/net.0/Gemm") == "net.0"
    assert onnx_module_name("/encoder/layer.0/output/dense/MatMul") == "encoder.layer.0.output.dense"
    assert onnx_module_name("/head/Gemm") == "head"
