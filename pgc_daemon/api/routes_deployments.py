"""Deployments: history, deploying a variant, rolling back, cancelling."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, status
from sqlalchemy.orm import Session

import store as st
from pgc_daemon.api.deps import StoreDep, TokenDep
from pgc_daemon.api.errors import RESPONSES_404, RESPONSES_409, RESPONSES_503, RESPONSES_MUTATING
from pgc_daemon.api.routes_models import model_or_404
from pgc_daemon.api.schemas import (
    MAX_ID,
    CancelRequest,
    DeploymentPublic,
    DeployRequest,
    RollbackRequest,
)
from pgc_daemon.services.deployments import request_cancel, request_deploy, request_rollback
from pgc_daemon.services.queries import RECENT, while_searching

router = APIRouter(prefix="/api/models", tags=["deployments"], responses=RESPONSES_503)

DeploymentId = Annotated[int, Path(ge=1, le=MAX_ID, description="a deployment of this model")]


def deployment_public(
    d: st.Deployment, variants: dict[int, st.Variant], searching: dict[int, int] | None = None
) -> dict[str, Any]:
    """``searching``: deployment id -> the run that proposed it while still searching
    (:func:`~pgc_daemon.services.queries.while_searching`)."""
    v = variants.get(d.variant_id) if d.variant_id else None
    run_id = (searching or {}).get(d.id)
    return {
        "id": d.id,
        "variant_id": d.variant_id,
        "label": v.label if v else None,
        "previous_variant_id": d.previous_variant_id,
        "state": d.state,
        "source": d.source,
        "reason": d.reason,
        "expected_speedup": d.expected_speedup,
        "expected_fidelity": d.expected_fidelity,
        "live_speedup": d.live_speedup,
        "live_fidelity": d.live_fidelity,
        "swap_ms": d.swap_ms,
        "build_s": d.build_s,
        "warm_s": d.warm_s,
        "created_at": d.created_at,
        "updated_at": d.updated_at,
        "transitions": [
            {"from_state": t.from_state, "to_state": t.to_state, "reason": t.reason, "at": t.at}
            for t in d.transitions
        ],
        "while_searching": run_id is not None,
        "search_run_id": run_id,
    }


@router.get(
    "/{name}/deployments",
    response_model=list[DeploymentPublic],
    responses=RESPONSES_404,
    summary="Deployment history, newest first, with every transition and its reason",
)
def list_deployments(name: str, store: StoreDep) -> list[dict[str, Any]]:
    with store.session() as s:
        model = model_or_404(s, name)
        variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
        deps = st.repo.list_deployments(s, model.id)
        searching = while_searching(deps, st.repo.list_search_runs(s, model.id, limit=1000))
        return [deployment_public(d, variants, searching) for d in deps]


def _public(s: Session, dep: st.Deployment) -> dict[str, Any]:
    variants = {v.id: v for v in st.repo.list_variants(s, dep.model_id)}
    runs = st.repo.list_search_runs(s, dep.model_id, limit=RECENT)
    return deployment_public(dep, variants, while_searching([dep], runs))


@router.post(
    "/{name}/deployments",
    response_model=DeploymentPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses={**RESPONSES_404, **RESPONSES_MUTATING, **RESPONSES_409},
    dependencies=[TokenDep],
    summary="Deploy a variant (by id or recipe); the agent builds, verifies and canaries it",
)
def deploy(name: str, body: DeployRequest, store: StoreDep) -> dict[str, Any]:
    # RecipeError -> 422, NotFound -> 404, Conflict -> 409 (errors.py)
    recipe = body.recipe.to_recipe() if body.recipe is not None else None
    with store.session() as s:
        model_or_404(s, name)
        dep = request_deploy(s, name, variant_id=body.variant_id, recipe=recipe, reason=body.reason)
        return _public(s, dep)


@router.post(
    "/{name}/rollback",
    response_model=DeploymentPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses={**RESPONSES_404, **RESPONSES_MUTATING, **RESPONSES_409},
    dependencies=[TokenDep],
    summary="Return to what served before the active variant (or to the fp32 base)",
    description="The body is JSON: `{}`, or `{\"reason\": ...}`.",
)
def rollback(name: str, body: RollbackRequest, store: StoreDep) -> dict[str, Any]:
    reason = body.reason
    with store.session() as s:
        model_or_404(s, name)
        return _public(s, request_rollback(s, name, reason=reason))


@router.post(
    "/{name}/deployments/{deployment_id}/cancel",
    response_model=DeploymentPublic,
    responses={**RESPONSES_404, **RESPONSES_MUTATING, **RESPONSES_409},
    dependencies=[TokenDep],
    summary="Cancel an open deployment (a candidate, or one the agent is still working on)",
    description="The body is JSON: `{}`, or `{\"reason\": ...}`. 409 when the deployment has "
    "already finished (or finished meanwhile). An agent building it notices at its next step "
    "and drops the build.",
)
def cancel(
    name: str, deployment_id: DeploymentId, body: CancelRequest, store: StoreDep
) -> dict[str, Any]:
    reason = body.reason
    with store.session() as s:
        model_or_404(s, name)
        return _public(s, request_cancel(s, name, deployment_id, reason))
