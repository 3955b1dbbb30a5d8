"""One module per ``pgc`` command, found by :func:`discover`: each public module here has
``register(subparsers)`` (which sets ``func``) and an ``ORDER`` for ``pgc --help``."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def discover() -> list[ModuleType]:
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__))
