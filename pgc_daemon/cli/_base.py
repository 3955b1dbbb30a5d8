"""What every command shares: exit codes, the usage error, settings from options."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pgc_daemon.errors import UsageError
from pgc_daemon.settings import Settings

if TYPE_CHECKING:
    from store import Store

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "UsageError",
    "add_backends_option",
    "add_store_option",
    "add_token_option",
    "backends_from",
    "clip",
    "existing_store",
    "settings_from",
]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def clip(text: str, width: int, *, tail: bool = False) -> str:
    """``text`` in at most ``width`` characters for a table cell, cut at its end (``tail``: at
    its start, where a layer's path tells it apart). JSON output keeps the whole text."""
    if len(text) <= width:
        return text
    return "…" + text[1 - width:] if tail else text[: width - 1] + "…"


def add_store_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store", dest="store_url", help="store URL (default: sqlite:///pgc.db or PGC_STORE_URL)"
    )


def add_token_option(p: argparse.ArgumentParser) -> None:
    # No --token: a command line is visible to every user of the machine (ps, /proc).
    p.add_argument(
        "--token-file",
        dest="api_token_file",
        metavar="PATH",
        help="file holding the API token (default: PGC_API_TOKEN, else <PGC_WORK_DIR>/token)",
    )


def add_backends_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", help="comma-separated backends the search may choose, e.g. "
                   "inductor,onnxruntime (default: every installed one)")


def backends_from(args: argparse.Namespace) -> list[str] | None:
    """``--backends`` as the policy's list (None: every installed one)."""
    if args.backends is None:
        return None
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not names:
        raise UsageError("--backends names no backend")
    return names


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings from the environment (PGC_*), overridden by the options given."""
    updates = {}
    for key in ("store_url", "host", "port", "api_token_file", "allow_remote"):
        value = getattr(args, key, None)
        if value is not None:
            updates[key] = value
    if updates.get("api_token_file"):
        updates["api_token"] = None  # the file named on the command line wins over PGC_API_TOKEN
    return Settings().model_copy(update=updates)


def existing_store(args: argparse.Namespace) -> Store:
    """The store of the options (``--store``, PGC_STORE_URL, else ``sqlite:///pgc.db`` here)
    for a command that reads or changes what serves: a SQLite file that is not there is a
    usage error, not a new empty store (``pgc status`` in the wrong folder listed no models
    and left a ``pgc.db`` behind)."""
    import store as st  # noqa: PLC0415

    try:
        return st.open_store(settings_from(args).store_url, create=False)
    except st.NotFound as exc:
        raise UsageError(f"{exc}: `pgc serve` or `pgc demo` makes one in the folder it runs "
                         "in; --store or PGC_STORE_URL names another") from None
