"""Which module serves a call: ``Slot.pick``, on the request path."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pgc_daemon.agent.slot import Slot
from profiler import Profiler, ProfilerConfig


def test_a_twin_with_weights_of_its_own_also_serves_one_call_in_n_but_never_in_a_canary() -> None:
    module, twin = nn.Linear(4, 4), nn.Linear(4, 4)
    slot = Slot(module, 1, "v", hookable=False, twin=twin, twin_every=4)
    assert [slot.pick(None, n) is twin for n in range(12)] == [n % 4 == 0 for n in range(12)]
    assert slot.pick(None, None) is module  # a canary's control arm
    canary = dataclasses.replace(slot, control=Slot(nn.Linear(4, 4), 0, "c", hookable=False))
    assert all(canary.pick(None, n) is module for n in range(8))
    assert all(dataclasses.replace(slot, twin_every=0).pick(None, n) is module for n in range(8))
    assert all(dataclasses.replace(slot, twin=None).pick(None, n) is module for n in range(8))

    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None))
    try:
        prof.watch(base)
        token = prof.sample(base)
        assert token is not None
        try:  # a sampled call runs the twin, or, without one, what the profiler gives
            assert slot.pick(token, 1) is twin
            hooked = Slot(base, None, "fp32", hookable=True).pick(token, 0)
            assert hooked is token.module and hooked is not base
            x = torch.randn(1, 4)
            elapsed = 0
            with torch.inference_mode():
                hooked(x)
        finally:
            prof.end(token, None, (x,), {}, elapsed)
    finally:
        prof.stop(flush=False)
