"""The deployment state machine: which state may follow which, in one table.

``candidate → building → warming → verifying → canary → active``, or ``failed`` /
``rolled_back`` / ``cancelled``; a replaced active deployment becomes ``superseded``. The words
are the store's (:class:`store.DeploymentState`); every move is a compare-and-set in the store
(``UPDATE … WHERE state IN (the states it may come from)``), so two processes racing for one
deployment cannot both move it: the loser gets :class:`store.StoreConflict`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

import store as st
from store import DeploymentState as D
from store import RunState

__all__ = [
    "IN_FLIGHT",
    "OPEN",
    "TERMINAL",
    "TRANSITIONS",
    "D",
    "DeploymentState",
    "RunState",
    "allowed_from",
    "move",
]

DeploymentState = D

TRANSITIONS: dict[D, frozenset[D]] = {
    D.CANDIDATE: frozenset({D.BUILDING, D.ACTIVE, D.FAILED, D.CANCELLED}),
    D.BUILDING: frozenset({D.WARMING, D.FAILED, D.CANCELLED}),
    D.WARMING: frozenset({D.VERIFYING, D.FAILED, D.CANCELLED}),
    D.VERIFYING: frozenset({D.CANARY, D.ACTIVE, D.FAILED, D.CANCELLED}),
    D.CANARY: frozenset({D.ACTIVE, D.ROLLED_BACK, D.FAILED, D.CANCELLED}),
    D.ACTIVE: frozenset({D.SUPERSEDED, D.ROLLED_BACK}),
    D.FAILED: frozenset(),
    D.ROLLED_BACK: frozenset(),
    D.SUPERSEDED: frozenset(),
    D.CANCELLED: frozenset(),
}
TERMINAL = frozenset(state for state, nxt in TRANSITIONS.items() if not nxt)
#: Being worked on by an agent (its swapper thread owns it).
IN_FLIGHT = frozenset({D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY})
#: Not finished: at most one of these per model at a time.
OPEN = IN_FLIGHT | {D.CANDIDATE}
#: Heartbeat of in-flight deployments: while an agent's swapper works on a deployment it
#: refreshes the deployment's ``updated_at`` at least every ``HEARTBEAT_S`` seconds (also
#: through a long build or canary). A deployment in ``IN_FLIGHT`` not updated for
#: ``STALE_AFTER_S`` seconds has lost its agent (``kill -9``, a host gone): any process may
#: then move it to ``failed`` (a compare-and-set, so a live agent that races it just drops it).
HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0


def allowed_from(to_state: D) -> frozenset[D]:
    return frozenset(src for src, nxt in TRANSITIONS.items() if to_state in nxt)


def move(s: Session, deployment_id: int, to_state: D, reason: str, **fields: Any) -> st.Deployment:
    """Move a deployment to ``to_state`` if it is in a state that may precede it, atomically;
    :class:`store.StoreConflict` otherwise (a move another process made first included)."""
    return st.repo.transition(
        s, deployment_id, to_state, reason, expected=allowed_from(to_state), **fields
    )
