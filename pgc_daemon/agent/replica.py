"""This serving process as one replica of its model.

A model may be served by several processes at once: the workers of ``uvicorn --workers N`` or
gunicorn on one host, replicas on several hosts sharing one PostgreSQL store. They share one
model record, one search and one deployment decision; each process is a row in
``pgc_replicas`` saying what it serves, how fast, and whether it compiled anything itself.
The row is refreshed every :data:`~pgc_daemon.states.HEARTBEAT_S` by a thread of its own
(no torch work in it, so no OpenMP team), so the API shows the fleet and a replica that
starts can tell which of the others are alive.

A replica is *alive* when it has not stopped and was heard from within
:data:`~pgc_daemon.states.STALE_AFTER_S`; one on this host whose process is gone is dead
at once (a ``kill -9`` leaves its row fresh for a minute).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

import store as st
from pgc_daemon import states
from pgc_daemon.errors import describe

log = logging.getLogger("pgc.agent")
HOST = socket.gethostname()


def new_name() -> str:
    """``host:pid:random``: unique across restarts of a process that gets the same pid."""
    return f"{HOST}:{os.getpid()}:{secrets.token_hex(3)}"


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive as far as we can tell
        return False
    return False


def others_alive(sess: Session, model_id: int, me: str) -> list[st.Replica]:
    """The model's other live replicas; rows of processes on this host that are gone are
    marked stopped on the way."""
    alive = []
    for r in st.repo.live_replicas(sess, model_id, states.STALE_AFTER_S):
        if r.name == me:
            continue
        if r.host == HOST and process_gone(r.pid):
            st.repo.stop_replica(sess, r.name)
            continue
        alive.append(r)
    return alive


@dataclass
class Report:
    """What the replica row says of this process at one beat."""

    state: str
    variant_id: int | None
    deployment_id: int | None
    calls: int
    live_ms: float | None
    compiles: int
    loads: int
    message: str | None = None


def trimmed_mean(values: Sequence[float], keep: float = 0.8) -> float | None:
    """Mean of the middle ``keep`` share (live latency is bimodal on a busy machine)."""
    if not values:
        return None
    ordered = sorted(values)
    cut = int(len(ordered) * (1 - keep) / 2)
    middle = ordered[cut : len(ordered) - cut] or ordered
    return statistics.fmean(middle)


class Replica:
    """The replica row of this process: registered with the model, refreshed by
    :meth:`start`'s thread from ``report()`` until :meth:`stop`."""

    def __init__(self, store: Callable[[], st.Store], report: Callable[[], Report]) -> None:
        self.name = new_name()
        self._store = store
        self._report = report
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = False

    def register(self, sess: Session, model_id: int) -> None:
        """Insert the row, inside the caller's registration transaction."""
        st.repo.register_replica(sess, model_id, self.name, HOST, os.getpid())
        self.registered = True

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pgc-replica", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        """Write the current report now (a failure is logged; the next beat tries again)."""
        if not self.registered:
            return
        r = self._report()
        try:
            with self._store().session() as sess:
                st.repo.beat_replica(
                    sess, self.name, state=r.state, variant_id=r.variant_id,
                    deployment_id=r.deployment_id, calls=r.calls, live_ms=r.live_ms,
                    compiles=r.compiles, loads=r.loads, message=r.message,
                )
        except Exception as exc:  # noqa: BLE001 - a missed beat is retried
            log.debug("replica beat failed: %s", describe(exc))

    def _run(self) -> None:
        while not self._done.wait(states.HEARTBEAT_S):
            self.beat()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self.registered:
            return
        try:
            with self._store().session() as sess:
                st.repo.stop_replica(sess, self.name)
        except Exception as exc:  # noqa: BLE001 - the row goes stale instead
            log.debug("could not mark replica %s stopped: %s", self.name, describe(exc))
