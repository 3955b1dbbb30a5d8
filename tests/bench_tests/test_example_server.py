"""The example FastAPI server (examples/fastapi_server.py) under uvicorn, a real process on
127.0.0.1, answers the requests bench/fleet.py sends it. (The bench once posted the digits
test set in the CNN's shape: every request was refused with 422, no traffic reached pgc, and
the bench waited for a search that never started.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.fleet import request_bodies  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_the_example_server_serves_the_fleet_benchmarks_requests(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PGC_STORE_URL": f"sqlite:///{tmp_path}/pgc.db", "PGC_WORK_DIR": str(tmp_path / "work")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "examples.fastapi_server:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(f"http://127.0.0.1:{port}/healthz")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the example server did not come up"
                time.sleep(0.5)
        bodies = request_bodies()
        assert len(bodies) >= 4
        for body in bodies[:4]:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
                answer = json.loads(resp.read())
            assert len(answer["labels"]) == 64 and all(0 <= label <= 9 for label in answer["labels"])
            assert answer["serving"] == "fp32 · eager"
        assert _get(f"http://127.0.0.1:{port}/healthz")["calls"] == 4  # every call went through pgc
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reaps it and closes the stderr pipe
