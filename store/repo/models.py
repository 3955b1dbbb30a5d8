"""Models, their variants and policies, and events."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from store._errors import NotFound
from store._schema import Event, Model, Policy, Variant

# --------------------------------------------------------------------------- models


def upsert_model(
    s: Session,
    name: str,
    *,
    spec: str | None = None,
    spec_origin: dict | None = None,
    graph_hash: str | None = None,
    hardware: str | None = None,
    metric: str | None = None,
    input_signature: dict | None = None,
) -> Model:
    now = time.time()
    model = s.scalars(select(Model).where(Model.name == name)).one_or_none()
    if model is None:
        model = Model(name=name, created_at=now, last_seen_at=now)
        s.add(model)
    model.spec = spec if spec is not None else model.spec
    model.spec_origin = spec_origin if spec_origin is not None else model.spec_origin
    model.graph_hash = graph_hash if graph_hash is not None else model.graph_hash
    model.hardware = hardware if hardware is not None else model.hardware
    model.metric = metric if metric is not None else model.metric
    if input_signature is not None:
        model.input_signature = input_signature
    model.last_seen_at = now
    s.flush()
    return model


def get_model(s: Session, name: str) -> Model:
    model = s.scalars(select(Model).where(Model.name == name)).one_or_none()
    if model is None:
        raise NotFound(f"no model named {name!r}")
    return model


def list_models(s: Session) -> Sequence[Model]:
    return s.scalars(select(Model).order_by(Model.name)).all()


def touch_model(s: Session, model_id: int) -> None:
    s.execute(update(Model).where(Model.id == model_id).values(last_seen_at=time.time()))


# --------------------------------------------------------------------------- variants


def get_or_create_variant(
    s: Session, model_id: int, recipe_hash: str, recipe: dict, label: str
) -> Variant:
    variant = s.scalars(
        select(Variant).where(Variant.model_id == model_id, Variant.recipe_hash == recipe_hash)
    ).one_or_none()
    if variant is None:
        variant = Variant(
            model_id=model_id,
            recipe_hash=recipe_hash,
            recipe=recipe,
            label=label,
            created_at=time.time(),
        )
        s.add(variant)
        s.flush()
    return variant


def set_variant_artifact(s: Session, variant_id: int, digest: str | None) -> None:
    """Record the artifact a worker built for this variant (serving processes load it)."""
    variant = get_variant(s, variant_id)
    variant.artifact = digest


def set_variant_profile_artifact(s: Session, variant_id: int, digest: str | None) -> None:
    """Record the profiling twin a worker built for this variant (serving processes run it
    on sampled calls)."""
    get_variant(s, variant_id).profile_artifact = digest


def get_variant(s: Session, variant_id: int) -> Variant:
    variant = s.get(Variant, variant_id)
    if variant is None:
        raise NotFound(f"no variant {variant_id}")
    return variant


def list_variants(s: Session, model_id: int) -> Sequence[Variant]:
    return s.scalars(select(Variant).where(Variant.model_id == model_id).order_by(Variant.id)).all()


# --------------------------------------------------------------------------- policies


def get_policy(s: Session, model_id: int) -> Policy | None:
    return s.get(Policy, model_id)


def put_policy(s: Session, model_id: int, settings: Mapping[str, Any]) -> Policy:
    """Store a policy; its version goes up only when the settings change."""
    policy = s.get(Policy, model_id)
    now = time.time()
    if policy is None:
        policy = Policy(model_id=model_id, version=1, settings=dict(settings), updated_at=now)
        s.add(policy)
    elif policy.settings != dict(settings):
        policy.settings = dict(settings)
        policy.version += 1
        policy.updated_at = now
    s.flush()
    return policy


# --------------------------------------------------------------------------- events


def add_event(
    s: Session,
    model_id: int | None,
    kind: str,
    message: str,
    *,
    level: str = "info",
    data: dict | None = None,
) -> Event:
    ev = Event(model_id=model_id, at=time.time(), level=level, kind=kind, message=message, data=data)
    s.add(ev)
    s.flush()
    return ev


def count_events(s: Session, model_id: int, kind: str) -> int:
    return s.scalar(
        select(func.count(Event.id)).where(Event.model_id == model_id, Event.kind == kind)
    ) or 0


def list_events(
    s: Session, model_id: int | None = None, *, kind: str | None = None, limit: int = 200
) -> Sequence[Event]:
    q = select(Event)
    if model_id is not None:
        q = q.where(Event.model_id == model_id)
    if kind is not None:
        q = q.where(Event.kind == kind)
    return s.scalars(q.order_by(Event.id.desc()).limit(limit)).all()
