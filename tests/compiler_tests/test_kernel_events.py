"""Kernel events are switched on for the thread that builds a profiling twin, not for the
process: ``kernel_events`` set the process's environment, so a variant another thread built
meanwhile came out with kernel events (3% slower on every call) and under the twin's cache
key. Seen in CI: a test's max-autotune variant was stored under its twin's key, and the twin
then loaded the variant instead of being built."""

from __future__ import annotations

import os
import threading

import pytest
from torch import nn

from compiler import Backend, Recipe
from compiler._kernel_map import ENV, kernel_events, kernel_profiling, profile_options
from compiler.cache import KERNEL_ENV, cache_key

RECIPE = Recipe(backend=Backend("inductor"))


def _state(model: nn.Module) -> tuple[bool, bool, str]:
    return kernel_profiling(), bool(profile_options()), cache_key(model, RECIPE).digest


def test_kernel_events_stay_on_the_thread_that_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    model = nn.Linear(8, 8)
    plain = _state(model)
    inside, elsewhere = [], []
    entered, looked = threading.Event(), threading.Event()

    def twin_build() -> None:
        with kernel_events():
            entered.set()
            inside.append(_state(model))
            looked.wait(10)
            inside.append(dict(cache_key(model, RECIPE).env).get(KERNEL_ENV))

    thread = threading.Thread(target=twin_build)
    thread.start()
    assert entered.wait(10)
    elsewhere.append(_state(model))  # another thread builds a variant meanwhile
    looked.set()
    thread.join(10)

    assert plain[:2] == (False, False)
    assert elsewhere == [plain]
    assert inside[0][:2] == (True, True) and inside[0][2] != plain[2]
    assert inside[1] == "1"
    assert ENV not in os.environ
    assert _state(model) == plain


def test_the_environment_switch_still_builds_every_package_with_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Linear(8, 8)
    monkeypatch.delenv(ENV, raising=False)
    plain = cache_key(model, RECIPE).digest
    monkeypatch.setenv(ENV, "1")  # what `pgc profile --recipe` and PGC_KERNEL_PROFILE=1 do
    assert kernel_profiling() and profile_options()
    with kernel_events():  # the same key either way
        assert cache_key(model, RECIPE).digest != plain
        inside = cache_key(model, RECIPE).digest
    assert cache_key(model, RECIPE).digest == inside
