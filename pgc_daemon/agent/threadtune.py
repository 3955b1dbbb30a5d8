"""How many intra-op threads the inference thread serves each variant with, chosen on live
traffic.

Why: the thread count that is fastest for a model alone is not always the fastest while it
serves. Measured on a 2-core VM (MiniLM, batch 1, requests from a tokenizing client thread at
16 per second, the four arms interleaved in blocks at one time): alone, fp32 took 29.6 ms at
two threads and 44.6 at one, int8 static · Inductor 8.7 and 13.1; serving, fp32 took 39.1 ms at
two threads and 47.2 at one, but int8 took **17.0 ms at two threads and 13.5 at one**. A short
call of many small parallel regions spends its time in OpenMP barriers waiting for a team-mate
whose core woke up late or went to another thread; one thread has no team to wait for. So the
live speedup of int8 over fp32 was 2.30x at two threads (the search measured 3.4x) and 3.5x at
one.

What it does: for the variant that serves alone (no canary), calls go in alternating blocks to
each candidate thread count (the configured count, half of it, and one) until every count has
``calls_per_arm`` steady calls (or, earlier, from ``early_calls`` on, once every other count is
faster or slower than the incumbent by the margin with confidence: a count twice as slow need
not be served 40 times to be known); then the variant serves at the count whose trimmed-mean
latency is lower than the incumbent's (the configured count; on a probe again, the last
choice) with confidence by ``margin``, else at the incumbent. It decides again every
``reprobe_s``, and sooner (at most every ``min_reprobe_s``) once the cores busy outside this
process have moved by ``load_shift`` from the decision's (:mod:`~pgc_daemon.agent.hostload`):
a count chosen while a search worker held a core is wrong once the search is over.
During a canary (and the demo's A/B) an arm already decided serves at its count, without
probing again; an arm not yet decided is probed on its own calls, and the canary compares the
two only once both serve at their counts (:func:`~pgc_daemon.agent.canary.run`), so the
comparison is of the variants as they will serve. (Seen in the demo: a new int8 static ·
Inductor arm served at the incumbent's count, 2, while the search worker held a core, measured
1.10x slower than ONNX Runtime, and was rolled back; the search had timed it 1.11x faster at one
thread. Serving the undecided arm at the latest decision's count had been chosen for the swap's
p99, which a wrong verdict costs far more than.) A variant that computes on a thread pool of its
own (ONNX Runtime, OpenVINO) is not probed: torch's count does not reach it, and a "decision"
on it would measure noise. ``Settings.thread_tuning = False`` keeps every call at the
configured count.

Threading: :meth:`ThreadTuner.use` and :meth:`ThreadTuner.record` run on the executor's
inference thread only (the thread whose intra-op setting they change); a call served inline on
a request thread is left alone. :meth:`ThreadTuner.status` reads from any thread.

The count is set for the inference thread alone, through OpenMP's ``omp_set_num_threads`` (a
per-thread setting), not ``torch.set_num_threads``: that one also stores the process-wide
count every thread takes when it first runs torch work, so the user's other threads, pgc's
swapper and the artifact key of what the worker built (``torch.threads``) would follow the
inference thread's choice (seen: a worker's artifact refused as built for another thread
count, then compiled in the serving process). Where torch does not run on OpenMP, or its
runtime cannot be found, nothing is tuned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pgc_daemon.agent.hostload import OtherLoad
from pgc_daemon.agent.livecompare import LiveComparison, compare, trimmed_mean
from pgc_daemon.agent.ompthreads import set_thread_count

log = logging.getLogger("pgc.agent")

#: Calls per probe block; the first of each block pays for the switch and is not counted.
PROBE_BLOCK = 8
#: Steady calls per thread count before deciding.
CALLS_PER_ARM = 40
#: Steady calls per count after which the probe may stop early (every other count is clearly
#: faster or slower than the incumbent).
EARLY_CALLS = 14
#: A count other than the incumbent must be at least this much faster, with confidence.
MARGIN = 0.03
#: Probe again after this long.
REPROBE_S = 900.0
#: ... or, once the machine's load has moved, after at least this long.
MIN_REPROBE_S = 30.0
#: How far (cores busy outside this process) the load must move from a decision's to probe
#: again; at least this, and at least a quarter of the configured count.
LOAD_SHIFT = 0.5
#: Variants whose choice is remembered at most (oldest forgotten first).
MAX_VARIANTS = 32
#: A decided count's age and the machine's load are looked at once a second or once in this
#: many calls, whichever comes first: every call, with the ``Use`` made anew, cost 17-20 µs on
#: the inference thread with the caches cold after a forward pass (a microbenchmark evicting
#: 64 MB between calls).
STALE_EVERY, STALE_EVERY_S = 16, 1.0


def candidates(configured: int) -> tuple[int, ...]:
    """The configured count, half of it and one (distinct, largest first)."""
    return tuple(sorted({configured, max(1, configured // 2), 1}, reverse=True))


@dataclass
class _Probe:
    samples: dict[int, list[float]]
    calls: int = 0
    chosen: int | None = None
    decided_at: float = 0.0
    results: dict[int, float] = field(default_factory=dict)
    """Trimmed-mean live latency (ms) per count at the last decision."""
    load: float | None = None
    """Cores busy outside this process at the last decision (None: not known)."""
    previous: int | None = None
    """The count chosen before this probe (a probe again): the one another must beat."""
    steady: Use | None = None
    """What a call gets while the count is decided (made once: see ``STALE_EVERY``)."""
    served: int = 0
    """Calls served at the decided count (a staleness check every ``STALE_EVERY``)."""
    checked_at: float = 0.0


@dataclass(frozen=True)
class Use:
    """The count one call runs at, and whether its latency counts toward a decision."""

    variant_id: int | None
    threads: int
    counted: bool
    decided: bool = True
    """The call runs at the count decided for its variant (or nothing is tuned for it): its
    latency is that of the variant as it serves."""
    incumbent: bool = True
    """The call runs at the count its variant serves at unless a probe finds a faster one
    (``ThreadTuner._incumbent``): the profiler samples it, not a probe at another count."""


class ThreadTuner:
    def __init__(
        self,
        configured: int,
        *,
        calls_per_arm: int = CALLS_PER_ARM,
        early_calls: int = EARLY_CALLS,
        block: int = PROBE_BLOCK,
        margin: float = MARGIN,
        reprobe_s: float = REPROBE_S,
        min_reprobe_s: float = MIN_REPROBE_S,
        only_configured: bool = False,
        load: Callable[[], float | None] = lambda: None,
        owner: Callable[[], int | None] = lambda: None,
        batched: Callable[[], bool] = lambda: False,
        notify: Callable[[str, dict[str, Any]], None] = lambda message, data: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``owner``: the ident of the thread whose calls are tuned (the executor's inference
        thread; None: no call is). ``batched()``: the call now is a micro-batch of several
        (it runs at the configured count and is not measured: the choice is for single calls,
        whose short parallel regions are what a smaller team serves faster).
        ``notify(message, data)`` hears every decision, on that thread (keep it cheap).
        ``load()``: cores busy outside this process now (cheap; None: not known)."""
        self.configured = configured
        self._owner = owner
        self._batched = batched
        self._notify = notify
        self.candidates = (configured,) if only_configured else candidates(configured)
        self.calls_per_arm = calls_per_arm
        self.early_calls = min(early_calls, calls_per_arm)
        self.block = block
        self.margin = margin
        self.reprobe_s = reprobe_s
        self.min_reprobe_s = min_reprobe_s
        self.load_shift = max(LOAD_SHIFT, configured / 4)
        self.load = load  # cores busy outside this process now (None: not known)
        self._clock = clock
        self._probes: dict[int | None, _Probe] = {}
        self._own_pools: set[int | None] = set()  # variants computing on a pool of their own
        self._lock = threading.Lock()  # status() reads from other threads

    def _probe(self, variant_id: int | None) -> _Probe:
        probe = self._probes.get(variant_id)
        if probe is None:
            with self._lock:
                if len(self._probes) >= MAX_VARIANTS:
                    del self._probes[next(iter(self._probes))]
                probe = self._probes[variant_id] = _Probe({n: [] for n in self.candidates})
                if len(self.candidates) == 1:  # nothing to probe: always the configured count
                    probe.steady = Use(variant_id, self.configured, counted=False)
        return probe

    def use(self, variant_id: int | None, *, canary: bool = False,
            own_pool: bool = False) -> Use | None:
        """The count for this call of ``variant_id``, set on the calling thread (None, and
        nothing set, off the owner thread). ``canary``: the variant is an arm of a canary (a
        decided arm keeps its count, not probed again even if stale; an undecided one is
        probed). ``own_pool``: the variant computes on a thread pool of its own, which
        this count does not reach (nothing is probed)."""
        if threading.get_ident() != self._owner():
            return None
        if own_pool:
            if variant_id not in self._own_pools:
                with self._lock:
                    self._own_pools.add(variant_id)
            return Use(variant_id, torch.get_num_threads(), counted=False)
        if self._batched():
            if torch.get_num_threads() != self.configured:
                set_thread_count(self.configured)
            return Use(variant_id, self.configured, counted=False)
        probe = self._probe(variant_id)
        steady = probe.steady
        if steady is not None:  # decided: the same Use, the age and load looked at now and then
            probe.served += 1
            now = self._clock()
            fresh = (canary or probe.chosen is None
                     or (probe.served % STALE_EVERY and now - probe.checked_at < STALE_EVERY_S))
            if not fresh:
                probe.checked_at = now
                fresh = not self._stale(variant_id, probe)
            if fresh:
                if torch.get_num_threads() != steady.threads:
                    set_thread_count(steady.threads)
                return steady
            probe.previous, probe.chosen, probe.steady = probe.chosen, None, None  # probe again
            probe.samples = {n: [] for n in self.candidates}
        # undecided (a decided probe, and one with a single candidate, has ``steady``)
        k = probe.calls // self.block
        n = self.candidates[k % len(self.candidates)]
        counted = probe.calls % self.block != 0
        probe.calls += 1
        if torch.get_num_threads() != n:
            set_thread_count(n)
        return Use(variant_id, n, counted, decided=False, incumbent=n == self._incumbent(probe))

    def _moved(self, probe: _Probe) -> float | None:
        """The load now, where it has moved by ``load_shift`` from the decision's (else None)."""
        now = self.load()
        if now is None or probe.load is None or abs(now - probe.load) < self.load_shift:
            return None
        return now

    def _stale(self, variant_id: int | None, probe: _Probe) -> bool:
        """Whether a decision is due again: it is old, or the load it was made under moved."""
        age = self._clock() - probe.decided_at
        if age > self.reprobe_s:
            return True
        now = None if age < self.min_reprobe_s else self._moved(probe)
        if now is None:
            return False
        message = (f"variant {variant_id}: the machine's load moved from {probe.load:.1f} to "
                   f"{now:.1f} cores busy outside this process since it chose {probe.chosen} "
                   f"intra-op thread(s); measuring the counts again")
        log.info("%s", message)
        self._notify(message, {"variant_id": variant_id, "reprobe": True,
                               "load_cores": [probe.load, now]})
        return True

    def record(self, use: Use | None, elapsed_ms: float) -> None:
        """The latency of a steady call made under ``use``; decides once every count has
        enough."""
        if use is None or not use.counted:
            return
        probe = self._probes.get(use.variant_id)
        if probe is None or probe.chosen is not None:
            return
        samples = probe.samples[use.threads]
        samples.append(elapsed_ms)
        counts = [len(s) for s in probe.samples.values()]
        if min(counts) >= self.calls_per_arm:
            self._decide(use.variant_id, probe, self._compare(probe))
        elif min(counts) >= self.early_calls and probe.calls % self.block == 0:
            # Probing costs the calls served at a slower count: stop as soon as every other
            # count is faster or slower than the incumbent by the margin, with confidence.
            comparisons = self._compare(probe)
            m = self.margin
            if all(c.high < 1.0 - m or c.low > 1.0 + m for c in comparisons.values()):
                self._decide(use.variant_id, probe, comparisons)

    def _incumbent(self, probe: _Probe) -> int:
        """The count a probe keeps unless another beats it with confidence: the last decision's
        (a count chosen under load stays when a probe again cannot tell; seen in the demo: an
        int8 variant measured 11.3 ms at one thread and 13.0 at two under 1.5 busy cores, not
        apart with confidence, and went back to two), else the configured count."""
        return probe.previous if probe.previous in probe.samples else self.configured

    def _compare(self, probe: _Probe) -> dict[int, LiveComparison]:
        incumbent = self._incumbent(probe)
        base = probe.samples[incumbent]
        return {n: compare(s, base) for n, s in probe.samples.items() if n != incumbent}

    def _decide(
        self, variant_id: int | None, probe: _Probe, comparisons: dict[int, LiveComparison]
    ) -> None:
        kept = best = self._incumbent(probe)
        best_cmp = None
        for n, c in comparisons.items():
            if c.high < 1.0 - self.margin and (best_cmp is None or c.ratio < best_cmp.ratio):
                best, best_cmp = n, c
        # every other count against the chosen one, with its interval: what the search needs to
        # turn a ratio timed at one count into one against this variant as it serves
        # (the comparisons already made, where the incumbent stays)
        against = comparisons if best == kept else {
            n: compare(s, probe.samples[best]) for n, s in probe.samples.items() if n != best}
        load = self.load()
        with self._lock:
            probe.results = {n: _trimmed(s) for n, s in probe.samples.items()}
            probe.chosen, probe.decided_at = best, self._clock()
            probe.steady = Use(variant_id, best, counted=False)
            probe.load = load
            probe.samples = {n: [] for n in self.candidates}
            probe.calls = 0
        busy = "" if load is None else f"; {load:.1f} cores busy outside this process"
        why = _describe(probe.results, best_cmp, kept if kept != self.configured else None)
        message = (f"variant {variant_id} serves at {best} intra-op thread(s), measured live: "
                   f"{why}{busy}")
        log.info("%s", message)
        self._notify(message, {"variant_id": variant_id, "threads": best,
                               "live_ms": {str(n): ms for n, ms in probe.results.items()},
                               "vs_chosen": {str(n): [c.ratio, c.low, c.high]
                                             for n, c in against.items()},
                               "load_cores": load})

    def chosen(self, variant_id: int | None) -> int | None:
        probe = self._probes.get(variant_id)
        return None if probe is None else probe.chosen

    def decided(self, variant_id: int | None) -> bool:
        """Whether calls of ``variant_id`` run at a count decided for it (or nothing is tuned
        for it here): what the canary waits for before it compares two arms."""
        if len(self.candidates) == 1 or self._owner() is None or variant_id in self._own_pools:
            return True
        probe = self._probes.get(variant_id)
        return probe is not None and probe.chosen is not None

    def settled(self, variant_id: int | None) -> bool:
        """Whether ``variant_id`` serves at a count decided under the machine's load of now
        (or nothing is tuned for it here)."""
        if not self.decided(variant_id):
            return False
        probe = self._probes.get(variant_id)
        return probe is None or probe.chosen is None or self._moved(probe) is None

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "configured": self.configured,
                "candidates": list(self.candidates),
                "variants": {
                    "base" if v is None else str(v): {
                        "threads": p.chosen,
                        "live_ms": {str(n): ms for n, ms in p.results.items()},
                        "load_cores": p.load,
                    }
                    for v, p in self._probes.items()
                },
            }


def tuner_for(executor: Any, profiler: Any, *, enabled: bool = True) -> ThreadTuner:
    """The tuner of a served model: it tunes the calls of its executor's inference thread
    (none without an executor: calls inline on request threads are left as they are), and its
    decisions become the profiler's ``threads`` events (stored with the model's events).
    ``enabled=False`` (``Settings.thread_tuning``): every call runs at the configured count."""
    return ThreadTuner(
        executor.threads if executor is not None else torch.get_num_threads(),
        only_configured=not enabled,
        owner=lambda: None if executor is None else executor.ident,
        batched=lambda: executor is not None and executor.batch_calls > 1,
        notify=lambda message, data: profiler.event("threads", "info", message, data),
        load=OtherLoad().cores,
    )


def _trimmed(samples: list[float]) -> float:
    return float(trimmed_mean(np.asarray(samples, dtype=float)))


def _describe(results: dict[int, float], won: LiveComparison | None, kept: int | None) -> str:
    parts = ", ".join(f"{ms:.2f} ms at {n}" for n, ms in sorted(results.items()))
    if won is None:
        last = "" if kept is None else f"; {kept} kept from the last decision"
        return f"{parts} (no other count faster with confidence{last})"
    return f"{parts} ({1 / won.ratio:.2f}x, 95% interval {1 / won.high:.2f}-{1 / won.low:.2f}x)"
