"""The demo's clients and its measurements of them: a load that follows the machine, client
threads sending real sentences at that rate, and the live speedup as an A/B at one time."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from pgc_daemon.agent.canary import MIN_CANARY_CALLS, at_their_threads
from pgc_daemon.agent.livecompare import LiveComparison
from pgc_daemon.agent.livecompare import compare as compare_live

log = logging.getLogger("pgc.demo")

#: After the search, fp32 and the deployed variant serve the demo's traffic side by side
#: this long.
AB_S = 20.0
#: The demo's default load keeps fp32 serving this busy (one request at a time) ...
LOAD_SHARE = 0.5
#: ... at most this many requests per second.
MAX_RATE = 20.0


def load_rate(fp32_ms: float) -> float:
    """Requests per second that keep a server of fp32 calls of ``fp32_ms`` ``LOAD_SHARE``
    busy. A fixed rate saturates a slower machine: requests queue, the niced search worker
    gets no CPU and nothing deploys in the demo's time (seen on a 2-core VM whose fp32 call
    went from 28 to 33 ms: fp32 then served at 82 ms p50 and the first trial took 216 s)."""
    return min(MAX_RATE, LOAD_SHARE * 1000.0 / max(fp32_ms, 1e-3))


def fp32_latency_ms(model: Any, calls: int = 8) -> float:
    """Median latency of ``model`` on the demo's requests, after two warm-up calls."""
    import statistics

    import torch

    from pgc_daemon.examples import minilm

    stream = minilm.traffic(seed=99)
    times = []
    with torch.inference_mode():
        for i in range(calls + 2):
            ids, mask = next(stream)
            t0 = time.perf_counter()
            model(ids, mask)
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


class Traffic:
    """Client threads sending requests at a total rate, like a real server's load."""

    def __init__(self, served: Any, rate: float, clients: int) -> None:
        self.served = served
        self.rate = rate
        self.clients = clients
        self.stop = threading.Event()
        self.sent = 0
        self.failed = 0
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name=f"demo-client-{i}", daemon=True)
            for i in range(clients)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        from pgc_daemon.examples import minilm

        stream = minilm.traffic(seed=100 + i)
        interval = self.clients / self.rate
        next_at = time.monotonic()
        while not self.stop.is_set():
            ids, mask = next(stream)
            try:
                self.served(ids, mask)
                self.sent += 1
            except Exception:  # noqa: BLE001 - the demo counts failures, it does not hide them
                self.failed += 1
                log.exception("request failed")
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            else:
                next_at = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


def live_ab(served: Any, seconds: float = AB_S) -> LiveComparison | None:
    """The live speedup measured at one time: fp32 beside the variant that serves, on the
    demo's own traffic, in the canary's alternating blocks, then the variant alone again (no
    deployment; the store is not told). A ratio of fp32's first windows to the variant's last
    ones measures the shared machine's drift as much as the variant: seen on a 2-core VM,
    fp32 47.8 ms early and int8 19.6 ms late (2.43x) while the canary, interleaved, said
    3.13x. None when no variant serves, or too few calls came in."""
    slot = served.slot
    if slot.control is not None or slot.module is served.base:
        return None
    base = served.base_slot(slot.deployment_id)
    live = served.live
    ab = dataclasses.replace(slot, control=base)
    served.swap(ab)
    try:
        # as in the canary: compared once both serve at their measured thread counts
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not at_their_threads(served, slot, base):
            time.sleep(0.05)
        live.latency_ms[base.variant_id].clear()
        live.latency_ms[slot.variant_id].clear()
        time.sleep(seconds)
    finally:
        if served.slot is ab:  # unless the agent swapped in something else meanwhile
            served.swap(slot)
    variant = list(live.latency_ms[slot.variant_id])
    fp32 = list(live.latency_ms[base.variant_id])
    if min(len(variant), len(fp32)) < MIN_CANARY_CALLS:
        return None
    return compare_live(variant, fp32)
