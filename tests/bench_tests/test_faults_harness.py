"""Fast checks of the fault campaign's own accounting (bench/faults.py): no process, no model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._faults import harness, scenarios  # noqa: E402
from bench.faults import _table  # noqa: E402


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def _agent(tmp_path: Path, pid: int, recs: list[dict]) -> harness.Agent:
    path = tmp_path / f"a{pid}.jsonl"
    path.write_text("".join(json.dumps({"pid": pid, **r}) + "\n" for r in recs) + "{torn line")
    return harness.Agent(_Proc(pid), path, 0.0)  # type: ignore[arg-type]


def _rec(t: float, n: int, fail: int = 0, own: int = 0, max_ms: float = 2.0, total: int = 0) -> dict:
    return {"t": t, "n": n, "fail": fail, "own": own, "max_ms": max_ms, "p99_ms": max_ms,
            "total": total, "fail_total": fail, "own_total": own, "errors": []}


def test_window_counts_only_the_window_and_the_agents_own_records(tmp_path: Path) -> None:
    a = _agent(tmp_path, 1, [_rec(10, 5), _rec(11, 0), _rec(12, 7, fail=1, own=2, max_ms=1500.0), _rec(30, 9)])
    # a record of another pid in the same file (a restarted agent appending) is not this agent's
    with a.status_path.open("a") as fh:
        fh.write("\n" + json.dumps({"pid": 2, **_rec(11, 100, fail=50)}) + "\n")
    w = harness.window_stats([a], 10.0, 12.0)
    assert w["requests"] == 12
    assert w["failed"] == 1 and w["own_errors"] == 2
    assert w["max_ms"] == 1500.0
    assert w["idle_seconds"] == 1


def test_totals_sum_the_last_record_of_every_agent(tmp_path: Path) -> None:
    a = _agent(tmp_path, 1, [_rec(1, 5, total=5), _rec(2, 5, fail=1, total=10)])
    b = _agent(tmp_path, 2, [_rec(1, 3, own=1, total=3)])
    assert harness.totals([a, b]) == {"requests": 13, "failed": 1, "own_errors": 1}


def test_a_result_fails_unless_a_scenario_says_it_passed() -> None:
    r = scenarios.result("x")
    assert r["passed"] is False and r["recovered"] is False
    s = scenarios.skipped("y", "no mount")
    assert s["skipped"] is True and s["passed"] is False


def test_table_tells_skip_pass_and_fail_apart() -> None:
    rows = [scenarios.result("a", passed=True), scenarios.result("b"), scenarios.skipped("c", "why")]
    text = _table(rows)
    assert "pass" in text and "FAIL" in text and "SKIP" in text


def test_every_issue_scenario_is_registered() -> None:
    assert len([n for n in scenarios.SCENARIOS if n != "tick_72h"]) == 13


def test_the_pathological_key_allowed_by_the_api_pattern_fits_its_length() -> None:
    key = "re:" + ".*" * 148 + "x"
    assert len(key) <= 300


def test_cpu_info_reports_isa_flags() -> None:
    info = harness.cpu_info()
    assert set(info) >= {"model", "generation", "avx2", "avx512f", "amx"}
