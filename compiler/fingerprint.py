"""A model's identity: its module tree, parameter shapes and dtypes, and its weights."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def fingerprint(model: nn.Module) -> str:
    """A SHA-256 over structure and weights: a new model version (new weights, new layer)
    gets a new fingerprint, the same model loaded twice gets the same one."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"m:{name}:{type(mod).__module__}.{type(mod).__qualname__}\n".encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"t:{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
        data = t.detach().cpu().contiguous()
        if data.dtype == torch.bfloat16:
            data = data.view(torch.int16)
        h.update(data.numpy().tobytes())
    return h.hexdigest()
