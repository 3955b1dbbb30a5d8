"""The live choice of intra-op threads per serving variant (``agent/threadtune.py``): the
decision on measured latencies, its limits (owner thread, canary, re-probing), and the whole
path through a served model's executor into the store's events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sklearn.datasets  # noqa: F401 - maps scikit-learn's own libgomp into the process
import torch
from torch import nn

import store as st
from pgc_daemon import attach
from pgc_daemon.agent.ompthreads import set_thread_count
from pgc_daemon.agent.threadtune import (
    STALE_EVERY,
    STALE_EVERY_S,
    ThreadTuner,
    Use,
    candidates,
)
from pgc_daemon.settings import Settings
from profiler import ProfilerConfig

from .helpers import wait_for


pytestmark = pytest.mark.serial  # it times thread counts on live traffic


@pytest.fixture(autouse=True)
def _threads_back() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tuner(configured: int = 4, **kw: Any) -> ThreadTuner:
    me = threading.get_ident()
    return ThreadTuner(configured, owner=lambda: me, calls_per_arm=20, block=4, **kw)


def _serve(tuner: ThreadTuner, cost_ms: dict[int, float], calls: int, variant: int | None = 7,
           canary: bool = False, uses: list[Use] | None = None) -> list[int]:
    """``calls`` calls of ``variant`` whose latency at n threads is ``cost_ms[n]`` (with a
    little spread); the thread counts they ran at."""
    ran = []
    for i in range(calls):
        use = tuner.use(variant, canary=canary)
        assert use is not None
        if uses is not None:
            uses.append(use)
        assert torch.get_num_threads() == use.threads
        ran.append(use.threads)
        tuner.record(use, cost_ms[use.threads] * (1 + 0.02 * (i % 5)))
    return ran


def test_candidates_are_the_configured_count_half_of_it_and_one() -> None:
    assert candidates(8) == (8, 4, 1)
    assert candidates(2) == (2, 1)
    assert candidates(1) == (1,)


def test_the_count_that_serves_faster_live_is_chosen() -> None:
    tuner = _tuner()
    ran = _serve(tuner, {4: 17.0, 2: 15.0, 1: 13.5}, 400)
    assert tuner.chosen(7) == 1
    assert set(ran[:60]) == {4, 2, 1}  # probed every count in blocks
    assert set(ran[-100:]) == {1}  # then served at the choice
    status = tuner.status()["variants"]["7"]
    assert status["threads"] == 1 and status["live_ms"]["1"] < status["live_ms"]["4"]


def test_the_configured_count_stays_unless_another_is_faster_with_confidence() -> None:
    tuner = _tuner()
    _serve(tuner, {4: 10.0, 2: 10.1, 1: 9.9}, 400)  # within the spread and the margin
    assert tuner.chosen(7) == 4
    slower = _tuner()
    _serve(slower, {4: 9.0, 2: 12.0, 1: 20.0}, 400)
    assert slower.chosen(7) == 4


def test_each_variant_has_its_own_choice_and_a_decided_canary_arm_keeps_it() -> None:
    tuner = _tuner()
    _serve(tuner, {4: 17.0, 2: 15.0, 1: 13.5}, 400, variant=1)
    _serve(tuner, {4: 9.0, 2: 12.0, 1: 20.0}, 400, variant=2)
    assert (tuner.chosen(1), tuner.chosen(2)) == (1, 4)
    # a canary: each decided arm at its variant's choice, every call as it serves
    uses: list[Use] = []
    assert set(_serve(tuner, {4: 1.0, 2: 1.0, 1: 1.0}, 50, variant=1, canary=True, uses=uses)) == {1}
    assert set(_serve(tuner, {4: 1.0, 2: 1.0, 1: 1.0}, 50, variant=2, canary=True, uses=uses)) == {4}
    assert all(u.decided and not u.counted for u in uses)
    assert (tuner.chosen(1), tuner.chosen(2)) == (1, 4)


def test_an_undecided_canary_arm_is_probed_and_its_probe_calls_are_marked() -> None:
    """Seen in the demo: a new int8 static · Inductor arm served at the incumbent's count (2)
    while a search worker held one of the 2 cores, measured 1.10x slower than the incumbent and
    was rolled back, where the search had timed it faster at one thread. An undecided arm is
    probed like a variant serving alone; its calls say they are not yet as it will serve, so
    the canary does not compare them."""
    tuner = _tuner()
    _serve(tuner, {4: 9.0, 2: 12.0, 1: 20.0}, 400, variant=2)  # the incumbent: 4
    uses: list[Use] = []
    ran = _serve(tuner, {4: 17.0, 2: 15.0, 1: 13.5}, 400, variant=3, canary=True, uses=uses)
    assert tuner.chosen(3) == 1 and tuner.decided(3)
    assert set(ran[:60]) == {4, 2, 1}  # probed every count
    first_decided = next(i for i, u in enumerate(uses) if u.decided)
    assert first_decided >= 3 * 4 * 3  # at least three blocks per count before a decision
    assert all(not u.decided for u in uses[:first_decided])
    assert all(u.decided and u.threads == 1 for u in uses[first_decided:])


def test_a_variant_on_a_thread_pool_of_its_own_is_not_probed() -> None:
    """ONNX Runtime and OpenVINO compute on their own pools: torch's count does not reach them,
    and a decision on them measured noise (seen: "serves at 2 threads: 10.39 ms at 1, 10.24 ms
    at 2"), which then set the count of the next canary arm."""
    heard: list[dict[str, Any]] = []
    tuner = _tuner(notify=lambda message, data: heard.append(data))
    torch.set_num_threads(3)
    assert not tuner.decided(5)
    for _ in range(200):
        use = tuner.use(5, own_pool=True)
        assert use is not None and use.decided and not use.counted
        assert torch.get_num_threads() == 3  # nothing set
        tuner.record(use, 10.0)
    assert tuner.decided(5) and tuner.settled(5) and tuner.chosen(5) is None
    assert heard == [] and "5" not in tuner.status()["variants"]


def test_a_clearly_slower_count_is_given_up_early_and_a_close_one_is_not() -> None:
    me = threading.get_ident()
    clear = ThreadTuner(2, owner=lambda: me, calls_per_arm=40, block=8, early_calls=14)
    ran = _serve(clear, {2: 10.0, 1: 20.0}, 200)
    decided_after = next(i for i in range(len(ran)) if all(n == 2 for n in ran[i:]))
    assert clear.chosen(7) == 2
    assert ran[:decided_after].count(1) <= 24  # three blocks, not the 40 counted calls
    close = ThreadTuner(2, owner=lambda: me, calls_per_arm=40, block=8, early_calls=14)
    ran = _serve(close, {2: 10.0, 1: 10.1}, 300)
    assert close.chosen(7) == 2
    assert ran.count(1) >= 40 + 40 // 7  # served until every count had all its calls


def test_thread_tuning_off_serves_every_call_at_the_configured_count() -> None:
    me = threading.get_ident()
    tuner = ThreadTuner(4, owner=lambda: me, calls_per_arm=20, block=4, only_configured=True)
    assert set(_serve(tuner, {4: 17.0, 2: 15.0, 1: 13.5}, 200)) == {4}
    assert tuner.chosen(7) is None


def test_the_choice_is_probed_again_after_a_while() -> None:
    clock = _Clock()
    tuner = _tuner(reprobe_s=60.0, clock=clock)
    _serve(tuner, {4: 17.0, 2: 15.0, 1: 13.5}, 400)
    assert tuner.chosen(7) == 1
    clock.now = 61.0
    _serve(tuner, {4: 9.0, 2: 12.0, 1: 20.0}, 400)  # the load changed
    assert tuner.chosen(7) == 4


def test_the_choice_is_made_again_when_the_machines_load_moves() -> None:
    """Seen in the demo: one thread chosen while the search worker held a core stood for the
    rest of the run, after the worker was done and two threads were faster."""
    clock, load = _Clock(), [1.0]
    heard: list[dict[str, Any]] = []
    tuner = _tuner(configured=2, clock=clock, load=lambda: load[0],
                   notify=lambda message, data: heard.append(data))
    _serve(tuner, {2: 18.0, 1: 13.8}, 200)  # the worker busy on a core
    assert tuner.chosen(7) == 1 and tuner.settled(7)
    assert tuner.status()["variants"]["7"]["load_cores"] == 1.0
    clock.now = 20.0
    load[0] = 0.1  # the search is over, but not long enough after the decision to look again
    _serve(tuner, {2: 10.0, 1: 13.8}, 20)
    assert tuner.chosen(7) == 1
    clock.now = 40.0
    load[0] = 0.8  # a small move is not a reason to probe
    _serve(tuner, {2: 10.0, 1: 13.8}, 20)
    assert tuner.chosen(7) == 1
    load[0] = 0.1
    assert not tuner.settled(7)  # decided under another load: not what it would choose now
    _serve(tuner, {2: 10.0, 1: 13.8}, 20, canary=True)  # a canary's arm keeps its count
    assert tuner.chosen(7) == 1
    ran = _serve(tuner, {2: 10.0, 1: 13.8}, 200)
    assert 2 in ran[:20] and tuner.chosen(7) == 2 and tuner.settled(7)
    moved = [d for d in heard if d.get("reprobe")]
    assert len(moved) == 1 and moved[0]["load_cores"] == [1.0, 0.1]
    assert heard[-1]["threads"] == 2 and heard[-1]["load_cores"] == 0.1
    # the other count against the chosen one, with its interval (what the search scales by)
    ratio, low, high = heard[-1]["vs_chosen"]["1"]
    assert 1.0 < low < ratio < high and ratio == pytest.approx(13.8 / 10.0, rel=0.05)


def test_a_decided_count_costs_a_call_little_and_is_still_looked_at() -> None:
    """While a count is decided, calls get the same ``Use`` and the age and load are looked at
    once a second or once in ``STALE_EVERY`` calls (every call had cost 17-20 µs cold)."""
    clock, looks = _Clock(), [0]

    def load() -> float:
        looks[0] += 1
        return 1.0

    tuner = _tuner(configured=2, clock=clock, load=load)
    _serve(tuner, {2: 18.0, 1: 13.8}, 200)
    assert tuner.chosen(7) == 1
    clock.now = 100.0  # past MIN_REPROBE_S: a look reads the load
    looks[0] = 0
    uses: list[Use] = []
    _serve(tuner, {2: 18.0, 1: 13.8}, 64, uses=uses)
    assert all(u is uses[0] for u in uses) and uses[0].threads == 1 and not uses[0].counted
    assert 1 <= looks[0] <= 64 // STALE_EVERY + 1  # the clock stood still: by call count
    looks[0] = 0
    for i in range(10):  # a second apart: every call is looked at
        clock.now = 101.0 + i * STALE_EVERY_S
        tuner.use(7)
    assert looks[0] == 10


def test_a_probe_again_that_cannot_tell_keeps_the_last_choice() -> None:
    """Seen in demo run 17: under 1.5 busy cores an int8 variant measured 11.3 ms at one
    thread and 13.0 at two, not apart with confidence, and went back to the configured two
    it had left. A probe again now keeps the count it had unless another beats it."""
    clock = _Clock()
    heard: list[str] = []
    tuner = _tuner(configured=2, reprobe_s=60.0, clock=clock,
                   notify=lambda message, data: heard.append(message))
    _serve(tuner, {2: 18.0, 1: 13.8}, 200)
    assert tuner.chosen(7) == 1
    clock.now = 61.0
    # as noisy as live calls on a loaded machine: both counts spread over each other
    g = torch.Generator().manual_seed(3)
    for _ in range(400):
        use = tuner.use(7)
        assert use is not None
        base = {2: 13.0, 1: 12.6}[use.threads]
        tuner.record(use, base * float(1 + 0.6 * torch.rand(1, generator=g)))
        if tuner.chosen(7) is not None:
            break
    assert tuner.chosen(7) == 1
    assert "1 kept from the last decision" in heard[-1]
    # a count that is faster with confidence still takes over from it
    clock.now = 200.0
    _serve(tuner, {2: 9.0, 1: 13.8}, 400)
    assert tuner.chosen(7) == 2


def test_the_openmp_runtime_torch_runs_on_is_found_among_several() -> None:
    """scikit-learn ships its own libgomp (seen in CI: picked first, it set nothing torch
    reads, and no count was ever tuned)."""
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) >= 2
    seen: list[int] = []

    def on_a_thread() -> None:
        set_thread_count(3)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=on_a_thread)
    t.start()
    t.join()
    assert seen == [3]


def test_calls_off_the_owner_thread_are_left_alone() -> None:
    tuner = ThreadTuner(4, owner=lambda: None)
    torch.set_num_threads(2)
    assert tuner.use(1) is None
    tuner.record(None, 5.0)
    assert torch.get_num_threads() == 2


class _SlowerWithThreads(nn.Module):
    """A model whose call costs 1.5 ms per intra-op thread: one thread is the fastest."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.0015 * torch.get_num_threads())
        return x + 1


def test_a_served_model_serves_at_the_count_measured_fastest_and_says_so(
    settings: Settings, store: st.Store
) -> None:
    torch.set_num_threads(2)
    served = attach(_SlowerWithThreads(), name="threads", settings=settings, executor=True)
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        base = served.slot.variant_id  # the base module's variant, once registered
        x = torch.zeros(3)
        for _ in range(400):
            assert torch.equal(served(x), x + 1)
            if served.tuner.chosen(base) is not None:
                break
        assert served.tuner.chosen(base) == 1
        assert served.status()["threads"]["variants"][str(base)]["threads"] == 1
        assert torch.get_num_threads() == 2  # the request thread's own setting is untouched
        # and so is every other thread's, one started later too (the swapper keys the
        # worker's artifacts by the count it sees: were it 1, none would load)
        seen: list[int] = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert seen == [2]

        def stored() -> list[Any]:
            with store.session() as s:
                return list(st.repo.list_events(s, served.model_id, kind="threads"))

        events = wait_for(stored, what="the threads event in the store")
        assert "serves at 1 intra-op thread" in events[0].message
        assert events[0].data["threads"] == 1
    finally:
        served.close()


class _SeesItsSamples(_SlowerWithThreads):
    """Notes for each call its thread count and whether the profiler's hook twin ran it (a call
    sampled per layer: the twin is a shallow copy, another object holding the same list)."""

    def __init__(self) -> None:
        super().__init__()
        self.home = id(self)
        self.seen: list[tuple[bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((id(self) != self.home, torch.get_num_threads()))
        return super().forward(x)


def test_a_call_probed_at_another_count_is_not_profiled_per_layer(settings: Settings) -> None:
    """Seen in demo run 39: a twin's first two sampled calls ran while the tuner probed two
    threads under load (10.3 ms live there, 6.2 ms at the one it kept), and the variant's rows
    read 1.31x its live latency. Rows describe the variant at the count it serves at: while
    probing, the incumbent (here the configured 2); once decided, the decision (1)."""
    torch.set_num_threads(2)
    model = _SeesItsSamples()
    served = attach(model, name="probed-rows", settings=settings, executor=True,
                    profiler=ProfilerConfig(sample_every=2, budget=None))
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        base = served.slot.variant_id
        x = torch.zeros(3)
        for _ in range(400):
            served(x)
            if served.tuner.chosen(base) is not None:
                break
        probing = list(model.seen)
        for _ in range(40):
            served(x)
        after = model.seen[len(probing):]
    finally:
        served.close()
    assert served.tuner.chosen(base) == 1
    assert {n for _, n in probing} == {1, 2}  # both counts were served while probing
    assert {n for twin, n in probing if twin} == {2}  # the incumbent's calls only
    assert [n for twin, n in after if twin]  # and once decided, at the decided count
    assert {n for twin, n in after if twin} == {1}


def test_settings_can_turn_thread_tuning_off(settings: Settings) -> None:
    torch.set_num_threads(2)
    served = attach(_SlowerWithThreads(), name="untuned", executor=True,
                    settings=settings.model_copy(update={"thread_tuning": False}))
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        x = torch.zeros(3)
        for _ in range(150):
            assert torch.equal(served(x), x + 1)
        assert served.tuner.candidates == (2,)
        assert served.tuner.chosen(served.slot.variant_id) is None
    finally:
        served.close()


class _Flat(nn.Module):
    """3 ms a call whatever the thread count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)
        return x + 1


def test_a_canary_compares_a_new_arm_at_the_count_measured_for_it(
    settings: Settings, store: st.Store
) -> None:
    """The candidate costs 3 ms at the configured 2 threads, like what serves, and 1.5 ms at
    one. Served at the incumbent's count it measured even and a search deployment was rolled
    back; probed first, the canary compares it at one thread and keeps it, about 2x faster."""
    from pgc_daemon.agent import canary
    from pgc_daemon.agent.slot import Slot
    from pgc_daemon.policy import Policy

    torch.set_num_threads(2)
    served = attach(_Flat(), name="canary-threads", settings=settings, executor=True)
    stop = threading.Event()

    def traffic() -> None:
        x = torch.zeros(3)
        while not stop.is_set():
            served(x)

    client = threading.Thread(target=traffic)
    try:
        wait_for(lambda: served.model_id is not None, what="registration")
        client.start()
        control = served.slot
        wait_for(lambda: served.tuner.chosen(control.variant_id) is not None,
                 what="the incumbent's thread decision")
        assert served.tuner.chosen(control.variant_id) == 2  # no count faster
        candidate = Slot(_SlowerWithThreads(), 991, "faster at one thread", True)
        served.swap(Slot(candidate.module, 991, candidate.label, True, control=control))
        policy = Policy(canary_s=1.0, canary_shadow_samples=4, canary_search_tolerance=0.0)
        result = canary.run(served, candidate, control, policy, threading.Event(),
                            tolerance=canary.tolerance_for("search", policy))
        served.swap(control)
        assert served.tuner.chosen(991) == 1
        assert result.keep, result.reason
        assert result.live["live_speedup"] > 1.6, result.reason
    finally:
        stop.set()
        client.join(10)
        served.close()
