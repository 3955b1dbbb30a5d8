"""The store's repository functions, on every backend."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from typing import Any

import pytest

import store as st
from store import repo


def _model(s: st.Store, name: str = "m") -> int:
    with s.session() as sess:
        return repo.upsert_model(sess, name, spec="pkg.mod:build", graph_hash="abc").id


def test_upsert_model_keeps_one_row_and_updates_fields(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        again = repo.upsert_model(s, "m", metric="cosine")
        assert again.id == mid
        assert again.spec == "pkg.mod:build" and again.metric == "cosine"
        assert [m.name for m in repo.list_models(s)] == ["m"]
    with any_store.session() as s, pytest.raises(st.NotFound):
        repo.get_model(s, "nope")


def test_variants_are_unique_per_recipe_hash(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        a = repo.get_or_create_variant(s, mid, "h1", {"version": 1}, "fp32")
        b = repo.get_or_create_variant(s, mid, "h1", {"version": 1}, "fp32")
        c = repo.get_or_create_variant(s, mid, "h2", {"version": 1, "x": 1}, "int8")
        assert a.id == b.id != c.id
        assert [v.id for v in repo.list_variants(s, mid)] == [a.id, c.id]


def test_policy_version_moves_only_on_change(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        assert repo.put_policy(s, mid, {"max_accuracy_drop": 0.01}).version == 1
        assert repo.put_policy(s, mid, {"max_accuracy_drop": 0.01}).version == 1
        assert repo.put_policy(s, mid, {"max_accuracy_drop": 0.02}).version == 2
        assert repo.get_policy(s, mid).settings == {"max_accuracy_drop": 0.02}


def _req(mid: int, vid: int | None, start: float, count: int, p50: float, **kw: Any) -> st.RequestStatRow:
    row: dict[str, Any] = dict(
        model_id=mid, variant_id=vid, window_start=start, window_end=start + 10, shape_bucket="b1 s128",
        count=count, errors=0, fallbacks=0, mean_ms=p50, p50_ms=p50, p95_ms=p50 * 1.2,
        p99_ms=p50 * 1.5, sampled=1, overhead=0.001, dropped=0,
    )
    row.update(kw)
    return st.RequestStatRow(**row)


def test_request_summary_weights_windows_by_count_and_excludes_intervals(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        v = repo.get_or_create_variant(s, mid, "h", {}, "fp32").id
        repo.add_window_stats(s, requests=[_req(mid, v, 100, 10, 10.0), _req(mid, v, 110, 30, 20.0)])
    with any_store.session() as s:
        summ = repo.request_summary(s, mid, variant_id=v)
        assert summ["count"] == 40
        assert summ["p50_ms"] == pytest.approx((10 * 10 + 30 * 20) / 40)
        assert summ["seconds"] == pytest.approx(20.0)  # two 10 s windows: 2 requests/s
        quiet = repo.request_summary(s, mid, variant_id=v, exclude=[(112, 115)])
        assert quiet["count"] == 10 and quiet["p50_ms"] == pytest.approx(10.0)
        assert quiet["seconds"] == pytest.approx(10.0)
        assert repo.request_summary(s, mid, variant_id=v + 1) is None
        assert repo.shape_histogram(s, mid) == {"b1 s128": 40}


def test_layer_profile_aggregates_windows_hottest_first(any_store: st.Store) -> None:
    mid = _model(any_store)

    def row(layer: str, count: int, mean: float, start: float) -> st.LayerStatRow:
        return st.LayerStatRow(
            model_id=mid, variant_id=None, window_start=start, window_end=start + 10, layer=layer,
            op_type="Linear", shape_bucket="b1", count=count, mean_ms=mean, p50_ms=mean,
            p95_ms=mean, p99_ms=mean, share=0.0, counters={"task_clock_ns": 5.0 * count},
        )

    with any_store.session() as s:
        repo.add_window_stats(s, layers=[row("a", 10, 1.0, 0), row("b", 10, 4.0, 0), row("a", 10, 2.0, 10)])
    with any_store.session() as s:
        prof = repo.layer_profile(s, mid)
        assert [r["layer"] for r in prof] == ["b", "a"]
        a = prof[1]
        assert a["count"] == 20 and a["mean_ms"] == pytest.approx(1.5)
        assert sum(r["share"] for r in prof) == pytest.approx(1.0)
        assert prof[0]["share"] == pytest.approx(40 / 70)
        assert repo.layer_counters(s, mid)["a"]["task_clock_ns"] == pytest.approx(100.0)
        assert [r["layer"] for r in repo.layer_profile(s, mid, since=15)] == ["a"]


def test_transitions_are_recorded_in_order(any_store: st.Store) -> None:
    mid = _model(any_store)
    path = ["candidate", "building", "warming", "verifying", "canary", "active"]
    with any_store.session() as s:
        v = repo.get_or_create_variant(s, mid, "h", {}, "int8").id
        dep = repo.create_deployment(s, mid, v, source="search", reason="found it")
        for before, state in zip(path, path[1:]):
            repo.transition(s, dep.id, state, f"now {state}", expected={before})
        assert repo.active_deployment(s, mid).id == dep.id
    with any_store.session() as s:
        full = repo.get_deployment(s, dep.id)
        assert [t.to_state for t in full.transitions] == path
        assert [t.from_state for t in full.transitions] == [None, *path[:-1]]
        assert all(a.at <= b.at for a, b in zip(full.transitions, full.transitions[1:]))


def test_deployments_in_states_are_found_however_old(any_store: st.Store) -> None:
    """What a replica asks every poll (in-flight deployments of its host's dead processes):
    the deployments in the states asked, oldest first, past any count of newer ones."""
    mid = _model(any_store)
    with any_store.session() as s:
        old = repo.create_deployment(s, mid, None, source="manual", reason="old").id
        repo.transition(s, old, "building", "claimed", expected={"candidate"})
        for i in range(25):  # newer deployments that ended
            d = repo.create_deployment(s, mid, None, source="manual", reason=f"n{i}").id
            repo.transition(s, d, "cancelled", "no", expected={"candidate"})
        new = repo.create_deployment(s, mid, None, source="manual", reason="new").id
        repo.transition(s, new, "building", "claimed", expected={"candidate"})
        waiting = repo.create_deployment(s, mid, None, source="manual", reason="waits").id
    with any_store.session() as s:
        assert [d.id for d in repo.deployments_in(s, mid, {"building", "canary"})] == [old, new]
        assert [d.id for d in repo.deployments_in(s, mid, {"candidate"})] == [waiting]
        assert repo.deployments_in(s, mid + 1000, {"building"}) == []


def test_a_transition_is_a_compare_and_set(any_store: st.Store) -> None:
    """A move from a state the deployment is not in is refused and leaves nothing behind; of
    two sessions that both read ``candidate``, only the first to write moves it."""
    mid = _model(any_store)
    with any_store.session() as s:
        dep_id = repo.create_deployment(s, mid, None, source="manual", reason="x").id
    with pytest.raises(st.StoreConflict):
        with any_store.session() as s:
            repo.transition(s, dep_id, "building", "ok", expected={"candidate"})
            repo.transition(s, dep_id, "active", "skips warming", expected={"candidate"})
    with any_store.session() as s:  # the failed transaction left nothing behind
        assert repo.get_deployment(s, dep_id).state == "candidate"
        assert len(repo.get_deployment(s, dep_id).transitions) == 1
    with any_store.session() as s:
        repo.transition(s, dep_id, "building", "first", expected={"candidate"})
    with pytest.raises(st.StoreConflict):
        with any_store.session() as s:
            repo.transition(s, dep_id, "cancelled", "second", expected={"candidate"})
    with any_store.session() as s:
        assert repo.get_deployment(s, dep_id).state == "building"


def test_search_runs_and_trials(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        run = repo.create_search_run(s, mid, study_name="st", policy_version=1, trigger="t", trials_budget=5)
        assert repo.running_search(s, mid).id == run.id
        assert run.policy is None
        snap = repo.create_search_run(s, mid, study_name="st", policy_version=2, trigger="t",
                                      trials_budget=5, policy={"max_accuracy_drop": 0.02})
        snap_id = snap.id
        v = repo.get_or_create_variant(s, mid, "h", {}, "int8").id
        repo.add_trial(s, run_id=run.id, model_id=mid, variant_id=v, number=0, state="complete",
                       speedup=2.0, fidelity=0.99, accuracy_drop=0.01, feasible=True, params={},
                       duration_s=1.0)
        repo.update_search_run(s, run.id, state="done", trials_done=1)
        repo.update_search_run(s, snap_id, state="cancelled")
    with any_store.session() as s:
        assert repo.running_search(s, mid) is None
        assert [t.speedup for t in repo.list_trials(s, mid, run_id=run.id)] == [2.0]
        assert repo.get_search_run(s, snap_id).policy == {"max_accuracy_drop": 0.02}
    with pytest.raises(st.StoreConflict), any_store.session() as s:  # (run, number) is unique
        repo.add_trial(s, run_id=run.id, model_id=mid, number=0, state="complete", params={}, duration_s=0)


def test_reservoir_and_events_and_retention(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        repo.save_reservoir(s, mid, b"abc", 3, 10)
        repo.save_reservoir(s, mid, b"abcd", 4, 20)
        repo.add_event(s, mid, "leak", "rss grows", level="warning")
        repo.add_window_stats(s, requests=[_req(mid, None, 0, 1, 1.0), _req(mid, None, time.time(), 1, 1.0)])
    with any_store.session() as s:
        res = repo.load_reservoir(s, mid)
        assert (res.payload, res.count, res.seen) == (b"abcd", 4, 20)
        assert repo.reservoir_count(s, mid) == 4
        assert repo.reservoir_count(s, mid + 1) is None
        assert [e.kind for e in repo.list_events(s, mid)] == ["leak"]
        removed = repo.prune_stats(s, time.time() - 3600)
        assert removed == 1
        assert repo.request_summary(s, mid)["count"] == 1


def _summary_in_python(
    windows: Sequence[Any], exclude: Sequence[tuple[float, float]] = ()
) -> dict[str, float] | None:
    """``request_summary`` as it was before it aggregated in SQL: a loop over window rows."""
    windows = [
        w for w in windows
        if not any(w.window_start < end and w.window_end > start for start, end in exclude)
    ]
    n = sum(w.count for w in windows)
    if n == 0:
        return None

    def wavg(attr: str) -> float:
        return sum(getattr(w, attr) * w.count for w in windows) / n

    busy = sum(w.mean_ms * w.count for w in windows)
    return {
        "count": n,
        "windows": len(windows),
        "errors": sum(w.errors for w in windows),
        "fallbacks": sum(w.fallbacks for w in windows),
        "mean_ms": wavg("mean_ms"),
        "p50_ms": wavg("p50_ms"),
        "p95_ms": wavg("p95_ms"),
        "p99_ms": wavg("p99_ms"),
        "sampled": sum(w.sampled for w in windows),
        "dropped": sum(w.dropped for w in windows),
        "overhead": sum(w.overhead * w.mean_ms * w.count for w in windows) / busy if busy else 0.0,
        "seconds": sum(w.window_end - w.window_start for w in windows),
    }


def test_request_summary_in_sql_matches_the_python_loop(any_store: st.Store) -> None:
    """The aggregate query gives what summing every window row in Python gave, with every
    filter (since, variant, excluded intervals), including windows without calls."""
    mid = _model(any_store)
    rng = random.Random(7)
    with any_store.session() as s:
        variants = [repo.get_or_create_variant(s, mid, h, {}, h).id for h in ("a", "b")]
        rows = [
            _req(mid, rng.choice([*variants, None]), 10.0 * i, rng.choice([0, 1, 5, 40]),
                 rng.uniform(1, 30), errors=rng.randint(0, 2), fallbacks=rng.randint(0, 1),
                 sampled=rng.randint(0, 3), overhead=rng.uniform(0, 0.01), dropped=rng.randint(0, 1))
            for i in range(200)
        ]
        repo.add_window_stats(s, requests=rows)
    cases: list[dict[str, Any]] = [
        {},
        {"since": 500.0},
        {"variant_id": variants[0]},
        {"variant_id": variants[1], "since": 900.0, "exclude": [(300.0, 450.0), (1200.0, 1201.0)]},
        {"exclude": [(0.0, 2000.0)]},  # every window excluded: no traffic
        {"variant_id": variants[1] + 100},
    ]
    with any_store.session() as s:
        for kw in cases:
            windows = repo.request_windows(s, mid, since=kw.get("since", 0.0),
                                           variant_id=kw.get("variant_id"))
            want = _summary_in_python(windows, kw.get("exclude", ()))
            got = repo.request_summary(s, mid, **kw)
            if want is None:
                assert got is None, kw
                continue
            assert got is not None and got.keys() == want.keys(), kw
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-9), (kw, key)
                assert type(got[key]) is type(value), (kw, key)


def test_window_rows_are_frozen_and_carry_the_tables_columns() -> None:
    """Each row type has exactly its table's columns (less the id), and cannot be changed."""
    for row_type, table in (
        (st.RequestStatRow, st.RequestStat),
        (st.LayerStatRow, st.LayerStat),
        (st.HostStatRow, st.HostStat),
    ):
        columns = {c.key for c in table.__table__.columns} - {"id"}
        assert {f.name for f in dataclasses.fields(row_type)} == columns, row_type
    row = _req(1, None, 0.0, 1, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.count = 2  # type: ignore[misc]


def test_add_window_stats_takes_typed_rows_only(any_store: st.Store) -> None:
    mid = _model(any_store)
    with pytest.raises(TypeError), any_store.session() as s:
        as_dict = dataclasses.asdict(_req(mid, None, 0.0, 1, 1.0))
        repo.add_window_stats(s, requests=[as_dict])  # type: ignore[list-item]
    with any_store.session() as s:
        assert repo.add_window_stats(s) == 0
        assert repo.request_summary(s, mid) is None
