"""The search itself: the policy's pick, infeasible outcomes, and the traffic shape deciding
where candidates are measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler import Backend, LayerQuant, Quantization, Recipe
from pgc_daemon.policy import Policy
from pgc_daemon.optimizer.search.prepare import make_search, offline_profile, timing_inputs_for
from pgc_daemon.optimizer.search.study import TrialRecord, pareto_front, pick, shape_signature, study_name


def _rec(label: str, ratio: float, drop: float, feasible: bool = True) -> TrialRecord:
    return TrialRecord(number=0, state="complete", params={}, recipe={}, recipe_hash=label,
                       label=label, ratio=ratio, speedup=1 / ratio, drop=drop, feasible=feasible)


def test_pick_takes_the_fastest_feasible_and_breaks_near_ties_by_accuracy() -> None:
    a, b, c = _rec("a", 0.40, 0.008), _rec("b", 0.405, 0.002), _rec("c", 0.30, 0.05, feasible=False)
    assert pick([a, b, c], Policy()) is b  # within 2% of the fastest: the more accurate one
    # a difference in drop under a tenth of the budget is no reason to be slower (demo 20:
    # cosine 0.9936 against 0.9935 chose a variant 2% slower, which was then not deployed)
    d = _rec("d", 0.405, 0.0075)
    assert pick([a, d], Policy()) is a and pick([d, a], Policy()) is a
    e = _rec("e", 0.405, 0.0065)  # 0.0015 lower: over a tenth of the budget (0.001)
    assert pick([a, e], Policy()) is e
    assert pick([a, c], Policy()) is a
    assert pick([c], Policy()) is None
    accurate = Policy(objective="most_accurate", latency_target_ms=10)
    assert pick([a, b], accurate) is b


def test_pareto_front() -> None:
    a, b, c = _rec("a", 0.4, 0.01), _rec("b", 0.5, 0.001), _rec("c", 0.6, 0.02)
    assert pareto_front([a, b, c]) == [a, b]


def test_offline_latencies_follow_the_ratios_on_one_fp32_latency(mlp_spec: dict) -> None:
    """Regression (a digits GRU through ``pgc optimize``): each trial timed fp32 beside its
    candidate while the machine's speed moved, so the table showed 0.64 ms at 1.42x beside
    0.39 ms at 1.40x, and a latency target judged those milliseconds, not the ratios."""
    model, inputs = mlp_spec["model"], [(a, {}) for a in mlp_spec["example_inputs"][:4]]
    policy = Policy(latency_target_ms=0.5, objective="fastest")
    search = make_search(base=model, inputs=inputs, profile=[], name="one-reference",
                         policy=policy, storage=None, metric="top1")
    fast, slow = _rec("fast", 1 / 1.42, 0.0), _rec("slow", 1 / 1.40, 0.0)
    fast.latency_ms, fast.baseline_ms, fast.feasible = 0.636, 0.903, False  # a slow moment
    slow.latency_ms, slow.baseline_ms = 0.394, 0.552
    third = _rec("third", 1 / 1.05, 0.0)
    third.latency_ms, third.baseline_ms = 0.566, 0.594
    result = search.result([fast, slow, third])
    assert result.baseline_ms == 0.594  # the median of the trials' fp32
    assert fast.latency_ms == pytest.approx(0.594 / 1.42) and fast.feasible
    assert third.latency_ms == pytest.approx(0.594 / 1.05) and not third.feasible  # over 0.5
    assert result.chosen is fast


def test_recipes_the_compiler_refuses_cost_no_trial(mlp_spec: dict) -> None:
    """Regression (``bench/foreign.py``, a transformer): 5 of 12 trials were max-autotune
    recipes with an int8 dynamic layer, which the compiler refuses before building."""
    from compiler import refused

    model, inputs = mlp_spec["model"], [(a, {}) for a in mlp_spec["example_inputs"][:4]]
    policy = Policy(backends=["inductor-max"], max_trials=12)
    search = make_search(base=model, inputs=inputs, profile=[], name="refusals", policy=policy,
                         storage=None, metric="top1")
    dynamic = [c for c in search.space.default_choices if "dynamic" in c]
    assert dynamic  # the space offers them: every such recipe is refused on this backend
    evaluated: list[Recipe] = []

    def evaluate(number: int, params: dict, recipe: Recipe) -> TrialRecord:
        evaluated.append(recipe)
        rec = _rec(recipe.label(), 0.5 + 0.01 * number, 0.0)
        rec.number, rec.recipe_hash, rec.params = number, recipe.hash, params
        rec.recipe = recipe.to_dict()  # the moves go next to the best so far
        return rec

    search.evaluate = evaluate
    recipes = map(search.space.recipe, search.space.grid())
    buildable = {r.hash for r in recipes if not refused(r, model)}
    assert len(buildable) < search.space.size
    result = search.run(len(buildable))  # every one: neither the sampler nor the moves get stuck
    assert len(evaluated) == len(buildable) == len(result.records)
    assert not any(refused(r, model) for r in evaluated)
    assert refused(search.space.recipe({"default": dynamic[0], "backend": "inductor-max"}), model)
    # a dynamic default that reaches no linear (every one has a rule of its own) builds
    static = {n: LayerQuant.parse("int8-static-pc") for n in ("net.1", "net.3", "net.5")}
    rules = Quantization.of({"_default": dynamic[0], **static})
    recipe = Recipe(quantization=rules, backend=Backend("inductor", "max-autotune"))
    assert refused(recipe, model) is None


def test_study_names_follow_policy_and_traffic_shape() -> None:
    p = Policy()
    base = study_name("m", "h" * 64, "cpu-x", p, "b1 s128")
    assert base == study_name("m", "h" * 64, "cpu-x", Policy(), "b1 s128")
    assert base != study_name("m", "h" * 64, "cpu-x", Policy(max_accuracy_drop=0.02), "b1 s128")
    assert base != study_name("m", "h" * 64, "cpu-x", p, "b8 s128")
    assert base != study_name("m", "g" * 64, "cpu-x", p, "b1 s128")


def test_shape_signature_ignores_rare_shapes() -> None:
    assert shape_signature({"b1 s128": 90, "b8 s128": 10}) == "b1 s128"
    assert shape_signature({"b1 s128": 50, "b8 s128": 50}) == "b1 s128|b8 s128"
    assert shape_signature({}) == ""


def test_timing_inputs_follow_the_traffic_histogram() -> None:
    small = [((torch.zeros(1, 4),), {})] * 10
    big = [((torch.zeros(8, 4),), {})] * 10
    chosen = timing_inputs_for(small + big, {"b1 4": 75, "b8 4": 25}, n=8)
    batches = [ex[0][0].shape[0] for ex in chosen]
    assert batches.count(1) == 6 and batches.count(8) == 2


@pytest.mark.serial  # speedups measured under each traffic
@pytest.mark.slow
def test_the_search_times_variants_under_the_traffic_it_is_given(mlp_spec: dict[str, Any]) -> None:
    """The same model searched under batch-64 and under batch-1 traffic: each search times
    its trials on the inputs it was given (a batch-64 call costs several batch-1 calls), so
    the speedups it records are those of that traffic; each chooses the fastest feasible
    variant it measured, never slower than fp32 eager. (Which variant wins at batch 1 is
    the machine's to say: with AOTInductor packages int8 may win both.)"""
    model = mlp_spec["model"]
    batch64 = [(a, {}) for a in mlp_spec["example_inputs"]]
    batch1 = [((a[0][i : i + 1],), {}) for a in mlp_spec["example_inputs"][:2] for i in range(16)]
    results = {}
    for name, inputs in (("b1", batch1), ("b64", batch64)):
        search = make_search(
            base=model, inputs=inputs, profile=offline_profile(model, inputs), name=f"traffic-{name}",
            policy=Policy(max_trials=3, max_accuracy_drop=0.02), storage=None, metric="top1",
        )
        results[name] = search.run(3)
    for result in results.values():
        assert result.chosen is not None and result.baseline_ms
        timed = [r for r in result.records if r.feasible and r.speedup is not None]
        fastest = max([1.0] + [r.speedup for r in timed])  # fp32 eager itself takes part
        assert result.chosen.speedup >= fastest / 1.02 - 1e-9  # ties within 2% go to accuracy
        assert result.chosen.recipe == Recipe().to_dict() or result.chosen.speedup >= 1.0
    assert results["b64"].baseline_ms > 4 * results["b1"].baseline_ms
    assert results["b64"].chosen.speedup > 1.3
    speedups = {name: {r.recipe_hash: r.speedup for r in res.records if r.speedup} for name, res in results.items()}
    shared = set(speedups["b1"]) & set(speedups["b64"]) - {Recipe().hash}
    assert shared, "both searches timed at least one same non-fp32 recipe"
    assert any(abs(speedups["b1"][h] - speedups["b64"][h]) > 0.05 * speedups["b64"][h] for h in shared)


@pytest.mark.slow
def test_a_most_accurate_search_starts_at_fp32_compiled_and_chooses_the_least_drop(
    mlp_spec: dict[str, Any]
) -> None:
    """Under a latency target everything meets, the most accurate recipe is fp32 compiled:
    the ladder tries it first (a fastest search would try all-int8 next), and the choice is
    the least drop among what was measured."""
    model = mlp_spec["model"]
    inputs = [(a, {}) for a in mlp_spec["example_inputs"]]
    policy = Policy(max_trials=2, objective="most_accurate", latency_target_ms=1e4)
    search = make_search(base=model, inputs=inputs, profile=offline_profile(model, inputs),
                         name="accurate", policy=policy, storage=None, metric="top1")
    result = search.run(2)
    first, second = result.records[:2]
    assert first.label.startswith("fp32 · inductor") and first.drop == 0.0
    assert "int8-static-pc ·" not in second.label  # the next rung, not the fast end
    assert result.chosen is not None
    assert result.chosen.drop == min(r.drop for r in result.records if r.state == "complete")


def test_a_budget_nothing_meets_reports_the_closest_and_chooses_nothing(mlp_spec: dict[str, Any]) -> None:
    model = mlp_spec["model"]
    inputs = [(a, {}) for a in mlp_spec["example_inputs"]]
    # a latency target no variant can meet on this machine
    policy = Policy(max_trials=2, latency_target_ms=1e-6)
    search = make_search(base=model, inputs=inputs, profile=[], name="hopeless", policy=policy,
                         storage=None, metric="top1")
    result = search.run(2)
    assert result.chosen is None and not result.feasible
    assert result.closest and "no feasible variant" in result.message
    assert all(r.state == "complete" for r in result.closest)


def test_a_resumed_study_gives_the_store_the_trials_it_lacks(store: Any) -> None:
    """A store started afresh beside a kept Optuna storage (or a worker killed between Optuna's
    tell and pgc's record) still shows every finished trial of the study it resumes, once."""
    import store as st
    from pgc_daemon.optimizer.search.runner import record_resumed, record_trial

    def rec(number: int, recipe: Recipe, speedup: float) -> TrialRecord:
        return TrialRecord(number=number, state="complete", params={}, recipe=recipe.to_dict(),
                           recipe_hash=recipe.hash, label=f"trial {number}", speedup=speedup,
                           fidelity=0.995, drop=0.005, feasible=True)

    fp32 = Recipe()
    compiled = Recipe.from_dict({"backend": {"kind": "inductor"}})
    with store.session() as s:
        model = st.repo.upsert_model(s, "m")
        old = st.repo.create_search_run(s, model.id, study_name="study-a", policy_version=1,
                                        trigger="test", trials_budget=4)
        other = st.repo.create_search_run(s, model.id, study_name="study-b", policy_version=1,
                                          trigger="test", trials_budget=4)
        new = st.repo.create_search_run(s, model.id, study_name="study-a", policy_version=1,
                                        trigger="resuming the study", trials_budget=4)
        record_trial(s, model.id, old.id, rec(0, fp32, 1.0))   # recorded before the restart
        record_trial(s, model.id, other.id, rec(1, fp32, 1.0))  # same number, another study
        finished = [rec(0, fp32, 1.0), rec(1, compiled, 1.3)]
        assert record_resumed(s, model.id, new.id, "study-a", finished) == 1
        assert record_resumed(s, model.id, new.id, "study-a", finished) == 0  # never twice
        mine = st.repo.list_trials(s, model.id, run_id=new.id)
        assert [(t.number, t.speedup) for t in mine] == [(1, 1.3)]


def test_trials_are_judged_against_fp32_as_it_serves(mlp_spec: dict[str, Any]) -> None:
    """Timed at one thread beside live traffic, a trial's ratio is turned into one against fp32
    at the count it serves at: there fp32 took 10 ms at two threads and 12.5 at one, so fp32
    itself timed at one thread is 1.25x slower than fp32 as it serves."""
    from pgc_daemon.optimizer.search.trial import ServingThreads

    model = mlp_spec["model"]
    inputs = [(a, {}) for a in mlp_spec["example_inputs"]]
    serving = ServingThreads(2, {1: (1.25, 1.15, 1.36)})
    search = make_search(base=model, inputs=inputs, profile=[], name="served", storage=None,
                         policy=Policy(max_trials=1), metric="top1", timing_threads=1,
                         serving_threads=serving, reference_ms=10.0)
    rec = search.evaluate(0, {}, Recipe())
    assert rec.state == "complete", rec.message
    assert rec.timing["serving_scale"] == 1.25
    assert rec.ratio == pytest.approx(rec.timing["ratio"] * 1.25)
    assert rec.speedup == pytest.approx(1 / rec.ratio)
    assert rec.latency_ms == pytest.approx(rec.ratio * 10.0)
    assert "as it serves" in rec.message and "same 1 thread(s)" in rec.message
    # the count fp32 serves at, one never measured, or one not slower with confidence (the
    # tuner would not act on it either) changes nothing
    assert serving.scale(2) == 1.0 and serving.scale(4) == 1.0
    assert ServingThreads(2, {1: (0.93, 0.85, 1.02)}).scale(1) == 1.0
    assert ServingThreads(2, {1: (1.05, 0.97, 1.12)}).scale(1) == 1.0


def test_a_peer_beside_live_traffic_is_timed_with_a_pool_of_one_on_the_threads_clock(
    mlp_spec: dict[str, Any],
) -> None:
    """ONNX Runtime timed at its pool's two threads on wall time, against fp32 eager at two,
    came out far ahead of what it served at (fp32's team stalls beside the serving process);
    it is timed as torch's backends are: a session of one thread, which computes on the
    timing thread, on that thread's CPU clock, against fp32 at one, scaled to fp32 as it
    serves. The variant that serves keeps its own pool."""
    import time

    from compiler import at_threads, build
    from pgc_daemon.optimizer.search.trial import ServingThreads, timing_module

    model = mlp_spec["model"]
    inputs = [(a, {}) for a in mlp_spec["example_inputs"]]
    ort = Recipe(backend=Backend("onnxruntime"))
    search = make_search(base=model, inputs=inputs, profile=[], name="peer", storage=None,
                         policy=Policy(max_trials=1), metric="top1", timing_threads=1,
                         serving_threads=ServingThreads(2, {1: (1.25, 1.15, 1.36)}))
    rec = search.evaluate(0, {}, ort)
    assert rec.state == "complete", rec.message
    assert rec.timing["clock"] == "thread" and rec.timing["serving_scale"] == 1.25
    assert "same 1 thread(s)" in rec.message

    variant = build(model, ort, example=inputs[0])
    one = timing_module(variant.module, 1, ort)
    assert one is not None and one.threads == 1 and variant.module.threads == torch.get_num_threads()
    x = inputs[0][0][0]
    torch.testing.assert_close(one(x), variant.module(x))
    assert timing_module(variant.module, None, ort) is None  # offline: as built
    assert timing_module(model, 1, Recipe(backend=Backend("inductor"))) is None
    assert at_threads(model, 1) is None  # torch's own threads: nothing to resize
    # at one thread ONNX Runtime computes on the calling thread: its CPU clock sees it all
    t0, p0 = time.thread_time(), time.process_time()
    for _ in range(500):
        one(x)
    assert time.thread_time() - t0 >= 0.9 * (time.process_time() - p0)


def test_fp32_as_it_serves_comes_from_the_latest_thread_decision_for_it(store: Any) -> None:
    import store as st
    from pgc_daemon.optimizer.search.runner import serving_threads
    from pgc_daemon.optimizer.search.trial import ServingThreads

    with store.session() as s:
        model = st.repo.upsert_model(s, "m")
        assert serving_threads(s, model.id, 1) is None  # no decision yet
        st.repo.add_event(s, model.id, "threads", "older", data={
            "variant_id": 1, "threads": 1, "vs_chosen": {"2": [1.25, 1.1, 1.4]}})
        st.repo.add_event(s, model.id, "threads", "fp32", data={
            "variant_id": 1, "threads": 2, "vs_chosen": {"1": [1.24, 1.18, 1.31]}})
        st.repo.add_event(s, model.id, "threads", "another variant", data={
            "variant_id": 2, "threads": 1, "vs_chosen": {"2": [1.26, 1.18, 1.33]}})
        st.repo.add_event(s, model.id, "threads", "a reprobe, no decision", data={
            "variant_id": 1, "reprobe": True, "load_cores": [1.0, 0.1]})
        found = serving_threads(s, model.id, 1)
    assert found == ServingThreads(2, {1: (1.24, 1.18, 1.31)})
    assert found.scale(1) == 1.24
    assert ServingThreads.from_event({"threads": 2, "vs_chosen": {"x": 1}}) is None


class _Tokens(torch.nn.Module):
    """A small text model that honours its mask: embedding, two linears, masked mean pool."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(300, 64)
        self.ff = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                      torch.nn.Linear(256, 64))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ff(self.emb(ids))
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1)


def test_a_trial_on_variable_lengths_reports_a_static_variant_that_measured_fp32() -> None:
    """Unpadded text: a variant built for one length would serve every other length with the
    fp32 model, and its timing would be fp32's; the trial says so instead of reporting ~1x.
    The same model with the sequence axis dynamic is measured as itself."""
    g = torch.Generator().manual_seed(1)
    inputs = []
    for length in (12, 7, 19, 25, 9, 31, 16, 22):
        inputs.append(((torch.randint(1, 300, (1, length), generator=g),
                        torch.ones(1, length, dtype=torch.long)), {}))
    search = make_search(base=_Tokens().eval(), inputs=inputs, profile=[], name="lengths",
                         storage=None, policy=Policy(max_trials=2), metric="cosine")
    static = search.evaluate(0, {}, Recipe.from_dict({"backend": {"kind": "inductor"}}))
    assert static.state == "failed"
    assert "ran the original fp32 model" in static.message and "dynamic shapes" in static.message
    dynamic = search.evaluate(1, {}, Recipe.from_dict(
        {"backend": {"kind": "inductor"}, "dynamic": {"dim": 1}}))
    assert dynamic.state == "complete", dynamic.message
    assert dynamic.fidelity > 0.9999


class _Branchy(torch.nn.Module):
    """A model whose Python branches on its data: ``torch.export`` cannot trace it, so no
    AOTInductor package can be built, while ``torch.compile`` runs it (a graph break)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.sum() > 0:  # data-dependent
            h = h * 2
        return self.b(h)


def test_a_compiled_variant_without_an_artifact_is_not_deployed_in_a_live_search(tmp_path) -> None:
    """Serving processes load what a worker built and never compile. A variant whose package
    could not be built (``torch.compile`` stood in) would make each of them compile, so a
    search that shares artifacts with them does not time or choose it; offline it is timed."""
    from compiler import CompileCache

    g = torch.Generator().manual_seed(0)
    inputs = [((torch.randn(4, 32, generator=g),), {}) for _ in range(8)]
    recipe = Recipe.from_dict({"backend": {"kind": "inductor"}})
    cache = CompileCache(tmp_path / "cache", artifacts=tmp_path / "artifacts")
    live = make_search(base=_Branchy().eval(), inputs=inputs, profile=[], name="branchy",
                       storage=None, policy=Policy(max_trials=2), metric="cosine", cache=cache)
    rec = live.evaluate(0, {}, recipe)
    assert rec.state == "failed" and rec.artifact is None
    assert rec.message.startswith("not deployable: AOTInductor package not built"), rec.message
    assert "would have to compile it" in rec.message and "timing" not in rec.phases
    assert pick([rec], Policy()) is None
    offline = make_search(base=_Branchy().eval(), inputs=inputs, profile=[], name="branchy-off",
                          storage=None, policy=Policy(max_trials=2), metric="cosine")
    rec = offline.evaluate(0, {}, recipe)
    assert rec.state == "complete", rec.message
    assert rec.fidelity > 0.9999 and "timing" in rec.phases
