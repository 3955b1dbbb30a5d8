"""A served model's face besides being called: start, flush, close, status, what the store
calls it, and what the swapper uses to change what serves (the
:class:`~pgc_daemon.agent.contract.Served` protocol). :class:`~pgc_daemon.agent.served.ServedModel`
inherits it; the request path is kept apart in ``served.py`` so that it can be read (and
reviewed) on its own."""

from __future__ import annotations

from typing import Any, Self

from torch import nn

from pgc_daemon.agent.executor import Executor
from pgc_daemon.agent.threadtune import ThreadTuner
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.slot import BASE_LABEL, Slot
from pgc_daemon.agent.shapewatch import slot_misses
from pgc_daemon.agent.swapper import Swapper
from profiler import Profiler


class Lifecycle:
    """Start and stop the background parts of a served model together: the inference thread
    (the :class:`~pgc_daemon.agent.executor.Executor`, when there is one), the profiler (whose
    exporter writes into the registry) and the swapper thread. Threading: call these from the
    thread that owns the served model (the server's start-up and shut-down), not from request
    threads; ``close`` serves the calls already handed to the inference thread (later ones run
    in their callers' threads), joins the threads and is idempotent."""

    registry: Registry
    base: nn.Module
    profiler: Profiler
    swapper: Swapper
    executor: Executor | None
    tuner: ThreadTuner
    calls: int
    fallbacks: int
    caller_errors: int
    retries: int
    _slot: Slot
    _failure: str | None
    _closed: bool = False

    @property
    def name(self) -> str:
        return self.registry.name

    @property
    def metric(self) -> str | None:
        """The fidelity metric (chosen from a live output when attach was given none)."""
        return self.registry.metric

    @property
    def model_id(self) -> int | None:
        """The model's id in the store; None until the swapper thread registered it."""
        return self.registry.model_id

    @property
    def baseline_variant_id(self) -> int | None:
        return self.registry.baseline_variant_id

    def start(self) -> Self:
        if self.executor is not None:
            self.executor.start()
        self.profiler.start()
        self.swapper.start()
        return self

    def flush(self) -> None:
        """Write the current statistics window and the reservoir now (tests, shutdown)."""
        self.profiler.flush()
        self.registry.save(pick_metric=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.executor is not None:
            self.executor.stop()
        self.swapper.stop()
        self.profiler.stop(flush=self.model_id is not None)
        if self.model_id is not None:
            self.registry.save()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        slot = self._slot
        return {
            "name": self.name,
            "serving": slot.label,
            "variant_id": slot.variant_id,
            "calls": self.calls,
            "fallbacks": self.fallbacks,
            # calls the serving variant ran on the original model: shapes it was not built for
            "shape_misses": slot_misses(slot)[0] or 0,
            "profile_twin": self.swapper.twins.state,
            "caller_errors": self.caller_errors,
            "retries": self.retries,
            "reservoir": len(self.registry.reservoir),
            "dropped_windows": self.profiler.dropped,
            "profiler": self.profiler.status(),
            "registered": self.model_id is not None,
            "executor": None if self.executor is None else self.executor.status(),
            "threads": self.tuner.status(),
        }

    # ------------------------------------------------------------------ for the swapper

    @property
    def slot(self) -> Slot:
        return self._slot

    def swap(self, new: Slot) -> Slot:
        """Make ``new`` the serving slot; returns the one it replaced. One reference write:
        calls already running keep the module they read. The profiler lets go of every module
        that no longer serves (a replaced variant, a rolled-back candidate, the control of a
        finished canary), so nothing of pgc keeps a replaced variant alive."""
        for slot in (new, new.control):
            if slot is not None and slot.per_layer:
                self.profiler.watch(slot.module, kernels=slot.kernels)
        old, self._slot = self._slot, new
        serving = [self.base, new.module]
        if new.control is not None:
            serving.append(new.control.module)
        self.profiler.retain(serving)
        return old

    def base_slot(self, deployment_id: int | None = None) -> Slot:
        return Slot(self.base, self.registry.baseline_variant_id, BASE_LABEL, True, deployment_id)

    def at_its_threads(self, slot: Slot) -> bool:
        return slot.own_pool or self.tuner.decided(slot.variant_id)

    def serving_threads(self, slot: Slot) -> int:
        return self.tuner.chosen(slot.variant_id) or self.tuner.configured

    def other_load(self) -> float | None:
        return self.tuner.load()

    def take_variant_failure(self) -> str | None:
        failure, self._failure = self._failure, None
        return failure
