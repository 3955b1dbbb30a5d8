"""What a peer backend builds of a recipe.

ONNX Runtime (``compiler._ort``) and OpenVINO with NNCF (``compiler._openvino_nncf``) build
int8 static and dynamic layers and run every other layer in their own float precision:
fp16, bf16 and fp8 choices and int8 weight-only are not built (the build reports each such
layer as skipped). OpenVINO builds a dynamic choice as a static one (NNCF calibrates every
activation scale). Where the default is int8, both take one int8 form for the whole model:
ONNX Runtime one scheme and granularity (the default's), NNCF one weight granularity, and
a layer asking another stays float.

:func:`as_built` writes a recipe as what such a backend builds of it, so a variant's label
says what runs (a search had chosen "bf16 · onnxruntime", which ran in fp32), and recipes
that build the same variant are one recipe: the search measures it once. Other backends'
recipes are returned as they are. What needs the model's graph to say (which layer is first
in graph order, which is a convolution) is left as written.
"""

from __future__ import annotations

from dataclasses import replace

from compiler.recipe import DEFAULT_KEY, FP32, LayerQuant, Quantization, Recipe

_PEERS = ("onnxruntime", "openvino")


def _built(choice: LayerQuant, kind: str, chosen: LayerQuant | None) -> LayerQuant:
    if choice.precision != "int8" or choice.scheme == "weight_only":
        return FP32
    if kind == "openvino":
        choice = replace(choice, scheme="static")
        if chosen is not None and choice.granularity != chosen.granularity:
            return FP32
    elif chosen is not None and choice != chosen:
        return FP32
    return choice


def as_built(recipe: Recipe) -> Recipe:
    """``recipe`` as its backend builds it (see the module docstring)."""
    kind = recipe.backend.kind
    if kind not in _PEERS or recipe.quantization.is_identity:
        return recipe
    rules = dict(recipe.quantization.rules)
    default = rules.get(DEFAULT_KEY)
    # the int8 form the whole model takes where the default is int8 (ONNX Runtime: any int8
    # default, weight-only too, which leaves every layer float; NNCF: static or dynamic)
    chosen = default if default is not None and default.precision == "int8" and (
        kind == "onnxruntime" or default.scheme != "weight_only") else None
    built = {key: _built(choice, kind, chosen) for key, choice in rules.items()}
    base = built.get(DEFAULT_KEY, FP32)
    kept = {k: c for k, c in built.items() if k == DEFAULT_KEY or c != base}
    quant = Quantization.of(kept) if any(not c.is_identity for c in kept.values()) else Quantization()
    return replace(recipe, quantization=quant)
