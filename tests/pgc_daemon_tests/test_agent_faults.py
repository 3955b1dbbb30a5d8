"""What pgc promises inside someone's server when something goes wrong around a deployment:
a malformed request is the caller's error and blames no variant; a canary promotes only on
evidence and never at shutdown; a deployment a store error, a cancel or a bug interrupts
leaves the previous module serving and is settled; the swapper's heartbeat keeps in-flight
deployments fresh. Real models (digits MLP), a real SQLite store, real threads."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch

import store as st
from compiler import Quantization, Recipe
from pgc_daemon import attach, states
from pgc_daemon.agent import canary
from pgc_daemon.agent.slot import BASE_LABEL, Slot
from pgc_daemon.policy import Policy
from pgc_daemon.services import deployments as services
from pgc_daemon.settings import Settings
from pgc_daemon.states import D
from profiler import ProfilerConfig

from .helpers import Load, deploy, deployment_state, wait_for

SPEC = "pgc_daemon.examples.digits:mlp"
INT8 = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}))
CALM = {"canary_latency_tolerance": 10.0, "canary_shadow_samples": 4}


def _attach(spec: dict[str, Any], settings: Settings, **policy: Any) -> Any:
    served = attach(spec["model"], name="mlp", spec=SPEC, settings=settings,
                    policy={"canary_s": 0.5, **CALM, **policy})
    wait_for(lambda: served.model_id is not None, what="registration")
    return served


def _inputs(spec: dict[str, Any]) -> list[torch.Tensor]:
    return [args[0] for args in spec["example_inputs"][:8]]


def _deployment(store: st.Store, dep_id: int) -> Any:
    with store.session() as s:
        return st.repo.get_deployment(s, dep_id)


# ---------------------------------------------------------------- 1. malformed requests


def test_a_malformed_request_gets_its_own_error_and_blames_no_variant(
    mlp_spec: dict, settings: Settings, store: st.Store
) -> None:
    served = _attach(mlp_spec, settings)
    healthy = copy.deepcopy(mlp_spec["model"])
    try:
        served.swap(Slot(healthy, 999, "healthy variant", True, None))
        bad = torch.zeros(2, 3)
        with pytest.raises(RuntimeError) as direct:
            mlp_spec["model"](bad)
        with pytest.raises(RuntimeError) as caller:
            served(bad)
        assert type(caller.value) is type(direct.value)
        assert str(caller.value) == str(direct.value)  # the base's error, unchanged
        assert served.fallbacks == 0 and served.caller_errors == 1
        status = served.status()
        assert status["caller_errors"] == 1 and status["fallbacks"] == 0
        time.sleep(5 * settings.poll_s)  # several swapper iterations
        assert served.slot.module is healthy and served.slot.label == "healthy variant"
        assert served(_inputs(mlp_spec)[0]).shape == (64, 10)
        with store.session() as s:
            assert st.repo.list_events(s, served.model_id, kind="rollback") == []
    finally:
        served.close()


def test_malformed_requests_during_a_canary_do_not_fail_it(mlp_spec: dict, settings: Settings) -> None:
    served = _attach(mlp_spec, settings)
    healthy = copy.deepcopy(mlp_spec["model"])
    errors: list[BaseException] = []
    stop = threading.Event()

    def malformed() -> None:
        while not stop.is_set():
            try:
                served(torch.zeros(2, 3))
            except RuntimeError as exc:
                errors.append(exc)
            time.sleep(0.01)

    try:
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2) as load:
            wait_for(lambda: load.calls > 20, what="traffic")
            control = served.slot
            candidate = Slot(healthy, 998, "healthy variant", True, None)
            served.swap(Slot(healthy, 998, "healthy variant", True, None, control=control))
            bad = threading.Thread(target=malformed)
            bad.start()
            try:
                result = canary.run(served, candidate, control, Policy(canary_s=1.0, **CALM),
                                    threading.Event())
            finally:
                stop.set()
                bad.join(5)
                served.swap(control)
        assert result.keep, result.reason
        assert errors and served.caller_errors == len(errors)
        assert served.fallbacks == 0 and load.errors == []
    finally:
        served.close()


class _Interruptible(torch.nn.Module):
    """The user's model, with a switch that interrupts it mid-call (Ctrl-C in a notebook
    lands in whatever runs; a green thread's timeout is a ``BaseException`` too)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.interrupt = inner, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.interrupt:
            raise KeyboardInterrupt
        return y


def test_an_interrupt_inside_a_sampled_call_leaves_sampling_free(
    mlp_spec: dict, settings: Settings
) -> None:
    """A sampled call that a ``BaseException`` ends must still end its sample: before, its
    token was left open, holding the profiler's sampling lock (and, for a compiled variant,
    the process's one torch.profiler trace, recording every op from then on), so no call
    was sampled again."""
    model = _Interruptible(mlp_spec["model"])
    served = attach(model, name="mlp", spec=SPEC, settings=settings,
                    profiler=ProfilerConfig(sample_every=1, budget=None,
                                            window_s=settings.window_s))
    x = _inputs(mlp_spec)[0]
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        served(x)
        wait_for(lambda: served.profiler.status()["sampled"] >= 1, what="a sampled call")
        model.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            served(x)
        model.interrupt = False
        before = served.profiler.status()["sampled"]
        for _ in range(5):
            assert served(x).shape == (64, 10)
        wait_for(lambda: served.profiler.status()["sampled"] >= before + 5,
                 what="every later call sampled")
    finally:
        served.close()


# ---------------------------------------------------------------- 2. no promotion without evidence


def test_a_canary_without_traffic_waits_then_fails(mlp_spec: dict, settings: Settings) -> None:
    served = _attach(mlp_spec, settings)
    try:
        control = served.slot
        variant = copy.deepcopy(mlp_spec["model"])
        candidate = Slot(variant, 997, "idle variant", True, None)
        served.swap(Slot(variant, 997, "idle variant", True, None, control=control))
        started = time.monotonic()
        result = canary.run(served, candidate, control, Policy(canary_s=0.2, **CALM), threading.Event())
        waited = time.monotonic() - started
        served.swap(control)
        assert not result.keep and result.end == D.FAILED
        assert result.reason.startswith("too little traffic to judge: 0 calls")
        # past its hard deadline (0.6 s) it kept waiting for traffic, and the wait is bounded
        assert canary.MIN_EVIDENCE_WAIT_S - 0.5 <= waited < canary.MIN_EVIDENCE_WAIT_S + 3
    finally:
        served.close()


def test_a_canary_keeps_waiting_for_traffic_that_resumes(mlp_spec: dict, settings: Settings) -> None:
    served = _attach(mlp_spec, settings)
    try:
        control = served.slot
        variant = copy.deepcopy(mlp_spec["model"])
        candidate = Slot(variant, 996, "variant", True, None)
        served.swap(Slot(variant, 996, "variant", True, None, control=control))
        results: list[canary.Verdict] = []
        judge = threading.Thread(target=lambda: results.append(canary.run(
            served, candidate, control, Policy(canary_s=0.2, **CALM), threading.Event())))
        judge.start()
        time.sleep(1.5)  # past the hard deadline, with no traffic
        assert judge.is_alive() and not results
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2):
            judge.join(30)
        served.swap(control)
        assert results and results[0].keep, results and results[0].reason
        assert "live latency" in results[0].reason and "shadow " in results[0].reason
    finally:
        served.close()


def test_an_agent_stopped_during_a_canary_never_promotes_it(
    mlp_spec: dict, settings: Settings, store: st.Store
) -> None:
    served = _attach(mlp_spec, settings, canary_s=60.0)
    try:
        for x in _inputs(mlp_spec):
            served(x)
        dep = deploy(store, "mlp", INT8)
        wait_for(lambda: deployment_state(store, dep) == "canary", timeout=60, what="the canary")
        assert served.slot.canary
    finally:
        served.close()  # shutdown while the candidate is on canary
    d = _deployment(store, dep)
    assert d.state == "failed" and d.reason == canary.STOPPED
    assert served.slot.module is served.base and not served.slot.canary
    again = _attach(mlp_spec, settings)
    try:
        with store.session() as s:
            active = st.repo.active_deployment(s, again.model_id)
            assert active.source == "attach"  # nothing to restore: the candidate never won
            assert not [x for x in st.repo.list_deployments(s, again.model_id) if x.source == "restore"]
        assert again.slot.label == BASE_LABEL
    finally:
        again.close()


# ---------------------------------------------------------------- 4. stranded deployments


def test_a_store_error_mid_deployment_restores_the_previous_slot_and_fails_it(
    mlp_spec: dict, settings: Settings, store: st.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_move = states.move
    failed_once: list[int] = []

    def flaky_move(s: Any, dep_id: int, to_state: D, reason: str, **fields: Any) -> Any:
        if to_state == D.CANARY and not failed_once:  # the candidate is swapped in by now
            failed_once.append(dep_id)
            raise st.StoreUnavailable("database is locked")
        return real_move(s, dep_id, to_state, reason, **fields)

    monkeypatch.setattr(states, "move", flaky_move)
    served = _attach(mlp_spec, settings)
    try:
        for x in _inputs(mlp_spec):
            served(x)
        dep = deploy(store, "mlp", INT8)
        wait_for(lambda: failed_once, timeout=60, what="the store error")
        wait_for(lambda: deployment_state(store, dep) == "failed", timeout=30, what="the failure")
        d = _deployment(store, dep)
        assert "interrupted by a store error" in d.reason and "database is locked" in d.reason
        assert [t.to_state for t in d.transitions][-2:] == ["verifying", "failed"]
        assert served.slot.module is served.base and not served.slot.canary
        assert not served.swapper.busy.is_set()
        with store.session() as s:
            assert st.repo.active_deployment(s, served.model_id).source == "attach"
    finally:
        served.close()


def test_a_cancel_during_the_canary_drops_it_and_restores_the_previous_slot(
    mlp_spec: dict, settings: Settings, store: st.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(states, "HEARTBEAT_S", 0.2)
    served = _attach(mlp_spec, settings, canary_s=60.0)
    try:
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2) as load:
            dep = deploy(store, "mlp", INT8)
            wait_for(lambda: deployment_state(store, dep) == "canary", timeout=60, what="the canary")
            # the heartbeat: updated_at moves while the canary runs
            first = _deployment(store, dep).updated_at
            wait_for(lambda: _deployment(store, dep).updated_at > first + 0.3, timeout=5,
                     what="a heartbeat")
            assert served.slot.canary
            with store.session() as s:
                services.request_cancel(s, "mlp", dep, "an operator changed their mind")
            cancelled_at = time.monotonic()
            wait_for(lambda: not served.slot.canary, timeout=10, what="the canary dropped")
            assert time.monotonic() - cancelled_at < 5  # noticed by the heartbeat, not at 60 s
            wait_for(lambda: not served.swapper.busy.is_set(), timeout=10, what="the swapper idle")
            before = load.calls
            wait_for(lambda: load.calls > before + 20, what="traffic after the cancel")
        assert load.errors == [] and load.wrong == 0
        assert served.slot.module is served.base
        d = _deployment(store, dep)
        assert d.state == "cancelled" and d.reason == "an operator changed their mind"
        with store.session() as s:
            assert st.repo.active_deployment(s, served.model_id).source == "attach"
    finally:
        served.close()


def test_a_cancel_during_the_build_drops_it(
    mlp_spec: dict, settings: Settings, store: st.Store
) -> None:
    served = _attach(mlp_spec, settings)
    building, go = threading.Event(), threading.Event()
    real_build = served.swapper.variants.build

    def slow_build(recipe: Any, artifact: str | None = None) -> Any:
        building.set()
        go.wait(30)
        return real_build(recipe, artifact)

    served.swapper.variants.build = slow_build  # type: ignore[method-assign]
    try:
        for x in _inputs(mlp_spec):
            served(x)
        dep = deploy(store, "mlp", INT8)
        assert building.wait(60)
        with store.session() as s:
            services.request_cancel(s, "mlp", dep)
        go.set()
        wait_for(lambda: not served.swapper.busy.is_set(), timeout=60, what="the swapper idle")
        assert deployment_state(store, dep) == "cancelled"
        assert served.slot.module is served.base and not served.slot.canary
        # the swapper moved on: the next deployment is taken up
        nxt = deploy(store, "mlp", INT8)
        wait_for(lambda: deployment_state(store, nxt) != "candidate", timeout=60, what="the next")
    finally:
        go.set()
        served.close()


def test_touch_deployment_refreshes_open_deployments_only(store: st.Store) -> None:
    with store.session() as s:
        mid = st.repo.upsert_model(s, "m").id
        open_id = st.repo.create_deployment(s, mid, None, source="manual", reason="x").id
        states.move(s, open_id, D.BUILDING, "building")
        done_id = st.repo.create_deployment(s, mid, None, source="manual", reason="y").id
        states.move(s, done_id, D.CANCELLED, "cancelled")
    with store.session() as s:
        was = {i: st.repo.get_deployment(s, i).updated_at for i in (open_id, done_id)}
    time.sleep(0.05)
    with store.session() as s:
        assert st.repo.touch_deployment(s, open_id) == "building"
        assert st.repo.touch_deployment(s, done_id) == "cancelled"
        with pytest.raises(st.NotFound):
            st.repo.touch_deployment(s, 12345)
    with store.session() as s:
        assert st.repo.get_deployment(s, open_id).updated_at > was[open_id]
        assert st.repo.get_deployment(s, done_id).updated_at == was[done_id]
    assert states.HEARTBEAT_S <= 5.0 < states.STALE_AFTER_S
