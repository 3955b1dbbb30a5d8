"""What serves right now."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

BASE_LABEL = "fp32 · eager"
#: During a canary, calls go to the candidate and the control in alternating blocks of this
#: many; per-call alternation would make each call pay for the other's cold caches and
#: sleeping worker threads, which is not what either costs once it serves alone.
AB_BLOCK = 8


@dataclass(frozen=True)
class Slot:
    """A module and the variant it is (None before the agent registered with the store).

    ``hookable``: per-layer hooks see its layers (eager modules). ``kernels``: for a compiled
    module, which layers each of its kernels computes (sampled calls are then split over
    them, see ``profiler._compiled``). ``twin``: the module's profiling twin (the same variant
    built with kernel events, or an OpenVINO model compiled with its per-node counters:
    :mod:`~pgc_daemon.agent.twins`), which serves sampled calls in its place; ``kernels`` is
    then the twin's (``profiler.NodeKernels`` for OpenVINO's). ``twin_every``: the twin also
    serves one unsampled call in this many, which keeps a twin with weights of its own
    (OpenVINO's counting copy) warm, and its counters (means over every call it ran) mostly
    live calls': once in a hundred calls, its sampled calls read 1.20x live (MiniLM int8).
    ``control``: set while this slot is a canary; then
    calls alternate, in blocks, between it and the control (what served before), so both are
    measured side by side on the same live traffic. ``own_pool``: the module computes on a
    thread pool of its own (ONNX Runtime, OpenVINO), which torch's intra-op count does not
    reach (:mod:`~pgc_daemon.agent.threadtune` leaves it alone).
    """

    module: nn.Module
    variant_id: int | None
    label: str
    hookable: bool
    deployment_id: int | None = None
    control: Slot | None = None
    kernels: Any = None
    twin: nn.Module | None = None
    own_pool: bool = False
    twin_every: int = 0

    @property
    def per_layer(self) -> bool:
        """Whether a sampled call of this slot is timed per layer (hooks or kernels)."""
        return self.hookable or self.kernels is not None

    def pick(self, sampled: Any, n: int | None) -> Any:
        """What serves the ``n``-th call (None: a canary's control arm). A ``sampled`` call (the
        profiler's token) runs the twin, or the token's module; the twin also serves every
        ``twin_every``-th call outside a canary; the others, the module."""
        if sampled is not None:
            return self.twin or sampled.module
        if (self.twin_every and n is not None and n % self.twin_every == 0
                and self.control is None and self.twin is not None):
            return self.twin
        return self.module

    @property
    def canary(self) -> bool:
        return self.control is not None

    def arm(self, n: int) -> tuple[Slot, bool]:
        """Which slot serves the ``n``-th call while this one is a canary, and whether that
        call counts in the comparison: the first call of each block pays for the switch."""
        if self.control is None:
            return self, True
        return (self.control if (n // AB_BLOCK) % 2 else self), n % AB_BLOCK != 0
