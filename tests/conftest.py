"""Shared fixtures: a real SQLite store in a temporary folder, settings that make the loop
fast enough for tests, and small real models trained on scikit-learn's digits."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# One Inductor kernel cache for every test's work dir (and the workers and daemons tests
# start, which inherit it): tests build the same small graphs again and again, and a cold
# cache compiles each kernel's C++ anew. Tests about pgc's own folder unset it.
if "PGC_INDUCTOR_CACHE_DIR" not in os.environ:
    _kernels = tempfile.mkdtemp(prefix="pgc-test-inductor-")
    os.environ["PGC_INDUCTOR_CACHE_DIR"] = _kernels
    atexit.register(shutil.rmtree, _kernels, ignore_errors=True)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'pgc.db'}"


@pytest.fixture
def store(store_url: str) -> Any:
    import store as st

    s = st.open_store(store_url)
    yield s
    s.close()


@pytest.fixture
def settings(tmp_path: Path, store_url: str) -> Any:
    from pgc_daemon.settings import Settings

    return Settings(
        store_url=store_url,
        work_dir=str(tmp_path / "work"),
        window_s=0.5,
        poll_s=0.2,
        sample_every=5,
        min_profile_calls=20,
        reservoir_size=32,
    )


@pytest.fixture(scope="session")
def real_data(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The whole loop on the digits MLP, once per session (one to three minutes on 2 cores;
    :mod:`tests.dashboards_tests.realdata`): the loop's test and the dashboard's read it.
    ``PGC_TEST_REALDATA=DIR`` reuses a copy of what ``python -m tests.dashboards_tests.realdata
    DIR`` wrote, when working on the dashboard."""
    from tests.dashboards_tests.realdata import produce, reuse

    root = tmp_path_factory.mktemp("realdata")
    earlier = os.environ.get("PGC_TEST_REALDATA")
    return reuse(Path(earlier), root) if earlier else produce(root)


@pytest.fixture(scope="session")
def mlp_spec() -> dict[str, Any]:
    from pgc_daemon.examples import digits

    return digits.mlp()


@pytest.fixture(scope="session")
def cnn_spec() -> dict[str, Any]:
    from pgc_daemon.examples import digits

    return digits.cnn()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# --------------------------------------------------------------- every store backend

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
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
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
