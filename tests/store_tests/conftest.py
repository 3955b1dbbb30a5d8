"""Every store test runs on each backend: SQLite always, PostgreSQL where a server is given in
``PGC_TEST_POSTGRES_URL`` (``.ci/run`` starts one)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import store as st

POSTGRES_URL = os.environ.get("PGC_TEST_POSTGRES_URL")


def _fresh_postgres(base_url: str) -> tuple[str, Any]:
    """A new empty database on the server, dropped after the test."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"pgc_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(base_url).set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url, drop


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'pgc.db'}"
        return
    if not POSTGRES_URL:
        pytest.skip("PGC_TEST_POSTGRES_URL is not set (.ci/run starts a PostgreSQL server)")
    url, drop = _fresh_postgres(POSTGRES_URL)
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def any_store(backend_url: str) -> Iterator[st.Store]:
    s = st.open_store(backend_url)
    yield s
    s.close()
