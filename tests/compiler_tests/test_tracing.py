"""Tracing a model for the peer runtimes (``compiler._tracing``, ``compiler._ort``): what
``transformers`` decoders call while traced, and inputs bound by name. Before: every ONNX
Runtime and OpenVINO trial of a GPT-2 failed (``aten::diff``, then a ``CumSum`` of booleans,
then a ``logits_to_keep`` graph input no call fed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from compiler import Backend, Recipe, build
from compiler._tracing import diff_by_slices, plain_transformer_layers


@pytest.mark.parametrize("case", [
    {"n": 1, "dim": -1}, {"n": 2, "dim": 0}, {"n": 1, "dim": 1, "prepend": True},
    {"n": 3, "dim": -1, "prepend": True, "append": True},
])
def test_diff_by_slices_is_torch_diff(case: dict[str, Any]) -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 50, (3, 7))
    kw: dict[str, Any] = {"n": case["n"], "dim": case["dim"]}
    if case.get("prepend"):
        kw["prepend"] = x.narrow(case["dim"], 0, 1) - 1
    if case.get("append"):
        kw["append"] = x.narrow(case["dim"], 0, 2)
    assert torch.equal(diff_by_slices(x, **kw), torch.diff(x, **kw))
    flags = x > 20
    assert torch.equal(diff_by_slices(flags), torch.diff(flags))


def test_the_trace_context_puts_torch_back() -> None:
    diff, cumsum, method = torch.diff, torch.cumsum, torch.Tensor.cumsum
    flags = torch.tensor([True, False, True])
    with plain_transformer_layers():
        assert torch.diff is diff_by_slices
        assert flags.cumsum(0).dtype == torch.int64 and torch.equal(
            torch.cumsum(flags, 0), torch.tensor([1, 1, 2]))
    assert (torch.diff, torch.cumsum, torch.Tensor.cumsum) == (diff, cumsum, method)


def _gpt2() -> tuple[nn.Module, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                       n_positions=32, use_cache=False, bos_token_id=0,
                                       eos_token_id=0)).eval()
    return model, [((), {"input_ids": torch.randint(0, 64, (1, 12))}) for _ in range(4)]


@pytest.mark.parametrize("kind", ["onnxruntime", "openvino"])
def test_a_transformers_decoder_builds_on_the_peers_and_answers_as_it_does(kind: str) -> None:
    if kind == "openvino":
        pytest.importorskip("openvino")
    model, examples = _gpt2()
    built = build(model, Recipe(backend=Backend(kind, "f32") if kind == "openvino"
                                else Backend(kind)), example=examples[0])
    with torch.inference_mode():
        want = model(**examples[1][1]).logits
        got = built.module(**examples[1][1])
    got = got.logits if hasattr(got, "logits") else got[0]
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


class _Keywords(nn.Module):
    """Tensors given by keyword around a parameter the caller leaves out, and an int default."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, skipped: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, keep: int = 3) -> torch.Tensor:
        out = self.fc(x) * scale
        return out if skipped is None else out + skipped


def test_onnx_inputs_are_bound_by_name() -> None:
    torch.manual_seed(0)
    model = _Keywords().eval()
    example = ((), {"x": torch.randn(2, 8), "scale": torch.full((2, 8), 3.0)})
    built = build(model, Recipe(backend=Backend("onnxruntime")), example=example)
    other = {"x": torch.randn(2, 8), "scale": torch.full((2, 8), 0.5)}
    with torch.inference_mode():
        assert torch.allclose(built.module(**other), model(**other), atol=1e-5)
