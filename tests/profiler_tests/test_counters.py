"""Per-layer CPU counters through perf_event_open (real system calls, no mocks): detection,
the fallback from hardware to software events, per-thread groups, per-layer deltas."""

from __future__ import annotations

import mmap
import threading
import time

import pytest
import torch
from torch import nn

from profiler import (
    LayerTimer,
    PerfCounters,
    Profiler,
    ProfilerConfig,
    counter_availability,
    derived,
)
from profiler._counters import HARDWARE_EVENTS, SOFTWARE_EVENTS

linux = pytest.mark.skipif(counter_availability().mode == "off",
                           reason=f"no perf counters here: {counter_availability().reason}")


def test_availability_is_detected_once_and_explains_what_is_off() -> None:
    av = counter_availability()
    assert counter_availability() is av  # detected once per process
    assert av.mode in ("hardware", "software", "off")
    for name in (*HARDWARE_EVENTS, *SOFTWARE_EVENTS):
        # every requested event is either counted or has a reason
        assert name in av.events or name in av.unavailable
    if av.mode == "hardware":
        assert av.ipc and av.reason is None
    else:
        assert not av.ipc and av.reason  # why hardware events are off, e.g. ENOENT on a VM
    assert av.summary().startswith(av.mode)


@linux
def test_hardware_falls_back_to_software_events() -> None:
    # An event no PMU offers (config 0xffff is not a generic hardware event) stands in for
    # a machine without hardware counters, so this runs the fallback on any machine.
    from profiler._counters import EVENTS, PERF_TYPE_HARDWARE

    EVENTS["bogus_hw"] = (PERF_TYPE_HARDWARE, 0xFFFF)
    try:
        counters = PerfCounters(hardware=("bogus_hw",), software=("task_clock_ns", "page_faults"))
    finally:
        del EVENTS["bogus_hw"]
    av = counters.availability
    assert av.mode == "software"
    assert av.events == ("task_clock_ns", "page_faults")
    assert "bogus_hw" in av.unavailable and av.reason == av.unavailable["bogus_hw"]
    snap = counters.read()
    assert set(snap) == {"task_clock_ns", "page_faults"}
    counters.close()


def test_on_this_machine_the_fallback_is_what_the_kernel_offers() -> None:
    av = counter_availability()
    if av.mode != "software":
        pytest.skip(f"counters here are {av.mode}")
    # a VM like this one: no PMU, so none of the hardware events opened, for a stated reason
    assert not any(e in av.events for e in HARDWARE_EVENTS)
    assert {"task_clock_ns", "page_faults", "context_switches"} <= set(av.events)
    assert "ENOENT" in av.reason or "not permitted" in av.reason


@linux
def test_counters_count_real_work() -> None:
    counters = PerfCounters()
    before = counters.read()
    end = time.perf_counter() + 0.03
    while time.perf_counter() < end:  # 30 ms of CPU
        pass
    # touch 64 MiB of new pages: a fresh mapping (np.ones once read 0 faults late in the
    # suite: the allocator handed back memory already mapped)
    fresh = mmap.mmap(-1, 64 * 1024 * 1024)
    for offset in range(0, len(fresh), mmap.PAGESIZE):
        fresh[offset] = 1
    time.sleep(0.01)  # a voluntary context switch
    after = counters.read()
    fresh.close()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["task_clock_ns"] >= 25e6
    assert delta["page_faults"] >= 16  # 64 MiB: 16k small pages, or 32 huge ones
    assert delta["context_switches"] >= 1
    counters.close()


@linux
def test_context_switches_come_from_getrusage_when_kernel_counting_is_off() -> None:
    counters = PerfCounters(allow_kernel=False)
    av = counters.availability
    assert av.context_switches_from == "getrusage" and not av.kernel
    before = counters.read()["context_switches"]
    for _ in range(3):
        time.sleep(0.002)
    assert counters.read()["context_switches"] >= before + 3
    counters.close()


@linux
def test_each_thread_reads_its_own_counters() -> None:
    counters = PerfCounters(hardware=(), software=("task_clock_ns",))
    main_before = counters.read()["task_clock_ns"]
    seen: dict[str, float] = {}

    def busy() -> None:
        a, cpu0 = counters.read()["task_clock_ns"], time.thread_time_ns()
        acc = 0
        for i in range(300_000):  # fixed CPU work (wall time would depend on the machine's load)
            acc += i * i
        seen["cpu"] = time.thread_time_ns() - cpu0
        seen["delta"] = counters.read()["task_clock_ns"] - a

    t = threading.Thread(target=busy)
    t.start()
    t.join()
    main_after = counters.read()["task_clock_ns"]
    assert seen["delta"] == pytest.approx(seen["cpu"], rel=0.5)  # the thread's own CPU...
    assert main_after - main_before < seen["delta"] / 2  # ...is not the main thread's
    counters.close()


class Burn(nn.Module):
    """A fixed amount of CPU work (not wall time: the machine may be busy), and the CPU time
    it really took, measured by the layer itself."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.cpu_ns = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.thread_time_ns()
        acc = 0
        for i in range(self.n):
            acc += i * i
        self.cpu_ns += time.thread_time_ns() - t0
        return x


@linux
def test_per_layer_counter_deltas_reach_the_window_rows() -> None:
    model = nn.Sequential(Burn(400_000), Burn(100_000))
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None, counter_every=1))
    prof.watch(model)
    x = torch.ones(1)
    for _ in range(3):
        token = prof.begin(model)
        t0 = time.perf_counter_ns()
        (token.module if token is not None else model)(x)
        prof.end(token, 1, (x,), {}, time.perf_counter_ns() - t0)
    win = prof.close_window()
    rows = {r.layer: r for r in win.layers}
    big, small = rows["0"].counters, rows["1"].counters
    assert set(big) == set(counter_availability().events) | {"calls"} and big["calls"] == 3
    # the task clock of each layer is the CPU time the layer itself measured
    assert big["task_clock_ns"] == pytest.approx(model[0].cpu_ns, rel=0.5)
    assert small["task_clock_ns"] == pytest.approx(model[1].cpu_ns, rel=0.5)
    assert big["task_clock_ns"] > 2 * small["task_clock_ns"]
    assert prof.status()["counters"].startswith(counter_availability().mode)
    prof.stop()


def test_the_status_says_why_a_compiled_variant_has_no_counters() -> None:
    # counters are read per hooked layer; a module timed from its kernels opens none, and the
    # status said "no model watched yet" while one was
    prof = Profiler(ProfilerConfig(host_interval_s=None))
    assert prof.status()["counters"] == "not started (no model watched yet)"
    prof.watch(nn.Linear(4, 4), kernels={"aten::linear": [[""]]})
    assert prof.status()["counters"].startswith("not used (compiled variants' layers")
    prof.watch(nn.Sequential(nn.Linear(4, 4)))  # a hooked model opens them
    assert not prof.status()["counters"].startswith(("not used", "not started"))


def test_layer_timer_takes_any_counter_source() -> None:
    class Ticks:
        def __init__(self) -> None:
            self.n = 0.0

        def read(self) -> dict[str, float]:
            self.n += 1
            return {"ticks": self.n}

    model = nn.Sequential(nn.Identity(), nn.Identity())
    timer = LayerTimer(model, counters=Ticks())
    timer.attach()
    timer.target(torch.ones(1))
    timer.detach()
    rows = {r[0]: r[3] for r in timer.results()}
    assert rows["0"] == {"ticks": 1.0, "calls": 1.0} and rows["1"] == {"ticks": 1.0, "calls": 1.0}


def test_derived_ratios() -> None:
    assert derived({"cycles": 200.0, "instructions": 300.0}) == {"ipc": 1.5}
    assert derived({"cache_references": 100.0, "cache_misses": 5.0}) == {"cache_miss_rate": 0.05}
    assert derived({"task_clock_ns": 1.0}) == {} and derived(None) == {}


@linux
def test_counters_are_read_on_one_sampled_call_in_n_and_say_over_how_many() -> None:
    model = nn.Sequential(Burn(10_000))
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None, counter_every=4))
    prof.watch(model)
    x = torch.ones(1)
    for _ in range(9):
        token = prof.begin(model)
        (token.module if token is not None else model)(x)
        prof.end(token, 1, (x,), {}, 1000)
    row = next(r for r in prof.close_window().layers if r.layer == "0")
    assert row.count == 9 and row.counters["calls"] == 3  # calls 1, 5 and 9
    prof.stop()


@linux
def test_a_counter_group_closes_after_module_globals_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Groups live in thread-local storage, freed at interpreter exit after module globals
    # are set to None: their __del__ then printed "Exception ignored ... 'NoneType' object
    # has no attribute 'close'" at the end of every CI run.
    from profiler import _counters

    counters = PerfCounters()
    if not counters.available:
        pytest.skip(counters.availability.summary())
    group = counters._group()  # noqa: SLF001 - this thread's group, as the hooks read it
    assert group is not None and group.fds
    monkeypatch.setattr(_counters, "os", None)  # what interpreter exit leaves
    group.close()
    monkeypatch.undo()
    assert group.fds == []
