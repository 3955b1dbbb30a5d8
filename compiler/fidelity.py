"""How close a variant's outputs are to the fp32 reference.

Every fidelity is in [0, 1], 1 meaning identical, so that ``accuracy_drop = 1 - fidelity``
means the same thing for every metric:

- ``cosine``: mean cosine similarity of each sample's output vector (embeddings);
- ``top1``: share of rows whose argmax agrees (logits);
- ``sqnr``: 1 - noise-to-signal power ratio, so SQNR 20 dB is fidelity 0.99 (anything else).

Outputs are compared leaf by leaf: tensors inside tuples, lists, dicts, named tuples, pytree
nodes (a model hub's ``ModelOutput``) and plain dataclasses, which torch's pytree does not
open (a model returning one scored a perfect 1.0 against any output: no tensor was found on
either side). An output whose tensors differ from the reference's in number, shape or dtype
kind scores 0; integer and boolean tensors (ids, masks) count by exact agreement; an output
holding no tensor at all cannot be judged and raises ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

METRICS = ("cosine", "top1", "sqnr")


def output_leaves(output: Any) -> Iterator[Any]:
    """Every leaf of a model output, in order: torch's pytree leaves, with dataclasses that
    are not registered with it opened field by field."""
    for leaf in tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            yield from output_leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        else:
            yield leaf


def tensor_leaves(output: Any) -> list[torch.Tensor]:
    """Every tensor of a model output, in order (dataclasses opened field by field)."""
    return [leaf.detach() for leaf in output_leaves(output) if torch.is_tensor(leaf)]


def float_leaves(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output, as fp32."""
    return [t.float() for t in tensor_leaves(output) if t.is_floating_point()]


def _matched(ref: Any, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The float leaves of both sides, or None where the outputs do not match: other tensors
    in number, shape or kind, or unequal integer tensors beside them counted in ``exact``."""
    r, o = tensor_leaves(ref), tensor_leaves(out)
    if not r:
        raise ValueError("the model's output holds no tensor to compare")
    if len(r) != len(o) or any(a.shape != b.shape or a.is_floating_point() != b.is_floating_point()
                               for a, b in zip(r, o)):
        return None
    return [a.float() for a in r if a.is_floating_point()], [b.float() for b in o
                                                                 if b.is_floating_point()]


def _exact(ref: Any, out: Any) -> float:
    """Share of equal elements over the integer and boolean tensors of a matched pair."""
    pairs = [(a, b) for a, b in zip(tensor_leaves(ref), tensor_leaves(out))
             if not a.is_floating_point()]
    total = sum(a.numel() for a, _ in pairs)
    return 1.0 if not total else sum(int((a == b).sum()) for a, b in pairs) / total


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
    matched = [_matched(ref, out) for ref, out in zip(references, outputs)]
    if any(m is None for m in matched):
        return 0.0  # a variant whose outputs are not the reference's kind of output
    pairs = [m for m in matched if m is not None]
    exact = min(_exact(ref, out) for ref, out in zip(references, outputs))
    if not any(r for r, _ in pairs):  # integer outputs only (ids, masks): exact agreement
        return exact
    if metric == "sqnr":
        signal = noise = 0.0
        for r_leaves, o_leaves in pairs:
            for r, o in zip(r_leaves, o_leaves):
                signal += float(r.pow(2).sum())
                noise += float((r - o).pow(2).sum())
        if not math.isfinite(noise):
            return 0.0
        value = 1.0 if signal == 0.0 else max(0.0, 1.0 - noise / signal)
        return min(value, exact)
    scores: list[torch.Tensor] = []
    for r_leaves, o_leaves in pairs:
        if not r_leaves:
            continue
        if metric == "top1":
            r, o = r_leaves[0], o_leaves[0]
            scores.append((r.argmax(-1) == o.argmax(-1)).float().reshape(-1))
        else:
            for r, o in zip(r_leaves, o_leaves):
                scores.append(_cosine(r, o))
    value = float(torch.cat(scores).mean())
    return min(value, exact) if math.isfinite(value) else 0.0


def judgments(metric: str, references: Sequence[Any]) -> int:
    """How many separate yes-or-no judgments a fidelity by ``metric`` over ``references`` is
    the share of: for ``top1`` the rows whose argmax is compared (a batch of 4 is 4 rows);
    0 for the continuous metrics, whose drop is not a count."""
    if metric != "top1":
        return 0
    rows = 0
    for ref in references:
        leaves = float_leaves(ref)
        if leaves and leaves[0].dim():
            rows += leaves[0].numel() // max(leaves[0].shape[-1], 1)
    return rows


def drop_floor(metric: str, drop: float, judged: int, confidence: float = 0.95) -> float:
    """The least true accuracy drop that a measured ``drop`` over ``judged`` judgments
    (:func:`judgments`) makes likely: for ``top1``, the one-sided Clopper-Pearson lower
    bound at ``confidence`` of the rate of changed rows. One row changed of 8 (a measured
    drop of 0.125) is as likely from a true drop of 0.0064 as from 0.5: a row whose logits
    nearly tie flips under any change. Continuous metrics, and counts not known
    (``judged`` 0), give ``drop`` back."""
    if metric != "top1" or judged <= 0 or drop <= 0:
        return drop
    changed = min(judged, max(0, round(drop * judged)))
    if changed == 0:
        return 0.0
    from scipy.stats import beta

    return float(beta.ppf(1.0 - confidence, changed, judged - changed + 1))


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
