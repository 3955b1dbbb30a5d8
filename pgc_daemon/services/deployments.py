"""The one way to create a deployment: a search proposing its result, an operator deploying a
variant or rolling back (the REST API and the CLI). Each only *creates* a candidate under the
model's lock, and at most one deployment per model is open at a time; the agent serving the
model builds, verifies, canaries and swaps it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import store as st
from pgc_daemon import states
from compiler import Recipe
from pgc_daemon.errors import PgcError
from pgc_daemon.policy import Policy
from pgc_daemon.services.queries import BASELINE_HASH, baseline_variant


class Conflict(PgcError):
    """The action conflicts with work in progress or with the current state (HTTP 409)."""


class InvalidRequest(PgcError, ValueError):
    """The action asks for something that cannot be (HTTP 422, exit code 2)."""


def busy_deployment(s: Any, model_id: int) -> st.Deployment | None:
    for d in st.repo.list_deployments(s, model_id, limit=20):
        if d.state in states.OPEN:
            return d
    return None


def _create(s: Any, model: st.Model, variant_id: int, source: str, reason: str) -> st.Deployment:
    st.repo.lock_model(s, model.id)
    busy = busy_deployment(s, model.id)
    if busy is not None:
        raise Conflict(f"deployment {busy.id} is still {busy.state}")
    dep = st.repo.create_deployment(s, model.id, variant_id, source=source, reason=reason)
    return st.repo.get_deployment(s, dep.id)


def request_deploy(
    s: Any,
    model_name: str,
    *,
    variant_id: int | None = None,
    recipe: dict[str, Any] | None = None,
    reason: str = "deployed by an operator",
) -> st.Deployment:
    """Deploy a stored variant or a recipe (validated: ``RecipeError`` on a bad one)."""
    if (variant_id is None) == (recipe is None):
        raise InvalidRequest("give exactly one of a variant id and a recipe")
    model = st.repo.get_model(s, model_name)
    if recipe is not None:
        parsed = Recipe.from_dict(recipe)
        variant = st.repo.get_or_create_variant(
            s, model.id, parsed.hash, parsed.to_dict(), parsed.label()
        )
    else:
        variant = st.repo.get_variant(s, variant_id)  # type: ignore[arg-type]
        if variant.model_id != model.id:
            raise st.NotFound(f"no variant {variant_id} for model {model_name!r}")
    return _create(s, model, variant.id, "manual", reason)


def request_rollback(
    s: Any, model_name: str, *, reason: str = "rolled back by an operator"
) -> st.Deployment:
    """Return to what served before the active variant (the fp32 base if nothing else)."""
    model = st.repo.get_model(s, model_name)
    active = st.repo.active_deployment(s, model.id)
    base = baseline_variant(s, model.id)
    if active is None or base is None or active.variant_id == base.id:
        raise Conflict("the fp32 base already serves; nothing to roll back")
    target = active.previous_variant_id or base.id
    return _create(s, model, target, "rollback", reason)


@dataclass(frozen=True)
class Proposal:
    """A search's chosen variant, as the deployment decision needs it."""

    recipe_hash: str
    recipe: dict[str, Any]
    label: str
    speedup: float | None
    fidelity: float | None
    message: str


def measured_speedup(s: Any, model_id: int, deployment: st.Deployment | None) -> float:
    """What the serving variant was measured at against fp32 eager (1.0 for the base)."""
    if deployment is None or deployment.variant_id is None:
        return 1.0
    if deployment.expected_speedup is not None:
        return deployment.expected_speedup
    variant = st.repo.get_variant(s, deployment.variant_id)
    if variant.recipe_hash == BASELINE_HASH:
        return 1.0
    speeds = [
        t.speedup
        for t in st.repo.list_trials(s, model_id)
        if t.variant_id == variant.id and t.speedup is not None
    ]
    return max(speeds, default=1.0)


def propose(
    store: st.Store, model_id: int, chosen: Proposal, policy: Policy, *, run_id: int | None = None
) -> int | None:
    """Create a candidate deployment for ``chosen`` when it is worth it; returns its id, or
    None with the reason recorded as an event."""
    with store.session() as s:
        st.repo.lock_model(s, model_id)
        variant = st.repo.get_or_create_variant(
            s, model_id, chosen.recipe_hash, chosen.recipe, chosen.label
        )
        active = st.repo.active_deployment(s, model_id)
        busy = busy_deployment(s, model_id)
        now = measured_speedup(s, model_id, active)
        reason = None
        if busy is not None:
            reason = f"deployment {busy.id} is still {busy.state}"
        elif active is not None and active.variant_id == variant.id:
            reason = f"{chosen.label} is already serving"
        elif (chosen.speedup or 0.0) < now * policy.min_speedup:
            reason = (
                f"{chosen.label} ({chosen.speedup or 0:.2f}x) is not {policy.min_speedup:.2f}x "
                f"faster than what serves ({now:.2f}x)"
            )
        elif not policy.auto_deploy:
            reason = f"found {chosen.label} ({chosen.speedup or 0:.2f}x); auto_deploy is off"
        if reason is not None:
            st.repo.add_event(s, model_id, "kept", f"kept the current module: {reason}")
            return None
        dep = st.repo.create_deployment(
            s,
            model_id,
            variant.id,
            source="search",
            reason=f"search run {run_id}: {chosen.message}" if run_id else chosen.message,
            expected_speedup=chosen.speedup,
            expected_fidelity=chosen.fidelity,
        )
        return dep.id
