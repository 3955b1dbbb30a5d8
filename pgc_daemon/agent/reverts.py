"""Going back: to the base module when an active variant fails live requests, and to a
variant still in memory when an operator rolls back.

Both change what serves and record it, in the order that keeps the two in agreement: a
failing variant is taken out of service *first* (requests must not keep failing over to the
base while the store is slow) and recorded after, with records a store error kept from
retried on the next swapper iteration; an operator's rollback is recorded *first* and swapped
in after (a store error leaves what serves unchanged). Runs in the swapper thread.
"""

from __future__ import annotations

import dataclasses
import logging

from sqlalchemy.orm import Session

import store as st
from pgc_daemon import states
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.slot import Slot
from pgc_daemon.states import D

log = logging.getLogger("pgc.swapper")


def end_active(sess: Session, model_id: int, end: D, reason: str, *, keep: int | None = None) -> None:
    """Move every active deployment of the model but ``keep`` to ``end``: exactly one
    deployment per model is active, whichever replica served which before."""
    for dep in st.repo.list_deployments(sess, model_id, limit=50):
        if dep.state == D.ACTIVE and dep.id != keep:
            states.move(sess, dep.id, end, reason)


class Reverter:
    def __init__(self, served: Served) -> None:
        self.served = served
        self._unrecorded: tuple[Slot, str] | None = None
        """A revert to the base done in memory whose store records failed (retried)."""

    def handle_failed_variant(self) -> None:
        """An active (non-canary) variant failed a live request: return to the base module."""
        served = self.served
        if self._unrecorded is not None:
            self._record(*self._unrecorded)
        error = served.take_variant_failure()
        if error is None:
            return
        slot = served.slot
        if slot.module is served.base:
            return
        self.to_base(slot, f"variant failed live requests: {error}")

    def to_base(self, slot: Slot, reason: str) -> None:
        """Serve the base module now, then record it."""
        served = self.served
        served.swap(served.base_slot())
        self._unrecorded = (slot, reason)
        self._record(slot, reason)

    def _record(self, slot: Slot, reason: str) -> None:
        served, reg = self.served, self.served.registry
        with reg.store().session() as sess:
            st.repo.lock_model(sess, reg.id)
            if slot.deployment_id is not None:
                current = st.repo.get_deployment(sess, slot.deployment_id)
                if current.state in states.allowed_from(D.ROLLED_BACK):
                    states.move(sess, slot.deployment_id, D.ROLLED_BACK, reason)
            end_active(sess, reg.id, D.ROLLED_BACK, reason)
            dep = st.repo.create_deployment(
                sess, reg.id, reg.baseline_variant_id, source="rollback", reason=reason
            )
            states.move(sess, dep.id, D.ACTIVE, "base module restored")
            st.repo.add_event(sess, reg.id, "rollback", reason, level="warning")
        self._unrecorded = None
        if served.slot.module is served.base:
            served.swap(served.base_slot(dep.id))

    def to_variant(self, dep_id: int, target: Slot, current: Slot, *, owner: str) -> None:
        """An operator's rollback to a module still in memory (``owner``: this replica)."""
        reg = self.served.registry
        with reg.store().session() as sess:
            end_active(sess, reg.id, D.ROLLED_BACK, "rolled back on request")
            states.move(
                sess,
                dep_id,
                D.ACTIVE,
                f"rolled back to {target.label}",
                previous_variant_id=current.variant_id,
                owner=owner,
            )
            st.repo.add_event(sess, reg.id, "rollback", f"rolled back to {target.label}")
        self.served.swap(dataclasses.replace(target, deployment_id=dep_id, control=None))
