"""The optimizer's tick costs the same CPU whatever history the store keeps: it reads the
reservoir's count (not its payload), the windows of the profile and drift spans, and, for a
regression check, the two spans it compares and the busy intervals that overlap them only.

The store is the expensive case: an active non-base variant whose study finished (so the
decision is "up to date" and the regression check runs, here on every tick), 50 busy
intervals (25 searches, 25 builds) over the history, and 10 s request windows with per-layer
rows for every window."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, update

import store as st
from pgc_daemon import states
from pgc_daemon.optimizer import daemon as daemon_mod
from pgc_daemon.optimizer.daemon import Daemon
from pgc_daemon.optimizer.schedule import study_name
from pgc_daemon.policy import Policy
from pgc_daemon.settings import Settings
from pgc_daemon.states import D

WINDOW_S = 10.0
LAYERS = ("net.1", "net.3", "net.5")
BUSY = 25  # searches, and as many builds


def _history(tmp: Path, hours: float, *, recent_p50: float = 1.0) -> tuple[Settings, int]:
    """A store with ``hours`` of 10 s windows for one model; p50 1 ms throughout, except the
    last 10 minutes at ``recent_p50``."""
    url = f"sqlite:///{tmp / 'pgc.db'}"
    store = st.open_store(url)
    now = time.time()
    windows = int(hours * 3600 / WINDOW_S)
    start = now - windows * WINDOW_S
    policy = Policy(max_trials=4)
    with store.session() as s:
        mid = st.repo.upsert_model(s, "m", spec="pgc_daemon.examples.digits:mlp",
                                   graph_hash="f" * 16, hardware="cpu-test").id
        st.repo.put_policy(s, mid, policy.model_dump())
        vid = st.repo.get_or_create_variant(s, mid, "c" * 64, {}, "int8 somewhere").id
        st.repo.save_reservoir(s, mid, b"\0" * 4_000_000, 128, 4096)
        name = study_name("m", "f" * 16, "cpu-test", policy.study, "b64")
        run = st.repo.create_search_run(s, mid, study_name=name, policy_version=1,
                                        trigger="first", trials_budget=4)
        st.repo.update_search_run(s, run.id, state="done", chosen_variant_id=vid)
        active = st.repo.create_deployment(s, mid, vid, source="search", reason="chosen")
        states.move(s, active.id, D.ACTIVE, "deployed")
        quiet = 1200.0  # no busy interval within 20 min of either end of the history
        for i in range(BUSY):
            at = start + quiet + i * (now - start - 2 * quiet) / BUSY
            r = st.repo.create_search_run(s, mid, study_name=f"other-{i}", policy_version=1,
                                          trigger="drift", trials_budget=4)
            st.repo.update_search_run(s, r.id, state="done", finished_at=at + 300)
            s.execute(update(st.SearchRun).where(st.SearchRun.id == r.id).values(started_at=at))
            dep = st.repo.create_deployment(s, mid, vid, source="manual", reason="busy")
            states.move(s, dep.id, D.BUILDING, "build")
            states.move(s, dep.id, D.FAILED, "broke")
            tr = st.Transition
            for to, when in ((D.CANDIDATE, at + 390), (D.BUILDING, at + 400), (D.FAILED, at + 460)):
                s.execute(update(tr).where(tr.deployment_id == dep.id, tr.to_state == to)
                          .values(at=when))
        # the study finished before the history began; the variant became active as it began
        s.execute(update(st.SearchRun).where(st.SearchRun.id == run.id)
                  .values(started_at=start - 7200, finished_at=start - 3600))
        s.execute(update(st.Transition).where(st.Transition.deployment_id == active.id)
                  .values(at=start))
    recent_from = now - 600
    for c0 in range(0, windows, 4000):
        reqs: list[dict[str, Any]] = []
        lays: list[dict[str, Any]] = []
        for i in range(c0, min(c0 + 4000, windows)):
            ws, we = start + i * WINDOW_S, start + (i + 1) * WINDOW_S
            p50 = recent_p50 if ws >= recent_from else 1.0
            where = dict(model_id=mid, variant_id=vid, window_start=ws, window_end=we,
                         shape_bucket="b64")
            reqs.append(dict(**where, count=1500, errors=0, fallbacks=0, mean_ms=p50, p50_ms=p50,
                             p95_ms=p50 * 1.5, p99_ms=p50 * 2, sampled=15, overhead=0.004,
                             dropped=0, histogram=None))
            lays.extend(dict(**where, layer=layer, op_type="Linear", count=15, mean_ms=0.1,
                             p50_ms=0.1, p95_ms=0.15, p99_ms=0.2, share=1 / 3, counters=None)
                        for layer in LAYERS)
        with store.session() as s:
            s.execute(insert(st.RequestStat.__table__), reqs)
            s.execute(insert(st.LayerStat.__table__), lays)
    store.close()
    settings = Settings(store_url=url, work_dir=str(tmp / "work"), min_profile_calls=50,
                        retention_h=24 * 30)
    return settings, mid


def _daemon(settings: Settings) -> tuple[Daemon, list[str]]:
    daemon = Daemon(settings)
    started: list[str] = []

    def no_spawn(model_id: int, trigger: str, **kw: Any) -> int:
        started.append(trigger)
        return 0

    daemon.start_search = no_spawn  # type: ignore[method-assign]
    return daemon, started


def _tick_cpu_ms(*settings: Settings, rounds: int = 21) -> list[float]:
    """Median CPU ms of one tick for each store, their ticks interleaved so that whatever
    else loads the machine (a sibling hyperthread, another test's leftovers) loads each alike."""
    daemons = [_daemon(s) for s in settings]
    for daemon, _ in daemons:
        daemon.tick()  # warms the page cache, prunes once
    cpu: list[list[float]] = [[] for _ in daemons]
    for _ in range(rounds):
        for (daemon, _), own in zip(daemons, cpu):
            t0 = time.process_time()
            daemon.tick()
            own.append((time.process_time() - t0) * 1e3)
    for daemon, started in daemons:
        daemon.store.close()
        assert started == [], started  # up to date: the regression check ran and found none
    return [statistics.median(own) for own in cpu]


@pytest.mark.serial  # tick CPU time compared across histories
def test_tick_cpu_does_not_grow_with_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon_mod, "REGRESSION_EVERY_S", 0.0)  # check on every tick
    (tmp_path / "6h").mkdir()
    (tmp_path / "48h").mkdir()
    short, long = _tick_cpu_ms(_history(tmp_path / "6h", 6)[0], _history(tmp_path / "48h", 48)[0])
    assert long <= 1.5 * short + 0.5, (
        f"tick CPU grew with history: 6 h {short:.2f} ms, 48 h {long:.2f} ms"
    )
    assert long < 60.0, f"tick CPU {long:.1f} ms at 48 h (target 20 ms)"


def test_the_bounded_regression_check_still_finds_a_regression(tmp_path: Path) -> None:
    settings, _ = _history(tmp_path, 2, recent_p50=1.5)
    # the newest busy search started 23 min ago: outside this re-search interval
    daemon, started = _daemon(settings.model_copy(update={"reoptimize_interval_s": 900.0}))
    daemon.tick()
    assert started == ["live latency regressed: p50 1.00 -> 1.50 ms"]
    daemon.store.close()


def test_the_daemon_prunes_history_beyond_its_bounds(store: st.Store, settings: Any) -> None:
    """Trials past the bound go with the hourly prune; the active deployment and the fp32
    base's variant stay."""
    from compiler import Recipe
    from pgc_daemon.optimizer.workers import prune_statistics

    with store.session() as s:
        mid = st.repo.upsert_model(s, "m").id
        base = st.repo.get_or_create_variant(s, mid, Recipe().hash, Recipe().to_dict(), "fp32")
        dep = st.repo.create_deployment(s, mid, base.id, source="attach", reason="attached")
        states.move(s, dep.id, states.D.ACTIVE, "serving")
        runs = [
            st.repo.create_search_run(s, mid, study_name=f"s{i}", policy_version=1, trigger="t",
                                      trials_budget=1).id
            for i in range(12)
        ]
        for i in range(st.repo.KEEP_TRIALS + 500):
            st.repo.add_trial(s, model_id=mid, run_id=runs[i % len(runs)], number=i,
                              state="complete", params={}, duration_s=0.0)
    assert prune_statistics(store, settings.retention_h) > 0
    with store.session() as s:
        # the newest KEEP_TRIALS stay, and the older trials of the newest KEEP_RUNS runs
        assert st.repo.KEEP_TRIALS <= len(st.repo.list_trials(s, mid, limit=10**6)) < 2300
        assert st.repo.active_deployment(s, mid).id == dep.id
        assert st.repo.get_variant(s, base.id).recipe_hash == Recipe().hash
