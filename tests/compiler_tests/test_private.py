"""Folders pgc loads pickled graphs and generated code from are private to it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from compiler import CompileCache, UnsafeFolderError, private_dir


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_created_private_even_under_a_loose_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        folder = private_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert _mode(folder) == 0o700
    assert _mode(tmp_path / "a") == 0o700


def test_the_compile_cache_folder_is_private(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "cache")
    assert cache.folder is not None
    for sub in (cache.folder, cache.folder / "variants", cache.folder / "inductor"):
        assert _mode(sub) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o722, 0o702])
def test_a_folder_others_may_write_to_is_refused(tmp_path: Path, mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(UnsafeFolderError, match="writable by group or others"):
        private_dir(folder)
    with pytest.raises(UnsafeFolderError):
        CompileCache(folder)


def test_a_folder_readable_by_others_but_not_writable_is_accepted(tmp_path: Path) -> None:
    folder = tmp_path / "readable"
    folder.mkdir()
    folder.chmod(0o755)
    assert private_dir(folder) == folder


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand a folder to another user")
def test_a_folder_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(UnsafeFolderError, match="belongs to user 65534"):
        private_dir(folder)
