"""Prometheus ``/metrics``: read from the store at scrape time by one custom collector, so
every number matches what the API and the dashboard show."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

import store as st

WINDOW_S = 300.0


class StoreCollector(Collector):
    def __init__(self, store: st.Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        since = time.time() - WINDOW_S
        lat = GaugeMetricFamily(
            "pgc_request_latency_ms",
            f"Live request latency over the last {int(WINDOW_S)} s, by model, variant and quantile",
            labels=["model", "variant", "quantile"],
        )
        reqs = CounterMetricFamily(
            "pgc_requests", "Requests served through pgc", labels=["model", "variant"]
        )
        fallbacks = CounterMetricFamily(
            "pgc_fallbacks", "Requests a variant failed and the base module served", labels=["model"]
        )
        overhead = GaugeMetricFamily(
            "pgc_profiler_overhead_ratio",
            f"Profiler time over serving time in the last {int(WINDOW_S)} s",
            labels=["model"],
        )
        trials = CounterMetricFamily("pgc_trials", "Search trials by state", labels=["model", "state"])
        deployments = CounterMetricFamily(
            "pgc_deployments", "Deployments by final state", labels=["model", "state"]
        )
        with self.store.session() as s:
            for model in st.repo.list_models(s):
                variants = {v.id: v.label for v in st.repo.list_variants(s, model.id)}
                windows = st.repo.request_windows(s, model.id, since=since)
                for vid in sorted({w.variant_id for w in windows}, key=lambda v: v or 0):
                    summ = st.repo.request_summary(s, model.id, since=since, variant_id=vid)
                    if summ is None:
                        continue
                    label = variants.get(vid, "unregistered") if vid else "unregistered"
                    for q in ("p50", "p95", "p99"):
                        lat.add_metric([model.name, label, q], summ[f"{q}_ms"])
                for vid in variants:
                    total = st.repo.request_summary(s, model.id, variant_id=vid)
                    if total is not None:
                        reqs.add_metric([model.name, variants[vid]], total["count"])
                allsum = st.repo.request_summary(s, model.id)
                fallbacks.add_metric([model.name], allsum["fallbacks"] if allsum else 0)
                recent = st.repo.request_summary(s, model.id, since=since)
                overhead.add_metric([model.name], recent["overhead"] if recent else 0.0)
                counts: dict[str, int] = {}
                for t in st.repo.list_trials(s, model.id):
                    counts[t.state] = counts.get(t.state, 0) + 1
                for state, n in counts.items():
                    trials.add_metric([model.name, state], n)
                dcounts: dict[str, int] = {}
                for d in st.repo.list_deployments(s, model.id, limit=10_000):
                    dcounts[d.state] = dcounts.get(d.state, 0) + 1
                for state, n in dcounts.items():
                    deployments.add_metric([model.name, state], n)
        yield from (lat, reqs, fallbacks, overhead, trials, deployments)


def make_registry(store: st.Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry
