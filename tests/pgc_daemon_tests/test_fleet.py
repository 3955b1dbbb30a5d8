"""A fleet on one store, with real processes: replicas of one model share one deployment and
one build; a replica that starts late comes up on the active variant without compiling; a
replica killed mid-deployment affects no other.

Each replica is ``fleet_replica.py`` (the digits MLP attached through pgc, serving its own
traffic and checking every answer). The variant is built here, in the test process, as a
search worker builds it: into the shared compile cache, as an artifact the replicas load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import store as st
from compiler import Backend, CompileCache, Quantization, Recipe, build
from pgc_daemon.settings import Settings
from tests.pgc_daemon_tests.helpers import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("fleet_replica.py")
MODEL = "digits-mlp"
INT8_COMPILED = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))


class Replicas:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT)], cwd=ROOT, env=self.env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        return json.loads(out.strip().splitlines()[-1])

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            if p.stdout is not None:
                p.stdout.close()


def _replicas(store: st.Store) -> list[st.Replica]:
    with store.session() as s:
        try:
            model = st.repo.get_model(s, MODEL)
        except st.NotFound:
            return []
        return list(st.repo.live_replicas(s, model.id, 30.0))


def _by_pid(store: st.Store, pid: int) -> st.Replica | None:
    return next((r for r in _replicas(store) if r.pid == pid), None)


def test_replicas_share_one_deployment_one_build_and_a_late_replica_loads_it(
    backend_url: str, tmp_path: Path, mlp_spec: dict[str, Any]
) -> None:
    work = tmp_path / "work"
    env = {
        **os.environ, "PGC_STORE_URL": backend_url, "PGC_WORK_DIR": str(work),
        "PGC_POLL_S": "0.2", "PGC_WINDOW_S": "0.5", "PYTHONPATH": str(ROOT),
    }
    fleet = Replicas(env)
    store = st.open_store(backend_url)
    try:
        a, b = fleet.start(), fleet.start()
        wait_for(lambda: len(_replicas(store)) == 2, timeout=120, what="two replicas registered")
        with store.session() as s:
            model = st.repo.get_model(s, MODEL)
            deps = st.repo.list_deployments(s, model.id)
            # the second replica joined: it superseded nothing
            assert [d.state for d in deps] == ["active"], [(d.state, d.reason) for d in deps]
            st.repo.put_policy(s, model.id, {"canary_s": 3.0, "canary_latency_tolerance": 10.0, "canary_search_tolerance": 10.0,
                                             "canary_shadow_samples": 4})
        # built here, as a search worker builds it: an artifact in the shared cache
        settings = Settings(store_url=backend_url, work_dir=str(work))
        x = mlp_spec["example_inputs"][0]
        built = build(mlp_spec["model"], INT8_COMPILED, example=(x, {}),
                      cache=CompileCache(settings.compile_cache_path()))
        assert built.artifact, built.report.notes
        with store.session() as s:
            v = st.repo.get_or_create_variant(s, model.id, INT8_COMPILED.hash, INT8_COMPILED.to_dict(),
                                              INT8_COMPILED.label())
            st.repo.set_variant_artifact(s, v.id, built.artifact)
            dep = st.repo.create_deployment(s, model.id, v.id, source="manual", reason="test").id

        def everywhere() -> bool:
            rows = _replicas(store)
            return len(rows) == 2 and all(r.variant_id == v.id for r in rows)

        wait_for(everywhere, timeout=180, what="both replicas serving the variant")
        with store.session() as s:
            d = st.repo.get_deployment(s, dep)
            assert d.state == "active"
            assert d.owner in {r.name for r in _replicas(store)}  # one replica drove it
            actives = [x for x in st.repo.list_deployments(s, model.id) if x.state == "active"]
            assert [x.id for x in actives] == [dep]
        rows = _replicas(store)
        assert sum(r.compiles for r in rows) == 0, [(r.name, r.message) for r in rows]
        assert all(r.loads == 1 for r in rows), [(r.name, r.loads, r.message) for r in rows]
        follower = next(r for r in rows if r.name != d.owner)
        assert "artifact loaded" in (follower.message or "")

        # a replica that starts late comes up on the active variant, loading the artifact
        c = fleet.start()
        late = wait_for(lambda: _by_pid(store, c.pid), timeout=120, what="the late replica registered")
        wait_for(lambda: (_by_pid(store, c.pid) or late).variant_id == v.id, timeout=30,
                 what="the late replica serving the variant")
        row = _by_pid(store, c.pid)
        assert row is not None
        assert row.seen_at - row.started_at <= 10.0 + 5.0  # serving within 10 s (+ one beat)
        assert row.compiles == 0 and row.loads == 1

        # a replica killed in the middle of a deployment it drives affects no other
        with store.session() as s:
            st.repo.put_policy(s, model.id, {"canary_s": 120.0, "canary_latency_tolerance": 10.0,
                                             "canary_search_tolerance": 10.0})
            base = next(x for x in st.repo.list_variants(s, model.id) if x.recipe_hash == Recipe().hash)
            dep2 = st.repo.create_deployment(s, model.id, base.id, source="manual", reason="test").id

        def claimed() -> str | None:
            with store.session() as s:
                d2 = st.repo.get_deployment(s, dep2)
                return d2.owner if d2.state == "canary" else None

        owner = wait_for(claimed, timeout=120, what="a replica on canary")
        victim = next(p for p in (a, b, c) if _by_pid(store, p.pid) and _by_pid(store, p.pid).name == owner)  # type: ignore[union-attr]
        victim.kill()
        victim.wait(timeout=30)
        # a replica on the same host sees the owner's process gone and fails the deployment
        wait_for(lambda: _state(store, dep2) == "failed", timeout=30, what="the orphaned deployment failed")
        survivors = [p for p in (a, b, c) if p is not victim]
        for p in survivors:
            got = fleet.finish(p)
            assert got["failed"] == 0 and got["wrong"] == 0 and got["calls"] > 0, got
            assert got["serving"] == INT8_COMPILED.label(), got
    finally:
        fleet.kill_all()
        store.close()


def _state(store: st.Store, dep: int) -> str:
    with store.session() as s:
        return st.repo.get_deployment(s, dep).state
