"""Small real models for the compiler's tests: a tiny BERT sentence embedder (random weights,
the transformers implementation MiniLM uses, pooler kept so the unused-submodule trap is
exercised) with variable-length inputs, a model with data-dependent control flow, and one
built of PyTorch's own transformer layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

VOCAB = 200


class Branchy(nn.Module):
    """Data-dependent Python control flow in ``forward``: whole-model export cannot take it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.b = nn.Linear(64, 8)
        self.c = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.mean() > 0:
            return self.b(h)
        return self.c(h) * 2


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` (batch first): without gradients its layers run one fused op
    that reads their linears' weights directly."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


@pytest.fixture(scope="session")
def torch_encoder() -> dict[str, Any]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    inputs = [((torch.randn(4, 8, 32, generator=g),), {}) for _ in range(4)]
    return {"model": TorchEncoder().eval().requires_grad_(False), "inputs": inputs}


def token_batch(g: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids with real lengths from 4 to ``length``; padding 0, mask 0."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i in range(batch):
        k = int(torch.randint(4, length + 1, (1,), generator=g))
        ids[i, k:] = 0
        mask[i, k:] = 0
    return ids, mask


@pytest.fixture(scope="session")
def tiny_bert() -> dict[str, Any]:
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    from pgc_daemon.examples.minilm import SentenceEmbedder

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128,
    )
    encoder = BertModel(cfg, add_pooling_layer=True).eval()  # the pooler stays: unused
    model = SentenceEmbedder(encoder).eval()
    g = torch.Generator().manual_seed(1)
    inputs = [(token_batch(g, 1, 32), {}) for _ in range(8)]
    return {"model": model, "encoder": encoder, "inputs": inputs, "generator": g}


@pytest.fixture(scope="session")
def branchy() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Branchy().eval()
    g = torch.Generator().manual_seed(2)
    # inputs on both sides of the branch, so calibration reaches both heads
    inputs = [((torch.randn(4, 16, generator=g) + (1.5 if i % 2 else -1.5),), {}) for i in range(8)]
    with torch.no_grad():
        sides = {bool(x[0].mean() > 0) for (x, _) in inputs}
    assert sides == {True, False}
    return {"model": model, "inputs": inputs}


def examples(spec: dict[str, Any], n: int = 8) -> list[Any]:
    return [(args, {}) for args in spec["example_inputs"][:n]]


def outputs(module: nn.Module, inputs: list[Any]) -> list[Any]:
    with torch.inference_mode():
        return [module(*a, **k) for a, k in inputs]
