"""The GPU path as far as a CPU machine goes: fp8 as a layer choice (torchao's float8 dynamic
activations, per-row scales), offered only for a model on a GPU with float8 tensor cores; the
search's space for a model on a GPU (half precisions, fp8, int8 weight-only through pgc's
Triton kernel, Inductor only; no x86-only static int8, no CPU runtimes) and its baselines.
The builds themselves are checked on a GPU (marked ``gpu``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import BuildError, Hardware, Kernels, LayerQuant, Quantization, Recipe, build
from pgc_daemon.optimizer.search import space as space_module
from pgc_daemon.optimizer.search.offers import GPU_BACKENDS, backends_for, choices_for
from pgc_daemon.optimizer.search.space import build_space

CPU = Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True, "avx512_bf16": True})


def _gpu(capability: tuple[int, int]) -> Hardware:
    return Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True}, cuda=True,
                    gpu="NVIDIA test", gpu_capability=capability)


def test_fp8_is_a_layer_choice_that_round_trips() -> None:
    fp8 = LayerQuant.parse("fp8")
    assert fp8.label() == "fp8" and fp8.precision == "fp8" and fp8.scheme is None
    recipe = Recipe(quantization=Quantization.of({"_default": "fp8", "net.5": "fp32"}))
    again = Recipe.from_json(recipe.to_json())
    assert again == recipe and again.hash == recipe.hash
    assert again.quantization.choice_for("net.1")[0].label() == "fp8"
    assert "fp8" in recipe.label()


def test_fp8_is_offered_only_for_a_model_on_a_gpu_with_float8_tensor_cores() -> None:
    assert "fp8" in choices_for(_gpu((9, 0)), gpu=True)  # Hopper
    assert "fp8" in choices_for(_gpu((8, 9)), gpu=True)  # Ada
    assert "fp8" not in choices_for(_gpu((8, 0)), gpu=True)  # Ampere: no float8 units
    assert _gpu((9, 0)).fp8_fast and not _gpu((8, 0)).fp8_fast and not CPU.fp8_fast
    # a model served on the CPU of a machine with a GPU gets the CPU's choices
    on_cpu = choices_for(_gpu((9, 0)), gpu=False)
    assert not {"fp8", "fp16"} & set(on_cpu) and "int8-static-pc" in on_cpu
    assert "bf16" in choices_for(CPU) and "fp8" not in choices_for(CPU)
    assert "int8-static-pc" not in choices_for(_gpu((9, 0)), gpu=True)  # pt2e's x86 quantizer


def test_an_fp8_build_on_cpu_is_refused_with_the_reason(mlp_spec: dict[str, Any]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU test covers it")
    recipe = Recipe(quantization=Quantization.of({"_default": "fp8"}))
    with pytest.raises(BuildError, match="fp8 needs a CUDA GPU of compute capability 8.9"):
        build(mlp_spec["model"], recipe)


def test_the_space_for_a_model_on_a_gpu(mlp_spec: dict[str, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Which device the model is on decides the space (here the model is said to be on a GPU:
    nothing in building a space touches the device)."""
    monkeypatch.setattr(space_module, "on_gpu", lambda _model: True)
    hopper = _gpu((9, 0))
    space = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], hopper,
                        backends=("inductor", "inductor-max", "inductor-max+bf16", "eager",
                                  "onnxruntime", "openvino"))
    assert space.gpu and space.backends == GPU_BACKENDS  # CPU runtimes and autocast left out
    assert set(space.layer_choices) == {"fp32", "fp16", "bf16", "fp8", "int8-weight_only-pc",
                                        "int8-dynamic-pc"}
    tried = [(p["default"], p["backend"]) for p in space.baselines()]
    assert tried == [("fp32", "inductor"), ("fp16", "inductor-max"), ("bf16", "inductor-max"),
                     ("fp8", "inductor-max"), ("int8-weight_only-pc", "inductor-max")]
    wo = space.recipe(space.params("int8-weight_only-pc", "inductor-max"))
    assert wo.kernels == Kernels("triton")  # pgc's Triton kernel, called from Inductor's code
    assert space.recipe(space.params("fp16", "inductor")).kernels.is_identity
    assert space.to_dict()["gpu"] is True
    ampere = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], _gpu((8, 0)),
                         backends=backends_for(CPU))
    assert ("fp8", "inductor-max") not in [(p["default"], p["backend"])
                                           for p in ampere.baselines()]


def test_the_space_for_a_model_on_the_cpu_is_unchanged(mlp_spec: dict[str, Any]) -> None:
    space = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], _gpu((9, 0)),
                        backends=("inductor", "eager"))
    assert not space.gpu and "fp16" not in space.layer_choices
    assert space.baselines()[1] == space.params("int8-static-pc", "inductor")
    wo = space.recipe(space.params("int8-weight_only-pc", "inductor"))
    assert wo.kernels.is_identity


@pytest.mark.gpu
def test_fp8_layers_run_on_a_gpu_with_float8_tensor_cores(mlp_spec: dict[str, Any]) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU of compute capability 8.9 or newer")
    model = mlp_spec["model"].to("cuda").to(torch.bfloat16)
    built = build(model, Recipe(quantization=Quantization.of({"_default": "fp8"})))
    assert all(built.report.applied.get(n) == "fp8" for n in ("net.1", "net.3", "net.5"))
    x = mlp_spec["example_inputs"][0][0].to("cuda").to(torch.bfloat16)
    with torch.inference_mode():
        ref, out = model(x), built.module(x)
    assert (ref.argmax(-1) == out.argmax(-1)).float().mean() > 0.95
