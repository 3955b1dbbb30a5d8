"""The overhead budget: the profiler measures its own cost and moves its sampling rate to stay
under the budget, and back up when there is headroom."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from profiler import (
    Pacer, Period, Profiler, ProfilerConfig, RateController, Window, foreign_cost_ns,
)

pytestmark = pytest.mark.serial  # it measures the profiler's cost against serving time


MS = 1_000_000


def test_controller_lowers_the_rate_in_proportion_to_the_excess() -> None:
    c = RateController(base_every=10, budget=0.01, target=1.0)
    # 1 s of serving; sampling cost 40 ms against a 10 ms allowance: N x4
    n = c.update(Period(calls=1000, serving_ns=1000 * MS, sampled=100, sampled_cost_ns=40 * MS))
    assert n == 40
    assert c.state == "rate lowered to stay within budget"


def test_controller_raises_the_rate_by_at_most_2x_and_never_past_the_configured_one() -> None:
    c = RateController(base_every=10, budget=0.01, target=1.0)
    c.every = 160
    # far under budget: the ideal N would be 16, but one step only halves
    n = c.update(Period(calls=1000, serving_ns=1000 * MS, sampled=6, sampled_cost_ns=1 * MS))
    assert n == 80
    for _ in range(10):
        n = c.update(Period(calls=1000, serving_ns=1000 * MS, sampled=12, sampled_cost_ns=1 * MS))
    assert n == 10  # back at the configured rate, not beyond


def test_controller_raises_the_rate_when_nothing_was_sampled_and_there_is_room() -> None:
    c = RateController(base_every=1, budget=0.005)
    c.every = 64
    assert c.update(Period(calls=10, serving_ns=1000 * MS, sampled=0, fixed_cost_ns=0)) == 32


def test_controller_holds_small_changes_to_avoid_jitter() -> None:
    c = RateController(base_every=10, budget=0.01, target=1.0)
    c.every = 100
    # ideal N = 90: less than 20% away, keep 100
    assert c.update(Period(calls=1000, serving_ns=1000 * MS, sampled=10, sampled_cost_ns=9 * MS)) == 100


def test_fixed_costs_over_budget_send_the_rate_to_its_floor() -> None:
    c = RateController(base_every=10, budget=0.005, max_every=1000)
    n = c.update(Period(calls=100, serving_ns=100 * MS, sampled=10, sampled_cost_ns=1 * MS,
                        fixed_cost_ns=1 * MS))
    assert n == 160  # at most 16x per step
    for _ in range(3):
        n = c.update(Period(calls=100, serving_ns=100 * MS, sampled=1, sampled_cost_ns=MS // 10,
                            fixed_cost_ns=1 * MS))
    assert n == 1000 and c.state.startswith("over budget")


#: periods measured on MiniLM at 7 calls a second (1 thread, default config): calls, serving
#: ms, sampled calls, their cost ms, per-call and background ms. The fifth and sixth hold a
#: burst of background work (a window's export and a host sample falling together).
LOW_TRAFFIC = [(70, 3260, 2, 3.76, 4.46), (70, 3186, 1, 0.80, 3.48), (70, 3244, 0, 0.0, 3.55),
               (70, 3534, 1, 0.80, 5.86), (71, 4006, 1, 3.29, 19.94), (70, 3297, 1, 0.89, 14.08),
               (70, 3147, 1, 0.83, 9.19), (70, 3564, 0, 0.0, 2.35)]


def _period(calls: int, serving: float, sampled: int, cost: float, fixed: float) -> Period:
    return Period(calls=calls, serving_ns=serving * MS, sampled=sampled,
                  sampled_cost_ns=cost * MS, fixed_cost_ns=fixed * MS)


def test_a_burst_of_background_work_at_low_traffic_does_not_stop_per_layer_sampling() -> None:
    # Judged one period at a time, the burst sent N from 100 to 1 600 and then 25 600 (one
    # sampled call every hour at this traffic) while the profiler cost half its budget.
    c = RateController(base_every=100, budget=0.005, max_every=1_000_000)
    rates = [c.update(_period(*p)) for p in LOW_TRAFFIC]
    assert max(rates) <= 200, rates
    assert rates[-1] == 100 and c.state == "within budget"


def test_periods_without_a_sampled_call_bring_the_rate_back_from_what_sampling_costs() -> None:
    c = RateController(base_every=10, budget=0.01, target=1.0)
    c.every = 640
    # one sampled call of 1 ms among 1 000 calls a period, then none: 1 in 10 would cost
    # 100 ms of 1 000 ms serving, 10x the budget; 1 in 100 fits it
    c.update(_period(1000, 1000, 1, 1.0, 0.0))
    rates = [c.update(_period(1000, 1000, 0, 0.0, 0.0)) for _ in range(6)]
    assert rates[-1] == 100, rates


def test_sustained_background_over_the_budget_still_sends_the_rate_to_its_floor() -> None:
    c = RateController(base_every=100, budget=0.005, max_every=100_000)
    for _ in range(6):
        n = c.update(_period(70, 3300, 1, 0.8, 30.0))  # 0.9% of serving in background alone
    assert n == 100_000 and c.state.startswith("over budget: per-call and background")


#: MiniLM's int8 variant served at 20 calls a second in the demo (13.5 ms a call; 1 call in 20
#: configured): periods of 100 calls with 2.3 ms of per-call and background cost, one of them
#: sampled, and one period with a 21.3 ms burst (a reservoir save during a window's export).
DEPLOYED_QUIET = (100, 1350, 1, 3.2, 2.3)
DEPLOYED_BURST = (100, 1384, 0, 0.0, 21.3)


def test_a_rare_burst_of_background_work_is_read_over_the_longer_run() -> None:
    # With bursts every 30 s (every sixth period) the demo's fixed costs were over the target
    # on average, and the floor was right; with the save paced to every few minutes they are
    # not, yet the burst's own period, read over the last three periods, sent N to its floor
    # (100 000: one sampled call every 80 minutes) each time it came.
    c = RateController(base_every=20, budget=0.005, max_every=100_000)
    rates = [c.update(_period(*DEPLOYED_QUIET)) for _ in range(30)]
    rates += [c.update(_period(*DEPLOYED_BURST))]
    rates += [c.update(_period(*DEPLOYED_QUIET)) for _ in range(6)]
    assert max(rates[30:]) <= 3 * rates[29], rates  # was 16x, then the floor
    assert rates[-1] <= 300 and not c.state.startswith("over budget"), (rates, c.state)


def test_pacer_waits_until_the_serving_time_pays_for_a_run() -> None:
    p = Pacer(0.001, min_s=10, max_s=60, now=0.0)
    assert not p.due(5.0, 0)  # before min_s, whatever was served
    assert p.due(10.0, 0)  # no cost measured yet: due
    p.ran(10.0, 0)
    p.cost(3 * MS)  # 3 ms a run at 0.1% of serving: 3 s of serving pays for the next one
    assert not p.due(25.0, 2_000 * MS)
    assert p.due(25.0, 3_000 * MS)
    p.ran(25.0, 3_000 * MS)
    assert not p.due(84.0, 3_000 * MS)
    assert p.due(85.0, 3_000 * MS)  # max_s: due however little was served


def test_pacer_reads_a_typical_run_not_one_slow_one() -> None:
    p = Pacer(0.001, min_s=1, max_s=600, now=0.0)
    for cost in (2, 2, 3, 2, 300):  # one write waited for another writer's lock
        p.cost(cost * MS)
    p.ran(0.0, 0)
    assert p.due(1.0, 2_500 * MS)


def test_pacer_without_a_budget_runs_every_min_s() -> None:
    p = Pacer(None, min_s=10, max_s=60, now=0.0)
    p.cost(1e12)
    assert not p.due(9.0, 0) and p.due(10.0, 0)


@pytest.mark.parametrize("kwargs", [{"fraction": 0.0}, {"min_s": 0}, {"min_s": 5, "max_s": 1}])
def test_pacer_rejects_bad_settings(kwargs: dict) -> None:
    args = {"fraction": 0.001, "min_s": 1.0, "max_s": 10.0, **kwargs}
    with pytest.raises(ValueError):
        Pacer(args["fraction"], args["min_s"], args["max_s"], now=0.0)


def test_no_budget_keeps_the_rate() -> None:
    c = RateController(base_every=7, budget=None)
    assert c.update(Period(calls=10, serving_ns=MS, sampled=10, sampled_cost_ns=MS)) == 7


@pytest.mark.parametrize("kwargs", [{"budget": 0.0}, {"budget": 1.5}, {"base_every": 0},
                                    {"base_every": 10, "max_every": 5}])
def test_controller_rejects_bad_settings(kwargs: dict) -> None:
    args = {"base_every": 1, "budget": 0.01, **kwargs}
    with pytest.raises(ValueError):
        RateController(args.pop("base_every"), args.pop("budget"), **args)


class Delay(nn.Module):
    """Busy-waits ``ms`` (not sleep: a real, CPU-bound serving time)."""

    def __init__(self) -> None:
        super().__init__()
        self.ms = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        end = time.perf_counter_ns() + int(self.ms * 1e6)
        while time.perf_counter_ns() < end:
            pass
        return x


def _many_layers(ms: float = 2.0) -> tuple[nn.Module, Delay]:
    """200 cheap modules around ``ms`` of real work: hooking every call costs ~50%."""
    delay = Delay()
    delay.ms = ms
    layers = [nn.Sequential(nn.Identity(), nn.Identity()) for _ in range(66)]
    return nn.Sequential(*layers, delay), delay


def _serve(prof: Profiler, model: nn.Module, n: int) -> None:
    x = torch.ones(1)
    for _ in range(n):
        token = prof.begin(model)
        t0 = time.perf_counter_ns()
        (token.module if token is not None else model)(x)
        prof.end(token, 1, (x,), {}, time.perf_counter_ns() - t0)


def test_profiler_lowers_its_rate_to_meet_the_budget_and_raises_it_again() -> None:
    # A 5% budget keeps this test short; the mechanism is the same at 0.5% (the benchmark
    # checks that one on MiniLM).
    model, delay = _many_layers(ms=2.0)
    budget = 0.05
    prof = Profiler(ProfilerConfig(sample_every=1, budget=budget, host_interval_s=None))
    prof.watch(model)
    _serve(prof, model, 100)
    prof.close_window()  # turn sampled calls into rows: their processing is charged too
    before = prof.aggregator.totals()
    assert before.overhead > 3 * budget  # sampling every call is far over budget
    assert prof.adapt() > 2
    for _ in range(6):  # the controller converges within a few periods
        _serve(prof, model, min(max(150, 12 * prof.sample_every), 1500))
        prof.close_window()
        prof.adapt()
    # the least of up to three windows at the rate reached: a noisy moment on a shared
    # machine only adds to what a window charges (a CI run once measured 21.5% at 1 in 12
    # in one window; the same test alone, and two other CI runs that day, were within)
    measured = float("inf")
    for _ in range(3):
        t0 = prof.aggregator.totals()
        _serve(prof, model, min(max(300, 20 * prof.sample_every), 2000))
        prof.close_window()
        t1 = prof.aggregator.totals()
        measured = min(measured, (t1.cost_ns - t0.cost_ns) / (t1.serving_ns - t0.serving_ns))
        if measured < 1.3 * budget:
            break
    assert measured < 1.3 * budget, f"overhead {measured:.3%} at 1 in {prof.sample_every}"
    lowered = prof.sample_every
    assert lowered > 4
    # the same model with 20 ms of work per call: headroom, so the rate goes back up
    delay.ms = 20.0
    # a loaded machine inflates the measured cost: allow more periods (a CI run whose suite
    # took 23 minutes, against 21 for the same code before, was at 1 in 23 after 12)
    for _ in range(20):
        _serve(prof, model, min(4 * prof.sample_every, 200))
        prof.close_window()
        prof.adapt()
        if prof.sample_every <= lowered // 3:
            break
    assert prof.sample_every <= lowered // 3
    prof.stop()


def test_measured_overhead_is_exported_per_window() -> None:
    model, _ = _many_layers()
    got: list[Window] = []
    prof = Profiler(ProfilerConfig(sample_every=2, budget=None, window_s=60, host_interval_s=None),
                    sink=got.extend)
    prof.watch(model)
    prof.start()
    _serve(prof, model, 50)
    prof.flush()
    prof.stop()
    rows = [r for w in got for r in w.requests]
    assert rows and rows[0].sampled == 25
    # every row carries the profiler's cost as a fraction of its serving time, and the
    # profiler's own ledger agrees with what the rows say
    total = prof.aggregator.totals()
    assert rows[0].overhead == pytest.approx(total.overhead, rel=0.5)
    assert rows[0].overhead > 0.01


def test_the_background_thread_adapts_the_rate_on_live_traffic() -> None:
    model, _ = _many_layers(ms=2.0)
    prof = Profiler(ProfilerConfig(sample_every=1, budget=0.05, window_s=0.3, control_s=0.05,
                                   host_interval_s=None), sink=lambda ws: None)
    prof.watch(model)
    prof.start()
    deadline = time.monotonic() + 30
    try:
        while prof.sample_every == 1 and time.monotonic() < deadline:
            _serve(prof, model, 50)
        assert prof.sample_every > 1
        # the state names why the rate went down; on a loaded machine (CI on 2 cores) a
        # period's background cost alone can exceed the budget, which is also a lowering
        assert prof.status()["state"] in (
            "rate lowered to stay within budget",
            "over budget: per-call and background costs alone exceed it at this traffic",
        )
    finally:
        prof.stop()


def _busy(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("kind", ["waits", "computes"])
def test_the_background_is_charged_what_it_computes_not_what_it_waits(kind: str) -> None:
    # An export that waits (on the store, the GIL, or a core a search worker holds) costs
    # serving nothing; on the wall clock such waits were charged and starved the sampling.
    def sink(windows: list[Window]) -> None:
        time.sleep(0.2) if kind == "waits" else _busy(200)

    model, _ = _many_layers(ms=0.5)
    prof = Profiler(ProfilerConfig(sample_every=1000, budget=None, window_s=60,
                                   host_interval_s=None), sink=sink)
    prof.watch(model)
    prof.start()
    try:
        _serve(prof, model, 20)
        before = prof.aggregator.totals().background_ns
        prof.flush()  # one window exported through the sink
        charged = (prof.aggregator.totals().background_ns - before) / 1e6
    finally:
        prof.stop()
    if kind == "waits":
        assert charged < 50, f"{charged:.0f} ms charged for a 200 ms wait"
    else:
        assert charged > 150, f"{charged:.0f} ms charged for 200 ms of work"


@pytest.mark.parametrize("traffic", ["light", "heavy"])
def test_window_exports_are_spaced_out_when_serving_is_light(traffic: str) -> None:
    # An export costs the same whatever the traffic; every ``window_s`` at light traffic it
    # took more of the budget than the sampled calls were left (see ``EXPORT_SHARE``).
    exports: list[float] = []

    def sink(windows: list[Window]) -> None:
        exports.append(time.monotonic())
        _busy(1.0)  # 1 ms of CPU a write: pays for itself in 80 ms of serving at 5% x 0.25

    class Sleeps(nn.Module):  # serves 1 ms without holding the GIL, as torch's kernels do
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.001)
            return x

    model = Sleeps()
    prof = Profiler(ProfilerConfig(sample_every=1000, budget=0.05, window_s=0.2, control_s=0.05,
                                   host_interval_s=None), sink=sink)
    prof.watch(model)
    prof.start()
    try:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            _serve(prof, model, 1)
            if traffic == "light":
                time.sleep(0.05)  # 20 calls a second: 20 ms of serving a second
    finally:
        prof.stop(flush=False)
    if traffic == "light":  # at most every 6 x 0.2 s: 2-3 in 3 s
        assert 1 <= len(exports) <= 4, exports
    else:  # every 0.2 s, as configured
        assert len(exports) >= 8, [round(b - a, 2) for a, b in zip(exports, exports[1:])]


@pytest.mark.parametrize("twin", [True, False])
def test_what_a_sampled_call_costs_other_threads_is_charged_to_it(twin: bool) -> None:
    # With process-wide hooks (a model that cannot be twinned: a TorchScript part), every
    # module call of every other thread takes torch's hooked path while one thread's call is
    # sampled (the concurrent case of the benchmark measured +15-20% on the digits CNN's
    # other threads): that is charged to the sampled call. With the twin (any other model)
    # other threads run the original, which has no hooks: nothing to charge.
    model, _ = _many_layers(ms=0.0)
    if not twin:
        model.append(torch.jit.script(nn.Identity()))
    modules = sum(1 for _ in model.modules())
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None))
    prof.watch(model)
    x = torch.ones(1)

    def sampled_call(others: int) -> int:
        before = prof.aggregator.totals().sampled_cost_ns
        token = prof.begin(model)
        assert token is not None and (token.module is not model) == twin
        other = threading.Thread(target=lambda: [model(x) for _ in range(others)])
        other.start()
        other.join()
        t0 = time.perf_counter_ns()
        token.module(x)
        assert (token.timer.foreign_ns > 0) == (others > 0 and not twin)
        prof.end(token, 1, (x,), {}, time.perf_counter_ns() - t0)
        prof.close_window()
        return prof.aggregator.totals().sampled_cost_ns - before

    alone = min(sampled_call(0) for _ in range(3))
    shared = sampled_call(20)
    expected = 20 * modules * foreign_cost_ns()
    assert expected > 0
    if twin:
        assert shared - alone < 0.1 * expected, (shared, alone, expected)
    else:
        assert shared - alone >= 0.9 * expected, (shared, alone, expected)
