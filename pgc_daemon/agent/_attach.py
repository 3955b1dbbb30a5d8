"""``pgc_daemon.attach``: put a model under pgc inside the user's serving process. (A private
module: one named ``attach`` would be shadowed by the function that ``pgc_daemon.agent``
re-exports, and type checkers would see the module.)"""

from __future__ import annotations

from typing import Any

from torch import nn

import store as st
from pgc_daemon.agent.registry import Registry
from pgc_daemon.agent.served import ServedModel
from pgc_daemon.policy import Policy
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings
from profiler import ProfilerConfig


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
    if not isinstance(model, nn.Module):
        raise TypeError("attach() needs a torch.nn.Module")
    registry = Registry(
        model.eval(), InputReservoir(settings.reservoir_size), name=name, spec=spec,
        settings=settings, policy=policy, metric=metric, store=opened,
    )
    config = profiler or ProfilerConfig(sample_every=settings.sample_every, window_s=settings.window_s)
    return ServedModel(registry, config).start()
