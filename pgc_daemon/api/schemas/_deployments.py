"""Deployments: their history, and deploying, rolling back and cancelling."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pgc_daemon.api.schemas._common import MAX_ID, STRICT, IntegralInt, Text
from pgc_daemon.api.schemas._recipe import RecipeBody


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
    while_searching: bool = Field(
        description="a search proposed it while it was still searching (a trial good enough "
        "to deploy before the search ended); false for a search's final choice and for every "
        "other source"
    )
    search_run_id: int | None = Field(
        description="the search run that proposed it while searching (null otherwise)"
    )


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
    model_config = STRICT
    reason: Text = "rolled back through the API"


class CancelRequest(BaseModel):
    model_config = STRICT
    reason: Text = "cancelled through the API"
