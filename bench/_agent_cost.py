"""The ``agent`` case of ``bench/profiler_overhead.py``: what does serving through
``pgc_daemon.attach`` add to each call, all of it, against calling the model itself?

The profiler's steps are one part of the request path; the agent's own bookkeeping is the
rest (the input reservoir, live latency, the thread tuner, the in-flight count, entering
inference mode). Here a real attached model (a temporary SQLite store, default settings and
profiler, no executor: calls run inline on this thread, as with one intra-op thread) and the
model itself are called alternately, in shuffled order, with the same input, the caller in
inference mode (as a server calls a model). Compared: this thread's CPU time per call.

- ``us_per_call``: the median paired difference, in µs (unsampled and sampled calls alike;
  one call in 100 is sampled at the default rate, so the median is an unsampled call's),
  with a bootstrap 95% interval (``us_per_call_ci95``): on a 37 ms call the calls' own spread
  is tens of µs;
- ``overhead``: the paired sum ratio - 1, with a bootstrap 95% interval;
- ``background``: the CPU of every other thread of the process over the measured rounds (the
  agent's: profiler ticker and exporter, registry, swapper), over plain serving time. The
  model is served half the time here, so time-driven work weighs about twice what it does
  on a server busy all the time; ``thread_cpu_ms`` splits it by thread over the rounds.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _paired import bootstrap_ci, median_diff_ci

_tt = time.thread_time_ns


def _threads_cpu_ns() -> dict[str, int]:
    """CPU ns of every other live thread of the process, by name (their own clocks)."""
    out: dict[str, int] = {}
    for t in threading.enumerate():
        if t is threading.current_thread() or t.ident is None:
            continue
        try:
            ns = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError):
            continue  # ended meanwhile
        out[t.name] = out.get(t.name, 0) + ns
    return out


def agent_cost(name: str, model: torch.nn.Module, inputs: list[tuple[Any, ...]],
               rounds: int) -> dict[str, Any]:
    from pgc_daemon import attach  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        served = attach(model, name=name, store=f"sqlite:///{Path(tmp) / 'agent.db'}",
                        executor=False)
        try:
            deadline = time.monotonic() + 60  # registering (store schema, first save) is start-up
            while not served.status()["registered"] and time.monotonic() < deadline:
                time.sleep(0.1)
            return _measure(served, model, inputs, rounds)
        finally:
            served.close()


def _measure(served: Any, model: torch.nn.Module, inputs: list[tuple[Any, ...]],
             rounds: int) -> dict[str, Any]:
    arms = {"plain": model, "served": served}
    cpu = {a: np.zeros(rounds) for a in arms}
    rng = random.Random(0)
    with torch.inference_mode():
        for i in range(max(20, rounds // 20)):  # the first window, caches, the allocator
            for fn in arms.values():
                fn(*inputs[i % len(inputs)])
        before = _threads_cpu_ns()
        p0, t0 = time.process_time_ns(), _tt()
        for r in range(rounds):
            args = inputs[r % len(inputs)]
            order = list(arms)
            rng.shuffle(order)
            for a in order:
                fn = arms[a]
                c = _tt()
                fn(*args)
                cpu[a][r] = _tt() - c
        # this thread's clock first: the process clock read after it has counted all of
        # this thread's time (the other order left a fraction of a microsecond out, and an
        # idle background came out negative in CI)
        t1 = _tt()
        background_ns = (time.process_time_ns() - p0) - (t1 - t0)
        after = _threads_cpu_ns()
    by_thread = {name: ns - before.get(name, 0) for name, ns in after.items()}
    # threads that ran and ended within the rounds (short-lived background work)
    by_thread["(ended threads)"] = max(0, background_ns - sum(by_thread.values()))
    plain, instr = cpu["plain"], cpu["served"]
    ok = (plain < 3 * np.median(plain)) & (instr < 3 * np.median(instr))  # preempted rounds
    ratio_ci = bootstrap_ci(instr[ok], plain[ok])
    us_ci = [v / 1e3 for v in median_diff_ci(instr[ok], plain[ok])]
    status = served.profiler.status()
    return {
        "rounds": rounds,
        "rounds_used": int(ok.sum()),
        "plain_cpu_ms": float(np.median(plain) / 1e6),
        "us_per_call": float(np.median(instr[ok] - plain[ok]) / 1e3),
        "us_per_call_ci95": us_ci,
        "overhead": float(instr[ok].sum() / plain[ok].sum() - 1),
        "overhead_ci95": list(ratio_ci),
        "background": float(background_ns / plain.sum()),
        "sampled_calls": int(status["sampled"]),
        "registered": served.model_id is not None,  # measured as it serves once registered
        "thread_cpu_ms": {k: v / 1e6 for k, v in sorted(by_thread.items()) if v},  # in the rounds
    }
