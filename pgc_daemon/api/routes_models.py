"""Models, their policies, profiles and events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

import store as st
from pgc_daemon.api.deps import StoreDep, TokenDep
from pgc_daemon.api.errors import RESPONSES_404, RESPONSES_MUTATING
from pgc_daemon.api.schemas import EventPublic, ModelPublic, PolicyPublic, PolicyUpdate, ProfilePublic
from pgc_daemon.policy import Policy
from pgc_daemon.status import model_summary, profile_summary

router = APIRouter(prefix="/api/models", tags=["models"])


def model_or_404(s: object, name: str) -> st.Model:
    return st.repo.get_model(s, name)  # type: ignore[arg-type]  # NotFound -> 404


@router.get("", response_model=list[ModelPublic], summary="Every model an agent registered")
def list_models(store: StoreDep) -> list[dict]:
    with store.session() as s:
        return [model_summary(s, m) for m in st.repo.list_models(s)]


@router.get("/{name}", response_model=ModelPublic, responses=RESPONSES_404, summary="One model")
def get_model(name: str, store: StoreDep) -> dict:
    with store.session() as s:
        return model_summary(s, model_or_404(s, name))


def _policy_public(row: st.Policy) -> PolicyPublic:
    return PolicyPublic(**Policy.parse(row.settings).model_dump(), version=row.version, updated_at=row.updated_at)


@router.get("/{name}/policy", response_model=PolicyPublic, responses=RESPONSES_404)
def get_policy(name: str, store: StoreDep) -> PolicyPublic:
    with store.session() as s:
        model = model_or_404(s, name)
        row = st.repo.get_policy(s, model.id)
        if row is None:
            row = st.repo.put_policy(s, model.id, Policy().model_dump())
        return _policy_public(row)


@router.put(
    "/{name}/policy",
    response_model=PolicyPublic,
    responses={**RESPONSES_404, **RESPONSES_MUTATING},
    dependencies=[TokenDep],
    summary="Replace the policy (a new policy starts a new search)",
)
def put_policy(name: str, body: PolicyUpdate, store: StoreDep) -> PolicyPublic:
    with store.session() as s:
        model = model_or_404(s, name)
        row = st.repo.put_policy(s, model.id, Policy(**body.model_dump()).model_dump())
        st.repo.add_event(s, model.id, "policy", f"policy is now version {row.version}")
        return _policy_public(row)


@router.get(
    "/{name}/profile",
    response_model=ProfilePublic,
    responses=RESPONSES_404,
    summary="Per-layer live latency, hottest first, with suggestions",
)
def get_profile(
    name: str,
    store: StoreDep,
    variant_id: Annotated[int | None, Query(ge=1, description="default: the fp32 base")] = None,
    since: Annotated[float, Query(ge=0, description="UTC seconds; default: all")] = 0.0,
) -> dict:
    with store.session() as s:
        return profile_summary(s, model_or_404(s, name), variant_id=variant_id, since=since)


@router.get("/{name}/events", response_model=list[EventPublic], responses=RESPONSES_404)
def get_events(
    name: str, store: StoreDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[st.Event]:
    with store.session() as s:
        return list(st.repo.list_events(s, model_or_404(s, name).id, limit=limit))
