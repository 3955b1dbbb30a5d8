"""The hook twin: a sampled call runs through hooks no other call sees, and computes, reads
and leaves behind exactly what a call of the model itself would."""

from __future__ import annotations

import threading
import time

import torch
import torch.fx
from torch import nn

from profiler import LayerTimer
from profiler._twin import HookTwin


def _names(timer: LayerTimer) -> set[str]:
    return {r[0] for r in timer.results()}


def _sampled(timer: LayerTimer, *args: torch.Tensor) -> torch.Tensor:
    timer.attach()
    try:
        return timer.target(*args)
    finally:
        timer.detach()


def test_the_twin_shares_every_tensor_and_copies_only_module_objects() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
    model.eval()
    twin = HookTwin(model, lambda m, a: None, lambda m, a, o: None)
    twins = [twin.twin_of(m) for m in model.modules()]
    assert len(twins) == 4 and all(t is not None and t is not m
                                   for t, m in zip(twins, model.modules()))
    assert twin.root[0].weight is model[0].weight
    assert twin.root[1].running_mean is model[1].running_mean
    assert twin.root[0]._parameters is model[0]._parameters  # one dict: a swap reaches both


def test_a_change_to_the_model_after_watching_reaches_the_sampled_call() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))  # still in training mode
    timer = LayerTimer(model)
    x = torch.randn(16, 8)
    model.eval()  # after the twin was made
    with torch.no_grad():
        assert torch.equal(_sampled(timer, x), model(x))  # no dropout in the sampled call
        model[0].weight = nn.Parameter(torch.zeros(8, 8))  # a weight swapped in
        model[0].bias.fill_(3.0)  # and one changed in place
        assert torch.equal(_sampled(timer, x), torch.full((16, 8), 3.0))


def test_what_the_sampled_call_assigns_is_written_back_and_nothing_else() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            self.mode = "a"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1  # state kept between calls
            model.mode = "b"  # another thread changes the original meanwhile
            return x + self.calls

    model = Counting()
    timer = LayerTimer(model)
    assert _sampled(timer, torch.zeros(1)).item() == 1.0
    assert model.calls == 1 and model.mode == "b"  # the call's update; the other kept
    assert model(torch.zeros(1)).item() == 2.0
    assert _sampled(timer, torch.zeros(1)).item() == 3.0 and model.calls == 3


def test_a_module_replaced_after_watching_is_timed_without_the_twin() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    timer = LayerTimer(model)
    assert timer.twin is not None
    model[1] = nn.Tanh()  # the twin would run the ReLU it was made with
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(_sampled(timer, x), model(x))
    assert timer.twin is None and "changed" in (timer.twin_reason or "")
    assert timer.target is model and "0" in _names(timer)


def test_the_users_own_hooks_run_in_sampled_calls_too() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    seen: list[str] = []
    model[0].register_forward_hook(lambda m, a, o: seen.append("before watch"))
    timer = LayerTimer(model)
    model[1].register_forward_pre_hook(lambda m, a: seen.append("after watch"))
    _sampled(timer, torch.randn(1, 4))
    assert seen == ["before watch", "after watch"]
    assert {"0", "1"} <= _names(timer)
    assert len(model[0]._forward_hooks) == 1 and not model[0]._forward_pre_hooks  # none added


def test_a_module_used_twice_is_one_module_in_the_twin() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    timer = LayerTimer(model)
    assert timer.target[0] is timer.target[2] is not shared
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(_sampled(timer, x), model(x))
    assert "0" in _names(timer) and "2" not in _names(timer)  # timed under its first name


def test_graph_modules_are_twinned() -> None:
    model = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)))
    timer = LayerTimer(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert timer.twin is not None and torch.equal(_sampled(timer, x), model(x))
    assert {"0", "1", "2"} <= _names(timer)


def test_a_torchscript_part_falls_back_to_process_wide_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.ReLU()))
    timer = LayerTimer(model)
    assert timer.twin is None and "TorchScript" in (timer.twin_reason or "")
    assert timer.target is model
    _sampled(timer, torch.randn(1, 4))
    assert "0" in _names(timer)


def test_other_threads_run_the_model_unhooked_while_a_call_is_sampled() -> None:
    hooked = []

    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return x

    model = nn.Sequential(Slow(), nn.Identity())
    timer = LayerTimer(model)
    real_pre = timer._pre  # noqa: SLF001 - count every hook call, whichever thread

    def counting_pre(mod: nn.Module, args: object) -> None:
        hooked.append(threading.get_ident())
        real_pre(mod, args)

    timer.twin._pre[-1] = counting_pre  # type: ignore[union-attr]  # noqa: SLF001
    timer.twin.refresh()  # type: ignore[union-attr]
    timer.attach()
    others = [threading.Thread(target=lambda: [model(torch.ones(1)) for _ in range(5)])
              for _ in range(2)]
    for t in others:
        t.start()
    timer.target(torch.ones(1))
    for t in others:
        t.join()
    timer.detach()
    assert set(hooked) == {threading.get_ident()} and len(hooked) == 3  # root and 2 layers


def test_the_profiler_says_how_sampled_calls_are_timed() -> None:
    from profiler import Profiler, ProfilerConfig

    model = nn.Sequential(nn.Linear(4, 4))
    twinned = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None))
    twinned.watch(model)
    x = torch.ones(1, 4)
    token = twinned.begin(model)
    assert token is not None and token.module is not model
    assert twinned.status()["hooks"].startswith("hook twin")
    twinned.end(token, model, (x,), {}, 1_000)
    plain = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None,
                                    hook_twin=False))
    plain.watch(model)
    token = plain.begin(model)
    assert token is not None and token.module is model
    assert plain.status()["hooks"] == ("process-wide while a call is sampled: "
                                       "off (hook_twin=False)")
    plain.end(token, model, (x,), {}, 1_000)  # a call begun must end: it took process-wide hooks
    twinned.stop()
    plain.stop()


def test_a_real_transformer_sampled_through_its_twin() -> None:
    # all-MiniLM-L6-v2 with its real weights (Hugging Face modules, a tokenizer's inputs)
    from pgc_daemon.examples import minilm

    model = minilm.load_model().eval()
    timer = LayerTimer(model)
    assert timer.twin is not None, timer.twin_reason
    args = minilm.encode(["The twin runs the same weights as the model it copies."])
    with torch.inference_mode():
        expected = model(*args)
        got = _sampled(timer, *args)
    assert torch.equal(got, expected)
    names = _names(timer)
    for i in range(6):
        assert f"encoder.encoder.layer.{i}.intermediate.dense" in names
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_forgotten_model_is_freed_even_with_the_heap_frozen() -> None:
    # The twin's hooks refer to the timer, which refers to the twin: a cycle. The agent
    # freezes the heap after each deployment (gc.freeze), where no collection would break
    # it, so the profiler breaks it when it lets go of a model.
    import gc
    import weakref

    from profiler import Profiler, ProfilerConfig

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    ref = weakref.ref(model)
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None))
    prof.watch(model)
    token = prof.begin(model)
    assert token is not None
    token.module(torch.ones(1, 4))
    prof.end(token, 1, (torch.ones(1, 4),), {}, 1000)
    prof.close_window()  # rows made: nothing pending holds the timer
    del token
    gc.collect()
    gc.freeze()
    try:
        prof.forget(model)
        del model
        assert ref() is None
    finally:
        gc.unfreeze()
