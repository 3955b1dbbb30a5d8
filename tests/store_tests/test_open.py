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
