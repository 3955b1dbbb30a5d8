"""Folders pgc loads code from (pickled graphs, Inductor's generated kernels, the worker logs
beside them) must be private to the user pgc runs as: anyone who can write there can run code
in the serving process. They are created with mode 0700, and an existing one is refused when
another user owns it or when group or others may write to it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from compiler._errors import UnsafeFolderError


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, or check an existing one; returns
    it. Raises :class:`UnsafeFolderError` when it is owned by someone else or group/world
    writable (pgc never loosens or takes over a folder it did not make: say so and stop)."""
    folder = Path(path).expanduser()
    old = os.umask(0o077)
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    finally:
        os.umask(old)
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode):
        info = folder.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolderError(f"{folder} is not a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeFolderError(
            f"{folder} belongs to user {info.st_uid}, not to this user ({os.getuid()}); pgc "
            "loads code from it, so it must be yours: choose another PGC_WORK_DIR"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeFolderError(
            f"{folder} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); pgc "
            f"loads code from it: run 'chmod go-w {folder}' or choose another PGC_WORK_DIR"
        )
    return folder
