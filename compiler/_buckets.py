"""Shape buckets: pad variable-length inputs up to the nearest bucket, give back the outputs
of the unpadded input.

Which outputs are token-level is found once, on the example input, before anything is
compiled: the eager model is run on the example and on the example one step longer; output
tensors whose ``dim`` grew with the input are token-level and are cut back to the input's
length on every call, the others (pooled embeddings, logits) are returned as they are. Their
values equal the unpadded run's (up to float rounding) when the model honours its mask:
padding holds ``pad_value`` in every padded input, which is 0 = "masked" in an attention mask.
That the model honours it is checked on the example (:func:`token_level_outputs`), not assumed.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from compiler._errors import BuildError
from compiler._registry import BuildContext, Example, register_analysis, register_transform
from compiler.parts import ShapeBuckets


def _length(args: Any, kwargs: Any, dim: int) -> int | None:
    leaves, _ = tree_flatten((args, kwargs))
    for t in leaves:
        if torch.is_tensor(t) and t.dim() > dim:
            return int(t.shape[dim])
    return None


def pad_inputs(args: Any, kwargs: Any, dim: int, length: int, to: int, value: int) -> Any:
    """Pad every tensor whose ``dim`` has ``length`` elements to ``to`` with ``value``."""
    leaves, spec = tree_flatten((args, kwargs))
    out = []
    for t in leaves:
        if torch.is_tensor(t) and t.dim() > dim and t.shape[dim] == length and to > length:
            pad = [0, 0] * (t.dim() - dim - 1) + [0, to - length]
            t = F.pad(t, pad, value=value)
        out.append(t)
    return tree_unflatten(out, spec)


class BucketHooks:
    """Pads a module's inputs up to a bucket (forward pre-hook) and cuts token-level outputs
    back (forward hook). Hooks rather than a wrapper module, so that the variant keeps the
    model's own module names (per-layer profiles and rules still match)."""

    def __init__(self, part: ShapeBuckets, token_leaves: frozenset[int] | None) -> None:
        self.part = part
        self.token_leaves = token_leaves
        self._local = threading.local()

    def _stack(self) -> list[tuple[int, int] | None]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def pre(self, _module: nn.Module, args: Any, kwargs: Any) -> Any:
        dim = self.part.dim
        length = _length(args, kwargs, dim)
        bucket = self.part.bucket_for(length) if length is not None else None
        if length is None or bucket is None or bucket == length:
            self._stack().append(None)
            return None
        self._stack().append((length, bucket))
        return pad_inputs(args, kwargs, dim, length, bucket, self.part.pad_value)

    def post(self, _module: nn.Module, _args: Any, _kwargs: Any, out: Any) -> Any:
        padded = self._stack().pop()
        if padded is None:
            return None
        length, bucket = padded
        dim = self.part.dim
        leaves, spec = tree_flatten(out)
        cut = []
        for i, t in enumerate(leaves):
            token = (
                i in self.token_leaves
                if self.token_leaves is not None
                else torch.is_tensor(t) and t.dim() > dim and t.shape[dim] == bucket
            )
            if token and torch.is_tensor(t):
                t = t.narrow(dim, 0, length)
            cut.append(t)
        return tree_unflatten(cut, spec)


#: Largest relative L2 change padding may make to an output of the eager model (float
#: rounding under a mask is ~1e-6; a model that reads its padding changes by percents).
MAX_PADDING_CHANGE = 1e-3


def token_level_outputs(model: nn.Module, part: ShapeBuckets, example: Example) -> frozenset[int] | None:
    """Indices of output leaves whose ``dim`` follows the input length (None: unknown).

    Raises :class:`BuildError` when padding the example changes what the model returns (its
    outputs, token-level ones cut back): buckets are offered on the promise that a padded
    call gives the unpadded call's outputs, so that promise is checked, not assumed."""
    args, kwargs = example
    length = _length(args, kwargs, part.dim)
    if length is None:
        return None
    with torch.inference_mode():
        short = tree_flatten(model(*args, **kwargs))[0]
        pargs, pkwargs = pad_inputs(args, kwargs, part.dim, length, length + 1, part.pad_value)
        longer = tree_flatten(model(*pargs, **pkwargs))[0]
    token = frozenset(
        i
        for i, (a, b) in enumerate(zip(short, longer))
        if torch.is_tensor(a) and a.dim() > part.dim and b.shape[part.dim] == a.shape[part.dim] + 1
    )
    for i, (a, b) in enumerate(zip(short, longer)):
        if not (torch.is_tensor(a) and a.is_floating_point()):
            continue
        if i in token:
            b = b.narrow(part.dim, 0, length)
        change = float(torch.linalg.vector_norm((a - b).float())) / max(
            float(torch.linalg.vector_norm(a.float())), 1e-12)
        if not change <= MAX_PADDING_CHANGE:
            raise BuildError(
                f"shape buckets do not apply: padding dim {part.dim} with {part.pad_value} "
                f"changes the model's output {i} by {change:.2g} (relative), so the model reads "
                "its padding; dynamic shapes serve variable lengths without padding")
    return token


@register_analysis(ShapeBuckets)
def analyze_buckets(model: nn.Module, part: ShapeBuckets, ctx: BuildContext) -> None:
    if part.is_identity:
        return
    example = ctx.first_input()
    if example is not None:
        try:
            ctx.state["token_leaves"] = token_level_outputs(model, part, example)
        except BuildError:
            raise
        except Exception as exc:  # noqa: BLE001 - the hooks fall back to shapes
            ctx.report.notes.append(f"buckets: could not probe outputs ({type(exc).__name__})")


@register_transform(ShapeBuckets)
def apply_buckets(model: nn.Module, part: ShapeBuckets, ctx: BuildContext) -> nn.Module:
    if part.is_identity:
        return model
    leaves = ctx.state.get("token_leaves")
    how = (
        f"token-level output leaves {sorted(leaves)} cut back, others as they are"
        if leaves is not None
        else "outputs whose dim has the bucket's length are cut back (no example to probe)"
    )
    ctx.report.notes.append(
        f"shape buckets {list(part.sizes)} on dim {part.dim}, padded with {part.pad_value}; {how}"
    )
    hooks = BucketHooks(part, leaves)
    model.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    model.register_forward_hook(hooks.post, with_kwargs=True)
    model._pgc_buckets = hooks  # type: ignore[assignment]
    return model
