"""The pgc command's promises about bad input: one readable line and an exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def pgc(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgc_daemon.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )


def test_help_lists_the_commands() -> None:
    out = pgc("--help")
    assert out.returncode == 0
    for cmd in ("demo", "serve", "token"):
        assert cmd in out.stdout


REFUSED_AT_ONCE = [
    ["demo", "--duration", "-5"],
    ["demo", "--max-drop", "3"],
    ["demo", "--rate", "0"],
    ["demo", "--backends", "tensorrt"],  # not a backend pgc knows
    ["demo", "--backends", " , "],
    ["serve", "--store", "mysql://x/y"],
    ["serve", "--host", "0.0.0.0"],  # off loopback without --allow-remote
    ["serve", "--token-file", "missing-token"],
]


@pytest.mark.parametrize(
    "args",
    [*REFUSED_AT_ONCE,
     ["optimize", "pgc_daemon.examples.digits:mlp", "--backends", "inductor,inductor"]],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    out = pgc(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [
    ["status"], ["status", "--json"], ["rollback", "minilm"], ["cancel", "minilm", "1"],
    ["deploy", "minilm", "--variant", "1"]])
def test_a_command_on_what_serves_in_a_folder_without_a_store_says_so_and_makes_none(
        args: list[str], tmp_path: Path) -> None:
    """``pgc status`` in the wrong folder listed no models (exit 0) and left an empty
    ``pgc.db`` there; the commands that read or change what serves now name the file they
    looked for and create nothing."""
    out = pgc(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and f"no pgc store at {tmp_path / 'pgc.db'}" in lines[0], lines
    assert not list(tmp_path.iterdir())
    other = tmp_path / "elsewhere.db"
    assert pgc(*args, "--store", f"sqlite:///{other}", cwd=tmp_path).returncode == 2
    assert not list(tmp_path.iterdir())


def test_status_reads_the_store_a_server_made(tmp_path: Path) -> None:
    import store as st

    made = st.open_store(f"sqlite:///{tmp_path / 'pgc.db'}")
    with made.session() as s:
        st.repo.upsert_model(s, "mini")
    made.close()
    out = pgc("status", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    models = json.loads(out.stdout.strip().splitlines()[-1])["models"]
    assert [m["name"] for m in models] == ["mini"]


def test_bad_input_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """Checking the arguments takes no torch, model or API imports (seconds on 2 cores)."""
    script = ("import contextlib, io, json, sys\n"
              "from pgc_daemon.cli import run\n"
              "out = []\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    with contextlib.redirect_stderr(io.StringIO()):\n"
              "        out.append([run(args), 'torch' in sys.modules])\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(REFUSED_AT_ONCE)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[2, False]] * len(REFUSED_AT_ONCE)


def test_the_demo_loads_a_machine_by_what_fp32_costs_there() -> None:
    """A fixed 20 requests/s saturated a VM whose fp32 call slowed from 28 to 33 ms (fp32 then
    served at 82 ms p50, and the starved search deployed nothing in the demo's time): the
    default rate keeps fp32 serving half busy, up to 20/s."""
    from pgc_daemon.cli._demo_traffic import LOAD_SHARE, MAX_RATE, load_rate

    assert load_rate(33.0) == pytest.approx(LOAD_SHARE * 1000 / 33.0)
    assert load_rate(33.0) * 0.033 == pytest.approx(LOAD_SHARE)
    assert load_rate(60.0) < load_rate(33.0) < MAX_RATE
    assert load_rate(5.0) == MAX_RATE  # a fast machine is not flooded


def test_unknown_command_is_a_usage_error() -> None:
    out = pgc("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_serve_takes_no_token_on_the_command_line(tmp_path: Path) -> None:
    """A command line is visible to every user (ps): the token comes from PGC_API_TOKEN or a
    file."""
    out = pgc("serve", "--token", "s3cret", cwd=tmp_path)
    assert out.returncode == 2 and "unrecognized arguments: --token" in out.stderr


@pytest.mark.parametrize("args", [["nope.module:fn"], ["pgc_daemon.examples.digits:mlp", "--trials", "0"]])
def test_optimize_refuses_bad_input_in_one_line(args: list[str], tmp_path: Path) -> None:
    out = pgc("optimize", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pgc optimize: error:")


@pytest.mark.slow
def test_optimize_reports_what_each_trial_cost(tmp_path: Path) -> None:
    """``pgc optimize --json`` on a real model: one JSON object last, with the wall seconds of
    every evaluated trial (how long a search takes is part of what it reports)."""
    import json

    out = pgc("optimize", "pgc_daemon.examples.digits:mlp", "--trials", "2", "--no-sensitivity",
              "--max-drop", "0.02", "--json", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["feasible"] and data["speedup"] > 0
    assert data["trials"] == 2 and len(data["trial_s"]) == 2
    assert data["failed"] == []  # both baselines build on the MLP
    assert all(0 < s <= data["elapsed_s"] for s in data["trial_s"])
    assert min(data["trial_s"]) <= data["trial_s_median"] <= max(data["trial_s"])
    assert "median" in out.stderr and "a trial" in out.stderr


CRASHES_ONCE = """
import ctypes, os
from pathlib import Path
import torch
from torch import nn

MARK = Path(__file__).with_name("crashed")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        # the first export of the model ends its process natively, as a heap corruption
        # inside a compiler does
        if torch.compiler.is_exporting() and not MARK.exists():
            MARK.write_text(str(os.getpid()))
            ctypes.string_at(0)
        return self.b(torch.relu(self.a(x)))


def build():
    torch.manual_seed(0)
    return Net().eval(), [torch.randn(2, 16) for _ in range(16)]
"""


@pytest.mark.slow
def test_optimize_outlives_a_native_crash_in_a_build(tmp_path: Path) -> None:
    """``pgc optimize`` built in its own process, so a segfault inside a build ended the
    command with nothing printed. The search now runs in a child: the crash costs that
    trial, recorded failed, and the command resumes the study and answers."""
    import json
    import os

    from pgc_daemon.optimizer.search.inflight import ENDED

    (tmp_path / "crashes_once.py").write_text(CRASHES_ONCE)
    out = pgc("optimize", "crashes_once:build", "--trials", "3", "--no-sensitivity",
              "--max-drop", "0.05", "--json", cwd=tmp_path, timeout=600)
    assert out.returncode in (0, 3), out.stderr[-2000:]
    crashed_pid = int((tmp_path / "crashed").read_text())
    assert crashed_pid != os.getpid()
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["crashes"] == 1 and data["trials"] == 3
    assert [f["message"] for f in data["failed"]] == [ENDED]
    assert "ended (SIGSEGV) during a build; resuming the study" in out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.glob("*.db"))  # the study lived in a private temporary folder


def test_the_demos_layer_tables_keep_one_line_a_layer(capsys: pytest.CaptureFixture[str]) -> None:
    """A compiled variant's rows name long kernels and the layers they fuse: in an 80-column
    terminal each row stays one line, and the end of the layer's path (what tells
    ``layer.0.intermediate.dense`` from ``layer.1...``) is what is kept. (The demo printed
    four lines a row, cut at the front of both.)"""
    from rich.console import Console

    from pgc_daemon.cli._base import clip
    from pgc_daemon.cli._demo import _print_report

    op = ("aoti_torch_cpu__qlinear_pointwise_binary (fused with "
          "encoder.encoder.layer.0.intermediate.intermediate_act_fn)")
    rows = [{"layer": f"encoder.encoder.layer.{i}.intermediate.dense", "op_type": op,
             "share": 0.03, "mean_ms": 0.2} for i in range(3)]
    _print_report(Console(file=None, force_terminal=False, width=80),
                  {"model": "m", "outcome": "deployed", "deployed_layers": rows})
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "intermediate.dense" in ln]
    assert len(lines) == 3 and all(len(ln) <= 80 for ln in lines)
    assert all(f"layer.{i}.intermediate.dense" in lines[i] for i in range(3))
    assert clip("abcdef", 4) == "abc…" and clip("abcdef", 4, tail=True) == "…def"
    assert clip("abc", 4) == "abc"
