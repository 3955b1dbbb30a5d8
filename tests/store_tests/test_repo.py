"""The store's repository functions, on every backend."""

from __future__ import annotations

import time

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


def _req(mid: int, vid: int | None, start: float, count: int, p50: float, **kw: float) -> dict:
    row = dict(
        model_id=mid, variant_id=vid, window_start=start, window_end=start + 10, shape_bucket="b1 s128",
        count=count, errors=0, fallbacks=0, mean_ms=p50, p50_ms=p50, p95_ms=p50 * 1.2,
        p99_ms=p50 * 1.5, sampled=1, overhead=0.001, dropped=0,
    )
    row.update(kw)
    return row


def test_request_summary_weights_windows_by_count_and_excludes_intervals(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        v = repo.get_or_create_variant(s, mid, "h", {}, "fp32").id
        repo.add_request_stats(s, [_req(mid, v, 100, 10, 10.0), _req(mid, v, 110, 30, 20.0)])
    with any_store.session() as s:
        summ = repo.request_summary(s, mid, variant_id=v)
        assert summ["count"] == 40
        assert summ["p50_ms"] == pytest.approx((10 * 10 + 30 * 20) / 40)
        quiet = repo.request_summary(s, mid, variant_id=v, exclude=[(112, 115)])
        assert quiet["count"] == 10 and quiet["p50_ms"] == pytest.approx(10.0)
        assert repo.request_summary(s, mid, variant_id=v + 1) is None
        assert repo.shape_histogram(s, mid) == {"b1 s128": 40}


def test_layer_profile_aggregates_windows_hottest_first(any_store: st.Store) -> None:
    mid = _model(any_store)

    def row(layer: str, count: int, mean: float, start: float) -> dict:
        return dict(
            model_id=mid, variant_id=None, window_start=start, window_end=start + 10, layer=layer,
            op_type="Linear", shape_bucket="b1", count=count, mean_ms=mean, p50_ms=mean,
            p95_ms=mean, p99_ms=mean, share=0.0, counters={"task_clock_ns": 5.0 * count},
        )

    with any_store.session() as s:
        repo.add_layer_stats(s, [row("a", 10, 1.0, 0), row("b", 10, 4.0, 0), row("a", 10, 2.0, 10)])
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
        v = repo.get_or_create_variant(s, mid, "h", {}, "int8").id
        repo.add_trial(s, run_id=run.id, model_id=mid, variant_id=v, number=0, state="complete",
                       speedup=2.0, fidelity=0.99, accuracy_drop=0.01, feasible=True, params={},
                       duration_s=1.0)
        repo.update_search_run(s, run.id, state="done", trials_done=1)
    with any_store.session() as s:
        assert repo.running_search(s, mid) is None
        assert [t.speedup for t in repo.list_trials(s, mid, run_id=run.id)] == [2.0]
    with pytest.raises(st.StoreConflict), any_store.session() as s:  # (run, number) is unique
        repo.add_trial(s, run_id=run.id, model_id=mid, number=0, state="complete", params={}, duration_s=0)


def test_reservoir_and_events_and_retention(any_store: st.Store) -> None:
    mid = _model(any_store)
    with any_store.session() as s:
        repo.save_reservoir(s, mid, b"abc", 3, 10)
        repo.save_reservoir(s, mid, b"abcd", 4, 20)
        repo.add_event(s, mid, "leak", "rss grows", level="warning")
        repo.add_request_stats(s, [_req(mid, None, 0, 1, 1.0), _req(mid, None, time.time(), 1, 1.0)])
    with any_store.session() as s:
        res = repo.load_reservoir(s, mid)
        assert (res.payload, res.count, res.seen) == (b"abcd", 4, 20)
        assert [e.kind for e in repo.list_events(s, mid)] == ["leak"]
        removed = repo.prune_stats(s, time.time() - 3600)
        assert removed == 1
        assert repo.request_summary(s, mid)["count"] == 1
