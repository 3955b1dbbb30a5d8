"""Shape buckets: the key under which live traffic is counted, so the search can see which
shapes real requests have (batch size and a sequence-length bucket)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

SEQ_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)


def seq_bucket(length: int, buckets: Sequence[int] = SEQ_BUCKETS) -> int:
    """The smallest bucket that holds ``length`` (the length itself past the largest)."""
    for b in buckets:
        if length <= b:
            return b
    return length


def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``b<batch> s<seq bucket>`` for token inputs (integer tensors with a sequence axis),
    ``b<batch> <d1>x<d2>...`` for other tensors, ``-`` when no tensor is passed."""
    first = next((a for a in args if torch.is_tensor(a)), None)
    if first is None:
        first = next((v for v in kwargs.values() if torch.is_tensor(v)), None)
    if first is None or first.dim() == 0:
        return "-"
    batch = first.shape[0]
    if first.dim() == 1:
        return f"b{batch}"
    if not first.is_floating_point() and first.dim() == 2:
        return f"b{batch} s{seq_bucket(first.shape[1])}"
    return f"b{batch} " + "x".join(str(d) for d in first.shape[1:])


def parse_key(key: str) -> dict[str, int | str]:
    """Split a shape key into its batch and sequence bucket (where it has them)."""
    out: dict[str, int | str] = {}
    for part in key.split():
        if part.startswith("b") and part[1:].isdigit():
            out["batch"] = int(part[1:])
        elif part.startswith("s") and part[1:].isdigit():
            out["seq"] = int(part[1:])
        else:
            out["dims"] = part
    return out
