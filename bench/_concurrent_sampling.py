"""The ``concurrent`` case of ``bench/profiler_overhead.py``: what does one thread's sampled call
cost the calls other threads serve at the same time?

A sampled call runs the profiler's hook twin of the model, so the other threads' calls run
no hook; with ``hook_twin=False`` (the fallback for models that cannot be twinned) the hooks
are process-wide while a call is sampled, and the other threads' calls run through them
(each returns at once on seeing another thread). Here 4 request threads call the model through the profiler's steps as the agent
takes them (never sampled themselves), while a fifth thread calls it with **every** call
sampled (by a second profiler of the same model), so hooks are attached nearly all the time: the worst case of another thread being
sampled. Phases of ``phase_s`` alternate with a plain phase (all five threads call the model
without the profiler), and the 4 request threads' CPU time per call (their own thread CPU
clocks, so preemption and GIL waits do not count) is compared between the two kinds of phase:
``unsampled_overhead`` with a bootstrap 95% interval over phase pairs. Beside it, what the
sampled calls were charged for the other threads' hooked module calls (``charged_ms``, the
profiler's estimate, which its budget sees) against what those threads measured
(``measured_extra_ms``: their extra CPU per call in profiled phases × their calls there).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from profiler import Profiler, ProfilerConfig

REQUEST_THREADS = 4


def _profiled(phase: int) -> bool:
    """Phases 1-2, 3-4, ... are pairs, one profiled and one plain, in alternating order."""
    first = (phase - 1) % 2 == 0
    return first if ((phase - 1) // 2) % 2 == 0 else not first


def concurrent(
    model: torch.nn.Module, inputs: list[tuple[Any, ...]], phases: int, phase_s: float,
    hook_twin: bool = True,
) -> dict[str, Any]:
    """``hook_twin``: the sampled calls run the profiler's hook twin (the default), or the
    model itself with process-wide hooks."""
    # the request threads are never sampled: one call in a billion, no budget to change it
    prof = Profiler(ProfilerConfig(sample_every=10**9, max_sample_every=10**9, budget=None,
                                   host_interval_s=None))
    every_call = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None,
                                         hook_twin=hook_twin))
    for p in (prof, every_call):
        p.watch(model)
    profiled = threading.Event()  # set: a profiled phase
    stop = threading.Event()
    lock = threading.Lock()
    # per phase: (CPU ns, calls) summed over the request threads
    per_phase: list[list[int]] = [[0, 0] for _ in range(2 * phases + 1)]
    phase = [0]
    sampled = [0]
    charged = [0]  # ns charged to the sampled calls for other threads' module calls

    def request(k: int) -> None:
        i = k
        with torch.inference_mode():
            while not stop.is_set():
                args = inputs[i % len(inputs)]
                i += REQUEST_THREADS
                p, on = phase[0], profiled.is_set()
                c0 = time.thread_time_ns()
                if on:  # the agent's inline steps (see ``profiler._profiler``)
                    calls = prof.calls
                    mark = next(calls.marks)
                    token = prof.sample(model) if mark else None
                    run = token.module if token is not None else model
                    t0 = time.perf_counter_ns()
                    run(*args)
                    t1 = time.perf_counter_ns()
                    if mark is None:
                        calls.queue.append((1, None, t1 - t0, False, False, 0))
                    else:
                        prof.end(token, 1, args, {}, t1 - t0)
                else:
                    model(*args)
                c1 = time.thread_time_ns()
                if phase[0] == p:  # a call that straddles phases counts for neither
                    with lock:
                        per_phase[p][0] += c1 - c0
                        per_phase[p][1] += 1

    def sampled_caller() -> None:
        i = 0
        with torch.inference_mode():
            while not stop.is_set():
                args = inputs[i % len(inputs)]
                i += 1
                token = every_call.begin(model) if profiled.is_set() else None  # every call
                run = token.module if token is not None else model
                t0 = time.perf_counter_ns()
                run(*args)
                if token is not None:
                    charged[0] += token.timer.foreign_ns
                    every_call.end(token, 1, args, {}, time.perf_counter_ns() - t0)
                    sampled[0] += 1

    threads = [threading.Thread(target=request, args=(k,), daemon=True) for k in range(REQUEST_THREADS)]
    threads.append(threading.Thread(target=sampled_caller, daemon=True))
    for t in threads:
        t.start()
    try:
        time.sleep(phase_s)  # warm-up, phase 0: not counted
        for p in range(1, 2 * phases + 1):
            if _profiled(p):
                profiled.set()
            else:
                profiled.clear()
            phase[0] = p
            time.sleep(phase_s)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    on_us, off_us = [], []
    profiled_calls = sum(per_phase[p][1] for p in range(1, 2 * phases + 1) if _profiled(p))
    for p in range(1, 2 * phases + 1):
        ns, calls = per_phase[p]
        (on_us if _profiled(p) else off_us).append(ns / max(calls, 1) / 1e3)
    on_a, off_a = np.array(on_us), np.array(off_us)
    n = min(len(on_a), len(off_a))
    ratios = on_a[:n] / off_a[:n]  # paired: phase 2j-1 with 2j
    rng = np.random.default_rng(0)
    boot = ratios[rng.integers(0, n, (2000, n))].mean(1) - 1
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {
        "hooks": "hook twin" if hook_twin else "process-wide",
        "request_threads": REQUEST_THREADS,
        "phases": phases,
        "phase_s": phase_s,
        "plain_cpu_us_per_call": float(np.median(off_a)),
        "profiled_cpu_us_per_call": float(np.median(on_a)),
        "unsampled_overhead": float(ratios.mean() - 1),
        "unsampled_overhead_ci95": [float(lo), float(hi)],
        "sampled_calls_other_thread": sampled[0],
        "request_calls_profiled": profiled_calls,
        "measured_extra_ms": float(np.median(on_a) - np.median(off_a)) * profiled_calls / 1e3,
        "charged_ms": charged[0] / 1e6,
    }
