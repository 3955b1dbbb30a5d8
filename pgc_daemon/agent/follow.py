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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import store as st
from compiler import warm
from pgc_daemon import states
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.replica import HOST, process_gone
from pgc_daemon.agent.runtime import in_short_thread, settle_heap
from pgc_daemon.agent.slot import Slot
from pgc_daemon.agent.variants import Variants
from pgc_daemon.errors import describe
from pgc_daemon.states import D

log = logging.getLogger("pgc.swapper")


@dataclasses.dataclass(frozen=True)
class Look:
    """What one poll read of the model's deployments: the candidates to deploy (oldest
    first), those in flight, and the active one. ``Look()`` is a look not taken yet (or to
    take again, after a deployment)."""

    pending: list[int] = dataclasses.field(default_factory=list)
    in_flight: list[st.Deployment] = dataclasses.field(default_factory=list)
    active: st.Deployment | None = None
    stale: bool = True

    @classmethod
    def read(cls, reg: Registry) -> Look:
        """One session, one query: all a quiet poll asks the store (it used to open three
        sessions for four queries, about 3 ms of CPU a second per replica under load).
        Nothing until live inputs exist to warm up and verify with (a candidate waits rather
        than fails)."""
        if len(reg.reservoir) == 0:
            return cls()
        with reg.store().session() as sess:
            deps = st.repo.deployments_in(sess, reg.id, states.OPEN | {D.ACTIVE})
        actives = [d for d in deps if d.state == D.ACTIVE]
        return cls(
            pending=[d.id for d in deps if d.state == D.CANDIDATE],
            in_flight=[d for d in deps if d.state in states.IN_FLIGHT],
            active=max(actives, key=lambda d: d.id) if actives else None,
            stale=False,
        )


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

    def follow(self, active: st.Deployment | None,
               quietly: Callable[[], AbstractContextManager[None]]) -> bool:
        """Serve ``active`` (the model's active deployment, as the poll read it) if this
        replica does not yet; True when it swapped. ``quietly`` wraps the torch work (no
        profiling hooks, short GIL turns). The variant's row is read only to swap."""
        served, reg = self.served, self.served.registry
        if active is None or active.variant_id is None or len(reg.reservoir) == 0:
            return False
        now = served.slot
        if now.canary or active.id in self.failed:
            return False
        if now.variant_id == active.variant_id:
            if now.deployment_id != active.id:  # same module, now under this deployment
                served.swap(dataclasses.replace(now, deployment_id=active.id))
            return False
        if active.variant_id == reg.baseline_variant_id:
            served.swap(served.base_slot(active.id))
            self._say("serving", f"follows deployment {active.id}: the base module")
            return True
        with reg.store().session() as sess:
            variant = st.repo.get_variant(sess, active.variant_id)
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

    def fail_orphans(self, in_flight: Sequence[st.Deployment]) -> None:
        """Fail deployments in flight (as the poll read them) whose owner was a replica on
        this host whose process is gone (``kill -9``): at once, rather than after
        ``STALE_AFTER_S`` without heartbeat. A session is opened only for an orphan."""
        reg = self.served.registry
        for dep in in_flight:
            if not dep.owner or dep.owner == self.replica_name:
                continue
            host, _, rest = dep.owner.partition(":")
            pid = rest.partition(":")[0]
            if host != HOST or not pid.isdigit() or not process_gone(int(pid)):
                continue
            why = f"its replica {dep.owner} died before it finished"
            with reg.store().session() as sess:
                try:
                    states.move(sess, dep.id, D.FAILED, why)
                except st.StoreConflict:
                    continue  # another replica (or pgc serve) got there first
                st.repo.add_event(sess, reg.id, "deploy_failed", f"deployment {dep.id}: {why}",
                                  level="warning")
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
