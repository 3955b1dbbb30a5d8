"""pgc's error root. The libraries below ``pgc_daemon`` keep their own roots (they may not
import this package); :func:`describe` is how the outer layers (CLI, API) turn any of them
into one readable line."""

from __future__ import annotations

from compiler import CompilerError
from store import StoreError


class PgcError(Exception):
    """Root of the errors ``pgc_daemon`` raises."""


class SpecError(PgcError, ValueError):
    """A MODEL_SPEC could not be imported or did not return what it must."""


class PolicyError(PgcError, ValueError):
    """A policy is invalid."""


class SearchError(PgcError, RuntimeError):
    """A search could not run (no inputs, no spec, a worker died)."""


class DeployFailed(PgcError, RuntimeError):
    """A step of a deployment failed; the message is the recorded reason."""


class UsageError(PgcError, ValueError):
    """Bad command-line input (exit code 2)."""


KNOWN_ERRORS: tuple[type[BaseException], ...] = (PgcError, CompilerError, StoreError)


def describe(exc: BaseException) -> str:
    """One line for a person: the message, without a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text
