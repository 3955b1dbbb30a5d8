"""``PGC_GC_FREEZE``: after building a variant in the serving process the swapper collects
the heap once and freezes what survives (so later full collections do not stall requests),
and leaves the heap alone when the setting is off. A real attach of the digits MLP, a real
SQLite store, a real int8 build."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

import store as st
from compiler import Quantization, Recipe
from pgc_daemon import attach
from pgc_daemon.settings import Settings
from pgc_daemon.states import D

from .helpers import deploy, deployment_state, wait_for

SPEC = "pgc_daemon.examples.digits:mlp"
INT8 = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}))
ENDED = (D.ACTIVE, D.FAILED, D.ROLLED_BACK)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Start with nothing frozen, and leave nothing frozen for the tests after this one."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _deploy_int8(mlp_spec: dict[str, Any], settings: Settings, store: st.Store) -> str:
    served = attach(mlp_spec["model"], name="mlp", spec=SPEC, settings=settings, policy={"canary_s": 0})
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        for args in mlp_spec["example_inputs"][:8]:
            served(*args)  # live inputs to build, warm up and verify with
        dep = deploy(store, "mlp", INT8)
        wait_for(lambda: deployment_state(store, dep) in ENDED, timeout=120, what="the deployment")
        return deployment_state(store, dep)
    finally:
        served.close()


def test_with_gc_freeze_the_heap_is_frozen_after_a_build(
    mlp_spec: dict[str, Any], settings: Settings, store: st.Store, unfrozen: None
) -> None:
    assert gc.get_freeze_count() == 0
    state = _deploy_int8(mlp_spec, settings.model_copy(update={"gc_freeze": True}), store)
    assert state == D.ACTIVE
    assert gc.get_freeze_count() > 0


def test_without_gc_freeze_the_swapper_never_freezes(
    mlp_spec: dict[str, Any], settings: Settings, store: st.Store, unfrozen: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    freezes: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1))
    state = _deploy_int8(mlp_spec, settings.model_copy(update={"gc_freeze": False}), store)
    assert state == D.ACTIVE  # a variant was built, so the setting was what kept the heap alone
    assert freezes == []
    assert gc.get_freeze_count() == 0
