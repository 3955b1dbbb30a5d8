"""Every recipe part: JSON round-trip, validation, registered transform, and the promise that
adding parts left the JSON and hashes of existing recipes unchanged."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from compiler import (
    Backend,
    DynamicShapes,
    Fusion,
    Kernels,
    LayerQuant,
    Layout,
    Partition,
    Quantization,
    Recipe,
    RecipeError,
    ShapeBuckets,
    registered_parts,
)

PARTS: list[Any] = [
    LayerQuant(),
    LayerQuant("bf16"),
    LayerQuant("fp16"),
    LayerQuant("int8", "dynamic", "per_tensor"),
    LayerQuant("int8", "static", "per_channel"),
    LayerQuant("int8", "weight_only", "per_channel"),
    Quantization(),
    Quantization.of({"_default": "int8-static-pc", r"re:.*\.output\.dense": "fp32", "head": "int8-dynamic-pt"}),
    Backend(),
    Backend("inductor"),
    Backend("inductor", "max-autotune"),
    Backend("onnxruntime"),
    Fusion(),
    Fusion(conv_bn=True),
    Fusion(conv_bn=True, conv_bn_relu=True, linear_act=True),
    Layout(),
    Layout("channels_last"),
    Kernels(),
    Kernels("triton"),
    ShapeBuckets(),
    ShapeBuckets((64, 128, 256, 512)),
    ShapeBuckets((8, 16), dim=0, pad_value=1),
    Partition(),
    Partition("memory"),
    DynamicShapes(),
    DynamicShapes(1),
]


@pytest.mark.parametrize("part", PARTS, ids=lambda p: f"{type(p).__name__}:{p.to_dict()}")
def test_every_part_round_trips_through_json(part: Any) -> None:
    text = json.dumps(part.to_dict())
    again = type(part).from_dict(json.loads(text))
    assert again == part
    assert dataclasses.is_dataclass(part)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(part, dataclasses.fields(part)[0].name, None)


def test_every_recipe_part_has_a_registered_transform() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(Recipe)}
    part_types = {type(getattr(Recipe(), name)) for name in fields}
    assert part_types <= set(registered_parts())
    assert set(Recipe.APPLY_ORDER) == set(fields)


INVALID = [
    lambda: Fusion(conv_bn=1),  # type: ignore[arg-type]
    lambda: Fusion(conv_bn_relu=True),
    lambda: Fusion.from_dict({"conv_bn": True, "fold": True}),
    lambda: Layout("nhwc"),
    lambda: Layout.from_dict({"memory_format": "channels_last", "x": 1}),
    lambda: Kernels("cuda"),
    lambda: ShapeBuckets((128, 64)),
    lambda: ShapeBuckets((64, 64)),
    lambda: ShapeBuckets((0, 64)),
    lambda: ShapeBuckets((64.0, 128)),  # type: ignore[arg-type]
    lambda: ShapeBuckets((64,), dim=-1),
    lambda: ShapeBuckets((64,), pad_value=0.5),  # type: ignore[arg-type]
    lambda: ShapeBuckets(tuple(range(1, 40))),
    lambda: ShapeBuckets.from_dict({"sizes": 64}),
    lambda: Partition("throughput"),
    lambda: Backend("onnxruntime", "max-autotune"),
    lambda: Recipe(fusion=Layout()),  # type: ignore[arg-type]
    lambda: Recipe.from_json('{"version": 1, "layout": {"memory_format": "nchw"}}'),
    lambda: Recipe.from_json('{"version": 1, "buckets": {"sizes": [512, 64]}}'),
    lambda: Recipe.from_json('{"version": 1, "partition": "memory"}'),
    lambda: DynamicShapes(dim=-1),
    lambda: DynamicShapes(dim=True),  # type: ignore[arg-type]
    lambda: Recipe.from_json('{"version": 1, "dynamic": {"dim": 1, "max": 512}}'),
    lambda: Recipe.from_json('{"version": 1, "dynamic": 1}'),
    lambda: Recipe(buckets=ShapeBuckets((64, 128)), dynamic=DynamicShapes(1)),
]


@pytest.mark.parametrize("make", INVALID)
def test_invalid_parts_are_rejected_with_a_value_error(make: Any) -> None:
    with pytest.raises(RecipeError) as info:
        make()
    assert isinstance(info.value, ValueError) and str(info.value)


# Known values computed before the new parts existed: the store keys variants by them.
OLD = [
    (Recipe(), '{"version":1,"quantization":{},"backend":{"kind":"eager","mode":"default"}}',
     "39d396af8456404f727819f901b549accc97cf1694ec745da7b95e385dc1c72d"),
    (Recipe(backend=Backend("inductor")),
     '{"version":1,"quantization":{},"backend":{"kind":"inductor","mode":"default"}}',
     "5c0f513c425da69144f9ebb567115c94cbcff850ec0cef7f94232f94488b09d3"),
    (Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor", "max-autotune")),
     None, "5ccd3efcd474c4b3cb7316bf469ef68a6663cbf18da3ae67104e12ee21e2c279"),
    (Recipe(quantization=Quantization.of(
        {"_default": "int8-static-pc", r"re:.*\.output\.dense": "fp32", "head": "int8-weight_only-pt"})),
     None, "11c267da77398221bd2aff5201b527d7dbff5c8e9d7fc69dc1e52a681d3b326c"),
]


@pytest.mark.parametrize("recipe,text,digest", OLD, ids=lambda x: x.label() if isinstance(x, Recipe) else "")
def test_existing_recipes_keep_their_json_and_hash(recipe: Recipe, text: str | None, digest: str) -> None:
    if text is not None:
        assert recipe.to_json() == text
        assert Recipe.from_json(text) == recipe
    assert recipe.hash == digest
    assert set(json.loads(recipe.to_json())) == {"version", "quantization", "backend"}


NEW = [
    Recipe(fusion=Fusion(conv_bn=True)),
    Recipe(layout=Layout("channels_last"), backend=Backend("inductor")),
    Recipe(kernels=Kernels("triton"), quantization=Quantization.of({"_default": "int8-weight_only-pc"})),
    Recipe(buckets=ShapeBuckets((64, 128, 256, 512))),
    Recipe(partition=Partition("memory"), backend=Backend("inductor")),
    Recipe(dynamic=DynamicShapes(1), backend=Backend("inductor")),
    Recipe(
        quantization=Quantization.of({"_default": "int8-static-pc", "encoder.layer.0.output.dense": "fp32"}),
        backend=Backend("inductor"), fusion=Fusion(True, True, True), layout=Layout("channels_last"),
        buckets=ShapeBuckets((64, 128)), partition=Partition("memory"),
    ),
]


@pytest.mark.parametrize("recipe", NEW, ids=lambda r: r.label())
def test_recipes_with_new_parts_round_trip_and_hash_apart(recipe: Recipe) -> None:
    again = Recipe.from_json(recipe.to_json())
    assert again == recipe and again.hash == recipe.hash
    assert recipe.hash != Recipe(quantization=recipe.quantization, backend=recipe.backend).hash
    assert not recipe.is_identity
    written = json.loads(recipe.to_json())
    for name in ("fusion", "layout", "kernels", "buckets", "partition", "dynamic"):
        assert (name in written) == (getattr(recipe, name) != getattr(Recipe(), name))


def test_labels_name_the_new_parts() -> None:
    r = Recipe(buckets=ShapeBuckets((64, 128)), layout=Layout("channels_last"), partition=Partition("memory"))
    assert r.label() == "fp32 · eager · channels_last · buckets 64/128 · memory"
    assert Recipe().label() == "fp32 · eager"
    assert Recipe(dynamic=DynamicShapes(1)).label() == "fp32 · eager · dynamic dim 1"


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_length() -> None:
    b = ShapeBuckets((64, 128, 256, 512))
    assert [b.bucket_for(n) for n in (1, 64, 65, 512, 513)] == [64, 64, 128, 512, None]
