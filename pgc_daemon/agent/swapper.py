"""The swapper: the agent's background thread that owns the deployment state machine.

``candidate → building → warming → verifying → canary → active``, or ``failed`` /
``rolled_back``; a replaced active deployment becomes ``superseded``. Everyone else (the
search, the API) only *creates* candidates; this thread, in the serving process, is the only
one that moves them, because only it can swap the module. Every transition is written to the
store with its reason (:func:`pgc_daemon.states.move`, a compare-and-set). While the store is
unreachable the thread keeps retrying and the current module keeps serving.

What a deployment attempt promises, however it ends:

- **The previous slot serves again** unless the deployment reached ``active``: restored in a
  ``finally``, so a store error, a cancel or a bug part-way never leaves the process in A/B
  canary mode with nothing judging it.
- **Someone else may end it.** An operator's cancel (or another process failing a deployment
  whose heartbeat went stale) makes the swapper's next move a
  :class:`store.StoreConflict`; the swapper drops the build or the canary, restores the
  previous slot and moves on. The heartbeat notices such a move within ``HEARTBEAT_S`` and
  ends a running canary early.
- **A store error fails it, once the store answers.** A deployment an unreachable store
  interrupted part-way is not resumed: its build may be gone and its canary's numbers are
  stale. When the store answers again, one still in flight is moved to ``failed`` with what
  interrupted it (the optimizer or the operator proposes again); one still a ``candidate``
  was never started and is simply tried again; one whose move to ``active`` had landed
  though its answer was lost is served.
- **Heartbeat** (:mod:`~pgc_daemon.agent.heartbeat`): the deployment's ``updated_at`` is
  refreshed every ``HEARTBEAT_S`` while the swapper works on it.

The swapper sees the served model only through :class:`~pgc_daemon.agent.contract.Served`;
the canary is :mod:`~pgc_daemon.agent.canary`, and the thread, GIL and heap tricks that keep
this work off the request path are :mod:`~pgc_daemon.agent.runtime`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import store as st
from compiler import warm
from pgc_daemon import states
from pgc_daemon.agent import canary
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.follow import Follower, Look
from pgc_daemon.agent.heartbeat import Heartbeat
from pgc_daemon.agent.replica import Replica, Report, trimmed_mean
from pgc_daemon.agent.reverts import Reverter, end_active
from pgc_daemon.agent.runtime import in_short_thread, lower_priority, settle_heap, short_gil_turns
from pgc_daemon.agent.slot import Slot
from pgc_daemon.agent.variants import VERIFY_INPUTS, Variants
from pgc_daemon.agent.shapewatch import ShapeMissWatch
from pgc_daemon.agent.twins import TwinWatch
from pgc_daemon.errors import DeployFailed, describe
from pgc_daemon.policy import Policy
from pgc_daemon.states import D

log = logging.getLogger("pgc.swapper")

class Swapper:
    """The deployment thread of one served model.

    Threading: everything below runs in the swapper's own thread (and the short-lived
    threads it starts for torch work), except :meth:`start`, :meth:`stop` and ``busy``, which
    the owner uses. ``busy`` is set while a deployment runs (the profiler's host samples
    taken meanwhile do not count as a leak). :meth:`release` may also be called directly,
    for a module built elsewhere (tests do), while the thread is idle.
    """

    def __init__(self, served: Served) -> None:
        self.served = served
        self.registry = served.registry
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"pgc-swapper-{self.registry.name}", daemon=True
        )
        self.variants = Variants(served)
        self.replica = Replica(self.registry.store, self._report)
        self.follower = Follower(served, self.variants, self.replica.name)
        self.reverts = Reverter(served)
        self.shape_misses = ShapeMissWatch(served.registry)
        self.twins = TwinWatch(served, self.variants)
        self.busy = threading.Event()
        self.deployments_done = 0
        self._interrupted: dict[int, _Interrupted] = {}
        """Deployments a store error interrupted, settled when the store answers again."""
        self._moved: threading.Event | None = None  # set by the heartbeat: someone else moved it
        self._failing: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.replica.stop()
        self.twins.stop()

    def _report(self) -> Report:
        """This replica's row: what it serves, how fast, what it built (the replica's thread)."""
        slot, served = self.served.slot, self.served
        recent = list(served.live.latency_ms.get(slot.variant_id, ()))[-256:]
        state = "deploying" if self.busy.is_set() and not self.follower.state == "loading" else self.follower.state
        return Report(
            state=state, variant_id=slot.variant_id, deployment_id=slot.deployment_id,
            calls=served.calls, live_ms=trimmed_mean(recent), compiles=self.variants.compiles,
            loads=self.variants.loads, message=self.follower.message,
        )

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        served, reg = self.served, self.registry
        backoff = reg.settings.poll_s
        lower_priority()
        while not self._stop.is_set():
            try:
                if reg.model_id is None:
                    base_dep = reg.register(self.replica)
                    if served.slot.module is served.base:
                        served.swap(served.base_slot(base_dep))
                    self.replica.start()
                    log.info("registered model %s (id %s) as replica %s", reg.name, reg.model_id, self.replica.name)
                reg.ensure_metric()
                self._settle_interrupted()
                self.reverts.handle_failed_variant()
                look = Look.read(reg)
                for dep_id in look.pending:
                    if self._stop.is_set():
                        break
                    self.busy.set()
                    try:
                        # no per-layer hooks while variants compile, warm up, verify and
                        # canary: tracing must not see them, nor a compiled module guard on them
                        with served.profiler.paused(), short_gil_turns(), Heartbeat(reg, dep_id) as beat:
                            self._moved = beat.moved
                            self._deploy(dep_id)
                    finally:
                        self._moved = None
                        self.busy.clear()
                    look = Look()  # read again after a deployment
                self._follow(look)
                self.shape_misses.check(served.slot)
                self.twins.check()
                backoff = reg.settings.poll_s
            except st.StoreError as exc:
                log.warning("store unavailable (%s); serving continues, retrying", describe(exc))
                backoff = min(backoff * 2, 30.0)
            except Exception:  # noqa: BLE001 - the swapper must survive anything
                log.exception("swapper iteration failed")
                backoff = min(backoff * 2, 30.0)
            self._stop.wait(backoff)

    def _follow(self, look: Look) -> None:
        """Serve the model's active deployment if another replica made it (or it was made
        before this one started): see :mod:`~pgc_daemon.agent.follow`."""
        if self._stop.is_set() or len(self.registry.reservoir) == 0:
            return
        if look.stale:
            look = Look.read(self.registry)
        self.follower.fail_orphans(look.in_flight)
        if self.follower.follow(look.active, self._quietly):
            self.replica.beat()
        elif (
            self.registry.spec  # a model pgc can search: a deployment will verify on these
            and len(self.registry.reservoir) >= VERIFY_INPUTS
            and self.variants.references_stale()
        ):
            in_short_thread(self.variants.prepare_references)

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """Torch work of a deployment or a follow: no per-layer hooks, short GIL turns."""
        self.busy.set()
        try:
            with self.served.profiler.paused(), short_gil_turns():
                yield
        finally:
            self.busy.clear()

    def _settle_interrupted(self) -> None:
        """Deployments a store error interrupted, now that the store answers (see the module
        docstring): fail those in flight, serve one whose activation had landed."""
        for dep_id, what in list(self._interrupted.items()):
            with self.registry.store().session() as sess:
                try:
                    dep = st.repo.get_deployment(sess, dep_id)
                except st.NotFound:
                    dep = None
                if dep is not None and dep.state in states.IN_FLIGHT:
                    reason = f"interrupted by a store error ({what.error}); not resumed"
                    if what.reason:
                        reason = f"{what.reason}; {reason}"
                    states.move(sess, dep_id, D.FAILED, reason)
                    st.repo.add_event(sess, self.registry.id, "deploy_failed", reason, level="warning")
                    log.warning("deployment %s failed: %s", dep_id, reason)
            self._interrupted.pop(dep_id, None)
            if dep is not None and dep.state == D.ACTIVE and self.served.slot.deployment_id != dep_id:
                self._serve_landed(dep_id, dep.variant_id)

    def _serve_landed(self, dep_id: int, variant_id: int | None) -> None:
        """A deployment whose move to ``active`` committed although its answer was lost:
        serve it (it is warm), or, if it is gone from memory, record what does serve."""
        slot = self.variants.in_memory(variant_id) if variant_id is not None else None
        if slot is None:  # not expected: a deployment's module is kept warm from its build on
            lost = Slot(self.served.base, variant_id, "lost variant", False, dep_id)
            return self.reverts.to_base(lost, "its module is gone after a store error")
        self.served.swap(_replace(slot, deployment_id=dep_id, control=None))
        log.info("deployment %s had become active before the store failed; serving it", dep_id)

    # ------------------------------------------------------------------ one deployment

    def _transition(self, dep_id: int, state: D, reason: str, **fields: Any) -> None:
        with self.registry.store().session() as sess:
            states.move(sess, dep_id, state, reason, **fields)

    def _deploy(self, dep_id: int) -> None:
        """One attempt at a deployment. Whatever ends it short of ``active`` (a failure, a
        cancel, a store error, a bug), the slot that served before serves again."""
        served = self.served
        before = served.slot
        variant_id: list[int | None] = [None]
        self._failing = None
        try:
            self._attempt(dep_id, variant_id)
        except st.StoreConflict as exc:
            log.info("deployment %s was moved by someone else (%s); dropped", dep_id, exc)
        except st.StoreError as exc:
            self._interrupted[dep_id] = _Interrupted(variant_id[0], describe(exc), self._failing)
            raise
        finally:
            now = served.slot
            if now is not before and (now.deployment_id != dep_id or now.canary):
                served.swap(before)  # not active: what served before serves again

    def _attempt(self, dep_id: int, variant_id: list[int | None]) -> None:
        served, reg = self.served, self.registry
        with reg.store().session() as sess:
            dep = st.repo.get_deployment(sess, dep_id)
            variant = st.repo.get_variant(sess, dep.variant_id) if dep.variant_id else None
            source = dep.source
        if variant is None:
            self._transition(dep_id, D.FAILED, "deployment names no variant")
            return
        variant_id[0] = variant.id
        policy = reg.current_policy()
        current = served.slot
        if current.variant_id == variant.id:
            self._transition(dep_id, D.FAILED, f"{variant.label} is already serving")
            return
        try:
            # A rollback to a module still in memory skips the build.
            reuse = self.variants.in_memory(variant.id)
            if reuse is not None and source == "rollback":
                self.reverts.to_variant(dep_id, reuse, current, owner=self.replica.name)
                return
            if reuse is not None:
                self._transition(
                    dep_id, D.BUILDING, f"{variant.label} is built already", owner=self.replica.name
                )
                self._transition(dep_id, D.WARMING, "warm already", build_s=0.0)
                self._transition(dep_id, D.VERIFYING, "verifying fidelity", warm_s=0.0)
                slot = _replace(reuse, deployment_id=dep_id, control=None)
            else:
                how = "loading the worker's artifact of" if variant.artifact else "building"
                self._transition(dep_id, D.BUILDING, f"{how} {variant.label}", owner=self.replica.name)
                built = in_short_thread(self.variants.build, variant.recipe, variant.artifact)
                self._transition(
                    dep_id,
                    D.WARMING,
                    f"{self.variants.last_source or 'built'}; warming up",
                    build_s=built.report.build_s,
                )
                examples = self.variants.warm_examples()
                warm_s = in_short_thread(warm, built, examples)
                self._transition(
                    dep_id, D.VERIFYING, f"warmed in {warm_s:.1f}s; verifying fidelity", warm_s=warm_s
                )
                slot = Slot(built.module, variant.id, variant.label, built.hookable, dep_id,
                            kernels=built.kernel_layers, own_pool=built.own_pool)
                self.variants.remember(slot)
                if reg.settings.gc_freeze:
                    settle_heap()
        except st.StoreError:
            raise  # a cancel (StoreConflict) or the store failing: _deploy's to handle
        except DeployFailed as exc:
            self._fail(dep_id, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bad candidate must not hurt serving
            self._fail(dep_id, f"{type(exc).__name__}: {describe(exc)}")
            return
        self.release(dep_id, slot, policy, source)

    def release(self, dep_id: int, slot: Slot, policy: Policy, source: str = "manual") -> bool:
        """From ``verifying`` on, for a built and warmed module: verify its fidelity on live
        inputs, swap it in as a canary beside what serves, and make it active, roll it back or
        fail it. Returns whether it became active; whenever it did not, the slot that served
        before serves again (also when this raises)."""
        served = self.served
        before = served.slot
        active = False
        try:
            active = self._release(dep_id, slot, policy, source)
            return active
        finally:
            if not active and served.slot is not before:
                served.swap(before)

    def _release(self, dep_id: int, slot: Slot, policy: Policy, source: str) -> bool:
        served, reg = self.served, self.registry
        label = slot.label
        try:
            verified = in_short_thread(self.variants.verify, slot.module, policy.min_fidelity)
        except DeployFailed as exc:
            self._fail(dep_id, str(exc))
            return False
        except Exception as exc:  # noqa: BLE001
            self._fail(dep_id, f"{type(exc).__name__}: {describe(exc)}")
            return False
        if self._stop.is_set():
            self._fail(dep_id, "agent stopped before the deployment finished")
            return False
        current = served.slot
        t0 = time.perf_counter()
        if policy.canary_s > 0:
            previous = served.swap(_replace(slot, control=current))
        else:
            previous = current
        swap_ms = (time.perf_counter() - t0) * 1e3
        if policy.canary_s > 0:
            self._transition(
                dep_id,
                D.CANARY,
                f"verified fidelity {verified:.4f}; canary for {policy.canary_s:.0f}s beside "
                "the previous module",
                swap_ms=swap_ms,
            )
            result = canary.run(served, slot, previous, policy, self._stop, self._moved,
                                canary.tolerance_for(source, policy))
        else:
            result = canary.Verdict(True, f"verified fidelity {verified:.4f}; no canary", {})
        reason, live = result.reason, result.live
        if not result.keep:
            served.swap(previous)
            self._transition(dep_id, result.end, reason, **live)
            kind = "rollback" if result.end == D.ROLLED_BACK else "deploy_failed"
            with reg.store().session() as sess:
                st.repo.add_event(sess, reg.id, kind, reason, level="warning")
            log.warning("%s %s: %s", "rolled back" if kind == "rollback" else "failed", label, reason)
            return False
        # the store first: the process serves the candidate alone only once the store says so
        with reg.store().session() as sess:
            st.repo.lock_model(sess, reg.id)
            end = D.ROLLED_BACK if source == "rollback" else D.SUPERSEDED
            end_active(sess, reg.id, end, f"replaced by {label}")
            states.move(
                sess,
                dep_id,
                D.ACTIVE,
                reason,
                swap_ms=swap_ms,
                previous_variant_id=previous.variant_id,
                **live,
            )
            st.repo.add_event(sess, reg.id, "deployed", f"{label} is active: {reason}")
        served.swap(slot)
        self.deployments_done += 1
        log.info("deployed %s: %s", label, reason)
        return True

    def _fail(self, dep_id: int, reason: str) -> None:
        log.warning("deployment %s failed: %s", dep_id, reason)
        self._failing = reason  # kept if the store fails now: the deployment is failed later
        self._transition(dep_id, D.FAILED, reason)
        with self.registry.store().session() as sess:
            st.repo.add_event(sess, self.registry.id, "deploy_failed", reason, level="warning")


def _replace(slot: Slot, **changes: Any) -> Slot:
    return dataclasses.replace(slot, **changes)


@dataclasses.dataclass(frozen=True)
class _Interrupted:
    """A deployment a store error interrupted: its variant, the error, why it was being failed."""

    variant_id: int | None
    error: str
    reason: str | None = None
