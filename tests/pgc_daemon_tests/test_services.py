"""The services shared by the API and the CLI: one way to create and cancel deployments, one
suggestion engine, one trial mapping."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import store as st
from compiler import Recipe
from pgc_daemon import states
from pgc_daemon.services import suggest
from pgc_daemon.services.deployments import (
    Conflict,
    Proposal,
    propose,
    request_cancel,
    request_deploy,
)
from pgc_daemon.services.queries import front_summary, trial_public, trials
from pgc_daemon.policy import Policy
from pgc_daemon.states import D

ROOT = Path(__file__).resolve().parents[2]


def _model(store: st.Store) -> int:
    with store.session() as s:
        m = st.repo.upsert_model(s, "mini", spec="pkg:build", graph_hash="g" * 64, metric="cosine")
        base = st.repo.get_or_create_variant(s, m.id, Recipe().hash, Recipe().to_dict(), Recipe().label())
        d0 = st.repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
        states.move(s, d0.id, D.ACTIVE, "base")
        return m.id


# --------------------------------------------------------------------------- one path


def test_only_services_create_deployments_outside_the_agent() -> None:
    callers = []
    for path in (ROOT / "pgc_daemon").rglob("*.py"):
        if "agent" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "create_deployment":
                callers.append(str(path.relative_to(ROOT)))
    assert callers == ["pgc_daemon/services/deployments.py"], callers


def test_propose_and_request_deploy_share_the_one_open_deployment_rule(store: st.Store) -> None:
    model_id = _model(store)
    chosen = Proposal(Recipe().hash, Recipe().to_dict(), "x", 3.0, 1.0, "found")
    with store.session() as s:
        manual = request_deploy(s, "mini", recipe=Recipe(), reason="by hand")
    assert manual.state == D.CANDIDATE
    assert propose(store, model_id, chosen, Policy()) is None  # kept: one is open
    with store.session() as s:
        events = st.repo.list_events(s, model_id)
        assert any(f"deployment {manual.id} is still candidate" in e.message for e in events)
        request_cancel(s, "mini", manual.id, "changed my mind")
        other = request_deploy(s, "mini", recipe=Recipe(), reason="again")  # none open now
        with pytest.raises(Conflict, match=f"deployment {other.id} is still candidate"):
            request_deploy(s, "mini", variant_id=other.variant_id, reason="twice")


# --------------------------------------------------------------------------- cancel


@pytest.mark.parametrize("state", [D.CANDIDATE, D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY])
def test_cancel_moves_any_open_deployment_to_cancelled(store: st.Store, state: D) -> None:
    _model(store)
    with store.session() as s:
        dep = request_deploy(s, "mini", recipe=Recipe(), reason="r")
        path = [D.CANDIDATE, D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY]
        for step in path[1 : path.index(state) + 1]:
            states.move(s, dep.id, step, step)
        done = request_cancel(s, "mini", dep.id, "stop")
        assert done.state == D.CANCELLED and done.reason == "stop"
        last = done.transitions[-1]
        assert (last.from_state, last.to_state) == (state, D.CANCELLED)


def test_cancel_of_a_finished_or_foreign_deployment_is_refused(store: st.Store) -> None:
    model_id = _model(store)
    with store.session() as s:
        active = st.repo.active_deployment(s, model_id)
        assert active is not None
        with pytest.raises(Conflict, match="active; only an open one"):
            request_cancel(s, "mini", active.id, "no")
        with pytest.raises(st.NotFound):
            request_cancel(s, "mini", 999, "no")
        other = st.repo.upsert_model(s, "other", spec="pkg:other", graph_hash="h" * 64, metric="cosine")
        with pytest.raises(st.NotFound):
            request_cancel(s, "other", active.id, "no")
        assert other.id != model_id


def test_cancel_losing_the_race_is_a_conflict(store: st.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent moved the deployment between the check and the compare-and-set."""
    _model(store)
    with store.session() as s:
        dep = request_deploy(s, "mini", recipe=Recipe(), reason="r")

    def raced(*_a: object, **_k: object) -> None:
        raise st.StoreConflict(f"deployment {dep.id} was moved from candidate meanwhile")

    monkeypatch.setattr(states, "move", raced)
    with store.session() as s, pytest.raises(Conflict, match="meanwhile"):
        request_cancel(s, "mini", dep.id, "stop")


# --------------------------------------------------------------------------- suggestions


@pytest.mark.parametrize(
    ("op", "share", "text"),
    [
        ("LayerNorm", 0.15, "hot: a quantization or fusion candidate"),  # inclusive bound
        ("LayerNorm", 0.149, None),
        ("Linear", 0.02, "int8 candidate"),
        ("LSTM", 0.03, "int8 candidate"),  # LSTM and GRU have int8 kernels
        ("Linear", 0.019, None),
        ("Embedding", 0.1, None),
    ],
)
def test_for_layer_thresholds(op: str, share: float, text: str | None) -> None:
    assert suggest.for_layer(op, share) == text


def _hw(**kw: object) -> SimpleNamespace:
    base = {"features": {"avx512_vnni": True}, "gpu_capability": None, "int8_fast": True, "bf16_fast": False}
    return SimpleNamespace(**{**base, **kw})


def test_the_engine_ranks_hot_layers_groups_hardware_and_layout() -> None:
    layers = [
        {"layer": "enc.0.ff", "op_type": "Linear", "latency_ratio": 0.15},
        {"layer": "enc.1.ff", "op_type": "Linear", "latency_ratio": 0.1},
        {"layer": "norm", "op_type": "LayerNorm", "latency_ratio": 0.05},
    ]
    groups = [{"group": "enc.*.ff", "layers": 2, "op_type": "Linear", "latency_ratio": 0.25}]
    layout = {"ratio": 0.03, "ms_per_call": 0.1, "layers": {"conv1": 1}, "ops": {"aten::copy_": 1}}
    found = suggest.suggest(layers, groups=groups, hardware=_hw(), layout=layout)
    assert [(s.kind, s.target) for s in found] == [
        ("hot_layer", "enc.0.ff"), ("hot_group", "enc.*.ff"), ("int8_path", "Linear"), ("layout", "conv1"),
    ]
    assert "AVX512-VNNI" in found[2].message
    slow = suggest.suggest(layers, hardware=_hw(int8_fast=False, bf16_fast=True, features={}))
    assert [s.kind for s in slow] == ["hot_layer", "int8_path", "bf16_path"]
    assert "gains little" in slow[1].message
    # the API's rows (``share``) go through the same rules
    assert [s.target for s in suggest.suggest([{"layer": "a", "op_type": "X", "share": 0.2}])] == ["a"]


def test_time_between_kernels_is_not_called_a_quantization_candidate() -> None:
    from profiler._compiled import BETWEEN

    assert suggest.BETWEEN == BETWEEN  # the row the profiler writes
    found = suggest.suggest([{"layer": BETWEEN, "op_type": "wrapper", "latency_ratio": 0.6},
                             {"layer": "fc", "op_type": "Linear", "latency_ratio": 0.3}])
    assert [s.target for s in found] == [BETWEEN, "fc"]
    assert "between kernels" in found[0].message and "quantization" not in found[0].message
    assert "quantization or fusion candidate" in found[1].message


def test_the_cli_and_the_api_use_the_one_engine() -> None:
    from pgc_daemon.cli import profile

    report = {
        "layers": [{"layer": "a", "op_type": "Linear", "latency_ratio": 0.15}],
        "groups": [], "device": "cpu", "layout": None,
    }
    assert profile.suggestions(report, _hw()) == [
        s.to_dict() for s in suggest.suggest(report["layers"], hardware=_hw())
    ]
    assert profile.suggestions(report, _hw())[0]["kind"] == "hot_layer"  # 15% is hot in both


# --------------------------------------------------------------------------- trials


def test_one_trial_mapping_for_trials_and_front(store: st.Store) -> None:
    model_id = _model(store)
    with store.session() as s:
        model = st.repo.get_model(s, "mini")
        base = st.repo.list_variants(s, model_id)[0]
        run = st.repo.create_search_run(s, model_id, study_name="s", policy_version=1, trigger="t", trials_budget=1)
        t = st.repo.add_trial(s, run_id=run.id, model_id=model_id, variant_id=base.id, number=0,
                              state="complete", speedup=1.0, latency_ms=2.0, baseline_ms=2.0,
                              fidelity=1.0, accuracy_drop=0.0, feasible=True, params={}, duration_s=1.0)
        listed = trials(s, model)
        front = front_summary(s, model)
        one = trial_public(t, base)
    assert listed == [one]
    point = front["points"][0]
    assert {k: point[k] for k in one} == one and point["pareto"] and point["deployed"]
