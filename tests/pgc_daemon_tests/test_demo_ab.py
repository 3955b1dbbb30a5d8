"""The demo's live speedup is measured at one time: fp32 beside the deployed variant on live
traffic, in the canary's alternating blocks, and then the variant serves alone again."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from pgc_daemon import attach
from pgc_daemon.agent.slot import Slot
from pgc_daemon.cli._demo_traffic import live_ab
from pgc_daemon.settings import Settings

from .helpers import wait_for

pytestmark = pytest.mark.serial  # it times fp32 beside what serves


class Slower(torch.nn.Module):
    """The base module and 20 ms more per call: a variant whose live ratio is known. (The
    digits MLP takes 3.3 ms a call on a 2-core AVX2-only VM, so 3 ms more was not enough to
    be twice as slow there.)"""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.inner(x)


def _deploy(served: Any, module: torch.nn.Module) -> Slot:
    """Serve ``module`` as an active deployment of its own variant in the store (the agent's
    follower then leaves it serving)."""
    import store as st
    from compiler import Recipe
    from pgc_daemon import states
    from pgc_daemon.states import D

    store = served.registry.store()
    with store.session() as s:
        v = st.repo.get_or_create_variant(s, served.model_id, "f" * 64, Recipe().to_dict(), "slower")
        dep = st.repo.create_deployment(s, served.model_id, v.id, source="manual", reason="test")
        slot = Slot(module, v.id, "slower", True, dep.id)
        served.swap(slot)
        for step in (D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY):
            states.move(s, dep.id, step, str(step))
        previous = st.repo.active_deployment(s, served.model_id)
        states.move(s, previous.id, D.SUPERSEDED, "replaced")
        states.move(s, dep.id, D.ACTIVE, "test", previous_variant_id=previous.variant_id)
    return slot


def test_live_ab_times_fp32_beside_what_serves_and_gives_the_slot_back(mlp_spec: dict[str, Any], settings: Settings) -> None:
    served = attach(mlp_spec["model"], name="mlp", settings=settings)
    stop = threading.Event()
    x = mlp_spec["example_inputs"][0][0]

    def client() -> None:
        while not stop.is_set():
            served(x)
            time.sleep(0.001)

    thread = threading.Thread(target=client, daemon=True)
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        assert live_ab(served, seconds=0.2) is None  # fp32 serves: nothing to compare
        variant = _deploy(served, Slower(mlp_spec["model"]))
        thread.start()
        ab = live_ab(served, seconds=3.0)
        assert ab is not None
        assert served.slot is variant  # serving alone again, not on the A/B slot
        assert min(ab.calls) >= 20
        # 20 ms slower than fp32 (a few ms at most): slower, with confidence
        assert ab.speedup < 0.5 and ab.low > 1.0
        # nothing compared when too few calls come in
        stop.set()
        thread.join(timeout=5)
        assert live_ab(served, seconds=0.1) is None
        assert served.slot is variant
    finally:
        stop.set()
        served.close()
