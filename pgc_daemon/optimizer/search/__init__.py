"""Searching a model's variant space with Optuna."""

from pgc_daemon.optimizer.search.evaluate import Evaluator, Score
from pgc_daemon.optimizer.search.measure import Timing, interleaved
from pgc_daemon.optimizer.search.space import Space, build_space, hot_layers
from pgc_daemon.optimizer.search.study import Search, SearchResult, TrialRecord, pareto_front, pick, study_name

__all__ = [
    "Evaluator",
    "Score",
    "Search",
    "SearchResult",
    "Space",
    "Timing",
    "TrialRecord",
    "build_space",
    "hot_layers",
    "interleaved",
    "pareto_front",
    "pick",
    "study_name",
]
