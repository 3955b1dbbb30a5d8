"""Retention of what searches and deployments leave behind (trials, variants, deployments and
their transitions, events), bounded by count per model, so that reads that walk a model's
history cost the same after a year as after a day. Statistics are bounded by age instead
(``stats.prune_stats``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import delete, exists, func, or_, select
from sqlalchemy.orm import Session

from store._schema import (
    Deployment,
    Event,
    HostStat,
    LayerStat,
    Model,
    Replica,
    RequestStat,
    SearchRun,
    Trial,
    Variant,
)
from store._states import DeploymentState

KEEP_TRIALS = 2000
KEEP_RUNS = 3
KEEP_DEPLOYMENTS = 500
KEEP_EVENTS = 2000

_FINISHED = sorted(
    s.value
    for s in (
        DeploymentState.FAILED,
        DeploymentState.ROLLED_BACK,
        DeploymentState.SUPERSEDED,
        DeploymentState.CANCELLED,
    )
)
"""The only deployments retention deletes: never the active one, never an open one."""


@dataclass(frozen=True)
class Pruned:
    trials: int = 0
    deployments: int = 0
    variants: int = 0
    events: int = 0

    @property
    def total(self) -> int:
        return self.trials + self.deployments + self.variants + self.events


def _id_floor(s: Session, column, where, keep: int) -> int | None:  # type: ignore[no-untyped-def]
    """The smallest id among the newest ``keep`` rows; None when there are no more than
    ``keep`` (nothing to prune). ``keep`` 0 prunes everything (floor past the largest id)."""
    if keep <= 0:
        top = s.scalar(select(func.max(column)).where(where))
        return None if top is None else top + 1
    return s.scalar(select(column).where(where).order_by(column.desc()).offset(keep - 1).limit(1))


def prune_history(
    s: Session,
    *,
    keep_trials: int = KEEP_TRIALS,
    keep_runs: int = KEEP_RUNS,
    keep_deployments: int = KEEP_DEPLOYMENTS,
    keep_events: int = KEEP_EVENTS,
    protect_hashes: Collection[str] = (),
) -> Pruned:
    """Delete, per model, trials past the newest ``keep_trials`` (the trials of the newest
    ``keep_runs`` search runs are always kept), finished deployments past the newest
    ``keep_deployments`` (the active deployment and open ones are always kept; transitions go
    with their deployment), events past the newest ``keep_events``, and then variants nothing
    refers to any more (no deployment, trial, run or statistics row), except those whose
    recipe hash is in ``protect_hashes`` (the caller's fp32 base)."""
    trials = deployments = events = 0
    for model_id in s.scalars(select(Model.id)):
        floor = _id_floor(s, Trial.id, Trial.model_id == model_id, keep_trials)
        if floor is not None:
            runs = list(
                s.scalars(
                    select(SearchRun.id)
                    .where(SearchRun.model_id == model_id)
                    .order_by(SearchRun.id.desc())
                    .limit(keep_runs)
                )
            ) if keep_runs > 0 else []
            q = delete(Trial).where(Trial.model_id == model_id, Trial.id < floor)
            if runs:
                q = q.where(Trial.run_id.not_in(runs))
            trials += s.execute(q).rowcount or 0
        floor = _id_floor(s, Deployment.id, Deployment.model_id == model_id, keep_deployments)
        if floor is not None:
            q = delete(Deployment).where(
                Deployment.model_id == model_id,
                Deployment.id < floor,
                Deployment.state.in_(_FINISHED),
            )
            deployments += s.execute(q).rowcount or 0
        floor = _id_floor(s, Event.id, Event.model_id == model_id, keep_events)
        if floor is not None:
            events += s.execute(delete(Event).where(Event.model_id == model_id, Event.id < floor)).rowcount or 0
    v = Variant.id
    unused = [
        ~exists().where(or_(Deployment.variant_id == v, Deployment.previous_variant_id == v)),
        ~exists().where(Trial.variant_id == v),
        ~exists().where(SearchRun.chosen_variant_id == v),
        ~exists().where(RequestStat.variant_id == v),
        ~exists().where(LayerStat.variant_id == v),
        ~exists().where(HostStat.variant_id == v),
        ~exists().where(Replica.variant_id == v),
    ]
    q = delete(Variant).where(*unused)
    if protect_hashes:
        q = q.where(Variant.recipe_hash.not_in(list(protect_hashes)))
    variants = s.execute(q.execution_options(synchronize_session=False)).rowcount or 0
    return Pruned(trials=trials, deployments=deployments, variants=variants, events=events)


def trial_counts(s: Session, model_id: int) -> dict[str, int]:
    """Trials of a model by state, counted in SQL (no rows loaded)."""
    q = select(Trial.state, func.count()).where(Trial.model_id == model_id).group_by(Trial.state)
    return {state: int(n) for state, n in s.execute(q)}
