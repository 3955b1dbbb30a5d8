"""Recipes: validation, JSON round-trip, hashing, per-layer matching priority."""

from __future__ import annotations

import json

import pytest

from compiler import Backend, LayerQuant, Quantization, Recipe, RecipeError

RECIPES = [
    Recipe(),
    Recipe(backend=Backend("inductor")),
    Recipe(backend=Backend("inductor", "max-autotune")),
    Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"})),
    Recipe(
        quantization=Quantization.of(
            {
                "_default": "int8-dynamic-pt",
                r"re:.*\.output\.dense": "fp32",
                "encoder.layer.0.intermediate.dense": "bf16",
                "head": "int8-weight_only-pc",
            }
        ),
        backend=Backend("inductor"),
    ),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.label())
def test_json_round_trip_is_exact(recipe: Recipe) -> None:
    text = recipe.to_json()
    again = Recipe.from_json(text)
    assert again == recipe
    assert again.hash == recipe.hash
    assert json.loads(text)["version"] == 1


def test_hash_is_stable_and_order_insensitive_for_exact_names() -> None:
    a = Recipe(quantization=Quantization.of({"x": "int8-dynamic-pc", "y": "fp16"}))
    b = Recipe(quantization=Quantization.of({"y": "fp16", "x": "int8-dynamic-pc"}))
    assert a == b and a.hash == b.hash
    # a known value: a recipe's hash must not change between releases or processes
    assert Recipe().hash == Recipe.from_json('{"version":1}').hash
    assert len(Recipe().hash) == 64
    c = Recipe(quantization=Quantization.of({"x": "int8-dynamic-pt", "y": "fp16"}))
    assert c.hash != a.hash


def test_regex_order_is_priority() -> None:
    q = Quantization.of({"re:a.*": "fp16", "re:ab.*": "bf16"})
    assert q.choice_for("abc")[0].precision == "fp16"
    q2 = Quantization.of({"re:ab.*": "bf16", "re:a.*": "fp16"})
    assert q2.choice_for("abc")[0].precision == "bf16"
    assert Recipe(quantization=q).hash != Recipe(quantization=q2).hash


def test_matching_priority_exact_over_regex_over_default() -> None:
    q = Quantization.of(
        {"_default": "int8-dynamic-pc", r"re:layer\.\d+\.out": "fp16", "layer.1.out": "bf16"}
    )
    assert q.choice_for("layer.1.out") == (LayerQuant("bf16"), "layer.1.out")
    assert q.choice_for("layer.2.out") == (LayerQuant("fp16"), r"re:layer\.\d+\.out")
    assert q.choice_for("other")[1] == "_default"
    assert Quantization().choice_for("anything") == (LayerQuant(), None)


@pytest.mark.parametrize(
    "make",
    [
        lambda: LayerQuant("int4"),
        lambda: LayerQuant("int8"),
        lambda: LayerQuant("int8", "sometimes"),
        lambda: LayerQuant("fp16", "dynamic"),
        lambda: LayerQuant("int8", "dynamic", "per_block"),
        lambda: Backend("tvm"),
        lambda: Backend("eager", "max-autotune"),
        lambda: Quantization.of({"re:(unclosed": "fp16"}),
        lambda: Quantization.of({"": "fp16"}),
        lambda: Quantization((("a", "fp16"),)),  # type: ignore[arg-type]
        lambda: LayerQuant.parse("int8-fast"),
        lambda: Recipe.from_json("{not json"),
        lambda: Recipe.from_json('{"version": 2}'),
        lambda: Recipe.from_json('{"version": 1, "quantisation": {}}'),
        lambda: Recipe.from_json('{"backend": {"kind": "inductor", "extra": 1}}'),
        lambda: Recipe.from_json("[1, 2]"),
        lambda: Recipe(backend="inductor"),  # type: ignore[arg-type]
    ],
)
def test_invalid_values_are_rejected_with_a_value_error(make: object) -> None:
    with pytest.raises(RecipeError) as info:
        make()  # type: ignore[operator]
    assert isinstance(info.value, ValueError)
    assert str(info.value)


def test_labels_parse_back() -> None:
    for text in ("fp32", "bf16", "fp16", "int8-dynamic-pc", "int8-static-pt", "int8-weight_only-pc"):
        assert LayerQuant.parse(text).label() == text


#: Hashes printed by the code before the choices became enums (stored in the store and the
#: compile cache, so they may never change): the JSON and the hash of a recipe are its words.
PINNED = [
    ({}, "39d396af8456404f727819f901b549accc97cf1694ec745da7b95e385dc1c72d"),
    (
        {
            "quantization": {
                "_default": {"precision": "int8", "scheme": "dynamic", "granularity": "per_channel"},
                "re:enc.*": {"precision": "bf16"},
                "fc": "int8-static-pt",
            },
            "backend": {"kind": "inductor", "mode": "max-autotune"},
        },
        "e40528bf61f1a0e16a0279f7003c59250b98de98b85e50b7ae03c2d42e52ac6e",
    ),
    (
        {
            "quantization": {"_default": "fp16"},
            "backend": {"kind": "eager", "mode": "default"},
            "fusion": {"conv_bn": True, "conv_bn_relu": True, "linear_act": False},
            "layout": {"memory_format": "channels_last"},
            "kernels": {"linear": "triton"},
            "buckets": {"sizes": [64, 128]},
            "partition": {"strategy": "memory"},
        },
        "5aa202cbba0646c7b2af51e92e91b0c932a91db56dd51f01c739d5f92530c00f",
    ),
    (
        {"quantization": {"_default": "int8-weight_only-pc"}, "backend": {"kind": "onnxruntime"}},
        "a4b8e87d54706b7cb729e07f172f977b2900d5ac02438db9e704365d8bae2eb8",
    ),
]


@pytest.mark.parametrize(("data", "digest"), PINNED, ids=range(len(PINNED)))
def test_recipe_hashes_are_pinned(data: dict, digest: str) -> None:
    recipe = Recipe.from_dict(data)
    assert recipe.hash == digest
    assert Recipe.from_json(recipe.to_json()).hash == digest
    # the JSON holds plain words, not enum members
    assert all(type(v) is str for v in json.loads(recipe.to_json())["backend"].values())


def test_choices_are_enums_and_take_their_words() -> None:
    from compiler.recipe import BackendKind, Granularity, Precision, Scheme

    q = LayerQuant("int8", "static", "per_tensor")
    assert q.precision is Precision.INT8 and q.scheme is Scheme.STATIC
    assert q.granularity is Granularity.PER_TENSOR
    assert q == LayerQuant(Precision.INT8, Scheme.STATIC, Granularity.PER_TENSOR)
    assert hash(q) == hash(LayerQuant(Precision.INT8, Scheme.STATIC, Granularity.PER_TENSOR))
    assert Backend("inductor").kind is BackendKind.INDUCTOR and Backend("inductor").kind == "inductor"
    for bad in (1, None, ["int8"], "INT8"):
        with pytest.raises(RecipeError, match="precision must be one of"):
            LayerQuant(bad)  # type: ignore[arg-type]
