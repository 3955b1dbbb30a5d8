from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import store as st
from store._engine import VERSION_TABLE, current_revision
from store._schema import Base


def test_open_applies_migrations_and_matches_the_models(store: st.Store) -> None:
    tables = store.tables()
    for name in ("pgc_models", "pgc_variants", "pgc_policies", "pgc_layer_stats",
                 "pgc_request_stats", "pgc_deployments", "pgc_deployment_transitions"):
        assert name in tables
    assert all(t.startswith("pgc_") for t in tables)
    assert current_revision(store.engine) is not None
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == [], f"the migrations and the ORM models disagree: {diff}"


def test_sqlite_is_in_wal_mode_with_a_busy_timeout(store: st.Store) -> None:
    path = store.sqlite_path
    assert path is not None and path.exists()
    with store.engine.connect() as conn:
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        timeout = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
    assert mode == "wal"
    assert timeout >= 5000


def test_reopening_is_idempotent(store_url: str) -> None:
    a = st.open_store(store_url)
    rev = current_revision(a.engine)
    a.close()
    b = st.open_store(store_url)
    assert current_revision(b.engine) == rev
    b.close()


def _open(url: str) -> str | None:
    s = st.open_store(url)
    rev = current_revision(s.engine)
    s.close()
    return rev


def test_concurrent_first_open_from_processes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'race.db'}"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        revs = pool.map(_open, [url] * 3)
    assert len(set(revs)) == 1 and revs[0] is not None


@pytest.mark.parametrize("url", ["not a url", "mysql://x/y", "oracle://a"])
def test_bad_urls_are_one_clear_error(url: str) -> None:
    with pytest.raises(st.StoreError) as info:
        st.open_store(url)
    assert "\n" not in str(info.value)


def test_unreachable_database_is_store_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(st.StoreUnavailable):
        st.open_store(f"sqlite:///{blocker}/pgc.db")


def test_default_file_is_pgc_db_in_the_working_directory() -> None:
    assert st.DEFAULT_URL == "sqlite:///pgc.db"


def test_store_file_is_plain_sqlite(store: st.Store) -> None:
    with st.open_store(store.url).session() as s:
        st.repo.upsert_model(s, "m")
    conn = sqlite3.connect(store.sqlite_path)
    assert conn.execute("select name from pgc_models").fetchall() == [("m",)]
    conn.close()


def test_an_old_store_upgrades_with_its_data(tmp_path: Path) -> None:
    """A store written at the first revision opens under today's code with its rows intact."""
    from alembic import command
    from alembic.config import Config

    from store._engine import _MIGRATIONS

    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = st.Store(url, migrate=False)
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with old.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        conn.exec_driver_sql(
            "INSERT INTO pgc_models (name, created_at, last_seen_at) VALUES ('legacy', 1, 1)"
        )
    old.close()
    new = st.open_store(url)
    with new.session() as s:
        assert st.repo.get_model(s, "legacy").created_at == 1
    assert current_revision(new.engine) != "0001"
    new.close()


def test_search_runs_written_at_the_first_revision_gain_an_empty_policy(tmp_path: Path) -> None:
    """A search run queued by a store at 0001 reads back after the upgrade with ``policy`` None,
    and new runs keep the policy snapshot they were queued with."""
    from alembic import command
    from alembic.config import Config

    from store._engine import _MIGRATIONS

    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = st.Store(url, migrate=False)
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with old.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        conn.exec_driver_sql(
            "INSERT INTO pgc_models (id, name, created_at, last_seen_at) VALUES (1, 'legacy', 1, 1)"
        )
        conn.exec_driver_sql(
            "INSERT INTO pgc_search_runs (model_id, study_name, policy_version, state, trigger,"
            " trials_budget, trials_done, started_at, heartbeat_at)"
            " VALUES (1, 'study', 3, 'done', 'old', 5, 5, 1, 1)"
        )
    old.close()
    new = st.open_store(url)
    with new.session() as s:
        (before,) = st.repo.list_search_runs(s, 1)
        assert (before.study_name, before.policy_version, before.policy) == ("study", 3, None)
        run = st.repo.create_search_run(s, 1, study_name="study", policy_version=4, trigger="new",
                                        trials_budget=5, policy={"max_accuracy_drop": 0.01})
        run_id = run.id
    with new.session() as s:
        assert st.repo.get_search_run(s, run_id).policy == {"max_accuracy_drop": 0.01}
    new.close()


def test_a_new_sqlite_store_is_private(tmp_path: Path) -> None:
    import os
    import stat as statmod

    s = st.open_store(f"sqlite:///{tmp_path / 'new.db'}")
    try:
        with s.session() as sess:
            st.repo.upsert_model(sess, "m")
        for name in ("new.db", "new.db-wal", "new.db-shm", "new.db.lock"):
            mode = statmod.S_IMODE(os.stat(tmp_path / name).st_mode)
            assert mode == 0o600, (name, oct(mode))
    finally:
        s.close()


def test_a_store_file_others_may_write_is_refused(tmp_path: Path) -> None:
    import os

    path = tmp_path / "shared.db"
    st.open_store(f"sqlite:///{path}").close()
    os.chmod(path, 0o664)
    with pytest.raises(st.StoreConfigError, match="writable by group or others"):
        st.open_store(f"sqlite:///{path}")
    os.chmod(path, 0o644)  # readable by others is the user's choice; writable is not
    st.open_store(f"sqlite:///{path}").close()
    if os.getuid() == 0:
        os.chown(path, 12345, -1)
        with pytest.raises(st.StoreConfigError, match="belongs to user 12345"):
            st.open_store(f"sqlite:///{path}")


def test_write_sessions_hold_the_sqlite_write_lock_from_their_start(tmp_path: Path) -> None:
    s = st.open_store(f"sqlite:///{tmp_path / 'w.db'}")
    other = sqlite3.connect(str(tmp_path / "w.db"), timeout=0.1, isolation_level=None)
    try:
        with s.session(write=True) as sess:
            st.repo.list_models(sess)  # only a read so far
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")  # released at commit
        other.execute("ROLLBACK")
    finally:
        other.close()
        s.close()
