"""A search worker imports a model spec only from the file the serving process registered,
checked by digest before anything is imported, and never from its current directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pgc_daemon.errors import SpecError
from pgc_daemon.modelspec import SpecOrigin, load_spec, spec_origin

SPEC_SOURCE = """
import pathlib, torch
pathlib.Path({marker!r}).write_text("imported")

def build():
    return torch.nn.Linear(4, 2), [torch.randn(1, 4)]
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A user's project folder holding ``userapp/model.py``, importable from the folder."""
    root = tmp_path / "project"
    (root / "userapp").mkdir(parents=True)
    (root / "userapp" / "__init__.py").write_text("")
    marker = tmp_path / "imported.txt"
    (root / "userapp" / "model.py").write_text(SPEC_SOURCE.format(marker=str(marker)))
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("userapp", "userapp.model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return root, marker


def test_the_origin_names_root_file_and_digest(project: tuple[Path, Path]) -> None:
    root, marker = project
    origin = spec_origin("userapp.model:build")
    assert origin is not None
    assert Path(origin.root) == root.resolve()
    assert Path(origin.file) == (root / "userapp" / "model.py").resolve()
    assert len(origin.sha256) == 64
    assert not marker.exists()  # finding the origin imports nothing
    assert SpecOrigin.from_json(origin.to_json()) == origin


def test_a_spec_loads_from_its_recorded_origin(project: tuple[Path, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _root, marker = project
    origin = spec_origin("userapp.model:build")
    assert origin is not None
    monkeypatch.chdir(tmp_path)  # the worker runs elsewhere: the recorded root is what counts
    spec = load_spec("userapp.model:build", origin)
    assert marker.exists() and spec.model.in_features == 4


def test_a_changed_spec_file_is_refused_before_it_is_imported(project: tuple[Path, Path]) -> None:
    root, marker = project
    origin = spec_origin("userapp.model:build")
    assert origin is not None
    source = root / "userapp" / "model.py"
    source.write_text(source.read_text() + "\nimport os  # tampered\n")
    with pytest.raises(SpecError, match="changed since the serving process registered it"):
        load_spec("userapp.model:build", origin)
    assert not marker.exists()
    assert "userapp.model" not in sys.modules


def test_with_an_origin_the_current_directory_is_not_importable(
    project: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module of the same name planted in the worker's current directory is not what gets
    imported: only the recorded root is put on the path."""
    root, marker = project
    origin = spec_origin("userapp.model:build")
    assert origin is not None
    elsewhere = tmp_path / "cwd"
    (elsewhere / "planted").mkdir(parents=True)
    (elsewhere / "planted" / "__init__.py").write_text(
        f"import pathlib; pathlib.Path({str(tmp_path / 'planted.txt')!r}).write_text('x')\n"
    )
    monkeypatch.chdir(elsewhere)
    load_spec("userapp.model:build", origin)
    assert str(elsewhere) not in sys.path
    with pytest.raises(ModuleNotFoundError):
        __import__("planted")
    assert not (tmp_path / "planted.txt").exists()


def test_an_origin_whose_file_is_gone_is_refused(tmp_path: Path) -> None:
    origin = SpecOrigin(str(tmp_path), str(tmp_path / "gone.py"), "0" * 64)
    with pytest.raises(SpecError, match="cannot be read"):
        load_spec("gone:build", origin)


def test_the_worker_refuses_a_model_whose_spec_origin_was_not_recorded(
    store: Any, settings: Any, mlp_spec: dict
) -> None:
    """A model row with a spec but no recorded origin (written by anything but an agent that
    found the module) is refused before any import."""
    import store as st
    from pgc_daemon.errors import SearchError
    from pgc_daemon.optimizer.search.runner import run_live_search
    from pgc_daemon.reservoir import InputReservoir
    from pgc_daemon.policy import Policy, PolicySnapshot

    reservoir = InputReservoir(32)
    for args in mlp_spec["example_inputs"][:16]:
        reservoir.offer(tuple(args), {})
    with store.session() as s:
        model = st.repo.upsert_model(s, "mlp", spec="pgc_daemon.examples.digits:mlp")
        st.repo.save_reservoir(s, model.id, reservoir.serialize(), len(reservoir), reservoir.seen)
        run = st.repo.create_search_run(
            s, model.id, study_name="x", policy_version=0, trigger="t", trials_budget=1,
            policy=PolicySnapshot(Policy(), 0).to_json(),
        )
        run_id = run.id
    with pytest.raises(SearchError, match="did not record where"):
        run_live_search(settings, run_id)
    with store.session() as s:
        assert st.repo.get_search_run(s, run_id).state == "failed"
