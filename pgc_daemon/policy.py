"""What a user asks of pgc for one model, validated once at the edge (API, CLI, attach)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pgc_daemon.errors import PolicyError


class Policy(BaseModel):
    """Targets and budgets. ``max_accuracy_drop`` is ``1 - fidelity`` against fp32 on live
    inputs (0.01 = mean cosine 0.99 for embeddings, 99% top-1 agreement for logits)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_accuracy_drop: float = Field(0.01, ge=0.0, le=1.0)
    latency_target_ms: float | None = Field(None, gt=0.0, le=3_600_000.0)
    latency_percentile: Literal["p50", "p95", "p99"] = "p50"
    objective: Literal["fastest", "most_accurate"] = "fastest"
    max_trials: int = Field(12, ge=1, le=1000)
    time_budget_s: float = Field(900.0, gt=0.0, le=7 * 24 * 3600.0)
    min_speedup: float = Field(1.05, ge=1.0, le=100.0)
    auto_deploy: bool = True
    canary_s: float = Field(20.0, ge=0.0, le=24 * 3600.0)
    canary_latency_tolerance: float = Field(0.15, ge=0.0, le=10.0)
    canary_shadow_samples: int = Field(16, ge=0, le=1000)

    @model_validator(mode="after")
    def _objective_needs_target(self) -> Policy:
        if self.objective == "most_accurate" and self.latency_target_ms is None:
            raise ValueError("objective 'most_accurate' needs latency_target_ms")
        return self

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Policy:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "policy"
            raise PolicyError(f"invalid policy: {where}: {first['msg']}") from None

    @property
    def min_fidelity(self) -> float:
        return 1.0 - self.max_accuracy_drop
