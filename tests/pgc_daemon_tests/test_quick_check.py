"""The quick accuracy check before timing knows its noise (``optimizer/search/evaluate.py``):
it grows its sample while the drop's bootstrap interval straddles the budget, and prunes only
when the drop is over the budget with confidence, for any metric (a spec's own function over
labels too)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from pgc_daemon.optimizer.search.evaluate import (
    QUICK_MAX,
    QUICK_START,
    Evaluator,
    QuickStep,
    for_budget,
    quick_verdict,
)
from pgc_daemon.policy import Policy

CLASSES = 4


class _Classifier(nn.Module):
    """Scores ``CLASSES`` classes from a 2-number input; wrong (class + 1) on the inputs
    whose id (their second number) is in ``wrong``."""

    def __init__(self, wrong: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.wrong = wrong

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        label, ident = int(x[0]), int(x[1])
        if ident in self.wrong:
            label = (label + 1) % CLASSES
        return torch.nn.functional.one_hot(torch.tensor(label), CLASSES).float()


def _agreement(outputs: Sequence[torch.Tensor], labels: Sequence[Any]) -> float:
    """A spec's own accuracy function over labels."""
    return sum(int(o.argmax()) == y for o, y in zip(outputs, labels, strict=True)) / len(labels)


def _evaluator(n: int = 64) -> Evaluator:
    inputs = [((torch.tensor([i % CLASSES, i]),), {}) for i in range(n)]
    labels = [i % CLASSES for i in range(n)]
    return Evaluator(_Classifier(), inputs, accuracy=_agreement, labels=labels)


def test_a_clearly_worse_candidate_is_pruned_on_the_first_few_inputs() -> None:
    steps = _evaluator().quick(_Classifier(frozenset(range(0, 64, 2))), budget=0.05)
    prune, step = quick_verdict(steps, 0.05)
    assert prune and step.n == QUICK_START and len(steps) == 1
    assert step.drop == pytest.approx(0.5) and step.low > 0.05


def test_an_unlucky_first_sample_grows_the_check_instead_of_pruning() -> None:
    # one wrong answer among the first 8 (drop 0.125 there, 0.031 over 32 inputs): a fixed
    # threshold of twice the budget plus 0.01 (0.05) pruned this on noise
    steps = _evaluator().quick(_Classifier(frozenset({3})), budget=0.02)
    prune, step = quick_verdict(steps, 0.02)
    assert steps[0].n == QUICK_START and steps[0].drop == pytest.approx(0.125)
    assert steps[0].low <= 0.02 < steps[0].high  # straddles: more inputs
    assert not prune
    assert [s.n for s in steps] == [8, 16, 32] and steps[-1].n == QUICK_MAX
    assert steps[-1].drop == pytest.approx(1 / 32)


def test_an_equal_candidate_passes_on_the_first_step_and_the_steps_are_paired() -> None:
    steps = _evaluator().quick(copy.deepcopy(_Classifier()), budget=0.01)
    assert len(steps) == 1 and steps[0] == QuickStep(QUICK_START, 0.0, 0.0, 0.0)
    assert quick_verdict(steps, 0.01) == (False, steps[0])


def test_builtin_metrics_bootstrap_too() -> None:
    inputs = [((torch.randn(3, 5, generator=torch.Generator().manual_seed(i)),), {}) for i in range(40)]
    base = nn.Linear(5, 5)
    noisy = copy.deepcopy(base)
    with torch.no_grad():
        noisy.weight.add_(torch.randn_like(noisy.weight) * 2.0)
    evaluator = Evaluator(base, inputs, metric="cosine")
    prune, step = quick_verdict(evaluator.quick(noisy, budget=0.01), 0.01)
    assert prune and step.low > 0.01
    prune, step = quick_verdict(evaluator.quick(copy.deepcopy(base), budget=0.01), 0.01)
    assert not prune and step.high < 1e-6


def test_the_verdict_is_decided_by_the_first_conclusive_step() -> None:
    straddle, over, under = QuickStep(8, 0.1, 0.0, 0.3), QuickStep(16, 0.2, 0.12, 0.3), QuickStep(16, 0.0, 0.0, 0.05)
    assert quick_verdict([straddle, over], 0.1) == (True, over)
    assert quick_verdict([straddle, under], 0.1) == (False, under)
    assert quick_verdict([straddle], 0.1) == (False, straddle)  # undecided: the full check judges


def test_the_full_check_holds_enough_rows_for_one_changed_row_to_fit_the_budget() -> None:
    """Top-1 agreement over 64 rows moves in steps of 0.0156: under a budget of 0.01 a variant
    that changed one row was as infeasible as one that changed ten. The check takes as many
    of the inputs (the reservoir holds 128) as make one changed row fit."""
    inputs = [((torch.tensor([i % CLASSES, i]),), {}) for i in range(128)]
    one_wrong = _Classifier(frozenset({5}))
    ev = for_budget(_Classifier(), inputs, 0.01, first=64, metric="top1")
    assert len(ev.inputs) == 101
    drop = ev.score(one_wrong).drop
    assert drop == pytest.approx(1 / 101)
    assert Policy().violations(drop, None)["accuracy_drop"] <= 0  # feasible at 0.01
    over_64 = Evaluator(_Classifier(), inputs[:64], metric="top1").score(one_wrong).drop
    assert Policy().violations(over_64, None)["accuracy_drop"] > 0  # as it was
    # a budget one row of 64 fits, a continuous metric, a spec's own function: the first 64
    assert len(for_budget(_Classifier(), inputs, 0.02, first=64, metric="top1").inputs) == 64
    assert len(for_budget(_Classifier(), inputs, 0.01, first=64, metric="sqnr").inputs) == 64
    labels = [i % CLASSES for i in range(128)]
    assert len(for_budget(_Classifier(), inputs, 0.01, first=64, accuracy=_agreement,
                          labels=labels).inputs) == 64
    # a budget finer than the inputs can resolve takes all of them; batches count each row
    assert len(for_budget(_Classifier(), inputs, 0.005, first=64, metric="top1").inputs) == 128
    batched = [((torch.rand(4, CLASSES),), {}) for _ in range(128)]
    assert len(for_budget(nn.Identity(), batched, 0.01, first=64, metric="top1").inputs) == 64
    assert len(for_budget(nn.Identity(), batched, 0.002, first=64, metric="top1").inputs) == 126
