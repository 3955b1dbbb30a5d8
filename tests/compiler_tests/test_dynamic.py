"""Variable-length inputs served unpadded: dynamic shapes, the checks that keep buckets and
dynamic packages honest, and the recompile limit caught instead of printed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from compiler import (
    Backend,
    BuildError,
    CompileCache,
    DynamicShapes,
    Partition,
    Quantization,
    Recipe,
    ShapeBuckets,
    build,
    compare,
    load_artifact,
    probe,
    recompile_limit_hits,
)
from compiler._aoti import AotiModule

LENGTHS = (5, 9, 14, 22, 31, 40, 57, 80)


def _sentences(n: int) -> list[tuple[tuple[torch.Tensor, torch.Tensor], dict]]:
    """all-MiniLM-L6-v2's tokenizer on the example corpus, unpadded: one length each."""
    from pgc_daemon.examples import minilm

    out = []
    for text in minilm.sentences()[:n]:
        enc = minilm.tokenizer()([text], truncation=True, max_length=128, return_tensors="pt")
        out.append(((enc["input_ids"], enc["attention_mask"]), {}))
    return out


def _at(length: int, g: torch.Generator, vocab: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(1, vocab, (1, length), generator=g), torch.ones(1, length, dtype=torch.long)


@pytest.mark.slow
def test_minilm_int8_with_a_dynamic_sequence_serves_every_length_from_one_package(
    tmp_path, capfd
) -> None:
    from pgc_daemon.examples import minilm

    model = minilm.load_model().eval()
    inputs = _sentences(40)
    lengths = sorted({x[0][0].shape[1] for x in inputs})
    assert len(lengths) >= 10  # the traffic really varies
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}),
                    backend=Backend("inductor"), dynamic=DynamicShapes(1))
    cache = CompileCache(tmp_path)
    hits = recompile_limit_hits()[0]
    built = build(model, recipe, calibration=inputs[:8], example=inputs[0], cache=cache)
    module = built.module
    assert isinstance(module, AotiModule) and not module.runners and len(module.dynamic) == 1
    assert any("one package for lengths" in n for n in built.report.notes), built.report.notes
    # int8 against fp32. Without VNNI activations are quantized to 7 bits (reduce_range), and
    # the int8 graph itself is further off: cosine 0.968 at worst over these 40 sentences,
    # measured as the eager q/dq graph on an AVX2-only EPYC; the package matched it.
    floor = 0.98 if probe().int8_fast else 0.96
    with torch.inference_mode():
        for (args, _), n in zip(inputs, range(len(inputs))):
            got = compare(model(*args), module(*args))
            assert got["cosine"] > floor, (n, args[0].shape, got)
    assert module.shape_misses == 0  # not one length ran the fp32 fallback
    # another process's view: the artifact loads as the same dynamic package
    loaded = load_artifact(model, recipe, built.artifact, cache=cache).module
    with torch.inference_mode():
        for args, _ in inputs[::7]:
            assert torch.equal(loaded(*args), module(*args))
    assert loaded.shape_misses == 0
    assert recompile_limit_hits()[0] == hits
    assert "recompil" not in capfd.readouterr().err


def test_fp32_compiled_with_a_dynamic_sequence_matches_fp32_at_every_length(
    tiny_bert: dict[str, Any], capfd
) -> None:
    model = tiny_bert["model"]
    hits = recompile_limit_hits()[0]
    g = torch.Generator().manual_seed(3)
    for recipe in (
        Recipe(backend=Backend("inductor"), dynamic=DynamicShapes(1)),  # one AOTI package
        Recipe(backend=Backend("inductor"), dynamic=DynamicShapes(1),  # torch.compile
               partition=Partition("memory")),
    ):
        built = build(model, recipe, example=tiny_bert["inputs"][0])
        with torch.inference_mode():
            for length in LENGTHS:
                ids, mask = _at(length, g)
                want, got = model(ids, mask), built.module(ids, mask)
                assert got.shape == want.shape
                assert compare(want, got)["max_abs"] < 1e-4, (recipe.label(), length)
        assert getattr(built.module, "shape_misses", 0) == 0
    assert recompile_limit_hits()[0] == hits  # eight lengths, no recompile per length
    assert "recompil" not in capfd.readouterr().err


class _FixedLength(nn.Module):
    """A model that fixes its sequence length: a learned table as long as the example."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 16)
        self.pos = nn.Parameter(torch.randn(1, 32, 16))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.emb(ids) + self.pos).mean(dim=1)


def test_a_model_that_fixes_its_length_fails_a_dynamic_build_with_the_reason(capfd) -> None:
    g = torch.Generator().manual_seed(0)
    model = _FixedLength().eval()
    with pytest.raises(BuildError, match="the model fixes the length of that axis"):
        build(model, Recipe(backend=Backend("inductor"), dynamic=DynamicShapes(1)),
              example=(_at(32, g), {}))
    assert "Traceback" not in capfd.readouterr().err  # one line, from pgc, not torch's log


class _ReadsPadding(nn.Module):
    """Mean-pools every token, masked or not: padding changes its answer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(dim=1)


def test_buckets_are_refused_for_a_model_whose_output_padding_changes(
    tiny_bert: dict[str, Any]
) -> None:
    g = torch.Generator().manual_seed(0)
    with pytest.raises(BuildError, match="reads its padding"):
        build(_ReadsPadding().eval(), Recipe(buckets=ShapeBuckets((16, 32))),
              example=(_at(12, g), {}))
    # a model that honours its mask passes the same check
    built = build(tiny_bert["model"], Recipe(buckets=ShapeBuckets((16, 32))),
                  example=tiny_bert["inputs"][0])
    assert built.module is not None


def test_a_static_variant_fed_other_lengths_is_caught_not_printed(
    tiny_bert: dict[str, Any], capfd
) -> None:
    """The two ways a static variant stops measuring itself on variable-length traffic, each
    reported as the trial's result (``_shape_fallback``) and neither on the terminal."""
    from compiler import silence_recompile_limit
    from pgc_daemon.optimizer.search.trial import _shape_fallback

    silence_recompile_limit()  # as every trial does in a search process
    model = tiny_bert["model"]
    g = torch.Generator().manual_seed(5)
    packaged = build(model, Recipe(backend=Backend("inductor")), example=tiny_bert["inputs"][0])
    assert isinstance(packaged.module, AotiModule)
    with torch.inference_mode():
        for length in LENGTHS:
            packaged.module(*_at(length, g))
    why = _shape_fallback(packaged.module, 0, len(LENGTHS), recompile_limit_hits()[0])
    assert why is not None and f"{len(LENGTHS)} of {len(LENGTHS)} timed calls" in why

    hits = recompile_limit_hits()[0]
    compiled = build(model, Recipe(backend=Backend("inductor"), partition=Partition("memory")),
                     example=tiny_bert["inputs"][0])
    try:
        with torch.inference_mode():
            for length in range(6, 6 + 2 * LENGTHS.__len__() + 2):  # past the limit of 8
                compiled.module(*_at(length, g))
        assert recompile_limit_hits()[0] > hits
        why = _shape_fallback(compiled.module, 0, 18, hits)
        assert why is not None and "recompile limit" in why and "size mismatch" in why
    finally:
        torch._dynamo.reset()
    err = capfd.readouterr().err
    assert "recompile_limit" not in err and "recompil" not in err
