"""Deploying while searching: the first good trial goes out before the search ends, a later
one replaces it only when it is ``min_speedup`` better than what serves or is being deployed,
one deployment is open at a time, ``auto_deploy`` off deploys nothing; the baselines run before
the sensitivity pass and the study stays consistent when sensitivity then prunes choices; a
trial's artifact reaches the variant; the API, the dashboard's data and the demo's numbers say
which deployments were made while searching."""

from __future__ import annotations

import threading
import time
from typing import Any

import optuna
import pytest

import store as st
from compiler import Backend, LayerSensitivity, Quantization, Recipe, SensitivityReport, fingerprint, probe
from pgc_daemon import states
from pgc_daemon.cli._demo import first_active, search_best
from pgc_daemon.modelspec import spec_origin
from pgc_daemon.optimizer.search.prepare import first_trials, make_search, settle, shape_space
from pgc_daemon.optimizer.search.progressive import Progressive, eligible
from pgc_daemon.optimizer.search.results import TrialRecord, feasible
from pgc_daemon.optimizer.search.runner import (
    deployed_while_searching,
    finish_run,
    record_trial,
    run_live_search,
)
from pgc_daemon.optimizer.search.offers import AUTOCAST_BACKENDS, backends_for
from pgc_daemon.optimizer.search.space import PEER_BASELINES
from pgc_daemon.optimizer.search.study import ADOPTS, EARLY
from pgc_daemon.policy import Policy, load_policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.services.deployments import Proposal, Standing, not_faster, propose
from pgc_daemon.settings import Settings
from pgc_daemon.states import D

from .helpers import api_client, wait_for

SPEC = "pgc_daemon.examples.digits:mlp"
RECIPES = [
    Recipe(quantization=Quantization.of({"_default": q}), backend=Backend(b))
    for b in ("inductor", "eager")
    for q in ("int8-static-pc", "int8-dynamic-pc", "int8-dynamic-pt", "int8-weight_only-pc")
]


def _rec(n: int, speedup: float, *, feasible_: bool = True, state: str = "complete", artifact: str | None = None) -> TrialRecord:
    recipe = RECIPES[n]
    return TrialRecord(
        number=n, state=state, params={"default": "x"}, recipe=recipe.to_dict(), recipe_hash=recipe.hash,
        label=recipe.label(), ratio=1 / speedup, speedup=speedup, latency_ms=10 / speedup, baseline_ms=10.0,
        fidelity=0.995, drop=0.005, feasible=feasible_, message=f"{speedup:.2f}x faster than fp32 eager",
        artifact=artifact,
    )


def _model(store: st.Store) -> tuple[int, int]:
    """A model serving its fp32 module (active), and a search run of it that is running."""
    with store.session() as s:
        m = st.repo.upsert_model(s, "mini", spec="pkg:build", graph_hash="g" * 64, metric="top1")
        base = st.repo.get_or_create_variant(s, m.id, Recipe().hash, Recipe().to_dict(), Recipe().label())
        d0 = st.repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
        states.move(s, d0.id, D.ACTIVE, "base")
        run = st.repo.create_search_run(s, m.id, study_name="s", policy_version=1, trigger="t", trials_budget=6)
        st.repo.update_search_run(s, run.id, state="running")
        return m.id, run.id


def _activate(store: st.Store, dep_id: int) -> None:
    """What the agent does with a deployment that passes: build, verify, canary, active."""
    with store.session() as s:
        for step in (D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY):
            states.move(s, dep_id, step, str(step))
        dep = st.repo.get_deployment(s, dep_id)
        previous = st.repo.active_deployment(s, dep.model_id)
        if previous is not None:
            states.move(s, previous.id, D.SUPERSEDED, "replaced")
        states.move(s, dep_id, D.ACTIVE, "canary passed",
                    previous_variant_id=previous.variant_id if previous else None)


def _deployments(store: st.Store, model_id: int) -> list[st.Deployment]:
    with store.session() as s:
        return [d for d in st.repo.list_deployments(s, model_id) if d.source == "search"]


# --------------------------------------------------------------------------- the decision


def test_a_variant_must_beat_the_better_of_what_serves_and_what_is_deployed() -> None:
    base = Standing(serving_speedup=1.0, serving_variant_id=1)
    assert not_faster(1.5, base, 1.2) is None
    assert not_faster(1.1, base, 1.2) == "1.10x is not 1.20x faster than what serves (1.00x)"
    assert not_faster(1.0, base, 1.0) is not None  # as fast is not faster, whatever min_speedup
    assert not_faster(None, base, 1.0) is not None
    busy = Standing(serving_speedup=1.0, serving_variant_id=1, busy_id=7, busy_state="canary", busy_speedup=1.5)
    assert busy.best == 1.5
    assert "what is being deployed (1.50x)" in (not_faster(1.7, busy, 1.2) or "")
    assert not_faster(1.8, busy, 1.2) is None
    serving_faster = Standing(serving_speedup=2.0, serving_variant_id=2, busy_id=8, busy_speedup=1.5)
    assert not_faster(2.3, serving_faster, 1.2) is not None and not_faster(2.4, serving_faster, 1.2) is None


def test_only_timed_feasible_variants_are_deployed_while_searching() -> None:
    policy = Policy()
    assert eligible(_rec(0, 2.0), policy)
    assert not eligible(_rec(0, 2.0, feasible_=False), policy)
    assert not eligible(_rec(0, 2.0, state="pruned"), policy)
    assert not eligible(_rec(0, 2.0), Policy(auto_deploy=False))
    fp32 = TrialRecord(number=0, state="complete", params={}, recipe=Recipe().to_dict(), recipe_hash=Recipe().hash,
                       label="fp32", ratio=0.5, speedup=2.0, feasible=True)
    assert not eligible(fp32, policy)  # the unmodified model serves already
    dup = _rec(0, 2.0)
    dup.duplicate = True
    assert not eligible(dup, policy)


# --------------------------------------------------------------------------- through the store


def test_trials_are_deployed_while_searching_one_open_deployment_at_a_time(store: st.Store) -> None:
    model_id, run_id = _model(store)
    attached = time.time()
    p = Progressive(store, model_id, run_id, Policy(min_speedup=1.2), budget=6)
    assert p.offer(_rec(0, 3.0, feasible_=False), 1) is None  # infeasible
    assert p.offer(_rec(1, 1.1), 2) is None  # not 1.2x faster than the fp32 module
    assert _deployments(store, model_id) == []

    first = p.offer(_rec(2, 1.5, artifact="a" * 64), 3)
    assert first is not None
    with store.session() as s:
        dep = st.repo.get_deployment(s, first)
        assert dep.state == D.CANDIDATE and dep.source == "search" and dep.expected_speedup == 1.5
        assert dep.reason == (f"search run {run_id}: deployed while searching (trial 3 of 6): "
                              "1.50x faster than fp32 eager")
        assert st.repo.get_variant(s, dep.variant_id).artifact == "a" * 64  # from the proposal

    api = api_client(store)
    deps = api.get("/api/models/mini/deployments").json()
    assert (deps[0]["id"], deps[0]["while_searching"], deps[0]["search_run_id"]) == (first, True, run_id)
    assert deps[1]["source"] == "attach" and deps[1]["while_searching"] is False
    assert api.get("/api/models/mini").json()["search"]["deployed_while_searching"] == [first]
    assert api.get("/api/models/mini/searches").json()[0]["deployed_while_searching"] == [first]

    assert p.offer(_rec(3, 1.7), 4) is None and p.pending is None  # not 1.2x past 1.5x in flight
    assert p.offer(_rec(4, 2.0), 5) is None  # good enough, but deployment `first` is open
    assert p.pending is not None and p.pending.label == RECIPES[4].label()
    assert p.offer(_rec(5, 1.9), 6) is None and p.pending.label == RECIPES[4].label()  # the faster stays
    assert p.retry() is None and len(_deployments(store, model_id)) == 1  # still open

    _activate(store, first)
    second = p.retry()  # the open one ended: the remembered trial goes out
    assert second is not None and p.pending is None
    with store.session() as s:
        dep = st.repo.get_deployment(s, second)
        assert "deployed while searching (trial 5 of 6)" in dep.reason and dep.expected_speedup == 2.0
    active = api.get("/api/models/mini").json()["active"]
    assert active["deployment_id"] == first and active["while_searching"] is True
    tl = api.get("/api/models/mini/timeline").json()
    assert [m["while_searching"] for m in tl["markers"] if m["deployment_id"] == first] == [True]

    # the end of the run: the final choice was deployed while searching already
    _activate(store, second)
    assert p.finish(_rec(4, 2.0)) is None
    assert len(_deployments(store, model_id)) == 2
    with store.session() as s:
        at, label = first_active(s, model_id, attached) or (None, None)
        dep = st.repo.get_deployment(s, first)
        assert at == next(t.at for t in dep.transitions if t.to_state == D.ACTIVE)
        assert label == RECIPES[2].label()


def test_the_retry_thread_proposes_the_remembered_trial_when_the_open_one_ends(store: st.Store) -> None:
    model_id, run_id = _model(store)
    p = Progressive(store, model_id, run_id, Policy(), budget=4, retry_s=0.05).start()
    try:
        first = p.offer(_rec(0, 1.5), 1)
        assert first is not None and p.offer(_rec(1, 3.0), 2) is None
        time.sleep(0.3)
        assert len(_deployments(store, model_id)) == 1  # nothing while `first` is open
        _activate(store, first)
        wait_for(lambda: len(_deployments(store, model_id)) == 2, timeout=10, what="the remembered trial proposed")
        assert p.pending is None
    finally:
        p.stop()


def test_auto_deploy_off_proposes_nothing_while_searching_nor_at_the_end(store: st.Store) -> None:
    model_id, run_id = _model(store)
    policy = Policy(auto_deploy=False)
    p = Progressive(store, model_id, run_id, policy, budget=2)
    assert p.offer(_rec(0, 3.0), 1) is None and p.pending is None
    assert p.finish(_rec(0, 3.0)) is None
    assert _deployments(store, model_id) == []
    with store.session() as s:
        kept = st.repo.list_events(s, model_id, kind="kept")
        assert [e.message for e in kept] == [f"kept the current module: found {RECIPES[0].label()} (3.00x); auto_deploy is off"]


def test_the_final_choice_waits_for_the_open_deployment_then_replaces_it(store: st.Store) -> None:
    """A final choice better than the deployment still open goes out once that one ends; it
    is the run's final choice, not a deployment made while searching."""
    model_id, run_id = _model(store)
    policy = Policy(min_speedup=1.2)
    p = Progressive(store, model_id, run_id, policy, budget=3)
    first = p.offer(_rec(0, 1.5), 1)
    assert first is not None
    agent = threading.Timer(0.5, _activate, args=(store, first))
    agent.start()
    with store.session() as s:  # what finish_run records before proposing
        st.repo.update_search_run(s, run_id, state="done", finished_at=time.time())
    second = p.finish(_rec(1, 2.5), wait_s=30)
    agent.join()
    assert second is not None
    with store.session() as s:
        dep = st.repo.get_deployment(s, second)
        assert dep.reason == f"search run {run_id}: 2.50x faster than fp32 eager"
    deps = {d["id"]: d for d in api_client(store).get("/api/models/mini/deployments").json()}
    assert deps[first]["while_searching"] is True and deps[second]["while_searching"] is False
    # a choice that is not 1.2x better than what now serves is kept out, with the reason
    _activate(store, second)
    p = Progressive(store, model_id, run_id, policy, budget=3)
    assert p.finish(_rec(2, 2.6)) is None
    with store.session() as s:
        assert "is not 1.20x faster than what serves (2.50x)" in st.repo.list_events(s, model_id, kind="kept")[0].message


def test_a_final_choice_rolled_back_while_searching_says_why_the_current_module_stays(store: st.Store) -> None:
    """The run's final choice went out while searching and its canary rolled it back: the
    run ends with a ``kept`` event that names it and the rollback, not in silence (seen in CI:
    a search's 3.99x choice lost its canary 1.60x slower, and nothing said why it was not
    serving)."""
    model_id, run_id = _model(store)
    p = Progressive(store, model_id, run_id, Policy(), budget=3)
    dep_id = p.offer(_rec(1, 3.0), 1)
    assert dep_id is not None
    with store.session() as s:
        for step in (D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY):
            states.move(s, dep_id, step, str(step))
        states.move(s, dep_id, D.ROLLED_BACK, "live latency 0.86 ms vs 0.54 ms for the control")
    assert p.finish(_rec(1, 3.0)) is None
    assert len(_deployments(store, model_id)) == 1  # not proposed twice
    with store.session() as s:
        kept = [e.message for e in st.repo.list_events(s, model_id, kind="kept")]
    assert kept == [
        f"kept the current module: the run's choice {RECIPES[1].label()} was rolled back while searching "
        f"(deployment {dep_id}: live latency 0.86 ms vs 0.54 ms for the control)"
    ]
    # a final choice that was deployed and serves says nothing more
    second = Progressive(store, model_id, run_id, Policy(), budget=3)
    other = second.offer(_rec(2, 4.0), 1)
    assert other is not None
    _activate(store, other)
    assert second.finish(_rec(2, 4.0)) is None
    with store.session() as s:
        assert len(st.repo.list_events(s, model_id, kind="kept")) == 1


# --------------------------------------------------------------------------- artifacts


def test_a_trials_artifact_is_recorded_on_its_variant(store: st.Store) -> None:
    model_id, run_id = _model(store)
    digest = "0123456789abcdef" * 4
    with store.session() as s:
        record_trial(s, model_id, run_id, _rec(0, 2.0, artifact=digest))
        record_trial(s, model_id, run_id, _rec(1, 2.0))
    with store.session() as s:
        variants = {v.recipe_hash: v for v in st.repo.list_variants(s, model_id)}
        assert variants[RECIPES[0].hash].artifact == digest
        assert variants[RECIPES[1].hash].artifact is None
    # the final proposal carries it too, for a variant no trial of this store recorded
    chosen = _rec(2, 2.0, artifact="f" * 64)
    proposal = Proposal(chosen.recipe_hash, chosen.recipe, chosen.label, 2.0, 0.99, "found", artifact="f" * 64)
    assert propose(store, model_id, proposal, Policy()) is not None
    with store.session() as s:
        assert {v.recipe_hash: v for v in st.repo.list_variants(s, model_id)}[RECIPES[2].hash].artifact == "f" * 64


# --------------------------------------------------------------------------- the study


def _replay(policy: Policy, speedups: dict[str, float]) -> Any:
    """Replaces building and timing (as the search benchmark does) with fixed numbers."""

    def evaluate(number: int, params: dict[str, Any], recipe: Recipe) -> TrialRecord:
        speedup = speedups.get(recipe.label(), 1.1)
        rec = TrialRecord(number=number, state="complete", params=dict(params), recipe=recipe.to_dict(),
                          recipe_hash=recipe.hash, label=recipe.label(), ratio=1 / speedup, speedup=speedup,
                          latency_ms=10 / speedup, baseline_ms=10.0, fidelity=0.998, drop=0.002,
                          message=f"{speedup:.2f}x")
        rec.feasible = feasible(policy, rec)
        rec.violation = policy.normalized_violation(rec.drop, rec.latency_ms)
        return rec

    return evaluate


def _sensitivity() -> SensitivityReport:
    """net.1 loses int8 static; int8 dynamic per-channel breaks the budget on net.5, which the
    default covers (net.3 and net.1 are hot)."""
    rep = SensitivityReport(metric="top1", inputs=8)
    for layer, choice, fid in [("net.1", "int8-static-pc", 0.95), ("net.3", "int8-static-pc", 0.999),
                               ("net.5", "int8-dynamic-pc", 0.9), ("net.5", "int8-static-pc", 0.999)]:
        rep.rows.append(LayerSensitivity(layer, choice, fid, None, None, None, None, "ok"))
    return rep


PROFILE = [{"layer": "net.3", "share": 0.7}, {"layer": "net.1", "share": 0.2}, {"layer": "net.5", "share": 0.1}]


def test_baselines_before_sensitivity_keep_the_study_consistent_and_resumable(
    mlp_spec: dict[str, Any], tmp_path: Any
) -> None:
    """The baselines are evaluated before sensitivity; sensitivity then prunes choices Optuna
    already... would have recorded, had the baselines been told with parameters. They get the
    final space's parameters instead; a resumed study (same or another sensitivity) goes on."""
    model = mlp_spec["model"]
    inputs = [(a, {}) for a in mlp_spec["example_inputs"][:8]]
    # PyTorch's backends: the peers' own baselines (see the real search below) aside, so the
    # three Inductor baselines are the whole early set
    policy = Policy(max_accuracy_drop=0.02, backends=["inductor", "eager"])
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    seen: list[tuple[int, int, str]] = []

    def search(sensitivity: SensitivityReport | None, *, early: bool = False) -> Any:
        out = make_search(base=model, inputs=inputs, profile=PROFILE, policy=policy, name="s", storage=storage,
                          metric="top1", sensitivity=sensitivity, early=early,
                          on_trial=lambda r, done, budget: seen.append((r.number, done, r.label)))
        out.evaluate = _replay(policy, {"int8-static-pc · inductor": 3.0})
        return out

    first = search(None, early=True)
    order = first_trials(first.space)
    assert [p["default"] for p, _ in order] == ["int8-static-pc", "int8-dynamic-pc", "fp32"]
    assert all(r.backend.kind == "inductor" for _, r in order)
    early = first.run_first(order, 6)
    assert [r.number for r in early] == [0, 1, 2] and [s[1] for s in seen] == [1, 2, 3]
    assert all(not t.params and t.state == optuna.trial.TrialState.FAIL for t in first.study.trials)
    assert len(first.finished()) == 3  # kept, counted, nothing lost if the worker dies now

    report = _sensitivity()
    settle(first, shape_space(model, PROFILE, policy, sensitivity=report), policy=policy, sensitivity=report)
    space = first.space
    assert first.sensitivity is report  # what orders the neighbor moves from now on
    assert "int8-dynamic-pc" not in space.default_choices and "int8-static-pc" not in space.choices_of("net.1")
    adopted = [t for t in first.study.trials if ADOPTS in t.user_attrs]
    # int8 static cannot be said any more (net.1 would follow the default into int8 static),
    # nor int8 dynamic (pruned from the default): fp32 · Inductor alone is adopted
    assert [(t.user_attrs[ADOPTS], t.state) for t in adopted] == [(2, optuna.trial.TrialState.COMPLETE)]
    fp32_ind = adopted[0]
    assert fp32_ind.params == space.params("fp32", "inductor")
    assert {k: tuple(d.choices) for k, d in fp32_ind.distributions.items()} == space.distributions()
    assert fp32_ind.values == pytest.approx([1 / 1.1, 0.002])
    assert sorted(r.number for r in first.finished()) == [0, 1, 2]
    assert sum(bool(t.user_attrs.get("record")) for t in first.study.trials) == 3  # each record held once

    result = first.run(6)  # suggests in the pruned space: no "dynamic value space" error
    assert len(result.records) == 6 and result.chosen is not None
    assert result.chosen.label == "int8-static-pc · inductor"  # an early record takes part
    assert len({r.recipe_hash for r in result.records}) == 6

    # resumed with the same sensitivity: nothing adopted twice, the budget counts every trial
    again = search(report)
    assert again.sensitivity is report
    assert len([t for t in again.study.trials if ADOPTS in t.user_attrs]) == 1
    assert len(again.finished()) == 6
    assert len(again.run(7).records) == 7
    # resumed after the space moved (no pruning now): the study's recorded choices are kept
    moved = search(None)
    assert moved.space.default_choices == space.default_choices
    assert len(moved.run(8).records) == 8
    assert sum(1 for t in moved.study.trials if t.user_attrs.get(EARLY)) == 3


# --------------------------------------------------------------------------- end to end


def _served(store: st.Store, spec: dict[str, Any], policy: dict[str, Any]) -> int:
    """What the agent leaves in the store for a served model (inputs, a live per-layer
    profile of the fp32 module, the policy), without serving it: the test plays the agent."""
    reservoir = InputReservoir(32)
    for args in spec["example_inputs"][:16]:
        reservoir.offer(tuple(args), {})
    now = time.time()
    with store.session() as s:
        model = st.repo.upsert_model(
            s, "mlp", spec=SPEC, spec_origin=spec_origin(SPEC).to_json(), graph_hash=fingerprint(spec["model"]),
            hardware=probe().key(), metric="top1", input_signature={"threads": 2},
        )
        st.repo.save_reservoir(s, model.id, reservoir.serialize(), len(reservoir), reservoir.seen)
        base = st.repo.get_or_create_variant(s, model.id, Recipe().hash, Recipe().to_dict(), Recipe().label())
        st.repo.add_window_stats(s, layers=[st.LayerStatRow(
            model_id=model.id, variant_id=base.id, window_start=now - 30, window_end=now - 20, layer=row["layer"],
            op_type="Linear", shape_bucket="b64 1x8x8", count=50, mean_ms=ms, p50_ms=ms, p95_ms=ms, p99_ms=ms,
            share=row["share"]) for row, ms in zip(PROFILE, (0.7, 0.2, 0.1))])
        st.repo.put_policy(s, model.id, policy)
        return model.id


def _queue(store: st.Store, model_id: int, name: str = "study-p") -> int:
    with store.session() as s:
        snap = load_policy(s, model_id)
        return st.repo.create_search_run(s, model_id, study_name=name, policy_version=snap.version, trigger="test",
                                         trials_budget=snap.policy.max_trials, policy=snap.to_json()).id


class Agent:
    """Plays the agent through the store: every candidate deployment is built, verified and
    canaried (state by state) a moment after it appears; it notes whether the search was still
    running when each appeared."""

    def __init__(self, store: st.Store, model_id: int, run_id: int) -> None:
        self.store, self.model_id, self.run_id = store, model_id, run_id
        self.seen: dict[int, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            with self.store.session() as s:
                run = st.repo.get_search_run(s, self.run_id)
                open_ = [d for d in st.repo.list_deployments(s, self.model_id) if d.state in states.OPEN]
            for d in open_:
                self.seen.setdefault(d.id, run.state)
                _activate(self.store, d.id)

    def __enter__(self) -> Agent:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.mark.slow
def test_a_real_search_deploys_while_searching_after_baselines_that_ran_before_sensitivity(
    mlp_spec: dict[str, Any], settings: Settings, store: st.Store
) -> None:
    policy = {"max_trials": 4, "max_accuracy_drop": 0.02, "min_speedup": 1.0}
    model_id = _served(store, mlp_spec, policy)
    run_id = _queue(store, model_id)
    with Agent(store, model_id, run_id) as agent:
        result = run_live_search(settings, run_id)
    with store.session() as s:
        run = st.repo.get_search_run(s, run_id)
        trials = sorted(st.repo.list_trials(s, model_id, run_id=run_id), key=lambda t: t.created_at)
        sensitivity = st.repo.load_sensitivity(s, model_id)
        deployments = sorted(_deployments(store, model_id), key=lambda d: d.id)
    assert run.state == "done" and result.feasible, run.message
    assert len(trials) == 4
    # the baselines (every layer int8 first: each installed peer in its own int8, built in
    # seconds, then Inductor's static (and, with AMX, static with bf16 between) and dynamic;
    # fp32 last) were timed before sensitivity
    # was measured, as many as the budget of 4 takes
    assert sensitivity
    measured_at = min(r.created_at for r in sensitivity)
    before = [t for t in trials if t.created_at < measured_at]
    installed = backends_for()
    expected = [*((choice, peer) for peer, choice in PEER_BASELINES.items() if peer in installed),
                ("int8-static-pc", "inductor"),
                *(("int8-static-pc", b) for b in AUTOCAST_BACKENDS[1:] if b in installed),  # AMX
                ("int8-dynamic-pc", "inductor"), ("fp32", "inductor")][:4]
    assert [(t.params["default"], t.params["backend"]) for t in before] == expected
    # the first feasible trial faster than fp32 eager went out while the run was running
    good = [t for t in trials if t.feasible and t.speedup and t.speedup > 1.0]
    assert good, [(t.params, t.speedup, t.feasible) for t in trials]
    assert deployments and agent.seen[deployments[0].id] == "running"
    first = deployments[0]
    assert first.variant_id == good[0].variant_id
    created = first.transitions[0]  # the reason it was created with (each move has its own)
    assert created.to_state == D.CANDIDATE
    assert created.reason.startswith(f"search run {run_id}: deployed while searching (trial ")
    views = {d["id"]: d for d in api_client(store).get("/api/models/mlp/deployments").json()}
    assert views[first.id]["while_searching"] is True and views[first.id]["search_run_id"] == run_id
    # the last deployment made during the baselines got its profiling twin before sensitivity
    # was measured when it is compiled (its per-layer rows need not wait for the search's end)
    with store.session() as s:
        last = [d for d in deployments if d.created_at < measured_at][-1]
        variant = s.get(st.Variant, last.variant_id)
        backend, twin, variant_id = variant.recipe["backend"]["kind"], variant.profile_artifact, variant.id
        twins = [(e.data or {}).get("variant_id") for e in st.repo.list_events(s, model_id, kind="profile_twin")
                 if e.at < measured_at]
    if backend == "inductor":
        assert twin is not None and twins == [variant_id], twins
    else:  # eager or a peer: nothing to build a twin of
        assert twins == [] and twin is None
    # each later deployment was min_speedup (1.0: strictly) faster than the one before it
    speeds = [d.expected_speedup for d in deployments]
    assert speeds == sorted(speeds) and len(set(speeds)) == len(speeds)
    with store.session() as s:
        assert st.repo.active_deployment(s, model_id).id == deployments[-1].id
        assert search_best(s, model_id) == pytest.approx(max(t.speedup for t in trials if t.feasible))

    # the study resumes in the space sensitivity shaped, with the early trials counted
    with store.session() as s:
        st.repo.put_policy(s, model_id, {**policy, "max_trials": 5, "auto_deploy": False})
    run2 = _queue(store, model_id)
    result2 = run_live_search(settings, run2)
    assert len(result2.records) == 5
    study = optuna.load_study(study_name="study-p", storage=settings.optuna_storage())
    records = [t.user_attrs["record"] for t in study.trials if t.user_attrs.get("record")]
    evaluated = {r["number"] for r in records if not r["duplicate"]}
    assert len(evaluated) == 5
    # what a trial's build saved as an artifact (when the compiler keeps one) is on its variant
    saved = {r["recipe_hash"]: r["artifact"] for r in records if r.get("artifact")}
    with store.session() as s:
        on_variants = {v.recipe_hash: v.artifact for v in st.repo.list_variants(s, model_id)}
    assert all(on_variants[h] == digest for h, digest in saved.items()), (saved, on_variants)
    with store.session() as s:
        assert len(st.repo.list_trials(s, model_id, run_id=run2)) == 1  # one new trial, the rest resumed


def test_the_trial_deployed_last_while_searching_is_the_one_whose_twin_is_built(store: st.Store) -> None:
    model_id, run_id = _model(store)
    progressive = Progressive(store, model_id, run_id, Policy(), 4)
    records = [_rec(0, 2.0), _rec(1, 3.0), _rec(2, 4.0)]
    assert deployed_while_searching(records, progressive) is None  # nothing deployed
    progressive.proposed = {records[0].recipe_hash: 1, records[1].recipe_hash: 2, "elsewhere": 3}
    assert deployed_while_searching(records, progressive) is records[1]


def test_finish_run_without_progressive_state_still_proposes_the_final_choice(store: st.Store) -> None:
    """The end-of-run proposal stays: a run that deployed nothing while searching proposes its
    final choice after its end is recorded (so it is not marked as made while searching)."""
    from pgc_daemon.optimizer.search.results import SearchResult

    model_id, run_id = _model(store)
    chosen = _rec(0, 2.0)
    result = SearchResult(records=[chosen], front=[chosen], chosen=chosen, closest=[], baseline_ms=10.0,
                          metric="top1", message="chose it", study_name="s")
    finish_run(store, model_id, run_id, result, Policy())
    deps = api_client(store).get("/api/models/mini/deployments").json()
    assert deps[0]["source"] == "search" and deps[0]["while_searching"] is False
    assert deps[0]["reason"] == f"search run {run_id}: 2.00x faster than fp32 eager"
    with store.session() as s:
        assert st.repo.get_search_run(s, run_id).state == "done"


# --------------------------------------------------------------------------- the demo


def test_the_demo_waits_for_the_search_and_reports_when_the_first_variant_went_active(
    store: st.Store, capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace

    from rich.console import Console

    from pgc_daemon.cli._demo import Traffic, _phase, _print_report, _report

    model_id, run_id = _model(store)
    attached = time.time() - 5.0
    with store.session() as s:
        record_trial(s, model_id, run_id, _rec(0, 1.8))
        record_trial(s, model_id, run_id, _rec(1, 2.2, feasible_=False))  # infeasible: not the best
    p = Progressive(store, model_id, run_id, Policy(), budget=4)
    dep = p.offer(_rec(0, 1.8), 1)

    def phase() -> Any:
        with store.session() as s:
            return _phase(s, s.get(st.Model, model_id), None)

    now = phase()
    assert now.line.startswith("deploying: candidate") and "searching: 0/6 trials" in now.line
    assert not now.serving and not now.settled
    _activate(store, dep)
    now = phase()
    assert now.serving and not now.settled and "deployed while searching" in now.line
    with store.session() as s:
        st.repo.update_search_run(s, run_id, state="done", finished_at=time.time())
    now = phase()
    assert now.serving and now.settled and not now.kept

    served = SimpleNamespace(settings=Settings(store_url=store.url),
                             profiler=SimpleNamespace(stalled=2))
    with store.session() as s:
        report = _report(s, s.get(st.Model, model_id), served, Traffic(served, 1.0, 1), "deployed", 60.0,
                         None, attached)
    with store.session() as s:
        went_active = next(t.at for t in st.repo.get_deployment(s, dep).transitions if t.to_state == D.ACTIVE)
    assert report["first_active_s"] == pytest.approx(went_active - attached, abs=0.05)
    assert report["first_active_label"] == RECIPES[0].label()
    assert report["search_best_speedup"] == 1.8 and report["deployed_while_searching"] is True
    assert {"speedup", "search_speedup", "canary_speedup", "trials", "outcome"} <= set(report)
    assert report["sampled_calls_stalled"] == 2  # the agent's profiler's count
    _print_report(Console(file=None, force_terminal=False, width=200), report)
    out = capsys.readouterr().out
    assert f"first active deployment {report['first_active_s']:.0f} s after attach" in out
    assert "best in search 1.80x" in out
    # a store reused from an earlier run: the deployment it serves went active before attach
    with store.session() as s:
        again = _report(s, s.get(st.Model, model_id), served, Traffic(served, 1.0, 1), "deployed",
                        60.0, None, time.time())
    assert again["first_active_s"] is None and again["restored"] is True
    _print_report(Console(file=None, force_terminal=False, width=200), again)
    out = capsys.readouterr().out
    assert "restored at attach" in out and "no deployment active yet" not in out
