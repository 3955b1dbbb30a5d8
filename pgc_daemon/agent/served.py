"""The request path: what ``served(...)`` does in the user's threads.

- one read of one reference (``self._slot``) picks the module for the whole call: a swap never
  changes a call half way, and in-flight calls finish on the module they started with;
- nothing of pgc raises into the caller: profiling, reservoir and shadow capture swallow their
  own errors; a pgc *variant* that raises is blamed only if the base (the user's module) then
  serves the call (a *fallback*: the swapper reverts the variant or fails its canary). If the
  base raises too, the caller gets its exception unchanged (a *caller error*: bad input);
- the profiler's steps are inline (an unsampled call runs none of its Python: see
  ``profiler._profiler``), and nothing else slow is. With an ``Executor``, calls run on the
  inference thread at the count ``ThreadTuner`` chose (a probe at a new one: not per layer).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pgc_daemon.agent.batchchoice import choice_for
from pgc_daemon.agent.executor import executor_for
from pgc_daemon.agent.lifecycle import Lifecycle
from pgc_daemon.agent.live import LiveRecord
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.runtime import call_after_tracing, traced_while_serving
from pgc_daemon.agent.slot import BASE_LABEL, Slot
from pgc_daemon.agent.swapper import Swapper
from pgc_daemon.agent.threadtune import tuner_for
from profiler import Profiler, ProfilerConfig

log = logging.getLogger("pgc.agent")
_perf_ns = time.perf_counter_ns
_inference_mode_on = torch.is_inference_mode_enabled


class ServedModel(Lifecycle):
    """A callable that serves through the active variant of a model (made by ``attach``)."""

    def __init__(self, registry: Registry, profiler: ProfilerConfig,
                 executor: dict[str, Any] | None = None) -> None:
        self.registry = registry
        self.base = registry.base
        self.reservoir = registry.reservoir
        self.settings = registry.settings
        self._slot = Slot(self.base, None, BASE_LABEL, hookable=True)
        self.live = LiveRecord()
        self.calls = self.fallbacks = self.retries = self.caller_errors = 0
        self.last_variant_error: str | None = None
        self._failure: str | None = None
        self._ab_calls = 0
        self._in_flight: list[None] = []  # an entry a call served: append/pop are atomic
        self.swapper = Swapper(self)
        self.profiler = Profiler(profiler, sink=registry.export,  # quiet: no leak while deploying
                                 serving=lambda: self._slot.variant_id,
                                 quiet=lambda: not self.swapper.busy.is_set())
        self.profiler.watch(self.base)
        self._calls = self.profiler.calls
        self.executor = executor_for(self._serve, registry.name, executor,  # None: inline
                                     choice_for(executor, lambda: registry.policy, self.profiler))
        self._submit = self._serve if self.executor is None else self.executor.submit
        self.tuner = tuner_for(self.executor, self.profiler, enabled=self.settings.thread_tuning)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._in_flight.append(None)  # no lock, no allocation on the request path
        try:
            return self._submit(args, kwargs)
        finally:
            self._in_flight.pop()

    def serving_now(self) -> bool:
        """Whether a request is being served now (background work yields; not ``swapper.busy``)."""
        return bool(self._in_flight)

    def _serve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        slot = serving = self._slot
        steady = True
        if slot.control is not None:  # canary: alternate blocks of calls with the control
            self._ab_calls += 1
            slot, steady = slot.arm(self._ab_calls - 1)
        use = (self.tuner.use(slot.variant_id, canary=self._slot.canary, own_pool=slot.own_pool)
               if self.executor is not None else None)  # inline calls: nothing tuned
        prof, calls = self.profiler, self._calls
        mark = next(calls.marks)  # per layer: rows describe the variant as it serves
        token = prof.sample(slot.module) if mark and slot.per_layer and (
            use is None or use.incumbent) else None
        module = slot.pick(token, self.calls if slot is serving else None)  # see twins
        fallback, t0 = False, _perf_ns()
        try:
            if _inference_mode_on():  # the caller's own (entering it again costs 1-4 µs)
                out = module(*args, **kwargs)
            else:
                with torch.inference_mode():
                    out = module(*args, **kwargs)
        except BaseException as exc:
            if token is not None:  # left open, it would hold its hooks, or the process's one
                prof.end(token, slot.variant_id, args, kwargs, _perf_ns() - t0, error=True)
                token = None  # torch.profiler trace, and no call would be sampled again
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt in a notebook, a green thread's timeout
            try:
                if not traced_while_serving(exc):
                    raise
                self.retries += 1
                out = call_after_tracing(slot.module, args, kwargs)
            except Exception as again:
                if slot.module is self.base:
                    self.caller_errors += 1
                    raise  # the user's own module failed: not ours to hide
                out = self._fallback(slot, again, args, kwargs)  # raises the base's error
                fallback = True
        elapsed = _perf_ns() - t0
        if mark is None:
            calls.queue.append((slot.variant_id, None, elapsed, False, fallback, 0))
        else:
            prof.end(token, slot.variant_id, args, kwargs, elapsed, fallback=fallback)
        self.calls += 1
        try:
            if steady and token is None and not fallback:  # hooks would bias the comparison
                if use is None or use.decided:  # as the variant serves, not while probed
                    self.live.latency_ms[slot.variant_id].append(elapsed / 1e6)
                if use is not None:
                    self.tuner.record(use, elapsed / 1e6)
            self.reservoir.offer(args, kwargs)
            if self.live.shadow_wanted > 0 and not fallback and slot is self._slot:
                self.live.offer_shadow(slot.variant_id, args, kwargs, out)
        except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
            log.debug("agent bookkeeping failed", exc_info=True)
        return out

    def _fallback(self, slot: Slot, exc: Exception, args: Any, kwargs: Any) -> Any:
        """Serve a call a variant failed with the base module (see the module docstring)."""
        try:
            try:
                with torch.inference_mode():
                    out = self.base(*args, **kwargs)
            except Exception as again:
                if not traced_while_serving(again):
                    raise
                self.retries += 1
                out = call_after_tracing(self.base, args, kwargs)
        except Exception:
            self.caller_errors += 1
            log.debug("%s and the base failed a call: caller's error", slot.label, exc_info=True)
            raise
        self.fallbacks += 1
        self.last_variant_error = self._failure = f"{slot.label}: {type(exc).__name__}: {exc}"
        log.warning("variant %s failed a request (%s); served by the base module", slot.label, exc)
        return out
