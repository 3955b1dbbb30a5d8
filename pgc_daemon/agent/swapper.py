"""The swapper: the agent's background thread that owns the deployment state machine.

``candidate → building → warming → verifying → canary → active``, or ``failed`` /
``rolled_back``; a replaced active deployment becomes ``superseded``. Everyone else (the
search, the API) only *creates* candidates; this thread, in the serving process, is the only
one that moves them, because only it can swap the module. Every transition is written to the
store with its reason. While the store is unreachable the thread keeps retrying and the
current module keeps serving.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

import store as st
from pgc_daemon import states
from compiler import BuiltVariant, CompileCache, Recipe, build, fidelity, warm
from pgc_daemon.errors import DeployFailed, describe
from pgc_daemon.agent.livecompare import compare as compare_live
from pgc_daemon.agent.slot import Slot
from pgc_daemon.agent.yielding import YieldToRequests
from profiler import shape_key

if TYPE_CHECKING:
    from pgc_daemon.agent.served import ServedModel

log = logging.getLogger("pgc.swapper")
T = TypeVar("T")

VERIFY_INPUTS = 32
WARM_SHAPES = 8
CALIBRATION_INPUTS = 32
MIN_CANARY_CALLS = 20
KEEP_BUILT = 3
SWAPPER_NICE = 10
#: The verification set (live inputs and their fp32 outputs) is kept this long even while the
#: reservoir changes: recomputing fp32 on every deployment would take cores from requests.
REFS_MAX_AGE_S = 600.0
#: Python's thread switch interval while a deployment runs in this process. Compiling, the
#: store's ORM and the canary's statistics hold the GIL for long stretches; a serving thread
#: waits up to one interval for it after every torch op or compiled kernel (each releases it),
#: so at the default 5 ms an eager forward pass of a few hundred ops can take seconds while a
#: variant compiles, and a compiled one (its Python wrapper calls ~100 kernels) 2-3x longer
#: while the swapper records transitions. At 0.1 ms that wait is small.
SWITCH_INTERVAL_S = 1e-4


class Swapper:
    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pgc-swapper-{served.name}", daemon=True)
        self._built: collections.OrderedDict[int, Slot] = collections.OrderedDict()
        self._refs: tuple[int, float, list[Any], list[Any]] | None = None
        """(reservoir version, taken at, inputs, fp32 outputs) of the verification set."""
        self._scores: weakref.WeakKeyDictionary[torch.nn.Module, tuple[float, float]] = (
            weakref.WeakKeyDictionary()
        )
        """Fidelity of modules on the verification set taken at that time."""
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
                        # no per-layer hooks while variants compile, warm up, verify and
                        # canary: tracing must not see them, nor a compiled module guard on them
                        with served.profiler.paused(), _short_gil_turns():
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
                states.move(sess, slot.deployment_id, "rolled_back", reason)
            dep = st.repo.create_deployment(
                sess, served.model_id, served.baseline_variant_id, source="rollback", reason=reason
            )
            states.move(sess, dep.id, "active", "base module restored")
            st.repo.add_event(sess, served.model_id, "rollback", reason, level="warning")
        served.swap(served.base_slot(dep.id))

    # ------------------------------------------------------------------ one deployment

    def _transition(self, dep_id: int, state: str, reason: str, **fields: Any) -> None:
        with self.served.store().session() as sess:
            states.move(sess, dep_id, state, reason, **fields)

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
                built = in_short_thread(self._build, variant.recipe)
                self._transition(
                    dep_id,
                    "warming",
                    f"built in {built.report.build_s:.1f}s; warming up",
                    build_s=built.report.build_s,
                )
                examples = self._warm_examples()
                warm_s = in_short_thread(warm, built, examples)
                self._transition(
                    dep_id, "verifying", f"warmed in {warm_s:.1f}s; verifying fidelity", warm_s=warm_s
                )
                slot = self._slot_for(built, variant.id, variant.label, dep_id)
                self._remember(slot)
                if served.settings.gc_freeze:
                    _settle_heap()
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
            verified = in_short_thread(self._verify, slot.module, policy.min_fidelity)
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
                    states.move(sess, prev.id, end, f"replaced by {label}")
            states.move(
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
                    states.move(sess, cur.id, "rolled_back", "rolled back on request")
            states.move(
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
        """Fidelity of ``module`` against the base on live inputs. The verification set (the
        inputs and the base's outputs) is kept for a while (``REFS_MAX_AGE_S``); a module
        already scored on the same set (one kept warm, deployed again) is not run again: the
        same module on the same inputs gives the same outputs."""
        served = self.served
        now = time.monotonic()
        if self._refs is None or (
            self._refs[0] != served.reservoir.version and now - self._refs[1] > REFS_MAX_AGE_S
        ):
            samples = served.reservoir.snapshot()[:VERIFY_INPUTS]
            with torch.inference_mode(), self._background_reference():
                refs = [served.base(*a, **k) for a, k in samples]
            self._refs = (served.reservoir.version, now, samples, refs)
        _, taken_at, samples, refs = self._refs
        metric = served.metric or "sqnr"
        known = self._scores.get(module)
        if known is not None and known[0] == taken_at:
            score = known[1]
        else:
            with torch.inference_mode():
                outs = [module(*a, **k) for a, k in samples]
            score = fidelity(metric, refs, outs)
            self._scores[module] = (taken_at, score)
        if score < min_fidelity:
            raise DeployFailed(
                f"verification failed: {metric} fidelity {score:.4f} < required {min_fidelity:.4f}"
            )
        return score

    @contextlib.contextmanager
    def _background_reference(self) -> Iterator[None]:
        """For fp32 reference forwards of the eager base in a swapper thread: one intra-op
        thread (no second OpenMP team beside the serving threads'), and every op waits for a
        moment without requests (:class:`YieldToRequests`)."""
        with _one_thread(), YieldToRequests(self.served.serving_now):
            yield

    def _shadow_scores(self, shadow: list[Any], metric: str) -> list[float]:
        """Fidelity of live canary outputs against the fp32 base on the same inputs."""
        scores = []
        with torch.inference_mode(), self._background_reference():
            for _variant, (args, kwargs), out in shadow:
                scores.append(fidelity(metric, [self.served.base(*args, **kwargs)], [out]))
        return scores

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
            shadow = served.take_shadow()
            if shadow:
                shadow_scores.extend(in_short_thread(self._shadow_scores, shadow, metric))
            now = time.monotonic()
            if now >= hard_deadline:
                break
            if now >= deadline:
                after = list(served.live[slot.variant_id])
                before = list(served.live[control.variant_id])
                if min(len(after), len(before)) >= MIN_CANARY_CALLS and compare_live(
                    after, before
                ).certain(policy.canary_latency_tolerance):
                    break  # more calls would not change the verdict
        served.request_shadow(0)
        before = list(served.live[control.variant_id])
        after = list(served.live[slot.variant_id])
        live: dict[str, float] = {}
        notes = []
        if len(after) >= MIN_CANARY_CALLS and len(before) >= MIN_CANARY_CALLS:
            c = compare_live(after, before)
            live["live_speedup"] = c.speedup
            said = (
                f"live latency {c.candidate_ms:.2f} ms vs {c.control_ms:.2f} ms for the control "
                f"(trimmed means of {c.calls[0]} and {c.calls[1]} calls; ratio {c.ratio:.2f}, "
                f"95% CI {c.low:.2f}-{c.high:.2f})"
            )
            if c.too_slow(policy.canary_latency_tolerance):
                return (
                    False,
                    f"{said}: slower than the {policy.canary_latency_tolerance:.0%} tolerance",
                    live,
                )
            notes.append(said)
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


def in_short_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread that ends when it returns (and re-raise what it raised).

    A thread that has run parallel torch work keeps an OpenMP team; while it lives, libgomp
    counts more threads than cores and stops spin-waiting at its barriers, and every forward
    pass in the process slows down: measured on MiniLM with 2 cores, serving threads ran 2x
    slower (17 -> 28 ms fp32, 7 -> 16 ms int8) for as long as the thread that had built a
    variant lived, idle or not, and recovered the moment it ended. The swapper lives as long
    as the model is served, so its torch work runs in threads like this one (which inherit
    its lower priority)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            error.append(exc)

    worker = threading.Thread(target=run, name="pgc-swapper-work", daemon=True)
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return result[0]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch work in this thread without an OpenMP team: a second team beside the serving
    threads' makes every thread's barriers sleep instead of spin (more threads than cores).
    Only for eager modules: compiled code was generated for the serving thread count.
    ``torch.set_num_threads`` also sets the count that threads starting meanwhile take, so it
    is put back before the short-lived thread this runs in ends."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_turns_lock = threading.Lock()
_turns_depth = 0
_turns_before = 0.0


@contextlib.contextmanager
def _short_gil_turns() -> Iterator[None]:
    """While a deployment runs here, serving threads get the GIL back quickly. The interval is
    one per process, and the swappers of several served models may overlap: the first to
    enter sets it, the last to leave puts it back."""
    global _turns_depth, _turns_before
    with _turns_lock:
        if _turns_depth == 0:
            _turns_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_turns_before, SWITCH_INTERVAL_S))
        _turns_depth += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns_depth -= 1
            if _turns_depth == 0:
                sys.setswitchinterval(_turns_before)


_unfreeze_at_exit = False


def _settle_heap() -> None:
    """Collect what compiling left behind, then freeze what survives (``gc.freeze``).

    Compiling a variant leaves millions of long-lived Python objects (the FX graphs, guards and
    generated code it keeps), and every full collection afterwards scans them all with the GIL
    held: measured 100-540 ms stalls of every serving thread on MiniLM. Frozen objects are
    left out of collections. This is one long collection now, while deploying, instead of one
    on the request path every few seconds. Unfreezing first lets a variant dropped from the
    warm set (or anything else frozen last time) be collected."""
    global _unfreeze_at_exit
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:  # let the interpreter's last collections free frozen objects
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    log.debug("heap settled in %.0f ms; %d objects frozen", (time.perf_counter() - started) * 1e3,
              gc.get_freeze_count())


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
