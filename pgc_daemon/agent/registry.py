"""The agent's side of the store: registering the model, exporting what the profiler measured,
saving the input reservoir, and reading the current policy.

Threading: :meth:`Registry.register`, :meth:`Registry.ensure_metric` and
:meth:`Registry.current_policy` run in the swapper thread; :meth:`Registry.export` is the
profiler's sink and runs in its exporter thread; :meth:`Registry.save` runs in the thread that
flushes or closes the served model. None of them runs on the request path. ``model_id`` and
``baseline_variant_id`` are written once (by ``register``) and only read afterwards.
"""

from __future__ import annotations

import logging
import time
import torch
from torch import nn

import store as st
from pgc_daemon.modelspec import spec_origin
from compiler import Recipe, choose_metric
from pgc_daemon import states
from pgc_daemon.agent.replica import Replica, others_alive
from pgc_daemon.agent.rows import window_rows
from pgc_daemon.agent.runtime import in_short_thread
from pgc_daemon.policy import Policy, load_policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings
from pgc_daemon.states import D
from profiler import Pacer, Window

log = logging.getLogger("pgc.agent")
#: The reservoir is written with the statistics when it changed, at most every
#: ``RESERVOIR_SAVE_S`` and, while serving is light, only as often as its measured cost fits
#: ``RESERVOIR_SHARE`` of the profiler's budget (it is charged to the profiler: the export runs
#: it), yet at least every ``RESERVOIR_MAX_S``. Rewritten every 30 s, MiniLM's 128 inputs
#: (13-29 ms a save) took 0.25% of serving at 20 calls a second of a 13 ms variant, half the
#: budget, and per-layer sampling of the deployed variant stopped.
RESERVOIR_SAVE_S, RESERVOIR_MAX_S = 30.0, 600.0
RESERVOIR_SHARE = 0.1


class Registry:
    """One served model's record in the store (created by :func:`~pgc_daemon.agent.attach`)."""

    def __init__(
        self,
        base: nn.Module,
        reservoir: InputReservoir,
        *,
        name: str,
        spec: str | None,
        settings: Settings,
        policy: Policy | None,
        metric: str | None,
        store: st.Store | None = None,
        budget: float | None = None,
    ) -> None:
        """``budget``: the profiler's overhead budget, which paces the reservoir's saves."""
        if not name or len(name) > 200 or "/" in name:
            raise ValueError("model name must be 1-200 characters without '/'")
        self.base = base
        self.reservoir = reservoir
        self.name = name
        self.spec = spec
        self.settings = settings
        self.policy = policy or Policy()
        self.metric = metric
        self.model_id: int | None = None
        self.baseline_variant_id: int | None = None
        self._store = store
        self._saved_version = -1
        self._serving_ns = 0.0  # served time in the windows exported so far
        self._reservoir_pace = Pacer(budget and RESERVOIR_SHARE * budget, RESERVOIR_SAVE_S,
                                     RESERVOIR_MAX_S, now=time.monotonic() - RESERVOIR_SAVE_S)

    @property
    def id(self) -> int:
        """The model's id in the store, for work that starts after :meth:`register`."""
        if self.model_id is None:
            raise RuntimeError("model not registered yet")
        return self.model_id

    def store(self) -> st.Store:
        if self._store is None:
            self._store = st.open_store(self.settings.store_url)
        return self._store

    def register(self, replica: Replica | None = None) -> int | None:
        """Register the model, its baseline variant and policy, and this process as one of
        its replicas; returns the id of the deployment this process serves first (the base
        deployment it created), or None when it joins a model whose active deployment it will
        follow. Called by the swapper thread (retried until the store answers).

        Under the model's lock, so replicas starting together (``uvicorn --workers N``) take
        one decision: a model attached for the first time, or whose weights changed, gets a
        base deployment (the active one, if any, is superseded); a model whose active
        deployment is for these same weights keeps it, and this replica follows it (loading
        its artifact). Deployments in flight are failed only when no other replica is alive
        to own them; candidates wait for whichever replica claims them."""
        from compiler import fingerprint, probe  # noqa: PLC0415

        graph_hash = fingerprint(self.base)
        hardware = probe()
        # where this process finds the spec's code: a search worker imports only that file
        origin = spec_origin(self.spec) if self.spec else None
        identity = Recipe()
        with self.store().session() as sess:
            st.repo.begin_write(sess)  # replicas starting together register one at a time
            try:
                previous_hash = st.repo.get_model(sess, self.name).graph_hash
            except st.NotFound:
                previous_hash = None
            model = st.repo.upsert_model(
                sess,
                self.name,
                spec=self.spec,
                spec_origin=origin.to_json() if origin is not None else None,
                graph_hash=graph_hash,
                hardware=hardware.key(),
                metric=self.metric,
                input_signature={"threads": torch.get_num_threads(), "hardware": hardware.summary()},
            )
            st.repo.lock_model(sess, model.id)
            baseline = st.repo.get_or_create_variant(
                sess, model.id, identity.hash, identity.to_dict(), identity.label()
            )
            if st.repo.get_policy(sess, model.id) is None:
                st.repo.put_policy(sess, model.id, self.policy.model_dump())
            same_model = previous_hash == graph_hash
            others = others_alive(sess, model.id, replica.name) if replica is not None else []
            active = st.repo.active_deployment(sess, model.id)
            for dep in st.repo.list_deployments(sess, model.id):
                if dep.state == D.ACTIVE and not same_model:
                    states.move(sess, dep.id, D.SUPERSEDED, "the model's weights changed")
                elif dep.state in states.IN_FLIGHT and (not same_model or not others):
                    states.move(sess, dep.id, D.FAILED, "agent restarted before it finished")
            base_dep: int | None = None
            if active is None or not same_model:
                dep = st.repo.create_deployment(
                    sess, model.id, baseline.id, source="attach", reason="the user's module, as attached"
                )
                states.move(sess, dep.id, D.ACTIVE, "serving the base module")
                base_dep = dep.id
            elif active.variant_id == baseline.id:
                base_dep = active.id
            if replica is not None:
                replica.register(sess, model.id)
            self.model_id = model.id
            self.baseline_variant_id = baseline.id
            saved = st.repo.load_reservoir(sess, model.id) if same_model else None
        if saved is not None and len(self.reservoir) == 0:
            # the live inputs of the last run: calibration and verification need not wait
            self.reservoir.load(InputReservoir.deserialize(saved.payload), seen=saved.seen)
        return base_dep

    def ensure_metric(self) -> None:
        """Pick the fidelity metric from a real output once live inputs exist."""
        if self.metric is not None or len(self.reservoir) == 0:
            return
        args, kwargs = self.reservoir.snapshot()[0]

        def forward() -> object:
            with torch.inference_mode():
                return self.base(*args, **kwargs)

        # in a thread that ends: the long-lived swapper thread must not keep an OpenMP team
        self.metric = choose_metric(in_short_thread(forward))
        if self.model_id is not None:
            with self.store().session() as sess:
                st.repo.upsert_model(sess, self.name, metric=self.metric)

    def current_policy(self) -> Policy:
        """The stored policy (the API may have changed it), else the one given to attach."""
        if self.model_id is None:
            return self.policy
        try:
            with self.store().session() as sess:
                self.policy = load_policy(sess, self.model_id, default=self.policy).policy
        except Exception:  # noqa: BLE001
            log.debug("policy read failed; keeping the last one", exc_info=True)
        return self.policy

    def export(self, windows: list[Window]) -> None:
        """Profiler sink (exporter thread): a batch of windows in one transaction — request
        and layer rows, host samples, events (leak warnings, sampling-rate changes)."""
        if self.model_id is None:
            raise RuntimeError("model not registered yet")
        mid = self.model_id
        self._serving_ns += sum(r.count * r.mean_ms for w in windows for r in w.requests) * 1e6
        rows = window_rows(mid, windows)
        with self.store().session() as sess:
            st.repo.add_window_stats(sess, requests=rows.requests, layers=rows.layers, host=rows.host)
            for ev in rows.events:
                st.repo.add_event(sess, mid, ev["kind"], ev["message"], level=ev["level"], data=ev["data"])
            st.repo.touch_model(sess, mid)
        self.save_reservoir()

    def save_reservoir(self, force: bool = False) -> None:
        """Write the reservoir if it changed and its save is due (see ``RESERVOIR_SAVE_S``),
        or now when ``force``."""
        now = time.monotonic()
        if self.model_id is None or len(self.reservoir) == 0:
            return
        if not force and (self.reservoir.version == self._saved_version
                          or not self._reservoir_pace.due(now, self._serving_ns)):
            return
        t0 = time.thread_time_ns()
        version = self.reservoir.version
        payload = self.reservoir.serialize()
        with self.store().session() as sess:
            st.repo.save_reservoir(sess, self.model_id, payload, len(self.reservoir), self.reservoir.seen)
        self._saved_version = version
        self._reservoir_pace.ran(now, self._serving_ns)
        self._reservoir_pace.cost(time.thread_time_ns() - t0)

    def save(self, pick_metric: bool = False) -> None:
        """Write the reservoir now (flush, shutdown), picking the metric first when asked; a
        failure is logged, not raised."""
        try:
            if pick_metric:
                self.ensure_metric()
            self.save_reservoir(force=True)
        except Exception:  # noqa: BLE001
            log.warning("saving the input reservoir failed", exc_info=True)
