"""Accuracy of a variant against the fp32 module on real inputs.

``drop`` is what the policy bounds: ``1 - fidelity`` for the built-in metrics, or the fall
in a user's accuracy function (``accuracy(fp32) - accuracy(variant)`` on labels).

The quick check before timing (:meth:`Evaluator.quick`) knows its noise: it scores a few
inputs, bootstraps the drop over them (the same resampled inputs for fp32 and the variant, so
the interval is of the paired difference, and for any metric: the spec's own function over
labels is simply called on each resample), and doubles the sample while the interval straddles
the budget. A candidate is pruned only when the drop's one-sided lower bound is over the
budget; the full check on every input stays the judge of the rest. A fixed threshold on 8
inputs pruned a rank-correlation metric's candidates on noise, and let clearly infeasible
candidates of a tight budget through to be timed.

The full check's inputs are sized to the budget where the metric counts rows
(:func:`for_budget`): top-1 agreement over 64 rows moves in steps of 0.0156, so under a
budget of 0.01 a variant that changed one row of them was as infeasible as one that changed
ten. It takes as many inputs as make one changed row fit the budget, up to every input given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from compiler import Example, choose_metric, fidelity, judgments


@dataclass(frozen=True)
class Score:
    fidelity: float
    drop: float
    n: int


#: The quick check starts with this many inputs and doubles up to ``QUICK_MAX``.
QUICK_START = 8
QUICK_MAX = 32
#: Bootstrap resamples per step, and the one-sided confidence of a prune.
RESAMPLES = 200
CONFIDENCE = 0.95


@dataclass(frozen=True)
class QuickStep:
    """The drop on the first ``n`` inputs and its bootstrap interval (one-sided bounds at
    ``CONFIDENCE`` each side)."""

    n: int
    drop: float
    low: float
    high: float


def quick_verdict(steps: Sequence[QuickStep], budget: float) -> tuple[bool, QuickStep]:
    """Whether the steps prune a candidate under ``budget``, and the step that decides: the
    first whose lower bound is over the budget (prune), else the first wholly within it, else
    the last (not pruned: the full check decides). Also what ``bench/search.py`` replays."""
    for step in steps:
        if step.low > budget:
            return True, step
        if step.high <= budget:
            return False, step
    return False, steps[-1]


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

    def extend(self, base: nn.Module, more: Sequence[Example]) -> None:
        """Judge on ``more`` inputs too (their fp32 references computed here). Only for the
        built-in metrics: a spec's accuracy function comes with labels for its inputs."""
        if self.accuracy is not None:
            raise ValueError("an accuracy function's inputs come with their labels")
        start = len(self.inputs)
        self.inputs += list(more)
        self.references += self._outputs(base, len(self.inputs), start=start)

    def _outputs(self, module: nn.Module, n: int, start: int = 0) -> list[Any]:
        with torch.inference_mode():
            return [module(*a, **k) for a, k in self.inputs[start:n]]

    def quick(self, module: nn.Module, budget: float, *, seed: int = 0) -> list[QuickStep]:
        """The quick check's steps: ``QUICK_START`` inputs, doubled while the drop's interval
        straddles ``budget``, up to ``QUICK_MAX`` (see the module docstring); decide with
        :func:`quick_verdict`."""
        cap = min(QUICK_MAX, len(self.inputs))
        n, outs, steps = min(QUICK_START, cap), [], []
        rng = np.random.default_rng(seed)
        while True:
            outs += self._outputs(module, n, start=len(outs))
            drop = self._measure(outs, range(n))[1]
            boot = np.array([self._measure(outs, rng.integers(0, n, n))[1] for _ in range(RESAMPLES)])
            low, high = np.quantile(boot, [1 - CONFIDENCE, CONFIDENCE])
            steps.append(QuickStep(n, drop, float(low), float(high)))
            if n >= cap or low > budget or high <= budget:
                return steps
            n = min(2 * n, cap)

    def _measure(self, outs: list[Any], idx: Sequence[int]) -> tuple[float, float]:
        """(value, drop) of ``outs`` (the variant's outputs of the first inputs) on the inputs
        ``idx`` (with repeats: a bootstrap resample): the metric's value for the variant, and
        how far it falls short of fp32's."""
        picked = [outs[i] for i in idx]
        refs = [self.references[i] for i in idx]
        if self.accuracy is not None:
            if self.labels is not None:
                labels = [self.labels[i] for i in idx]
                value = float(self.accuracy(picked, labels))
                return value, float(self.accuracy(refs, labels)) - value
            value = float(self.accuracy(picked, refs))
        else:
            value = fidelity(self.metric, refs, picked)
        return value, 1.0 - value

    def score(self, module: nn.Module, n: int | None = None) -> Score:
        n = len(self.inputs) if n is None else min(n, len(self.inputs))
        value, drop = self._measure(self._outputs(module, n), range(n))
        return Score(value, drop, n)


def for_budget(
    base: nn.Module,
    inputs: Sequence[Example],
    budget: float,
    *,
    first: int,
    metric: str | None = None,
    accuracy: Callable[[Sequence[Any], Sequence[Any]], float] | None = None,
    labels: Sequence[Any] | None = None,
) -> Evaluator:
    """An :class:`Evaluator` over the ``first`` inputs, or over more where its metric counts
    rows (:func:`compiler.judgments`) and one row changed of them would break ``budget``: as
    many inputs as hold more than ``1 / budget`` rows, up to every one of ``inputs``."""
    n = min(len(inputs), first)
    evaluator = Evaluator(base, list(inputs[:n]), metric=metric, accuracy=accuracy,
                          labels=list(labels[:n]) if labels is not None else None)
    rows = judgments(evaluator.metric, evaluator.references)
    if not rows or rows * budget > 1 or len(inputs) <= n or budget <= 0:
        return evaluator
    # one row changed of ``need`` is a drop under the budget (not equal: 1 - 99/100 > 0.01)
    need = math.floor(1 / budget) + 1
    evaluator.extend(base, inputs[n:math.ceil(n * need / rows)])
    return evaluator
