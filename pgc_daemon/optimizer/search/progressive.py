"""Deploying while the search goes on.

A search of six trials takes minutes on a small machine; the first good trial is often known
long before the last. So every trial the policy deploys is offered at once: the first trial that
is feasible and ``min_speedup`` faster than what serves becomes a candidate deployment while the
search continues, and a later trial replaces it the same way when it is ``min_speedup`` faster
than the better of what serves and what is being deployed. The agent verifies and canaries each
of them like any other deployment.

A model has at most one open deployment. A trial good enough while another deployment is still
open is remembered (the fastest such trial), and offered again every ``RETRY_S`` by a small
thread of the worker and after each trial, so it goes out as soon as the open one ends: judged
then against what that one came to. At the end of the run the policy's final choice goes through
:func:`~pgc_daemon.services.deployments.propose` as before, unless this run already proposed it;
when a deployment is still open then and the choice would beat it, the worker waits (at most
``FINAL_WAIT_S``, and not for a deployment no agent is working on) before proposing it.

The decisions are :func:`eligible` here and :func:`~pgc_daemon.services.deployments.not_faster`
there (pure); :class:`Progressive` holds the run's state and goes through the store.
"""

from __future__ import annotations

import logging
import threading
import time

import store as st
from compiler import Recipe
from pgc_daemon.optimizer.search.results import TrialRecord
from pgc_daemon.policy import Policy
from pgc_daemon.services.deployments import (
    Proposal,
    not_faster,
    propose,
    propose_while_searching,
    standing,
)
from pgc_daemon.states import STALE_AFTER_S, D

log = logging.getLogger("pgc.search")

#: How often a remembered trial is offered again while another deployment is open.
RETRY_S = 2.0
#: The longest the worker waits, after its search, for an open deployment to end before it
#: proposes the final choice.
FINAL_WAIT_S = 600.0
#: How often it looks while it waits.
FINAL_POLL_S = 1.0

_BASE_HASH = Recipe().hash
#: How a deployment ends without serving.
_LOST = frozenset({D.FAILED, D.ROLLED_BACK, D.CANCELLED})


def eligible(rec: TrialRecord, policy: Policy) -> bool:
    """Whether a trial may be deployed while the search goes on: the policy deploys
    automatically, and the trial was timed, is feasible under the policy and is not the
    unmodified model (whether it is fast enough depends on what serves then)."""
    return (
        policy.auto_deploy
        and rec.state == "complete"
        and rec.feasible
        and not rec.duplicate
        and rec.speedup is not None
        and rec.recipe_hash != _BASE_HASH
    )


def proposal(rec: TrialRecord, *, trial: int | None = None, trials: int | None = None) -> Proposal:
    """A trial as the deployment decision takes it (``trial`` of ``trials``: while searching)."""
    return Proposal(
        rec.recipe_hash,
        rec.recipe,
        rec.label,
        rec.speedup,
        rec.fidelity,
        rec.message,
        artifact=rec.artifact,
        trial=trial,
        trials=trials,
    )


class Progressive:
    """The deployments one search run makes while it searches, and its final proposal.

    Thread-safe: the search thread offers trials, the retry thread offers the remembered one
    again; one lock orders them."""

    def __init__(
        self,
        store: st.Store,
        model_id: int,
        run_id: int | None,
        policy: Policy,
        budget: int,
        *,
        retry_s: float = RETRY_S,
    ) -> None:
        self.store = store
        self.model_id = model_id
        self.run_id = run_id
        self.policy = policy
        self.budget = budget
        self.retry_s = retry_s
        self.pending: Proposal | None = None
        """The fastest trial good enough to deploy that waits for an open deployment to end."""
        self.proposed: dict[str, int] = {}
        """Recipe hash -> the deployment this run created for it while searching."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ while searching

    def offer(self, rec: TrialRecord, done: int) -> int | None:
        """Offer trial ``rec`` (the ``done``-th of the run): returns the deployment created for
        it or for the trial remembered earlier, if one was."""
        if not eligible(rec, self.policy):
            return self.retry()
        with self._lock:
            if rec.recipe_hash not in self.proposed and (
                self.pending is None or (rec.speedup or 0.0) > (self.pending.speedup or 0.0)
            ):
                self.pending = proposal(rec, trial=done, trials=self.budget)
            return self._try()

    def retry(self) -> int | None:
        """Offer the remembered trial again (an open deployment may have ended)."""
        with self._lock:
            return self._try()

    def _try(self) -> int | None:
        chosen = self.pending
        if chosen is None:
            return None
        offer = propose_while_searching(
            self.store, self.model_id, chosen, self.policy, run_id=self.run_id
        )
        if offer.deployment_id is not None:
            log.info("run %s: deployed %s while searching", self.run_id, chosen.label)
            self.proposed[chosen.recipe_hash] = offer.deployment_id
            self.pending = None
        elif not offer.waiting:  # no longer good enough: forget it
            log.info("run %s: not deploying %s: %s", self.run_id, chosen.label, offer.reason)
            self.pending = None
        return offer.deployment_id

    def start(self) -> Progressive:
        """Start the thread that offers the remembered trial again every ``retry_s``."""
        if self.policy.auto_deploy and self._thread is None:
            self._thread = threading.Thread(target=self._retry_loop, name="pgc-progressive", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _retry_loop(self) -> None:
        while not self._stop.wait(self.retry_s):
            if self.pending is None:
                continue
            try:
                self.retry()
            except Exception as exc:  # noqa: BLE001 - the next round or the final proposal retries
                log.warning("run %s: offering a trial again failed: %s", self.run_id, exc)

    # ------------------------------------------------------------------ the end

    def finish(self, chosen: TrialRecord | None, *, wait_s: float = FINAL_WAIT_S) -> int | None:
        """Propose the run's final choice (after the run is recorded as finished), unless this
        run already deployed it while searching. When another deployment is still open and the
        choice would beat it, wait for it to end first (at most ``wait_s``)."""
        self.stop()
        with self._lock:
            self.pending = None
        if chosen is None:
            return None
        if chosen.recipe_hash in self.proposed:
            self._explain_lost(chosen, self.proposed[chosen.recipe_hash])
            return None  # its deployment (and what came of it) is in the history already
        final = proposal(chosen)
        if self.policy.auto_deploy and chosen.recipe_hash != _BASE_HASH:
            self._wait_for_open(final, wait_s)
        return propose(self.store, self.model_id, final, self.policy, run_id=self.run_id)

    def _explain_lost(self, chosen: TrialRecord, deployment_id: int) -> None:
        """The final choice was deployed while searching and did not end up serving (its
        canary rolled it back, it failed or was cancelled): say so, as :func:`propose` says
        why it keeps the current module, so the run's outcome is never silent."""
        with self.store.session() as s:
            dep = st.repo.get_deployment(s, deployment_id)
            if dep.state not in _LOST:
                return  # serving, replaced by a better one, or still open: the history says
            ended = str(dep.state).replace("_", " ")
            st.repo.add_event(
                s,
                self.model_id,
                "kept",
                f"kept the current module: the run's choice {chosen.label} was {ended} "
                f"while searching (deployment {dep.id}: {dep.reason or 'no reason recorded'})",
            )

    def _wait_for_open(self, final: Proposal, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self.store.session() as s:
                now = standing(s, self.model_id)
            if now.busy_id is None or not_faster(final.speedup, now, self.policy.min_speedup):
                return
            if time.time() - (now.busy_updated_at or 0.0) > STALE_AFTER_S:
                return  # no agent works on it: the daemon fails it, propose says why it waited
            time.sleep(FINAL_POLL_S)
