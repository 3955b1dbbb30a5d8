"""Read models of a model: its summary, live latency, profile, events and timeline."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pgc_daemon.policy import Policy


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
    while_searching: bool = Field(
        description="a search deployed it while it was still searching, not as its final choice"
    )


class SearchPublic(BaseModel):
    """One search run and its progress: ``trials_done`` of ``trials_budget``, and the best
    speedup and fidelity among its feasible trials so far."""

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
    study_name: str = Field(description="the Optuna study (open it with optuna-dashboard)")
    deployed_while_searching: list[int] = Field(
        description="deployments this run proposed while it was still searching (each trial "
        "good enough goes out at once; the final choice follows the end of the run)"
    )


class ReplicaCounts(BaseModel):
    live: int = Field(description="serving processes heard from in the last minute")
    on_active: int = Field(description="of them, serving the active deployment's variant")
    compiles: int = Field(description="variants the live replicas compiled themselves (0: all loaded)")


class ReplicaPublic(BaseModel):
    """One serving process of the model (a worker of a multi-process server, a host)."""

    name: str = Field(description="host:pid:random")
    host: str
    pid: int
    alive: bool
    state: str = Field(description="starting, serving, loading, deploying or stopped")
    serving: str | None = Field(description="label of the variant it serves")
    variant_id: int | None
    deployment_id: int | None
    calls: int
    live_ms: float | None = Field(description="trimmed mean of its recent live latency")
    compiles: int
    loads: int = Field(description="artifacts it loaded (variants built by a search worker)")
    message: str | None
    started_at: float
    seen_at: float


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
    replicas: ReplicaCounts


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
    suggestion: str | None = Field(
        description="what the share suggests (pgc_daemon.services.suggest: at or above 15% "
        "a quantization or fusion candidate; an int8-capable op at or above 2% an int8 candidate)"
    )


class ActiveProfile(BaseModel):
    variant_id: int
    label: str | None
    layers: list[LayerPublic] = Field(
        description="a compiled variant's kernels, timed on sampled calls and split over the "
        "layers each was generated from; `op_type` names the kernel and the layers it fuses "
        "with; `(between kernels)` is the wrapper's time")
    layer_sum_ms: float = Field(description="the rows' mean times added up: one call")
    live_ms: float | None = Field(
        description="the variant's live end-to-end mean latency over the windows its rows were "
        "sampled in (what the rows' sum is to match)")
    live_ms_all: float | None = Field(
        None, description="the same over every window since `since`")
    sampled_calls: int = Field(0, description="calls sampled in those windows")


class ProfilePublic(BaseModel):
    model: str
    variant_id: int | None
    layers: list[LayerPublic]
    shapes: dict[str, int]
    requests: Summary | None
    active: ActiveProfile | None = Field(
        None, description="the serving variant's per-layer rows when it is not the one shown")


class EventPublic(BaseModel):
    id: int
    at: float
    level: str
    kind: str
    message: str


class TimelinePoint(BaseModel):
    t: float = Field(description="end of the last window in this step (UTC seconds)")
    count: int
    errors: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float


class TimelineSeries(BaseModel):
    variant_id: int | None
    label: str
    is_baseline: bool
    points: list[TimelinePoint]


class TimelineMarker(BaseModel):
    at: float
    kind: Literal["deployed", "rollback", "rolled_back", "failed"] = Field(
        description="deployed: a variant became active; rollback: a rollback became active; "
        "rolled_back: a canary or active variant was reverted; failed: a deployment failed"
    )
    deployment_id: int
    variant_id: int | None
    label: str | None
    source: str
    reason: str | None
    while_searching: bool = Field(description="a search deployed it while still searching")


class Interval(BaseModel):
    start: float
    end: float


class TimelinePublic(BaseModel):
    model: str
    since: float
    until: float
    step_s: float = Field(description="windows are merged into steps this long")
    latency_target_ms: float | None
    latency_percentile: str
    series: list[TimelineSeries]
    markers: list[TimelineMarker]
    busy: list[Interval] = Field(description="when pgc searched or built (left out of summaries)")
