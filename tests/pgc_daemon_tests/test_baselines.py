"""What a search tries before its sampler: the fast end for ``fastest``, a ladder from the
accurate end for ``most_accurate`` (fp32 compiled, then rungs in the order of the drop
per-layer sensitivity predicts, all-int8 static last)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from optuna.trial import TrialState

from compiler import Hardware, LayerSensitivity, SensitivityReport
from pgc_daemon.optimizer.search.baselines import (
    BROKEN,
    LADDER_RUNGS,
    baselines_for,
    ranked_out,
    slowdown,
)
from pgc_daemon.optimizer.search.prepare import first_trials
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.optimizer.search.space import Space, build_space
from pgc_daemon.optimizer.search.study import Search
from pgc_daemon.policy import Policy

HW = Hardware(cpu="x", arch="x86_64", cores=2, features={"avx2": True})
PROFILE = [{"layer": "net.3", "share": 0.5}, {"layer": "net.1", "share": 0.3},
           {"layer": "net.5", "share": 0.2}]
#: drop of each layer alone in each choice: net.1 the most sensitive, net.5 the least
DROPS = {
    ("net.1", "int8-dynamic-pc"): 0.004, ("net.1", "int8-static-pc"): 0.006,
    ("net.1", "int8-dynamic-pt"): 0.02,  # over a 1% budget alone: pruned for net.1
    ("net.3", "int8-dynamic-pc"): 0.0005, ("net.3", "int8-static-pc"): 0.001,
    ("net.3", "int8-dynamic-pt"): 0.003,
    ("net.5", "int8-dynamic-pc"): 0.0002, ("net.5", "int8-static-pc"): 0.0004,
    ("net.5", "int8-dynamic-pt"): 0.002,
}
ACCURATE = Policy(max_accuracy_drop=0.01, objective="most_accurate", latency_target_ms=5.0)


def _report() -> SensitivityReport:
    rep = SensitivityReport(metric="cosine", inputs=8)
    for (layer, choice), drop in DROPS.items():
        rep.rows.append(LayerSensitivity(layer, choice, 1 - drop, None, None, None, None))
    return rep


def _space(mlp_spec: dict, report: SensitivityReport | None) -> Space:
    return build_space(mlp_spec["model"], PROFILE, HW, max_hot=2, sensitivity=report,
                       max_drop=0.01, backends=("inductor", "eager", "onnxruntime"),
                       choices=("fp32", "int8-static-pc", "int8-dynamic-pc", "int8-dynamic-pt"))


def _predicted(space: Space, params: dict[str, Any]) -> float:
    """The drop the ladder orders by: each layer alone, summed (net.5 is the default's)."""
    choices = {"net.5": params["default"]} | {n: params[f"layer:{n}"] for n in space.hot_layers}
    return sum(DROPS.get((n, c), 0.0) for n, c in choices.items())


def test_most_accurate_climbs_from_fp32_in_the_order_of_the_predicted_drop(mlp_spec) -> None:
    report = _report()
    space = _space(mlp_spec, report)
    assert set(space.hot_layers) == {"net.1", "net.3"}  # net.5 is the default's
    ladder = baselines_for(space, ACCURATE, report)
    assert ladder[0] == space.params("fp32", "inductor")  # the most accurate compiled recipe
    assert ladder[-1] == space.params("int8-static-pc", "inductor")  # and the fastest end
    assert len(ladder) == LADDER_RUNGS
    assert len({space.recipe(p).hash for p in ladder}) == len(ladder)
    rungs = [_predicted(space, p) for p in ladder[1:-1]]
    assert rungs == sorted(rungs) and rungs[0] > 0.0
    # each layer in its gentlest choice: per-channel dynamic on all three here
    assert ladder[1] == space.params("int8-dynamic-pc", "inductor", **{"net.1": "fp32",
                                                                       "net.3": "fp32"})
    assert space.params("fp32", "inductor", **{"net.3": "int8-dynamic-pc"}) in ladder
    for params in ladder:  # never a choice the space pruned for a layer
        for n in space.hot_layers:
            assert params[f"layer:{n}"] in space.choices_of(n)
    # fastest starts at the fast end instead: all-int8 right after fp32, the peer in its own
    fast = baselines_for(space, Policy(max_accuracy_drop=0.01), report)
    assert [(p["default"], p["backend"]) for p in fast[:3]] == [
        ("fp32", "inductor"), ("int8-static-pc", "inductor"), ("int8-dynamic-pc", "onnxruntime")]


def test_without_sensitivity_the_ladder_takes_the_usual_order_of_lossiness(mlp_spec) -> None:
    space = _space(mlp_spec, None)
    ladder = baselines_for(space, ACCURATE, None)
    assert ladder[0] == space.params("fp32", "inductor")
    assert ladder[-1] == space.params("int8-static-pc", "inductor")
    # per-channel dynamic, the least lossy int8 as a rule, for everything in between
    for params in ladder[1:-1]:
        assert set(params[k] for k in params if k.startswith(("default", "layer:"))) <= {
            "fp32", "int8-dynamic-pc"}


@pytest.mark.parametrize("objective,first", [("most_accurate", "fp32"),
                                             ("fastest", "int8-dynamic-pc")])
def test_before_sensitivity_most_accurate_tries_fp32_compiled_first(mlp_spec, objective,
                                                                    first) -> None:
    space = _space(mlp_spec, None)
    order = [params["default"] for params, _ in first_trials(space, (), objective)]
    assert order[0] == first  # fastest: the peer's int8 first, for an early deployment
    assert ("fp32" in order[1:]) is (objective == "fastest")


def _record(space: Space, params: dict[str, Any], number: int, ratio: float,
            feasible: bool = True) -> TrialRecord:
    recipe = space.recipe(params)
    return TrialRecord(number=number, state="complete", params=params, recipe=recipe.to_dict(),
                       recipe_hash=recipe.hash, label=recipe.label(), ratio=ratio,
                       speedup=1 / ratio, drop=0.0, feasible=feasible)


def test_a_backend_far_behind_the_fastest_is_ranked_out(mlp_spec) -> None:
    space = build_space(mlp_spec["model"], PROFILE, HW, max_hot=1,
                        backends=("inductor", "eager", "onnxruntime", "openvino"))
    records = [_record(space, space.params("int8-static-pc", "inductor"), 0, 0.5),
               _record(space, space.params("int8-dynamic-pc", "onnxruntime"), 1, 0.7),
               _record(space, space.params("int8-dynamic-pc", "onnxruntime"), 2, 0.6),
               _record(space, space.params("int8-static-pc", "openvino"), 3, 0.3,
                       feasible=False)]
    # eager is fp32 eager's own backend (ratio 1, before any trial); ONNX Runtime's best is
    # within 25% of the fastest; OpenVINO's only point broke the budget: not judged yet
    assert ranked_out(records, space.backends) == {("backend", "eager"): pytest.approx(2.0)}
    near = [_record(space, space.params("int8-dynamic-pc", "onnxruntime"), 4, 0.85)]
    assert ranked_out(near, space.backends) == {}  # 1/0.85 < 1.25: eager stays
    assert ranked_out([], space.backends) == {}


def test_a_backend_whose_builds_all_failed_is_ranked_out(mlp_spec) -> None:
    """Two failed builds and none that built: the backend fails for the model (a traced
    branch, an output export cannot flatten), so no more trials go to it."""
    space = build_space(mlp_spec["model"], PROFILE, HW, max_hot=1,
                        backends=("inductor", "onnxruntime", "openvino"))
    ok = _record(space, space.params("int8-static-pc", "inductor"), 0, 0.5)

    def failed(backend: str, number: int, default: str = "int8-dynamic-pc") -> TrialRecord:
        rec = _record(space, space.params(default, backend), number, 1.0)
        rec.state, rec.ratio, rec.feasible = "failed", None, False
        return rec

    once = [ok, failed("onnxruntime", 1)]
    assert ranked_out(once, space.backends) == {}  # one failure may be the recipe's
    twice = once + [failed("onnxruntime", 2, "int8-static-pc")]
    assert ranked_out(twice, space.backends) == {("backend", "onnxruntime"): BROKEN}
    # a backend that built once stays whatever failed beside it
    built = twice + [failed("openvino", 3), failed("openvino", 4, "int8-static-pc"),
                     _record(space, space.params("int8-static-pc", "openvino"), 5, 0.55)]
    assert ("backend", "openvino") not in ranked_out(built, space.backends)
    # with no feasible trial at all the broken backend is still ranked out
    assert ranked_out(twice[1:], space.backends) == {("backend", "onnxruntime"): BROKEN}
    # one converter, two labels: failures of openvino and openvino-f32 add up
    both = build_space(mlp_spec["model"], PROFILE, HW, max_hot=1,
                       backends=("inductor", "openvino", "openvino-f32"))
    ov = [ok, failed("openvino", 1)]
    rec = _record(both, both.params("int8-static-pc", "openvino-f32"), 2, 1.0)
    rec.state, rec.ratio, rec.feasible = "failed", None, False
    assert ranked_out(ov + [rec], both.backends) == {("backend", "openvino"): BROKEN,
                                                     ("backend", "openvino-f32"): BROKEN}


def test_the_sampler_is_not_given_trials_on_a_ranked_out_backend(mlp_spec) -> None:
    """Eager here is twice slower than fp32 (int8 eager on a small model); the baselines put
    Inductor at 2x. After them no trial is spent on eager, and the sampler is told why."""
    space = _space(mlp_spec, None)
    space = Space(hot_layers=space.hot_layers, layer_choices=space.layer_choices,
                  default_choices=space.default_choices, backends=("inductor", "eager"))
    policy = Policy(max_accuracy_drop=0.01)

    def evaluate(number: int, params: dict[str, Any], recipe: Any) -> TrialRecord:
        ratio = 0.5 if recipe.backend.kind == "inductor" else 2.0
        return _record(space, params, number, ratio)

    evaluated: list[TrialRecord] = []
    search = Search(base=None, space=space, policy=policy, timing_inputs=[],
                    evaluator=SimpleNamespace(metric="cosine"),  # type: ignore[arg-type]
                    calibration=[], storage=None, name="rank-out", seed=0, evaluate=evaluate,
                    on_trial=lambda rec, done, budget: evaluated.append(rec))
    search.enqueue(baselines_for(space, policy, None))
    search.run(12)
    assert len(evaluated) == 12
    assert [r for r in evaluated if "eager" in r.label] == []
    told = [t for t in search.study.trials if t.state == TrialState.PRUNED]
    assert told and all(t.params["backend"] == "eager" for t in told)
    assert ranked_out(evaluated, space.backends) == {("backend", "eager"): pytest.approx(2.0)}


def test_a_default_far_behind_on_the_fastest_backend_is_ranked_out(mlp_spec) -> None:
    """The default covers every layer but the hot ones: fp32 there stays slow whatever the
    hot layers do. It is judged on the fastest backend only: a default seen on a slower
    backend alone may be slow because of the backend."""
    space = build_space(mlp_spec["model"], PROFILE, HW, max_hot=1,
                        backends=("inductor", "onnxruntime"))
    hot = space.hot_layers[0]
    fast = _record(space, space.params("int8-static-pc", "inductor"), 0, 0.3)
    fp32_default = _record(space, space.params("fp32", "inductor", **{hot: "int8-static-pc"}),
                           1, 0.6)
    dynamic_on_ort = _record(space, space.params("int8-dynamic-pc", "onnxruntime"), 2, 0.5)
    out = ranked_out([fast, fp32_default, dynamic_on_ort], space.backends)
    assert out == {("default", "fp32"): pytest.approx(2.0),
                   ("backend", "onnxruntime"): pytest.approx(0.5 / 0.3)}
    # int8-dynamic-pc was seen on ONNX Runtime only: not judged as a default yet
    assert ("default", "int8-dynamic-pc") not in out
    sampled = space.params("fp32", "inductor", **{hot: "int8-dynamic-pc"})
    assert slowdown(out, sampled, space.recipe(sampled)) == pytest.approx(2.0)
    other = space.params("int8-dynamic-pc", "inductor")
    assert slowdown(out, other, space.recipe(other)) is None


@pytest.mark.parametrize("bf16", [True, False])
def test_fastest_keeps_its_sensitive_layers_in_bf16_where_offered_else_fp32(mlp_spec, bf16) -> None:
    """A sensitive layer kept out of int8 runs in bf16 where the machine has bf16 units (in
    the int8 graph, compiler._graph_cast): as accurate as fp32 and faster; fp32 elsewhere."""
    choices = ("fp32", "int8-static-pc", "int8-dynamic-pc") + (("bf16",) if bf16 else ())
    space = build_space(mlp_spec["model"], PROFILE, HW, max_hot=2, sensitivity=_report(),
                        max_drop=0.01, backends=("inductor", "eager"), choices=choices)
    policy = Policy(max_accuracy_drop=0.01)
    queued = baselines_for(space, policy, _report())
    kept = [p for p in queued
            if p["default"].startswith("int8") and p["layer:net.1"] != p["default"]]
    assert [p["default"] for p in kept] == ["int8-static-pc", "int8-dynamic-pc"]
    # both hot layers cost a quarter of the budget or more alone (net.3: 0.003 per-tensor)
    got = {p[f"layer:{n}"] for p in kept for n in ("net.1", "net.3")}
    assert got == {"bf16" if bf16 else "fp32"}
