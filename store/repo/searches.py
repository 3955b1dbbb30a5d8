"""Search runs, their trials, and per-layer sensitivity (what a search reads and writes)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from store._errors import NotFound
from store._schema import LayerSensitivity, SearchRun, Trial
from store._states import RUN_OPEN, RunState

_OPEN_STATES = sorted(state.value for state in RUN_OPEN)

# --------------------------------------------------------------------------- search runs


def create_search_run(
    s: Session,
    model_id: int,
    *,
    study_name: str,
    policy_version: int,
    trigger: str,
    trials_budget: int,
    policy: dict | None = None,
) -> SearchRun:
    """Queue a search run; ``policy``: a snapshot of the policy's settings it runs under."""
    now = time.time()
    run = SearchRun(
        model_id=model_id,
        study_name=study_name,
        policy_version=policy_version,
        state=RunState.QUEUED.value,
        trigger=trigger,
        trials_budget=trials_budget,
        policy=dict(policy) if policy is not None else None,
        trials_done=0,
        started_at=now,
        heartbeat_at=now,
    )
    s.add(run)
    s.flush()
    return run


def update_search_run(s: Session, run_id: int, **fields: Any) -> SearchRun:
    run = s.get(SearchRun, run_id)
    if run is None:
        raise NotFound(f"no search run {run_id}")
    for key, value in fields.items():
        setattr(run, key, value)
    run.heartbeat_at = time.time()
    s.flush()
    return run


def get_search_run(s: Session, run_id: int) -> SearchRun:
    run = s.get(SearchRun, run_id)
    if run is None:
        raise NotFound(f"no search run {run_id}")
    return run


def list_search_runs(s: Session, model_id: int, *, limit: int = 50) -> Sequence[SearchRun]:
    q = select(SearchRun).where(SearchRun.model_id == model_id)
    return s.scalars(q.order_by(SearchRun.id.desc()).limit(limit)).all()


def running_search(s: Session, model_id: int) -> SearchRun | None:
    q = select(SearchRun).where(
        SearchRun.model_id == model_id, SearchRun.state.in_(_OPEN_STATES)
    )
    return s.scalars(q.order_by(SearchRun.id.desc())).first()


def add_trial(s: Session, **fields: Any) -> Trial:
    fields.setdefault("created_at", time.time())
    trial = Trial(**fields)
    s.add(trial)
    s.flush()
    return trial


def list_trials(
    s: Session, model_id: int, *, run_id: int | None = None, limit: int = 2000
) -> Sequence[Trial]:
    """The newest ``limit`` trials of a model (of one run), oldest first."""
    q = select(Trial).where(Trial.model_id == model_id)
    if run_id is not None:
        q = q.where(Trial.run_id == run_id)
    newest = s.scalars(q.order_by(Trial.id.desc()).limit(limit)).all()
    return newest[::-1]


# --------------------------------------------------------------------------- sensitivity

_SENSITIVITY_FIELDS = (
    "metric", "fidelity", "rms", "sqnr_db", "max_abs", "layer_sqnr_db", "status", "inputs",
    "samples",
)


def save_sensitivity(
    s: Session, model_id: int, graph_hash: str, rows: Iterable[Mapping[str, Any]]
) -> int:
    """Store per-layer sensitivity for one graph (model version) of a model, one row per
    (layer, choice), as ``compiler.SensitivityReport.to_rows()`` gives them. A (layer, choice)
    measured again replaces its row. Returns the number of rows written."""
    existing = {
        (r.layer, r.choice): r
        for r in s.scalars(
            select(LayerSensitivity).where(
                LayerSensitivity.model_id == model_id, LayerSensitivity.graph_hash == graph_hash
            )
        )
    }
    now = time.time()
    n = 0
    for row in rows:
        key = (str(row["layer"]), str(row["choice"]))
        values = {f: row.get(f) for f in _SENSITIVITY_FIELDS}
        values["status"] = values["status"] or "ok"
        values["inputs"] = int(values["inputs"] or 0)
        rec = existing.get(key)
        if rec is None:
            rec = LayerSensitivity(
                model_id=model_id, graph_hash=graph_hash, layer=key[0], choice=key[1]
            )
            s.add(rec)
            existing[key] = rec
        for f, v in values.items():
            setattr(rec, f, v)
        rec.created_at = now
        n += 1
    s.flush()
    return n


def load_sensitivity(
    s: Session, model_id: int, graph_hash: str | None = None, *, choice: str | None = None
) -> list[LayerSensitivity]:
    """Sensitivity rows of one graph of a model (default: the graph measured last), most
    sensitive first: lowest fidelity, then lowest SQNR; rows without numbers (layers that
    cannot take the choice) last."""
    if graph_hash is None:
        graph_hash = s.scalars(
            select(LayerSensitivity.graph_hash)
            .where(LayerSensitivity.model_id == model_id)
            .order_by(LayerSensitivity.created_at.desc(), LayerSensitivity.id.desc())
            .limit(1)
        ).first()
        if graph_hash is None:
            return []
    q = select(LayerSensitivity).where(
        LayerSensitivity.model_id == model_id, LayerSensitivity.graph_hash == graph_hash
    )
    if choice is not None:
        q = q.where(LayerSensitivity.choice == choice)
    rows = list(s.scalars(q))
    rows.sort(
        key=lambda r: (
            r.fidelity is None,
            r.fidelity if r.fidelity is not None else 0.0,
            r.sqnr_db if r.sqnr_db is not None else 0.0,
            r.layer,
            r.choice,
        )
    )
    return rows


def delete_sensitivity(s: Session, model_id: int, graph_hash: str | None = None) -> int:
    """Forget a model's sensitivity (of one graph, or of every graph)."""
    q = delete(LayerSensitivity).where(LayerSensitivity.model_id == model_id)
    if graph_hash is not None:
        q = q.where(LayerSensitivity.graph_hash == graph_hash)
    return int(s.execute(q).rowcount or 0)
