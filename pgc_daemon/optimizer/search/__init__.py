"""Searching a model's variant space with Optuna.

The names below load lazily: ``python -m pgc_daemon.optimizer.search.worker`` imports this
package first, and the worker sets up its parent-death signal before anything imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pgc_daemon.optimizer.search.evaluate import Evaluator, Score
    from pgc_daemon.optimizer.search.hotprofile import hot_layers
    from pgc_daemon.optimizer.search.measure import Timing, interleaved
    from pgc_daemon.optimizer.search.results import SearchResult, TrialRecord, pareto_front, pick
    from pgc_daemon.optimizer.search.space import Space, build_space
    from pgc_daemon.optimizer.search.study import Search, study_name

_WHERE = {
    "Evaluator": "evaluate",
    "Score": "evaluate",
    "Search": "study",
    "SearchResult": "results",
    "Space": "space",
    "Timing": "measure",
    "TrialRecord": "results",
    "build_space": "space",
    "hot_layers": "hotprofile",
    "interleaved": "measure",
    "pareto_front": "results",
    "pick": "results",
    "study_name": "study",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
