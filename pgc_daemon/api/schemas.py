"""Request and response bodies of the REST API (``*Public`` out, ``*Update``/``*Request`` in)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pgc_daemon.policy import Policy


class ErrorBody(BaseModel):
    detail: str = Field(description="what went wrong, in one line")


class ValidationErrorBody(BaseModel):
    detail: str = Field(description="the first problem, in one line")
    errors: list[dict[str, Any]] = Field(description="every problem, as FastAPI reports them")


class Health(BaseModel):
    status: Literal["ok"]
    store: str
    models: int
    daemon: dict[str, Any]


class PolicyPublic(Policy):
    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int
    updated_at: float


class PolicyUpdate(Policy):
    """A whole policy; fields left out take their defaults."""


class Summary(BaseModel):
    count: int
    windows: int
    errors: int
    fallbacks: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    sampled: int
    dropped: int
    overhead: float


class LatencyPublic(BaseModel):
    baseline: Summary | None
    current: Summary | None
    speedup: float | None = Field(description="baseline p50 / current p50 on live traffic")
    quiet: bool = Field(description="whether windows in which pgc searched or built were left out")


class ActivePublic(BaseModel):
    deployment_id: int
    variant_id: int
    label: str
    recipe: dict[str, Any]
    recipe_hash: str
    source: str
    since: float
    expected_speedup: float | None
    expected_fidelity: float | None
    live_speedup: float | None
    live_fidelity: float | None
    is_baseline: bool


class SearchPublic(BaseModel):
    run_id: int
    state: str
    trigger: str
    trials_done: int
    trials_budget: int
    best_speedup: float | None
    best_fidelity: float | None
    message: str | None
    started_at: float
    finished_at: float | None
    study_name: str


class ModelPublic(BaseModel):
    name: str
    spec: str | None
    metric: str | None
    hardware: str | None
    graph_hash: str | None
    created_at: float
    last_seen_at: float
    online: bool
    policy: Policy | None
    policy_version: int | None
    active: ActivePublic | None
    latency: LatencyPublic
    search: SearchPublic | None


class LayerPublic(BaseModel):
    layer: str
    op_type: str
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    total_ms: float
    share: float = Field(description="share of the summed per-layer time (latency_ratio)")
    counters: dict[str, float] | None
    suggestion: str | None


class ProfilePublic(BaseModel):
    model: str
    variant_id: int | None
    layers: list[LayerPublic]
    shapes: dict[str, int]
    requests: Summary | None


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
    points: list[FrontPoint]
    chosen_variant_id: int | None
    feasible: int
    message: str | None


class TransitionPublic(BaseModel):
    from_state: str | None
    to_state: str
    reason: str | None
    at: float


class DeploymentPublic(BaseModel):
    id: int
    variant_id: int | None
    label: str | None
    previous_variant_id: int | None
    state: str
    source: str
    reason: str | None
    expected_speedup: float | None
    expected_fidelity: float | None
    live_speedup: float | None
    live_fidelity: float | None
    swap_ms: float | None
    created_at: float
    updated_at: float
    transitions: list[TransitionPublic]


class DeployRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variant_id: int | None = Field(None, ge=1, description="a variant the store knows")
    recipe: dict[str, Any] | None = Field(None, description="or a recipe (JSON, as compiler writes it)")
    reason: str = Field("deployed through the API", max_length=500)


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field("rolled back through the API", max_length=500)


class OptimizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trials: int | None = Field(None, ge=1, le=1000, description="trial budget (default: policy)")


class EventPublic(BaseModel):
    id: int
    at: float
    level: str
    kind: str
    message: str
