"""Trials a search process did not live to finish.

A build can end the whole process: a segfault or a heap corruption inside a compiler or a
runtime (seen on ``nn.TransformerEncoder`` under max-autotune: ``free(): invalid next size``).
Left as it was, the next worker resumes the study and is handed the same recipe again (a
baseline not yet recorded, or the same neighbor of the same best), and crashes again until
the schedule gives up on the study. So while a trial is evaluated it already holds a failed
record that blames its recipe; the trial's real outcome replaces it. A process that dies
mid-trial leaves that record behind, and the study that opens next closes the trial with it:
the recipe counts as tried, failed, and is never built again by that study.

An orderly interruption (``SIGTERM`` when ``pgc serve`` stops, Ctrl-C of ``pgc optimize``)
raises in the search's thread instead of killing it: the record is withdrawn, and the recipe
may be tried again later. Only a process that ends without running Python (a native crash,
``SIGKILL``, the OOM killer) leaves the blame in place.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import optuna

from pgc_daemon.optimizer.search.results import TrialRecord

if TYPE_CHECKING:
    from compiler import Recipe

#: The message of a trial whose process ended during it.
ENDED = ("the search process ended during this trial (a crash in native code, or a kill): "
         "not tried again")


#: The trial in flight in this process, for the ``SIGTERM`` backstop to withdraw.
_in_flight: list[optuna.Trial] = []


@contextmanager
def blamed_until_done(trial: optuna.Trial, params: dict[str, Any], recipe: Recipe,
                      **attrs: Any) -> Iterator[None]:
    """Hold a failed record on ``trial`` while the block runs (the block's own record
    replaces it); withdraw it when the block is interrupted (``KeyboardInterrupt``,
    ``SystemExit``). ``attrs``: further user attributes the trial keeps either way."""
    rec = TrialRecord(number=trial.number, state="failed", params=dict(params),
                      recipe=recipe.to_dict(), recipe_hash=recipe.hash, label=recipe.label(),
                      message=ENDED)
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    trial.set_user_attr("record", rec.to_dict())
    _in_flight.append(trial)
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        _withdraw(trial)
        raise
    finally:
        _in_flight.remove(trial)


def _withdraw(trial: optuna.Trial) -> None:
    try:
        trial.set_user_attr("record", None)
    except Exception:  # noqa: BLE001 - told already (nothing to withdraw), or storage gone
        pass


def close_unfinished(study: optuna.Study) -> int:
    """Close the trials an earlier process left running (each keeps the record it held, if
    any: see :func:`blamed_until_done`). Returns how many were blamed on their recipe."""
    blamed = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        blamed += t.user_attrs.get("record") is not None
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    return blamed


def interrupt_on_sigterm(grace_s: float = 5.0) -> None:
    """Make ``SIGTERM`` raise ``SystemExit`` in the main thread, so a trial in flight is
    withdrawn, not blamed, instead of ending the process at once. Python runs that handler
    only between bytecodes: a main thread inside one long native call (a compile, a
    runtime's graph build) would not see it. So a thread woken by the signal itself (the
    interpreter's wakeup fd) withdraws the trial and ends the process ``grace_s`` later if it
    is still there. Call from the main thread; it takes over the wakeup fd."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)

    def backstop() -> None:
        while signal.SIGTERM not in os.read(read, 64):
            pass
        time.sleep(grace_s)
        for trial in list(_in_flight):
            _withdraw(trial)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=backstop, name="pgc-sigterm-backstop", daemon=True).start()
