"""Policy, model specs, the input reservoir, the interleaved timer and the search space."""

from __future__ import annotations

import random
from typing import Any
import time

import numpy as np
import pytest
import torch
from torch import nn

import store as st
from compiler import Backend, Hardware, SensitivityReport
from pgc_daemon.errors import PolicyError, SpecError
from pgc_daemon.modelspec import as_examples, load_spec
from pgc_daemon.policy import Policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.optimizer.search.hotprofile import hot_layers
from pgc_daemon.optimizer.search.measure import interleaved
from pgc_daemon.optimizer.search.space import build_space

# ---------------------------------------------------------------- policy


def test_policy_defaults_and_min_fidelity() -> None:
    p = Policy()
    assert p.max_accuracy_drop == 0.01 and p.min_fidelity == pytest.approx(0.99)


@pytest.mark.parametrize(
    "data,where",
    [
        ({"max_accuracy_drop": 2}, "max_accuracy_drop"),
        ({"latency_percentile": "p42"}, "latency_percentile"),
        ({"objective": "most_accurate"}, "policy"),
        ({"max_trials": 0}, "max_trials"),
        ({"surprise": 1}, "surprise"),
        ({"backends": ["tvm"]}, "backends"),
        ({"backends": []}, "backends"),
        ({"backends": ["eager", "eager"]}, "named twice"),
    ],
)
def test_invalid_policies_give_one_readable_line(data: dict, where: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.parse(data)
    assert where in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------- model specs


def test_load_spec_from_the_shipped_digits_factory() -> None:
    spec = load_spec("pgc_daemon.examples.digits:mlp")
    assert isinstance(spec.model, nn.Module) and not spec.model.training
    assert spec.accuracy is not None and spec.labels is not None
    assert len(spec.labels) == len(spec.examples)
    args, kwargs = spec.examples[0]
    assert torch.is_tensor(args[0]) and kwargs == {}


@pytest.mark.parametrize(
    "path,msg",
    [
        ("no_colon_here", "package.module:function"),
        ("no.such.module:build", "cannot import"),
        ("pgc_daemon.examples.digits:nothing", "no function"),
        ("pgc_daemon.examples.digits:data", "must return"),
    ],
)
def test_bad_specs_are_spec_errors(path: str, msg: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert msg in str(info.value)


def test_example_forms() -> None:
    t = torch.ones(2)
    assert as_examples(t) == [((t,), {})]
    assert as_examples((t, t))[0][0] == (t, t)
    assert as_examples([{"x": t}])[0] == ((), {"x": t})
    with pytest.raises(SpecError):
        as_examples([])
    with pytest.raises(SpecError):
        as_examples(["text"])


# ---------------------------------------------------------------- reservoir


def test_reservoir_is_bounded_copies_inputs_and_round_trips() -> None:
    r = InputReservoir(capacity=8, seed=1)
    x = torch.zeros(1, 4)
    for i in range(1000):
        x.fill_(i)
        r.offer((x,), {"mask": torch.ones(1, 4)})
    assert len(r) == 8 and r.seen == 1000
    values = sorted(int(a[0][0, 0]) for a, _ in r.snapshot())
    assert len(set(values)) == 8  # copies, not 8 views of the reused tensor
    assert max(values) > 100  # later traffic got in
    again = InputReservoir.deserialize(r.serialize())
    assert [int(a[0][0, 0]) for a, _ in again] == [int(a[0][0, 0]) for a, _ in r.snapshot()]
    assert torch.equal(again[0][1]["mask"], torch.ones(1, 4))


def test_the_skip_drawn_in_advance_keeps_every_call_s_odds() -> None:
    """Calls not taken are skipped by a count drawn in advance: the final sample is still
    uniform over the calls seen (each in it with odds capacity / calls), and past
    ``stale_after`` calls each is taken with odds capacity / stale_after."""
    k, n, runs = 4, 120, 3000
    hits = np.zeros(n)
    for seed in range(runs):
        r = InputReservoir(capacity=k, stale_factor=1000, seed=seed)
        for i in range(n):
            r.offer((torch.tensor([i]),), {})
        hits[[int(a[0]) for a, _ in r.snapshot()]] += 1
    assert r.seen == n
    deciles = hits.reshape(10, -1).sum(axis=1) / runs  # expected k / 10 = 0.4 each
    assert np.all(np.abs(deciles - k / 10) < 0.05), deciles
    # the floor: 4 / 40 odds a call once 40 have been seen, so ~1 000 of 10 000 are taken
    r = InputReservoir(capacity=4, stale_factor=10, seed=0)
    x = torch.zeros(1)
    for _ in range(10_040):
        r.offer((x,), {})
    assert 900 < r.version < 1100 and r.seen == 10_040


def test_reservoir_keeps_following_traffic_that_drifts() -> None:
    r = InputReservoir(capacity=10, stale_factor=10, seed=0)
    for i in range(20_000):
        r.offer((torch.tensor([0 if i < 10_000 else 1]),), {})
    late = sum(int(a[0]) for a, _ in r.snapshot())
    assert late >= 8  # the second half replaced almost everything


# ---------------------------------------------------------------- interleaved timing


@pytest.mark.serial  # timed on the wall clock
def test_interleaved_timing_finds_a_two_times_slower_candidate() -> None:
    def base(_x: object) -> None:
        time.sleep(0.002)

    def slow(_x: object) -> None:
        time.sleep(0.004)

    t = interleaved(base, slow, [((None,), {})], min_rounds=4, max_rounds=12)
    assert 1.5 < t.ratio < 2.6
    assert t.ratio_low <= t.ratio <= t.ratio_high
    assert t.speedup == pytest.approx(1 / t.ratio)
    assert t.baseline_ms["p50"] < t.candidate_ms["p50"]


@pytest.mark.serial  # timed on the wall clock
def test_interleaved_timing_stops_once_the_decision_is_clear() -> None:
    """A candidate three times slower is clearly on the wrong side of fp32 (and of the best
    so far) after the fewest rounds; a close call against the same thresholds is timed to
    full precision."""

    def base(_x: object) -> None:
        time.sleep(0.002)

    def slow(_x: object) -> None:
        time.sleep(0.006)

    jitter = random.Random(7)

    def close(_x: object) -> None:  # as fast as the base on average, noisily
        time.sleep(jitter.uniform(0.001, 0.003))

    full = interleaved(base, slow, [((None,), {})], min_rounds=8, max_rounds=12, rel_halfwidth=1e-6)
    assert full.rounds >= 8
    decided = interleaved(base, slow, [((None,), {})], min_rounds=8, max_rounds=12, rel_halfwidth=1e-6,
                          decide_at=[1 / 1.05, 0.5])
    assert decided.rounds == 3 and decided.ratio_low > 1 / 1.05
    undecided = interleaved(base, close, [((None,), {})], min_rounds=8, max_rounds=12,
                            rel_halfwidth=1e-6, decide_at=[1.0])
    assert undecided.rounds >= 8
    # three times faster: ahead of every threshold, the new best, whose figure a deployment
    # promises: not settled by being ahead, timed to full precision
    ahead = interleaved(slow, base, [((None,), {})], min_rounds=8, max_rounds=12,
                        rel_halfwidth=1e-6, decide_at=[1 / 1.05, 0.5])
    assert ahead.rounds >= 8 and ahead.ratio_high < 0.5


def test_interleaved_needs_inputs() -> None:
    with pytest.raises(ValueError):
        interleaved(print, print, [])


# ---------------------------------------------------------------- space


def test_hot_layers_come_from_the_profile(mlp_spec: dict) -> None:
    model = mlp_spec["model"]
    profile = [
        {"layer": "net.3", "share": 0.6},
        {"layer": "net.1", "share": 0.3},
        {"layer": "net.5", "share": 0.05},
        {"layer": "net.2", "share": 0.05},  # a ReLU: not quantizable
    ]
    assert hot_layers(model, profile, coverage=0.8) == ["net.3", "net.1"]
    assert hot_layers(model, profile, coverage=0.8, max_hot=1) == ["net.3"]
    assert hot_layers(model, [], coverage=0.8) == []


def test_space_turns_params_into_recipes(mlp_spec: dict) -> None:
    hw = Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True})
    space = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], hw)
    assert space.hot_layers == ("net.3",)
    assert "bf16" not in space.layer_choices  # no bf16 units on this "machine"
    recipe = space.recipe(space.params("int8-dynamic-pc", "inductor", **{"net.3": "fp32"}))
    assert recipe.quantization.choice_for("net.3")[0].precision == "fp32"
    assert recipe.quantization.choice_for("net.1")[0].label() == "int8-dynamic-pc"
    assert recipe.backend.kind == "inductor"
    base = space.baselines()
    assert base[0] == space.params("fp32", "inductor")
    assert space.size == len(list(space.grid()))
    # each installed peer is tried first in its own int8, after all-int8 static Inductor
    peers = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], hw,
                        backends=("inductor", "inductor-max", "eager", "onnxruntime", "openvino",
                                  "openvino-f32"))
    tried = [(p["default"], p["backend"]) for p in peers.baselines()]
    assert tried == [("fp32", "inductor"), ("int8-static-pc", "inductor"),
                     ("int8-dynamic-pc", "onnxruntime"), ("int8-static-pc", "openvino"),
                     ("int8-dynamic-pc", "inductor"), ("int8-static-pc", "inductor-max")]
    assert peers.recipe(peers.baselines()[-1]).backend == Backend("inductor", "max-autotune")
    alone = build_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], hw,
                        backends=("inductor", "eager"))
    assert [p["backend"] for p in alone.baselines()] == ["inductor"] * 3  # no peer, none tried
    fp32 = space.recipe(space.params("fp32", "eager"))
    assert fp32.is_identity


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.query(x) @ self.key(x).T, -1) @ self.value(x)


def test_compiled_recipes_run_sibling_linears_as_one_where_the_model_has_them(mlp_spec: dict) -> None:
    hw = Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True})
    space = build_space(_Attention(), [], hw, backends=("inductor", "eager", "onnxruntime"))
    assert space.sibling_linears and space.to_dict()["sibling_linears"]
    for backend, fused in (("inductor", True), ("eager", False), ("onnxruntime", False)):
        recipe = space.recipe(space.params("int8-static-pc", backend))
        assert recipe.fusion.linear_siblings is fused
        assert space.params_for(recipe) is not None  # warm starts still find it
    mlp = build_space(mlp_spec["model"], [], hw)  # a Sequential's linears run in a chain
    assert not mlp.sibling_linears
    assert mlp.recipe(mlp.params("int8-static-pc", "inductor")).fusion.is_identity


def _report(rows: list[tuple[str, str, float | None, str]]) -> SensitivityReport:
    from compiler import LayerSensitivity, SensitivityReport

    rep = SensitivityReport(metric="top1", inputs=8)
    for layer, choice, fid, status in rows:
        rep.rows.append(LayerSensitivity(layer, choice, fid, None, None, None, None, status))
    return rep


def test_sensitivity_picks_the_hot_layers_and_prunes_their_choices(mlp_spec: dict) -> None:
    from pgc_daemon.optimizer.search.space import build_space

    hw = Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True})
    profile = [{"layer": "net.3", "share": 0.5}, {"layer": "net.1", "share": 0.3}, {"layer": "net.5", "share": 0.2}]
    rep = _report([
        ("net.1", "int8-dynamic-pt", 0.95, "ok"),      # breaks a 1% budget alone
        ("net.1", "int8-dynamic-pc", 0.998, "ok"),
        ("net.3", "int8-dynamic-pt", 0.999, "ok"),
        ("net.5", "int8-dynamic-pt", 0.97, "ok"),      # not hot: the default covers it
        ("net.3", "int8-static-pc", None, "failed: no static path"),
    ])
    space = build_space(mlp_spec["model"], profile, hw, max_hot=2, sensitivity=rep, max_drop=0.01)
    assert space.hot_layers == ("net.1", "net.3")  # the two most sensitive of the time candidates
    assert "int8-dynamic-pt" not in space.choices_of("net.1")
    assert "int8-dynamic-pt" in space.choices_of("net.3")
    assert "int8-static-pc" not in space.choices_of("net.3")
    assert "int8-dynamic-pt" not in space.default_choices  # it breaks the budget on net.5
    assert "fp32" in space.choices_of("net.1") and "fp32" in space.default_choices
    reasons = {(layer, choice): why for layer, choice, why in space.pruned}
    assert "alone > budget" in reasons[("net.1", "int8-dynamic-pt")]
    assert "no static path" in reasons[("net.3", "int8-static-pc")]
    # enqueued points never ask a layer for a pruned choice
    for params in space.baselines(sensitive=["net.1"]):
        assert params["layer:net.1"] in space.choices_of("net.1")
    assert space.params("int8-static-pc", "inductor")["layer:net.3"] == "fp32"
    assert space.size == len(list(space.grid()))


def test_one_changed_row_of_a_few_prunes_nothing_two_do(mlp_spec: dict, store: Any) -> None:
    """Top-1 sensitivity on 8 rows moves in steps of 0.125: a choice is pruned when even the
    least drop its count makes likely breaks the budget, and a report whose count is not
    known (stored before it was kept) prunes by the drop measured, as before."""
    from compiler import LayerSensitivity, SensitivityReport
    from pgc_daemon.optimizer.search.runner import stored_sensitivity
    from pgc_daemon.optimizer.search.space import prune

    def report(samples: int) -> SensitivityReport:
        rep = SensitivityReport(metric="top1", inputs=8, samples=samples)
        rep.rows += [LayerSensitivity("net.1", "int8-static-pc", 7 / 8, None, None, None, None),
                     LayerSensitivity("net.3", "int8-static-pc", 6 / 8, None, None, None, None)]
        return rep

    choices = ("fp32", "int8-static-pc")
    kept, removed = prune(["net.1", "net.3"], choices, report(8), 0.01)
    assert kept == {"net.1": choices, "net.3": ("fp32",)}
    assert removed == [("net.3", "int8-static-pc",
                        "drop 0.2500 (at least 0.0464 likely) alone > budget 0.01")]
    kept, _ = prune(["net.1", "net.3"], choices, report(8), 0.005)  # a budget under the floor
    assert kept == {"net.1": ("fp32",), "net.3": ("fp32",)}
    kept, _ = prune(["net.1", "net.3"], choices, report(0), 0.01)
    assert kept == {"net.1": ("fp32",), "net.3": ("fp32",)}
    # the count travels through the store with the rows: a resumed search prunes alike
    with store.session() as s:
        model_id = st.repo.upsert_model(s, "mlp", graph_hash="a" * 64).id
        st.repo.save_sensitivity(s, model_id, "a" * 64, report(8).to_rows())
    again = stored_sensitivity(store, model_id, "a" * 64)
    assert again is not None and again.samples == 8
    assert prune(["net.1", "net.3"], choices, again, 0.01)[0]["net.1"] == choices


def test_the_space_offers_graph_parts_for_conv_models_and_buckets_for_varied_traffic(
    mlp_spec: dict, cnn_spec: dict
) -> None:
    from compiler import DynamicShapes, Fusion, Layout, ShapeBuckets
    from pgc_daemon.optimizer.search.space import build_space, live_buckets

    hw = Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True})
    cnn = build_space(cnn_spec["model"], [], hw)
    assert cnn.graph_choices and not cnn.bucket_sizes
    fused = cnn.recipe(cnn.params("int8-static-pc", "inductor"))
    assert fused.fusion == Fusion(conv_bn=True, conv_bn_relu=True)
    assert fused.layout == Layout("channels_last")
    plain = cnn.recipe({**cnn.params("fp32", "eager"), "graph": "as_is"})
    assert plain.is_identity
    assert cnn.params_for(plain) == {**cnn.params("fp32", "eager"), "graph": "as_is"}
    assert cnn.size == len(list(cnn.grid()))
    # its convolutions as GEMMs: Inductor only (the other backends run the graph as written)
    assert cnn.graph_choices == ("fused_cl", "as_is", "conv_gemm")
    gemms = {**cnn.params("int8-static-pc", "inductor-max"), "graph": "conv_gemm"}
    assert cnn.recipe(gemms).fusion == Fusion(conv_bn=True, conv_gemm=True)
    assert cnn.params_for(cnn.recipe(gemms)) == gemms
    peer = cnn.recipe({**cnn.params("fp32", "onnxruntime"), "graph": "conv_gemm"})
    assert peer.fusion.is_identity and peer.layout.is_identity
    assert gemms in cnn.baselines()  # where the digits CNN beat ONNX Runtime at batch 1
    depthwise = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Flatten(), nn.Linear(4, 2))
    assert build_space(depthwise, [], hw).graph_choices == ("fused_cl", "as_is")
    rows = nn.Sequential(nn.Conv1d(8, 16, 3), nn.Flatten(), nn.Linear(16 * 6, 2))
    assert build_space(rows, [], hw).graph_choices == ("as_is", "conv_gemm")

    assert live_buckets({"b1 s64": 50, "b1 s128": 40, "b1 s512": 1}) == (64, 128)
    assert live_buckets({"b1 s128": 100}) == ()
    mlp = build_space(mlp_spec["model"], [], hw, shapes={"b1 s64": 5, "b1 s128": 5})
    assert not mlp.graph_choices and mlp.bucket_sizes == (64, 128)
    bucketed = mlp.recipe({**mlp.params("int8-dynamic-pc", "inductor"), "buckets": "live"})
    assert bucketed.buckets == ShapeBuckets((64, 128))
    # or the sequence axis compiled dynamic (what baselines take): Inductor only, the other
    # backends already are
    assert mlp.distributions()["buckets"] == ("live", "dynamic", "none")
    dyn = mlp.recipe(mlp.params("int8-dynamic-pc", "inductor"))
    assert dyn.dynamic == DynamicShapes(1) and dyn.buckets.is_identity
    assert mlp.params_for(dyn) == mlp.params("int8-dynamic-pc", "inductor")
    assert mlp.params_for(bucketed)["buckets"] == "live"
    eager = mlp.recipe({**mlp.params("fp32", "eager"), "buckets": "dynamic"})
    assert eager.dynamic.is_identity and eager.is_identity
    assert mlp.size == len(list(mlp.grid()))
    # a study recorded before "dynamic" was offered keeps the choices it recorded
    older = mlp.reconciled({"buckets": ("live", "none")})
    assert older.distributions()["buckets"] == ("live", "none")
    assert older.params_for(dyn) is None


def test_a_live_search_times_torch_backends_at_one_thread_and_peers_as_built() -> None:
    """Beside serving traffic both arms are timed at one intra-op thread (OpenMP barriers of a
    preempted two-thread team inflate fp32 eager far more than a compiled variant); a backend
    with its own thread pool is timed with fp32 at the count it was built for, unless its pool
    was resized to the timing count."""
    from compiler import Backend, Recipe
    from pgc_daemon.optimizer.search.runner import LIVE_TIMING_THREADS
    from pgc_daemon.optimizer.search.trial import timing_threads

    before = torch.get_num_threads()
    inductor = Recipe(backend=Backend("inductor"))
    with timing_threads(LIVE_TIMING_THREADS, inductor):
        assert torch.get_num_threads() == LIVE_TIMING_THREADS == 1
    assert torch.get_num_threads() == before
    with timing_threads(1, Recipe(backend=Backend("onnxruntime"))):
        assert torch.get_num_threads() == before
    with timing_threads(1, Recipe(backend=Backend("onnxruntime")), resized=True):
        assert torch.get_num_threads() == 1  # its pool made one thread wide for timing
    with timing_threads(None, inductor):
        assert torch.get_num_threads() == before
    # ... and read on the timing thread's CPU clock where both arms run wholly on it
    from pgc_daemon.optimizer.search.trial import timing_clock

    assert timing_clock(LIVE_TIMING_THREADS, inductor) == "thread"
    assert timing_clock(LIVE_TIMING_THREADS, Recipe(backend=Backend("eager"))) == "thread"
    assert timing_clock(1, Recipe(backend=Backend("onnxruntime"))) == "wall"  # its own pool
    assert timing_clock(1, Recipe(backend=Backend("onnxruntime")), resized=True) == "thread"
    assert timing_clock(None, inductor) == "wall"  # offline: threads as they are


def _spin(ms: float) -> None:
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


@pytest.mark.serial  # timed on the wall clock
def test_the_thread_clock_times_a_call_without_the_time_it_lost_its_core() -> None:
    """A call that loses its core for a while (here: it sleeps, as a preempted thread waits)
    costs only its own CPU time on the thread clock; on the wall clock the lost time counts,
    and a long arm loses more of it under load than a short one."""

    def base(_x: object) -> None:
        _spin(4.0)

    def preempted(_x: object) -> None:  # 2 ms of work, 5 ms without the core
        _spin(1.0)
        time.sleep(0.005)
        _spin(1.0)

    inputs = [((None,), {})]
    wall = interleaved(base, preempted, inputs, min_rounds=4, max_rounds=6)
    cpu = interleaved(base, preempted, inputs, min_rounds=4, max_rounds=6, clock="thread")
    assert wall.ratio > 1.4 and wall.clock == "wall"
    assert 0.4 < cpu.ratio < 0.6 and cpu.clock == "thread"
    assert cpu.to_dict()["clock"] == "thread"


@pytest.mark.serial  # timed on the wall clock
def test_timing_leaves_the_live_gap_between_calls() -> None:
    """A candidate that pays after idle time (cold caches, sleeping OpenMP threads) is timed
    as live traffic meets it when calls are spaced by the live gap, and flattered back to
    back."""
    last = [0.0]

    def base(_x: object) -> None:
        time.sleep(0.004)

    def cold_after_idle(_x: object) -> None:
        idle = time.monotonic() - last[0] > 0.01
        time.sleep(0.002 + (0.002 if idle else 0.0))
        last[0] = time.monotonic()

    inputs = [((None,), {})]
    packed = interleaved(base, cold_after_idle, inputs, block=3, min_rounds=6, max_rounds=8)
    spaced = interleaved(base, cold_after_idle, inputs, block=3, min_rounds=6, max_rounds=8, gap_s=0.02)
    assert packed.ratio < 0.8 < 0.85 < spaced.ratio


def test_the_live_gap_is_the_idle_time_between_one_processs_requests() -> None:
    from pgc_daemon.optimizer.search.runner import MAX_GAP_PER_CALL, MAX_TIMING_GAP_S, live_gap_s

    # 100 calls in 5 s of windows: one every 50 ms, 10 ms each, so 40 ms idle
    assert live_gap_s({"count": 100, "seconds": 5.0, "mean_ms": 10.0}) == pytest.approx(0.04)
    assert live_gap_s({"count": 10, "seconds": 60.0, "mean_ms": 30.0}) == MAX_TIMING_GAP_S
    # a short call is spaced by a few calls' time, not by the whole idle gap
    assert live_gap_s({"count": 100, "seconds": 5.0, "mean_ms": 0.5}) == pytest.approx(MAX_GAP_PER_CALL * 0.0005)
    assert live_gap_s({"count": 1000, "seconds": 5.0, "mean_ms": 10.0}) == 0.0  # saturated
    assert live_gap_s(None) == 0.0


def test_the_policy_backends_narrow_the_space_to_what_is_installed(mlp_spec: dict) -> None:
    from pgc_daemon.errors import SearchError
    from pgc_daemon.optimizer.search.prepare import allowed_backends, shape_space
    from pgc_daemon.optimizer.search.offers import backends_for

    assert allowed_backends(Policy()) == backends_for()
    torch_only = Policy(backends=["inductor", "eager"])
    space = shape_space(mlp_spec["model"], [{"layer": "net.3", "share": 0.9}], torch_only, sensitivity=None)
    assert space.backends == ("inductor", "eager")
    assert {p["backend"] for p in space.baselines()} == {"inductor"}
    assert allowed_backends(Policy(backends=["inductor-max"])) == ("inductor-max",)
    ort = allowed_backends(Policy(backends=["onnxruntime", "eager"]), installed=("inductor", "eager"))
    assert ort == ("eager",)  # one not installed here is not offered
    with pytest.raises(SearchError, match="none of the policy's backends"):
        allowed_backends(Policy(backends=["openvino"]), installed=("inductor", "eager"))
