"""What the optimizer's tick asks of the store, every second, for every model: each question
answered by one small query whose cost does not grow with the model's history (the tick reads
the newest windows through the ``(model_id, window_end)`` indexes, never a whole history).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from sqlalchemy import and_, case, func, not_, or_, select
from sqlalchemy.orm import Session

from store._schema import Deployment, RequestStat, SearchRun, Transition, Variant
from store._states import DeploymentState

__all__ = [
    "ActiveVariant",
    "RunRow",
    "StaleDeployment",
    "active_variant",
    "busy_between",
    "calls_since",
    "latency_between",
    "run_rows",
    "stale_deployments",
]

_ACTIVE = DeploymentState.ACTIVE.value
_BUILDING = DeploymentState.BUILDING.value
#: The states that end a deployment's build/warm/verify phase (the busy part of a deployment,
#: as ``pgc_daemon.services.queries.busy_intervals`` counts it).
_BUILD_ENDS = tuple(
    s.value
    for s in (
        DeploymentState.CANARY,
        DeploymentState.ACTIVE,
        DeploymentState.FAILED,
        DeploymentState.ROLLED_BACK,
        DeploymentState.CANCELLED,
    )
)


class RunRow(NamedTuple):
    study_name: str
    state: str
    policy_version: int
    trials_budget: int
    started_at: float


class ActiveVariant(NamedTuple):
    deployment_id: int
    variant_id: int
    recipe_hash: str
    since: float
    """When the deployment became active (its ``updated_at`` if no transition says)."""


class StaleDeployment(NamedTuple):
    id: int
    model_id: int
    state: str
    updated_at: float


def calls_since(s: Session, model_id: int, since: float) -> int:
    """Live calls in the request windows that ended at or after ``since``."""
    q = select(func.sum(RequestStat.count)).where(
        RequestStat.model_id == model_id, RequestStat.window_end >= since
    )
    return int(s.scalar(q) or 0)


def run_rows(s: Session, model_id: int, *, limit: int = 200) -> list[RunRow]:
    """The newest ``limit`` search runs of a model, newest first: the columns the schedule
    reads only (no policy snapshot, no message)."""
    r = SearchRun
    q = (
        select(r.study_name, r.state, r.policy_version, r.trials_budget, r.started_at)
        .where(r.model_id == model_id)
        .order_by(r.id.desc())
        .limit(limit)
    )
    return [RunRow(*row) for row in s.execute(q)]


def active_variant(s: Session, model_id: int) -> ActiveVariant | None:
    """The variant the model's active deployment serves, with its recipe hash and when it
    became active; None without an active deployment of a variant."""
    became = (
        select(func.min(Transition.at))
        .where(Transition.deployment_id == Deployment.id, Transition.to_state == _ACTIVE)
        .scalar_subquery()
    )
    d = Deployment
    q = (
        select(d.id, d.variant_id, Variant.recipe_hash, became, d.updated_at)
        .join(Variant, Variant.id == Deployment.variant_id)
        .where(Deployment.model_id == model_id, Deployment.state == _ACTIVE)
        .order_by(Deployment.id.desc())
        .limit(1)
    )
    row = s.execute(q).first()
    if row is None:
        return None
    dep_id, variant_id, recipe_hash, at, updated_at = row
    return ActiveVariant(dep_id, variant_id, recipe_hash, at if at is not None else updated_at)


def busy_between(
    s: Session, model_id: int, start: float, end: float, *, now: float | None = None
) -> list[tuple[float, float]]:
    """When pgc loaded the machine (search runs; deployments from ``building`` to the end of
    verification), as merged, sorted intervals, only those that overlap ``[start, end]``: the
    same intervals ``services.queries.busy_intervals`` lists, bounded to the span a summary
    reads, so their number does not grow with the model's history."""
    now = time.time() if now is None else now
    r = SearchRun
    runs = s.execute(
        select(r.started_at, func.coalesce(r.finished_at, now)).where(
            r.model_id == model_id,
            r.started_at < end,
            or_(r.finished_at.is_(None), r.finished_at > start),
        )
    ).all()
    t = Transition
    built = func.min(case((t.to_state == _BUILDING, t.at)))
    ended = func.min(case((t.to_state.in_(_BUILD_ENDS), t.at)))
    deps = s.execute(
        select(built, ended)
        .join(Deployment, Deployment.id == t.deployment_id)
        .where(Deployment.model_id == model_id)
        .group_by(t.deployment_id)
        .having(built.is_not(None), built < end, or_(ended.is_(None), ended > start))
    ).all()
    intervals = sorted(
        [(float(a), float(b)) for a, b in runs]
        + [(float(a), float(b) if b is not None else now) for a, b in deps]
    )
    merged: list[tuple[float, float]] = []
    for a, b in intervals:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def latency_between(
    s: Session,
    model_id: int,
    variant_id: int,
    start: float,
    end: float,
    *,
    exclude: Sequence[tuple[float, float]] = (),
) -> tuple[int, float | None]:
    """Calls and their count-weighted p50 (ms) over one variant's request windows that ended
    within ``[start, end]``, leaving out windows that overlap an ``exclude`` interval."""
    r = RequestStat
    q = select(func.sum(r.count), func.sum(r.p50_ms * r.count)).where(
        r.model_id == model_id,
        r.window_end >= start,
        r.window_end <= end,
        r.variant_id == variant_id,
    )
    for a, b in exclude:
        q = q.where(not_(and_(r.window_start < b, r.window_end > a)))
    n, p50 = s.execute(q).one()
    if not n:
        return 0, None
    return int(n), float(p50) / int(n)


def stale_deployments(
    s: Session, states: Collection[Any], updated_before: float
) -> list[StaleDeployment]:
    """Deployments (of every model) in one of ``states`` whose ``updated_at`` is older than
    ``updated_before``: work an agent took and stopped reporting on, or never took."""
    d = Deployment
    q = (
        select(d.id, d.model_id, d.state, d.updated_at)
        .where(d.state.in_(sorted(str(x) for x in states)), d.updated_at < updated_before)
        .order_by(d.id)
    )
    return [StaleDeployment(*row) for row in s.execute(q)]
