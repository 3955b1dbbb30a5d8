"""The one way to create or cancel a deployment: a search proposing its result
(:func:`propose`) or, while it goes on, a trial good enough (:func:`propose_while_searching`),
an operator deploying a variant, rolling back or cancelling (the REST API and the CLI).
Every deployment is created by :func:`_create`, under the model's lock, and only while no
other deployment of that model is open; the agent serving the model then builds, verifies,
canaries and swaps it.

Contract: these functions take the caller's session and neither commit nor roll back; the
caller's ``store.session()`` does. They raise :class:`Conflict` (HTTP 409) when the request
clashes with the current state, :class:`InvalidRequest` (HTTP 422) when it cannot be, and the
store's ``NotFound`` (HTTP 404) for a name or id that is not there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

import store as st
from compiler import Recipe
from pgc_daemon import states
from pgc_daemon.errors import PgcError
from pgc_daemon.policy import Policy
from pgc_daemon.services.queries import BASELINE_HASH, baseline_variant
from pgc_daemon.states import D


class Conflict(PgcError):
    """The action conflicts with work in progress or with the current state (HTTP 409)."""


class InvalidRequest(PgcError, ValueError):
    """The action asks for something that cannot be (HTTP 422, exit code 2)."""


class Source:
    """Who asked for a deployment (the ``source`` column)."""

    SEARCH = "search"
    MANUAL = "manual"
    ROLLBACK = "rollback"


def busy_deployment(s: Session, model_id: int) -> st.Deployment | None:
    """The model's open deployment (at most one exists), if any."""
    for d in st.repo.list_deployments(s, model_id, limit=20):
        if d.state in states.OPEN:
            return d
    return None


def _create(
    s: Session,
    model_id: int,
    variant_id: int,
    *,
    source: str,
    reason: str,
    expected_speedup: float | None = None,
    expected_fidelity: float | None = None,
) -> st.Deployment:
    """Create a candidate deployment: the one place outside the agent that calls
    ``store.repo.create_deployment`` (the agent itself records only what it already did: the
    attached base module, a restore after a restart, a revert to the base).

    The model's lock (``store.repo.lock_model``: ``BEGIN IMMEDIATE`` on SQLite, ``FOR UPDATE``
    on PostgreSQL) is taken before the check for an open deployment, so of concurrent callers
    exactly one creates and the others get :class:`Conflict`. Callers that write before
    calling this (a new variant) take the lock first themselves: on SQLite a transaction that
    wrote before it locked may have read an older snapshot."""
    st.repo.lock_model(s, model_id)
    busy = busy_deployment(s, model_id)
    if busy is not None:
        raise Conflict(f"deployment {busy.id} is still {busy.state}")
    dep = st.repo.create_deployment(
        s,
        model_id,
        variant_id,
        source=source,
        reason=reason,
        expected_speedup=expected_speedup,
        expected_fidelity=expected_fidelity,
    )
    return st.repo.get_deployment(s, dep.id)


def request_deploy(
    s: Session,
    model_name: str,
    *,
    variant_id: int | None = None,
    recipe: Recipe | Mapping[str, Any] | None = None,
    reason: str = "deployed by an operator",
) -> st.Deployment:
    """Deploy a stored variant or a recipe (validated: ``RecipeError`` on a bad one)."""
    if (variant_id is None) == (recipe is None):
        raise InvalidRequest("give exactly one of a variant id and a recipe")
    model = st.repo.get_model(s, model_name)
    parsed = None
    if recipe is not None:  # validated before the lock is taken
        parsed = recipe if isinstance(recipe, Recipe) else Recipe.from_dict(recipe)
    st.repo.lock_model(s, model.id)  # before the first write: see _create
    if parsed is not None:
        variant = st.repo.get_or_create_variant(
            s, model.id, parsed.hash, parsed.to_dict(), parsed.label()
        )
    else:
        variant = st.repo.get_variant(s, variant_id)  # type: ignore[arg-type]
        if variant.model_id != model.id:
            raise st.NotFound(f"no variant {variant_id} for model {model_name!r}")
    return _create(s, model.id, variant.id, source=Source.MANUAL, reason=reason)


def request_rollback(
    s: Session, model_name: str, *, reason: str = "rolled back by an operator"
) -> st.Deployment:
    """Return to what served before the active variant (the fp32 base if nothing else)."""
    model = st.repo.get_model(s, model_name)
    st.repo.lock_model(s, model.id)
    active = st.repo.active_deployment(s, model.id)
    base = baseline_variant(s, model.id)
    if active is None or base is None or active.variant_id == base.id:
        raise Conflict("the fp32 base already serves; nothing to roll back")
    target = active.previous_variant_id or base.id
    return _create(s, model.id, target, source=Source.ROLLBACK, reason=reason)


def request_cancel(
    s: Session, model_name: str, deployment_id: int, reason: str = "cancelled by an operator"
) -> st.Deployment:
    """Cancel an open deployment (a candidate, or one an agent is building, warming,
    verifying or running on canary) of ``model_name``.

    The move is a compare-and-set: of a cancel and an agent's own next step, exactly one
    wins. A deployment already finished (or finished meanwhile) is a :class:`Conflict`. An
    agent mid-build on it finds out at its next transition (``StoreConflict``) and drops the
    build; a cancelled canary is the agent's to revert."""
    model = st.repo.get_model(s, model_name)
    dep = st.repo.get_deployment(s, deployment_id)
    if dep.model_id != model.id:
        raise st.NotFound(f"no deployment {deployment_id} for model {model_name!r}")
    if dep.state not in states.OPEN:
        raise Conflict(f"deployment {deployment_id} is {dep.state}; only an open one can be cancelled")
    try:
        return states.move(s, deployment_id, D.CANCELLED, reason)
    except st.StoreConflict as exc:
        raise Conflict(str(exc)) from None


@dataclass(frozen=True)
class Proposal:
    """A search's chosen variant, as the deployment decision needs it."""

    recipe_hash: str
    recipe: dict[str, Any]
    label: str
    speedup: float | None
    fidelity: float | None
    message: str
    artifact: str | None = None
    """Digest of the compiled artifact the search saved for this recipe (recorded on the
    variant, so the serving process loads it instead of compiling); None: none saved."""
    trial: int | None = None
    """Set when the search proposes while it goes on: which of its trials this was (1-based,
    in the order they were evaluated). None: the run's final choice."""
    trials: int | None = None
    """The run's trial budget (with ``trial``)."""

    @property
    def while_searching(self) -> bool:
        return self.trial is not None

    def reason(self, run_id: int | None) -> str:
        """The deployment's reason: which run, whether it was still searching, what it found."""
        text = self.message
        if self.while_searching:
            text = f"{WHILE_SEARCHING} (trial {self.trial} of {self.trials}): {text}"
        return f"search run {run_id}: {text}" if run_id else text


#: What the reason of a deployment a search proposed while it went on says.
WHILE_SEARCHING = "deployed while searching"


@dataclass(frozen=True)
class Standing:
    """What a model serves and what is on its way, as a search's result is judged against."""

    serving_speedup: float
    """What the active variant was measured at against fp32 eager (1.0 for the base)."""
    serving_variant_id: int | None
    busy_id: int | None = None
    """The open deployment, if any (at most one exists)."""
    busy_state: str | None = None
    busy_variant_id: int | None = None
    busy_speedup: float | None = None
    """What the open deployment's variant was measured at (as :func:`measured_speedup`)."""
    busy_updated_at: float | None = None

    @property
    def best(self) -> float:
        """The speedup to beat: the better of what serves and what is being deployed."""
        return max(self.serving_speedup, self.busy_speedup or 0.0)


def standing(s: Session, model_id: int) -> Standing:
    active = st.repo.active_deployment(s, model_id)
    busy = busy_deployment(s, model_id)
    return Standing(
        serving_speedup=measured_speedup(s, model_id, active),
        serving_variant_id=active.variant_id if active is not None else None,
        busy_id=busy.id if busy is not None else None,
        busy_state=str(busy.state) if busy is not None else None,
        busy_variant_id=busy.variant_id if busy is not None else None,
        busy_speedup=measured_speedup(s, model_id, busy) if busy is not None else None,
        busy_updated_at=busy.updated_at if busy is not None else None,
    )


def not_faster(speedup: float | None, now: Standing, min_speedup: float) -> str | None:
    """Why a variant measured at ``speedup`` should not replace what serves or is being
    deployed (None: it should): it must be faster than the better of them, by at least
    ``min_speedup`` times."""
    best = now.best
    if speedup is not None and speedup > best and speedup >= best * min_speedup:
        return None
    deploying = (now.busy_speedup or 0.0) > now.serving_speedup
    what = "what is being deployed" if deploying else "what serves"
    return f"{speedup or 0:.2f}x is not {min_speedup:.2f}x faster than {what} ({best:.2f}x)"


@dataclass(frozen=True)
class Offer:
    """What came of :func:`propose_while_searching`."""

    deployment_id: int | None
    """The deployment created, if one was."""
    waiting: bool = False
    """Refused only because another deployment is open: worth offering again when it ends."""
    reason: str | None = None
    """Why none was created."""


def measured_speedup(s: Session, model_id: int, deployment: st.Deployment | None) -> float:
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


def _why_not(
    s: Session, model_id: int, variant: st.Variant, chosen: Proposal, policy: Policy
) -> str | None:
    """Why the search's choice should not be deployed now (None: it should)."""
    busy = busy_deployment(s, model_id)
    if busy is not None:
        return f"deployment {busy.id} is still {busy.state}"
    active = st.repo.active_deployment(s, model_id)
    if active is not None and active.variant_id == variant.id:
        return f"{chosen.label} is already serving"
    now = measured_speedup(s, model_id, active)
    if (chosen.speedup or 0.0) < now * policy.min_speedup:
        return (
            f"{chosen.label} ({chosen.speedup or 0:.2f}x) is not {policy.min_speedup:.2f}x "
            f"faster than what serves ({now:.2f}x)"
        )
    if not policy.auto_deploy:
        return f"found {chosen.label} ({chosen.speedup or 0:.2f}x); auto_deploy is off"
    return None


def propose(
    store: st.Store, model_id: int, chosen: Proposal, policy: Policy, *, run_id: int | None = None
) -> int | None:
    """Create a candidate deployment for ``chosen`` when it is worth it; returns its id, or
    None with the reason recorded as an event."""
    with store.session() as s:
        st.repo.lock_model(s, model_id)  # the decision and the creation see one state
        variant = _variant(s, model_id, chosen)
        reason = _why_not(s, model_id, variant, chosen, policy)
        if reason is not None:
            st.repo.add_event(s, model_id, "kept", f"kept the current module: {reason}")
            return None
        return _create_for(s, model_id, variant, chosen, run_id).id


def propose_while_searching(
    store: st.Store, model_id: int, chosen: Proposal, policy: Policy, *, run_id: int | None = None
) -> Offer:
    """Create a candidate deployment for a trial of a search that goes on, when the policy
    deploys automatically and the trial is ``min_speedup`` faster than the better of what
    serves and what is being deployed. Only one deployment is open at a time: while another
    is, the answer says ``waiting`` (offer it again when that one ends). Nothing is recorded
    as an event when nothing is created: the search offers every good trial, and its final
    choice goes through :func:`propose`."""
    if not policy.auto_deploy:
        return Offer(None, reason="auto_deploy is off")
    with store.session() as s:
        st.repo.lock_model(s, model_id)
        variant = _variant(s, model_id, chosen)
        now = standing(s, model_id)
        if now.serving_variant_id == variant.id:
            return Offer(None, reason=f"{chosen.label} is already serving")
        if now.busy_variant_id == variant.id:
            being = f"{chosen.label} is being deployed (deployment {now.busy_id})"
            return Offer(None, reason=being)
        why = not_faster(chosen.speedup, now, policy.min_speedup)
        if why is not None:
            return Offer(None, reason=f"{chosen.label}: {why}")
        if now.busy_id is not None:
            busy = f"deployment {now.busy_id} is still {now.busy_state}"
            return Offer(None, waiting=True, reason=busy)
        return Offer(_create_for(s, model_id, variant, chosen, run_id).id)


def _variant(s: Session, model_id: int, chosen: Proposal) -> st.Variant:
    variant = st.repo.get_or_create_variant(
        s, model_id, chosen.recipe_hash, chosen.recipe, chosen.label
    )
    if chosen.artifact is not None and variant.artifact != chosen.artifact:
        st.repo.set_variant_artifact(s, variant.id, chosen.artifact)
    return variant


def _create_for(
    s: Session, model_id: int, variant: st.Variant, chosen: Proposal, run_id: int | None
) -> st.Deployment:
    return _create(
        s,
        model_id,
        variant.id,
        source=Source.SEARCH,
        reason=chosen.reason(run_id),
        expected_speedup=chosen.speedup,
        expected_fidelity=chosen.fidelity,
    )
