"""A traced graph checked against the module it was traced from, before it is quantized.

ONNX Runtime's exporter and OpenVINO's converter trace the module on one example: Python
control flow on a tensor's value runs once and only its path is recorded. A model that takes
one of two paths by its input (``if x.mean() > 0.3:``) became an ONNX Runtime variant that ran
the example's path on every input; under a labels metric its accuracy was as good, so a
search chose it at 2.56x while it computed another function than the model on a quarter of
the inputs. The tracer's warnings cannot tell such a branch from a harmless check on a shape
(all-MiniLM-L6-v2 raises 14 of the same warning in OpenVINO's converter, from shape tests in
its attention code), so the graph itself is checked: run in fp32 on the calibration inputs,
it has to give the module's outputs (up to float reordering) or the build fails and says why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from compiler._errors import BuildError
from compiler._registry import Example
from compiler.fidelity import tensor_leaves

#: inputs checked at most (the calibration's first ones)
CHECK_INPUTS = 16
#: largest relative error (L2 norm of the difference over the reference's) of any output
#: tensor of an fp32 graph; a path the trace fixed gives errors of order 1
TOLERANCE = 1e-3


def check_trace(backend: str, module: nn.Module, run: Callable[[Example], Any],
                inputs: Sequence[Example]) -> None:
    """Raise :class:`BuildError` unless ``run`` (the traced graph, in fp32) gives ``module``'s
    outputs on each of ``inputs`` (at most :data:`CHECK_INPUTS`)."""
    for i, (args, kwargs) in enumerate(inputs[:CHECK_INPUTS]):
        with torch.no_grad():
            want = tensor_leaves(module(*args, **kwargs))
            got = tensor_leaves(run((args, kwargs)))
        error = _error(want, got)
        if error > TOLERANCE:
            raise BuildError(
                f"{backend} backend: the traced graph differs from the model on calibration "
                f"input {i + 1} of {min(len(inputs), CHECK_INPUTS)} (relative error "
                f"{error:.2g}): the model's forward takes a path by its inputs' values (or "
                f"shapes) that the trace fixed to the example's"
            )


def _error(want: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """The largest relative error over the output tensors (inf where they do not match)."""
    if len(want) != len(got):
        return float("inf")
    worst = 0.0
    for w, g in zip(want, got):
        if w.shape != g.shape:
            return float("inf")
        w, g = w.double(), g.double()
        diff = float((w - g).norm())
        if diff == 0.0:
            continue
        scale = float(w.norm())
        worst = max(worst, diff / scale if scale > 0 else float("inf"))
    return worst if worst == worst else float("inf")  # NaN: not the module's outputs
