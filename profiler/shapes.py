"""Shape buckets: the key under which live traffic is counted, so the search can see which
shapes real requests have (batch size and a sequence-length bucket).

The key comes from the call's first tensor (looking one level into tuples, lists and dicts,
so ``model(batch_dict)`` and ``model([ids, mask])`` are keyed too):

- integer tensors ``[batch, seq]`` (token ids): ``b<batch> s<seq bucket>``;
- float tensors ``[batch, seq, features]`` (embeddings, audio frames): ``b<batch> s<seq
  bucket> f<features>``;
- 1-D tensors: ``b<batch>``; 0-D tensors or no tensor: ``-``;
- anything else (images ``[batch, C, H, W]``...): ``b<batch> <d1>x<d2>...``.

Sequence lengths are rounded up to :data:`SEQ_BUCKETS`, so variable-length traffic makes a
handful of keys, not one per length. Keys are cached per (shape, dtype): the request path
pays a dictionary lookup, not string formatting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

SEQ_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
_CACHE_MAX = 4096
_cache: dict[tuple[Any, Any], str] = {}
_is_tensor = torch.is_tensor


def seq_bucket(length: int, buckets: Sequence[int] = SEQ_BUCKETS) -> int:
    """The smallest bucket that holds ``length`` (the length itself past the largest)."""
    for b in buckets:
        if length <= b:
            return b
    return length


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    for a in args:
        if _is_tensor(a):
            return a
    for v in kwargs.values():
        if _is_tensor(v):
            return v
    for container in (*args, *kwargs.values()):  # one level down: lists, tuples, dicts
        items = container.values() if isinstance(container, dict) else container
        if isinstance(container, (list, tuple, dict)):
            for item in items:
                if _is_tensor(item):
                    return item
    return None


def key_of(shape: torch.Size, dtype: torch.dtype) -> str:
    """The key of a first tensor of ``shape`` and ``dtype`` (cached)."""
    sig = (shape, dtype)
    key = _cache.get(sig)
    if key is None:
        key = _key(shape, dtype)
        if len(_cache) < _CACHE_MAX:
            _cache[sig] = key
    return key


def _key(shape: torch.Size, dtype: torch.dtype) -> str:
    if len(shape) == 0:
        return "-"
    batch = shape[0]
    if len(shape) == 1:
        return f"b{batch}"
    if not dtype.is_floating_point and not dtype.is_complex and len(shape) == 2:
        return f"b{batch} s{seq_bucket(shape[1])}"
    if dtype.is_floating_point and len(shape) == 3:
        return f"b{batch} s{seq_bucket(shape[1])} f{shape[2]}"
    return f"b{batch} " + "x".join(str(d) for d in shape[1:])


def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The shape bucket of one call (see the module docstring)."""
    first = _first_tensor(args, kwargs)
    if first is None:
        return "-"
    return key_of(first.shape, first.dtype)


def parse_key(key: str) -> dict[str, int | str]:
    """Split a shape key into its batch, sequence bucket, features and other dimensions."""
    out: dict[str, int | str] = {}
    for part in key.split():
        if part.startswith("b") and part[1:].isdigit():
            out["batch"] = int(part[1:])
        elif part.startswith("s") and part[1:].isdigit():
            out["seq"] = int(part[1:])
        elif part.startswith("f") and part[1:].isdigit():
            out["features"] = int(part[1:])
        elif part != "-":
            out["dims"] = part
    return out
