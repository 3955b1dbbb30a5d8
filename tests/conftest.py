"""Shared fixtures: a real SQLite store in a temporary folder, settings that make the loop
fast enough for tests, and small real models trained on scikit-learn's digits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Starlette's TestClient names the server "testserver" in Host; the API answers loopback names
# only, unless told otherwise (PGC_ALLOWED_HOSTS). Tests that build their own TestClient get it
# allowed here; the security tests give their apps explicit settings and check the default.
os.environ.setdefault("PGC_ALLOWED_HOSTS", "testserver")
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
