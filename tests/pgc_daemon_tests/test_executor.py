"""The serving executor: request threads hand their calls to one inference thread per served
model (one OpenMP team however many request threads), which never hangs a caller, and can
micro-batch concurrent calls. Real models, a real store, real threads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pgc_daemon import attach
from pgc_daemon.agent.executor import Executor
from pgc_daemon.settings import Settings

from .helpers import wait_for

JOIN_S = 20.0


class Gated(nn.Module):
    """Records the thread and batch size of every forward pass, and can hold a call at a gate
    (to make calls queue up behind it)."""

    def __init__(self) -> None:
        super().__init__()
        self.idents: list[int] = []
        self.batches: list[int] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def arrive(self, x: torch.Tensor) -> None:
        self.idents.append(threading.get_ident())
        self.batches.append(int(x.shape[0]))
        self.entered.set()
        gate = self.gate
        if gate is not None:
            gate.wait(JOIN_S)


class Recorder(Gated):
    """A real linear layer."""

    def __init__(self, features: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(features, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.arrive(x)
        return self.linear(x) * scale


class Failing(Gated):
    """Doubles its input; raises one exception object of its own for inputs holding a
    negative number."""

    def __init__(self) -> None:
        super().__init__()
        self.raised: list[BaseException] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.arrive(x)
        if bool((x < 0).any()):
            exc = ValueError(f"negative input {len(self.raised)}")
            self.raised.append(exc)
            raise exc
        return x * 2


def _attach(model: nn.Module, settings: Settings, **kw: Any) -> Any:
    served = attach(model, name=f"exec-{type(model).__name__.lower()}", settings=settings, **kw)
    wait_for(lambda: served.model_id is not None, what="registration")
    return served


def _in_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run each function in its own thread; their results (or exceptions), in order."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a caller hung"
    return out


def _queued(executor: Executor, n: int) -> None:
    wait_for(lambda: executor.status()["queued"] >= n, timeout=JOIN_S, every=0.005,
             what=f"{n} calls queued")


def test_the_executor_is_on_by_default_with_several_intra_op_threads(mlp_spec: dict, settings: Settings) -> None:
    assert torch.get_num_threads() > 1  # tests/conftest.py: 2 threads where there are 2 cores
    served = _attach(mlp_spec["model"], settings)
    try:
        assert served.executor is not None and served.executor.alive
        assert served.status()["executor"]["threads"] == torch.get_num_threads()
    finally:
        served.close()
    off = attach(mlp_spec["model"], name="mlp-off", settings=settings, executor=False)
    try:
        assert off.executor is None and off.status()["executor"] is None
    finally:
        off.close()
    off = attach(mlp_spec["model"], name="mlp-env", settings=settings.model_copy(update={"executor": False}))
    try:
        assert off.executor is None  # PGC_EXECUTOR=0
    finally:
        off.close()
    with pytest.raises(ValueError, match="needs the executor"):
        attach(mlp_spec["model"], name="mlp-bad", settings=settings, executor=False, max_batch=4)


def test_results_equal_direct_calls_and_run_on_the_inference_thread(mlp_spec: dict, settings: Settings) -> None:
    model = Recorder()
    served = _attach(model, settings)
    inputs = [torch.randn(3, 6) for _ in range(8)]
    try:
        with torch.inference_mode():
            expected = [model.linear(x) for x in inputs]
        model.idents.clear()
        outs = _in_threads([lambda x=x: served(x) for x in inputs])
        for out, want in zip(outs, expected, strict=True):
            assert torch.equal(out, want)
        assert served(inputs[0], scale=3.0).allclose(expected[0] * 3)  # kwargs travel too
        idents = set(model.idents)
        assert len(idents) == 1, "every call ran on one thread"
        assert idents == {served.executor.ident}
        assert threading.get_ident() not in idents
        assert served.calls == 9 and served.executor.status()["calls"] == 9
    finally:
        served.close()


def test_the_caller_gets_the_models_own_exception_object(settings: Settings) -> None:
    model = Failing()
    served = _attach(model, settings)
    try:
        with pytest.raises(ValueError) as caught:
            served(-torch.ones(2))
        assert caught.value is model.raised[-1]
        assert served.caller_errors == 1
        assert torch.equal(served(torch.ones(2)), torch.full((2,), 2.0))  # still serving
    finally:
        served.close()


def test_a_stopped_executor_serves_inline(settings: Settings) -> None:
    model = Recorder()
    served = _attach(model, settings)
    served.executor.stop()
    try:
        assert not served.executor.alive
        out = _in_threads([lambda: (served(torch.ones(1, 6)), threading.get_ident())])[0]
        assert isinstance(out, tuple), out
        assert model.idents[-1] == out[1], "ran in the caller's own thread"
    finally:
        served.close()
    served(torch.ones(1, 6))  # after close as well
    assert model.idents[-1] == threading.get_ident()


def test_a_caller_never_waits_on_a_stuck_inference_thread() -> None:
    """The inference thread holds one call (at a gate nobody opens yet); a call queued behind
    it for longer than ``stall_s`` runs in its caller's thread."""
    model = Recorder()
    gate = model.gate = threading.Event()
    ex = Executor(lambda a, k: model(*a, **k), stall_s=0.3).start()
    stuck = threading.Thread(target=ex.submit, args=((torch.ones(1, 6),), {}), daemon=True)
    stuck.start()
    try:
        assert model.entered.wait(JOIN_S)
        model.gate = None  # only the first call waits at the gate
        started = time.monotonic()
        ident, out = _in_threads([lambda: (threading.get_ident(), ex.submit((torch.ones(2, 6),), {}))])[0]
        assert time.monotonic() - started < 5.0
        assert out.shape == (2, 4) and model.idents[-1] == ident
        assert ex.status()["inline"] == 1
    finally:
        gate.set()
        stuck.join(JOIN_S)
        ex.stop()
    assert not ex.alive


def test_a_reentrant_call_runs_inline_instead_of_deadlocking(settings: Settings) -> None:
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.idents: list[int] = []

        def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
            self.idents.append(threading.get_ident())
            if depth == 0:
                return x
            return served(x + 1, depth=depth - 1)  # the served object, from inside the model

    model = Recursive()
    served = _attach(model, settings)
    try:
        out = _in_threads([lambda: served(torch.zeros(2))])[0]
        assert torch.equal(out, torch.full((2,), 2.0))
        assert len(model.idents) == 3 and set(model.idents) == {served.executor.ident}
    finally:
        served.close()


def test_a_call_from_a_thread_the_model_waits_for_does_not_deadlock() -> None:
    """A model that hands work to another thread calling the served object, and waits for it:
    that call cannot be served by the busy inference thread; it runs inline after stall_s."""
    holder: dict[str, Executor] = {}

    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, nested = args
        if not nested:
            return x * 2
        return _in_threads([lambda: holder["ex"].submit((x, False), {})])[0] + 1

    holder["ex"] = ex = Executor(fn, stall_s=0.3).start()
    try:
        out = _in_threads([lambda: ex.submit((torch.ones(2), True), {})])[0]
        assert torch.equal(out, torch.full((2,), 3.0))
        assert ex.status()["inline"] == 1
    finally:
        ex.stop()


def _gated_round(served: Any, model: Gated, calls: list[Callable[[], Any]], blocker_input: torch.Tensor) -> list[Any]:
    """Hold the inference thread on one call until ``calls`` (each in its own thread) all
    wait in the queue, then let it go; their results in order."""
    model.batches.clear()
    model.entered.clear()
    model.gate = threading.Event()
    blocker = threading.Thread(target=served, args=(blocker_input,), daemon=True)
    blocker.start()
    assert model.entered.wait(JOIN_S)
    results: list[Any] = []
    callers = threading.Thread(target=lambda: results.extend(_in_threads(calls)), daemon=True)
    callers.start()
    _queued(served.executor, len(calls))
    model.gate.set()
    callers.join(JOIN_S)
    blocker.join(JOIN_S)
    model.gate = None
    return results


def test_micro_batching_batches_waiting_calls_and_splits_outputs(settings: Settings) -> None:
    model = Recorder()
    served = _attach(model, settings, max_batch=4, max_delay_ms=0.0)
    inputs = [torch.randn(n, 6) for n in (1, 2, 1, 3)]
    try:
        with torch.inference_mode():
            expected = [model.linear(x) for x in inputs]
        results = _gated_round(served, model, [lambda x=x: served(x) for x in inputs], torch.randn(1, 6))
        assert model.batches == [1, 7], "the four waiting calls ran as one batch of 7 rows"
        for out, want in zip(results, expected, strict=True):
            assert out.shape == want.shape and torch.allclose(out, want, atol=1e-6)
        status = served.executor.status()
        assert status["batches"] == 1 and status["batched_calls"] == 4
        assert served.calls == 2  # the request path saw one call per batch
    finally:
        served.close()


def test_micro_batching_leaves_incompatible_calls_apart(settings: Settings) -> None:
    model = Recorder()
    served = _attach(model, settings, max_batch=8, max_delay_ms=0.0)
    try:
        a, b = torch.randn(2, 6), torch.randn(1, 6)
        with torch.inference_mode():
            want_a, want_b = model.linear(a), model.linear(b)
        # another dtype, another scale (a non-tensor argument): not batched with a and b
        out = _gated_round(served, model, [
            lambda: served(a), lambda: served(b.double()), lambda: served(b, scale=2.0), lambda: served(b),
        ], torch.randn(1, 6))
        assert model.batches[0] == 1  # the blocker
        assert sorted(model.batches[1:]) == [1, 1, 3], model.batches
        assert isinstance(out[1], RuntimeError)  # float64 input to a float32 layer: its own error
        assert torch.allclose(out[0], want_a, atol=1e-6) and torch.allclose(out[3], want_b, atol=1e-6)
        assert torch.allclose(out[2], want_b * 2, atol=1e-6)
    finally:
        served.close()


@pytest.mark.parametrize("kind", ["tree", "scalar"])
def test_micro_batching_splits_pytree_outputs_or_stops_when_it_cannot(kind: str) -> None:
    """Outputs are split leaf by leaf (a dict holding a tuple here); a model whose output has
    no batch dim (a 0-dim sum) is served call by call, and batching stops for it."""
    model = Gated()

    def fn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        (x,) = args
        model.arrive(x)
        return {"y": x * 2, "rows": (x.sum(1),)} if kind == "tree" else x.sum()

    ex = Executor(fn, max_batch=4, max_delay_ms=0.0).start()
    inputs = [torch.full((n, 2), float(n)) for n in (1, 2, 3)]
    try:
        model.gate = threading.Event()
        blocker = threading.Thread(target=ex.submit, args=((torch.ones(1, 2),), {}), daemon=True)
        blocker.start()
        assert model.entered.wait(JOIN_S)
        results: list[Any] = []
        callers = threading.Thread(target=lambda: results.extend(
            _in_threads([lambda x=x: ex.submit((x,), {}) for x in inputs])), daemon=True)
        callers.start()
        _queued(ex, len(inputs))
        model.gate.set()
        callers.join(JOIN_S)
        blocker.join(JOIN_S)
        for x, out in zip(inputs, results, strict=True):
            if kind == "tree":
                assert torch.equal(out["y"], x * 2) and torch.equal(out["rows"][0], x.sum(1))
            else:
                assert torch.equal(out, x.sum())
        if kind == "tree":
            assert model.batches == [1, 6] and ex.batching_off is None
        else:
            assert model.batches == [1, 6, 1, 2, 3] and ex.batching_off
    finally:
        ex.stop()


def test_a_failing_batch_is_served_call_by_call(settings: Settings) -> None:
    """A batch that raises is served again call by call: the good calls get their results,
    the bad one its own exception, the same object the model raised for it alone."""
    model = Failing()
    served = _attach(model, settings, max_batch=4, max_delay_ms=0.0)
    try:
        good, bad = torch.ones(1, 3), -torch.ones(1, 3)
        out = _gated_round(served, model, [lambda: served(good), lambda: served(bad), lambda: served(good)],
                           torch.ones(1, 3))
        assert model.batches == [1, 3, 1, 1, 1], "the batch of 3 failed, then one by one"
        assert len(model.raised) == 2
        assert torch.equal(out[0], good * 2) and torch.equal(out[2], good * 2)
        assert isinstance(out[1], ValueError) and out[1] is model.raised[-1]
        assert served.executor.status()["batches"] == 0
    finally:
        served.close()


def test_close_serves_the_calls_already_handed_over(settings: Settings) -> None:
    model = Recorder()
    served = _attach(model, settings)
    inputs = [torch.randn(1, 6) for _ in range(3)]
    with torch.inference_mode():
        expected = [model.linear(x) for x in inputs]
    model.gate = threading.Event()
    blocker = threading.Thread(target=served, args=(torch.randn(1, 6),), daemon=True)
    blocker.start()
    assert model.entered.wait(JOIN_S)
    results: list[Any] = []
    callers = threading.Thread(target=lambda: results.extend(
        _in_threads([lambda x=x: served(x) for x in inputs])), daemon=True)
    callers.start()
    _queued(served.executor, len(inputs))
    closer = threading.Thread(target=served.close, daemon=True)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive(), "close waits for the calls in flight"
    model.gate.set()
    closer.join(JOIN_S)
    callers.join(JOIN_S)
    assert not closer.is_alive() and not served.executor.alive
    for out, want in zip(results, expected, strict=True):
        assert torch.equal(out, want)
    assert set(model.idents) == {served.executor.ident}, "served by the inference thread"


def test_doctor_reports_what_the_thread_settings_cost(capsys: pytest.CaptureFixture[str]) -> None:
    from pgc_daemon.cli import run

    started = time.monotonic()
    assert run(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    threads = report["threads"]
    assert threads["intra_op"] == torch.get_num_threads()
    assert threads["inter_op"] == torch.get_num_interop_threads()
    assert threads["cores"] >= 1 and "omp_num_threads" in threads
    assert threads["first_thread_ms"] > 0 and threads["second_thread_ms"] > 0
    assert threads["second_thread_ratio"] == pytest.approx(
        threads["second_thread_ms"] / threads["first_thread_ms"], rel=1e-6)
    assert threads["executor_default"] is (torch.get_num_threads() > 1)
    assert isinstance(threads["advice"], str) and threads["advice"]
    assert time.monotonic() - started < 30
