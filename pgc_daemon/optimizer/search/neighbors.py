"""Moves next to the best recipe so far: every other trial the sampler would make.

A search of 12 trials over categorical choices gives TPE a handful of observations, and on a
flat landscape it draws more or less at random. Recipes one choice apart from the best so far
are usually close to it in speed and accuracy, so the search alternates: a *neighbor* of the
incumbent (one parameter changed: the default choice first, since it covers most layers, then
the hot layers, the backend, the graph and the shapes, each in the space's order; a move
per-layer sensitivity predicts to break the accuracy budget after all others), then a TPE
sample, and so on. Replayed over the measured tables (``bench/search.py``, 21 seeds):
the digits CNN at batch 1, whose best is one ONNX Runtime recipe 15% ahead of 31 others
within 1.8-2.4x, reached within 5% of it in 12 trials on 18 seeds against 4 for TPE alone; the
digits LSTM on 21 against 20; where a baseline is the answer (every MiniLM scenario) nothing
changes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from compiler import Recipe, RecipeError, SensitivityReport
from pgc_daemon.optimizer.search.baselines import Choice, drop_change, slowdown
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.optimizer.search.space import Space
from pgc_daemon.policy import Policy

__all__ = ["incumbent", "neighbors", "next_neighbor"]


def incumbent(records: Sequence[TrialRecord], policy: Policy) -> TrialRecord | None:
    """The best feasible trial so far under the policy's objective (the fastest, or for
    ``most_accurate`` the least drop, the faster breaking ties); None before one is."""
    feasible = [r for r in records if r.state == "complete" and r.feasible and r.ratio]
    if not feasible:
        return None
    if policy.objective == "most_accurate":
        return min(feasible, key=lambda r: (max(r.drop or 0.0, 0.0), r.ratio))
    return min(feasible, key=lambda r: r.ratio)


def neighbors(space: Space, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every parameter set of ``space`` one choice away from ``params``, in the space's
    order (the default first, then hot layers, backend, graph, shapes)."""
    for name, choices in space.distributions().items():
        for choice in choices:
            if choice != params.get(name):
                yield {**params, name: choice}


def next_neighbor(space: Space, records: Sequence[TrialRecord], policy: Policy,
                  skip: Mapping[Choice, float] | None = None,
                  sensitivity: SensitivityReport | None = None,
                  tried: Collection[str] = ()) -> dict[str, Any] | None:
    """The first neighbor of the incumbent whose recipe no trial has evaluated yet and has no
    choice in ``skip`` (those the trials rank out, :func:`~.baselines.ranked_out`); None where
    there is no incumbent, the incumbent cannot be said in ``space``, or every neighbor was
    tried. With ``sensitivity``, the neighbors it predicts to break the accuracy budget (the
    incumbent's measured drop plus :func:`~.baselines.drop_change`) come after the rest.
    ``tried``: hashes of recipes tried without a record (refused before any build)."""
    best = incumbent(records, policy)
    if best is None:
        return None
    try:
        params = space.params_for(Recipe.from_dict(best.recipe))
    except RecipeError:
        return None
    if params is None:
        return None
    seen = {r.recipe_hash for r in records} | set(tried)
    room = policy.max_accuracy_drop - max(best.drop or 0.0, 0.0)
    deferred: dict[str, Any] | None = None
    for candidate in neighbors(space, params):
        recipe = space.recipe(candidate)
        if recipe.hash in seen or slowdown(skip or {}, candidate, recipe) is not None:
            continue
        if sensitivity is not None and drop_change(sensitivity, space, params, candidate) > room:
            deferred = deferred or candidate
            continue
        return candidate
    return deferred
