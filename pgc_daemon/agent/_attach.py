"""``pgc_daemon.attach``: put a model under pgc inside the user's serving process. (A private
module: one named ``attach`` would be shadowed by the function that ``pgc_daemon.agent``
re-exports, and type checkers would see the module.)"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

import store as st
from compiler._kernel_map import kernel_profiling
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.served import ServedModel
from pgc_daemon.policy import Policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings
from profiler import ProfilerConfig, kernel_trace_cost


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
    executor: bool | None = None,
    max_batch: int = 1,
    max_delay_ms: float = 2.0,
) -> ServedModel:
    """Serve ``model`` through pgc. Returns a callable with the model's signature.

    ``spec`` (``package.module:function``, see :mod:`pgc_daemon.modelspec`) lets ``pgc serve``
    rebuild the model to search its variants; without it pgc profiles but cannot optimize.
    ``store`` is a URL or an open store (default: ``settings.store_url``). ``policy`` is used
    when the store has none for this model yet. ``profiler`` overrides how the live profiler
    samples (rate, overhead budget, duty cycle, host statistics, leak window); by default it
    takes ``settings.sample_every`` and ``settings.window_s``. Store failures never fail
    ``attach``: the agent keeps serving and registers once the store answers.

    ``executor``: run every call on one inference thread of this model, which the calling
    thread hands the call to and waits for (:mod:`pgc_daemon.agent.executor`), so that only
    that thread keeps an OpenMP team, however many threads call the model. ``None`` (the
    default) takes ``settings.executor`` (``PGC_EXECUTOR``), else turns it on when torch runs
    more than one intra-op thread: that is when a team per request thread oversubscribes the
    cores (measured 1.4-1.9x slower calls, ``bench/threads.py``); with one intra-op thread
    there is no team, and request threads running side by side use the cores better than one
    thread would. ``max_batch`` > 1 turns on micro-batching of concurrent calls (the first
    waits up to ``max_delay_ms`` for others; needs the executor, and a model whose outputs'
    rows depend on their input rows alone): off by default.
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
    if not isinstance(model, nn.Module):
        raise TypeError("attach() needs a torch.nn.Module")
    if max_batch < 1 or max_delay_ms < 0:
        raise ValueError("attach() needs max_batch >= 1 and max_delay_ms >= 0")
    if executor is None:
        executor = settings.executor
    if executor is None:
        executor = max_batch > 1 or torch.get_num_threads() > 1
    if max_batch > 1 and not executor:
        raise ValueError("micro-batching (max_batch > 1) needs the executor, which "
                         "attach(executor=False) or PGC_EXECUTOR=0 turned off")
    config = profiler or ProfilerConfig(sample_every=settings.sample_every, window_s=settings.window_s)
    registry = Registry(
        model.eval(), InputReservoir(settings.reservoir_size), name=name, spec=spec,
        settings=settings, policy=policy, metric=metric, store=opened, budget=config.budget,
    )
    if (spec or kernel_profiling()) and threading.current_thread() is threading.main_thread():
        # kineto prints an error when its first trace in the process runs on another thread
        # than the one that imported torch (usually this one), and that first trace takes
        # 2-2.5 CPU seconds; compiled variants' sampled calls are traced on serving threads
        # (their profiling twins, or packages built with kernel events), so the first trace
        # is taken here, once per process, for a model pgc can search
        kernel_trace_cost()
    options = {"max_batch": max_batch, "max_delay_ms": max_delay_ms} if executor else None
    return ServedModel(registry, config, options).start()
