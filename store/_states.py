"""The words the store's ``state`` columns hold, once. Which moves between them are allowed is
not the store's business: ``pgc_daemon.states`` keeps that table beside the code that moves
deployments, and hands the store the states a move may start from (a compare-and-set)."""

from __future__ import annotations

import enum


class DeploymentState(str, enum.Enum):
    CANDIDATE = "candidate"
    BUILDING = "building"
    WARMING = "warming"
    VERIFYING = "verifying"
    CANARY = "canary"
    ACTIVE = "active"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    SUPERSEDED = "superseded"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


class RunState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    INFEASIBLE = "infeasible"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


#: A search run that a worker is (or is about to be) working.
RUN_OPEN = frozenset({RunState.QUEUED, RunState.RUNNING})
#: A search run that finished its study (whatever it found).
RUN_FINISHED = frozenset({RunState.DONE, RunState.INFEASIBLE})
