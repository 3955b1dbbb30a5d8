"""The one deployment decision per model, taken under the model's lock so that several
daemons working one fleet never deploy twice."""

from __future__ import annotations

from typing import Any

import store as st
from pgc_daemon.operations import busy_deployment
from pgc_daemon.policy import Policy
from pgc_daemon.search.study import TrialRecord
from pgc_daemon.status import BASELINE_HASH


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
    store: st.Store, model_id: int, chosen: TrialRecord, policy: Policy, *, run_id: int | None = None
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
