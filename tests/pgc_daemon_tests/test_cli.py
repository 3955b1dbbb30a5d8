"""The pgc command's promises about bad input: one readable line and an exit code."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--duration", "-5"],
        ["demo", "--max-drop", "3"],
        ["serve", "--store", "mysql://x/y"],
        ["serve", "--host", "0.0.0.0"],  # off loopback without --allow-remote
        ["serve", "--token-file", "missing-token"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    out = pgc(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0]
    assert "Traceback" not in out.stderr


def test_unknown_command_is_a_usage_error() -> None:
    out = pgc("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_serve_takes_no_token_on_the_command_line(tmp_path: Path) -> None:
    """A command line is visible to every user (ps): the token comes from PGC_API_TOKEN or a
    file."""
    out = pgc("serve", "--token", "s3cret", cwd=tmp_path)
    assert out.returncode == 2 and "unrecognized arguments: --token" in out.stderr
