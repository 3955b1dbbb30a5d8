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
# cache compiles each kernel's C++ anew. Tests about pgc's own folder unset it. An xdist
# worker inherits its controller's folder and works in a folder of its own inside it: pgc
# builds one AOTInductor package at a time per cache folder (compiler/_aoti.py), so a shared
# one would make the two workers take turns at every build.
if "PGC_INDUCTOR_CACHE_DIR" not in os.environ:
    _kernels = tempfile.mkdtemp(prefix="pgc-test-inductor-")
    os.environ["PGC_INDUCTOR_CACHE_DIR"] = _kernels
    atexit.register(shutil.rmtree, _kernels, ignore_errors=True)
if _worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["PGC_INDUCTOR_CACHE_DIR"] = os.path.join(os.environ["PGC_INDUCTOR_CACHE_DIR"], _worker)


@pytest.fixture(autouse=True)
def _no_process_wide_module_hooks_left() -> Iterator[None]:
    """A test that leaves a process-wide module hook behind (a sampled call begun and never
    ended) slows every module call after it in that process, and makes Dynamo trace the hook
    when a later test compiles (under xdist it failed the next file's Inductor build)."""
    yield
    from torch.nn.modules import module

    left = [*module._global_forward_pre_hooks.values(), *module._global_forward_hooks.values()]
    if left:
        module._global_forward_pre_hooks.clear()
        module._global_forward_hooks.clear()
        pytest.fail(f"process-wide module hooks left behind: {left}")


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
    _check_loop_files(items)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ------------------------------------------------ two xdist workers (the README's command)

# The files whose tests read the session's ``real_data`` loop: under ``pytest -n 2 --dist
# loadfile`` they run on one worker, first, so the loop runs once (each worker has its own
# session). Collection checks the list against what the tests really use.
LOOP_FILES = frozenset({
    "tests/dashboards_tests/test_browser.py",
    "tests/dashboards_tests/test_fuzz.py",
    "tests/dashboards_tests/test_metrics.py",
    "tests/dashboards_tests/test_optuna_dashboard.py",
    "tests/pgc_daemon_tests/test_loop.py",
})
_LOOP = "the real_data loop"


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _check_loop_files(items: list[Any]) -> None:
    missing = {_file_of(i.nodeid) for i in items
               if "real_data" in getattr(i, "fixturenames", ())} - LOOP_FILES
    if missing:
        raise pytest.UsageError(
            f"{', '.join(sorted(missing))} read real_data: add them to LOOP_FILES in tests/conftest.py")


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """``--dist loadfile``, with the loop's files as one unit that goes out first: it is the
    longest (the loop alone takes 1-3 minutes), so it must not be left for the end. (xdist's
    own ``loadgroup`` reads a node id that pytest 9.2 no longer uses, so its groups fall apart
    into single tests.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesLoopFirst(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            file = _file_of(nodeid)
            return _LOOP if file in LOOP_FILES else file

        def _assign_work_unit(self, node: Any) -> None:
            if _LOOP in self.workqueue:
                self.workqueue.move_to_end(_LOOP, last=False)
            super()._assign_work_unit(node)

    return FilesLoopFirst(config, log)


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
