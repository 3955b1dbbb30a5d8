"""The agent's memory stays bounded inside someone's server: a replaced variant is not kept
alive by the profiler, and the input reservoir is bounded in bytes as well as in count."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import torch

from pgc_daemon import attach
from pgc_daemon.agent.slot import Slot
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings

from .helpers import wait_for


def _promote(served: Any, module: torch.nn.Module, variant_id: int) -> None:
    """What the swapper does for one deployment: the candidate on canary beside what serves,
    then the candidate alone."""
    candidate = Slot(module, variant_id, f"variant {variant_id}", True, variant_id)
    served.swap(Slot(module, variant_id, candidate.label, True, variant_id, control=served.slot))
    served.swap(candidate)


def test_replaced_variants_are_collected(mlp_spec: dict, settings: Settings) -> None:
    served = attach(mlp_spec["model"], name="mlp", settings=settings)
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        refs = []
        for i in range(5):
            variant = copy.deepcopy(mlp_spec["model"])
            refs.append(weakref.ref(variant))
            _promote(served, variant, 100 + i)
            served(mlp_spec["example_inputs"][0][0])
            del variant
        # a rolled-back candidate is let go of as well
        rejected = copy.deepcopy(mlp_spec["model"])
        rejected_ref = weakref.ref(rejected)
        current = served.slot
        served.swap(Slot(rejected, 200, "rejected", True, 200, control=current))
        served.swap(current)
        del rejected, current
        # The agent's follower may put back what the store says serves (the base: these
        # variants are not in the store) at any moment (seen in CI); then nothing of them
        # may stay alive. Which one serves is read around the check, as an id (no reference).
        # A sampled call holds its model's layer timer until the profiler's background turn
        # has made rows of it (within ``control_s``): let it, as it would within a second.
        served.profiler.flush()
        before = served.slot.variant_id
        gc.collect()
        alive = [i for i, r in enumerate(refs) if r() is not None]
        after = served.slot.variant_id
        serving = [[i for i in range(5) if 100 + i == v] for v in (before, after)]
        assert alive in serving, f"variants still referenced: {alive}"
        assert rejected_ref() is None
        # the base, and the variant serving now if it is not the base
        assert served.profiler.watched in {1 + bool(v) for v in serving}
    finally:
        served.close()


def test_the_reservoir_is_bounded_in_bytes() -> None:
    batch = 64 * 1024  # bytes of one input
    r = InputReservoir(capacity=128, max_bytes=1024 * 1024, seed=0)
    x = torch.zeros(batch // 4)  # float32
    for i in range(2000):
        x.fill_(i)
        r.offer((x,), {})
        assert r.nbytes <= r.max_bytes
    assert len(r) == 16 and r.nbytes == 16 * batch  # 1 MiB of 64 KiB inputs
    values = sorted(int(a[0][0]) for a, _ in r.snapshot())
    assert len(set(values)) == 16 and max(values) > 100  # a sample, and later traffic got in
    # an input larger than the whole bound is not kept, and counted when it was to be taken
    huge = torch.zeros(2 * 1024 * 1024 // 4)
    while r.too_large == 0:
        r.offer((huge,), {})
        assert len(r) == 16 and r.nbytes == 16 * batch
    # larger inputs later: replacing evicts others until within the bound again
    big = torch.ones(256 * 1024 // 4)
    for _ in range(500):
        r.offer((big,), {})
        assert r.nbytes <= r.max_bytes
    assert len(r) >= 4
    # what a restarted agent loads back is bounded too
    again = InputReservoir(capacity=128, max_bytes=300 * 1024)
    again.load(r.snapshot(), seen=r.seen)
    assert again.nbytes <= 300 * 1024 and len(again) >= 1


def test_an_input_too_large_to_keep_takes_nothing_with_it() -> None:
    """A call drawn to be taken whose input is too large leaves the odds of the calls after
    it as they were (it once made the next call certain to be taken), and a reservoir that
    has only seen such inputs takes the first one that fits."""
    r = InputReservoir(capacity=4, max_bytes=1024, seed=0)
    huge, small = torch.zeros(1024), torch.zeros(4)
    for _ in range(3):
        r.offer((huge,), {})
    assert r.too_large == 3 and len(r) == 0
    r.offer((small,), {})
    assert len(r) == 1
    for _ in range(10_000):
        r.offer((small,), {})
    taken_after = 0
    for _ in range(20):
        too_large = r.too_large
        while r.too_large == too_large:
            r.offer((huge,), {})
        version = r.version
        r.offer((small,), {})
        taken_after += r.version != version
    assert taken_after <= 2  # odds about 4 / 10 000 each


def test_attach_bounds_the_reservoir_by_the_default_byte_bound(mlp_spec: dict, settings: Settings) -> None:
    from pgc_daemon.reservoir import MAX_BYTES

    served = attach(mlp_spec["model"], name="mlp", settings=settings)
    try:
        assert served.reservoir.max_bytes == MAX_BYTES == 64 * 1024 * 1024
        assert served.reservoir.capacity == settings.reservoir_size
    finally:
        served.close()
