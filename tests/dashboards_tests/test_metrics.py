"""``/metrics`` of a real ``pgc serve`` over real data: ``promtool check metrics`` is clean, the
numbers are the store's, and the Grafana dashboard's queries use only exposed metrics and run
in a real Prometheus that scrapes the server (Debian's ``prometheus`` package brings both)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import store as st
from pgc_daemon.api.metrics import LAYER_TOP_K, WINDOW_S
from profiler import LATENCY_BUCKETS_MS

from .conftest import TOKEN, Served, copy_sqlite, free_port, pgc_serve, wait_ready
from .realdata import RealData

pytestmark = pytest.mark.slow

GRAFANA = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "pgc.json"
RSS = 123_456_789
SLO_MS = 50.0
LEAK_SLOPE = 4096.0


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: apt-get install prometheus (Debian's package has {name})"
    return path


@pytest.fixture(scope="module")
def metrics_store(real_data: RealData, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the real data, plus one process sample of the serving process (what the
    agent's host-statistics writer stores) so the RSS gauge has something to report."""
    url = copy_sqlite(real_data.store_url, tmp_path_factory.mktemp("metrics") / "pgc.db")
    store = st.open_store(url)
    try:
        with store.session() as s:
            model = st.repo.get_model(s, real_data.model)
            st.repo.add_window_stats(s, host=[st.HostStatRow(
                model_id=model.id, variant_id=None, at=time.time(), cpu_percent=150.0,
                rss_bytes=RSS, threads=7, ctx_switches=1000, extra=None,
            )])
            # two leak warnings as the profiler stores them; the newer one is exported
            for slope in (1000.0, LEAK_SLOPE):
                st.repo.add_event(s, model.id, "leak", "RSS grew steadily: a possible leak",
                                  level="warning", data={"variant": real_data.deployed_variant_id,
                                                         "slope_bytes_per_s": slope})
    finally:
        store.close()
    return url


@pytest.fixture(scope="module")
def server(metrics_store: str, tmp_path_factory: pytest.TempPathFactory, real_data: RealData) -> Iterator[Served]:
    with pgc_serve(metrics_store, tmp_path_factory.mktemp("metrics-serve"), token=TOKEN, poll_s=3600.0) as served:
        # an SLO to draw: set through the API (the daemon polls rarely: no new search starts)
        r = httpx.put(f"{served.url}/api/models/{real_data.model}/policy", headers=served.headers(),
                      json={**_policy(served, real_data.model), "latency_target_ms": SLO_MS})
        assert r.status_code == 200, r.text
        yield served


def _policy(served: Served, model: str) -> dict[str, Any]:
    p = httpx.get(f"{served.url}/api/models/{model}/policy").json()
    return {k: v for k, v in p.items() if k not in ("version", "updated_at")}


@pytest.fixture(scope="module")
def metrics_text(server: Served) -> str:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def samples(text: str) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_promtool_check_metrics_is_clean(metrics_text: str) -> None:
    run = subprocess.run([tool("promtool"), "check", "metrics"], input=metrics_text, check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "" and run.stderr.strip() == "", run.stdout + run.stderr


def test_metrics_are_the_stores_numbers(metrics_text: str, metrics_store: str, real_data: RealData) -> None:
    fams = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    by_name = samples(metrics_text)
    store = st.open_store(metrics_store)
    try:
        with store.session() as s:
            model = st.repo.get_model(s, real_data.model)
            variants = {v.id: v for v in st.repo.list_variants(s, model.id)}
            windows = st.repo.request_windows(s, model.id)
            trials = st.repo.list_trials(s, model.id)
            deps = st.repo.list_deployments(s, model.id)
            ever = [{t.to_state for t in d.transitions} for d in deps]  # every state each reached
            layers = st.repo.layer_profile(s, model.id, variant_id=min(variants))
            leaks = st.repo.count_events(s, model.id, "leak")
    finally:
        store.close()

    # a real histogram per model and variant, from the stored fixed buckets
    assert fams["pgc_request_duration_seconds"].type == "histogram"
    for vid in {w.variant_id for w in windows}:
        label = variants[vid].label if vid is not None else "unregistered"
        labels = {"model": real_data.model, "variant_id": "" if vid is None else str(vid), "variant": label}
        buckets = [x for x in by_name["pgc_request_duration_seconds_bucket"] if all(x.labels[k] == v for k, v in labels.items())]
        assert [float(b.labels["le"]) for b in buckets] == [b / 1000 for b in LATENCY_BUCKETS_MS] + [float("inf")]
        assert [b.value for b in buckets] == sorted(b.value for b in buckets)  # cumulative
        count = next(x.value for x in by_name["pgc_request_duration_seconds_count"] if x.labels == labels)
        assert count == buckets[-1].value == sum(w.count for w in windows if w.variant_id == vid and w.histogram)
        total = next(x.value for x in by_name["pgc_requests_total"] if x.labels == labels)
        assert total == sum(w.count for w in windows if w.variant_id == vid)

    # per-layer latency: the hottest layers only (bounded cardinality)
    layer_names = {x.labels["layer"] for x in by_name["pgc_layer_latency_seconds"]}
    assert layer_names == {r["layer"] for r in layers[:LAYER_TOP_K]}
    assert {x.labels["statistic"] for x in by_name["pgc_layer_latency_seconds"]} == {"mean", "p50", "p95", "p99"}
    assert next(x.value for x in by_name["pgc_layers_profiled"]) == len(layers)

    # overhead is a gauge of the last WINDOW_S: present while traffic is, absent after
    recent = [w for w in windows if w.window_end >= time.time() - WINDOW_S + 5]
    if recent:
        assert 0 <= next(x.value for x in by_name["pgc_profiler_overhead_ratio"]) < 1
    elif not any(w.window_end >= time.time() - WINDOW_S - 5 for w in windows):
        assert "pgc_profiler_overhead_ratio" not in by_name
    assert next(x.value for x in by_name["pgc_profiler_dropped_samples_total"]) == sum(w.dropped for w in windows)
    assert sum(x.value for x in by_name["pgc_trials_total"]) == len(trials)

    outcomes = {x.labels["outcome"]: x.value for x in by_name["pgc_deployments_total"]}
    # counted from each deployment's stored transitions: attach, the search's deployment(s)
    # (it may deploy a first winner while it searches, then a better one), the rollback and
    # the redeployment all became active; exactly the one rollback asked for ended so
    assert outcomes == {
        "deployed": float(sum("active" in e for e in ever)),
        "rolled_back": float(sum("rolled_back" in e for e in ever)),
        "failed": float(sum("failed" in e for e in ever)),
    }
    assert outcomes["deployed"] >= 4 and outcomes["rolled_back"] == 1 and outcomes["failed"] == 0
    swaps = [d.swap_ms for d in deps if d.swap_ms is not None]
    assert next(x.value for x in by_name["pgc_swap_duration_seconds_count"]) == len(swaps) > 0
    assert next(x.value for x in by_name["pgc_swap_duration_seconds_sum"]) == pytest.approx(sum(swaps) / 1000)
    builds = [d.build_s for d in deps if d.build_s is not None]
    assert next(x.value for x in by_name["pgc_build_duration_seconds_count"]) == len(builds) > 0
    assert next(x.value for x in by_name["pgc_serving_process_resident_memory_bytes"]) == RSS
    assert next(x.value for x in by_name["pgc_serving_process_cpu_ratio"]) == 1.5
    assert next(x.value for x in by_name["pgc_leak_warnings_total"]) == leaks >= 2
    (growth,) = by_name["pgc_leak_growth_bytes_per_second"]
    assert growth.value == LEAK_SLOPE and growth.labels["variant_id"] == str(real_data.deployed_variant_id)
    assert next(x.value for x in by_name["pgc_policy_latency_target_seconds"]) == SLO_MS / 1000
    active = by_name["pgc_active_variant_info"]
    assert len(active) == 1 and active[0].labels["variant_id"] == str(real_data.deployed_variant_id)
    assert next(x.value for x in by_name["pgc_store_up"]) == 1


def grafana_queries() -> list[str]:
    dash = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if a.get("expr")]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def test_grafana_dashboard_uses_only_metrics_that_are_exposed(metrics_text: str) -> None:
    dash = json.loads(GRAFANA.read_text())
    assert dash["title"] and dash["uid"] and dash["panels"]
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    exposed = {f.name + sfx for f in text_string_to_metric_families(metrics_text) for sfx in suffixes[f.type]}
    assert set(samples(metrics_text)) <= exposed
    used = {name for e in grafana_queries() for name in re.findall(r"\b(pgc_[a-z0-9_]+)\b", e)}
    assert used, "the dashboard queries pgc's metrics"
    assert used <= exposed, f"not exposed by /metrics: {sorted(used - exposed)}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("slo", "overhead", "deployments"):
        assert topic in titles


def _promql(expr: str) -> str:
    return expr.replace("$model", ".*").replace("$__rate_interval", "30s")


def test_grafana_queries_run_in_prometheus_scraping_pgc_serve(server: Served, tmp_path: Path) -> None:
    port = free_port()
    target = server.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: pgc\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    prometheus = tool("prometheus")  # before the log is opened: a missing tool leaks no file
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally, with the process
    proc = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}/api/v1"
    wait_ready("prometheus", f"http://127.0.0.1:{port}/-/ready", proc, tmp_path / "prometheus.log", timeout=90)

    def query(expr: str) -> dict[str, Any]:
        return httpx.get(f"{base}/query", params={"query": expr}, timeout=10).json()

    try:
        deadline = time.monotonic() + 90
        while True:  # a few scrapes, so rate() over 30 s has points
            try:
                r = query('count_over_time(pgc_store_up{job="pgc"}[1m])')
                if r["status"] == "success" and r["data"]["result"] and float(r["data"]["result"][0]["value"][1]) >= 4:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus scraped nothing in 90 s"
            time.sleep(0.5)
        empty = []
        for expr in grafana_queries():
            if expr.startswith("label_values("):
                metric = expr.removeprefix("label_values(").split(",")[0]
                r = query(metric)
            else:
                r = query(_promql(expr))
            assert r["status"] == "success", (expr, r)
            if not r["data"]["result"]:
                empty.append(expr)
        # every query over metrics that have samples returns data; the annotations look for a
        # deployment in the last 2 minutes (offline data has none), and a gauge with nothing
        # to report (overhead once the traffic is 5 minutes old, the best speedup of a search
        # that found nothing faster) has no samples in /metrics either
        present = set(samples(httpx.get(f"{server.url}/metrics").text))
        for expr in empty:
            names = set(re.findall(r"\b(pgc_[a-z0-9_]+)\b", expr))
            assert expr.startswith("changes(") or not names & present, expr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
