"""Following the model's active deployment: what every replica but the deploying one does.

One replica claims a candidate (the compare-and-set from ``candidate`` to ``building``
records it as the deployment's ``owner``), builds or loads it, verifies it and runs the
canary on its own traffic. Once the deployment is ``active`` the other replicas *follow*:
each loads the same variant (the worker's artifact, so nothing is compiled), warms it on its
own live inputs, checks its fidelity against its own base module, and swaps it in - no
second canary, the decision was taken once. A replica that starts after the deployment
comes up the same way. A replica that cannot follow (no artifact fits and the build fails,
or its verification fails) keeps serving what it served, says why in its replica row and an
event, and does not retry that deployment.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import store as st
from compiler import warm
from pgc_daemon import states
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.replica import HOST, process_gone
from pgc_daemon.agent.runtime import in_short_thread, settle_heap
from pgc_daemon.agent.slot import Slot
from pgc_daemon.agent.variants import Variants
from pgc_daemon.errors import describe
from pgc_daemon.states import D

log = logging.getLogger("pgc.swapper")


class Follower:
    """Keeps one replica serving the model's active deployment (the swapper's thread calls
    :meth:`follow` between deployments)."""

    def __init__(self, served: Served, variants: Variants, replica_name: str) -> None:
        self.served = served
        self.variants = variants
        self.replica_name = replica_name
        self.failed: dict[int, str] = {}
        """Active deployments this replica could not follow, and why (not retried)."""
        self.state = "serving"
        self.message: str | None = None

    def follow(self, quietly: Callable[[], AbstractContextManager[None]]) -> bool:
        """Serve the active deployment if this replica does not yet; True when it swapped.
        ``quietly`` wraps the torch work (no profiling hooks, short GIL turns)."""
        served, reg = self.served, self.served.registry
        with reg.store().session() as sess:
            active = st.repo.active_deployment(sess, reg.id)
            variant = (
                st.repo.get_variant(sess, active.variant_id)
                if active is not None and active.variant_id is not None
                else None
            )
        if active is None or variant is None or len(reg.reservoir) == 0:
            return False
        now = served.slot
        if now.canary or active.id in self.failed:
            return False
        if now.variant_id == variant.id:
            if now.deployment_id != active.id:  # same module, now under this deployment
                served.swap(dataclasses.replace(now, deployment_id=active.id))
            return False
        if variant.id == reg.baseline_variant_id:
            served.swap(served.base_slot(active.id))
            self._say("serving", f"follows deployment {active.id}: the base module")
            return True
        slot = self.variants.in_memory(variant.id)
        try:
            with quietly():
                if slot is None:
                    self._say("loading", f"loading {variant.label} for deployment {active.id}")
                    slot = self._load(variant)
                policy = reg.current_policy()
                score = in_short_thread(self.variants.verify, slot.module, policy.min_fidelity)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot follow keeps serving
            why = f"could not follow deployment {active.id} ({variant.label}): {describe(exc)}"
            self.failed[active.id] = why
            self._say("serving", why)
            log.warning("replica %s %s", self.replica_name, why)
            with reg.store().session() as sess:
                st.repo.add_event(sess, reg.id, "replica_failed", f"replica {self.replica_name} {why}", level="warning")
            return False
        served.swap(dataclasses.replace(slot, deployment_id=active.id, control=None))
        self._say(
            "serving",
            f"follows deployment {active.id}: {variant.label} ({self.variants.last_source or 'warm'}; "
            f"fidelity {score:.4f})",
        )
        log.info("replica %s serves %s (deployment %s)", self.replica_name, variant.label, active.id)
        return True

    def fail_orphans(self) -> None:
        """Fail deployments in flight whose owner was a replica on this host whose process is
        gone (``kill -9``): at once, rather than after ``STALE_AFTER_S`` without heartbeat."""
        reg = self.served.registry
        with reg.store().session() as sess:
            for dep in st.repo.deployments_in(sess, reg.id, states.IN_FLIGHT):
                if not dep.owner or dep.owner == self.replica_name:
                    continue
                host, _, rest = dep.owner.partition(":")
                pid = rest.partition(":")[0]
                if host == HOST and pid.isdigit() and process_gone(int(pid)):
                    why = f"its replica {dep.owner} died before it finished"
                    try:
                        states.move(sess, dep.id, D.FAILED, why)
                    except st.StoreConflict:
                        continue  # another replica (or pgc serve) got there first
                    st.repo.add_event(sess, reg.id, "deploy_failed", f"deployment {dep.id}: {why}", level="warning")
                    log.warning("deployment %s failed: %s", dep.id, why)

    def _load(self, variant: st.Variant) -> Slot:
        built = in_short_thread(self.variants.build, variant.recipe, variant.artifact)
        in_short_thread(warm, built, self.variants.warm_examples())
        slot = Slot(built.module, variant.id, variant.label, built.hookable,
                    kernels=built.kernel_layers, own_pool=built.own_pool)
        self.variants.remember(slot)
        if self.served.registry.settings.gc_freeze:
            settle_heap()
        return slot

    def _say(self, state: str, message: str) -> None:
        self.state, self.message = state, message
