"""schemathesis, every check, against the live OpenAPI document of a real ``pgc serve``
subprocess over a store of real data: any server error, undocumented status, schema-valid
body refused, invalid body accepted, wrong Allow header or response off its schema fails.

The server gets its own copy of the store (the fuzzer changes policies and queues
deployments) and a token, so the ``ignored_auth`` check has something to check. Its daemon
polls rarely, so policies the fuzzer writes do not start searches every second; a POST
``/optimize`` still starts a real search worker, as it would for a user.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import psutil
import pytest

from .conftest import TOKEN, copy_sqlite, pgc_serve
from .realdata import RealData

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 30
SEED = 20260501


def test_schemathesis_all_checks_pass_on_a_live_server(real_data: RealData, tmp_path: Path) -> None:
    store_url = copy_sqlite(real_data.store_url, tmp_path / "fuzz" / "pgc.db")
    st_bin = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    report = tmp_path / "report"
    with pgc_serve(store_url, tmp_path / "fuzz", token=TOKEN, poll_s=3600.0) as served:
        # pgc serve binds the loopback interface unless told otherwise
        listening = {c.laddr.ip for c in psutil.Process(served.proc.pid).net_connections("inet") if c.status == "LISTEN"}
        assert listening == {"127.0.0.1"}, listening
        doc = httpx.get(f"{served.url}/openapi.json").json()
        operations = sum(len(ops) for ops in doc["paths"].values())
        cmd = [
            st_bin, "run", f"{served.url}/openapi.json",
            "--checks", "all",
            "-H", f"Authorization: Bearer {TOKEN}",
            "--max-examples", str(MAX_EXAMPLES),
            "--seed", str(SEED),
            "--workers", "1",
            "--request-timeout", "30",
            "--generation-database", "none",
            "--report", "junit", "--report-dir", str(report),
            "--no-color",
        ]
        run = subprocess.run(cmd, cwd=tmp_path, check=False, capture_output=True, text=True, timeout=900)
        alive = served.proc.poll() is None
        log = served.log_tail(60)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"schemathesis found problems:\n{out[-12000:]}\n--- server log ---\n{log}"
    assert alive, f"pgc serve died under fuzzing:\n{log}"
    assert f"Tested: {operations}" in out, out[-3000:]
    assert "Traceback" not in log, log
    cases = ET.parse(next(report.glob("*.xml"))).getroot().iter("testcase")
    assert sum(1 for _ in cases) >= operations
