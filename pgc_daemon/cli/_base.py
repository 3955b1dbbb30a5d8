"""What every command shares: exit codes, the usage error, settings from options."""

from __future__ import annotations

import argparse

from pgc_daemon.errors import UsageError
from pgc_daemon.settings import Settings

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_USAGE", "UsageError", "add_store_option", "settings_from"]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_store_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store", dest="store_url", help="store URL (default: sqlite:///pgc.db or PGC_STORE_URL)"
    )


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment (PGC_*), overridden by the options given."""
    updates = {}
    for key in ("store_url", "host", "port", "api_token"):
        value = getattr(args, key, None)
        if value is not None:
            updates[key] = value
    return Settings().model_copy(update=updates)
