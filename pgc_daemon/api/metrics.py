"""Prometheus ``/metrics``: read from the store at scrape time by one custom collector, so
every number matches what the API and the dashboard show, whichever process wrote it.

Units are base units (seconds, bytes, ratios); label cardinality is bounded: per model, one
series per variant the model served (the search's budget bounds those), the ``top_k``
hottest layers only, and fixed outcome, state and percentile values.

A scrape computes every family once per ``TTL_S`` (1 s), shared by concurrent scrapes.

Counters count rows of the store (requests, trials, deployments that reached an outcome):
they only grow, except when the retention policy prunes statistics older than
``PGC_RETENTION_H``, which Prometheus's ``rate()`` reads as a counter reset.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, get_args

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from sqlalchemy.orm import Session

import store as st
from pgc_daemon import states
from pgc_daemon.api.cache import TTL_S, TickCache
from pgc_daemon.policy import load_policy
from pgc_daemon.services.queries import baseline_variant, latency_summary
from pgc_daemon.services.timeline import Outcome, deployment_outcomes
from pgc_daemon.states import D
from store import RUN_OPEN
from profiler import LATENCY_BUCKETS_MS

WINDOW_S = 300.0
"""Gauges of recent behaviour (latency percentiles, profiler overhead) cover this long."""
LAYER_TOP_K = 10
"""Per-layer series exported per model: the hottest layers of the fp32 base's profile."""
HOST_STATS_S = 3600.0
"""Process statistics older than this are not reported (the serving process is gone)."""
SWAP_BUCKETS_S = (1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)
BUILD_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PERCENTILES = ("p50", "p95", "p99")
MS = 1e-3


def _buckets(values: Sequence[float], bounds: Sequence[float]) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets of ``values`` (upper bounds inclusive, as ``le`` says)."""
    out = [(floatToGoString(b), float(sum(v <= b for v in values))) for b in bounds]
    out.append(("+Inf", float(len(values))))
    return out


class _Families:
    """Every family this collector exposes, created empty so each is present (with its HELP
    and TYPE) on every scrape, even before a model registers."""

    def __init__(self, window_s: float, top_k: int) -> None:
        w = int(window_s)
        mv = ["model", "variant_id", "variant"]
        self.request_duration = HistogramMetricFamily(
            "pgc_request_duration_seconds",
            "End-to-end latency of requests served through pgc, by model and variant "
            "(fixed buckets, summed over every stored statistics window)",
            labels=mv,
        )
        self.requests = CounterMetricFamily(
            "pgc_requests", "Requests served through pgc, by model and variant", labels=mv
        )
        self.request_errors = CounterMetricFamily(
            "pgc_request_errors", "Requests that raised in the user's own module", labels=mv
        )
        self.fallbacks = CounterMetricFamily(
            "pgc_fallbacks",
            "Requests a pgc variant failed and the user's base module served again",
            labels=["model"],
        )
        self.recent_latency = GaugeMetricFamily(
            "pgc_request_latency_recent_seconds",
            f"Request latency percentiles over the last {w} s, by model and variant "
            "(from the profiler's per-window samples)",
            labels=[*mv, "percentile"],
        )
        self.live_latency = GaugeMetricFamily(
            "pgc_live_latency_seconds",
            "Live latency of the fp32 base (role=baseline) and of what serves now "
            "(role=current), leaving out windows in which pgc searched or built; the "
            "dashboard's numbers",
            labels=["model", "role", "percentile"],
        )
        self.live_speedup = GaugeMetricFamily(
            "pgc_live_speedup_ratio",
            "Live p50 of the fp32 base over live p50 of what serves now",
            labels=["model"],
        )
        self.latency_target = GaugeMetricFamily(
            "pgc_policy_latency_target_seconds",
            "The policy's latency target (the SLO) at its percentile",
            labels=["model", "percentile"],
        )
        self.max_drop = GaugeMetricFamily(
            "pgc_policy_max_accuracy_drop_ratio",
            "The policy's accuracy budget: 1 - fidelity against fp32",
            labels=["model"],
        )
        self.layer_latency = GaugeMetricFamily(
            "pgc_layer_latency_seconds",
            f"Per-layer latency of the fp32 base on sampled live calls, for the {top_k} "
            "hottest layers per model (statistic: mean, p50, p95 or p99)",
            labels=["model", "layer", "op_type", "statistic"],
        )
        self.layer_share = GaugeMetricFamily(
            "pgc_layer_latency_share_ratio",
            f"Share of the summed per-layer time, for the {top_k} hottest layers per model",
            labels=["model", "layer", "op_type"],
        )
        self.layers_profiled = GaugeMetricFamily(
            "pgc_layers_profiled",
            "Layers with per-layer statistics (only the hottest are exported)",
            labels=["model"],
        )
        self.overhead = GaugeMetricFamily(
            "pgc_profiler_overhead_ratio",
            f"Time spent profiling over time spent serving in the last {w} s",
            labels=["model"],
        )
        self.sampled = CounterMetricFamily(
            "pgc_profiler_sampled_requests",
            "Requests profiled per layer (one in PGC_SAMPLE_EVERY)",
            labels=["model"],
        )
        self.dropped = CounterMetricFamily(
            "pgc_profiler_dropped_samples",
            "Profiler samples dropped because the exporter's queue was full",
            labels=["model"],
        )
        self.trials = CounterMetricFamily(
            "pgc_trials", "Search trials by state", labels=["model", "state"]
        )
        self.search_running = GaugeMetricFamily(
            "pgc_search_running", "Whether a search runs for the model (1) or not (0)", labels=["model"]
        )
        self.search_done = GaugeMetricFamily(
            "pgc_search_trials_done", "Trials done by the latest search", labels=["model"]
        )
        self.search_budget = GaugeMetricFamily(
            "pgc_search_trials_budget", "Trial budget of the latest search", labels=["model"]
        )
        self.search_best = GaugeMetricFamily(
            "pgc_search_best_speedup_ratio",
            "Best speedup over fp32 among the latest search's feasible trials so far",
            labels=["model"],
        )
        self.deployments = CounterMetricFamily(
            "pgc_deployments",
            "Deployments by outcome: deployed (became active), rolled_back, failed",
            labels=["model", "outcome"],
        )
        self.in_flight = GaugeMetricFamily(
            "pgc_deployments_in_flight",
            "Deployments waiting or being built, warmed, verified or canaried",
            labels=["model"],
        )
        self.active = GaugeMetricFamily(
            "pgc_active_variant_info",
            "The variant that serves now (value 1)",
            labels=["model", "variant_id", "variant", "source"],
        )
        self.swap = HistogramMetricFamily(
            "pgc_swap_duration_seconds",
            "Time to swap a verified variant into the serving reference, per deployment",
            labels=["model"],
        )
        self.build = HistogramMetricFamily(
            "pgc_build_duration_seconds",
            "Time to build (transform and compile) a variant before deploying it",
            labels=["model"],
        )
        self.warm = HistogramMetricFamily(
            "pgc_warmup_duration_seconds",
            "Time to warm a built variant up before verifying it",
            labels=["model"],
        )
        self.rss = GaugeMetricFamily(
            "pgc_serving_process_resident_memory_bytes",
            "Resident memory of the model server process, latest sample of its agent",
            labels=["model"],
        )
        self.cpu = GaugeMetricFamily(
            "pgc_serving_process_cpu_ratio",
            "CPU use of the model server process in cores (1 = one core busy), latest sample",
            labels=["model"],
        )
        self.threads = GaugeMetricFamily(
            "pgc_serving_process_threads", "Threads of the model server process", labels=["model"]
        )
        self.leak_warnings = CounterMetricFamily(
            "pgc_leak_warnings",
            "Leak warnings: steady RSS growth of the serving process while one variant served",
            labels=["model"],
        )
        self.shape_miss_warnings = CounterMetricFamily(
            "pgc_shape_miss_warnings",
            "Shape-miss warnings: calls the serving compiled variant ran on the fp32 model, "
            "since it was not built for their input shapes (at most one warning a minute)",
            labels=["model"],
        )
        self.leak_growth = GaugeMetricFamily(
            "pgc_leak_growth_bytes_per_second",
            f"RSS growth rate of the latest leak warning, while it is under {int(HOST_STATS_S)} s "
            "old, by the variant that served",
            labels=["model", "variant_id"],
        )
        self.online = GaugeMetricFamily(
            "pgc_model_online",
            "Whether the model's agent reported in the last 120 s (1) or not (0)",
            labels=["model"],
        )

    def all(self) -> list[Metric]:
        return [v for v in vars(self).values() if isinstance(v, Metric)]


class StoreCollector(Collector):
    def __init__(
        self,
        store: st.Store,
        *,
        window_s: float = WINDOW_S,
        top_k: int = LAYER_TOP_K,
        ttl_s: float = TTL_S,
    ) -> None:
        self.store = store
        self.window_s = window_s
        self.top_k = top_k
        self._cache: TickCache[list[Metric]] = TickCache(self._collect, ttl_s)

    def collect(self) -> Iterator[Metric]:
        yield from self._cache.get()

    def _collect(self) -> list[Metric]:
        f = _Families(self.window_s, self.top_k)
        up = GaugeMetricFamily(
            "pgc_store_up", "Whether the store answered this scrape (1) or not (0)", value=1
        )
        try:
            with self.store.session() as s:
                for model in st.repo.list_models(s):
                    self._model(s, model, f)
        except st.StoreError:
            f = _Families(self.window_s, self.top_k)  # nothing half-read
            up = GaugeMetricFamily(
                "pgc_store_up", "Whether the store answered this scrape (1) or not (0)", value=0
            )
        return [up, *f.all()]

    def _model(self, s: Session, model: st.Model, f: _Families) -> None:
        now = time.time()
        recent_since = now - self.window_s
        name = model.name
        variants = {v.id: v for v in st.repo.list_variants(s, model.id)}

        def vlabels(vid: int | None) -> list[str]:
            v = variants.get(vid) if vid is not None else None
            return [name, str(vid) if vid is not None else "", v.label if v else "unregistered"]

        # ---- requests (every stored window read once, its numbers only)
        by_variant: dict[int | None, list[Any]] = {}
        for w in st.repo.request_window_numbers(s, model.id):
            by_variant.setdefault(w.variant_id, []).append(w)
        for vid, windows in sorted(by_variant.items(), key=lambda kv: kv[0] or 0):
            labels = vlabels(vid)
            f.requests.add_metric(labels, sum(w.count for w in windows))
            f.request_errors.add_metric(labels, sum(w.errors for w in windows))
            hist = [w for w in windows if w.histogram]
            if hist:
                counts = [0] * (len(LATENCY_BUCKETS_MS) + 1)
                for w in hist:
                    for i, c in enumerate(w.histogram[: len(counts)]):
                        counts[i] += int(c)
                cum, buckets = 0, []
                for bound, c in zip(LATENCY_BUCKETS_MS, counts):
                    cum += c
                    buckets.append((floatToGoString(bound * MS), float(cum)))
                buckets.append(("+Inf", float(sum(counts))))
                sum_s = sum(w.mean_ms * w.count for w in hist) * MS
                f.request_duration.add_metric(labels, buckets, sum_s)
            if vid is not None:
                recent = st.repo.request_summary(s, model.id, variant_id=vid, since=recent_since)
                if recent is not None:
                    for q in PERCENTILES:
                        f.recent_latency.add_metric([*labels, q], recent[f"{q}_ms"] * MS)
        everything = st.repo.request_summary(s, model.id)
        f.fallbacks.add_metric([name], everything["fallbacks"] if everything else 0)
        f.sampled.add_metric([name], everything["sampled"] if everything else 0)
        f.dropped.add_metric([name], everything["dropped"] if everything else 0)
        recent_all = st.repo.request_summary(s, model.id, since=recent_since)
        if recent_all is not None:
            f.overhead.add_metric([name], recent_all["overhead"])
        live = latency_summary(s, model)
        for role in ("baseline", "current"):
            summ = live[role]
            if summ is not None:
                for q in ("mean", *PERCENTILES):
                    f.live_latency.add_metric([name, role, q], summ[f"{q}_ms"] * MS)
        if live["speedup"] is not None:
            f.live_speedup.add_metric([name], live["speedup"])

        # ---- policy
        policy = load_policy(s, model.id).policy
        f.max_drop.add_metric([name], policy.max_accuracy_drop)
        if policy.latency_target_ms is not None:
            f.latency_target.add_metric([name, policy.latency_percentile], policy.latency_target_ms * MS)

        # ---- layers (fp32 base: compiled variants have no per-layer data)
        base = baseline_variant(s, model.id)
        layers = st.repo.layer_profile(s, model.id, variant_id=base.id) if base else []
        f.layers_profiled.add_metric([name], len(layers))
        for r in layers[: self.top_k]:
            for stat in ("mean", *PERCENTILES):
                f.layer_latency.add_metric([name, r["layer"], r["op_type"], stat], r[f"{stat}_ms"] * MS)
            f.layer_share.add_metric([name, r["layer"], r["op_type"]], r["share"])

        # ---- search
        for state, n in sorted(st.repo.trial_counts(s, model.id).items()):
            f.trials.add_metric([name, state], n)
        runs = st.repo.list_search_runs(s, model.id, limit=1)
        if runs:
            run = runs[0]
            f.search_running.add_metric([name], float(run.state in RUN_OPEN))
            f.search_done.add_metric([name], run.trials_done)
            f.search_budget.add_metric([name], run.trials_budget)
            if run.best_speedup is not None:
                f.search_best.add_metric([name], run.best_speedup)
        else:
            f.search_running.add_metric([name], 0.0)

        # ---- deployments
        deps = st.repo.list_deployments(s, model.id, limit=st.repo.KEEP_DEPLOYMENTS)
        outcomes = dict.fromkeys(get_args(Outcome), 0)
        for d in deps:
            for o in deployment_outcomes(d):
                outcomes[o] += 1
        for o, n in outcomes.items():
            f.deployments.add_metric([name, o], n)
        f.in_flight.add_metric([name], sum(d.state in states.OPEN for d in deps))
        active = next((d for d in deps if d.state == D.ACTIVE), None)
        if active is not None:
            f.active.add_metric([*vlabels(active.variant_id), active.source], 1.0)
        swaps = [d.swap_ms * MS for d in deps if d.swap_ms is not None]
        builds = [d.build_s for d in deps if d.build_s is not None]
        warms = [d.warm_s for d in deps if d.warm_s is not None]
        f.swap.add_metric([name], _buckets(swaps, SWAP_BUCKETS_S), sum(swaps))
        f.build.add_metric([name], _buckets(builds, BUILD_BUCKETS_S), sum(builds))
        f.warm.add_metric([name], _buckets(warms, BUILD_BUCKETS_S), sum(warms))

        # ---- the serving process
        host = st.repo.host_stats(s, model.id, since=now - HOST_STATS_S)
        if host:
            last = host[-1]
            f.rss.add_metric([name], last.rss_bytes)
            f.cpu.add_metric([name], last.cpu_percent / 100.0)
            f.threads.add_metric([name], last.threads)
        f.leak_warnings.add_metric([name], float(st.repo.count_events(s, model.id, "leak")))
        f.shape_miss_warnings.add_metric(
            [name], float(st.repo.count_events(s, model.id, "shape_miss"))
        )
        leaks = st.repo.list_events(s, model.id, kind="leak", limit=1)
        if leaks and leaks[0].at >= now - HOST_STATS_S:
            data = leaks[0].data or {}
            variant = data.get("variant")
            f.leak_growth.add_metric([name, "" if variant is None else str(variant)],
                                     float(data.get("slope_bytes_per_s", 0.0)))
        f.online.add_metric([name], float(now - model.last_seen_at < 120))


def make_registry(store: st.Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry
