"""Deployments an agent left behind (``kill -9`` mid-build or mid-canary, or no agent at all)
are failed by the daemon's tick, so the model can take a new deployment; live ones are not."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import update

import store as st
from pgc_daemon import states
from pgc_daemon.optimizer import stranded
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.settings import Settings
from pgc_daemon.states import D


def _deployment(store: st.Store, model: str, state: D, age_s: float) -> int:
    """A deployment of a spec-less model (the tick considers no search for it) moved to
    ``state`` and last updated ``age_s`` ago."""
    path = {
        D.CANDIDATE: [],
        D.BUILDING: [D.BUILDING],
        D.CANARY: [D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY],
    }[state]
    with store.session() as s:
        mid = st.repo.upsert_model(s, model).id
        vid = st.repo.get_or_create_variant(s, mid, "ab" * 32, {}, "a variant").id
        dep = st.repo.create_deployment(s, mid, vid, source="manual", reason="test")
        for to in path:
            states.move(s, dep.id, to, f"to {to}")
        s.execute(
            update(st.Deployment)
            .where(st.Deployment.id == dep.id)
            .values(updated_at=time.time() - age_s)
        )
        return dep.id


def _state(store: st.Store, dep_id: int) -> tuple[str, str | None]:
    with store.session() as s:
        dep = st.repo.get_deployment(s, dep_id)
        return dep.state, dep.reason


def test_one_tick_fails_in_flight_deployments_whose_agent_stopped_reporting(
    settings: Settings, store: st.Store
) -> None:
    stale = states.STALE_AFTER_S
    dead_canary = _deployment(store, "a", D.CANARY, stale + 30)
    dead_build = _deployment(store, "b", D.BUILDING, stale + 5)
    live_canary = _deployment(store, "c", D.CANARY, 1.0)
    live_build = _deployment(store, "d", D.BUILDING, stale / 2)

    Daemon(settings, store).tick()

    for dep in (dead_canary, dead_build):
        state, reason = _state(store, dep)
        assert state == D.FAILED
        assert reason is not None
        assert reason.startswith("the agent stopped reporting (no heartbeat for ")
    assert _state(store, live_canary)[0] == D.CANARY
    assert _state(store, live_build)[0] == D.BUILDING
    with store.session() as s:
        model = st.repo.get_model(s, "a")
        assert [e.kind for e in st.repo.list_events(s, model.id)] == ["deployment_failed"]
        dep = st.repo.get_deployment(s, dead_canary)
        last = dep.transitions[-1]
        assert (last.from_state, last.to_state) == (D.CANARY, D.FAILED)


def test_a_candidate_nobody_takes_is_failed_after_the_unclaimed_limit(
    settings: Settings, store: st.Store
) -> None:
    orphan = _deployment(store, "a", D.CANDIDATE, stranded.UNCLAIMED_AFTER_S + 60)
    waiting = _deployment(store, "b", D.CANDIDATE, stranded.UNCLAIMED_AFTER_S / 2)

    Daemon(settings, store).tick()

    state, reason = _state(store, orphan)
    assert state == D.FAILED and reason is not None and "no agent took it" in reason
    assert _state(store, waiting)[0] == D.CANDIDATE


def test_an_agent_that_moved_or_refreshed_the_deployment_meanwhile_wins(
    store: st.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick reads the stale rows, then moves each under the model's lock after reading it
    again: a deployment refreshed (or moved) since the first read is left alone."""
    refreshed = _deployment(store, "a", D.CANARY, 600.0)
    moved = _deployment(store, "b", D.CANARY, 600.0)
    now = time.time()
    real = st.repo.stale_deployments

    def and_then_the_agents_report(s, which, before):  # type: ignore[no-untyped-def]
        found = real(s, which, before)
        if D.CANARY not in which:
            return found
        with store.session() as other:
            other.execute(
                update(st.Deployment)
                .where(st.Deployment.id == refreshed)
                .values(updated_at=time.time())
            )
            states.move(other, moved, D.ACTIVE, "the canary passed")
        return found

    monkeypatch.setattr(st.repo, "stale_deployments", and_then_the_agents_report)
    failed = stranded.fail_stranded(store, now, unclaimed_s=1e9)
    assert failed == []
    assert _state(store, refreshed)[0] == D.CANARY
    assert _state(store, moved)[0] == D.ACTIVE
