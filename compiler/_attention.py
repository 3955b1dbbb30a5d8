"""Attention as two matmuls and a softmax, where that is faster on this machine and shape.

Inductor keeps ``scaled_dot_product_attention`` as one call to ATen's flash-attention kernel
for CPU. At the short sequences of a served text model that kernel loses to its plain form:
on all-MiniLM-L6-v2 (q ``[1, 12, 128, 32]``, 2 threads, 2-core AMD EPYC with AVX-512) it took
0.35 ms a layer against 0.28 ms for ATen's matmul, softmax, matmul, and 39% of the int8
package's time; lowered, the package went from 4.27x to 4.80x fp32 eager. At long sequences
the fused kernel wins (and the plain form holds a ``[L, S]`` score matrix per head).

Timing the two forms alone does not predict them inside a model: compiled on their own, the
plain form was *slower* (0.52 ms; its masked softmax ran as a separate, slower kernel), while
in MiniLM's package Inductor fuses the mask's construction and the scaling into the softmax.
So the first package built with a given attention shape (per machine, dtype and thread count)
is compiled both ways and the two packages are timed interleaved; the faster form is
remembered through :mod:`compiler._measure`, like every kernel-path choice, and later
packages with that shape are compiled once, in that form. Sites whose shapes are symbolic,
that use dropout or grouped-query heads, or whose score matrix would be large, stay fused
without timing.

The lowering is a decomposition of the one op on the exported program, so module paths and
the rest of the graph, quantize/dequantize ops included, are kept. Masked scores take the
dtype's lowest value, as Hugging Face's eager attention does, so a row whose every key is
masked stays finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler import _measure

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MAX_SCORES_BYTES = 64 << 20
"""Largest score matrix (all heads and batch) the plain form may hold; above it, stay fused."""


def math_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` for inference (no dropout, no grouped-query heads)."""
    if dropout_p or enable_gqa:
        raise ValueError("math_attention takes neither dropout nor grouped-query heads")
    s = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    scores = (query * s) @ key.transpose(-2, -1)
    lowest = torch.finfo(scores.dtype).min
    if is_causal:
        n, m = scores.shape[-2:]
        causal = torch.ones(n, m, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(causal.logical_not(), lowest)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), lowest)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    return torch.softmax(scores, dim=-1) @ value


@dataclass(frozen=True)
class Site:
    """One attention call's shapes and options, as the exported graph knows them."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    dtype: torch.dtype
    mask: tuple[tuple[int, ...], torch.dtype] | None
    is_causal: bool

    def label(self) -> str:
        mask = "" if self.mask is None else f", mask {list(self.mask[0])} {_dt(self.mask[1])}"
        causal = ", causal" if self.is_causal else ""
        return f"q {list(self.query)} k {list(self.key)} {_dt(self.dtype)}{mask}{causal}"

    def scores_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return math.prod(self.query[:-1]) * self.key[-2] * item


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _static(val: Any) -> tuple[int, ...] | None:
    shape = getattr(val, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def site_of(node: torch.fx.Node) -> Site | str:
    """The node's :class:`Site`, or why it stays fused."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if bound.get("dropout_p") or bound.get("enable_gqa"):
        return "dropout or grouped-query heads"
    vals = [getattr(bound.get(n), "meta", {}).get("val") for n in ("query", "key", "value")]
    q, k, v = (_static(x) for x in vals)
    if q is None or k is None or v is None:
        return "symbolic shapes"
    if q[:-2] != k[:-2] or k[:-1] != v[:-1]:
        return "heads differ between query and key"
    mask = None
    if bound.get("attn_mask") is not None:
        mval = getattr(bound["attn_mask"], "meta", {}).get("val")
        mshape = _static(mval)
        if mshape is None:
            return "symbolic mask shape"
        mask = (mshape, mval.dtype)
    site = Site(q, k, vals[0].dtype, mask, bool(bound.get("is_causal")))
    if site.scores_bytes() > MAX_SCORES_BYTES:
        return f"score matrix of {site.scores_bytes() >> 20} MiB"
    return site


@dataclass(frozen=True)
class Attention:
    """A program's attention sites and what to do with them: ``choice`` is "math" or "fused"
    when known (remembered, with the milliseconds ``ms`` it was chosen on; or ineligible, and
    ``why`` says why), None when it is to be measured on this program's packages."""

    sites: int
    what: str
    choice: str | None
    why: str = ""
    ms: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """What the choice is remembered under (:mod:`compiler._measure`)."""
        return f"attention {self.what}"

    def note(self, choice: str, ms: dict[str, float]) -> str:
        form = "as matmul, softmax, matmul" if choice == "math" else "fused kernel kept"
        if {"math", "fused"} <= ms.keys():
            where = "an earlier package" if self.choice else "the whole package, both ways"
            why = f"{ms['math']:.2f} ms a call plain against {ms['fused']:.2f} ms fused, measured on {where}"
        else:
            why = self.why
        return f"attention: {self.sites} sites {form} ({self.what}; {why})"


def find(program: Any) -> Attention | None:
    """The program's attention sites (None when it has none)."""
    nodes = [n for n in program.graph.nodes if n.op == "call_function" and n.target is SDPA]
    if not nodes:
        return None
    sites: set[Site] = set()
    for node in nodes:
        site = site_of(node)
        if isinstance(site, str):
            return Attention(len(nodes), "attention", "fused", site)
        sites.add(site)
    what = "; ".join(sorted(s.label() for s in sites)) + f", {torch.get_num_threads()} threads"
    unknown = Attention(len(nodes), what, None)
    known = _measure.remembered(unknown.key)
    return unknown if known is None else Attention(len(nodes), what, known[0], ms=known[1])


def lower(program: Any) -> Any:
    """``program`` with every attention call in the plain form."""
    return program.run_decompositions({SDPA: math_attention})


def choose(att: Attention, fused: Callable[[], Any], plain: Callable[[], Any]) -> tuple[str, dict[str, float]]:
    """Time the two packages' calls interleaved; the faster form, remembered for ``att``."""
    return _measure.choose(att.key, {"fused": fused, "math": plain}, reps=5)
