"""Automatic rollback: a variant that is slower on live traffic, or inaccurate on it, is
reverted by the canary without a failed request."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch

import store as st
from pgc_daemon import states
from compiler import Quantization, Recipe
from pgc_daemon import attach
from pgc_daemon.policy import Policy
from pgc_daemon.settings import Settings
from pgc_daemon.states import D
from pgc_daemon.agent import canary
from pgc_daemon.agent.slot import Slot

from .helpers import Load, deployment_state, wait_for

pytestmark = pytest.mark.serial  # it tells a variant a little slower live from one as fast


SPEC = "pgc_daemon.examples.digits:mlp"


def _attach(spec: dict[str, Any], settings: Settings, **policy: Any) -> Any:
    served = attach(spec["model"], name="mlp", spec=SPEC, settings=settings,
                    policy={"canary_s": 2.0, "canary_shadow_samples": 8, **policy})
    wait_for(lambda: served.model_id is not None, what="registration")
    return served


class Slowed(torch.nn.Module):
    """A deliberately slowed variant: the model's own answer, after waiting as long again."""

    def __init__(self, inner: torch.nn.Module, extra_ms: float) -> None:
        super().__init__()
        self.inner = inner
        self.extra_ms = extra_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.extra_ms / 1e3)
        return self.inner(x)


def _candidate(store: st.Store, source: str = "manual") -> int:
    """A deployment that got as far as verification, written in one transaction so the
    agent's swapper never sees it as a candidate (the test plays the build step)."""
    recipe = Recipe(quantization=Quantization.of({"_default": "bf16"}))
    with store.session() as s:
        m = st.repo.get_model(s, "mlp")
        v = st.repo.get_or_create_variant(s, m.id, recipe.hash, recipe.to_dict(), "slowed")
        dep = st.repo.create_deployment(s, m.id, v.id, source=source, reason="test").id
        for state in (D.BUILDING, D.WARMING, D.VERIFYING):
            states.move(s, dep, state, "built by the test")
    return dep


def test_a_variant_slower_on_live_traffic_is_rolled_back(mlp_spec: dict, settings: Settings, store: st.Store) -> None:
    served = _attach(mlp_spec, settings)
    inputs = [a[0] for a in mlp_spec["example_inputs"]]
    try:
        with Load(served, mlp_spec["model"], inputs, threads=2) as load:
            wait_for(lambda: load.calls > 30, what="traffic")
            dep = _candidate(store)
            slowed = Slowed(copy.deepcopy(mlp_spec["model"]), extra_ms=5.0)
            ok = served.swapper.release(dep, Slot(slowed, None, "slowed", True, dep), served.registry.current_policy())
            before = load.calls
            wait_for(lambda: load.calls > before + 20, what="traffic after the rollback")
        assert not ok
        assert deployment_state(store, dep) == "rolled_back"
        assert load.errors == [] and load.wrong == 0
        assert served.slot.module is served.base
        with store.session() as s:
            d = st.repo.get_deployment(s, dep)
            assert "live latency" in d.reason and "slower" in d.reason
            assert d.live_speedup is not None and d.live_speedup < 1 / 1.15
            assert [t.to_state for t in d.transitions][-2:] == ["canary", "rolled_back"]
            events = st.repo.list_events(s, served.model_id, kind="rollback")
            assert events and events[0].level == "warning"
            assert st.repo.active_deployment(s, served.model_id).source == "attach"
    finally:
        served.close()


def test_a_variant_inaccurate_on_live_inputs_fails_the_shadow_check(mlp_spec: dict, settings: Settings) -> None:
    served = _attach(mlp_spec, settings, max_accuracy_drop=0.01)
    inputs = [a[0] for a in mlp_spec["example_inputs"]]
    broken = copy.deepcopy(mlp_spec["model"])
    with torch.no_grad():  # deliberately inaccurate: the last layer's weights scrambled
        w = broken.net[5].weight
        w.copy_(w[torch.randperm(w.shape[0])])
    try:
        with Load(served, mlp_spec["model"], inputs, threads=2) as load:
            wait_for(lambda: load.calls > 20, what="traffic")
            wait_for(lambda: served.registry.metric == "top1", what="the metric chosen from live outputs")
            control = served.slot
            candidate = Slot(broken, 999, "scrambled", True, None)
            served.swap(Slot(broken, 999, "scrambled", True, None, control=control))
            # (latency is not what this checks: each arm serves at the thread count measured
            # for it, and a 1 ms MLP's two arms can differ by the 15% tolerance on that alone)
            policy = Policy(canary_s=1.0, canary_shadow_samples=8, canary_latency_tolerance=10.0)
            ok, reason, live, _end = canary.run(served, candidate, control, policy, threading.Event())
            served.swap(control)
        assert not ok
        assert "shadow top1 fidelity" in reason
        assert live["live_fidelity"] < 0.5
        # every request during the canary was answered; the wrong ones came from the
        # scrambled variant and are exactly what the canary is there to catch
        assert load.errors == []
    finally:
        served.close()


@pytest.mark.parametrize(("source", "kept"), [("search", False), ("manual", True)])
def test_a_search_deployment_a_little_slower_live_than_what_serves_is_rolled_back(
    source: str, kept: bool, mlp_spec: dict, settings: Settings, store: st.Store
) -> None:
    """Seen in the demo: the search's second deployment ran 11% slower live than the variant
    it replaced (95% interval 8-15%) and passed the canary's 15% tolerance. A deployment the
    search makes to be faster must not be slower; a manual one keeps the tolerance. The base
    serves in 20 ms here and the candidate in 22 ms (10% slower: within the tolerance)."""
    base = Slowed(copy.deepcopy(mlp_spec["model"]), extra_ms=20.0)
    served = attach(base, name="mlp", spec=SPEC, settings=settings,
                    policy={"canary_s": 2.0, "canary_shadow_samples": 8})
    inputs = [a[0] for a in mlp_spec["example_inputs"]]
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        with Load(served, mlp_spec["model"], inputs, threads=2) as load:
            wait_for(lambda: load.calls > 20, what="traffic")
            dep = _candidate(store, source)
            slower = Slowed(copy.deepcopy(mlp_spec["model"]), extra_ms=22.0)
            ok = served.swapper.release(dep, Slot(slower, None, "slower", True, dep),
                                        served.registry.current_policy(), source)
        assert ok is kept
        assert deployment_state(store, dep) == ("active" if kept else "rolled_back")
        assert load.errors == [] and load.wrong == 0
        with store.session() as s:
            d = st.repo.get_deployment(s, dep)
            assert 1 / 1.15 < d.live_speedup < 1.0, d.reason
            if not kept:
                assert "a deployment made to be faster must not be" in d.reason
    finally:
        served.close()
