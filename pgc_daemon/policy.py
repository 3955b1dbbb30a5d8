"""What a user asks of pgc for one model, validated once at the edge (API, CLI, attach), and
the snapshot of it that travels with the work.

The user sees one flat :class:`Policy` (what ``PUT /policy`` takes). Inside, it has three parts
that change different things:

- :class:`StudyTerms` — objective, constraints, metric percentile and the backends allowed:
  what *names* an Optuna study. Changing one of these starts a new study (earlier trials
  measured something else, or searched another space).
- :class:`Budget` — trials and time: how long a study may run. Raising it continues the same
  study (resumed, every finished trial kept).
- :class:`DeploySettings` — min speedup, auto-deploy and canary: what happens with a result.
  Changing them continues the same study too.

:func:`load_policy` is the one way to read a stored policy; it returns a :class:`PolicySnapshot`
(the policy and its version), which a search run stores and its worker uses, so the trials of
a run carry the version that run was started with, whatever the API changes meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sqlalchemy.orm import Session

import store as st
from pgc_daemon.errors import PolicyError

Objective = Literal["fastest", "most_accurate"]
Percentile = Literal["p50", "p95", "p99"]
#: what ``backends`` may name (``compiler.Backend`` labels); the search offers the installed ones
BackendName = Literal["inductor", "inductor-max", "inductor+bf16", "inductor-max+bf16", "eager",
                      "onnxruntime", "openvino", "openvino-f32"]


@dataclass(frozen=True)
class StudyTerms:
    """What names a study: two searches with equal terms measure the same thing."""

    objective: Objective
    max_accuracy_drop: float
    latency_target_ms: float | None
    latency_percentile: Percentile
    backends: tuple[str, ...] | None = None
    """the backends the search may choose (None: every installed one)"""


@dataclass(frozen=True)
class Budget:
    max_trials: int
    time_budget_s: float


@dataclass(frozen=True)
class DeploySettings:
    min_speedup: float
    auto_deploy: bool
    canary_s: float
    canary_latency_tolerance: float
    canary_search_tolerance: float
    canary_shadow_samples: int


class Policy(BaseModel):
    """Targets and budgets. ``max_accuracy_drop`` is ``1 - fidelity`` against fp32 on live
    inputs (0.01 = mean cosine 0.99 for embeddings, 99% top-1 agreement for logits)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_accuracy_drop: float = Field(0.01, ge=0.0, le=1.0)
    latency_target_ms: float | None = Field(None, gt=0.0, le=3_600_000.0)
    latency_percentile: Percentile = "p50"
    objective: Objective = "fastest"
    max_trials: int = Field(12, ge=1, le=1000)
    time_budget_s: float = Field(900.0, gt=0.0, le=7 * 24 * 3600.0)
    min_speedup: float = Field(1.05, ge=1.0, le=100.0)
    auto_deploy: bool = True
    canary_s: float = Field(20.0, ge=0.0, le=24 * 3600.0)
    canary_latency_tolerance: float = Field(0.15, ge=0.0, le=10.0)
    canary_search_tolerance: float = Field(0.0, ge=0.0, le=10.0)
    """How much slower live than what serves a deployment the search made under ``fastest``
    may be (it exists to be faster); other deployments get ``canary_latency_tolerance``."""
    canary_shadow_samples: int = Field(16, ge=0, le=1000)
    backends: tuple[BackendName, ...] | None = Field(
        None, min_length=1, json_schema_extra={"uniqueItems": True},
        description="the backends the search may choose, e.g. [\"inductor\"] for PyTorch only "
        "(null: every one installed on the worker's machine; one not installed there is not "
        "offered)",
    )

    @model_validator(mode="after")
    def _objective_needs_target(self) -> Policy:
        if self.objective == "most_accurate" and self.latency_target_ms is None:
            raise ValueError("objective 'most_accurate' needs latency_target_ms")
        if self.backends is not None and len(set(self.backends)) != len(self.backends):
            raise ValueError("backends are named twice")
        return self

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Policy:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "policy"
            raise PolicyError(f"invalid policy: {where}: {first['msg']}") from None

    # ------------------------------------------------------------------ parts

    @property
    def study(self) -> StudyTerms:
        return StudyTerms(
            self.objective, self.max_accuracy_drop, self.latency_target_ms, self.latency_percentile,
            tuple(sorted(self.backends)) if self.backends is not None else None,
        )

    @property
    def budget(self) -> Budget:
        return Budget(self.max_trials, self.time_budget_s)

    @property
    def deploy(self) -> DeploySettings:
        return DeploySettings(
            self.min_speedup,
            self.auto_deploy,
            self.canary_s,
            self.canary_latency_tolerance,
            self.canary_search_tolerance,
            self.canary_shadow_samples,
        )

    # ------------------------------------------------------------------ arithmetic

    @property
    def min_fidelity(self) -> float:
        return 1.0 - self.max_accuracy_drop

    @property
    def canary_floor(self) -> float:
        """Live shadow fidelity below which a canary fails: the verification bound less half
        the budget, since a few dozen live inputs are a noisier sample than the verification
        set."""
        return self.min_fidelity - 0.5 * self.max_accuracy_drop

    def violations(self, drop: float | None, latency_ms: float | None) -> dict[str, float]:
        """Constraint values of a measured point (feasible when every value is <= 0); the
        latency constraint only where there is a target and a measured latency."""
        out = {"accuracy_drop": (drop or 0.0) - self.max_accuracy_drop}
        if self.latency_target_ms is not None and latency_ms is not None:
            out["latency_ms"] = latency_ms - self.latency_target_ms
        return out

    def normalized_violation(self, drop: float | None, latency_ms: float | None) -> float:
        """How far a point is from feasible, in units of the policy's own bounds."""
        v = max((drop or 0.0) - self.max_accuracy_drop, 0.0) / max(self.max_accuracy_drop, 1e-3)
        if self.latency_target_ms is not None and latency_ms is not None:
            v += max(latency_ms - self.latency_target_ms, 0.0) / self.latency_target_ms
        return v


@dataclass(frozen=True)
class PolicySnapshot:
    """A policy as stored at one version. Version 0: none stored yet (the defaults, or what
    ``attach`` was given)."""

    policy: Policy
    version: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "settings": self.policy.model_dump()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PolicySnapshot:
        return cls(Policy.parse(data["settings"]), int(data["version"]))


def load_policy(s: Session, model_id: int, default: Policy | None = None) -> PolicySnapshot:
    """The stored policy of a model (``default``, else the defaults, at version 0 when none is
    stored)."""
    row = st.repo.get_policy(s, model_id)
    if row is None:
        return PolicySnapshot(default or Policy(), 0)
    return PolicySnapshot(Policy.parse(row.settings), row.version)
