"""A store of REAL data for the loop, dashboard, metrics and fuzzing tests (the session's
``real_data`` fixture, ``tests/conftest.py``): the whole loop on the digits MLP (attach -> live per-layer profile -> Optuna search in a worker process -> hot-swap
through the canary), then a rollback and a redeploy through the API, with live traffic all
along so the latency timeline has windows before, between and after the markers.

Also runnable by hand to get a store to look at: ``python -m tests.dashboards_tests.realdata DIR``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import store as st
from pgc_daemon import attach, states
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.settings import Settings
from profiler import ProfilerConfig
from tests.pgc_daemon_tests.helpers import Load, wait_for

MODEL = "digits-mlp"
SPEC = "pgc_daemon.examples.digits:mlp"
# A lenient canary: on a loaded machine the variant deployed may be no faster, and the tests
# need it deployed, rolled back and deployed again, not reverted by the canary.
# PyTorch's backends only: the variant that ends up serving is compiled, so the dashboard has
# its kernels' per-layer rows to show (a peer backend's variant has none).
POLICY = {"max_trials": 4, "canary_s": 1.0, "canary_latency_tolerance": 10.0, "min_speedup": 1.0,
          "canary_search_tolerance": 10.0, "max_accuracy_drop": 0.02,
          "backends": ["inductor", "eager"]}


@dataclass(frozen=True)
class RealData:
    root: Path
    store_url: str
    optuna_url: str
    model: str
    deployed_variant_id: int
    study_name: str
    profile_twin: bool
    """Whether the deployed variant has a profiling twin (its compiled kernels have rows)."""
    search_deployment_id: int
    """The search's last deployment (or, when it kept fp32, the fixture's of its fastest
    trial), before the rollback and the redeployment."""
    agent_loads: int | None = None
    """Variants the serving process loaded as a worker's artifact, and compiled itself
    (None: a reused store, not known)."""
    agent_compiles: int | None = None


def settings_for(root: Path) -> Settings:
    return Settings(
        store_url=f"sqlite:///{root / 'pgc.db'}",
        work_dir=str(root / "work"),
        window_s=0.5,
        poll_s=0.2,
        sample_every=5,
        min_profile_calls=20,
        reservoir_size=32,
    )


def _active(store: st.Store, model_id: int, source: str, after: int = 0) -> st.Deployment | None:
    with store.session() as s:
        dep = st.repo.active_deployment(s, model_id)
        return dep if dep is not None and dep.source == source and dep.id > after else None


def _search_outcome(store: st.Store, model_id: int, daemon: Daemon) -> st.Deployment | int | None:
    """The search's last deployment once active and the search is over (it deploys good
    trials while it searches, then its final choice); or, when the search kept the fp32
    module (on a loaded machine nothing may beat it), the variant id of its fastest feasible
    trial."""
    with store.session() as s:
        runs = st.repo.list_search_runs(s, model_id)
        if runs and runs[0].state in ("failed", "infeasible", "cancelled"):
            raise AssertionError(f"search {runs[0].state}: {runs[0].message}")
        if not runs or runs[0].state in ("queued", "running") or runs[0].id in daemon.workers:
            return None
        if any(d.state in states.OPEN for d in st.repo.list_deployments(s, model_id)):
            return None
        dep = st.repo.active_deployment(s, model_id)
        if dep is not None and dep.source == "search":
            return dep
        if st.repo.list_events(s, model_id, kind="kept"):
            timed = [t for t in st.repo.list_trials(s, model_id) if t.feasible and t.speedup and t.variant_id]
            assert timed, "the search timed no feasible variant"
            return max(timed, key=lambda t: t.speedup).variant_id
        return None


def produce(root: Path) -> RealData:
    """Run the loop in this process until the search's variant is active (or, if the search
    kept fp32, its fastest variant deployed through the API), roll it back and deploy it again
    through the API; return where the store is. One to three minutes on 2 cores."""
    root.mkdir(parents=True, exist_ok=True)
    # packages as served by default (no kernel events): the compiled variant the search chose
    # gets per-layer rows through the profiling twin its worker builds
    before = os.environ.pop("PGC_KERNEL_PROFILE", None)
    try:
        return _produce(root)
    finally:
        if before is not None:
            os.environ["PGC_KERNEL_PROFILE"] = before


def _produce(root: Path) -> RealData:
    from fastapi.testclient import TestClient

    from pgc_daemon.api import create_app
    from pgc_daemon.examples import digits

    settings = settings_for(root)
    store = st.open_store(settings.store_url)
    spec = digits.mlp()
    # a fixed sampling rate (the budget would all but stop sampling a model this small), so
    # the compiled variant that ends up serving has per-layer rows from its kernels
    fixed = ProfilerConfig(sample_every=settings.sample_every, budget=None, window_s=settings.window_s)
    served = attach(spec["model"], name=MODEL, spec=SPEC, settings=settings, policy=POLICY,
                    profiler=fixed)
    daemon = Daemon(settings, store)
    inputs = [a[0] for a in spec["example_inputs"]]
    try:
        with Load(served, spec["model"], inputs, threads=2) as load:
            daemon.start()
            wait_for(lambda: served.model_id, timeout=60, what="the agent to register")
            model_id = served.model_id
            outcome = wait_for(lambda: _search_outcome(store, model_id, daemon), timeout=600, every=0.5,
                               what="the search's decision")
            daemon.stop()  # the search is done; nothing else should load the machine
            app = create_app(settings, store=store)  # creates the work dir's token
            token, _ = settings.load_token()
            api = TestClient(app, base_url="http://127.0.0.1", headers={"Authorization": f"Bearer {token}"})
            if isinstance(outcome, int):  # kept fp32: deploy the search's fastest variant by hand
                r = api.post(f"/api/models/{MODEL}/deployments",
                             json={"variant_id": outcome, "reason": "the search's fastest variant"})
                assert r.status_code == 202, r.text
                outcome = wait_for(lambda: _active(store, model_id, "manual"), timeout=300, every=0.3,
                                   what="the deployment of the search's variant")
            dep = outcome
            loads, compiles = served.swapper.variants.loads, served.swapper.variants.compiles
            time.sleep(3.0)
            r = api.post(f"/api/models/{MODEL}/rollback", json={"reason": "rollback for the dashboard tests"})
            assert r.status_code == 202, r.text
            back = wait_for(lambda: _active(store, model_id, "rollback", dep.id), timeout=120, every=0.3,
                            what="the rollback")
            time.sleep(3.0)
            r = api.post(f"/api/models/{MODEL}/deployments",
                         json={"variant_id": dep.variant_id, "reason": "redeployed for the dashboard tests"})
            assert r.status_code == 202, r.text
            wait_for(lambda: _active(store, model_id, "manual", back.id), timeout=300, every=0.3,
                     what="the redeployment")
            with store.session() as s:
                twinned = st.repo.get_variant(s, dep.variant_id).profile_artifact is not None
            if twinned:  # sampled calls run the twin from the swapper's next look
                wait_for(lambda: served.slot.twin is not None, timeout=60, what="the profiling twin")
            time.sleep(3.0)
        assert load.errors == [] and load.wrong == 0, (load.errors[:3], load.wrong)
        served.flush()
        with store.session() as s:
            run = st.repo.list_search_runs(s, model_id)[0]
            study = run.study_name
            variant = st.repo.get_variant(s, dep.variant_id)
            twin = variant.profile_artifact is not None
            if dep.source == "search" and variant.recipe["backend"]["kind"] == "inductor":
                assert twin, "the worker built no profiling twin of the variant it chose"
    finally:
        daemon.stop()
        served.close()
        store.close()
    return RealData(
        root=root,
        store_url=settings.store_url,
        optuna_url=settings.optuna_storage(),
        model=MODEL,
        deployed_variant_id=dep.variant_id,
        study_name=study,
        profile_twin=twin,
        search_deployment_id=dep.id,
        agent_loads=loads,
        agent_compiles=compiles,
    )


def reuse(src: Path, dst: Path) -> RealData:
    """A copy of a store that :func:`produce` wrote earlier (``PGC_TEST_REALDATA=DIR``: a
    shortcut for working on the dashboard; CI always produces its own)."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("work"))
    settings = settings_for(dst)
    store = st.open_store(settings.store_url)
    try:
        with store.session() as s:
            model = st.repo.get_model(s, MODEL)
            run = st.repo.list_search_runs(s, model.id)[-1]
            # the redeployment through the API (newest first): the variant deployed last
            deps = st.repo.list_deployments(s, model.id)
            dep = next(d for d in deps if d.source == "manual")
            first = next(d for d in deps if d.source != "rollback" and d.id < dep.id
                         and d.variant_id == dep.variant_id)
            variant_id, study = dep.variant_id, run.study_name
            twin = st.repo.get_variant(s, variant_id).profile_artifact is not None
    finally:
        store.close()
    return RealData(dst, settings.store_url, settings.optuna_storage(), MODEL, variant_id, study,
                    twin, first.id)


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    data = produce(Path(argv[1]))
    print(f"{data} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


__all__ = ["MODEL", "RealData", "produce", "settings_for"]
