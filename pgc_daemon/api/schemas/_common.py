"""What every body shares: strict integers, ids, text, error bodies, health and the policy.

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

from pgc_daemon.policy import BackendName, Policy


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

Text = Annotated[str, StringConstraints(max_length=500, pattern=r"^[^\x00]*$")]

STRICT = ConfigDict(extra="forbid", strict=True)
"""The config of every request body."""

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


MAX_ACCURACY_DROP = 0.2
"""The largest accuracy budget the API takes (``PUT /policy``): past it, "fidelity against
fp32" stops meaning the same model, and a policy at 1.0 would let nearly any variant deploy."""
MIN_CANARY_S = 0.5
"""The shortest canary the API takes unless the body says ``allow_no_canary: true``: the
canary is what catches a variant that verified on stored inputs but fails on live ones."""


def _policy_update_schema(schema: dict[str, Any]) -> None:
    # Policy's own validator and the API's canary rule, said in JSON Schema so that
    # generated bodies respect them.
    accurate: dict[str, Any] = {}
    _most_accurate_needs_a_target(accurate)
    schema["allOf"] = [
        accurate,
        {
            "anyOf": [
                {"properties": {"canary_s": {"type": "number", "minimum": MIN_CANARY_S}}},
                {"required": ["allow_no_canary"], "properties": {"allow_no_canary": {"const": True}}},
            ]
        },
    ]


class _PolicyUpdateBase(Policy):
    """A whole policy; fields left out take their defaults. ``objective: most_accurate``
    needs ``latency_target_ms``. Bounds of the API beyond the policy's own:
    ``max_accuracy_drop`` at most 0.2, and ``canary_s`` at least 0.5 s unless
    ``allow_no_canary`` is true (the flag is not stored: send it with each such update)."""

    model_config = ConfigDict(strict=True, json_schema_extra=_policy_update_schema)

    allow_no_canary: bool = Field(
        False, description=f"allow canary_s below {MIN_CANARY_S} s (0: no canary at all)"
    )

    @model_validator(mode="after")
    def _canary_needs_consent(self) -> _PolicyUpdateBase:
        if self.canary_s < MIN_CANARY_S and not self.allow_no_canary:
            raise ValueError(
                f"canary_s below {MIN_CANARY_S} s skips the live canary: send allow_no_canary: "
                "true to mean it"
            )
        return self

    def to_policy(self) -> Policy:
        """The policy to store (without the API-only ``allow_no_canary``)."""
        return Policy(**self.model_dump(exclude={"allow_no_canary"}))


#: :class:`Policy` in a strict body: its integer fields take any integral JSON number.
PolicyUpdate = create_model(  # type: ignore[call-overload]
    "PolicyUpdate",
    __base__=_PolicyUpdateBase,
    __doc__=_PolicyUpdateBase.__doc__,
    max_accuracy_drop=(
        float,
        Field(0.01, ge=0.0, le=MAX_ACCURACY_DROP, description="1 - fidelity against fp32, at most 0.2"),
    ),
    # a JSON array (strict mode takes no list for a tuple)
    backends=(list[BackendName] | None, Field(
        None, min_length=1, json_schema_extra={"uniqueItems": True},
        description=Policy.model_fields["backends"].description)),
    **{
        name: (IntegralInt, field)
        for name, field in Policy.model_fields.items()
        if field.annotation is int
    },
)
