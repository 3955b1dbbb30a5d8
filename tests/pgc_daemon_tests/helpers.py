"""Test helpers: waiting on the store, driving traffic."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import store as st


def wait_for(cond: Callable[[], Any], timeout: float = 60.0, every: float = 0.1, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")


def deployment_state(store: st.Store, dep_id: int) -> str:
    with store.session() as s:
        return st.repo.get_deployment(s, dep_id).state


def deploy(store: st.Store, model: str, recipe: Any, source: str = "manual") -> int:
    with store.session() as s:
        m = st.repo.get_model(s, model)
        v = st.repo.get_or_create_variant(s, m.id, recipe.hash, recipe.to_dict(), recipe.label())
        return st.repo.create_deployment(s, m.id, v.id, source=source, reason="test").id


class Load:
    """Threads calling ``served`` on real inputs and checking every answer against the fp32
    model (top-1 must agree), until stopped. Each thread waits as long as its last call took
    before the next (at least 1 ms): busy half the time, like a served model with headroom,
    so that a search worker beside it (at a lower priority) gets a core; called back to back,
    two threads starved it, and one Inductor build took 130 s instead of 33."""

    def __init__(self, served: Any, reference: torch.nn.Module, inputs: list[torch.Tensor], threads: int = 4) -> None:
        self.served = served
        self.inputs = inputs
        with torch.inference_mode():
            self.expected = [reference(x).argmax(-1) for x in inputs]
        self.stop = threading.Event()
        self.calls = 0
        self.errors: list[BaseException] = []
        self.wrong = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, seed: int) -> None:
        i = seed
        while not self.stop.is_set():
            x = self.inputs[i % len(self.inputs)]
            started = time.perf_counter()
            try:
                out = self.served(x)
                agree = (out.argmax(-1) == self.expected[i % len(self.inputs)]).float().mean().item()
                with self._lock:
                    self.calls += 1
                    if agree < 0.85:
                        self.wrong += 1
            except BaseException as exc:  # noqa: BLE001 - the test reports every failure
                with self._lock:
                    self.errors.append(exc)
            i += 1
            self.stop.wait(max(0.001, time.perf_counter() - started))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


TEST_TOKEN = "pgc-test-token"
"""The bearer token the API tests give their apps (``Settings(api_token=TEST_TOKEN)``)."""


def api_headers(token: str = TEST_TOKEN) -> dict[str, str]:
    """What a well-behaved client sends on every call: the token (mutations need it)."""
    return {"Authorization": f"Bearer {token}"}


def api_client(store: st.Store, token: str = TEST_TOKEN, *, auth: bool = True, **settings: Any) -> Any:
    """A test client of the API over ``store``, calling it as ``http://127.0.0.1`` (the Host
    allow-list takes loopback only), with the token sent on every call unless ``auth`` is
    False."""
    from fastapi.testclient import TestClient

    from pgc_daemon.api import create_app
    from pgc_daemon.settings import Settings

    app = create_app(Settings(store_url=store.url, api_token=token, **settings), store=store)
    return TestClient(app, base_url="http://127.0.0.1", headers=api_headers(token) if auth else None)
