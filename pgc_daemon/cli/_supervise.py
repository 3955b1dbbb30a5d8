"""``pgc optimize``'s search in a child process, so a native crash inside a build does not end
the command.

A compiler or runtime can end the process that builds (a segfault, a heap corruption: seen on
``nn.TransformerEncoder`` under max-autotune and once on a ViT's OpenVINO int8 trial). The live
loop builds in worker processes; ``pgc optimize`` built in its own and died with the trials so
far, printing nothing. Now the command's process only draws progress: the search runs in a
child (``spawn``) on an Optuna study in SQLite (the user's ``--storage``, or a private
temporary file), and a child that dies without running Python is started again on the same
study, which records the recipe it was building as failed (``search/inflight.py``) and goes
on. Ctrl-C and ``SIGTERM`` reach the child as an orderly stop: its trial in flight is
withdrawn, not blamed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pgc_daemon.errors import SearchError

if TYPE_CHECKING:
    from pgc_daemon.optimizer.search.offline import OfflineResult
    from pgc_daemon.policy import Policy

#: at most this many child processes that ended natively, then the command gives up
MAX_CRASHES = 5
#: how long a child told to stop may take to withdraw its trial before it is killed
STOP_GRACE_S = 10.0


class SearchCrashed(SearchError):
    """The search's process ended natively more than :data:`MAX_CRASHES` times."""


def optimize_supervised(
    spec: str,
    policy: Policy,
    *,
    storage: str | None,
    seed: int,
    with_sensitivity: bool,
    on_trial: Callable[[Any, int, int], None],
    on_crash: Callable[[str], None],
) -> tuple[OfflineResult, int]:
    """``offline.optimize`` in a child process, started again on the same study after each
    native crash; returns the result and how many crashes it took. The child's errors are
    raised here as they were raised there."""
    ctx = mp.get_context("spawn")
    started = time.monotonic()
    crashes = 0
    with tempfile.TemporaryDirectory(prefix="pgc-optimize-") as tmp:  # private: mode 0700
        url = storage or f"sqlite:///{os.path.join(tmp, 'study.db')}"
        while True:
            left = max(policy.time_budget_s - (time.monotonic() - started), 1.0)
            run_policy = policy.model_copy(update={"time_budget_s": left})
            kind, payload, code = _one_child(ctx, (spec, run_policy, url, seed, with_sensitivity),
                                             on_trial)
            if kind == "done":
                return payload, crashes
            if kind == "error":
                raise payload
            crashes += 1
            how = _signal_name(code)
            if crashes > MAX_CRASHES:
                raise SearchCrashed(
                    f"the search process ended {crashes} times ({how} the last time); "
                    + ("the study in --storage keeps the trials so far" if storage else
                       "pass --storage sqlite:///study.db to keep the trials between runs"))
            on_crash(f"the search process ended ({how}) during a build; resuming the study, "
                     "which records that recipe as failed")


def _one_child(ctx: Any, args: tuple[Any, ...],
               on_trial: Callable[[Any, int, int], None]) -> tuple[str, Any, int | None]:
    """Run one child to its end: ("done", result), ("error", exception) or ("crashed", None)
    with its exit code."""
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, *args), name="pgc-optimize-search",
                       daemon=True)
    proc.start()
    send.close()
    try:
        while True:
            try:
                kind, payload = receive.recv()
            except EOFError:  # the child ended without a last word: it crashed
                proc.join()
                return "crashed", None, proc.exitcode
            if kind == "trial":
                on_trial(*payload)
                continue
            proc.join()
            return kind, payload, proc.exitcode
    except BaseException:  # Ctrl-C (the child has it too) or SIGTERM here: stop it in order
        _stop(proc)
        raise
    finally:
        receive.close()


def _stop(proc: Any) -> None:
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGTERM)  # withdraws its trial (``interrupt_on_sigterm``)
    proc.join(STOP_GRACE_S)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"exit code {code}"


def _child(send: Connection, spec: str, policy: Policy, storage: str, seed: int,
           with_sensitivity: bool) -> None:
    """The search, in the child: progress and the outcome go back through ``send``."""
    from pgc_daemon.optimizer.search.inflight import interrupt_on_sigterm
    from pgc_daemon.optimizer.search.offline import optimize

    interrupt_on_sigterm()
    try:
        out = optimize(spec, policy, storage=storage, seed=seed, with_sensitivity=with_sensitivity,
                       on_trial=lambda rec, done, budget: send.send(("trial", (rec, done, budget))))
        send.send(("done", out))
    except KeyboardInterrupt:
        send.send(("error", KeyboardInterrupt()))
    except SystemExit:  # SIGTERM from the command: it stops anyway
        raise
    except Exception as exc:  # noqa: BLE001 - the command reports it as raised here
        try:
            send.send(("error", exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text does
            send.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
