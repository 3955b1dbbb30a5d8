"""Modules stay small enough to read in one sitting, and the request path smaller still: it is
what runs in the user's threads on every call, and it is reviewed on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pgc_daemon"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 400
MAX_REQUEST_PATH_LINES = 150


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_every_module_is_at_most_400_lines(path: Path) -> None:
    assert _lines(path) <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {_lines(path)} lines"


def test_the_request_path_is_at_most_150_lines() -> None:
    assert _lines(PACKAGE / "agent" / "served.py") <= MAX_REQUEST_PATH_LINES


def _imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("name", ["swapper.py", "canary.py", "contract.py"])
def test_the_swapper_knows_the_served_model_only_through_its_protocol(name: str) -> None:
    """Not even under ``TYPE_CHECKING``: the swapper and the canary take a
    :class:`~pgc_daemon.agent.contract.Served`."""
    assert "pgc_daemon.agent.served" not in _imported(PACKAGE / "agent" / name)
