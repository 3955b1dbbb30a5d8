"""Calls a compiled variant could not serve: a package built for fixed shapes runs the original
model for any other shape (``compiler.AotiModule.shape_misses``), correct but as slow as fp32.
That is never an error, so without a word it would only show as a slower variant. The
swapper's thread looks at the serving variant's count each turn and says so in an event
(``shape_miss``, at most one a minute per variant) with the shapes that missed; the traffic's
new shapes then start a new search by themselves (:mod:`~pgc_daemon.optimizer.schedule`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import store as st
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.slot import Slot

#: seconds between two events about one variant
EVENT_EVERY_S = 60.0


@dataclass
class _Seen:
    variant_id: int
    module_id: int
    misses: int
    at: float


def slot_misses(slot: Slot) -> tuple[int | None, dict[str, int]]:
    """Calls the slot's module (and its profiling twin, which serves its sampled calls) ran
    on the original model, and those calls per shape; None for a module that never does."""
    total, shapes = None, {}
    for module in (slot.module, slot.twin):
        misses = getattr(module, "shape_misses", None)
        if misses is None:
            continue
        total = (total or 0) + misses
        for shape, n in getattr(module, "missed_shapes", {}).items():
            shapes[shape] = shapes.get(shape, 0) + n
    return total, shapes


class ShapeMissWatch:
    """Writes a ``shape_miss`` event when the serving slot's module ran the original model
    for shapes it was not built for since the last event (or since it started serving)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._seen: _Seen | None = None

    def check(self, slot: Slot, now: float | None = None) -> int:
        """Look at ``slot``; returns the misses reported now (0: none, or not yet due)."""
        module, vid, mid = slot.module, slot.variant_id, self._registry.model_id
        misses, missed_shapes = slot_misses(slot)
        if misses is None or vid is None or mid is None:
            return 0
        now = time.monotonic() if now is None else now
        seen = self._seen
        if seen is None or seen.module_id != id(module) or seen.variant_id != vid:
            # a variant that starts serving: count from here (its warm-up and verification
            # calls ran before it served)
            self._seen = _Seen(vid, id(module), misses, now - EVENT_EVERY_S)
            return 0
        new = misses - seen.misses
        if new <= 0 or now - seen.at < EVENT_EVERY_S:
            return 0
        shapes = dict(sorted(missed_shapes.items(), key=lambda kv: -kv[1]))
        named = "; ".join(f"{k} ({n})" for k, n in list(shapes.items())[:4])
        with self._registry.store().session() as s:
            st.repo.add_event(
                s, mid, "shape_miss",
                f"{new} calls ran the fp32 model: variant {vid} ({slot.label}) was not built for "
                f"their input shapes (calls per shape so far: {named}); a search on the new "
                "shapes follows",
                level="warning",
                data={"variant_id": vid, "calls": new, "total": misses, "shapes": shapes},
            )
        seen.misses, seen.at = misses, now
        return new
