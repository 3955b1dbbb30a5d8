"""The heartbeat of a deployment in flight: while an agent's swapper works on a deployment,
it refreshes the deployment's ``updated_at`` every :data:`~pgc_daemon.states.HEARTBEAT_S`,
so that another process may fail an in-flight deployment whose heartbeat is older than
:data:`~pgc_daemon.states.STALE_AFTER_S` (its agent was killed), and the swapper learns
within one beat that someone else ended it (an operator's cancel)."""

from __future__ import annotations

import logging
import threading

import store as st
from pgc_daemon import states
from pgc_daemon.agent.registry import Registry
from pgc_daemon.errors import describe

log = logging.getLogger("pgc.swapper")


class Heartbeat:
    """Refreshes one deployment's ``updated_at`` every ``interval`` seconds in a thread of its
    own (no torch work in it, so no OpenMP team) until :meth:`finish`. Sets ``moved`` when
    the deployment turned out ended by someone else (a cancel, a process that judged it
    stale). A failing store is only logged: the next beat tries again."""

    def __init__(self, registry: Registry, dep_id: int, interval: float | None = None) -> None:
        self.registry = registry
        self.dep_id = dep_id
        self.interval = states.HEARTBEAT_S if interval is None else interval
        self.moved = threading.Event()
        self.beats = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pgc-heartbeat-{dep_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def finish(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                with self.registry.store().session() as sess:
                    state = st.repo.touch_deployment(sess, self.dep_id)
            except st.NotFound:
                self.moved.set()
                return
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried
                log.debug("heartbeat of deployment %s failed: %s", self.dep_id, describe(exc))
                continue
            self.beats += 1
            if state in states.TERMINAL:
                self.moved.set()
                return
