"""Request and response bodies of the REST API (``*Public`` out, ``*Update``/``*Request`` in).

Request bodies are strict (no string-to-number or string-to-bool coercion, unknown fields
refused) and their JSON schemas say everything the server checks, so that any body the
OpenAPI document calls valid is accepted and any other is refused with 422: the schemathesis
test holds the API to exactly that.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
    model_validator,
)

from pgc_daemon.policy import Policy

# --------------------------------------------------------------------------- strict input


def _integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer; strict pydantic would not.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


IntegralInt = Annotated[int, BeforeValidator(_integral)]
"""An integer in a strict body: a JSON number with no fraction, never a string or a bool."""

MAX_ID = 2**53
"""Ids past this name no row: stores count from 1, and a larger number would overflow SQLite's
64-bit integers or lose precision as a JSON number (2**53 is exact in every JSON parser)."""

# --------------------------------------------------------------------------- errors


class ErrorBody(BaseModel):
    detail: str = Field(description="what went wrong, in one line")


class ValidationErrorBody(BaseModel):
    detail: str = Field(description="the first problem, in one line")
    errors: list[dict[str, Any]] = Field(description="every problem, as FastAPI reports them")


# --------------------------------------------------------------------------- health


class DaemonInfo(BaseModel):
    running: bool = Field(description="whether this server runs the optimizer loop")
    ticks: int | None = None
    workers: int | None = Field(None, description="search worker processes alive")
    last_error: str | None = None


class Health(BaseModel):
    status: Literal["ok"]
    store: str = Field(description="the store URL, without its password")
    models: int
    daemon: DaemonInfo


# --------------------------------------------------------------------------- policy


def _most_accurate_needs_a_target(schema: dict[str, Any]) -> None:
    # Policy's own validator, said in JSON Schema so that generated bodies respect it.
    schema["anyOf"] = [
        {"properties": {"objective": {"const": "fastest"}}},
        {
            "required": ["objective", "latency_target_ms"],
            "properties": {"latency_target_ms": {"type": "number"}},
        },
    ]


class PolicyPublic(Policy):
    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = Field(description="goes up by one each time the settings change")
    updated_at: float


class _PolicyUpdateBase(Policy):
    """A whole policy; fields left out take their defaults. ``objective: most_accurate``
    needs ``latency_target_ms``."""

    model_config = ConfigDict(strict=True, json_schema_extra=_most_accurate_needs_a_target)


#: :class:`Policy` in a strict body: its integer fields take any integral JSON number.
PolicyUpdate = create_model(  # type: ignore[call-overload]
    "PolicyUpdate",
    __base__=_PolicyUpdateBase,
    __doc__=_PolicyUpdateBase.__doc__,
    **{
        name: (IntegralInt, field)
        for name, field in Policy.model_fields.items()
        if field.annotation is int
    },
)


# --------------------------------------------------------------------------- recipes

#: A layer key: ``_default``, a module's qualified name, or ``re:`` and a pattern made of
#: names, ``\.``, ``.``, ``.*``, ``.+``, ``\d`` and ``\d+`` (always a valid regex).
LAYER_KEY_PATTERN = r"^(?:[A-Za-z0-9_][A-Za-z0-9_.\-]*|re:(?:[A-Za-z0-9_\-]|\\\.|\.\*|\.\+|\.|\\d\+|\\d)+)$"
LayerKey = Annotated[str, StringConstraints(pattern=LAYER_KEY_PATTERN, max_length=300)]


class FloatChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    precision: Literal["fp32", "bf16", "fp16"]
    granularity: Literal["per_tensor", "per_channel"] = "per_channel"


class Int8Choice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    precision: Literal["int8"]
    scheme: Literal["dynamic", "static", "weight_only"]
    granularity: Literal["per_tensor", "per_channel"] = "per_channel"


LayerChoice = Annotated[FloatChoice | Int8Choice, Field(discriminator="precision")]


def _keys_by_pattern(schema: dict[str, Any]) -> None:
    # pydantic writes a key pattern as ``patternProperties``, which lets other keys through;
    # the server refuses them, so the schema must too.
    pattern_props = schema.pop("patternProperties", {})
    if pattern_props:
        schema["additionalProperties"] = next(iter(pattern_props.values()))
    schema["propertyNames"] = {"pattern": LAYER_KEY_PATTERN, "maxLength": 300}


class EagerBackend(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["eager"] = "eager"
    mode: Literal["default"] = "default"


class InductorBackend(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["inductor"]
    mode: Literal["default", "max-autotune"] = "default"


class OnnxRuntimeBackend(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["onnxruntime"]
    mode: Literal["default"] = "default"


class FusionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    conv_bn: bool = False
    conv_bn_relu: bool = Field(False, description="implies conv_bn (the BatchNorm is folded first)")
    linear_act: bool = False

    @model_validator(mode="after")
    def _relu_needs_bn(self) -> FusionBody:
        if self.conv_bn_relu:
            self.conv_bn = True
        return self


class LayoutBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    memory_format: Literal["contiguous", "channels_last"] = "contiguous"


class KernelsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    linear: Literal["default", "triton"] = "default"


class BucketsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    sizes: list[Annotated[int, Field(ge=1, le=1_000_000), BeforeValidator(_integral)]] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"uniqueItems": True},
        description="distinct bucket lengths (taken in increasing order)",
    )
    dim: Annotated[int, Field(ge=0, le=16), BeforeValidator(_integral)] = 1
    pad_value: Annotated[int, Field(ge=-(2**31), le=2**31 - 1), BeforeValidator(_integral)] = 0

    @model_validator(mode="after")
    def _sorted(self) -> BucketsBody:
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError("bucket sizes must be distinct")
        self.sizes = sorted(self.sizes)
        return self


class PartitionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    strategy: Literal["latency", "memory"] = "latency"


class RecipeBody(BaseModel):
    """A recipe as ``compiler.Recipe.to_dict`` writes it: per-layer choices by key (in
    increasing priority: ``_default``, ``re:`` patterns in order, exact names), a backend, and
    the optional graph parts (fusion, layout, kernels, shape buckets, partition)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    version: Literal[1] = 1
    quantization: dict[LayerKey, LayerChoice] = Field(
        default_factory=dict, max_length=200, json_schema_extra=_keys_by_pattern
    )
    backend: EagerBackend | InductorBackend | OnnxRuntimeBackend = Field(
        default_factory=EagerBackend
    )
    fusion: FusionBody | None = None
    layout: LayoutBody | None = None
    kernels: KernelsBody | None = None
    buckets: BucketsBody | None = None
    partition: PartitionBody | None = None


# --------------------------------------------------------------------------- models

Text = Annotated[str, StringConstraints(max_length=500, pattern=r"^[^\x00]*$")]


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


# --------------------------------------------------------------------------- search


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
    model_config = ConfigDict(extra="forbid", strict=True)
    # constraints before the validator, or pydantic writes them as "ge"/"le" in the schema
    trials: Annotated[int, Field(ge=1, le=1000), BeforeValidator(_integral)] | None = Field(
        None, description="trial budget (default: the policy's max_trials)"
    )


# --------------------------------------------------------------------------- deployments


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
    build_s: float | None = Field(description="seconds to build (compile) the variant")
    warm_s: float | None = Field(description="seconds of warm-up before verification")
    created_at: float
    updated_at: float
    transitions: list[TransitionPublic]


def _exactly_one_target(schema: dict[str, Any]) -> None:
    schema["oneOf"] = [{"required": ["variant_id"]}, {"required": ["recipe"]}]


class DeployRequest(BaseModel):
    """Exactly one of ``variant_id`` and ``recipe``."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_exactly_one_target)
    # Not Optional: an explicit null is refused, as the schema says.
    variant_id: IntegralInt = Field(None, ge=1, le=MAX_ID, description="a variant the store knows")  # type: ignore[assignment]
    recipe: RecipeBody = Field(None, description="or a recipe")  # type: ignore[assignment]
    reason: Text = "deployed through the API"

    @model_validator(mode="after")
    def _exactly_one(self) -> DeployRequest:
        if (self.variant_id is None) == (self.recipe is None):
            raise ValueError("give exactly one of variant_id and recipe")
        return self


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    reason: Text = "rolled back through the API"


# --------------------------------------------------------------------------- events, timeline


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
