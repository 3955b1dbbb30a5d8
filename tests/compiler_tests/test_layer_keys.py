"""Layer keys ``re:<pattern>`` are matched by RE2 in bounded time: a recipe key can never
freeze the process that builds the variant (the agent builds inside the user's server)."""

from __future__ import annotations

import time

import pytest

from compiler import LayerQuant, Quantization, Recipe, RecipeError
from compiler.recipe import MAX_KEY_CHARS

NAMES = [f"model.encoder.layer.{i % 12}.attention.self.query_{i}" for i in range(200)]


@pytest.mark.parametrize(
    "key",
    [
        # ten ``.*``: Python's re took 35.7 s per module name (polynomial backtracking)
        "re:" + ".*" * 10 + "x_",
        # nested stars: exponential backtracking in a backtracking engine
        "re:(.*)*(.*)*(.*)*(.*)*(.*)*x",
        "re:(a|aa)*(a|aa)*(a|aa)*b",
    ],
)
def test_a_pathological_key_is_matched_against_200_module_names_in_well_under_a_second(key: str) -> None:
    q = Quantization.of({key: "bf16", "_default": "int8-dynamic-pc"})
    started = time.perf_counter()
    decided = [q.choice_for(name) for name in NAMES]
    took = time.perf_counter() - started
    assert took < 0.5, f"{took:.2f}s to match {len(NAMES)} names"
    # nothing ends in "x" or "b": every name falls through to the default
    assert {key for _, key in decided} == {"_default"}


def test_the_catastrophic_flat_key_is_refused_at_validation() -> None:
    # what the API accepted and the agent then hung on: 148 ``.*`` (299 characters)
    key = "re:" + ".*" * 148 + "x"
    with pytest.raises(RecipeError, match="at most"):
        Quantization.of({key: "bf16"})
    with pytest.raises(ValueError):  # RecipeError is a ValueError: the API answers 422
        Recipe.from_dict({"version": 1, "quantization": {key: {"precision": "bf16"}}})


def test_a_long_key_under_the_bound_still_matches_in_linear_time() -> None:
    key = "re:" + ".*" * ((MAX_KEY_CHARS - 4) // 2) + "x"
    assert len(key) <= MAX_KEY_CHARS
    q = Quantization.of({key: "bf16"})
    started = time.perf_counter()
    assert [q.choice_for(n)[1] for n in NAMES] == [None] * len(NAMES)
    assert q.choice_for("net.x") == (LayerQuant("bf16"), key)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize(
    "key",
    [
        "re:(?=net)net.*",  # look-ahead: RE2 has none
        r"re:(net)\.\1",  # backreference
        "re:a{1001}",  # repetition past RE2's bound
        "re:((a{100}){100}){100}",  # a program past the memory bound
        "re:(unclosed",
    ],
)
def test_keys_re2_cannot_compile_are_refused(key: str) -> None:
    with pytest.raises(RecipeError, match="bad regex"):
        Quantization.of({key: "bf16"})


def test_ordinary_keys_match_as_before() -> None:
    q = Quantization.of({r"re:layer\.\d+\.out": "fp16", "re:enc.*": "bf16", "layer.1.out": "int8-dynamic-pc"})
    assert q.choice_for("layer.2.out") == (LayerQuant("fp16"), r"re:layer\.\d+\.out")
    assert q.choice_for("layer.1.out")[1] == "layer.1.out"
    assert q.choice_for("encoder.x")[1] == "re:enc.*"
    assert q.choice_for("xenc")[1] is None  # a full match, not a search
