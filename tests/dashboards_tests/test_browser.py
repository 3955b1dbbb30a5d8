"""The dashboard in a real browser: Playwright drives Debian's Chromium against a real
``pgc serve`` subprocess over a store of real data (the digits MLP searched, deployed,
rolled back and deployed again), and checks what the charts drew against the API."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import TOKEN, Served, copy_sqlite, pgc_serve
from .realdata import RealData

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]

# What each chart drew, read from ECharts' own model: a data item counts when the chart made
# a graphic element for it.
DRAWN = """
() => {
  const drawn = (chart, name) => {
    const series = chart.getModel().getSeriesByName(name)[0];
    if (!series) return null;
    const data = series.getData();
    let n = 0;
    for (let i = 0; i < data.count(); i++) if (data.getItemGraphicEl(i)) n++;
    return n;
  };
  const c = window.pgc.charts;
  const frontLines = c["front-chart"].getOption().series.find((s) => s.name === "targets").markLine.data;
  const tl = c["timeline-chart"].getOption().series;
  const layers = c["layers-chart"].getOption().series;
  return {
    feasible: drawn(c["front-chart"], "feasible"),
    infeasible: drawn(c["front-chart"], "infeasible"),
    deployed: drawn(c["front-chart"], "deployed"),
    deployedIds: c["front-chart"].getOption().series.find((s) => s.name === "deployed").data.map((d) => d.point.variant_id),
    budget: frontLines.filter((l) => l.xAxis !== undefined).map((l) => l.xAxis),
    layerBars: drawn(c["layers-chart"], layers[0].name),
    layerSeries: layers.length,
    activeLayerBars: layers.length > 1 ? drawn(c["layers-chart"], layers[1].name) : 0,
    layerNames: c["layers-chart"].getOption().yAxis[0].data,
    timelineSeries: tl.filter((s) => s.name !== "markers").map((s) => s.name),
    timelineMarkers: tl.find((s) => s.name === "markers").markLine.data.filter((d) => d.marker).length,
  };
}
"""


@pytest.fixture(scope="module")
def server(real_data: RealData, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # A copy: the policy test starts a new search, which would change the data other tests read.
    root = tmp_path_factory.mktemp("browser")
    store_url = copy_sqlite(real_data.store_url, root / "pgc.db")
    shutil.copy(real_data.optuna_url.removeprefix("sqlite:///"), root / "pgc.optuna.db")
    with pgc_serve(store_url, root, token=TOKEN, poll_s=1.0) as served:
        yield served


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1500, "height": 1800})
    page = context.new_page()
    page.problems = []  # console errors and warnings, uncaught exceptions, failed requests
    page.on("console", lambda m: page.problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: page.problems.append(f"request failed: {r.url}"))
    yield page
    context.close()


def wait_refreshes(page: Any, n: int) -> None:
    page.wait_for_function(f"Number(document.body.dataset.refreshes || 0) >= {n}", timeout=30_000)


def api(served: Served, path: str) -> Any:
    r = httpx.get(f"{served.url}/api/{path}", timeout=10)
    r.raise_for_status()
    return r.json()


def test_the_charts_draw_what_the_api_says(server: Served, page: Any, real_data: RealData, artifacts: Path, tmp_path: Path) -> None:
    m = real_data.model
    page.goto(f"{server.url}/?refresh=1000")
    assert page.url.endswith("/ui/?refresh=1000")  # / redirects to the dashboard
    wait_refreshes(page, 2)

    front = api(server, f"models/{m}/front")
    # the y axis: latency when the policy has a latency target, else speedup
    y = page.input_value("#front-y")
    assert y == ("latency" if front["latency_target_ms"] is not None else "speedup")
    y_key = "latency_ms" if y == "latency" else "speedup"
    drawable = [p for p in front["points"] if p[y_key] is not None and p["accuracy_drop"] is not None]
    assert drawable, "the search timed variants"
    drawn = page.evaluate(DRAWN)
    assert drawn["feasible"] == sum(p["feasible"] for p in drawable)
    assert drawn["infeasible"] == sum(not p["feasible"] for p in drawable)
    assert drawn["feasible"] + drawn["infeasible"] == len(front["points"])
    assert drawn["deployed"] == 1 and drawn["deployedIds"] == [real_data.deployed_variant_id]
    assert drawn["budget"] == [front["max_accuracy_drop"]]

    # per-layer: the fp32 base's hottest layers, and beside them the active variant's: for an
    # AOTInductor package its kernels (timed on its profiling twin) split over the layers they
    # fuse, with the wrapper's row; a variant that runs outside torch (ONNX Runtime), or a
    # package without a twin, has none, and the note says so
    profile = api(server, f"models/{m}/profile")
    assert drawn["layerBars"] == min(12, len(profile["layers"])) > 0
    backend = api(server, f"models/{m}")["active"]["recipe"]["backend"]["kind"]
    active = profile["active"]
    if backend == "inductor" and real_data.profile_twin:  # sampled calls ran its twin
        assert active is not None and active["variant_id"] == real_data.deployed_variant_id
        assert drawn["layerSeries"] == 2 and drawn["activeLayerBars"] > 0
        per_layer: dict[str, float] = {}
        for r in active["layers"]:  # one row per (layer, kernel): added up per layer, as drawn
            per_layer[r["layer"]] = per_layer.get(r["layer"], 0.0) + r["mean_ms"]
        assert max(per_layer, key=per_layer.get) in drawn["layerNames"]
        assert "(between kernels)" in per_layer
        assert "split over the layers" in page.inner_text("#layers-note")
    elif backend == "eager":  # hooks see an eager variant's layers
        assert active is not None and drawn["layerSeries"] == 2 and drawn["activeLayerBars"] > 0
        assert all(r["layer"] != "(between kernels)" for r in active["layers"])
    else:
        assert active is None and drawn["layerSeries"] == 1
        assert "no per-layer numbers" in page.inner_text("#layers-note")

    # the timeline: one series per variant that served, a marker per deployment event
    timeline = api(server, f"models/{m}/timeline")
    assert sorted(drawn["timelineSeries"]) == sorted(s["label"] for s in timeline["series"])
    kinds = [mk["kind"] for mk in timeline["markers"]]
    assert drawn["timelineMarkers"] == len(kinds)
    assert {"deployed", "rolled_back", "rollback"} <= set(kinds)

    # tables
    models = api(server, "models")
    assert page.locator("#models-table tbody tr").count() == len(models)
    deployments = api(server, f"models/{m}/deployments")
    assert page.locator("#deployments-table tbody tr").count() == len(deployments)
    # deployments a search made while it was still searching say so
    searching = sum(d["while_searching"] for d in deployments)
    assert page.locator("#deployments-table .badge.searching").count() == searching
    page.locator("#deployments-table tbody tr").first.click()
    assert "active" in page.inner_text("#deployments-table .transitions")
    searches = api(server, f"models/{m}/searches")
    assert f"{searches[0]['trials_done']} / {searches[0]['trials_budget']} trials" in page.inner_text("#search")

    # hovering the deployed point shows its recipe
    box = page.locator("#front-chart").bounding_box()
    deployed = next(p for p in drawable if p["deployed"])
    x, y = page.evaluate(
        "(v) => window.pgc.charts['front-chart'].convertToPixel({seriesName: 'deployed'}, v)",
        [deployed["accuracy_drop"], deployed[y_key]],
    )
    page.mouse.move(box["x"] + x, box["y"] + y)
    tip = page.locator("#front-chart .tip")
    tip.wait_for(state="visible", timeout=5_000)
    text = tip.inner_text()
    assert deployed["label"] in text and "recipe" in text and "backend: " in text and "deployed" in text

    page.mouse.move(1, 1)
    shot = page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    (artifacts / "dashboard-test.png").write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 50_000
    assert page.problems == []


def test_the_policy_form_changes_the_policy_through_the_api(server: Served, page: Any, real_data: RealData, artifacts: Path) -> None:
    m = real_data.model
    before = api(server, f"models/{m}/policy")
    runs_before = len(api(server, f"models/{m}/searches"))
    page.goto(f"{server.url}/ui/?refresh=1000#/models/{m}")
    wait_refreshes(page, 1)
    assert page.input_value("#policy-form [name=max_accuracy_drop]") == str(before["max_accuracy_drop"])

    # without the token the server refuses, and the page says why
    page.fill("#policy-form [name=max_accuracy_drop]", "0.03")
    page.fill("#policy-form [name=latency_target_ms]", "50")
    page.click("#policy-form button[type=submit]")
    page.wait_for_selector("#policy-status.error")
    assert "401" in page.inner_text("#policy-status") and "token" in page.inner_text("#policy-status")
    assert api(server, f"models/{m}/policy")["version"] == before["version"]
    # (a 401 answer is a failed resource load to Chromium's console; nothing else may be)
    page.problems[:] = [p for p in page.problems if "401" not in p]

    # with it, the policy changes and the page shows the new version
    page.fill("#token", TOKEN)
    # the form shows the backends the policy names (the real-data store names PyTorch's)
    assert page.input_value("#policy-form [name=backends]") == ", ".join(before["backends"])
    page.fill("#policy-form [name=backends]", "inductor, onnxruntime")
    page.click("#policy-form button[type=submit]")
    page.wait_for_selector("#policy-status.ok")
    after = api(server, f"models/{m}/policy")
    assert after["max_accuracy_drop"] == 0.03 and after["latency_target_ms"] == 50
    assert after["backends"] == ["inductor", "onnxruntime"]
    assert page.input_value("#policy-form [name=backends]") == "inductor, onnxruntime"
    assert after["version"] == before["version"] + 1
    assert f"version {after['version']}" in page.inner_text("#policy-status")

    # it refreshes while you watch: the budget line moves, and the new policy's search shows up
    page.wait_for_function(
        "() => window.pgc.charts['front-chart'].getOption().series.find((s) => s.name === 'targets')"
        ".markLine.data.some((l) => l.xAxis === 0.03)",
        timeout=15_000,
    )
    page.wait_for_function(
        f"() => window.pgc.state.data.searches && window.pgc.state.data.searches.length > {runs_before}",
        timeout=60_000,
    )
    assert len(api(server, f"models/{m}/searches")) > runs_before
    (artifacts / "dashboard-policy-test.png").write_bytes(page.screenshot(full_page=True))
    assert page.problems == []
