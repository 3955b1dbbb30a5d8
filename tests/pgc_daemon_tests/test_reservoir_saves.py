"""The agent rewrites its input reservoir in the store as often as the serving time pays for
it: at light traffic a save every 30 s took half the profiler's budget (MiniLM's 128 inputs,
13-29 ms a save, against a 13 ms variant served 20 times a second), and per-layer sampling of
the deployed variant stopped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

import store as st
from pgc_daemon.agent import registry as registry_mod
from pgc_daemon.agent.registry import Registry
from pgc_daemon.reservoir import InputReservoir
from pgc_daemon.settings import Settings
from profiler import RequestRow, Window


def _window(calls: int, mean_ms: float) -> Window:
    row = RequestRow(variant=None, shape_bucket="b", count=calls, mean_ms=mean_ms, p50_ms=mean_ms,
                     p95_ms=mean_ms, p99_ms=mean_ms, trimmed_ms=mean_ms)
    now = time.time()
    return Window(start=now - 1, end=now, requests=[row])


def test_the_reservoir_is_saved_as_often_as_the_serving_time_pays_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_mod, "RESERVOIR_SAVE_S", 0.2)
    monkeypatch.setattr(registry_mod, "RESERVOIR_MAX_S", 1.5)
    url = f"sqlite:///{tmp_path / 'pgc.db'}"
    reservoir = InputReservoir(64)
    reg = Registry(nn.Linear(64, 64).eval(), reservoir, name="m", spec=None,
                   settings=Settings(store_url=url), policy=None, metric="cosine", budget=0.005)
    reg.register()
    store = st.open_store(url)

    def saved() -> int:
        with store.session() as s:
            row = st.repo.load_reservoir(s, reg.id)
            return row.seen if row is not None else 0

    def offer() -> None:
        reservoir.offer((torch.randn(8, 64),), {})

    light, heavy = _window(10, 1.0), _window(10_000, 10.0)  # 10 ms and 100 s of serving
    offer()
    reg.export([light])
    assert saved() == 1  # the first save at once
    offer()
    reg.export([light])
    assert saved() == 1  # not before RESERVOIR_SAVE_S
    time.sleep(0.25)
    reg.export([light])
    assert saved() == 1  # 10 ms of serving does not pay for a save at 0.1 x 0.5%
    reg.export([heavy])
    assert saved() == 2  # 100 s of serving does (a save costs a few ms here)
    time.sleep(0.25)
    reg.export([heavy])
    assert saved() == 2  # paid for, but nothing new to save
    offer()
    reg.export([light])
    assert saved() == 3  # paid for by the serving since the last save
    offer()
    time.sleep(0.25)
    reg.export([light])
    assert saved() == 3
    time.sleep(1.3)
    reg.export([light])
    assert saved() == 4  # RESERVOIR_MAX_S: saved however light the traffic
    offer()
    reg.save(pick_metric=False)
    assert saved() == 5  # a flush or shutdown saves at once
