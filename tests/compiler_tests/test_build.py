"""compiler.build on a real (digits-trained) model: what it changes, and what it never does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import Backend, BuildError, Quantization, Recipe, build, fidelity, warm


def _examples(spec: dict[str, Any], n: int = 8) -> list[Any]:
    return [(args, {}) for args in spec["example_inputs"][:n]]


def _outputs(module: torch.nn.Module, examples: list[Any]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [module(*a, **k) for a, k in examples]


def test_build_never_changes_the_original(mlp_spec: dict[str, Any]) -> None:
    model = mlp_spec["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    built = build(model, Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"})))
    assert built.module is not model
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


@pytest.mark.parametrize("choice", ["int8-dynamic-pc", "int8-dynamic-pt", "int8-weight_only-pc"])
def test_int8_goes_only_where_the_recipe_says(mlp_spec: dict[str, Any], choice: str) -> None:
    recipe = Recipe(quantization=Quantization.of({"net.1": choice, "net.5": choice}))
    built = build(mlp_spec["model"], recipe)
    assert set(built.report.applied) == {"net.1", "net.5"}
    modules = dict(built.module.named_modules())
    assert type(modules["net.1"].weight).__name__ != "Parameter" or modules["net.1"].weight.dtype != torch.float32
    assert modules["net.3"].weight.dtype == torch.float32
    assert type(modules["net.3"].weight) is torch.nn.Parameter
    examples = _examples(mlp_spec)
    score = fidelity("top1", _outputs(mlp_spec["model"], examples), _outputs(built.module, examples))
    assert score >= 0.95


def test_default_applies_to_every_linear_and_names_nothing_else(mlp_spec: dict[str, Any]) -> None:
    built = build(mlp_spec["model"], Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"})))
    assert set(built.report.applied) == {"net.1", "net.3", "net.5"}
    assert built.report.skipped == {}


def test_unsupported_layer_named_explicitly_is_skipped_with_a_reason(cnn_spec: dict[str, Any]) -> None:
    built = build(cnn_spec["model"], Recipe(quantization=Quantization.of({"features.1": "int8-dynamic-pc"})))
    assert "features.1" in built.report.skipped
    assert "BatchNorm2d" in built.report.skipped["features.1"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_layers_keep_float32_at_their_boundaries(mlp_spec: dict[str, Any], precision: str) -> None:
    built = build(mlp_spec["model"], Recipe(quantization=Quantization.of({"net.3": precision})))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert dict(built.module.named_modules())["net.3"].weight.dtype == dtype
    out = _outputs(built.module, _examples(mlp_spec, 2))
    assert all(o.dtype == torch.float32 for o in out)
    ref = _outputs(mlp_spec["model"], _examples(mlp_spec, 2))
    assert fidelity("sqnr", ref, out) > 0.999


def test_inductor_backend_compiles_and_matches_eager(mlp_spec: dict[str, Any]) -> None:
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))
    built = build(mlp_spec["model"], recipe)
    assert built.report.compiled and not built.hookable
    examples = _examples(mlp_spec)
    warm(built, examples[:1])
    eager = build(mlp_spec["model"], Recipe(quantization=recipe.quantization))
    assert fidelity("cosine", _outputs(eager.module, examples), _outputs(built.module, examples)) > 0.999


def test_a_variant_that_cannot_run_fails_warm_up_with_build_error(mlp_spec: dict[str, Any]) -> None:
    built = build(mlp_spec["model"], Recipe())
    with pytest.raises(BuildError):
        warm(built, [((torch.zeros(2, 3),), {})])  # wrong input shape for the model


class _Loud(torch.nn.Module):
    """Fails the way Inductor's lowering errors do: a line that names the failure, one that
    says where, then hundreds of lines of IR."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("Pointwise\n  target: the op it could not lower\n"
                                  + "  args[0]: TensorBox(StorageBox(\n" * 200)


def test_a_failed_build_says_why_in_one_line_and_keeps_the_cause() -> None:
    """Seen on an int8 ResNet: a trial's reason (in the CLI's progress, the store, the API and
    the dashboard) was 189 lines of Inductor IR."""
    with pytest.raises(BuildError) as info:
        build(_Loud(), Recipe(backend=Backend("inductor")), example=((torch.randn(2, 4),), {}))
    said = str(info.value)
    assert "\n" not in said and len(said) < 400, said
    assert said.startswith("building fp32 · inductor failed: ") and "the op it could not" in said
    assert "args[0]" in str(info.value.__cause__)  # the whole story, for the debug log
