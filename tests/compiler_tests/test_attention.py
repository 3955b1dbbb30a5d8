"""Attention in its plain form (matmul, softmax, matmul) where that is faster: the form
computes what the fused kernel does, the first package of an attention shape is compiled both
ways and timed, the faster form is remembered, and sites that cannot be lowered stay fused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiler import _attention, _measure
from compiler._aoti import PackageRunner, compile_package, relative_error, summarize_package

OPTIONS = {"freezing": True}


@pytest.fixture(autouse=True)
def fresh_choices() -> Iterator[None]:
    _measure.forget()
    yield
    _measure.forget()


def _qkv(g: torch.Generator, n: int = 24, m: int = 24) -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 4, n, 16, generator=g), torch.randn(2, 4, m, 16, generator=g),
            torch.randn(2, 4, m, 16, generator=g))


@pytest.mark.parametrize("case", ["none", "padded keys", "additive", "causal", "scale"])
def test_the_plain_form_computes_what_the_fused_kernel_does(case: str) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(g)
    kwargs: dict[str, Any] = {}
    if case == "padded keys":  # as a text model's padding mask: the last keys of one row off
        mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
        mask[1, ..., 17:] = False
        kwargs["attn_mask"] = mask
    elif case == "additive":
        kwargs["attn_mask"] = torch.randn(2, 1, 24, 24, generator=g)
    elif case == "causal":
        kwargs["is_causal"] = True
    elif case == "scale":
        kwargs["scale"] = 0.3
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    got = _attention.math_attention(q, k, v, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_row_whose_every_key_is_masked_stays_finite() -> None:
    q, k, v = _qkv(torch.Generator().manual_seed(0))
    mask = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    mask[0, 0, 3, :] = False
    out = _attention.math_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()


def _program(model: nn.Module, example: Any, dynamic: Any = None) -> Any:
    args, kwargs = example
    with torch.no_grad():
        return torch.export.export(model, tuple(args), dict(kwargs), strict=False, dynamic_shapes=dynamic)


def test_a_new_attention_shape_is_compiled_both_ways_and_the_faster_form_is_kept_and_remembered(
    tiny_bert: dict[str, Any], tmp_path: Path
) -> None:
    model, example = tiny_bert["model"], tiny_bert["inputs"][0]
    att = _attention.find(_program(model, example))
    assert att is not None and att.sites == 2 and att.choice is None  # two layers, nothing known

    notes: list[str] = []
    path = tmp_path / "first.pt2"
    compile_package(model, example, path, OPTIONS, notes=notes)
    known = _measure.remembered(f"attention {att.what}")
    assert known is not None
    choice, ms = known
    assert set(ms) == {"fused", "math"} and choice == min(ms, key=ms.__getitem__)
    assert notes == [att.note(choice, ms)] and "the whole package, both ways" in notes[0]
    kernels = summarize_package(path)
    assert ("bmm" in kernels) == (choice == "math")
    assert ("flash_attention" in kernels) == (choice == "fused")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.pt2"]  # the loser is gone
    with torch.no_grad():
        assert relative_error(model(*example[0]), PackageRunner(path)(*example)) < 1e-4

    notes2: list[str] = []
    compile_package(model, example, tmp_path / "second.pt2", OPTIONS, notes=notes2)
    assert "measured on an earlier package" in notes2[0]
    assert summarize_package(tmp_path / "second.pt2") == kernels


@pytest.mark.parametrize("form", ["math", "fused"])
def test_a_remembered_form_is_compiled_once_in_that_form(
    form: str, tiny_bert: dict[str, Any], tmp_path: Path
) -> None:
    model, example = tiny_bert["model"], tiny_bert["inputs"][0]
    att = _attention.find(_program(model, example))
    assert att is not None
    _measure.choose(f"attention {att.what}", {form: lambda: None})  # as if measured before

    path = tmp_path / "model.pt2"
    compile_package(model, example, path, OPTIONS)
    kernels = summarize_package(path)
    if form == "math":
        assert "bmm" in kernels and "flash_attention" not in kernels
    else:
        assert "flash_attention" in kernels and "bmm" not in kernels
    with torch.no_grad():
        assert relative_error(model(*example[0]), PackageRunner(path)(*example)) < 1e-4


class _Attend(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


def test_sites_with_symbolic_shapes_or_large_score_matrices_stay_fused_untimed() -> None:
    q, k, v = _qkv(torch.Generator().manual_seed(0))
    seq = torch.export.Dim("seq", min=2, max=512)
    dyn = {"q": {2: seq}, "k": {2: seq}, "v": {2: seq}}
    att = _attention.find(_program(_Attend(), ((q, k, v), {}), dyn))
    assert att is not None and att.choice == "fused" and att.why == "symbolic shapes"

    big = [torch.empty(1, 16, 2048, 16) for _ in range(3)]  # 16 x 2048 x 2048 fp32 scores: 256 MiB
    att = _attention.find(_program(_Attend(), (tuple(big), {})))
    assert att is not None and att.choice == "fused" and att.why == "score matrix of 256 MiB"
    assert _measure.remembered(f"attention {att.what}") is None
