"""Search: trials, the latency-accuracy front, starting a search."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status

import store as st
from pgc_daemon.api.deps import DaemonDep, StoreDep, TokenDep
from pgc_daemon.api.errors import RESPONSES_404, RESPONSES_409, RESPONSES_503, RESPONSES_MUTATING
from pgc_daemon.api.routes_models import model_or_404
from pgc_daemon.api.schemas import (
    MAX_ID,
    ErrorBody,
    FrontPublic,
    OptimizeRequest,
    SearchPublic,
    TrialPublic,
)
from pgc_daemon.policy import Policy
from pgc_daemon.services.queries import search_summary

router = APIRouter(prefix="/api/models", tags=["search"], responses=RESPONSES_503)


def trial_public(t: st.Trial, variants: dict[int, st.Variant]) -> dict[str, Any]:
    v = variants.get(t.variant_id) if t.variant_id else None
    return {
        "id": t.id,
        "run_id": t.run_id,
        "number": t.number,
        "state": t.state,
        "variant_id": t.variant_id,
        "label": v.label if v else None,
        "recipe": v.recipe if v else None,
        "latency_ms": t.latency_ms,
        "baseline_ms": t.baseline_ms,
        "speedup": t.speedup,
        "fidelity": t.fidelity,
        "accuracy_drop": t.accuracy_drop,
        "feasible": t.feasible,
        "params": t.params,
        "message": t.message,
        "duration_s": t.duration_s,
        "created_at": t.created_at,
    }


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
        model = model_or_404(s, name)
        variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
        return [trial_public(t, variants) for t in st.repo.list_trials(s, model.id, run_id=run_id)]


@router.get(
    "/{name}/front",
    response_model=FrontPublic,
    responses=RESPONSES_404,
    summary="Every timed trial, with the Pareto front and the deployed point marked",
)
def get_front(name: str, store: StoreDep) -> dict[str, Any]:
    with store.session() as s:
        model = model_or_404(s, name)
        row = st.repo.get_policy(s, model.id)
        policy = Policy.parse(row.settings if row else {})
        variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
        active = st.repo.active_deployment(s, model.id)
        runs = st.repo.list_search_runs(s, model.id, limit=1)
        # one point per variant: its latest timed trial
        latest: dict[int, st.Trial] = {}
        for t in st.repo.list_trials(s, model.id):
            if t.state == "complete" and t.variant_id is not None:
                latest[t.variant_id] = t
        points = [trial_public(t, variants) for t in latest.values()]
        for p in points:
            p["pareto"] = not any(
                o is not p
                and o["speedup"] >= p["speedup"]
                and o["accuracy_drop"] <= p["accuracy_drop"]
                and (o["speedup"] > p["speedup"] or o["accuracy_drop"] < p["accuracy_drop"])
                for o in points
            )
            p["deployed"] = active is not None and active.variant_id == p["variant_id"]
        points.sort(key=lambda p: -(p["speedup"] or 0))
        return {
            "model": model.name,
            "metric": model.metric,
            "max_accuracy_drop": policy.max_accuracy_drop,
            "latency_target_ms": policy.latency_target_ms,
            "latency_percentile": policy.latency_percentile,
            "min_speedup": policy.min_speedup,
            "points": points,
            "chosen_variant_id": runs[0].chosen_variant_id if runs else None,
            "feasible": sum(p["feasible"] for p in points),
            "message": runs[0].message if runs else None,
        }


@router.get(
    "/{name}/searches",
    response_model=list[SearchPublic],
    responses=RESPONSES_404,
    summary="Search runs, newest first, with their progress (trials done and budgeted, best so far)",
)
def list_searches(name: str, store: StoreDep) -> list[dict[str, Any]]:
    with store.session() as s:
        model = model_or_404(s, name)
        return [search_summary(r) for r in st.repo.list_search_runs(s, model.id)]


@router.post(
    "/{name}/optimize",
    response_model=SearchPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        **RESPONSES_404,
        **RESPONSES_MUTATING,
        **RESPONSES_409,
        503: {"model": ErrorBody, "description": "this server runs no optimizer loop, or no store"},
    },
    dependencies=[TokenDep],
    summary="Start a search now (progress: GET /searches or the model's `search`)",
)
def optimize(
    name: str, store: StoreDep, daemon: DaemonDep, body: OptimizeRequest | None = None
) -> dict[str, Any]:
    if daemon is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "this server runs no optimizer loop")
    with store.session() as s:
        model = model_or_404(s, name)
    run_id = daemon.start_search(model.id, "requested through the API", trials=body.trials if body else None)
    with store.session() as s:
        return search_summary(st.repo.get_search_run(s, run_id))  # type: ignore[return-value]
