"""The whole loop on a small real model: attach -> live profile in SQLite -> Optuna search in
a worker process -> hot-swap through the canary, checked through the store and the API."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

import store as st
from pgc_daemon import attach
from pgc_daemon.api import create_app
from pgc_daemon.daemon import Daemon
from pgc_daemon.settings import Settings

from .helpers import Load, wait_for

pytestmark = pytest.mark.slow


def test_loop_profiles_searches_and_deploys(mlp_spec: dict[str, Any], settings: Settings, store: st.Store) -> None:
    policy = {"max_trials": 4, "canary_s": 1.0, "min_speedup": 1.0, "max_accuracy_drop": 0.02}
    served = attach(mlp_spec["model"], name="mlp", spec="pgc_daemon.examples.digits:mlp",
                    settings=settings, policy=policy)
    daemon = Daemon(settings, store)
    inputs = [a[0] for a in mlp_spec["example_inputs"]]
    try:
        with Load(served, mlp_spec["model"], inputs, threads=2) as load:
            daemon.start()

            def finished() -> Any:
                with store.session() as s:
                    if served.model_id is None:
                        return None
                    runs = st.repo.list_search_runs(s, served.model_id)
                    if runs and runs[0].state in ("failed", "infeasible", "cancelled"):
                        raise AssertionError(f"search {runs[0].state}: {runs[0].message}")
                    kept = st.repo.list_events(s, served.model_id, kind="kept")
                    if kept:
                        raise AssertionError(kept[0].message)
                    dep = st.repo.active_deployment(s, served.model_id)
                    return dep if dep is not None and dep.source == "search" else None

            dep = wait_for(finished, timeout=600, every=1.0, what="a deployment from the search")
        assert load.errors == [] and load.wrong == 0
        served.flush()
        with store.session() as s:
            model = st.repo.get_model(s, "mlp")
            assert st.repo.layer_profile(s, model.id), "per-layer stats in the store"
            trials = st.repo.list_trials(s, model.id)
            assert 1 <= len(trials) <= 4
            assert all(t.params for t in trials)
            assert any(t.state == "complete" and t.feasible for t in trials)
            run = st.repo.list_search_runs(s, model.id)[0]
            assert run.state == "done" and run.chosen_variant_id == dep.variant_id
            full = st.repo.get_deployment(s, dep.id)
            assert [t.to_state for t in full.transitions] == [
                "candidate", "building", "warming", "verifying", "canary", "active"
            ]
        api = TestClient(create_app(settings, store=store))
        body = api.get("/api/models/mlp").json()
        assert body["active"]["deployment_id"] == dep.id
        assert body["active"]["expected_speedup"] == pytest.approx(dep.expected_speedup)
        front = api.get("/api/models/mlp/front").json()
        assert any(p["deployed"] for p in front["points"])
    finally:
        daemon.stop()
        served.close()
