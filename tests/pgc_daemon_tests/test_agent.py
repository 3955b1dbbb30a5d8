"""The agent in a serving process: registration, statistics, hot-swap under load, fallbacks
and rollbacks. Real models (digits MLP), a real SQLite store, real threads."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch

import store as st
from compiler import Backend, CompileCache, Quantization, Recipe, build, build_profiling_twin
from pgc_daemon import attach
from pgc_daemon.settings import Settings
from pgc_daemon.agent.slot import Slot
from pgc_daemon.agent import twins
from pgc_daemon.agent.runtime import thread_nice
from pgc_daemon.agent.twins import GuardedTwin
from pgc_daemon.agent.variants import KEEP_BUILT

from pgc_daemon.services.queries import profile_summary
from profiler import ProfilerConfig, exclusive_trace
from profiler._compiled import BETWEEN, event_name

from .helpers import Load, deploy, deployment_state, wait_for

SPEC = "pgc_daemon.examples.digits:mlp"
# an eager and a compiled variant: fp16, and fp32 through Inductor (int8 dynamic runs this model
# 26x slower than fp32 eager, 17x compiled, on a CPU without VNNI, where a canary rolls it back
# however tolerant; these tests are about swaps)
EAGER = Recipe(quantization=Quantization.of({"_default": "fp16"}))
COMPILED = Recipe(backend=Backend("inductor"))


def _attach(spec: dict[str, Any], settings: Settings, profiler: Any = None, **policy: Any) -> Any:
    policy = {"canary_s": 0.5, "canary_shadow_samples": 4, **policy}
    served = attach(spec["model"], name="mlp", spec=SPEC, settings=settings, policy=policy,
                    profiler=profiler)
    wait_for(lambda: served.model_id is not None, what="registration")
    return served


def _inputs(spec: dict[str, Any]) -> list[torch.Tensor]:
    return [args[0] for args in spec["example_inputs"][:8]]


def test_attach_registers_and_exports_live_statistics(mlp_spec: dict, settings: Settings, store: st.Store) -> None:
    # the thread tuner's probe calls are not sampled per layer (test_threadtune): with it off,
    # exactly every fifth call is
    served = _attach(mlp_spec, settings.model_copy(update={"thread_tuning": False}))
    try:
        inputs = _inputs(mlp_spec) * 10
        for x in inputs:
            out = served(x)
            assert out.shape == (x.shape[0], 10)
        served.flush()
        n = len(inputs)
        with store.session() as s:
            model = st.repo.get_model(s, "mlp")
            assert model.spec == SPEC and model.graph_hash and model.metric == "top1"
            summ = st.repo.request_summary(s, model.id)
            assert summ["count"] == n and summ["sampled"] == n // 5  # 1 in 5
            prof = st.repo.layer_profile(s, model.id)
            assert {"net.1", "net.3", "net.5"} <= {r["layer"] for r in prof}
            assert st.repo.shape_histogram(s, model.id) == {"b64 1x8x8": n}
            assert st.repo.load_reservoir(s, model.id).count == 32
            active = st.repo.active_deployment(s, model.id)
            assert active.source == "attach"
            assert st.repo.get_policy(s, model.id).settings["canary_s"] == 0.5
    finally:
        served.close()


def test_calls_of_changing_shapes_are_each_counted_under_their_own(
        mlp_spec: dict, settings: Settings, store: st.Store) -> None:
    """The request path keys one call in 16 while traffic keeps one shape; once a drain has
    seen the shape change, every call is keyed again and the histogram is exact."""
    served = _attach(mlp_spec, settings)
    try:
        x = _inputs(mlp_spec)[0]
        for _ in range(200):
            served(x)
        served.profiler.status()  # a drain: one shape alone, sparse keying from here
        assert not served.profiler.calls.dense
        model_id = served.model_id

        def histogram() -> dict[str, int]:
            served.flush()
            with store.session() as s:
                return st.repo.shape_histogram(s, model_id)

        for i in range(30):
            served(x[:8] if i % 3 == 0 else x)
        before = histogram()  # a drain that saw the change: dense keying from here
        assert served.profiler.calls.dense
        assert sum(before.values()) == 230  # every call counted, some under the old shape
        for i in range(300):
            served(x[:8] if i % 3 == 0 else x)
        after = histogram()
        assert after["b8 1x8x8"] - before.get("b8 1x8x8", 0) == 100
        assert after["b64 1x8x8"] - before["b64 1x8x8"] == 200
    finally:
        served.close()


def test_the_users_own_errors_are_not_hidden(mlp_spec: dict, settings: Settings) -> None:
    served = _attach(mlp_spec, settings)
    try:
        with pytest.raises(RuntimeError):
            served(torch.zeros(2, 3))  # a wrong input for the user's model is the user's error
    finally:
        served.close()


def _as_a_worker_builds(spec: dict, settings: Settings, store: st.Store, recipe: Recipe) -> None:
    """What a search worker leaves for the variant it chose: its artifact (what serves) and
    its profiling twin, recorded on the variant."""
    cache = CompileCache(settings.compile_cache_path(), artifacts=settings.artifact_path())
    calibration = [((x,), {}) for x in _inputs(spec)]
    built = build(spec["model"], recipe, calibration=calibration, cache=cache)
    twin = build_profiling_twin(spec["model"], recipe, calibration=calibration, cache=cache)
    assert built.artifact and twin is not None and twin.artifact
    with store.session() as s:
        m = st.repo.get_model(s, "mlp")
        v = st.repo.get_or_create_variant(s, m.id, recipe.hash, recipe.to_dict(), recipe.label())
        st.repo.set_variant_artifact(s, v.id, built.artifact)
        st.repo.set_variant_profile_artifact(s, v.id, twin.artifact)


def _kernel_events(module: torch.nn.Module, x: torch.Tensor) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    # the agent traces the twin on sampled calls and its calibration: one trace at a time
    with torch.inference_mode(), exclusive_trace(), profile(
        activities=[ProfilerActivity.CPU]
    ) as trace:
        module(x)
    return {event_name(e.name) for e in trace.events()}


class _Broken(torch.nn.Module):
    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a twin that fails")


def test_a_swap_under_concurrent_load_serves_every_request_correctly(
    mlp_spec: dict, settings: Settings, store: st.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGC_KERNEL_PROFILE", raising=False)  # as served by default
    # torchao's eager int8 is slower than fp32 on a model this small; the canary would
    # (rightly) roll it back. This test is about correctness across swaps, so allow it.
    # a fixed sampling rate: on a model this small the budget would sample almost nothing
    fixed = ProfilerConfig(sample_every=5, budget=None, window_s=settings.window_s)
    served = _attach(mlp_spec, settings, profiler=fixed, canary_latency_tolerance=10.0)
    # the machine's load as the twin watch reads it: busy elsewhere when the twin is first
    # calibrated (a search worker still running), quiet a little later
    other_load, reads = [1.5], []

    def load_now() -> float:
        reads.append(served.slot.twin is None)
        return other_load[0]

    served.swapper.twins.load = load_now
    monkeypatch.setattr(twins, "RECALIBRATE_S", 0.5)
    try:
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=4) as load:
            wait_for(lambda: load.calls > 50, what="traffic")
            for recipe in (EAGER, Recipe(), COMPILED):
                if recipe is COMPILED:
                    _as_a_worker_builds(mlp_spec, settings, store, recipe)
                dep = deploy(store, "mlp", recipe)
                wait_for(lambda: deployment_state(store, dep) in ("active", "failed", "rolled_back"),
                         timeout=120, what=f"deployment of {recipe.label()}")
                assert deployment_state(store, dep) == "active"
                assert served.slot.variant_id is not None
            before = load.calls
            wait_for(lambda: load.calls > before + 50, what="traffic after the swaps")
        assert load.errors == []
        assert load.wrong == 0
        with store.session() as s:
            model = st.repo.get_model(s, "mlp")
            deps = st.repo.list_deployments(s, model.id)
            states = [d.state for d in deps]
            assert states.count("active") == 1 and states[0] == "active"
            last = st.repo.get_deployment(s, deps[0].id)
            assert [t.to_state for t in last.transitions] == [
                "candidate", "building", "warming", "verifying", "canary", "active"
            ]
            assert last.live_fidelity is not None and last.live_fidelity > 0.9
        assert served.slot.label == COMPILED.label()
        assert served.swapper.variants.loads >= 1  # the worker's artifact: nothing compiled
        # what serves carries no kernel events; the twin the worker built is loaded beside it
        # and serves the sampled calls, which are split over the layers its kernels fuse
        wait_for(lambda: served.slot.twin is not None, timeout=30, what="the profiling twin")
        kernels = set(served.slot.kernels)
        assert kernels <= _kernel_events(served.slot.twin.twin, _inputs(mlp_spec)[0])
        assert not kernels & _kernel_events(served.slot.module, _inputs(mlp_spec)[0])
        assert served.status()["profile_twin"].startswith("loaded")  # calibrating, or done
        wait_for(lambda: "over a live one" in served.status()["profile_twin"], timeout=30,
                 what="the twin's calibration")  # measured in this process, as calls are served
        # on the variant's own weights (the same memory), every one of them equal
        assert ", 0 kept its own, over 1 package(s)" in served.status()["profile_twin"]
        # as the variant's calls are served: at its thread count, not the swapper's priority
        threads = served.tuner.chosen(served.slot.variant_id) or served.tuner.configured
        assert f"measured at {threads} thread" in served.status()["profile_twin"]
        assert "1.5 cores busy elsewhere" in served.status()["profile_twin"]
        # read on every turn, not only at the calibration: a smoothed reading needs several
        assert reads.count(True) >= 3, reads
        other_load[0] = 0.2  # the worker is done: calibrated again, once
        wait_for(lambda: served.status()["profile_twin"].startswith("calibrated again"),
                 timeout=30, what="the twin's calibration once the machine is quiet")
        assert "0.2 cores busy elsewhere" in served.status()["profile_twin"]
        for x in _inputs(mlp_spec) * 50:
            served(x)
        served.flush()
        with store.session() as s:  # and said so where a user reads events
            events = st.repo.list_events(s, st.repo.get_model(s, "mlp").id, kind="profiler")
            calibrations = [e for e in events if "over a live one" in e.message]
            assert len(calibrations) == 2
            assert {e.data["nice"] for e in calibrations} == {thread_nice()}  # this thread's
            assert {e.data["threads"] for e in calibrations} == {threads}
        with store.session() as s:
            prof = profile_summary(s, st.repo.get_model(s, "mlp"))
        active = prof["active"]
        assert active is not None and active["variant_id"] == served.slot.variant_id
        names = {dict(mlp_spec["model"].named_modules()).get(r["layer"]) is not None
                 or r["layer"] in ("(root)", BETWEEN) for r in active["layers"]}
        assert names == {True}
        assert {r["layer"] for r in active["layers"]} >= {"net.1", "net.3", "net.5"}
        assert active["layer_sum_ms"] > 0 and active["live_ms"] > 0

        # the slot back without its twin (a rollback to it, the demo's A/B) after another
        # variant's twin loaded: the kept twin is put back, and says what it reads, not
        # what the last one loaded did
        served.swapper.twins.weights = "12 weights shared, 3 kept its own (another twin)"
        served.swap(dataclasses.replace(served.slot, twin=None, kernels=None))
        wait_for(lambda: served.slot.twin is not None, timeout=30, what="the kept twin back")
        wait_for(lambda: served.status()["profile_twin"].startswith("loaded"), timeout=30,
                 what="the kept twin calibrated")
        assert ", 0 kept its own, over 1 package(s)" in served.status()["profile_twin"]

        # once its variant neither serves nor is kept warm (fp32 deployed, three others built
        # since), the twin is let go; when that variant serves again, its twin is loaded again
        twin_ref = weakref.ref(served.slot.twin.twin)
        def deployed(recipe: Recipe) -> None:  # under traffic: a canary needs calls to judge
            with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2) as load:
                dep = deploy(store, "mlp", recipe)
                wait_for(lambda: deployment_state(store, dep) == "active", timeout=120,
                         what=f"deployment of {recipe.label()}")
            assert load.errors == [] and load.wrong == 0

        deployed(Recipe())
        for i in range(KEEP_BUILT):
            served.swapper.variants.remember(Slot(mlp_spec["model"], 10_000 + i, "", True))
        wait_for(lambda: gc.collect() >= 0 and twin_ref() is None, timeout=30,
                 what="the twin of a variant no longer kept let go")
        deployed(COMPILED)
        wait_for(lambda: served.slot.twin is not None, timeout=30, what="the twin loaded again")

        # calls of a shape the package was not built for run the fp32 model: correct, never an
        # error, and said: the agent's status counts them, an event names their shapes, and
        # /metrics counts the warnings
        odd = torch.cat(_inputs(mlp_spec))[:5]  # a batch no live call had
        assert served.status()["shape_misses"] == 0
        for _ in range(7):
            torch.testing.assert_close(served(odd), mlp_spec["model"](odd))
        assert served.status()["shape_misses"] == 7

        def warned() -> Any:
            with store.session() as s:
                return st.repo.list_events(s, served.model_id, kind="shape_miss")

        (event,) = wait_for(warned, timeout=30, what="the shape-miss event")
        # the swapper looks every poll: it may have seen some of the 7 calls so far
        n = event.data["calls"]
        assert event.level == "warning" and 1 <= n <= 7 and event.data["total"] == n
        assert event.data["variant_id"] == served.slot.variant_id
        shape = "x".join(map(str, odd.shape))  # e.g. 5x1x8x8
        assert event.data["shapes"] == {shape: n} and f"{shape} ({n})" in event.message
        from pgc_daemon.api.metrics import StoreCollector

        (family,) = [m for m in StoreCollector(store, ttl_s=0).collect() if m.name == "pgc_shape_miss_warnings"]
        assert [x.value for x in family.samples if x.name.endswith("_total")] == [1.0]

        # a twin that fails a sampled call: the variant serves that call (no fallback to
        # fp32, no error), and the twin is taken off
        fallbacks = served.fallbacks
        broken = GuardedTwin(_Broken(), served.slot.module)  # as the watch wraps every twin
        served.swap(dataclasses.replace(served.slot, twin=broken))
        for x in _inputs(mlp_spec) * 10:
            assert torch.equal(served(x).argmax(-1), mlp_spec["model"](x).argmax(-1))
        assert broken.failures > 0 and served.fallbacks == fallbacks
        wait_for(lambda: served.slot.twin is None, timeout=30, what="the failed twin taken off")
        assert served.status()["profile_twin"].startswith("dropped")
    finally:
        served.close()


class Broken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a variant bug")


def test_an_openvino_variant_that_serves_gets_rows_per_layer_from_its_counting_twin(
    mlp_spec: dict, settings: Settings, store: st.Store
) -> None:
    """An OpenVINO variant has no kernel events to trace: its twin is the same model compiled
    again with OpenVINO's per-node counters, made by the agent itself. Sampled calls run it,
    and its nodes' times are split over the layers they were made from."""
    pytest.importorskip("openvino")
    from profiler import NodeKernels

    fixed = ProfilerConfig(sample_every=5, budget=None, window_s=settings.window_s)
    served = _attach(mlp_spec, settings, profiler=fixed, canary_latency_tolerance=10.0)
    recipe = Recipe(backend=Backend("openvino", "f32"))
    try:
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2) as load:
            wait_for(lambda: load.calls > 50, what="traffic")
            dep = deploy(store, "mlp", recipe)
            wait_for(lambda: deployment_state(store, dep) in ("active", "failed", "rolled_back"),
                     timeout=120, what=f"deployment of {recipe.label()}")
            assert deployment_state(store, dep) == "active"
            wait_for(lambda: served.slot.twin is not None, timeout=30, what="the counting twin")
            wait_for(lambda: "over a live one" in served.status()["profile_twin"], timeout=30,
                     what="the twin's calibration")
        assert load.errors == [] and load.wrong == 0
        slot = served.slot
        assert isinstance(slot.kernels, NodeKernels)
        assert not slot.module.counters and slot.twin.twin.counters  # what serves counts nothing
        assert "OpenVINO's counting copy" in served.status()["profile_twin"]
        assert slot.twin_every == 8
        # the copy also serves one unsampled call in eight, which keeps it warm: with
        # weights of its own, a sampled call after a hundred of the variant's ran 1.2x slower
        twin_calls = slot.twin.twin.calls
        with served.profiler.paused():  # no call sampled: each twin call is a warm one
            for x in _inputs(mlp_spec) * 8:
                served(x)
        assert slot.twin.twin.calls - twin_calls == len(_inputs(mlp_spec))
        for x in _inputs(mlp_spec) * 50:
            served(x)
        served.flush()
        with store.session() as s:
            prof = profile_summary(s, st.repo.get_model(s, "mlp"))
        active = prof["active"]
        assert active is not None and active["variant_id"] == slot.variant_id
        rows = {r["layer"]: r for r in active["layers"]}
        assert {"net.1", "net.3", "net.5", BETWEEN} <= set(rows)
        assert rows["net.1"]["op_type"].startswith("FullyConnected (")
        assert active["layer_sum_ms"] > 0 and active["live_ms"] > 0
    finally:
        served.close()


def test_a_failing_variant_falls_back_and_is_reverted(mlp_spec: dict, settings: Settings, store: st.Store) -> None:
    served = _attach(mlp_spec, settings)
    try:
        x = _inputs(mlp_spec)[0]
        expected = mlp_spec["model"](x)
        served.swap(Slot(Broken(), 999, "broken", True, None))
        out = served(x)  # served by the base module instead
        assert torch.allclose(out, expected)
        assert served.fallbacks == 1
        wait_for(lambda: served.slot.module is served.base, what="revert to the base")

        def rollback_events() -> list[Any]:
            with store.session() as s:
                return st.repo.list_events(s, served.model_id, kind="rollback")

        # the failing variant leaves service first and is recorded after (reverts.py)
        wait_for(lambda: rollback_events(), what="the rollback's record")
        assert "variant failed live requests" in rollback_events()[0].message
        with store.session() as s:
            assert st.repo.active_deployment(s, served.model_id).source == "rollback"
    finally:
        served.close()


def test_a_candidate_that_fails_verification_never_serves(mlp_spec: dict, settings: Settings, store: st.Store) -> None:
    served = _attach(mlp_spec, settings, max_accuracy_drop=0.0, canary_latency_tolerance=10.0)
    try:
        for x in _inputs(mlp_spec):
            served(x)
        # bf16 may change some argmaxes; with a zero budget it must not pass. Traffic runs in
        # case it passes verification: a canary promotes only on live evidence.
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2):
            dep = deploy(store, "mlp", Recipe(quantization=Quantization.of({"_default": "bf16"})))
            wait_for(lambda: deployment_state(store, dep) in ("failed", "active"), timeout=60)
        state = deployment_state(store, dep)
        with store.session() as s:
            reason = st.repo.get_deployment(s, dep).reason
        if state == "failed":
            assert "verification failed" in reason
            assert served.slot.module is served.base
        else:  # bf16 may agree on every argmax; then it must have really been verified
            assert "fidelity 1.0000" in reason or "canary passed" in reason
    finally:
        served.close()


def test_an_unreachable_store_never_fails_requests(mlp_spec: dict, tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    settings = Settings(store_url=f"sqlite:///{blocker}/pgc.db", window_s=0.1, poll_s=0.1)
    served = attach(mlp_spec["model"], name="mlp", spec=SPEC, settings=settings)
    try:
        for x in _inputs(mlp_spec) * 5:
            served(x)
        assert served.calls == len(_inputs(mlp_spec)) * 5 and served.model_id is None
    finally:
        served.close()


def test_a_restarted_agent_serves_the_active_variant_again(mlp_spec: dict, settings: Settings, store: st.Store) -> None:
    # a canary promotes only on live evidence: traffic runs while the deployment canaries
    served = _attach(mlp_spec, settings, canary_latency_tolerance=10.0)
    try:
        with Load(served, mlp_spec["model"], _inputs(mlp_spec), threads=2):
            dep = deploy(store, "mlp", EAGER)
            wait_for(lambda: deployment_state(store, dep) == "active", timeout=60)
    finally:
        served.close()
    again = _attach(mlp_spec, settings, canary_latency_tolerance=10.0)
    try:
        with Load(again, mlp_spec["model"], _inputs(mlp_spec), threads=2) as load:
            wait_for(lambda: again.slot.label == EAGER.label(), timeout=60, what="the variant served again")
        assert not again.slot.canary and not load.errors
        with store.session() as s:
            # the decision stands: the same deployment is active, nothing superseded it
            active = st.repo.active_deployment(s, again.model_id)
            assert active.id == dep and again.slot.deployment_id == dep
            assert [d.state for d in st.repo.list_deployments(s, again.model_id)].count("active") == 1
    finally:
        again.close()


class _Sleepy(torch.nn.Module):
    """A module whose forward takes a while, so tracing it keeps torch.fx's process-wide
    patch of nn.Module.__call__ in place for that long."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(0.6)
        return x + 1


def test_calls_during_torch_fx_tracing_in_another_thread_are_served(mlp_spec: dict, settings: Settings) -> None:
    import threading
    import time

    from pgc_daemon.agent.runtime import tracing_now

    served = _attach(mlp_spec, settings)
    x = _inputs(mlp_spec)[0]
    expected = mlp_spec["model"](x)
    try:
        tracer = threading.Thread(target=lambda: torch.fx.Tracer().trace(_Sleepy()))
        tracer.start()
        deadline = time.monotonic() + 5
        while not tracing_now() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tracing_now(), "the tracer should be running"
        with pytest.raises(NameError):  # what any plain call of a module meets right now
            mlp_spec["model"](x)
        out = served(x)  # the agent waits for the tracer and serves the call
        tracer.join()
        assert torch.allclose(out, expected)
        assert served.retries == 1
    finally:
        served.close()


def test_a_quiet_poll_reads_the_deployments_once(mlp_spec: dict, settings: Settings) -> None:
    """Every poll of every replica asks the store what to do; with nothing to do it is one
    query of the deployments (candidates, in flight, active), and no variant row. It used to
    be three sessions and four queries (about 3 ms of CPU a second per replica)."""
    import threading
    import time

    from sqlalchemy import event

    served = _attach(mlp_spec, settings)
    try:
        for x in _inputs(mlp_spec) * 5:  # live inputs: the swapper looks from now on
            served(x)
        engine = served.registry.store().engine
        tables: list[str] = []

        def seen(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
            if threading.current_thread().name == "pgc-swapper-mlp":
                tables.extend(t for t in ("pgc_deployments", "pgc_variants")
                              if f"FROM {t}" in statement)

        time.sleep(1.0)  # settled: metric chosen, references prepared
        event.listen(engine, "before_cursor_execute", seen)
        try:
            time.sleep(2.0)  # about 10 polls at poll_s 0.2
        finally:
            event.remove(engine, "before_cursor_execute", seen)
        polls = 2.0 / settings.poll_s
        assert "pgc_variants" not in tables
        assert 0.5 * polls <= tables.count("pgc_deployments") <= polls + 2, tables
    finally:
        served.close()
