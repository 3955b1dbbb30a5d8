"""Search: trials, the front, starting a search."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

from pgc_daemon.api.schemas._common import STRICT, _integral


class TrialPublic(BaseModel):
    id: int
    run_id: int
    number: int
    state: str
    variant_id: int | None
    label: str | None
    recipe: dict[str, Any] | None
    latency_ms: float | None
    baseline_ms: float | None
    speedup: float | None
    fidelity: float | None
    accuracy_drop: float | None
    feasible: bool
    params: dict[str, Any]
    message: str | None
    duration_s: float
    created_at: float


class FrontPoint(TrialPublic):
    pareto: bool
    deployed: bool


class FrontPublic(BaseModel):
    model: str
    metric: str | None
    max_accuracy_drop: float
    latency_target_ms: float | None
    latency_percentile: str
    min_speedup: float
    points: list[FrontPoint]
    chosen_variant_id: int | None
    feasible: int
    message: str | None


class OptimizeRequest(BaseModel):
    model_config = STRICT
    # constraints before the validator, or pydantic writes them as "ge"/"le" in the schema
    trials: Annotated[int, Field(ge=1, le=1000), BeforeValidator(_integral)] | None = Field(
        None, description="trial budget (default: the policy's max_trials)"
    )
