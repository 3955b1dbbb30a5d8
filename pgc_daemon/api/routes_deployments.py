"""Deployments: history, deploying a variant, rolling back."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, status

import store as st
from compiler import Recipe
from pgc_daemon.api.deps import StoreDep, TokenDep
from pgc_daemon.api.errors import RESPONSES_404, RESPONSES_409, RESPONSES_503, RESPONSES_MUTATING
from pgc_daemon.api.routes_models import model_or_404
from pgc_daemon.api.schemas import DeploymentPublic, DeployRequest, RollbackRequest
from pgc_daemon.status import baseline_variant

router = APIRouter(prefix="/api/models", tags=["deployments"], responses=RESPONSES_503)


def deployment_public(d: st.Deployment, variants: dict[int, st.Variant]) -> dict[str, Any]:
    v = variants.get(d.variant_id) if d.variant_id else None
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
        return [deployment_public(d, variants) for d in st.repo.list_deployments(s, model.id)]


def _busy(s: Any, model_id: int) -> st.Deployment | None:
    for d in st.repo.list_deployments(s, model_id, limit=20):
        if d.state == "candidate" or d.state in st.repo.IN_FLIGHT:
            return d
    return None


def _create(s: Any, model: st.Model, variant_id: int, source: str, reason: str) -> dict[str, Any]:
    st.repo.lock_model(s, model.id)
    busy = _busy(s, model.id)
    if busy is not None:
        raise HTTPException(status.HTTP_409_CONFLICT, f"deployment {busy.id} is still {busy.state}")
    dep = st.repo.create_deployment(s, model.id, variant_id, source=source, reason=reason)
    variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
    return deployment_public(st.repo.get_deployment(s, dep.id), variants)


@router.post(
    "/{name}/deployments",
    response_model=DeploymentPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses={**RESPONSES_404, **RESPONSES_MUTATING, **RESPONSES_409},
    dependencies=[TokenDep],
    summary="Deploy a variant (by id or recipe); the agent builds, verifies and canaries it",
)
def deploy(name: str, body: DeployRequest, store: StoreDep) -> dict[str, Any]:
    with store.session() as s:
        model = model_or_404(s, name)
        if body.recipe is not None:
            recipe = Recipe.from_dict(body.recipe.model_dump())  # RecipeError -> 422
            variant = st.repo.get_or_create_variant(
                s, model.id, recipe.hash, recipe.to_dict(), recipe.label()
            )
        else:
            variant = st.repo.get_variant(s, body.variant_id)  # type: ignore[arg-type]
            if variant.model_id != model.id:
                raise st.NotFound(f"no variant {body.variant_id} for model {name!r}")
        return _create(s, model, variant.id, "manual", body.reason)


@router.post(
    "/{name}/rollback",
    response_model=DeploymentPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses={**RESPONSES_404, **RESPONSES_MUTATING, **RESPONSES_409},
    dependencies=[TokenDep],
    summary="Return to what served before the active variant (or to the fp32 base)",
)
def rollback(name: str, store: StoreDep, body: RollbackRequest | None = None) -> dict[str, Any]:
    reason = body.reason if body else RollbackRequest().reason
    with store.session() as s:
        model = model_or_404(s, name)
        active = st.repo.active_deployment(s, model.id)
        base = baseline_variant(s, model.id)
        if active is None or base is None or active.variant_id == base.id:
            raise HTTPException(status.HTTP_409_CONFLICT, "the fp32 base already serves; nothing to roll back")
        target = active.previous_variant_id or base.id
        return _create(s, model, target, "rollback", reason)
