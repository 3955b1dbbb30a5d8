"""Every store test runs on each backend (``backend_url``, in tests/conftest.py): SQLite always,
PostgreSQL where a server is given in ``PGC_TEST_POSTGRES_URL`` (``.ci/run`` starts one)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import store as st


@pytest.fixture
def any_store(backend_url: str) -> Iterator[st.Store]:
    s = st.open_store(backend_url)
    yield s
    s.close()
