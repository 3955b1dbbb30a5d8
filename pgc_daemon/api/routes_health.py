"""Liveness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import store as st
from pgc_daemon.api.deps import DaemonDep, StoreDep
from pgc_daemon.api.errors import RESPONSES_503
from pgc_daemon.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    response_model=Health,
    responses=RESPONSES_503,
    summary="Store and optimizer loop status",
    description="503 with a one-line `detail` when the store does not take a write within a "
    "second, or when its SQLite file was deleted or replaced while this server had it open.",
)
def healthz(store: StoreDep, daemon: DaemonDep) -> dict[str, Any]:
    problem = store.health()
    if problem is not None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, problem)
    with store.session() as s:
        n = len(st.repo.list_models(s))
    info: dict[str, Any] = {"running": daemon is not None}
    if daemon is not None:
        info.update(ticks=daemon.ticks, workers=len(daemon.workers), last_error=daemon.last_error)
    return {"status": "ok", "store": store.safe_url, "models": n, "daemon": info}


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE_LATEST


@router.get(
    "/metrics",
    response_class=PrometheusResponse,
    summary="Prometheus text format, read from the store at scrape time",
    responses={200: {"description": "Prometheus text exposition format 0.0.4"}},
)
def metrics(request: Request) -> PrometheusResponse:
    return PrometheusResponse(generate_latest(request.app.state.registry))
