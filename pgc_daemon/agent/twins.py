"""Per-layer rows of the compiled variant that serves: its profiling twin.

Hooks cannot see inside a compiled variant; kernel events can, at a cost to every call of a
package that carries them (``compiler._kernel_map``). So the serving package has none, and a
worker builds its *twin* (the same recipe with kernel events, recorded on the variant as
``profile_artifact``: :mod:`pgc_daemon.optimizer.search.twin`). The swapper's thread looks
each turn (the store at most every :data:`POLL_S`) for the twin of the variant that serves,
loads it (never compiles it), warms it, checks that it computes what the variant computes,
and puts it on the slot, wrapped in a :class:`GuardedTwin`: sampled calls then run the twin
under the profiler and are split over the layers its kernels compute; every other call runs
the variant as before. Once on the slot, the twin and the variant are timed against each
other on a live input (``Profiler.calibrate``): what a sampled call costs over a live one
(recording its events, and the twin's own kernel events: MiniLM's ran 9% slower than its
variant) is taken out of its rows and charged to the budget. That is measured as calls are
served (the variant's thread count; the priority of the thread that attached, through a
``runtime.Launcher``, not the swapper's lower one), and again once other processes leave
this one more of the machine than they did then (a deployment lands while its search worker
still runs). An OpenVINO variant has no kernel events: its twin is the
same model compiled again with OpenVINO's per-node counters, made here (loading any OpenVINO
model compiles it), its nodes mapped to the base module's layers (``compiler._openvino_layers``).
A call the twin fails is served
by the variant; the twin is then taken off and not loaded again for that variant. A loaded twin
is kept while its variant is (serving, its canary's control, or kept warm by
:class:`~pgc_daemon.agent.variants.Variants`), so a rollback puts it back at once; after that it
is let go, with the variant's weights it reads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

import store as st
from compiler import compare, share_weights
from pgc_daemon.agent.contract import Served
from pgc_daemon.agent.ompthreads import set_thread_count
from pgc_daemon.agent.runtime import Launcher, in_short_thread, thread_nice
from pgc_daemon.agent.slot import Slot
from pgc_daemon.agent.variants import Variants
from pgc_daemon.errors import describe

log = logging.getLogger("pgc.swapper")

#: seconds between two looks in the store for the serving variant's twin
POLL_S = 5.0
#: the least cosine between the twin's outputs and the variant's on the same live inputs
#: (the same graph, the same kernels: only the events differ)
MIN_COSINE = 0.9999
#: a twin calibrated while other processes kept this many more cores busy than now is
#: calibrated again, at most every RECALIBRATE_S seconds
RECALIBRATE_LOAD_DROP = 0.5
RECALIBRATE_S = 60.0
#: what an OpenVINO variant's twin is recorded as (it has no artifact of its own)
OPENVINO_TWIN = "openvino-counters"
#: an OpenVINO counting copy also serves one unsampled call in this many (``Slot.twin_every``):
#: with weights of its own, it ran a call after 100 of the variant's 1.21x slower than the
#: variant (MiniLM int8, 1 thread; ResNet-18 1.31x), after 8 as fast (1.02x, 1.01x); and
#: OpenVINO's counters are means over every call it ran. The counters cost +0.36% a call
#: (interval -0.18% to +0.86%; 19 us on MiniLM), an eighth of that spread over all calls
OPENVINO_TWIN_EVERY = 8


class GuardedTwin:
    """A profiling twin as the request path calls it: a call the twin fails is served by the
    variant instead (and counted), never raised. Its shape misses are the twin's."""

    def __init__(self, twin: torch.nn.Module, variant: torch.nn.Module) -> None:
        self.twin, self.variant, self.failures = twin, variant, 0

    def __call__(self, *args: object, **kwargs: object) -> object:
        try:
            return self.twin(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the variant serves the call
            self.failures += 1
            return self.variant(*args, **kwargs)

    @property
    def shape_misses(self) -> int | None:
        return getattr(self.twin, "shape_misses", None)

    @property
    def missed_shapes(self) -> dict[str, int]:
        return getattr(self.twin, "missed_shapes", {})


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A twin loaded for a variant: kept while the variant is."""

    module: torch.nn.Module
    kernels: object
    weights: str  # which weights it reads from the variant
    digest: str  # its artifact
    every: int = 0  # it also serves one unsampled call in this many (``Slot.twin_every``)


class TwinWatch:
    """Gives the serving compiled variant its profiling twin once a worker built one."""

    def __init__(self, served: Served, variants: Variants,
                 load: Callable[[], float | None] | None = None) -> None:
        self._served = served
        self._variants = variants
        #: cores busy outside this process now (None: not known): the thread tuner's reading
        self.load = load if load is not None else served.other_load
        #: made here, in the thread that attaches: the calibration runs at its priority
        self.launcher = Launcher(f"pgc-launcher-{served.registry.name}")
        #: variant -> (when, other processes' load) of its twin's last calibration
        self._calibrated: dict[int, tuple[float, float | None]] = {}
        self._next_at = 0.0
        self._tried: set[tuple[int, str]] = set()  # (variant, twin digest) loaded or refused
        self._loaded: dict[int, _Kept] = {}
        #: what the last look found, for the agent's status
        self.state = "none"
        #: which weights the twin last put on the slot reads from its variant
        self.weights = "none"

    def check(self, now: float | None = None) -> bool:
        """Look at the serving slot; returns whether a twin was put on it now."""
        self.load()  # every turn: a smoothed load needs readings before the calibration's
        served = self._served
        slot = served.slot
        if any(getattr(s.twin, "failures", 0) for s in (slot, slot.control) if s is not None):
            self._drop(slot)
            return False
        self._let_go(slot)
        if slot.control is not None or slot.hookable or slot.variant_id is None:
            return False
        now = time.monotonic() if now is None else now
        if slot.twin is not None:
            self._recalibrate_if_quieter(slot, now)
            return False
        if slot.kernels is not None:
            return False  # a package that carries kernel events itself
        kept = self._loaded.get(slot.variant_id)
        if kept is not None:  # the slot came back without it (a rollback, the demo's A/B)
            return self._put(slot, kept)
        if now < self._next_at:
            return False
        self._next_at = now + POLL_S
        if callable(getattr(slot.module, "with_counters", None)):
            return self._count_nodes(slot)
        with served.registry.store().session() as s:
            variant = st.repo.get_variant(s, slot.variant_id)
            recipe, digest = variant.recipe, variant.profile_artifact
        if digest is None or (slot.variant_id, digest) in self._tried:
            return False
        self._tried.add((slot.variant_id, digest))
        try:
            twin = in_short_thread(self._variants.load_twin, recipe, digest)
            if twin.kernel_layers is None:
                raise ValueError("the twin's kernels are not mapped to layers")
            weights = self._share_weights(twin.module, slot.module)
            in_short_thread(self._check_outputs, slot.module, twin.module)
        except Exception as exc:  # noqa: BLE001 - the variant serves all the same
            self.state = f"not loaded: {describe(exc)}"
            log.warning("profiling twin of %s not used: %s", slot.label, describe(exc))
            return False
        kept = self._loaded[slot.variant_id] = _Kept(twin.module, twin.kernel_layers, weights,
                                                     digest)
        return self._put(slot, kept)

    def _count_nodes(self, slot: Slot) -> bool:
        """An OpenVINO variant's twin: the same compiled model again with OpenVINO's per-node
        counters (no worker builds it: loading an OpenVINO model compiles it for this CPU
        anyway), its nodes mapped to the base module's layers on a live input."""
        from compiler._openvino_layers import node_layers  # noqa: PLC0415
        from profiler import NodeKernels  # noqa: PLC0415

        key = (slot.variant_id or 0, OPENVINO_TWIN)
        if key in self._tried:
            return False
        self._tried.add(key)
        try:
            twin = in_short_thread(slot.module.with_counters)
            example = self._variants.warm_examples()[0]
            layers = in_short_thread(node_layers, twin.compiled, self._served.base, example,
                                     twin.model)
            in_short_thread(self._check_outputs, slot.module, twin)
            # its first calls allocated: not what its nodes take (read in a thread that ends,
            # as the check's: an infer request per thread holds its own buffers)
            in_short_thread(twin.count_from_here)
        except Exception as exc:  # noqa: BLE001 - the variant serves all the same
            self.state = f"not loaded: {describe(exc)}"
            log.warning("profiling twin of %s not used: %s", slot.label, describe(exc))
            return False
        kept = self._loaded[key[0]] = _Kept(
            twin, NodeKernels(layers, twin.node_times), "its own weights (OpenVINO's counting "
            f"copy, which serves 1 call in {OPENVINO_TWIN_EVERY})", OPENVINO_TWIN,
            OPENVINO_TWIN_EVERY)
        return self._put(slot, kept)

    def _let_go(self, slot: Slot) -> None:
        """Twins of variants neither on the slot nor kept warm any more are let go (a package,
        and the variant's weights it reads, each); if such a variant serves again, its twin is
        loaded again."""
        on_slot = {s.variant_id for s in (slot, slot.control) if s is not None}
        for variant_id in [v for v in self._loaded if v not in on_slot
                           and self._variants.in_memory(v) is None]:
            self._tried.discard((variant_id, self._loaded.pop(variant_id).digest))

    def _share_weights(self, twin: torch.nn.Module, module: torch.nn.Module) -> str:
        """The twin reads the variant's weights where they are equal (``compiler.share_weights``:
        its own copies, read once in hundreds of calls, ran its sampled calls from memory);
        a failure leaves it its own, which compute the same."""
        try:
            return in_short_thread(share_weights, twin, module).describe()
        except Exception as exc:  # noqa: BLE001 - the twin keeps its own weights
            log.warning("profiling twin keeps its own weights: %s", describe(exc))
            return f"weights not shared: {describe(exc)}"

    def _check_outputs(self, module: torch.nn.Module, twin: torch.nn.Module) -> None:
        """Warm the twin on live inputs (one per shape) and check it computes what the
        variant computes on them."""
        with torch.inference_mode():
            for args, kwargs in self._variants.warm_examples():
                got, want = twin(*args, **kwargs), module(*args, **kwargs)
                cosine = compare(want, got)["cosine"]
                if not cosine >= MIN_COSINE:
                    raise ValueError(f"its outputs differ from the variant's (cosine {cosine:.6f})")

    def _put(self, slot: Slot, kept: _Kept) -> bool:
        served = self._served
        if served.slot is not slot:
            return False
        self.weights = kept.weights  # a twin kept for a rollback: its own, not the last loaded's
        new = dataclasses.replace(slot, twin=GuardedTwin(kept.module, slot.module),
                                  kernels=kept.kernels, twin_every=kept.every)
        served.swap(new)
        self.state = f"loaded for variant {slot.variant_id} (calibrating; {kept.weights})"
        self._calibrate(new, "loaded")
        log.info("profiling twin of %s loaded (%s): sampled calls are split over its layers",
                 slot.label, self.weights)
        return True

    def _calibrate(self, slot: Slot, what: str) -> None:
        """What a sampled call of ``slot`` (its twin under the profiler) costs over a live
        one, measured as its calls are served: rows take it out, the budget counts it."""
        served, variant_id = self._served, slot.variant_id or 0
        load = self.load()
        try:
            args, kwargs = self._variants.warm_examples()[0]
            twin = slot.twin.twin if isinstance(slot.twin, GuardedTwin) else slot.twin

            def run(module: torch.nn.Module) -> None:
                with torch.inference_mode():
                    module(*args, **kwargs)

            threads = served.serving_threads(slot)

            def measure() -> tuple[int | None, int, int | None]:
                set_thread_count(threads)
                cost = served.profiler.calibrate(slot.module, lambda: run(twin),
                                                 lambda: run(slot.module))
                return cost, torch.get_num_threads(), thread_nice()

            cost, threads, nice = self.launcher.run(measure)
            busy = "" if load is None else f", {load:.1f} cores busy elsewhere"
            detail = ("not calibrated: the variant is not watched" if cost is None
                      else f"a sampled call costs {cost / 1e6:.2f} ms over a live one "
                           f"(measured at {threads} thread{'s' if threads > 1 else ''}{busy})")
        except Exception as exc:  # noqa: BLE001 - the generic per-event cost stands
            detail, threads, nice = f"not calibrated: {describe(exc)}", None, None
            log.warning("profiling twin of %s %s", slot.label, detail)
        self._calibrated[variant_id] = (time.monotonic(), load)
        if what == "loaded":
            detail = f"{detail}; {self.weights}"
        self.state = f"{what} for variant {slot.variant_id} ({detail})"
        served.profiler.event("profiler", "info", f"profiling twin of {slot.label} {what}: "
                              f"{detail}", {"variant_id": slot.variant_id, "load_cores": load,
                                            "threads": threads, "nice": nice})

    def _recalibrate_if_quieter(self, slot: Slot, now: float) -> None:
        """Calibrate the serving twin again once other processes load the machine less than
        they did at its last calibration (by RECALIBRATE_LOAD_DROP cores)."""
        last = self._calibrated.get(slot.variant_id or 0)
        if last is None or now - last[0] < RECALIBRATE_S or last[1] is None:
            return
        load = self.load()
        if load is not None and last[1] - load >= RECALIBRATE_LOAD_DROP:
            self._calibrate(slot, "calibrated again")

    def stop(self) -> None:
        self.launcher.stop()

    def _drop(self, slot: Slot) -> None:
        """A twin failed a call: the serving slot's (or its canary control's) is taken off,
        and not loaded again for that variant."""
        control = slot.control
        if getattr(slot.twin, "failures", 0):
            new = dataclasses.replace(slot, twin=None, kernels=None)
        elif control is not None and control.twin is not None:
            plain = dataclasses.replace(control, twin=None, kernels=None)
            new = dataclasses.replace(slot, control=plain)
        else:
            return
        failed = slot if getattr(slot.twin, "failures", 0) else control
        assert failed is not None
        self._loaded.pop(failed.variant_id or 0, None)
        self.state = "dropped: it failed a call (served by the variant)"
        if self._served.slot is slot:
            self._served.swap(new)
        log.warning("profiling twin of %s failed a call; taken off", failed.label)
