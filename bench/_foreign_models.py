"""Models written the way users write them, not the way pgc's examples are: PyTorch's own
transformer layers, dict and tuple outputs, keyword inputs, recurrent layers, depthwise
convolutions with a squeeze-excite gate, an ``EmbeddingBag`` over integer ids, a branch on
the input's values, a dataclass output, a list of tensors in, hand-written causal attention
over ``F.scaled_dot_product_attention`` with an RMS norm, a model served in bfloat16, a model
that returns class ids, and two models of Hugging Face ``transformers`` (a ViT over the image's
2x2 patches, a GPT-2 reading the pixels as tokens), as their library writes them. Each is
trained on scikit-learn's bundled digits (no download), seeded and single-threaded, so every
process builds bit-identical weights (a live search checks that by fingerprint).

MODEL_SPECs: ``bench._foreign_models:encoder`` (and the others :data:`SPECS` lists).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pgc_daemon.examples.digits import accuracy, data, train

SPECS = ("encoder", "dict_out", "conv1d", "gru", "mobile", "bag", "branchy", "dataclass_out",
         "list_in", "causal", "half", "labels_out", "hf_vit", "hf_gpt2")


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` over the image's 8 rows (its fused fast path without grad)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x.reshape(x.shape[0], 8, 8))).mean(1))


class DictOut(nn.Module):
    """Returns a dict of logits and features."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256))
        self.cls = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"logits": self.cls(h), "features": h}


class Conv1dNet(nn.Module):
    """Depthwise-separable ``Conv1d`` over rows, ``GroupNorm``, ``SiLU``."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(
            nn.Conv1d(8, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.SiLU(),
            nn.Conv1d(64, 64, 3, padding=1, groups=64), nn.Conv1d(64, 128, 1), nn.SiLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x.reshape(x.shape[0], 8, 8))


class GRUNet(nn.Module):
    """A two-layer GRU called with keyword inputs, one of them optional."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 96, batch_first=True, num_layers=2)
        self.head = nn.Linear(96, 10)

    def forward(self, pixels: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        x = pixels.reshape(pixels.shape[0], 8, 8)
        if scale is not None:
            x = x * scale
        out, _ = self.gru(x)
        return self.head(out[:, -1])


class Mobile(nn.Module):
    """Depthwise-separable ``Conv2d`` with batch norms, ``Hardswish`` and a squeeze-excite
    gate; returns a tuple (logits, probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16),
                                  nn.Hardswish())
        self.dw = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.Hardswish(),
            nn.Conv2d(16, 32, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(32, 8, 1), nn.ReLU(),
                                nn.Conv2d(8, 32, 1), nn.Sigmoid())
        self.head = nn.Linear(32 * 64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.dw(self.stem(x))
        logits = self.head((h * self.se(h)).flatten(1))
        return logits, logits.softmax(-1)


class Bag(nn.Module):
    """An ``EmbeddingBag`` over integer ids (each pixel's position and level), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(17 * 64, 64, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids))


class Branchy(nn.Module):
    """Takes one of two paths by the batch's mean intensity: Python control flow on a tensor's
    value, which ``torch.export`` cannot trace without ``torch.cond``."""

    def __init__(self) -> None:
        super().__init__()
        self.dark = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.bright = nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], 64)
        if x.mean() > 0.3:
            return self.bright(x)
        return self.dark(x)


@dataclass
class Output:
    """An output type in the style of a model hub's ``ModelOutput``: a plain dataclass."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 128), nn.Tanh())
        self.cls = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.body(x.reshape(x.shape[0], 64))
        return Output(logits=self.cls(h), hidden=h)


class ListIn(nn.Module):
    """Two views of the image (top and bottom halves) passed as one list argument."""

    def __init__(self) -> None:
        super().__init__()
        self.top = nn.Linear(32, 96)
        self.bottom = nn.Linear(32, 96)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(192, 10))

    def forward(self, views: list[torch.Tensor]) -> torch.Tensor:
        return self.head(torch.cat([self.top(views[0]), self.bottom(views[1])], dim=-1))


def _views(x: torch.Tensor) -> list[torch.Tensor]:
    flat = x.reshape(x.shape[0], 64)
    return [flat[:, :32].contiguous(), flat[:, 32:].contiguous()]


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Causal(nn.Module):
    """A decoder block as written by hand: fused ``qkv`` projection split into heads, causal
    ``scaled_dot_product_attention``, RMS norms, a SiLU-gated MLP; rows as tokens."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(8, d)
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 2 * d, bias=False)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.reshape(x.shape[0], 8, 8))
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        n = self.norm2(h)
        h = h + self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))
        return self.head(h[:, -1])


class LabelsOut(nn.Module):
    """Returns the predicted class ids (int64) beside the probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.net(x).softmax(-1)
        return probs.argmax(-1), probs


def _ids(x: torch.Tensor) -> torch.Tensor:
    return (x.reshape(x.shape[0], 64) * 16).round().long() + 17 * torch.arange(64)


def hf_vit_model() -> nn.Module:
    """``transformers``' ViT for image classification, sized for 8x8 digits: 16 patches."""
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=256, num_labels=10))


def hf_gpt2_model() -> nn.Module:
    """``transformers``' GPT-2 for sequence classification over 64 pixel tokens (17 levels);
    its padding token is one no image has, so every row is classified at its last pixel."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    return GPT2ForSequenceClassification(GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=18, num_labels=10,
        pad_token_id=17, bos_token_id=17, eos_token_id=17))


def _pixels(x: torch.Tensor) -> torch.Tensor:
    return (x.reshape(x.shape[0], 64) * 16).round().long()


def _logits_accuracy(outputs: Sequence[Any], labels: Sequence[Any]) -> float:
    """:func:`accuracy` of a model hub output's ``logits``."""
    return accuracy([o.logits for o in outputs], labels)


class _Trainable(nn.Module):
    """What ``train`` needs: images in, logits out."""

    def __init__(self, model: nn.Module, adapt: Callable[[nn.Module, torch.Tensor], Any]) -> None:
        super().__init__()
        self.model, self.adapt = model, adapt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapt(self.model, x)


_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, torch.Tensor], Any]]] = {
    "encoder": (Encoder, lambda m, x: m(x)),
    "dict_out": (DictOut, lambda m, x: m(x)["logits"]),
    "conv1d": (Conv1dNet, lambda m, x: m(x)),
    "gru": (GRUNet, lambda m, x: m(pixels=x)),
    "mobile": (Mobile, lambda m, x: m(x)[0]),
    "bag": (Bag, lambda m, x: m(_ids(x))),
    "branchy": (Branchy, lambda m, x: m(x)),
    "dataclass_out": (DataclassOut, lambda m, x: m(x).logits),
    "list_in": (ListIn, lambda m, x: m(_views(x))),
    "causal": (Causal, lambda m, x: m(x)),
    "half": (Conv1dNet, lambda m, x: m(x)),
    "labels_out": (LabelsOut, lambda m, x: m.net(x)),
    "hf_vit": (hf_vit_model, lambda m, x: m(pixel_values=x).logits),
    "hf_gpt2": (hf_gpt2_model, lambda m, x: m(input_ids=_pixels(x)).logits),
}


@functools.lru_cache(maxsize=None)
def _trained(kind: str) -> nn.Module:
    make, adapt = _MODELS[kind]
    # seeded before construction too: MultiheadAttention initializes outside reset_parameters
    torch.manual_seed(0)
    return train(_Trainable(make(), adapt)).model.eval()


def _spec(kind: str, batch: int, inputs: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    _, _, xt, yt = data()
    starts = range(0, len(xt) - batch + 1, batch)
    return {"model": _trained(kind), "example_inputs": [inputs(xt[i:i + batch]) for i in starts],
            "labels": [yt[i:i + batch] for i in starts], "accuracy": accuracy}


def encoder() -> dict[str, Any]:
    return _spec("encoder", 4, lambda x: (x,))


def dict_out() -> dict[str, Any]:
    """No accuracy function: pgc picks the metric from the outputs."""
    spec = _spec("dict_out", 8, lambda x: (x,))
    return {"model": spec["model"], "example_inputs": spec["example_inputs"]}


def conv1d() -> dict[str, Any]:
    return _spec("conv1d", 1, lambda x: (x,))


def gru() -> dict[str, Any]:
    return _spec("gru", 16, lambda x: {"pixels": x})


def mobile() -> dict[str, Any]:
    spec = _spec("mobile", 4, lambda x: (x,))
    return {"model": spec["model"], "example_inputs": spec["example_inputs"]}


def bag() -> dict[str, Any]:
    return _spec("bag", 8, lambda x: (_ids(x),))


def branchy() -> dict[str, Any]:
    return _spec("branchy", 8, lambda x: (x,))


def dataclass_out() -> dict[str, Any]:
    """No accuracy function: pgc picks the metric from the outputs."""
    spec = _spec("dataclass_out", 8, lambda x: (x,))
    return {"model": spec["model"], "example_inputs": spec["example_inputs"]}


def list_in() -> dict[str, Any]:
    return _spec("list_in", 8, lambda x: (_views(x),))


def causal() -> dict[str, Any]:
    return _spec("causal", 4, lambda x: (x,))


def half() -> dict[str, Any]:
    """The conv1d model as a user serving in bfloat16 has it: weights and inputs cast."""
    spec = _spec("half", 4, lambda x: (x.to(torch.bfloat16),))
    return {**spec, "model": spec["model"].to(torch.bfloat16)}


def labels_out() -> dict[str, Any]:
    """No accuracy function: pgc compares the ids (exactly) and the probabilities."""
    spec = _spec("labels_out", 8, lambda x: (x,))
    return {"model": spec["model"], "example_inputs": spec["example_inputs"]}


def hf_vit() -> dict[str, Any]:
    """Served one image at a time, called with its keyword (``pixel_values=``)."""
    spec = _spec("hf_vit", 1, lambda x: {"pixel_values": x})
    return {**spec, "accuracy": _logits_accuracy}


def hf_gpt2() -> dict[str, Any]:
    spec = _spec("hf_gpt2", 1, lambda x: {"input_ids": _pixels(x)})
    return {**spec, "accuracy": _logits_accuracy}
