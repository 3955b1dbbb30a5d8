"""pgc: a profile-guided compilation daemon for PyTorch inference.

In your server: ``served = pgc_daemon.attach(model, name="...", spec="pkg.mod:build")`` and
call ``served(...)`` instead of ``model(...)``; run ``pgc serve`` beside it.
"""

from pgc_daemon.agent import ServedModel, attach
from pgc_daemon.errors import PgcError, PolicyError, SearchError, SpecError
from pgc_daemon.policy import Policy
from pgc_daemon.settings import Settings

__all__ = [
    "PgcError",
    "Policy",
    "PolicyError",
    "SearchError",
    "ServedModel",
    "Settings",
    "SpecError",
    "attach",
]
