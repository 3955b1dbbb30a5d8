"""Operator actions on a model, shared by the REST API and the CLI: deploy a variant, roll
back. Both only *create* a candidate deployment under the model's lock; the agent serving the
model builds, verifies, canaries and swaps it."""

from __future__ import annotations

from typing import Any

import store as st
from compiler import Recipe
from pgc_daemon.errors import PgcError
from pgc_daemon.status import baseline_variant


class Conflict(PgcError):
    """The action conflicts with work in progress or with the current state (HTTP 409)."""


class InvalidRequest(PgcError, ValueError):
    """The action asks for something that cannot be (HTTP 422, exit code 2)."""


def busy_deployment(s: Any, model_id: int) -> st.Deployment | None:
    for d in st.repo.list_deployments(s, model_id, limit=20):
        if d.state == "candidate" or d.state in st.repo.IN_FLIGHT:
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
