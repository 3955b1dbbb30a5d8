"""How close a variant's outputs are to the fp32 reference.

Every fidelity is in [0, 1], 1 meaning identical, so that ``accuracy_drop = 1 - fidelity``
means the same thing for every metric:

- ``cosine``: mean cosine similarity of each sample's output vector (embeddings);
- ``top1``: share of rows whose argmax agrees (logits);
- ``sqnr``: 1 - noise-to-signal power ratio, so SQNR 20 dB is fidelity 0.99 (anything else).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

METRICS = ("cosine", "top1", "sqnr")


def float_leaves(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output (tensor, tuple, dict, ModelOutput)."""
    return [
        t.detach().float()
        for t in tree_leaves(output)
        if torch.is_tensor(t) and t.is_floating_point()
    ]


def choose_metric(reference_output: Any) -> str:
    """Pick the metric that fits an output: L2-normalized rows are embeddings (cosine); other
    2-D outputs are logits (top-1 agreement); 3-D outputs with a feature axis of 16 or more are
    sequences of vectors (cosine); anything else is compared by SQNR."""
    leaves = float_leaves(reference_output)
    if not leaves:
        return "sqnr"
    primary = leaves[0]
    if primary.dim() == 2 and primary.shape[-1] >= 2:
        norms = primary.norm(dim=-1)
        if torch.allclose(norms, torch.ones_like(norms), atol=1e-3):
            return "cosine"
        return "top1"
    if primary.dim() >= 3 and primary.shape[-1] >= 16:
        return "cosine"
    return "sqnr"


def _cosine(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    r = ref.reshape(ref.shape[0], -1) if ref.dim() > 1 else ref.reshape(1, -1)
    o = out.reshape(r.shape)
    return torch.nn.functional.cosine_similarity(r, o, dim=-1, eps=1e-12)


def fidelity(metric: str, references: Sequence[Any], outputs: Sequence[Any]) -> float:
    """Fidelity of ``outputs`` against ``references`` (pairs of whole model outputs)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, not {metric!r}")
    if len(references) != len(outputs) or not references:
        raise ValueError("need as many outputs as references, and at least one")
    if metric == "sqnr":
        signal = noise = 0.0
        for ref, out in zip(references, outputs):
            for r, o in zip(float_leaves(ref), float_leaves(out)):
                signal += float(r.pow(2).sum())
                noise += float((r - o).pow(2).sum())
        if not math.isfinite(noise):
            return 0.0
        return 1.0 if signal == 0.0 else max(0.0, 1.0 - noise / signal)
    scores: list[torch.Tensor] = []
    for ref, out in zip(references, outputs):
        r_leaves, o_leaves = float_leaves(ref), float_leaves(out)
        if metric == "top1":
            r, o = r_leaves[0], o_leaves[0]
            scores.append((r.argmax(-1) == o.argmax(-1)).float().reshape(-1))
        else:
            for r, o in zip(r_leaves, o_leaves):
                scores.append(_cosine(r, o))
    value = float(torch.cat(scores).mean())
    return value if math.isfinite(value) else 0.0


def compare(reference: Any, output: Any) -> dict[str, float]:
    """Every error measure that fits one pair of outputs: max abs, RMS, cosine, SQNR (dB) and,
    for 2-D outputs, top-1 agreement."""
    r_leaves, o_leaves = float_leaves(reference), float_leaves(output)
    r = torch.cat([t.reshape(-1) for t in r_leaves])
    o = torch.cat([t.reshape(-1) for t in o_leaves])
    err = r - o
    signal, noise = float(r.pow(2).mean()), float(err.pow(2).mean())
    out = {
        "max_abs": float(err.abs().max()),
        "rms": math.sqrt(noise),
        "cosine": float(torch.nn.functional.cosine_similarity(r, o, dim=0, eps=1e-12)),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-30) / noise),
    }
    if r_leaves[0].dim() == 2:
        out["top1"] = float(
            (r_leaves[0].argmax(-1) == o_leaves[0].argmax(-1)).float().mean()
        )
    return out


def sqnr_db_of(fidelity_value: float) -> float:
    """The SQNR in dB that an ``sqnr`` fidelity stands for."""
    nsr = 1.0 - fidelity_value
    return math.inf if nsr <= 0 else -10 * math.log10(nsr)
