"""The layout's promises, checked on the source: imports go one way, and ``import pgc_daemon``
(hence ``pgc --help``) loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAVES = ("compiler", "profiler", "store")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count, and so
    do ``TYPE_CHECKING`` ones: a cycle hidden behind either is still a cycle)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for top in ("pgc_daemon", *LEAVES) for p in (ROOT / top).rglob("*.py")]
    names = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph[name] = {m for m in _imports(path) if m in names and m != name}
    return graph


def _package_of(module: str) -> str:
    return module.split(".")[0]


def test_leaves_import_neither_each_other_nor_pgc_daemon() -> None:
    wrong = [
        f"{src} imports {dst}"
        for src, dsts in _graph().items()
        if _package_of(src) in LEAVES
        for dst in dsts
        if _package_of(dst) != _package_of(src)
    ]
    assert not wrong, wrong


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules (a package's ``__init__`` re-exporting its own modules
    is not a cycle: importing ``pkg.mod`` runs ``pkg`` first by definition)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if node.startswith(nxt + "."):  # a module importing its own package's __init__
                continue
            if nxt.startswith(node + "."):  # a package __init__ re-exporting its module
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle_inside_pgc_daemon() -> None:
    graph = {k: v for k, v in _graph().items() if k.startswith("pgc_daemon")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z", "a.x"]
    assert _cycle({"a.x": {"a.y"}, "a.y": set()}) is None


def _loads_torch(code: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('torch' in sys.modules)"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )
    return out.stdout.strip().splitlines()[-1] == "True"


def test_import_pgc_daemon_loads_no_torch() -> None:
    assert not _loads_torch("import pgc_daemon")
    assert not _loads_torch("import pgc_daemon.cli; pgc_daemon.cli.build_parser()")
    # and the lazy names still resolve (this one does load torch)
    assert _loads_torch("import pgc_daemon; pgc_daemon.attach")


#: What each wing of pgc_daemon may import from the others (the base modules beside them,
#: errors/settings/policy/states/modelspec, any wing may import).
WINGS_MAY_IMPORT = {
    "agent": set(),
    "services": set(),
    "optimizer": {"services"},
    "api": {"services", "optimizer"},
    "examples": set(),
}


def test_wings_import_only_downwards() -> None:
    wings = {"agent", "services", "optimizer", "api", "cli", "examples"}
    wrong = []
    for src, dsts in _graph().items():
        parts = src.split(".")
        if parts[0] != "pgc_daemon" or len(parts) < 3 or parts[1] not in WINGS_MAY_IMPORT:
            continue
        for dst in dsts:
            dparts = dst.split(".")
            if dparts[0] == "pgc_daemon" and len(dparts) > 1 and dparts[1] in wings:
                if dparts[1] != parts[1] and dparts[1] not in WINGS_MAY_IMPORT[parts[1]]:
                    wrong.append(f"{src} imports {dst}")
    assert not wrong, wrong
