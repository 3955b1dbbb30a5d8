"""The deployment state machine's table, enforced through the store's compare-and-set."""

from __future__ import annotations

import pytest

import store as st
from pgc_daemon import states
from pgc_daemon.states import D


def _dep(store: st.Store) -> int:
    with store.session() as s:
        mid = st.repo.upsert_model(s, "m").id
        return st.repo.create_deployment(s, mid, None, source="manual", reason="x").id


def test_the_happy_path_is_allowed_and_recorded(store: st.Store) -> None:
    dep_id = _dep(store)
    path = [D.BUILDING, D.WARMING, D.VERIFYING, D.CANARY, D.ACTIVE, D.SUPERSEDED]
    with store.session() as s:
        for state in path:
            states.move(s, dep_id, state, f"now {state}")
    with store.session() as s:
        assert [t.to_state for t in st.repo.get_deployment(s, dep_id).transitions] == [
            "candidate", *path
        ]


@pytest.mark.parametrize(
    "path",
    [[D.ACTIVE, D.CANARY], [D.BUILDING, D.CANARY], [D.FAILED, D.BUILDING], [D.CANCELLED, D.ACTIVE]],
)
def test_moves_the_table_does_not_allow_are_refused(store: st.Store, path: list[D]) -> None:
    dep_id = _dep(store)
    with pytest.raises(st.StoreConflict):
        with store.session() as s:
            for state in path:
                states.move(s, dep_id, state, "x")
    with store.session() as s:
        assert st.repo.get_deployment(s, dep_id).state == D.CANDIDATE


def test_the_table_is_closed_and_terminal_states_end() -> None:
    assert set(states.TRANSITIONS) == set(D)
    assert all(nxt <= set(D) for nxt in states.TRANSITIONS.values())
    assert states.TERMINAL == {D.FAILED, D.ROLLED_BACK, D.SUPERSEDED, D.CANCELLED}
    assert states.allowed_from(D.CANCELLED) == states.OPEN
    assert D.ACTIVE == "active" and str(D.ACTIVE) == "active"
