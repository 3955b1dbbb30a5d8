"""The whole loop on a small real model: attach -> live profile in SQLite -> Optuna search in
a worker process -> hot-swap through the canary, checked through the store and the API."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from fastapi.testclient import TestClient

import store as st
from pgc_daemon import attach
from pgc_daemon.api import create_app
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.optimizer.workers import pid_namespace
from pgc_daemon.settings import Settings
from tests.dashboards_tests.realdata import POLICY, RealData

from .helpers import Load, wait_for

pytestmark = pytest.mark.slow


def test_loop_profiles_searches_and_deploys(real_data: RealData) -> None:
    """The session's loop (``real_data``: the digits MLP attached under traffic, a daemon
    whose worker searches, deployments through the canary; then a rollback and a redeployment
    through the API, which the dashboard tests read), checked through the store and the API."""
    # the serving process loaded what the worker built: the worker wrote its artifacts to the
    # daemon's work dir (it once fell back to ./.pgc, and the agent compiled here)
    if real_data.agent_loads is None:
        pytest.skip("a reused store (PGC_TEST_REALDATA): what the agent loaded is not known")
    assert real_data.agent_loads >= 1 and real_data.agent_compiles == 0
    store = st.open_store(real_data.store_url)
    try:
        with store.session() as s:
            model = st.repo.get_model(s, real_data.model)
            assert st.repo.layer_profile(s, model.id), "per-layer stats in the store"
            trials = st.repo.list_trials(s, model.id)
            assert 1 <= len(trials) <= POLICY["max_trials"]
            assert all(t.params for t in trials)
            assert any(t.state == "complete" and t.feasible for t in trials)
            run = st.repo.list_search_runs(s, model.id)[0]
            assert run.state == "done"
            dep = st.repo.get_deployment(s, real_data.search_deployment_id)
            # what served is the run's final choice, or the run says why not: the choice did
            # not beat what served, or its canary rolled it back while searching
            kept = [e for e in st.repo.list_events(s, model.id, kind="kept") if e.at >= run.finished_at]
            lost = [d for d in st.repo.list_deployments(s, model.id)  # (dep: the API's rollback)
                    if d.variant_id == run.chosen_variant_id and d.state == "rolled_back"
                    and d.id != dep.id]
            assert dep.source == "search" or kept, (dep.source, run.message)
            assert run.chosen_variant_id == dep.variant_id or kept or lost, (run.message, dep.reason)
            # a compiled choice gets its profiling twin, built by the worker after the run
            chosen = st.repo.get_variant(s, run.chosen_variant_id)
            if chosen.recipe["backend"]["kind"] == "inductor":
                assert chosen.profile_artifact is not None
                # (a baseline deployed while searching gets its own twin: its event is apart)
                (event,) = [e for e in st.repo.list_events(s, model.id, kind="profile_twin")
                            if e.data["variant_id"] == chosen.id]
                assert event.data["artifact"] == chosen.profile_artifact
            assert [t.to_state for t in dep.transitions][:6] == [
                "candidate", "building", "warming", "verifying", "canary", "active"
            ]  # and then rolled back through the API
            active = st.repo.active_deployment(s, model.id)
            assert active is not None and active.variant_id == real_data.deployed_variant_id
        settings = Settings(store_url=real_data.store_url, work_dir=str(real_data.root / "work"))
        api = TestClient(create_app(settings, store=store), base_url="http://127.0.0.1")
        body = api.get(f"/api/models/{real_data.model}").json()
        assert body["active"]["deployment_id"] == active.id
        assert body["active"]["expected_speedup"] == pytest.approx(active.expected_speedup)
        front = api.get(f"/api/models/{real_data.model}/front").json()
        assert any(p["deployed"] for p in front["points"])
    finally:
        store.close()


def test_a_daemon_killed_mid_search_resumes_its_study(mlp_spec: dict[str, Any], settings: Settings, store: st.Store) -> None:
    import optuna

    # the study's mechanics, not its backends: ONNX Runtime and eager trials take seconds
    # (an Inductor build takes 30-130 s on 2 cores)
    policy = {"max_trials": 4, "canary_s": 1.0, "min_speedup": 1.0, "max_accuracy_drop": 0.02,
              "backends": ["onnxruntime", "eager"]}
    served = attach(mlp_spec["model"], name="mlp", spec="pgc_daemon.examples.digits:mlp",
                    settings=settings, policy=policy)
    inputs = [a[0] for a in mlp_spec["example_inputs"]]
    first = Daemon(settings, store)
    try:
        with Load(served, mlp_spec["model"], inputs, threads=1):
            first.start()

            def trials_done() -> int:
                with store.session() as s:
                    return len(st.repo.list_trials(s, served.model_id)) if served.model_id else 0

            wait_for(lambda: trials_done() >= 2, timeout=300, every=0.2, what="two finished trials")
            first.stop(kill_workers=True)  # the daemon and its worker die mid-search
            with store.session() as s:
                run1 = st.repo.list_search_runs(s, served.model_id)[0]
                kept = {(t.number, t.variant_id, t.speedup) for t in st.repo.list_trials(s, served.model_id)}
            assert run1.state == "running"
            # where its worker ran: the next daemon sees it gone at once (no heartbeat wait)
            assert run1.pid_ns == pid_namespace() and run1.host == socket.gethostname()
            study = optuna.load_study(study_name=run1.study_name, storage=settings.optuna_storage())
            finished_before = {t.number for t in study.trials if t.state.is_finished() and t.user_attrs.get("record")}

            second = Daemon(settings, store)
            second.start()
            try:
                def done() -> Any:
                    with store.session() as s:
                        runs = st.repo.list_search_runs(s, served.model_id)
                        return runs[0] if runs[0].id != run1.id and runs[0].state in ("done", "infeasible", "failed") else None

                run2 = wait_for(done, timeout=300, every=0.5, what="the resumed search")
            finally:
                second.stop()
        with store.session() as s:
            assert st.repo.get_search_run(s, run1.id).state == "failed"
            assert run2.state == "done" and run2.trigger == "resuming the study"
            assert run2.study_name == run1.study_name
            after = {(t.number, t.variant_id, t.speedup) for t in st.repo.list_trials(s, served.model_id)}
        assert kept <= after  # every trial finished before the kill is still there
        study = optuna.load_study(study_name=run1.study_name, storage=settings.optuna_storage())
        # a trial the kill interrupted holds a withdrawn (None) record: tried again, not counted
        evaluated = [t for t in study.trials
                     if t.user_attrs.get("record") and not t.user_attrs["record"]["duplicate"]]
        assert finished_before <= {t.number for t in evaluated}
        assert len(evaluated) == 4  # the budget counts the trials from before the kill
    finally:
        first.stop()
        served.close()
