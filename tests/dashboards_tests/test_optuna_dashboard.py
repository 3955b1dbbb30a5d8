"""A study that pgc's search wrote opens in optuna-dashboard: start it on the search's Optuna
storage (``pgc.optuna.db`` beside the SQLite store), and read the study through its API."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import optuna
import pytest

import store as st

from .conftest import free_port, wait_ready
from .realdata import RealData

pytestmark = pytest.mark.slow


def test_a_pgc_study_opens_in_optuna_dashboard(real_data: RealData, tmp_path: Path) -> None:
    storage = real_data.optuna_url.removeprefix("sqlite:///")
    assert Path(storage).name == "pgc.optuna.db" and Path(storage).parent == real_data.root
    copy = tmp_path / "pgc.optuna.db"
    shutil.copy(storage, copy)
    exe = shutil.which("optuna-dashboard", path=str(Path(sys.executable).parent)) or "optuna-dashboard"
    port = free_port()
    log = open(tmp_path / "optuna-dashboard.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [exe, f"sqlite:///{copy}", "--host", "127.0.0.1", "--port", str(port), "--quiet"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready("optuna-dashboard", f"{base}/api/studies", proc, tmp_path / "optuna-dashboard.log")
        r = httpx.get(f"{base}/api/studies", timeout=10)
        studies = {s["study_name"]: s for s in r.json()["study_summaries"]}
        assert real_data.study_name in studies, sorted(studies)
        summary = studies[real_data.study_name]
        assert summary["directions"] == ["minimize", "minimize"]
        study = httpx.get(f"{base}/api/studies/{summary['study_id']}", params={"after": 0}, timeout=30).json()
        assert study["objective_names"] == ["latency_ratio", "accuracy_drop"]
        assert study["best_trials"], "the Pareto front shows in optuna-dashboard"
        page = httpx.get(f"{base}/dashboard/studies/{summary['study_id']}", timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()

        # the same trials pgc shows: one Optuna trial per pgc trial of that search
        store = st.open_store(real_data.store_url)
        try:
            with store.session() as s:
                model = st.repo.get_model(s, real_data.model)
                run = next(r for r in st.repo.list_search_runs(s, model.id) if r.study_name == real_data.study_name)
                ours = st.repo.list_trials(s, model.id, run_id=run.id)
        finally:
            store.close()
        # a sample of a recipe already measured is told again with its values (a duplicate,
        # no trial of pgc's): every other complete Optuna trial is one of pgc's
        told = optuna.load_study(study_name=real_data.study_name, storage=f"sqlite:///{copy}")
        again = {t.number for t in told.trials if (t.user_attrs.get("record") or {}).get("duplicate")}
        complete = [t for t in study["trials"] if t["state"] == "Complete"
                    and t["number"] not in again]
        assert len(complete) == sum(t.state == "complete" for t in ours)
        assert sorted(t["values"][1] for t in complete) == pytest.approx(
            sorted(t.accuracy_drop for t in ours if t.state == "complete")
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
