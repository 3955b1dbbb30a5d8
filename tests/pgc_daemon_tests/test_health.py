"""``/healthz`` says the store is unhealthy (503, one line) when its SQLite file was deleted or
replaced under the running server, or when the database does not take a write (read-only,
locked by another process); otherwise 200."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time
from pathlib import Path

import store as st

from .helpers import api_client


def _health(store: st.Store) -> tuple[int, dict]:
    r = api_client(store).get("/healthz")
    return r.status_code, r.json()


def test_healthy_store_is_200(store: st.Store) -> None:
    code, body = _health(store)
    assert code == 200 and body["status"] == "ok"


def test_a_deleted_store_file_is_503(store: st.Store) -> None:
    c = api_client(store)
    assert c.get("/healthz").status_code == 200
    path = store.sqlite_path
    assert path is not None
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    r = c.get("/healthz")
    assert r.status_code == 503 and "deleted" in r.json()["detail"]
    assert "\n" not in r.json()["detail"]


def test_a_replaced_store_file_is_503(store: st.Store, tmp_path: Path) -> None:
    path = store.sqlite_path
    assert path is not None
    shutil.copy(path, tmp_path / "copy.db")
    os.replace(tmp_path / "copy.db", path)
    code, body = _health(store)
    assert code == 503 and "replaced" in body["detail"]


def test_a_read_only_store_is_503(store: st.Store) -> None:
    ro = st.open_store(f"sqlite:///file:{store.sqlite_path}?mode=ro&uri=true")
    try:
        code, body = _health(ro)
    finally:
        ro.close()
    assert code == 503 and "readonly" in body["detail"].replace("-", "").replace(" ", "")


def test_a_locked_store_is_503_within_seconds(store: st.Store) -> None:
    con = sqlite3.connect(str(store.sqlite_path), isolation_level=None, timeout=5)
    con.execute("BEGIN EXCLUSIVE")
    try:
        t0 = time.monotonic()
        code, body = _health(store)
        took = time.monotonic() - t0
    finally:
        con.execute("ROLLBACK")
        con.close()
    assert code == 503 and "locked" in body["detail"]
    assert took < 5
    assert _health(store)[0] == 200  # and healthy again once the lock is gone
