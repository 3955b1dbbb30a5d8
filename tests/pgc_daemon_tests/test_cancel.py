"""Cancelling an open deployment: ``POST /api/models/{name}/deployments/{id}/cancel`` and
``pgc cancel MODEL DEPLOYMENT_ID``."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import store as st
from compiler import Recipe
from pgc_daemon import states
from pgc_daemon.cli import run
from pgc_daemon.states import D

from .helpers import TEST_TOKEN, api_client


@pytest.fixture
def candidate(store: st.Store) -> int:
    """A served model with its base active and one candidate deployment; the candidate's id."""
    with store.session() as s:
        m = st.repo.upsert_model(s, "mini", spec="pkg:build", graph_hash="g" * 64, metric="cosine")
        base = st.repo.get_or_create_variant(s, m.id, Recipe().hash, Recipe().to_dict(), Recipe().label())
        d0 = st.repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
        states.move(s, d0.id, D.ACTIVE, "base")
        d1 = st.repo.create_deployment(s, m.id, base.id, source="manual", reason="by hand")
        states.move(s, d1.id, D.BUILDING, "building")
        return d1.id


def _client(store: st.Store, token: str = TEST_TOKEN, *, auth: bool = True) -> TestClient:
    return api_client(store, token, auth=auth)


def test_api_cancels_an_open_deployment_and_then_conflicts(store: st.Store, candidate: int) -> None:
    c = _client(store, token="s3cret", auth=False)
    url = f"/api/models/mini/deployments/{candidate}/cancel"
    assert c.post(url, json={}).status_code == 401  # a mutation: token-protected
    auth = {"Authorization": "Bearer s3cret"}
    r = c.post(url, json={"reason": "not now"}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["state"] == "cancelled" and body["reason"] == "not now"
    assert [t["to_state"] for t in body["transitions"]] == ["candidate", "building", "cancelled"]
    again = c.post(url, json={}, headers=auth)
    assert again.status_code == 409 and "cancelled" in again.json()["detail"]
    # a new deployment may start now that none is open
    assert c.post("/api/models/mini/deployments", json={"recipe": {}}, headers=auth).status_code == 202


def test_api_cancel_errors(store: st.Store, candidate: int) -> None:
    c = _client(store)
    assert c.post("/api/models/mini/deployments/999/cancel", json={}).status_code == 404
    assert c.post(f"/api/models/nope/deployments/{candidate}/cancel", json={}).status_code == 404
    assert c.post("/api/models/mini/deployments/0/cancel", json={}).status_code == 422
    assert c.post(f"/api/models/mini/deployments/{candidate}/cancel", json={"why": 1}).status_code == 422
    active = c.get("/api/models/mini").json()["active"]["deployment_id"]
    assert c.post(f"/api/models/mini/deployments/{active}/cancel", json={}).status_code == 409
    op = c.get("/openapi.json").json()["paths"]["/api/models/{name}/deployments/{deployment_id}/cancel"]
    assert {"200", "401", "404", "409", "422"} <= set(op["post"]["responses"])


def test_cli_cancel(store: st.Store, candidate: int, capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["cancel", "--store", store.url, "mini", str(candidate), "--reason", "cli", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out == {"deployment_id": candidate, "state": "cancelled", "reason": "cli", "variant_id": 1}
    # already finished: one line, exit 1
    assert run(["cancel", "--store", store.url, "mini", str(candidate)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pgc cancel: error" in err[0] and "cancelled" in err[0]
    assert run(["cancel", "--store", store.url, "mini", "999"]) == 2  # NotFound: a LookupError
