"""Replicas: the serving processes of one model, each with the variant it serves and its live
numbers, so a fleet (``uvicorn --workers N``, hosts on one PostgreSQL) is visible as one model
with several processes, and a replica that starts late knows what the others serve."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from store._errors import NotFound
from store._schema import Replica

#: Stopped (or vanished) replicas kept per model for the record.
KEEP_STOPPED = 50


def register_replica(s: Session, model_id: int, name: str, host: str, pid: int) -> Replica:
    now = time.time()
    row = Replica(
        model_id=model_id, name=name, host=host, pid=pid, started_at=now, seen_at=now,
        state="starting", calls=0, compiles=0, loads=0,
    )
    s.add(row)
    s.flush()
    return row


def beat_replica(s: Session, name: str, **fields: Any) -> None:
    """Refresh a replica's ``seen_at`` and set ``fields`` (what it serves, its live numbers)."""
    done = s.execute(
        update(Replica).where(Replica.name == name).values(seen_at=time.time(), **fields)
    ).rowcount
    if not done:
        raise NotFound(f"no replica {name}")


def stop_replica(s: Session, name: str) -> None:
    s.execute(
        update(Replica)
        .where(Replica.name == name)
        .values(state="stopped", stopped_at=time.time(), seen_at=time.time())
    )


def live_replicas(s: Session, model_id: int, within_s: float, *, now: float | None = None) -> Sequence[Replica]:
    """Replicas of the model not stopped and heard from in the last ``within_s`` seconds."""
    cutoff = (time.time() if now is None else now) - within_s
    return s.scalars(
        select(Replica)
        .where(Replica.model_id == model_id, Replica.stopped_at.is_(None), Replica.seen_at >= cutoff)
        .order_by(Replica.id)
    ).all()


def list_replicas(s: Session, model_id: int, *, limit: int = 100) -> Sequence[Replica]:
    """The newest replicas of a model, live or not."""
    return s.scalars(
        select(Replica).where(Replica.model_id == model_id).order_by(Replica.id.desc()).limit(limit)
    ).all()


def prune_replicas(s: Session, model_id: int, *, within_s: float, keep: int = KEEP_STOPPED) -> int:
    """Forget stopped or vanished replicas past the newest ``keep`` of them."""
    cutoff = time.time() - within_s
    gone = s.scalars(
        select(Replica.id)
        .where(Replica.model_id == model_id)
        .where((Replica.stopped_at.is_not(None)) | (Replica.seen_at < cutoff))
        .order_by(Replica.id.desc())
        .offset(keep)
    ).all()
    if not gone:
        return 0
    return s.execute(delete(Replica).where(Replica.id.in_(list(gone)))).rowcount or 0
