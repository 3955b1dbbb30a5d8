"""The policy travels with the work: a run keeps the snapshot it was queued under, its worker
searches under that, budgets continue a study and study terms start a new one; and a worker
refuses a spec that builds another model than the one served."""

from __future__ import annotations

from typing import Any

import optuna
import pytest

import store as st
from pgc_daemon.modelspec import spec_origin
from pgc_daemon import attach
from pgc_daemon.optimizer.daemon import Daemon
from compiler import Recipe, fingerprint, probe
from pgc_daemon.optimizer.search.runner import run_live_search, run_snapshot, warm_start_recipes
from pgc_daemon.optimizer.search.worker import main as worker_main
from pgc_daemon.policy import Policy, PolicySnapshot, load_policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings

from .helpers import Load, wait_for

SPEC = "pgc_daemon.examples.digits:mlp"


def served_model(store: st.Store, spec: dict[str, Any], *, graph_hash: str | None = None) -> int:
    """What ``attach`` leaves in the store for a served model, without serving it."""
    reservoir = InputReservoir(32)
    for args in spec["example_inputs"][:16]:
        reservoir.offer(tuple(args), {})
    with store.session() as s:
        model = st.repo.upsert_model(
            s, "mlp", spec=SPEC, spec_origin=spec_origin(SPEC).to_json(),
            graph_hash=graph_hash or fingerprint(spec["model"]),
            hardware=probe().key(), metric="top1", input_signature={"threads": 2},
        )
        st.repo.save_reservoir(s, model.id, reservoir.serialize(), len(reservoir), reservoir.seen)
        return model.id


def queue_run(store: st.Store, model_id: int, name: str = "study-a") -> int:
    """A run queued the way the daemon queues one: with the policy snapshot of now."""
    with store.session() as s:
        snap = load_policy(s, model_id)
        return st.repo.create_search_run(
            s, model_id, study_name=name, policy_version=snap.version, trigger="test",
            trials_budget=snap.policy.max_trials, policy=snap.to_json(),
        ).id


# ---------------------------------------------------------------- policy arithmetic


def test_the_policy_methods_give_the_numbers_the_search_used() -> None:
    p = Policy(max_accuracy_drop=0.02, latency_target_ms=4.0)
    assert p.violations(0.03, 5.0) == pytest.approx({"accuracy_drop": 0.01, "latency_ms": 1.0})
    assert p.violations(None, None) == pytest.approx({"accuracy_drop": -0.02})
    assert p.normalized_violation(0.03, 5.0) == pytest.approx(0.01 / 0.02 + 1.0 / 4.0)
    assert Policy(max_accuracy_drop=0.0).normalized_violation(0.002, None) == pytest.approx(2.0)


def test_a_run_reads_its_snapshot_and_old_runs_the_stored_policy(store: st.Store) -> None:
    with store.session() as s:
        mid = st.repo.upsert_model(s, "m").id
        st.repo.put_policy(s, mid, {"max_trials": 3})
        snap = PolicySnapshot(Policy(max_trials=7), 5)
        new = st.repo.create_search_run(s, mid, study_name="a", policy_version=5, trigger="t",
                                        trials_budget=7, policy=snap.to_json())
        old = st.repo.create_search_run(s, mid, study_name="a", policy_version=1, trigger="t",
                                        trials_budget=3)
        assert run_snapshot(s, new) == snap
        assert run_snapshot(s, old) == PolicySnapshot(Policy(max_trials=3), 1)


# ---------------------------------------------------------------- warm start


def test_a_new_study_warm_starts_from_the_recipes_other_studies_chose(store: st.Store) -> None:
    fp32, inductor = Recipe(), Recipe.from_dict({"backend": {"kind": "inductor"}})
    with store.session() as s:
        mid = st.repo.upsert_model(s, "m").id
        variants = {r.hash: st.repo.get_or_create_variant(s, mid, r.hash, r.to_dict(), r.label()).id
                    for r in (fp32, inductor)}
        for name, recipe in (("a", fp32), ("b", inductor), ("b", inductor), ("c", None), ("new", fp32)):
            run = st.repo.create_search_run(s, mid, study_name=name, policy_version=1, trigger="t",
                                            trials_budget=2)
            if recipe is not None:
                st.repo.update_search_run(s, run.id, chosen_variant_id=variants[recipe.hash])
        # newest first, each recipe once, the study itself left out
        assert warm_start_recipes(s, mid, "new") == [inductor, fp32]
        assert warm_start_recipes(s, mid, "new", limit=1) == [inductor]
        assert warm_start_recipes(s, mid, "b") == [fp32]


# ---------------------------------------------------------------- the worker


def test_the_worker_refuses_a_spec_that_builds_another_model(
    mlp_spec: dict[str, Any], settings: Settings, store: st.Store
) -> None:
    model_id = served_model(store, mlp_spec, graph_hash="0" * 64)
    run_id = queue_run(store, model_id)
    assert worker_main(["--run-id", str(run_id), "--store", settings.store_url]) == 1
    with store.session() as s:
        run = st.repo.get_search_run(s, run_id)
        assert run.state == "failed" and run.finished_at is not None
        assert "builds a different model than the one served" in run.message
        assert "000000000000" in run.message
        assert st.repo.list_trials(s, model_id) == []
        events = st.repo.list_events(s, model_id, kind="search_failed")
        assert len(events) == 1 and events[0].message == run.message
    assert optuna.get_all_study_names(settings.optuna_storage()) == []  # refused before searching


@pytest.mark.slow
def test_trials_carry_the_policy_version_their_run_was_queued_under(
    mlp_spec: dict[str, Any], settings: Settings, store: st.Store
) -> None:
    model_id = served_model(store, mlp_spec)
    with store.session() as s:
        st.repo.put_policy(s, model_id, {"max_trials": 2, "max_accuracy_drop": 0.02, "auto_deploy": False})
    run_id = queue_run(store, model_id)
    with store.session() as s:  # the policy changes before the worker gets going
        st.repo.put_policy(s, model_id, {"max_trials": 5, "max_accuracy_drop": 0.5, "auto_deploy": False})
        assert load_policy(s, model_id).version == 2
    result = run_live_search(settings, run_id)
    with store.session() as s:
        run = st.repo.get_search_run(s, run_id)
        trials = st.repo.list_trials(s, model_id, run_id=run_id)
    assert run.state in ("done", "infeasible") and run.policy_version == 1
    assert run.message == result.message
    assert 1 <= len(trials) <= 2  # version 1's budget, not version 2's
    for t in trials:  # feasibility judged under version 1's accuracy budget
        if t.state == "complete":
            assert t.feasible == ((t.accuracy_drop or 0.0) <= 0.02)
    study = optuna.load_study(study_name="study-a", storage=settings.optuna_storage())
    records = [t.user_attrs["record"] for t in study.trials if t.user_attrs.get("record")]
    assert records and {r["policy_version"] for r in records} == {1}


# ---------------------------------------------------------------- a real daemon


@pytest.mark.slow
def test_budgets_continue_the_study_and_study_terms_start_a_new_one(
    mlp_spec: dict[str, Any], settings: Settings, store: st.Store
) -> None:
    """End to end on SQLite: raising ``max_trials`` (with ``time_budget_s`` and ``canary_s``
    changed too) resumes the finished study with its trials kept; changing
    ``max_accuracy_drop`` starts a new one. Each run keeps the snapshot it was queued under.
    The policy's ``backends`` hold: every trial ran on one it names (ONNX Runtime and eager:
    the study mechanics are under test here, not Inductor, whose builds take longer)."""
    base = {"max_trials": 1, "max_accuracy_drop": 0.02, "auto_deploy": False,
            "backends": ["onnxruntime", "eager"]}
    served = attach(mlp_spec["model"], name="mlp", spec=SPEC, settings=settings, policy=base)
    daemon = Daemon(settings, store)
    inputs = [a[0] for a in mlp_spec["example_inputs"]]

    def next_run(after: int) -> Any:
        def finished() -> Any:
            with store.session() as s:
                runs = st.repo.list_search_runs(s, served.model_id) if served.model_id else []
            if not runs or runs[0].id <= after:
                return None
            if runs[0].state == "failed":
                raise AssertionError(f"search failed: {runs[0].message}")
            return runs[0] if runs[0].state in ("done", "infeasible") else None

        return wait_for(finished, timeout=300, every=0.5, what=f"a search run after {after}")

    def put(settings_: dict[str, Any]) -> None:
        with store.session() as s:
            st.repo.put_policy(s, served.model_id, settings_)

    def evaluated(name: str) -> int:
        study = optuna.load_study(study_name=name, storage=settings.optuna_storage())
        return sum(1 for t in study.trials
                   if t.user_attrs.get("record") and not t.user_attrs["record"]["duplicate"])

    try:
        with Load(served, mlp_spec["model"], inputs, threads=1):
            daemon.start()
            run1 = next_run(0)
            assert run1.trigger == "first search for this model" and run1.policy["version"] == 1
            with store.session() as s:
                kept = {(t.number, t.variant_id) for t in st.repo.list_trials(s, served.model_id)}
            assert evaluated(run1.study_name) == 1

            put({**base, "max_trials": 2, "time_budget_s": 600.0, "canary_s": 2.0})
            run2 = next_run(run1.id)
            assert run2.study_name == run1.study_name  # the same study, continued
            assert run2.trigger == "trial budget raised to 2 (was 1)"
            assert (run2.policy_version, run2.policy["version"], run2.trials_budget) == (2, 2, 2)
            assert run2.policy["settings"]["canary_s"] == 2.0
            assert evaluated(run1.study_name) == 2  # the budget counts the first run's trials
            with store.session() as s:
                after = {(t.number, t.variant_id) for t in st.repo.list_trials(s, served.model_id)}
            assert kept < after

            put({**base, "max_accuracy_drop": 0.03})
            run3 = next_run(run2.id)
            assert run3.study_name != run1.study_name
            assert run3.trigger == "policy changed (version 3)" and run3.policy_version == 3
            assert evaluated(run3.study_name) == 1
            assert evaluated(run1.study_name) == 2  # the old study is left as it was
            with store.session() as s:
                trials = st.repo.list_trials(s, served.model_id)
            assert len(trials) == 3
            assert {t.params["backend"] for t in trials} <= {"onnxruntime", "eager"}
    finally:
        daemon.stop()
        served.close()
