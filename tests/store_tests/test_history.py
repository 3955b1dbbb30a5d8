"""History bounded by count (``repo.prune_history``), the newest trials first in reach
(``repo.list_trials``), counts without rows (``repo.trial_counts``), on every backend."""

from __future__ import annotations

import store as st
from store import repo

BASE = "base-hash"


def _setup(store: st.Store, *, runs: int, trials_per_run: int, finished_deployments: int) -> dict:
    with store.session() as s:
        m = repo.upsert_model(s, "m", spec="pkg:build")
        base = repo.get_or_create_variant(s, m.id, BASE, {"version": 1}, "fp32")
        run_ids, variant_ids = [], []
        for r in range(runs):
            run = repo.create_search_run(s, m.id, study_name=f"s{r}", policy_version=1, trigger="t",
                                         trials_budget=trials_per_run)
            run_ids.append(run.id)
            for n in range(trials_per_run):
                v = repo.get_or_create_variant(s, m.id, f"h{r}-{n}", {"version": 1, "n": n}, f"v{r}-{n}")
                variant_ids.append(v.id)
                repo.add_trial(s, run_id=run.id, model_id=m.id, variant_id=v.id, number=n, state="complete",
                               speedup=1.0 + n, params={}, duration_s=1.0, feasible=True)
        dep_ids = []
        for i in range(finished_deployments):
            d = repo.create_deployment(s, m.id, variant_ids[i], source="manual", reason="r")
            repo.transition(s, d.id, "cancelled", "done", expected=["candidate"])
            dep_ids.append(d.id)
        # the active deployment is the OLDEST variant's, created before everything else's history
        active = repo.create_deployment(s, m.id, base.id, source="attach", reason="attached")
        repo.transition(s, active.id, "active", "base", expected=["candidate"])
        open_dep = repo.create_deployment(s, m.id, variant_ids[0], source="manual", reason="open")
        for _ in range(30):
            repo.add_event(s, m.id, "kept", "kept")
        return {"model": m.id, "base": base.id, "runs": run_ids, "variants": variant_ids,
                "deps": dep_ids, "active": active.id, "open": open_dep.id}


def test_list_trials_returns_the_newest_in_id_order(any_store: st.Store) -> None:
    ids = _setup(any_store, runs=3, trials_per_run=5, finished_deployments=0)
    with any_store.session() as s:
        newest = repo.list_trials(s, ids["model"], limit=4)
        every = repo.list_trials(s, ids["model"])
        assert [t.id for t in newest] == [t.id for t in every][-4:]
        assert [t.id for t in newest] == sorted(t.id for t in newest)
        assert [t.run_id for t in newest] == [ids["runs"][-1]] * 4
        assert repo.trial_counts(s, ids["model"]) == {"complete": 15}


def test_prune_history_keeps_what_serves_and_the_newest(any_store: st.Store) -> None:
    ids = _setup(any_store, runs=4, trials_per_run=5, finished_deployments=12)
    with any_store.session() as s:
        pruned = repo.prune_history(s, keep_trials=3, keep_runs=2, keep_deployments=4, keep_events=10,
                                    protect_hashes=[BASE])
    with any_store.session() as s:
        mid = ids["model"]
        trials = repo.list_trials(s, mid)
        # every trial of the two newest runs, even past keep_trials
        assert {t.run_id for t in trials} == set(ids["runs"][-2:]) and len(trials) == 10
        deps = repo.list_deployments(s, mid)
        kept = {d.id for d in deps}
        assert ids["active"] in kept and ids["open"] in kept
        assert len(deps) == 4 and set(ids["deps"][-2:]) <= kept  # the newest 4, active and open among them
        assert repo.active_deployment(s, mid).id == ids["active"]
        assert len(repo.list_events(s, mid, limit=1000)) == 10
        variants = {v.id for v in repo.list_variants(s, mid)}
        assert ids["base"] in variants  # protected (and served)
        referenced = {t.variant_id for t in trials} | {d.variant_id for d in deps}
        assert referenced <= variants
        assert variants == referenced | {ids["base"]}  # nothing unreferenced is left
    assert pruned.trials == 10 and pruned.deployments == 10 and pruned.events == 20
    assert pruned.variants > 0
    with any_store.session() as s:  # idempotent
        assert repo.prune_history(s, keep_trials=3, keep_runs=2, keep_deployments=4, keep_events=10,
                                  protect_hashes=[BASE]).total == 0
