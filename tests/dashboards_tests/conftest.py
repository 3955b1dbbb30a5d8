"""Shared fixtures of the dashboard, metrics and API-fuzzing tests: ``pgc serve`` started as
a real subprocess over the session's store of real data (``real_data``, tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TOKEN = "dashboard-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def copy_sqlite(src_url: str, dst: Path) -> str:
    """A consistent copy of a SQLite store (the backup API, so a WAL file is folded in)."""
    src = src_url.removeprefix("sqlite:///")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(src)) as a, contextlib.closing(sqlite3.connect(dst)) as b:
        a.backup(b)
    return f"sqlite:///{dst}"


def wait_ready(name: str, url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    """Wait until ``url`` (a readiness endpoint: ``/healthz``, Prometheus's ``/-/ready``)
    answers 200, failing with the server's name and its log when it exits or ``timeout``
    passes: a test must never query a server that is still starting."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode} before it was ready:\n{_tail(log)}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} was not ready at {url} after {timeout:.0f} s ({last}):\n{_tail(log)}")
        time.sleep(0.2)


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@dataclass
class Served:
    url: str
    token: str | None
    proc: subprocess.Popen[bytes]
    log: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@contextlib.contextmanager
def pgc_serve(store_url: str, workdir: Path, *, token: str | None = TOKEN, poll_s: float = 2.0) -> Iterator[Served]:
    """``pgc serve --store URL --port FREE`` as a subprocess, stopped with SIGTERM (uvicorn
    shuts down, the daemon stops its search workers) when the block ends."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGC_")}
    env.update(PGC_POLL_S=str(poll_s), PGC_WORK_DIR=str(workdir / "work"), PGC_NUM_THREADS="1")
    if token:
        env["PGC_API_TOKEN"] = token
    pgc = shutil.which("pgc", path=str(Path(sys.executable).parent)) or "pgc"
    log = workdir / f"serve-{port}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [pgc, "serve", "--store", store_url, "--port", str(port), "--log-level", "warning"],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
        )
    served = Served(f"http://127.0.0.1:{port}", token, proc, log)
    try:
        wait_ready("pgc serve", f"{served.url}/healthz", proc, log)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where browser screenshots are kept (``artifacts/``, ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
