"""One open deployment per model, whoever races for it: threads of one process, separate
processes, the HTTP route; on SQLite (``BEGIN IMMEDIATE``) and on PostgreSQL (``FOR UPDATE``)
where ``PGC_TEST_POSTGRES_URL`` names a server."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any


import store as st
from compiler import Quantization, Recipe
from pgc_daemon import states
from pgc_daemon.services.deployments import Conflict, request_deploy

BF16 = Recipe(quantization=Quantization.of({"_default": "bf16"}))
RACERS = 16


def _served_model(url: str) -> None:
    """A model served by its fp32 base, with the bf16 variant already stored (so a deploy
    request writes nothing before it decides: the case SQLite's lazy BEGIN got wrong)."""
    store = st.open_store(url)
    try:
        with store.session() as s:
            m = st.repo.upsert_model(s, "race", spec="pkg:build")
            base = st.repo.get_or_create_variant(s, m.id, Recipe().hash, Recipe().to_dict(), "fp32")
            st.repo.get_or_create_variant(s, m.id, BF16.hash, BF16.to_dict(), BF16.label())
            d = st.repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
            states.move(s, d.id, "active", "attached")
    finally:
        store.close()


def _open_deployments(url: str) -> list[Any]:
    store = st.open_store(url)
    try:
        with store.session() as s:
            m = st.repo.get_model(s, "race")
            return [d.id for d in st.repo.list_deployments(s, m.id) if d.state in states.OPEN]
    finally:
        store.close()


def _deploy_once(store: st.Store, barrier: Any) -> str:
    barrier.wait(timeout=60)
    try:
        with store.session() as s:
            request_deploy(s, "race", recipe=BF16, reason="race")
        return "created"
    except Conflict:
        return "conflict"


def test_threads_racing_request_deploy_create_one_deployment(backend_url: str) -> None:
    _served_model(backend_url)
    store = st.open_store(backend_url)
    barrier = threading.Barrier(RACERS)
    outcomes: list[str] = []
    lock = threading.Lock()

    def racer() -> None:
        out = _deploy_once(store, barrier)
        with lock:
            outcomes.append(out)

    threads = [threading.Thread(target=racer) for _ in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    store.close()
    assert sorted(outcomes) == ["conflict"] * (RACERS - 1) + ["created"], outcomes
    assert len(_open_deployments(backend_url)) == 1


def _process_racer(url: str, barrier: Any, results: Any) -> None:
    store = st.open_store(url, migrate=False)
    try:
        results.put(_deploy_once(store, barrier))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        results.put(f"error: {exc!r}")
    finally:
        store.close()


def test_processes_racing_request_deploy_create_one_deployment(backend_url: str) -> None:
    _served_model(backend_url)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [ctx.Process(target=_process_racer, args=(backend_url, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["conflict"] * 3 + ["created"], outcomes
    assert len(_open_deployments(backend_url)) == 1


def test_http_route_racing_creates_one_deployment(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from pgc_daemon.api import create_app
    from pgc_daemon.settings import Settings

    from .helpers import TEST_TOKEN, api_headers

    url = f"sqlite:///{tmp_path / 'race.db'}"
    _served_model(url)
    store = st.open_store(url)
    settings = Settings(store_url=url, work_dir=str(tmp_path / "work"), api_token=TEST_TOKEN)
    app = create_app(settings, store=store)
    barrier = threading.Barrier(RACERS)
    codes: list[int] = []
    lock = threading.Lock()

    def post(c: TestClient) -> None:
        barrier.wait(timeout=60)
        r = c.post("/api/models/race/deployments", json={"recipe": BF16.to_dict()})
        with lock:
            codes.append(r.status_code)

    with TestClient(app, base_url="http://127.0.0.1", headers=api_headers()) as c:
        threads = [threading.Thread(target=post, args=(c,)) for _ in range(RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    store.close()
    assert sorted(codes) == [202] + [409] * (RACERS - 1), codes
    assert len(_open_deployments(url)) == 1
