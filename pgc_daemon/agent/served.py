"""The agent: what ``pgc_daemon.attach`` puts inside the user's serving process.

Request-path contract (``ServedModel.__call__``):

- one read of one reference (``self._slot``) picks the module for the whole call, so a swap
  never changes a call half way and in-flight calls finish on the module they started with;
- nothing of pgc raises into the caller: profiling, reservoir and shadow capture swallow
  their own errors, and when a pgc *variant* raises, the call is served again by the base
  module (the user's own), counted as a fallback, and the variant is reported to the swapper;
- an exception from the user's own module is the user's: it is re-raised unchanged.

Everything slow (registration, export, build, warm-up, verification, canary) runs on
background threads: the profiler's exporter and the :class:`~pgc_daemon.agent.swapper.Swapper`.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from typing import Any

import torch
from torch import nn

import store as st
from pgc_daemon import states
from compiler import Recipe, choose_metric
from pgc_daemon.policy import Policy
from pgc_daemon.reservoir import InputReservoir, _detach
from pgc_daemon.settings import Settings
from pgc_daemon.agent.rows import window_rows
from pgc_daemon.agent.slot import BASE_LABEL, Slot
from profiler import Profiler, ProfilerConfig, Window

log = logging.getLogger("pgc.agent")
_perf_ns = time.perf_counter_ns
#: torch.fx tracing (export, quantization, some compiler passes; pgc builds variants in this
#: process) patches ``nn.Module.__call__`` for the whole process while it traces, and a call
#: another thread makes at that moment can fail inside the tracer's bookkeeping. Such a call
#: is served again once the tracer is done, waiting at most this long.
TRACING_WAIT_S = 5.0
_ORIGINAL_MODULE_CALL = getattr(
    torch.fx._symbolic_trace, "_orig_module_call", torch.nn.Module.__call__
)


def _tracing_now() -> bool:
    return torch.nn.Module.__call__ is not _ORIGINAL_MODULE_CALL


def _traced_while_serving(exc: BaseException) -> bool:
    """Whether a failure of the user's module came from torch.fx tracing in another thread
    rather than from the module or its input."""
    return _tracing_now() or "not installed as a submodule" in str(exc)


#: During a canary, calls go to the candidate and the control in alternating blocks of this
#: many; per-call alternation would make each call pay for the other's cold caches and
#: sleeping worker threads, which is not what either costs once it serves alone.
AB_BLOCK = 8


class ServedModel:
    """A callable that serves through the active variant of a model. Create with
    :func:`attach`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        name: str,
        spec: str | None,
        settings: Settings,
        policy: Policy | None,
        metric: str | None,
        store: st.Store | None = None,
        profiler: ProfilerConfig | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError("attach() needs a torch.nn.Module")
        if not name or len(name) > 200 or "/" in name:
            raise ValueError("model name must be 1-200 characters without '/'")
        self.name = name
        self.spec = spec
        self.settings = settings
        self.policy = policy or Policy()
        self.metric = metric
        self.base = model.eval()
        self._slot = Slot(self.base, None, BASE_LABEL, hookable=True)
        self.baseline_variant_id: int | None = None
        self.model_id: int | None = None
        self._store = store
        self.profiler = Profiler(
            profiler
            or ProfilerConfig(sample_every=settings.sample_every, window_s=settings.window_s),
            sink=self._export,
            quiet=self._quiet,
            serving=lambda: self._slot.variant_id,
        )
        self.profiler.watch(self.base)
        self.reservoir = InputReservoir(settings.reservoir_size)
        self._reservoir_saved_version = -1
        self._reservoir_saved_at = 0.0
        # Live latency per variant, for the canary's comparison (bounded, append-only).
        self.live: dict[int | None, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=4096)
        )
        self.calls = 0
        self.fallbacks = 0
        self.retries = 0
        self.variant_failure = threading.Event()
        self.last_variant_error: str | None = None
        self._shadow: collections.deque[tuple[Any, Any, Any]] = collections.deque(maxlen=256)
        self._shadow_wanted = 0
        self._ab_calls = 0
        self._in_flight: set[object] = set()
        self._rng = random.Random(0)
        self._closed = False
        from pgc_daemon.agent.swapper import Swapper  # noqa: PLC0415 - mutual reference

        self.swapper = Swapper(self)

    # ------------------------------------------------------------------ request path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = object()
        self._in_flight.add(call)  # set.add/discard are atomic: no lock on the request path
        try:
            return self._serve(args, kwargs)
        finally:
            self._in_flight.discard(call)

    def serving_now(self) -> bool:
        """Whether a request is being served right now (background work yields to it; not to
        be confused with ``swapper.busy``, a deployment in progress)."""
        return bool(self._in_flight)

    def _serve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        slot = self._slot
        steady = True
        if slot.control is not None:  # canary: alternate blocks of calls with the control
            n = self._ab_calls
            self._ab_calls = n + 1
            steady = n % AB_BLOCK != 0  # the first call after a switch pays for the switch
            if (n // AB_BLOCK) % 2:
                slot = slot.control
        token = self.profiler.begin(slot.module) if slot.hookable else None
        fallback = False
        t0 = _perf_ns()
        try:
            with torch.inference_mode():
                out = slot.module(*args, **kwargs)
        except Exception as exc:
            if token is not None:
                self.profiler.end(token, slot.variant_id, args, kwargs, _perf_ns() - t0, error=True)
                token = None
            try:
                if not _traced_while_serving(exc):
                    raise
                out = self._after_tracing(slot.module, args, kwargs)
            except Exception as again:
                if slot.module is self.base:
                    raise  # the user's own module failed: not ours to hide
                out = self._fallback(slot, again, args, kwargs)
                fallback = True
        elapsed = _perf_ns() - t0
        self.calls += 1
        self.profiler.end(token, slot.variant_id, args, kwargs, elapsed, fallback=fallback)
        try:
            if steady and token is None and not fallback:  # hooks would bias the comparison
                self.live[slot.variant_id].append(elapsed / 1e6)
            self.reservoir.offer(args, kwargs)
            if self._shadow_wanted > 0 and not fallback and slot is self._slot:
                self._capture_shadow(slot, args, kwargs, out)
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
            log.debug("agent bookkeeping failed", exc_info=True)
        return out

    def _after_tracing(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """Serve a call again once torch.fx tracing elsewhere in the process is over."""
        self.retries += 1
        deadline = time.monotonic() + TRACING_WAIT_S
        while _tracing_now() and time.monotonic() < deadline:
            time.sleep(0.005)
        with torch.inference_mode():
            return module(*args, **kwargs)

    def _fallback(self, slot: Slot, exc: Exception, args: Any, kwargs: Any) -> Any:
        self.fallbacks += 1
        self.last_variant_error = f"{slot.label}: {type(exc).__name__}: {exc}"
        self.variant_failure.set()
        log.warning("variant %s failed a request (%s); served by the base module", slot.label, exc)
        try:
            with torch.inference_mode():
                return self.base(*args, **kwargs)
        except Exception as again:
            if not _traced_while_serving(again):
                raise
        return self._after_tracing(self.base, args, kwargs)

    def _capture_shadow(self, slot: Slot, args: Any, kwargs: Any, out: Any) -> None:
        if self._rng.random() < 0.25:
            self._shadow_wanted -= 1
            self._shadow.append((slot.variant_id, (_detach(tuple(args)), _detach(dict(kwargs))), _detach(out)))

    # ------------------------------------------------------------------ swapper interface

    @property
    def slot(self) -> Slot:
        return self._slot

    def swap(self, new: Slot) -> Slot:
        """Make ``new`` the serving slot; returns the one it replaced. One reference write:
        calls already running keep the module they read."""
        if new.hookable:
            self.profiler.watch(new.module)
        old, self._slot = self._slot, new
        if old.hookable and old.module is not new.module and old.module is not self.base:
            if new.control is None or new.control.module is not old.module:
                self.profiler.forget(old.module)
        return old

    def request_shadow(self, n: int) -> None:
        self._shadow.clear()
        self._shadow_wanted = n

    def take_shadow(self) -> list[tuple[Any, Any, Any]]:
        items = []
        while self._shadow:
            items.append(self._shadow.popleft())
        return items

    # ------------------------------------------------------------------ store

    def store(self) -> st.Store:
        if self._store is None:
            self._store = st.open_store(self.settings.store_url)
        return self._store

    def register(self) -> None:
        """Register the model, its baseline variant, policy and the base deployment. Called by
        the swapper thread (retried until the store answers)."""
        from compiler import fingerprint, probe  # noqa: PLC0415

        s = self.store()
        graph_hash = fingerprint(self.base)
        hardware = probe()
        identity = Recipe()
        with s.session() as sess:
            try:
                previous_hash = st.repo.get_model(sess, self.name).graph_hash
            except st.NotFound:
                previous_hash = None
            model = st.repo.upsert_model(
                sess,
                self.name,
                spec=self.spec,
                graph_hash=graph_hash,
                hardware=hardware.key(),
                metric=self.metric,
                input_signature={"threads": torch.get_num_threads(), "hardware": hardware.summary()},
            )
            baseline = st.repo.get_or_create_variant(
                sess, model.id, identity.hash, identity.to_dict(), identity.label()
            )
            if st.repo.get_policy(sess, model.id) is None:
                st.repo.put_policy(sess, model.id, self.policy.model_dump())
            same_model = previous_hash == graph_hash
            restore = None
            for dep in st.repo.list_deployments(sess, model.id):
                if dep.state == "active":
                    states.move(sess, dep.id, "superseded", "agent restarted")
                    if same_model and dep.variant_id != baseline.id:
                        restore = dep
                elif dep.state in states.OPEN:
                    states.move(sess, dep.id, "failed", "agent restarted before it finished")
            dep = st.repo.create_deployment(
                sess, model.id, baseline.id, source="attach", reason="the user's module, as attached"
            )
            states.move(sess, dep.id, "active", "serving the base module")
            if restore is not None:
                st.repo.create_deployment(
                    sess,
                    model.id,
                    restore.variant_id,
                    source="restore",
                    reason="restoring the variant that served before the agent restarted",
                    expected_speedup=restore.expected_speedup,
                    expected_fidelity=restore.expected_fidelity,
                )
            self.model_id = model.id
            self.baseline_variant_id = baseline.id
            base_dep = dep.id
            saved = st.repo.load_reservoir(sess, model.id) if same_model else None
        if saved is not None and len(self.reservoir) == 0:
            # the live inputs of the last run: calibration and verification need not wait
            self.reservoir.load(InputReservoir.deserialize(saved.payload), seen=saved.seen)
        if self._slot.module is self.base:
            self._slot = self.base_slot(base_dep)

    def base_slot(self, deployment_id: int | None = None) -> Slot:
        return Slot(self.base, self.baseline_variant_id, BASE_LABEL, True, deployment_id)

    def ensure_metric(self) -> None:
        """Pick the fidelity metric from a real output once live inputs exist."""
        if self.metric is not None or len(self.reservoir) == 0:
            return
        args, kwargs = self.reservoir.snapshot()[0]
        with torch.inference_mode():
            out = self.base(*args, **kwargs)
        self.metric = choose_metric(out)
        if self.model_id is not None:
            with self.store().session() as sess:
                st.repo.upsert_model(sess, self.name, metric=self.metric)

    def current_policy(self) -> Policy:
        """The stored policy (the API may have changed it), else the one given to attach."""
        if self.model_id is None:
            return self.policy
        try:
            with self.store().session() as sess:
                row = st.repo.get_policy(sess, self.model_id)
            if row is not None:
                self.policy = Policy.parse(row.settings)
        except Exception:  # noqa: BLE001
            log.debug("policy read failed; keeping the last one", exc_info=True)
        return self.policy

    def _quiet(self) -> bool:
        """Whether pgc's own heavy work (a deployment's build, warm-up, verification, canary)
        is off this process right now; host samples taken during it do not count as a leak."""
        swapper = getattr(self, "swapper", None)
        return swapper is None or not swapper.busy.is_set()

    def _export(self, windows: list[Window]) -> None:
        """Profiler sink (exporter thread): a batch of windows in one transaction — request
        and layer rows, host samples, events (leak warnings, sampling-rate changes)."""
        if self.model_id is None:
            raise RuntimeError("model not registered yet")
        mid = self.model_id
        rows = window_rows(mid, windows)
        with self.store().session() as sess:
            st.repo.add_window_stats(sess, requests=rows.requests, layers=rows.layers, host=rows.host)
            for ev in rows.events:
                st.repo.add_event(sess, mid, ev["kind"], ev["message"], level=ev["level"], data=ev["data"])
            st.repo.touch_model(sess, mid)
        self._save_reservoir()

    def _save_reservoir(self, force: bool = False) -> None:
        now = time.time()
        if self.model_id is None or len(self.reservoir) == 0:
            return
        if not force and (
            self.reservoir.version == self._reservoir_saved_version
            or now - self._reservoir_saved_at < 30
        ):
            return
        version = self.reservoir.version
        payload = self.reservoir.serialize()
        with self.store().session() as sess:
            st.repo.save_reservoir(sess, self.model_id, payload, len(self.reservoir), self.reservoir.seen)
        self._reservoir_saved_version = version
        self._reservoir_saved_at = now

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ServedModel:
        self.profiler.start()
        self.swapper.start()
        return self

    def flush(self) -> None:
        """Write the current statistics window and the reservoir now (tests, shutdown)."""
        self.profiler.flush()
        try:
            self.ensure_metric()
            self._save_reservoir(force=True)
        except Exception:  # noqa: BLE001
            log.warning("saving the input reservoir failed", exc_info=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.swapper.stop()
        self.profiler.stop(flush=self.model_id is not None)
        if self.model_id is not None:
            try:
                self._save_reservoir(force=True)
            except Exception:  # noqa: BLE001
                log.warning("saving the input reservoir failed", exc_info=True)

    def __enter__(self) -> ServedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        slot = self._slot
        return {
            "name": self.name,
            "serving": slot.label,
            "variant_id": slot.variant_id,
            "calls": self.calls,
            "fallbacks": self.fallbacks,
            "retries": self.retries,
            "reservoir": len(self.reservoir),
            "dropped_windows": self.profiler.dropped,
            "profiler": self.profiler.status(),
            "registered": self.model_id is not None,
        }


def attach(
    model: nn.Module,
    *,
    name: str,
    spec: str | None = None,
    store: str | st.Store | None = None,
    settings: Settings | None = None,
    policy: Policy | dict[str, Any] | None = None,
    metric: str | None = None,
    profiler: ProfilerConfig | None = None,
) -> ServedModel:
    """Serve ``model`` through pgc. Returns a callable with the model's signature.

    ``spec`` (``package.module:function``, see :mod:`pgc_daemon.modelspec`) lets ``pgc serve``
    rebuild the model to search its variants; without it pgc profiles but cannot optimize.
    ``store`` is a URL or an open store (default: ``settings.store_url``). ``policy`` is used
    when the store has none for this model yet. ``profiler`` overrides how the live profiler
    samples (rate, overhead budget, duty cycle, host statistics, leak window); by default it
    takes ``settings.sample_every`` and ``settings.window_s``. Store failures never fail
    ``attach``: the agent keeps serving and registers once the store answers.
    """
    settings = settings or Settings()
    opened: st.Store | None = None
    if isinstance(store, st.Store):
        opened = store
        settings = settings.model_copy(update={"store_url": store.url})
    elif isinstance(store, str):
        settings = settings.model_copy(update={"store_url": store})
    if isinstance(policy, dict):
        policy = Policy.parse(policy)
    served = ServedModel(
        model, name=name, spec=spec, settings=settings, policy=policy, metric=metric,
        store=opened, profiler=profiler,
    )
    return served.start()
