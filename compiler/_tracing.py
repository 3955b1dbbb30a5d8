"""Tracing a model for another runtime (ONNX Runtime's TorchScript export, OpenVINO's converter)
with PyTorch's fused transformer path off.

``nn.TransformerEncoderLayer`` (and ``nn.MultiheadAttention``) run as one fused op,
``_transformer_encoder_layer_fwd``, when no gradient is recorded. A converter that traces
them then sees that op and none of the layer's linears: the TorchScript exporter has no ONNX
form for it (every ONNX Runtime trial of such a model failed in a search, whose workers run
without gradients), and OpenVINO converts it whole, so NNCF found nothing to quantize in it
(a 2-layer ``nn.TransformerEncoder``: only the head became int8). With the fast path off they
trace as their plain ops (linears, softmax, layer norms), which each runtime quantizes per
layer.

The switch is process-wide, so one trace runs at a time, and a call of such a layer in
another thread meanwhile takes the plain path (the same outputs, slower).

``torch.diff`` is traced as slices and a subtraction (:func:`diff_by_slices`): neither the
TorchScript exporter (opset 17) nor OpenVINO converts ``aten::diff``, and ``transformers`` 5
calls it while building a decoder's attention mask (``find_packed_sequence_indices``), so every
ONNX Runtime and OpenVINO trial of a GPT-2 failed. The same mask then takes a cumulative sum of
booleans, which the exporter writes as an ONNX ``CumSum`` of booleans that ONNX Runtime refuses:
a boolean's ``cumsum`` is traced as one of its ``int64`` cast, the type torch's result has. The
functions are swapped for the trace only, under the same lock; a call in another thread
meanwhile gets the same values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_LOCK = threading.Lock()


@contextlib.contextmanager
def plain_transformer_layers() -> Iterator[None]:
    """Trace for another runtime: the fused transformer path off, ``torch.diff`` as slices."""
    with _LOCK:
        before = torch.backends.mha.get_fastpath_enabled()
        diff, cumsum, method = torch.diff, torch.cumsum, torch.Tensor.cumsum
        torch.backends.mha.set_fastpath_enabled(False)
        torch.diff = diff_by_slices
        torch.cumsum = _counting(cumsum)
        torch.Tensor.cumsum = _counting(method)  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.diff, torch.cumsum = diff, cumsum
            torch.Tensor.cumsum = method  # type: ignore[method-assign]
            torch.backends.mha.set_fastpath_enabled(before)


def _counting(cumsum: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``cumsum`` that sums a boolean tensor as ``int64`` (what torch returns for one)."""

    def counted(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: A002
        if input.dtype == torch.bool and kwargs.get("dtype") is None:
            input = input.to(torch.int64)
        return cumsum(input, *args, **kwargs)

    return counted


def diff_by_slices(input: torch.Tensor, n: int = 1, dim: int = -1,  # noqa: A002 - torch's name
                   prepend: torch.Tensor | None = None,
                   append: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.diff`` from ops every exporter converts (concatenation, narrowing, subtraction;
    an exclusive or for booleans, as ``torch.diff`` does)."""
    parts = [t for t in (prepend, input, append) if t is not None]
    x = torch.cat(parts, dim) if len(parts) > 1 else input
    for _ in range(n):
        length = x.shape[dim] - 1
        later, earlier = x.narrow(dim, 1, length), x.narrow(dim, 0, length)
        x = torch.logical_xor(later, earlier) if x.dtype == torch.bool else later - earlier
    return x
