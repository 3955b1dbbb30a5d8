"""Search: trials, the latency-accuracy front, starting a search."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status

import store as st
from pgc_daemon.api.deps import DaemonDep, SearchLimitDep, StoreDep, TokenDep
from pgc_daemon.api.errors import (
    RESPONSES_404,
    RESPONSES_409,
    RESPONSES_429,
    RESPONSES_503,
    RESPONSES_MUTATING,
)
from pgc_daemon.api.routes_models import model_or_404
from pgc_daemon.api.schemas import (
    MAX_ID,
    ErrorBody,
    FrontPublic,
    OptimizeRequest,
    SearchPublic,
    TrialPublic,
)
from pgc_daemon.services.queries import front_summary, search_summary, trials

router = APIRouter(prefix="/api/models", tags=["search"], responses=RESPONSES_503)


@router.get(
    "/{name}/trials",
    response_model=list[TrialPublic],
    responses=RESPONSES_404,
    summary="Every trial of every search of this model, oldest first",
)
def list_trials(
    name: str, store: StoreDep, run_id: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None
) -> list[dict[str, Any]]:
    with store.session() as s:
        return trials(s, model_or_404(s, name), run_id=run_id)


@router.get(
    "/{name}/front",
    response_model=FrontPublic,
    responses=RESPONSES_404,
    summary="Every timed trial, with the Pareto front and the deployed point marked",
)
def get_front(name: str, store: StoreDep) -> dict[str, Any]:
    with store.session() as s:
        return front_summary(s, model_or_404(s, name))


@router.get(
    "/{name}/searches",
    response_model=list[SearchPublic],
    responses=RESPONSES_404,
    summary="Search runs, newest first, with their progress (trials done and budgeted, best so far)",
)
def list_searches(name: str, store: StoreDep) -> list[dict[str, Any]]:
    with store.session() as s:
        model = model_or_404(s, name)
        deps = st.repo.list_deployments(s, model.id)
        return [search_summary(r, deps) for r in st.repo.list_search_runs(s, model.id)]


@router.post(
    "/{name}/optimize",
    response_model=SearchPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        **RESPONSES_404,
        **RESPONSES_MUTATING,
        **RESPONSES_409,
        **RESPONSES_429,
        503: {"model": ErrorBody, "description": "this server runs no optimizer loop, or no store"},
    },
    dependencies=[TokenDep],
    summary="Start a search now (progress: GET /searches or the model's `search`)",
    description="The body is JSON (`{}` for the policy's trial budget). At most one search "
    "starts through the API per model per `PGC_MIN_SEARCH_INTERVAL_S` (429 with `Retry-After`).",
)
def optimize(
    name: str, body: OptimizeRequest, store: StoreDep, daemon: DaemonDep, limit: SearchLimitDep
) -> dict[str, Any]:
    if daemon is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "this server runs no optimizer loop")
    with store.session() as s:
        model = model_or_404(s, name)
    limit.take(name)
    try:
        run_id = daemon.start_search(model.id, "requested through the API", trials=body.trials)
    except BaseException:
        limit.give_back(name)
        raise
    with store.session() as s:
        return search_summary(st.repo.get_search_run(s, run_id))  # type: ignore[return-value]
