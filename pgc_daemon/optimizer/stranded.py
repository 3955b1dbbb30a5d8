"""Deployments nobody drives any more: failed by the daemon's tick so the model can take a new
one (at most one deployment per model is open, so a stranded one refuses every other).

An agent refreshes the ``updated_at`` of a deployment it works on at least every
``states.HEARTBEAT_S``; an in-flight deployment (``states.IN_FLIGHT``) not refreshed for
``states.STALE_AFTER_S`` belongs to an agent that died (``kill -9``, a lost machine). A
``candidate`` nobody took for ``UNCLAIMED_AFTER_S`` has no agent serving its model. Each is
moved to ``failed`` with a compare-and-set, under the model's lock and after reading it again:
a live agent that moved or refreshed it meanwhile wins.
"""

from __future__ import annotations

import logging

import store as st
from pgc_daemon import states
from pgc_daemon.states import D

log = logging.getLogger("pgc.daemon")

#: A ``candidate`` no agent took within this long: nothing serves the model.
UNCLAIMED_AFTER_S = 600.0


def fail_stranded(
    store: st.Store,
    now: float,
    *,
    stale_s: float | None = None,
    unclaimed_s: float = UNCLAIMED_AFTER_S,
) -> list[int]:
    """Fail the in-flight deployments whose agent stopped reporting and the candidates nobody
    took; returns their ids. One cheap query when nothing is stranded."""
    stale_s = states.STALE_AFTER_S if stale_s is None else stale_s
    with store.session() as s:
        found = [
            (
                dep,
                now - stale_s,
                f"the agent stopped reporting (no heartbeat for {now - dep.updated_at:.0f} s)",
            )
            for dep in st.repo.stale_deployments(s, states.IN_FLIGHT, now - stale_s)
        ] + [
            (
                dep,
                now - unclaimed_s,
                f"no agent took it within {unclaimed_s:.0f} s (is the model being served?)",
            )
            for dep in st.repo.stale_deployments(s, {D.CANDIDATE}, now - unclaimed_s)
        ]
    failed: list[int] = []
    for dep, cutoff, reason in found:
        try:
            with store.session() as s:
                st.repo.lock_model(s, dep.model_id)
                current = st.repo.get_deployment(s, dep.id)
                if current.state != dep.state or current.updated_at >= cutoff:
                    continue  # the agent moved or refreshed it since the first read
                states.move(s, dep.id, D.FAILED, reason)
                st.repo.add_event(
                    s, dep.model_id, "deployment_failed", f"deployment {dep.id}: {reason}",
                    level="error",
                )
        except (st.StoreConflict, st.NotFound):
            continue  # moved by someone else meanwhile (a live agent, a cancel): theirs wins
        log.warning("deployment %d (%s) failed: %s", dep.id, dep.state, reason)
        failed.append(dep.id)
    return failed
