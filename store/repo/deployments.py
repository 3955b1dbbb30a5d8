"""Deployments, their compare-and-set transitions, and the per-model decision lock."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, selectinload

from store._engine import begin_immediate
from store._errors import NotFound, StoreConflict
from store._schema import Deployment, Model, Transition
from store._states import DeploymentState

_CANDIDATE = DeploymentState.CANDIDATE.value
_ACTIVE = DeploymentState.ACTIVE.value


def create_deployment(
    s: Session,
    model_id: int,
    variant_id: int | None,
    *,
    source: str,
    reason: str,
    expected_speedup: float | None = None,
    expected_fidelity: float | None = None,
) -> Deployment:
    now = time.time()
    dep = Deployment(
        model_id=model_id,
        variant_id=variant_id,
        state=_CANDIDATE,
        source=source,
        reason=reason,
        expected_speedup=expected_speedup,
        expected_fidelity=expected_fidelity,
        created_at=now,
        updated_at=now,
    )
    dep.transitions.append(Transition(from_state=None, to_state=_CANDIDATE, reason=reason, at=now))
    s.add(dep)
    s.flush()
    return dep


def transition(
    s: Session,
    deployment_id: int,
    to_state: str,
    reason: str,
    *,
    expected: Collection[str],
    **fields: Any,
) -> Deployment:
    """Move a deployment to ``to_state`` if, at this moment, it is in one of ``expected``: a
    compare-and-set (``UPDATE … WHERE state IN expected``), so of two transactions racing for
    one deployment exactly one moves it. The other gets :class:`StoreConflict`."""
    current = s.scalar(select(Deployment.state).where(Deployment.id == deployment_id))
    if current is None:
        raise NotFound(f"no deployment {deployment_id}")
    if current not in {str(e) for e in expected}:
        raise StoreConflict(f"deployment {deployment_id} cannot go from {current} to {to_state}")
    now = time.time()
    values = {"state": str(to_state), "reason": reason, "updated_at": now, **fields}
    result = s.execute(
        update(Deployment)
        .where(Deployment.id == deployment_id, Deployment.state == current)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # another transaction moved it between the read and the write
        raise StoreConflict(f"deployment {deployment_id} was moved from {current} meanwhile")
    s.add(
        Transition(
            deployment_id=deployment_id,
            from_state=current,
            to_state=str(to_state),
            reason=reason,
            at=now,
        )
    )
    s.flush()
    dep = get_deployment(s, deployment_id)
    s.refresh(dep)
    return dep


def touch_deployment(s: Session, deployment_id: int) -> str:
    """An agent's heartbeat: refresh ``updated_at`` of a deployment that is still open (a
    candidate, or being built, warmed, verified or on canary) and return its state. A finished
    deployment is left as it is (its state is returned, so the agent learns that someone
    else ended it). :class:`NotFound` if there is none."""
    D = DeploymentState
    still_open = [d.value for d in (D.CANDIDATE, D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY)]
    s.execute(
        update(Deployment)
        .where(Deployment.id == deployment_id, Deployment.state.in_(still_open))
        .values(updated_at=time.time())
        .execution_options(synchronize_session=False)
    )
    state = s.scalar(select(Deployment.state).where(Deployment.id == deployment_id))
    if state is None:
        raise NotFound(f"no deployment {deployment_id}")
    return str(state)


def deployments_in(s: Session, model_id: int, states: Collection[Any]) -> Sequence[Deployment]:
    """The model's deployments in one of ``states``, oldest first, without their transitions
    (a question asked every poll: what ``list_deployments`` loads is ten times the work)."""
    q = select(Deployment).where(Deployment.model_id == model_id,
                                 Deployment.state.in_(sorted(str(x) for x in states)))
    return s.scalars(q.order_by(Deployment.id)).all()


def list_deployments(s: Session, model_id: int, *, limit: int = 200) -> Sequence[Deployment]:
    q = (
        select(Deployment)
        .options(selectinload(Deployment.transitions))
        .where(Deployment.model_id == model_id)
        .order_by(Deployment.id.desc())
        .limit(limit)
    )
    return s.scalars(q).all()


def get_deployment(s: Session, deployment_id: int) -> Deployment:
    q = (
        select(Deployment)
        .options(selectinload(Deployment.transitions))
        .where(Deployment.id == deployment_id)
    )
    dep = s.scalars(q).one_or_none()
    if dep is None:
        raise NotFound(f"no deployment {deployment_id}")
    return dep


def active_deployment(s: Session, model_id: int) -> Deployment | None:
    q = select(Deployment).where(Deployment.model_id == model_id, Deployment.state == _ACTIVE)
    return s.scalars(q.order_by(Deployment.id.desc())).first()


def begin_write(s: Session) -> None:
    """Take SQLite's write lock for the rest of the transaction before its first read (a
    no-op on PostgreSQL, where :func:`lock_model` locks the row): for decisions about a model
    that may not exist yet."""
    begin_immediate(s)


def lock_model(s: Session, model_id: int) -> Model:
    """Take the per-model decision lock until the transaction ends: ``SELECT … FOR UPDATE``
    on PostgreSQL; on SQLite, whose ``FOR UPDATE`` is a no-op and whose driver begins
    transactions only at the first write, ``BEGIN IMMEDIATE`` (the database's write lock,
    held until commit). Call it before reading what the decision depends on."""
    begin_immediate(s)
    model = s.scalars(select(Model).where(Model.id == model_id).with_for_update()).one_or_none()
    if model is None:
        raise NotFound(f"no model {model_id}")
    return model
