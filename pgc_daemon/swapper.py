"""The swapper: the agent's background thread that owns the deployment state machine.

``candidate → building → warming → verifying → canary → active``, or ``failed`` /
``rolled_back``; a replaced active deployment becomes ``superseded``. Everyone else (the
search, the API) only *creates* candidates; this thread, in the serving process, is the only
one that moves them, because only it can swap the module. Every transition is written to the
store with its reason. While the store is unreachable the thread keeps retrying and the
current module keeps serving.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

import store as st
from compiler import BuiltVariant, CompileCache, Recipe, build, fidelity, warm
from pgc_daemon.errors import describe
from pgc_daemon.slot import Slot
from profiler import shape_key

if TYPE_CHECKING:
    from pgc_daemon.agent import ServedModel

log = logging.getLogger("pgc.swapper")

VERIFY_INPUTS = 32
WARM_SHAPES = 8
CALIBRATION_INPUTS = 32
MIN_CANARY_CALLS = 20
KEEP_BUILT = 3
SWAPPER_NICE = 10


class DeployFailed(Exception):
    """A step of a deployment failed; the message is the recorded reason."""


class Swapper:
    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pgc-swapper-{served.name}", daemon=True)
        self._built: collections.OrderedDict[int, Slot] = collections.OrderedDict()
        self._refs: tuple[int, list[Any], list[Any]] | None = None
        self._cache: CompileCache | None = None
        self.busy = threading.Event()
        self.deployments_done = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        served = self.served
        backoff = served.settings.poll_s
        _lower_priority()
        while not self._stop.is_set():
            try:
                if served.model_id is None:
                    served.register()
                    log.info("registered model %s (id %s)", served.name, served.model_id)
                served.ensure_metric()
                self._handle_failed_variant()
                for dep_id in self._pending():
                    if self._stop.is_set():
                        break
                    self.busy.set()
                    try:
                        self._deploy(dep_id)
                    finally:
                        self.busy.clear()
                backoff = served.settings.poll_s
            except st.StoreError as exc:
                log.warning("store unavailable (%s); serving continues, retrying", describe(exc))
                backoff = min(backoff * 2, 30.0)
            except Exception:  # noqa: BLE001 - the swapper must survive anything
                log.exception("swapper iteration failed")
                backoff = min(backoff * 2, 30.0)
            self._stop.wait(backoff)

    def _pending(self) -> list[int]:
        """Candidates to deploy, oldest first; none until live inputs exist to warm up and
        verify with (a candidate waits rather than fails)."""
        if len(self.served.reservoir) == 0:
            return []
        with self.served.store().session() as sess:
            return [d.id for d in st.repo.pending_deployments(sess, self.served.model_id)]

    def _handle_failed_variant(self) -> None:
        """An active (non-canary) variant failed a live request: return to the base module."""
        served = self.served
        if not served.variant_failure.is_set():
            return
        served.variant_failure.clear()
        slot = served.slot
        if slot.module is served.base:
            return
        reason = f"variant failed live requests: {served.last_variant_error}"
        self._revert_to_base(slot, reason)

    def _revert_to_base(self, slot: Slot, reason: str) -> None:
        served = self.served
        served.swap(served.base_slot())
        with served.store().session() as sess:
            if slot.deployment_id is not None:
                st.repo.transition(sess, slot.deployment_id, "rolled_back", reason)
            dep = st.repo.create_deployment(
                sess, served.model_id, served.baseline_variant_id, source="rollback", reason=reason
            )
            st.repo.transition(sess, dep.id, "active", "base module restored")
            st.repo.add_event(sess, served.model_id, "rollback", reason, level="warning")
        served.swap(served.base_slot(dep.id))

    # ------------------------------------------------------------------ one deployment

    def _transition(self, dep_id: int, state: str, reason: str, **fields: Any) -> None:
        with self.served.store().session() as sess:
            st.repo.transition(sess, dep_id, state, reason, **fields)

    def _deploy(self, dep_id: int) -> None:
        served = self.served
        with served.store().session() as sess:
            dep = st.repo.get_deployment(sess, dep_id)
            variant = st.repo.get_variant(sess, dep.variant_id) if dep.variant_id else None
            source = dep.source
        if variant is None:
            self._transition(dep_id, "failed", "deployment names no variant")
            return
        policy = served.current_policy()
        current = served.slot
        if current.variant_id == variant.id:
            self._transition(dep_id, "failed", f"{variant.label} is already serving")
            return
        try:
            # A rollback to a module still in memory skips the build.
            reuse = self._module_in_memory(variant.id)
            if reuse is not None and source == "rollback":
                self._finish_rollback(dep_id, reuse, current)
                return
            if reuse is not None:
                self._transition(dep_id, "building", f"{variant.label} is built already")
                self._transition(dep_id, "warming", "warm already", build_s=0.0)
                self._transition(dep_id, "verifying", "verifying fidelity", warm_s=0.0)
                slot = _replace(reuse, deployment_id=dep_id, control=None)
            else:
                self._transition(dep_id, "building", f"building {variant.label}")
                built = self._build(variant.recipe)
                self._transition(
                    dep_id,
                    "warming",
                    f"built in {built.report.build_s:.1f}s; warming up",
                    build_s=built.report.build_s,
                )
                examples = self._warm_examples()
                warm_s = warm(built, examples)
                self._transition(
                    dep_id, "verifying", f"warmed in {warm_s:.1f}s; verifying fidelity", warm_s=warm_s
                )
                slot = self._slot_for(built, variant.id, variant.label, dep_id)
                self._remember(slot)
        except DeployFailed as exc:
            self._fail(dep_id, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bad candidate must not hurt serving
            self._fail(dep_id, f"{type(exc).__name__}: {describe(exc)}")
            return
        self.release(dep_id, slot, policy, source)

    def release(self, dep_id: int, slot: Slot, policy: Any, source: str = "manual") -> bool:
        """From ``verifying`` on, for a built and warmed module: verify its fidelity on live
        inputs, swap it in as a canary beside what serves, and make it active or roll it back.
        Returns whether it became active."""
        served = self.served
        label = slot.label
        try:
            verified = self._verify(slot.module, policy.min_fidelity)
        except DeployFailed as exc:
            self._fail(dep_id, str(exc))
            return False
        except Exception as exc:  # noqa: BLE001
            self._fail(dep_id, f"{type(exc).__name__}: {describe(exc)}")
            return False
        current = served.slot
        t0 = time.perf_counter()
        if policy.canary_s > 0:
            previous = served.swap(_replace(slot, control=current))
        else:
            previous = served.swap(slot)
        swap_ms = (time.perf_counter() - t0) * 1e3
        if policy.canary_s > 0:
            self._transition(
                dep_id,
                "canary",
                f"verified fidelity {verified:.4f}; canary for {policy.canary_s:.0f}s beside "
                "the previous module",
                swap_ms=swap_ms,
            )
            ok, reason, live = self._canary(slot, previous, policy)
        else:
            ok, reason, live = True, f"verified fidelity {verified:.4f}; no canary", {}
        if not ok:
            served.swap(previous)
            self._transition(dep_id, "rolled_back", reason, **live)
            with served.store().session() as sess:
                st.repo.add_event(sess, served.model_id, "rollback", reason, level="warning")
            log.warning("rolled back %s: %s", label, reason)
            return False
        served.swap(slot)
        with served.store().session() as sess:
            if previous.deployment_id is not None:
                prev = st.repo.get_deployment(sess, previous.deployment_id)
                if prev.state == "active":
                    end = "rolled_back" if source == "rollback" else "superseded"
                    st.repo.transition(sess, prev.id, end, f"replaced by {label}")
            st.repo.transition(
                sess,
                dep_id,
                "active",
                reason,
                swap_ms=swap_ms,
                previous_variant_id=previous.variant_id,
                **live,
            )
            st.repo.add_event(sess, served.model_id, "deployed", f"{label} is active: {reason}")
        self.deployments_done += 1
        log.info("deployed %s: %s", label, reason)
        return True

    def _fail(self, dep_id: int, reason: str) -> None:
        log.warning("deployment %s failed: %s", dep_id, reason)
        self._transition(dep_id, "failed", reason)
        with self.served.store().session() as sess:
            st.repo.add_event(sess, self.served.model_id, "deploy_failed", reason, level="warning")

    def _module_in_memory(self, variant_id: int) -> Slot | None:
        """A warm module for this variant, if one was built recently (or is the base)."""
        served = self.served
        if variant_id == served.baseline_variant_id:
            return served.base_slot()
        return self._built.get(variant_id)

    def _remember(self, slot: Slot) -> None:
        """Keep the last few built variants warm, so going back and forth between them (a
        rollback, an operator's A/B) swaps in milliseconds instead of recompiling."""
        if slot.variant_id is None:
            return
        self._built[slot.variant_id] = slot
        self._built.move_to_end(slot.variant_id)
        while len(self._built) > KEEP_BUILT:
            self._built.popitem(last=False)

    def _finish_rollback(self, dep_id: int, target: Slot, current: Slot) -> None:
        served = self.served
        new = _replace(target, deployment_id=dep_id, control=None)
        served.swap(new)
        with served.store().session() as sess:
            if current.deployment_id is not None:
                cur = st.repo.get_deployment(sess, current.deployment_id)
                if cur.state == "active":
                    st.repo.transition(sess, cur.id, "rolled_back", "rolled back on request")
            st.repo.transition(
                sess,
                dep_id,
                "active",
                f"rolled back to {target.label}",
                previous_variant_id=current.variant_id,
            )
            st.repo.add_event(sess, served.model_id, "rollback", f"rolled back to {target.label}")

    def _build(self, recipe_data: dict[str, Any]) -> BuiltVariant:
        recipe = Recipe.from_dict(recipe_data)
        samples = self.served.reservoir.snapshot()
        if self._cache is None:
            self._cache = CompileCache(self.served.settings.compile_cache_path())
        return build(
            self.served.base,
            recipe,
            calibration=samples[:CALIBRATION_INPUTS],
            example=samples[0] if samples else None,
            cache=self._cache,
        )

    def _warm_examples(self) -> list[Any]:
        samples = self.served.reservoir.snapshot()
        if not samples:
            raise DeployFailed("no live inputs captured yet to warm up and verify with")
        by_shape: dict[str, Any] = {}
        for args, kwargs in samples:
            by_shape.setdefault(shape_key(args, kwargs), (args, kwargs))
        return list(by_shape.values())[:WARM_SHAPES]

    def _verify(self, module: torch.nn.Module, min_fidelity: float) -> float:
        """Fidelity of ``module`` against the base on live inputs; the base's outputs are
        computed once per reservoir version (they are the same for every candidate)."""
        served = self.served
        version = served.reservoir.version
        if self._refs is None or self._refs[0] != version:
            samples = served.reservoir.snapshot()[:VERIFY_INPUTS]
            with torch.inference_mode():
                refs = [served.base(*a, **k) for a, k in samples]
            self._refs = (version, samples, refs)
        _, samples, refs = self._refs
        metric = served.metric or "sqnr"
        with torch.inference_mode():
            outs = [module(*a, **k) for a, k in samples]
        score = fidelity(metric, refs, outs)
        if score < min_fidelity:
            raise DeployFailed(
                f"verification failed: {metric} fidelity {score:.4f} < required {min_fidelity:.4f}"
            )
        return score

    def _slot_for(self, built: BuiltVariant, variant_id: int, label: str, dep_id: int) -> Slot:
        return Slot(built.module, variant_id, label, built.hookable, dep_id)

    # ------------------------------------------------------------------ canary

    def _canary(
        self, slot: Slot, control: Slot, policy: Any
    ) -> tuple[bool, str, dict[str, float]]:
        """Serve live calls in alternating blocks by the candidate and the control, compare
        them on the same traffic at the same time; shadow-check the candidate's outputs against the
        fp32 base on a sample of live inputs. Returns (keep?, reason, live numbers)."""
        served = self.served
        served.live[control.variant_id].clear()
        served.live[slot.variant_id].clear()
        served.variant_failure.clear()
        served.request_shadow(policy.canary_shadow_samples)
        started = time.monotonic()
        deadline = started + policy.canary_s
        hard_deadline = started + 3 * policy.canary_s
        shadow_scores: list[float] = []
        metric = served.metric or "sqnr"
        while not self._stop.is_set():
            self._stop.wait(0.2)
            if served.variant_failure.is_set():
                served.variant_failure.clear()
                served.request_shadow(0)
                return False, f"canary failed live requests: {served.last_variant_error}", {}
            for _variant, (args, kwargs), out in served.take_shadow():
                with torch.inference_mode():
                    ref = served.base(*args, **kwargs)
                shadow_scores.append(fidelity(metric, [ref], [out]))
            now = time.monotonic()
            enough = min(len(served.live[slot.variant_id]), len(served.live[control.variant_id]))
            if now >= deadline and (enough >= MIN_CANARY_CALLS or now >= hard_deadline):
                break
        served.request_shadow(0)
        before = list(served.live[control.variant_id])
        after = list(served.live[slot.variant_id])
        live: dict[str, float] = {}
        notes = []
        if len(after) >= MIN_CANARY_CALLS and len(before) >= MIN_CANARY_CALLS:
            prev_p50, new_p50 = statistics.median(before), statistics.median(after)
            live["live_speedup"] = prev_p50 / new_p50 if new_p50 > 0 else 0.0
            if new_p50 > prev_p50 * (1 + policy.canary_latency_tolerance):
                return (
                    False,
                    f"live p50 {new_p50:.2f} ms vs {prev_p50:.2f} ms for the control: "
                    f"slower than the {policy.canary_latency_tolerance:.0%} tolerance",
                    live,
                )
            notes.append(
                f"live p50 {new_p50:.2f} ms vs {prev_p50:.2f} ms ({live['live_speedup']:.2f}x)"
            )
        else:
            notes.append(f"too little traffic to judge latency ({len(after)} calls)")
        if shadow_scores:
            live_fid = sum(shadow_scores) / len(shadow_scores)
            live["live_fidelity"] = live_fid
            floor = policy.min_fidelity - 0.5 * policy.max_accuracy_drop
            if live_fid < floor:
                return (
                    False,
                    f"shadow {metric} fidelity {live_fid:.4f} on {len(shadow_scores)} live "
                    f"inputs < {floor:.4f}",
                    live,
                )
            notes.append(f"shadow {metric} {live_fid:.4f} on {len(shadow_scores)} inputs")
        return True, "canary passed: " + "; ".join(notes), live


def _lower_priority() -> None:
    """Run this thread (and the compiler processes it starts) at a lower CPU priority than
    the serving threads: building, compiling and verifying must not take the cores from
    requests. Linux applies nice values per thread; elsewhere this does nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SWAPPER_NICE)
    except (AttributeError, OSError):
        log.debug("could not lower the swapper's priority", exc_info=True)


def _replace(slot: Slot, **changes: Any) -> Slot:
    return dataclasses.replace(slot, **changes)
