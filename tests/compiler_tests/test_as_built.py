"""A peer backend's recipe written as what the backend builds of it (``compiler.as_built``):
the label says what runs, and a recipe and its rewrite build the very same variant."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import Backend, Quantization, Recipe, as_built, build
from tests.compiler_tests.conftest import examples, outputs


def _recipe(backend: str, **rules: str) -> Recipe:
    quant = Quantization.of({k.replace("__", "."): v for k, v in rules.items()})
    return Recipe(quantization=quant, backend=Backend.parse(backend))


@pytest.mark.parametrize(("recipe", "label"), [
    # float layer choices and int8 weight-only are not built by either peer
    (_recipe("onnxruntime", _default="bf16"), "fp32 · onnxruntime"),
    (_recipe("openvino", _default="fp16", net__1="int8-weight_only-pc"), "fp32 · openvino"),
    # one int8 form where the default is int8: ONNX Runtime's scheme and granularity
    (_recipe("onnxruntime", _default="int8-dynamic-pc", net__1="int8-static-pc", net__3="bf16",
             net__5="int8-dynamic-pc"), "int8-dynamic-pc+2 fp32 · onnxruntime"),
    (_recipe("onnxruntime", _default="int8-weight_only-pc", net__1="int8-static-pc"),
     "fp32 · onnxruntime"),
    # NNCF: dynamic built as static, one weight granularity
    (_recipe("openvino", _default="int8-dynamic-pc", net__1="int8-static-pt",
             net__3="int8-dynamic-pc"), "int8-static-pc+1 fp32 · openvino"),
    (_recipe("openvino-f32", _default="int8-static-pt"), "int8-static-pt · openvino-f32"),
    # what needs the graph's order to say is left as written
    (_recipe("onnxruntime", _default="fp32", net__1="int8-static-pc", net__3="int8-dynamic-pt"),
     "fp32+1 int8-dynamic-pt,1 int8-static-pc · onnxruntime"),
    # PyTorch's backends build every choice
    (_recipe("inductor", _default="bf16", net__1="int8-weight_only-pc"),
     "bf16+1 int8-weight_only-pc · inductor"),
])
def test_a_recipe_is_written_as_its_backend_builds_it(recipe: Recipe, label: str) -> None:
    assert as_built(recipe).label() == label
    assert as_built(as_built(recipe)) == as_built(recipe)


@pytest.mark.parametrize(("asked", "backend"), [
    ({"_default": "int8-dynamic-pc", "net.3": "bf16", "net.5": "int8-static-pc"}, "onnxruntime"),
    ({"_default": "int8-dynamic-pc", "net.1": "int8-static-pt"}, "openvino-f32"),
])
def test_a_recipe_and_its_rewrite_build_the_same_variant(
    mlp_spec: dict[str, Any], asked: dict[str, str], backend: str
) -> None:
    inputs = examples(mlp_spec, 8)
    recipe = Recipe(quantization=Quantization.of(asked), backend=Backend.parse(backend))
    rewritten = as_built(recipe)
    assert rewritten != recipe and rewritten.hash != recipe.hash
    first = build(mlp_spec["model"], recipe, calibration=inputs)
    second = build(mlp_spec["model"], rewritten, calibration=inputs)
    assert first.report.skipped and not second.report.skipped  # nothing left to say it skipped
    assert first.report.applied.keys() == second.report.applied.keys()  # the same int8 layers
    for a, b in zip(outputs(first.module, inputs), outputs(second.module, inputs)):
        assert torch.equal(a, b)
