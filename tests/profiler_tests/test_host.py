"""Host statistics (real psutil), the RSS trend per variant and the leak warning — from a real
growing allocation through the agent, the store and the API's events endpoint."""

from __future__ import annotations

import mmap

import time
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

import store as st
from pgc_daemon import attach
from pgc_daemon.api import create_app
from pgc_daemon.settings import Settings
from profiler import HostSampler, LeakDetector, ProfilerConfig

MIB = 1024 * 1024


def _feed(det: LeakDetector, rss: list[float], *, step: float = 1.0, variant: int = 1,
          quiet: bool = True) -> list[Any]:
    return [w for i, r in enumerate(rss) if (w := det.add(variant, i * step, int(r), quiet=quiet))]


def test_steady_growth_across_the_window_is_a_leak() -> None:
    det = LeakDetector(window_s=10, min_growth_bytes=8 * MIB)
    rss = [500 * MIB + i * 2 * MIB for i in range(12)]  # +2 MiB/s for 11 s
    warnings = _feed(det, rss)
    assert len(warnings) == 1  # once per window, not on every sample
    w = warnings[0]
    assert w.growth_bytes == pytest.approx(20 * MIB, rel=0.05)
    assert w.slope_bytes_per_s == pytest.approx(2 * MIB, rel=0.01)
    assert w.r2 > 0.99 and "possible leak" in w.message()


@pytest.mark.parametrize("shape", ["flat", "one_step", "noise", "too_small", "too_short"])
def test_what_is_not_a_leak(shape: str) -> None:
    det = LeakDetector(window_s=10, min_growth_bytes=8 * MIB)
    rng = np.random.default_rng(0)
    base = 500 * MIB
    rss = {
        "flat": [base] * 30,
        # a cache filling once (warm-up): a step, then flat
        "one_step": [base] * 5 + [base + 100 * MIB] * 25,
        "noise": list(base + rng.normal(0, 30 * MIB, 30)),
        "too_small": [base + i * 0.2 * MIB for i in range(30)],
        "too_short": [base + i * 10 * MIB for i in range(6)],  # 5 s < the 10 s window
    }[shape]
    assert _feed(det, rss) == []


def test_pgcs_own_work_and_a_swap_restart_the_trend() -> None:
    det = LeakDetector(window_s=10, min_growth_bytes=8 * MIB)
    grow = [500 * MIB + i * 2 * MIB for i in range(12)]
    # growth while pgc builds a candidate in the process is not the variant's leak
    assert _feed(det, grow, quiet=False) == []
    # a swap mid-way: each variant's series is too short on its own
    for i, r in enumerate(grow):
        assert det.add(1 if i < 6 else 2, i, int(r)) is None
    assert det.trend(2) == pytest.approx(2 * MIB, rel=0.01)


def test_host_sampler_reads_this_process() -> None:
    sampler = HostSampler()
    row, warning = sampler.sample(variant=7)
    assert warning is None and row.variant == 7
    assert row.rss_bytes > 10 * MIB and row.threads >= 1
    assert row.ctx_switches == row.extra["ctx_voluntary"] + row.extra["ctx_involuntary"]


def test_a_real_growing_allocation_raises_a_leak_warning_and_a_flat_one_does_not() -> None:
    sampler = HostSampler(leak=LeakDetector(window_s=1.0, min_growth_bytes=24 * MIB))
    held: list[mmap.mmap] = []
    warnings = []
    deadline = time.monotonic() + 1.6
    # +4 MiB every 50 ms, fresh pages written so they are resident: mapped directly, since
    # malloc may serve an array from heap that earlier tests freed (RSS would not grow)
    while time.monotonic() < deadline:
        block = mmap.mmap(-1, 4 * MIB)
        block.write(b"\x01" * (4 * MIB))
        held.append(block)
        _, w = sampler.sample(variant=1)
        if w is not None:
            warnings.append(w)
        time.sleep(0.05)
    assert warnings, "80 MiB of steady growth in 1.6 s went unnoticed"
    assert warnings[0].growth_bytes >= 24 * MIB and warnings[0].variant == 1
    for block in held:
        block.close()
    held.clear()
    flat = HostSampler(leak=LeakDetector(window_s=1.0, min_growth_bytes=24 * MIB))
    quiet = []
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:
        _, w = flat.sample(variant=1)
        quiet.append(w)
        time.sleep(0.05)
    assert not any(quiet)


class Leaky(torch.nn.Module):
    """A served model that keeps a reference to every output: a real leak."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.kept: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.kept.append(torch.ones(512 * 1024))  # 2 MiB per call, written: resident
        return out


@pytest.mark.timeout(120)
def test_leak_host_stats_counters_and_overhead_reach_the_store_and_the_api(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'pgc.db'}"
    settings = Settings(store_url=url, window_s=0.3, poll_s=0.1, sample_every=2)
    config = ProfilerConfig(sample_every=2, window_s=0.3, host_interval_s=0.05, leak_window_s=1.0,
                            leak_min_growth_mb=16, budget=None)
    model = Leaky().eval()
    served = attach(model, name="leaky", settings=settings, profiler=config)
    try:
        deadline = time.monotonic() + 30
        while served.model_id is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.model_id is not None
        x = torch.ones(4, 64)
        store = st.open_store(url)
        # ~40 MiB/s of steady growth for 1.8 s, then on until the warning is in the store (at
        # most 15 s: a slow machine takes fewer host samples a second; seen in CI)
        end, give_up = time.monotonic() + 1.8, time.monotonic() + 15
        while True:
            served(x)
            time.sleep(0.05)
            if time.monotonic() < end:
                continue
            served.flush()
            with store.session() as s:
                if st.repo.list_events(s, served.model_id, kind="leak") or time.monotonic() > give_up:
                    break
            end = time.monotonic() + 0.5
        served.flush()
        with store.session() as s:
            host = st.repo.host_stats(s, served.model_id)
            events = st.repo.list_events(s, served.model_id, kind="leak")
            summary = st.repo.request_summary(s, served.model_id)
            counters = st.repo.layer_counters(s, served.model_id)
        assert len(host) >= 10 and host[-1].rss_bytes > host[0].rss_bytes
        registered = [h for h in host if h.variant_id is not None]  # after registration
        assert len(registered) >= 10
        assert all(h.variant_id == served.baseline_variant_id for h in registered)
        # the trend restarts after each leak warning, so not every row carries a slope
        assert any("rss_slope_bytes_per_s" in (h.extra or {}) for h in registered)
        assert events and events[0].level == "warning" and "possible leak" in events[0].message
        assert events[0].data["growth_bytes"] >= 16 * MIB
        assert summary is not None and summary["overhead"] > 0 and summary["sampled"] > 0
        from profiler import counter_availability

        if counter_availability().mode != "off":  # software counters on this VM
            assert set(counter_availability().events) <= set(counters["lin"])
        client = TestClient(create_app(settings, store=store), base_url="http://127.0.0.1")
        api_events = client.get("/api/models/leaky/events").json()
        assert any(e["kind"] == "leak" and e["level"] == "warning" for e in api_events)
        model_json = client.get("/api/models/leaky").json()
        assert model_json["latency"]["baseline"]["overhead"] > 0
        store.close()
    finally:
        served.close()
