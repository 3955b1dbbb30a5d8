"""Models: their summaries, policies, live profiles, latency timelines and events."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy.orm import Session

import store as st
from pgc_daemon.api.deps import SearchLimitDep, StoreDep, TokenDep
from pgc_daemon.api.errors import RESPONSES_404, RESPONSES_429, RESPONSES_503, RESPONSES_MUTATING
from pgc_daemon.api.schemas import (
    MAX_ID,
    EventPublic,
    ModelPublic,
    PolicyPublic,
    PolicyUpdate,
    ProfilePublic,
    ReplicaPublic,
    TimelinePublic,
)
from pgc_daemon.policy import load_policy
from pgc_daemon.services.queries import model_summary, profile_summary, replicas
from pgc_daemon.services.timeline import timeline_summary

router = APIRouter(prefix="/api/models", tags=["models"], responses=RESPONSES_503)

Since = Annotated[
    float, Query(ge=0, allow_inf_nan=False, description="UTC seconds since the epoch; default: all")
]


#: Operations on one model, reachable from the list (OpenAPI links: clients and fuzzers
#: learn where real model names come from).
PER_MODEL_OPERATIONS = (
    "get_model", "get_policy", "put_policy", "get_profile", "get_timeline", "get_events", "list_replicas",
    "list_trials", "get_front", "list_searches", "optimize", "list_deployments", "deploy",
    "rollback", "cancel",
)
LINKS = {
    op: {"operationId": op, "parameters": {"name": "$response.body#/0/name"}}
    for op in PER_MODEL_OPERATIONS
}


def model_or_404(s: Session, name: str) -> st.Model:
    return st.repo.get_model(s, name)  # NotFound -> 404


@router.get(
    "",
    response_model=list[ModelPublic],
    responses={200: {"description": "every model, by name", "links": LINKS}},
    summary="Every model an agent registered",
)
def list_models(request: Request) -> list[dict[str, Any]]:
    # polled by every open dashboard: computed once per second, shared (api/cache.py)
    return request.app.state.models_cache.get()


def all_model_summaries(store: st.Store) -> list[dict[str, Any]]:
    with store.session() as s:
        return [model_summary(s, m) for m in st.repo.list_models(s)]


@router.get(
    "/{name}",
    response_model=ModelPublic,
    responses=RESPONSES_404,
    summary="One model: active variant, live latency, policy and search progress",
)
def get_model(name: str, store: StoreDep) -> dict[str, Any]:
    with store.session() as s:
        return model_summary(s, model_or_404(s, name))


def _policy_public(s: Session, model: st.Model) -> PolicyPublic:
    # an agent always stores one; version 0 means "the defaults, never set"
    snapshot = load_policy(s, model.id)
    row = st.repo.get_policy(s, model.id)
    updated_at = row.updated_at if row is not None else model.created_at
    return PolicyPublic(**snapshot.policy.model_dump(), version=snapshot.version, updated_at=updated_at)


@router.get("/{name}/policy", response_model=PolicyPublic, responses=RESPONSES_404)
def get_policy(name: str, store: StoreDep) -> PolicyPublic:
    with store.session() as s:
        return _policy_public(s, model_or_404(s, name))


@router.put(
    "/{name}/policy",
    response_model=PolicyPublic,
    responses={**RESPONSES_404, **RESPONSES_MUTATING, **RESPONSES_429},
    dependencies=[TokenDep],
    summary="Replace the policy (a new policy starts a new search)",
    description="A change of the study terms (objective, accuracy budget, latency target or "
    "percentile) or of the budget (trials, time) may start a search, so it counts against the "
    "per-model search-start limit (429 with `Retry-After`); deployment settings alone do not.",
)
def put_policy(name: str, body: PolicyUpdate, store: StoreDep, limit: SearchLimitDep) -> PolicyPublic:
    new = body.to_policy()
    with store.session() as s:
        model = model_or_404(s, name)
        before = st.repo.get_policy(s, model.id)
        old_version = before.version if before else 0
        old = load_policy(s, model.id).policy
        if before is None or (new.study, new.budget) != (old.study, old.budget):
            limit.take(name)
        row = st.repo.put_policy(s, model.id, new.model_dump())
        if row.version != old_version:
            st.repo.add_event(s, model.id, "policy", f"policy is now version {row.version}")
        return _policy_public(s, model)


@router.get(
    "/{name}/profile",
    response_model=ProfilePublic,
    responses=RESPONSES_404,
    summary="Per-layer live latency, hottest first, with suggestions",
    description="The fp32 base's per-layer rows (or `variant_id`'s), and beside them the "
    "serving variant's (`active`): for a compiled (AOTInductor) variant, its kernels timed on "
    "sampled calls and split over the layers each was generated from.",
)
def get_profile(
    name: str,
    store: StoreDep,
    variant_id: Annotated[int | None, Query(ge=1, le=MAX_ID, description="default: the fp32 base")] = None,
    since: Since = 0.0,
) -> dict[str, Any]:
    with store.session() as s:
        return profile_summary(s, model_or_404(s, name), variant_id=variant_id, since=since)


@router.get(
    "/{name}/timeline",
    response_model=TimelinePublic,
    responses=RESPONSES_404,
    summary="Live request latency over time per variant, with deployment and rollback markers",
)
def get_timeline(
    name: str,
    store: StoreDep,
    since: Since = 0.0,
    points: Annotated[int, Query(ge=1, le=2000, description="steps per variant at most")] = 300,
) -> dict[str, Any]:
    with store.session() as s:
        return timeline_summary(s, model_or_404(s, name), since=since, until=time.time(), points=points)


@router.get("/{name}/events", response_model=list[EventPublic], responses=RESPONSES_404)
def get_events(
    name: str, store: StoreDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[st.Event]:
    with store.session() as s:
        return list(st.repo.list_events(s, model_or_404(s, name).id, limit=limit))


@router.get(
    "/{name}/replicas",
    response_model=list[ReplicaPublic],
    responses=RESPONSES_404,
    summary="The model's serving processes: what each serves, how fast, what it compiled",
)
def list_replicas(name: str, store: StoreDep) -> list[dict[str, Any]]:
    with store.session() as s:
        return replicas(s, model_or_404(s, name))
