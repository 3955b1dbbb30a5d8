"""pgc: a profile-guided compilation daemon for PyTorch inference.

In your server: ``served = pgc_daemon.attach(model, name="...", spec="pkg.mod:build")`` and
call ``served(...)`` instead of ``model(...)``; run ``pgc serve`` beside it.

The public names load on first use (PEP 562), so ``import pgc_daemon``, ``pgc --help`` and
``pgc doctor`` start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pgc_daemon.agent import ServedModel, attach
    from pgc_daemon.errors import PgcError, PolicyError, SearchError, SpecError
    from pgc_daemon.policy import Policy
    from pgc_daemon.settings import Settings
    from profiler import exclusive_trace

_PUBLIC = {
    "PgcError": "pgc_daemon.errors",
    "Policy": "pgc_daemon.policy",
    "PolicyError": "pgc_daemon.errors",
    "SearchError": "pgc_daemon.errors",
    "ServedModel": "pgc_daemon.agent",
    "Settings": "pgc_daemon.settings",
    "SpecError": "pgc_daemon.errors",
    "attach": "pgc_daemon.agent",
    "exclusive_trace": "profiler",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pgc_daemon' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
