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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_LOCK = threading.Lock()


@contextlib.contextmanager
def plain_transformer_layers() -> Iterator[None]:
    with _LOCK:
        before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            torch.backends.mha.set_fastpath_enabled(before)
