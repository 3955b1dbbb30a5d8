"""Accuracy of a variant against the fp32 module on real inputs.

``drop`` is what the policy bounds: ``1 - fidelity`` for the built-in metrics, or the fall
in a user's accuracy function (``accuracy(fp32) - accuracy(variant)`` on labels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compiler import Example, choose_metric, fidelity


@dataclass(frozen=True)
class Score:
    fidelity: float
    drop: float
    n: int


class Evaluator:
    def __init__(
        self,
        base: nn.Module,
        inputs: Sequence[Example],
        *,
        metric: str | None = None,
        accuracy: Callable[[Sequence[Any], Sequence[Any]], float] | None = None,
        labels: Sequence[Any] | None = None,
    ) -> None:
        if not inputs:
            raise ValueError("no inputs to evaluate on")
        self.inputs = list(inputs)
        self.accuracy = accuracy
        self.labels = list(labels) if labels is not None else None
        self.references = self._outputs(base, len(self.inputs))
        if accuracy is not None:
            self.metric = "accuracy" if labels is not None else "custom"
        else:
            self.metric = metric or choose_metric(self.references[0])
        self.base_accuracy = (
            float(accuracy(self.references, self.labels))
            if accuracy is not None and self.labels is not None
            else None
        )

    def _outputs(self, module: nn.Module, n: int) -> list[Any]:
        with torch.inference_mode():
            return [module(*a, **k) for a, k in self.inputs[:n]]

    def score(self, module: nn.Module, n: int | None = None) -> Score:
        n = len(self.inputs) if n is None else min(n, len(self.inputs))
        outs = self._outputs(module, n)
        refs = self.references[:n]
        if self.accuracy is not None:
            if self.labels is not None:
                labels = self.labels[:n]
                base = float(self.accuracy(refs, labels))
                value = float(self.accuracy(outs, labels))
                return Score(value, base - value, n)
            value = float(self.accuracy(outs, refs))
            return Score(value, 1.0 - value, n)
        value = fidelity(self.metric, refs, outs)
        return Score(value, 1.0 - value, n)
