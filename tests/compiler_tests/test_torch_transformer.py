"""Models built of PyTorch's own transformer layers (``nn.TransformerEncoderLayer``,
``nn.MultiheadAttention``). Without gradients these run one fused op that reads their linears'
weights directly, and ``MultiheadAttention`` never calls its ``out_proj``: each backend has to
see the plain layers. Regressions found running ``pgc optimize`` on such a model (digits rows
through a 2-layer ``nn.TransformerEncoder``): every ONNX Runtime trial failed, NNCF quantized
only the head, int8 dynamic through Inductor ran at 0.18x fp32 eager, and bf16 failed to
build."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from compiler import Backend, Quantization, Recipe, _measure, build, compare

LINEARS = {"enc.layers.0.linear1", "enc.layers.0.linear2", "enc.layers.1.linear1",
           "enc.layers.1.linear2", "head"}


@pytest.fixture(autouse=True)
def _fresh_choices() -> Any:
    _measure.forget()
    yield
    _measure.forget()


def _build(spec: dict[str, Any], rules: dict[str, str], backend: Backend) -> Any:
    with torch.no_grad():  # as a search worker builds
        built = build(spec["model"], Recipe(quantization=Quantization.of(rules), backend=backend),
                      example=spec["inputs"][0], calibration=spec["inputs"])
    assert torch.backends.mha.get_fastpath_enabled()  # the process-wide switch is back on
    return built


def _cosines(spec: dict[str, Any], module: Any) -> list[float]:
    with torch.inference_mode():
        return [compare(spec["model"](*a), module(*a))["cosine"] for a, _ in spec["inputs"]]


def test_onnxruntime_exports_them_as_plain_layers(torch_encoder: dict[str, Any]) -> None:
    pytest.importorskip("onnxruntime")
    built = _build(torch_encoder, {"_default": "int8-dynamic-pc"}, Backend("onnxruntime"))
    assert LINEARS <= set(built.report.applied)
    assert min(_cosines(torch_encoder, built.module)) > 0.99


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None or
                    importlib.util.find_spec("nncf") is None, reason="needs the openvino extra")
def test_nncf_quantizes_them_layer_by_layer(torch_encoder: dict[str, Any]) -> None:
    built = _build(torch_encoder, {"_default": "int8-static-pc"}, Backend("openvino", "f32"))
    assert LINEARS <= set(built.report.applied)
    plain = _build(torch_encoder, {}, Backend("openvino", "f32"))
    assert min(_cosines(torch_encoder, plain.module)) > 0.9999
    # random weights, 4 calibration inputs, NNCF's transformer preset (the attention's
    # matmuls in int8 too): 0.96-0.99 here, where a wrong graph gives noise
    assert min(_cosines(torch_encoder, built.module)) > 0.95


def test_int8_dynamic_through_inductor_takes_the_pt2e_path(torch_encoder: dict[str, Any]) -> None:
    """torchao's int8 tensors inside these layers broke the compiled graph at every layer."""
    built = _build(torch_encoder, {"_default": "int8-dynamic-pc"}, Backend("inductor"))
    paths = built.report.kernel_paths
    assert "pt2e path: enc.layers.0.linear1 is inside TransformerEncoderLayer" in paths["head"]
    assert "oneDNN int8 linear" in paths["<compiled>"]
    assert LINEARS <= set(built.report.applied)
    assert min(_cosines(torch_encoder, built.module)) > 0.99


@pytest.mark.parametrize("backend", [Backend("inductor"), Backend("eager")], ids=str)
def test_bf16_builds_and_leaves_the_attentions_out_proj_to_it(
    torch_encoder: dict[str, Any], backend: Backend
) -> None:
    """out_proj's weight in bf16 met the attention's fp32 activations: the build failed."""
    built = _build(torch_encoder, {"_default": "bf16"}, backend)
    assert LINEARS <= set(built.report.applied)
    assert not any("out_proj" in n for n in built.report.applied)
    assert min(_cosines(torch_encoder, built.module)) > 0.999
    named = _build(torch_encoder, {"enc.layers.0.self_attn.out_proj": "bf16"}, Backend("eager"))
    assert "reads its weight directly" in named.report.skipped["enc.layers.0.self_attn.out_proj"]


def test_max_autotune_is_told_to_write_no_choices_to_the_terminal() -> None:
    """Inductor writes each autotuning's choices to stderr unless told not to; a search on
    this kind of model printed them into the user's terminal. (Not reproduced by a compile
    here: the choices print only where autotuning really runs, which depends on the graph.)"""
    from compiler._backend import compile_options

    options = compile_options(Backend("inductor", "max-autotune"))
    assert options["autotune_num_choices_displayed"] == 0
    assert options["max_autotune_report_choices_stats"] is False
