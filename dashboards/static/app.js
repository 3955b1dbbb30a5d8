/* pgc dashboard: plain JavaScript over the REST API, charts by ECharts (shipped in vendor/).
 *
 * Everything shown comes from the API of the `pgc serve` that serves this page; the page
 * refreshes every REFRESH_MS while it is open. Text from the API is inserted as text (DOM
 * nodes) or escaped (chart tooltips), never as markup. `window.pgc` exposes the charts and
 * the last data for the browser tests.
 */
"use strict";

const API = new URL("../api/", window.location.href).href;
const params = new URLSearchParams(window.location.search);
const REFRESH_MS = Math.max(500, Number(params.get("refresh") || 3000));
const TOP_LAYERS = 12;
const COLORS = ["#2f6fde", "#1f9d55", "#c2410c", "#7c3aed", "#0891b2", "#be185d", "#65a30d", "#a16207"];
const MARKER_STYLE = {
  deployed: { color: "#1f9d55", text: "deployed" },
  rollback: { color: "#d64545", text: "rollback" },
  rolled_back: { color: "#d64545", text: "rolled back" },
  failed: { color: "#d98b00", text: "failed" },
};

const state = {
  models: [],
  selected: null,
  data: {},
  refreshes: 0,
  policyDirty: false,
  expanded: new Set(),
  timer: null,
};
const charts = {};

// ------------------------------------------------------------------ small helpers

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else if (k === "style") node.setAttribute("style", v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function fmtMs(v) {
  if (v === null || v === undefined) return "–";
  if (v < 1) return v.toFixed(3);
  if (v < 10) return v.toFixed(2);
  return v.toFixed(1);
}
const fmtX = (v) => (v === null || v === undefined ? "–" : `${v.toFixed(2)}×`);
const fmtF = (v) => (v === null || v === undefined ? "–" : v.toFixed(4));
const fmtPct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(2)}%`);

function niceCeil(v) {
  // the next round number (1, 2, 2.5, 5 times a power of ten) at or above v
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v * (1 - 1e-9)) return m * p;
  return 10 * p;
}

function fmtTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  const time = d.toLocaleTimeString([], { hour12: false });
  return d.toDateString() === new Date().toDateString() ? time : `${d.toLocaleDateString()} ${time}`;
}

function ago(t) {
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function badge(text, kind) {
  return el("span", { class: `badge ${kind || text}` }, text);
}

function token() {
  return $("#token").value.trim();
}

async function api(path, options) {
  const opts = Object.assign({ headers: {} }, options || {});
  if (opts.method && opts.method !== "GET") {
    opts.headers["Content-Type"] = "application/json";
    if (token()) opts.headers.Authorization = `Bearer ${token()}`;
  }
  const resp = await fetch(API + path, opts);
  let body = null;
  try {
    body = await resp.json();
  } catch (_) {
    body = null;
  }
  return { ok: resp.ok, status: resp.status, body };
}

async function getJSON(path) {
  const r = await api(path);
  if (!r.ok) throw new Error((r.body && r.body.detail) || `HTTP ${r.status} for ${path}`);
  return r.body;
}

const drawnFrom = {};

function unchanged(id, input) {
  // Redrawing an unchanged chart would close an open tooltip on every refresh.
  const key = JSON.stringify(input);
  if (drawnFrom[id] === key) return true;
  drawnFrom[id] = key;
  return false;
}

function chart(id) {
  if (!charts[id]) {
    charts[id] = echarts.init(document.getElementById(id), null, { renderer: "canvas" });
  }
  return charts[id];
}

// ------------------------------------------------------------------ models list

function renderModels() {
  const tbody = $("#models-table tbody");
  tbody.replaceChildren();
  $("#models-empty").hidden = state.models.length > 0;
  for (const m of state.models) {
    const lat = m.latency || {};
    const search = m.search;
    const row = el(
      "tr",
      {
        class: `clickable${m.name === state.selected ? " selected" : ""}`,
        "data-model": m.name,
        onclick: () => select(m.name),
      },
      el("td", {}, el("b", {}, m.name)),
      el("td", {}, badge(m.online ? "online" : "offline")),
      el("td", {}, m.active ? m.active.label : "–"),
      el("td", { class: "num" }, lat.baseline ? `${fmtMs(lat.baseline.p50_ms)} ms` : "–"),
      el("td", { class: "num" }, lat.current ? `${fmtMs(lat.current.p50_ms)} ms` : "–"),
      el("td", { class: "num" }, fmtX(lat.speedup)),
      el(
        "td",
        {},
        search ? [badge(search.state), ` ${search.trials_done}/${search.trials_budget} trials`] : "no search yet"
      )
    );
    tbody.append(row);
  }
}

function select(name) {
  if (state.selected === name) return;
  state.selected = name;
  state.policyDirty = false;
  state.expanded.clear();
  $("#policy-status").textContent = "";
  window.location.hash = `#/models/${encodeURIComponent(name)}`;
  renderModels();
  refresh();
}

// ------------------------------------------------------------------ cards

function card(k, v, s, cls) {
  return el("div", { class: "card" }, el("div", { class: "k" }, k), el("div", { class: `v ${cls || ""}` }, v), el("div", { class: "s" }, s || ""));
}

// A search deploys each good enough trial while it goes on (not only its final choice).
const WHILE_SEARCHING = "deployed while searching";

function whileSearchingNote(s) {
  const n = (s.deployed_while_searching || []).length;
  return n ? ` · ${n} ${WHILE_SEARCHING}` : "";
}

function renderCards(m, front) {
  const lat = m.latency || {};
  const a = m.active;
  const s = m.search;
  const deployedPoint = front ? front.points.find((p) => p.deployed) : null;
  const fidelity = a && a.expected_fidelity !== null ? a.expected_fidelity : deployedPoint ? deployedPoint.fidelity : null;
  $("#model-name").textContent = m.name;
  $("#model-meta").textContent = [m.spec, m.hardware, m.metric && `metric: ${m.metric}`].filter(Boolean).join(" · ");
  $("#cards").replaceChildren(
    card(
      "serving",
      a ? a.label : "–",
      a ? `${a.source}${a.while_searching ? " · " + WHILE_SEARCHING : ""} · since ${fmtTime(a.since)}` : "no deployment yet",
      "long"
    ),
    card(
      "live p50 now",
      lat.current ? `${fmtMs(lat.current.p50_ms)} ms` : "–",
      lat.baseline ? `fp32 eager: ${fmtMs(lat.baseline.p50_ms)} ms (p95 ${fmtMs(lat.baseline.p95_ms)})` : ""
    ),
    card(
      "live speedup",
      fmtX(lat.speedup),
      lat.quiet ? "same traffic, pgc's busy windows left out" : "includes windows when pgc was busy",
      lat.speedup && lat.speedup > 1 ? "good" : ""
    ),
    card(
      `fidelity (${m.metric || "metric"})`,
      a ? fmtF(a.is_baseline ? 1 : fidelity) : "–",
      a && a.live_fidelity !== null ? `in search; canary shadow check ${fmtF(a.live_fidelity)}` : "in search, against fp32"
    ),
    card(
      "search",
      s ? `${s.trials_done}/${s.trials_budget} trials` : "–",
      s ? `${s.state}${s.best_speedup ? ` · best ${fmtX(s.best_speedup)}` : ""}${whileSearchingNote(s)}` : "no search yet"
    ),
    replicasCard(m.replicas)
  );
}

// Serving processes of the model (workers of a multi-process server, hosts of a fleet).
function replicasCard(r) {
  if (!r) return card("replicas", "–", "");
  const note = r.live
    ? `${r.on_active} on the active variant · ${r.compiles ? `${r.compiles} compiled here` : "none compiled: artifacts loaded"}`
    : "no serving process heard from";
  return card("replicas", String(r.live), note, r.live && r.on_active < r.live ? "warn" : "");
}

// ------------------------------------------------------------------ front

function recipeLines(recipe) {
  // A recipe as a person reads it: one line per layer rule (in increasing priority), then
  // the backend.
  if (!recipe) return [];
  const choice = (c) => (c.precision === "int8" ? `int8 ${c.scheme} ${c.granularity.replace("per_", "per-")}` : c.precision);
  const rules = Object.entries(recipe.quantization || {}).map(([k, c]) => `${k === "_default" ? "every layer" : k}: ${choice(c)}`);
  const b = recipe.backend || { kind: "eager", mode: "default" };
  return [...(rules.length ? rules : ["every layer: fp32"]), `backend: ${b.kind}${b.mode !== "default" ? " " + b.mode : ""}`];
}

function frontTip(p) {
  const flags = [p.feasible ? "feasible" : "infeasible", p.pareto ? "on the Pareto front" : null, p.deployed ? "deployed" : null]
    .filter(Boolean)
    .join(" · ");
  return (
    `<div class="tip"><b>${esc(p.label || "variant " + p.variant_id)}</b><br>` +
    `${esc(flags)}<br>` +
    `speedup ${esc(fmtX(p.speedup))} · latency ${esc(fmtMs(p.latency_ms))} ms vs fp32 ${esc(fmtMs(p.baseline_ms))} ms<br>` +
    `fidelity ${esc(fmtF(p.fidelity))} · accuracy drop ${esc(fmtPct(p.accuracy_drop))}<br>` +
    `trial ${esc(p.number)} of search ${esc(p.run_id)}` +
    `<pre>recipe\n${recipeLines(p.recipe).map(esc).join("\n")}</pre></div>`
  );
}

function yScale(yKind, values, top) {
  // Latencies of a search can span orders of magnitude (a slow fp32 compile next to int8):
  // then a log axis keeps the fast points apart.
  const positive = values.filter((v) => v > 0);
  const low = positive.length ? Math.min(...positive) : 1;
  if (yKind === "latency" && positive.length > 1 && top / low > 8) {
    return { type: "log", logBase: 10, min: Math.pow(10, Math.floor(Math.log10(low))), max: Math.pow(10, Math.ceil(Math.log10(top * 1.05))) };
  }
  return { type: "value", min: 0, max: niceCeil(top * 1.08) };
}

function renderFront(front) {
  const select = $("#front-y");
  if (!select.dataset.touched) {
    // Until the user picks: latency when the policy has a latency target (its line is drawn
    // there), else speedup, the ratio the search measured interleaved with fp32 (steadier
    // than raw milliseconds on a busy machine).
    select.value = front.latency_target_ms !== null ? "latency" : "speedup";
  }
  const yKind = select.value;
  if (unchanged("front-chart", [front, yKind])) return;
  const yOf = (p) => (yKind === "speedup" ? p.speedup : p.latency_ms);
  const drawable = front.points.filter((p) => yOf(p) !== null && p.accuracy_drop !== null);
  const point = (p) => ({ value: [p.accuracy_drop, yOf(p)], point: p });
  const feasible = drawable.filter((p) => p.feasible).map(point);
  const infeasible = drawable.filter((p) => !p.feasible).map(point);
  const pareto = drawable.filter((p) => p.pareto).sort((a, b) => a.accuracy_drop - b.accuracy_drop || yOf(a) - yOf(b));
  const deployed = drawable.filter((p) => p.deployed).map(point);
  const maxX = niceCeil(Math.max(front.max_accuracy_drop * 1.15, ...drawable.map((p) => p.accuracy_drop * 1.1), 0.001));

  const lines = [
    {
      xAxis: front.max_accuracy_drop,
      lineStyle: { color: "#d64545", type: "dashed", width: 1.5 },
      label: { formatter: `accuracy budget ${fmtPct(front.max_accuracy_drop)}`, position: "insideEndTop", color: "#a12a2a" },
    },
  ];
  const baselines = drawable.map((p) => p.baseline_ms).filter((v) => v !== null).sort((a, b) => a - b);
  if (yKind === "latency") {
    if (front.latency_target_ms !== null) {
      lines.push({
        yAxis: front.latency_target_ms,
        lineStyle: { color: "#d98b00", type: "dashed", width: 1.5 },
        label: { formatter: `latency target (${front.latency_percentile}) ${fmtMs(front.latency_target_ms)} ms`, position: "insideEndTop", color: "#8a5a00" },
      });
    }
    if (baselines.length) {
      const median = baselines[Math.floor(baselines.length / 2)];
      lines.push({
        yAxis: median,
        lineStyle: { color: "#98a2b3", type: "dotted" },
        label: { formatter: `fp32 eager ${fmtMs(median)} ms`, position: "insideEndTop", color: "#667085" },
      });
    }
  } else {
    lines.push({
      yAxis: front.min_speedup,
      lineStyle: { color: "#d98b00", type: "dashed", width: 1.5 },
      label: { formatter: `min speedup ${fmtX(front.min_speedup)}`, position: "insideEndTop", color: "#8a5a00" },
    });
    lines.push({
      yAxis: 1,
      lineStyle: { color: "#98a2b3", type: "dotted" },
      label: { formatter: "fp32 eager 1×", position: "insideEndBottom", color: "#667085" },
    });
  }

  // the axis must show the target lines too, not only the points
  const yValues = [...drawable.map(yOf), ...lines.filter((l) => l.yAxis !== undefined).map((l) => l.yAxis)];
  const yTop = yValues.length ? Math.max(...yValues) : 1;

  chart("front-chart").setOption(
    {
      animation: false,
      grid: { left: 64, right: 28, top: 44, bottom: 52 },
      legend: { top: 0, data: ["feasible", "infeasible", "Pareto front", "deployed"] },
      tooltip: {
        trigger: "item",
        confine: true,
        enterable: false,
        formatter: (p) => (p.data && p.data.point ? frontTip(p.data.point) : ""),
      },
      xAxis: {
        type: "value",
        name: `accuracy drop (1 − ${front.metric || "fidelity"})`,
        nameLocation: "middle",
        nameGap: 30,
        min: -0.03 * maxX, // points at 0 stay clear of the axis line
        max: maxX,
        axisLabel: { formatter: (v) => (v < 0 ? "" : `${(100 * v).toFixed(maxX < 0.02 ? 2 : 1)}%`) },
      },
      yAxis: {
        name: yKind === "speedup" ? "speedup over fp32 eager (search)" : "latency in search (ms)",
        ...yScale(yKind, yValues, yTop),
        nameTextStyle: { align: "left" },
      },
      series: [
        {
          name: "Pareto front",
          type: "line",
          data: pareto.map((p) => [p.accuracy_drop, yOf(p)]),
          symbol: "none",
          silent: true,
          lineStyle: { color: "#2f6fde", width: 1.5, type: "dashed", opacity: 0.7 },
          itemStyle: { color: "#2f6fde" },
          z: 1,
        },
        {
          name: "feasible",
          type: "scatter",
          data: feasible,
          symbolSize: (v, p) => (p.data.point.pareto ? 15 : 11),
          itemStyle: { color: "#2f6fde", opacity: 0.9, borderColor: "#fff", borderWidth: 1 },
          z: 3,
        },
        {
          name: "infeasible",
          type: "scatter",
          data: infeasible,
          symbol: "triangle",
          symbolSize: 12,
          itemStyle: { color: "#d64545", opacity: 0.85 },
          z: 3,
        },
        {
          name: "deployed",
          type: "scatter",
          data: deployed,
          symbol: "circle",
          symbolSize: 28,
          itemStyle: { color: "rgba(31,157,85,0.12)", borderColor: "#1f9d55", borderWidth: 3 },
          label: { show: true, position: "right", formatter: "deployed", color: "#146c3b", fontWeight: "bold" },
          z: 4,
        },
        {
          name: "targets",
          type: "scatter",
          data: [],
          silent: true,
          markLine: { symbol: ["none", "none"], silent: true, data: lines },
        },
      ],
    },
    { notMerge: true }
  );

  const notes = [];
  notes.push(
    `${drawable.length} variants timed: ${feasible.length} feasible, ${infeasible.length} infeasible, ` +
      `${pareto.length} on the Pareto front. Hover a point for its recipe.`
  );
  if (front.message) notes.push(`Search: ${front.message.replace(/\.?$/, ".")}`);
  if (front.points.length === 0) {
    const running = state.data.searches && state.data.searches[0] && ["queued", "running"].includes(state.data.searches[0].state);
    notes.push(
      running
        ? "The search is running: variants appear here as their trials are timed."
        : "No timed trial yet: the first search starts once enough live traffic is profiled."
    );
  }
  const noteEl = $("#front-note");
  noteEl.textContent = notes.join(" ");
  noteEl.classList.toggle("warn", front.feasible === 0 && front.points.length > 0);
}

// ------------------------------------------------------------------ layers

function renderLayers(m, baseProfile, activeProfile) {
  const layerInput = [m.active, baseProfile && baseProfile.layers, activeProfile && activeProfile.layers];
  if (unchanged("layers-chart", layerInput)) return;
  const base = baseProfile ? baseProfile.layers.slice(0, TOP_LAYERS) : [];
  const names = base.map((r) => r.layer);
  const active = m.active;
  // A compiled variant has a row per (layer, kernel): its kernels' time split over the layers
  // they fuse. Added up per layer; its own hot rows (the wrapper's) join the axis.
  const byName = {};
  for (const r of (activeProfile && activeProfile.layers) || []) {
    const had = byName[r.layer];
    byName[r.layer] = had
      ? { ...had, mean_ms: had.mean_ms + r.mean_ms, p95_ms: had.p95_ms + r.p95_ms, share: had.share + r.share,
          op_type: `${had.op_type}; ${r.op_type}` }
      : { ...r };
  }
  for (const r of Object.values(byName).sort((a, b) => b.mean_ms - a.mean_ms).slice(0, 3)) {
    if (!names.includes(r.layer)) names.push(r.layer);
  }
  const series = [
    {
      name: "fp32 eager (base)",
      type: "bar",
      data: names.map((n) => {
        const r = base.find((b) => b.layer === n);
        return r ? { value: r.mean_ms, row: r } : { value: null };
      }),
      itemStyle: { color: "#98a2b3" },
      barMaxWidth: 14,
    },
  ];
  let note = "";
  if (!active || active.is_baseline) {
    note = "The fp32 base serves: these are its live per-layer timings (mean over sampled calls).";
  } else if (activeProfile && activeProfile.layers.length) {
    series.push({
      name: `active: ${active.label}`,
      type: "bar",
      data: names.map((n) => (byName[n] ? { value: byName[n].mean_ms, row: byName[n] } : { value: null })),
      itemStyle: { color: "#2f6fde" },
      barMaxWidth: 14,
    });
    const compiled = activeProfile.layers.some((r) => r.layer === "(between kernels)");
    note = compiled
      ? `Mean per-layer latency of the active variant (${active.label}) next to the fp32 base: its kernels, ` +
        "timed on sampled calls and split over the layers each was generated from (the tooltip names " +
        "the kernels and what they fuse); “(between kernels)” is the compiled wrapper's own time."
      : `Mean per-layer latency of the active variant (${active.label}) next to the fp32 base.`;
  } else if (active.recipe && active.recipe.backend && active.recipe.backend.kind !== "eager") {
    note =
      `The active variant (${active.label}) is compiled by ${active.recipe.backend.kind} and has no per-layer ` +
      "numbers yet: its kernels are timed on sampled calls of its profiling twin (the same AOTInductor " +
      "package with kernel events, built by the search worker for the variant it chose), and none was " +
      "sampled so far. It is measured end to end: see Live latency. The bars show the fp32 base, whose hot layers " +
      "guided the search.";
  } else {
    note = `No per-layer samples of the active variant (${active.label}) yet; the bars show the fp32 base.`;
  }
  if (!base.length) note = "No per-layer samples yet: pgc times layers on one call in PGC_SAMPLE_EVERY.";
  $("#layers-note").textContent = note;
  chart("layers-chart").setOption(
    {
      animation: false,
      grid: { left: 8, right: 36, top: 36, bottom: 30, containLabel: true },
      legend: { top: 0 },
      tooltip: {
        trigger: "axis",
        axisPointer: { type: "shadow" },
        confine: true,
        formatter: (items) => {
          const lines = items
            .filter((i) => i.data && i.data.row)
            .map((i) => {
              const r = i.data.row;
              return `${esc(i.seriesName)}: mean ${esc(fmtMs(r.mean_ms))} ms · p95 ${esc(fmtMs(r.p95_ms))} ms · ${esc(fmtPct(r.share))} of layer time · ${esc(r.op_type)}`;
            });
          const r0 = items[0] && items[0].data && items[0].data.row;
          const head = `<b>${esc(items[0] ? items[0].name : "")}</b>`;
          const sug = r0 && r0.suggestion ? `<br><i>${esc(r0.suggestion)}</i>` : "";
          return `<div class="tip">${head}<br>${lines.join("<br>")}${sug}</div>`;
        },
      },
      xAxis: { type: "value", name: "ms", axisLabel: { formatter: (v) => fmtMs(v) } },
      yAxis: {
        type: "category",
        data: names,
        inverse: true,
        axisLabel: { fontSize: 11, formatter: (n) => (n.length > 38 ? `…${n.slice(-37)}` : n) },
      },
      series,
    },
    { notMerge: true }
  );
}

// ------------------------------------------------------------------ timeline

function renderTimeline(tl) {
  const q = $("#timeline-q").value;
  const series = [];
  tl.series.forEach((s, i) => {
    // a gap (the variant did not serve) breaks the line; gaps are judged against the
    // series' usual spacing, since statistics windows may be longer than a step
    const spacing = s.points.slice(1).map((p, j) => p.t - s.points[j].t).sort((a, b) => a - b);
    const usual = spacing.length ? spacing[Math.floor(spacing.length / 2)] : tl.step_s;
    const gap = Math.max(3 * tl.step_s, 2.5 * usual);
    const data = [];
    let last = null;
    for (const p of s.points) {
      if (last !== null && p.t - last > gap) data.push([(last + usual) * 1000, null]);
      data.push([p.t * 1000, p[`${q}_ms`]]);
      last = p.t;
    }
    const color = s.is_baseline || s.variant_id === null ? "#667085" : COLORS[i % COLORS.length];
    series.push({
      name: s.label,
      type: "line",
      data,
      showSymbol: data.length < 60,
      symbolSize: 4,
      connectNulls: false,
      lineStyle: { width: s.is_baseline ? 1.5 : 2, color, type: s.variant_id === null ? "dotted" : "solid" },
      itemStyle: { color },
    });
  });
  const markLines = tl.markers.map((mk) => {
    const style = MARKER_STYLE[mk.kind];
    const text = mk.source === "attach" ? "attached" : style.text;
    return {
      xAxis: mk.at * 1000,
      marker: mk,
      lineStyle: { color: style.color, type: "solid", width: 1.5 },
      label: { formatter: text, position: "insideEndTop", color: style.color, fontSize: 11 },
    };
  });
  if (tl.latency_target_ms !== null) {
    markLines.push({
      yAxis: tl.latency_target_ms,
      lineStyle: { color: "#d98b00", type: "dashed", width: 1.5 },
      label: { formatter: `SLO ${tl.latency_percentile} ${fmtMs(tl.latency_target_ms)} ms`, position: "insideEndTop", color: "#8a5a00" },
    });
  }
  series.push({
    name: "markers",
    type: "line",
    data: [],
    silent: false,
    markLine: {
      symbol: ["none", "none"],
      data: markLines,
      tooltip: {
        formatter: (p) => {
          const mk = p.data && p.data.marker;
          if (!mk) return esc(p.name || "");
          return `<div class="tip"><b>${esc(MARKER_STYLE[mk.kind].text)}: ${esc(mk.label || "")}</b><br>${esc(fmtTime(mk.at))} · deployment ${esc(mk.deployment_id)} (${esc(mk.source)}${mk.while_searching ? ", " + esc(WHILE_SEARCHING) : ""})<br>${esc(mk.reason || "")}</div>`;
        },
      },
    },
    markArea: {
      silent: true,
      itemStyle: { color: "rgba(152,162,179,0.14)" },
      label: { show: false },
      data: tl.busy.map((b) => [{ xAxis: b.start * 1000, name: "pgc busy" }, { xAxis: b.end * 1000 }]),
    },
  });
  // Calls before the agent registered (a cold start) can be ten times slower than anything
  // after; they stay in the data but may run off the top of the chart.
  const registered = tl.series.filter((s) => s.variant_id !== null).flatMap((s) => s.points.map((p) => p[`${q}_ms`]));
  const targetMs = tl.latency_target_ms !== null ? [tl.latency_target_ms] : [];
  const yMax = registered.length ? niceCeil(Math.max(...registered, ...targetMs) * 1.05) : undefined;
  const c = chart("timeline-chart");
  const prev = c.getOption && c.getOption();
  const zoom = prev && prev.dataZoom && prev.dataZoom[0] ? { start: prev.dataZoom[0].start, end: prev.dataZoom[0].end } : { start: 0, end: 100 };
  c.setOption(
    {
      animation: false,
      grid: { left: 56, right: 28, top: 44, bottom: 40 },
      dataZoom: [{ type: "inside", xAxisIndex: 0, filterMode: "none", ...zoom }],
      legend: { top: 0, data: tl.series.map((s) => s.label) },
      tooltip: {
        trigger: "axis",
        confine: true,
        valueFormatter: (v) => (v === null || v === undefined ? "–" : `${fmtMs(v)} ms`),
      },
      xAxis: { type: "time", min: tl.since * 1000, max: tl.until * 1000 },
      yAxis: { type: "value", name: `${q} latency (ms)`, nameTextStyle: { align: "left" }, min: 0, max: yMax },
      series,
    },
    { notMerge: true }
  );
  const counts = {};
  for (const mk of tl.markers) counts[mk.kind] = (counts[mk.kind] || 0) + 1;
  const summary = Object.entries(counts).map(([k, n]) => `${n} ${MARKER_STYLE[k].text}`).join(", ");
  $("#timeline-note").textContent =
    `Live ${q} per variant in steps of ${tl.step_s < 60 ? tl.step_s.toFixed(1) + " s" : (tl.step_s / 60).toFixed(1) + " min"}` +
    (summary ? `; markers: ${summary}` : "") +
    (tl.busy.length ? ". Grey: pgc was searching or building." : ".") +
    " During a canary both variants serve alternate calls.";
}

// ------------------------------------------------------------------ search

function renderSearch(searches, trials) {
  const box = $("#search");
  box.replaceChildren();
  if (!searches.length) {
    box.append(el("p", { class: "note" }, "No search yet. pgc searches once it has profiled enough live traffic, or when you press “search now”."));
    return;
  }
  const s = searches[0];
  const pct = s.trials_budget ? Math.min(100, (100 * s.trials_done) / s.trials_budget) : 0;
  const parts = [
    el("div", { class: "search-line" }, el("span", {}, badge(s.state), ` search ${s.run_id}`), el("span", {}, `${s.trials_done} / ${s.trials_budget} trials`)),
    el("div", { class: "progress", role: "progressbar", "aria-valuenow": s.trials_done, "aria-valuemax": s.trials_budget }, el("div", { style: `width:${pct}%` })),
    el(
      "div",
      { class: "search-line" },
      el("span", {}, `best so far: ${fmtX(s.best_speedup)}`),
      el("span", {}, `fidelity ${fmtF(s.best_fidelity)}`)
    ),
    el("p", { class: "search-msg" }, s.message || s.trigger),
    (s.deployed_while_searching || []).length
      ? el(
          "p",
          { class: "note while-searching" },
          el("span", { class: "badge searching" }, WHILE_SEARCHING),
          ` deployment${s.deployed_while_searching.length > 1 ? "s" : ""} ${s.deployed_while_searching.join(", ")} (good trials go out before the search ends)`
        )
      : null,
    el(
      "p",
      { class: "note" },
      `started ${fmtTime(s.started_at)}`,
      s.finished_at ? ` · took ${Math.round(s.finished_at - s.started_at)} s` : ` · running for ${Math.round(Date.now() / 1000 - s.started_at)} s`,
      " · Optuna study ",
      el("code", {}, s.study_name)
    ),
  ];
  box.append(...parts.filter(Boolean));
  if (trials && trials.length) {
    const rows = trials
      .slice(-6)
      .reverse()
      .map((t) =>
        el(
          "tr",
          { title: t.message || "" },
          el("td", {}, t.number),
          el("td", { class: "trial-label" }, t.label || "–"),
          el("td", {}, badge(t.state === "complete" && !t.feasible ? "infeasible" : t.state, t.state === "complete" && t.feasible ? "done" : t.state)),
          el("td", { class: "num" }, fmtX(t.speedup)),
          el("td", { class: "num" }, fmtPct(t.accuracy_drop))
        )
      );
    box.append(
      el("h4", {}, "trials of this search"),
      el(
        "table",
        { class: "table runs" },
        el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "variant"), el("th", {}, "state"), el("th", { class: "num" }, "speedup"), el("th", { class: "num" }, "drop"))),
        el("tbody", {}, rows)
      )
    );
  }
  if (searches.length > 1) {
    box.append(el("h4", {}, "earlier searches"));
    const rows = searches.slice(1, 6).map((r) =>
      el("tr", {}, el("td", {}, r.run_id), el("td", {}, badge(r.state)), el("td", { class: "num" }, `${r.trials_done}/${r.trials_budget}`), el("td", { class: "num" }, fmtX(r.best_speedup)), el("td", {}, fmtTime(r.started_at)))
    );
    box.append(
      el(
        "table",
        { class: "table runs" },
        el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "state"), el("th", { class: "num" }, "trials"), el("th", { class: "num" }, "best"), el("th", {}, "started"))),
        el("tbody", {}, rows)
      )
    );
  }
}

async function optimizeNow() {
  if (!state.selected) return;
  const r = await api(`models/${encodeURIComponent(state.selected)}/optimize`, { method: "POST", body: "{}" });
  const msg = r.ok ? `search ${r.body.run_id} started` : authHint(r);
  $("#search").prepend(el("p", { class: `note ${r.ok ? "" : "warn"}` }, msg));
  if (r.ok) refresh();
}

function authHint(r) {
  const detail = (r.body && r.body.detail) || `HTTP ${r.status}`;
  if (r.status === 401) return `${detail}. Enter the token at the top right.`;
  return detail;
}

// ------------------------------------------------------------------ deployments, events

function renderDeployments(deps) {
  const tbody = $("#deployments-table tbody");
  tbody.replaceChildren();
  if (!deps.length) {
    tbody.append(el("tr", {}, el("td", { colspan: 10, class: "note" }, "No deployment yet.")));
    return;
  }
  for (const d of deps) {
    const open = state.expanded.has(d.id);
    tbody.append(
      el(
        "tr",
        {
          class: "clickable",
          "data-deployment": d.id,
          title: "click for every transition",
          onclick: () => {
            if (state.expanded.has(d.id)) state.expanded.delete(d.id);
            else state.expanded.add(d.id);
            renderDeployments(deps);
          },
        },
        el("td", {}, d.id),
        el("td", {}, fmtTime(d.created_at)),
        el("td", {}, d.label || "–"),
        el(
          "td",
          {},
          d.while_searching
            ? [d.source, " ", el("span", { class: "badge searching", title: `proposed by search run ${d.search_run_id} before it ended` }, WHILE_SEARCHING)]
            : d.source
        ),
        el("td", {}, badge(d.state)),
        el("td", { class: "num" }, fmtX(d.expected_speedup)),
        el("td", { class: "num" }, fmtX(d.live_speedup)),
        el("td", { class: "num" }, d.build_s === null ? "–" : d.build_s.toFixed(1)),
        el("td", { class: "num" }, d.swap_ms === null ? "–" : d.swap_ms.toFixed(3)),
        el("td", { class: "reason" }, d.reason || "")
      )
    );
    if (open) {
      tbody.append(
        el(
          "tr",
          { class: "transitions" },
          el(
            "td",
            { colspan: 10 },
            el("ol", {}, d.transitions.map((t) => el("li", {}, `${fmtTime(t.at)} `, el("b", {}, t.to_state), t.reason ? ` — ${t.reason}` : "")))
          )
        )
      );
    }
  }
}

function renderEvents(events) {
  const ul = $("#events");
  ul.replaceChildren();
  if (!events.length) ul.append(el("li", { class: "note" }, "Nothing yet."));
  for (const e of events) {
    ul.append(el("li", { class: e.level }, el("span", { class: "when" }, fmtTime(e.at)), el("span", { class: "kind" }, e.kind), e.message));
  }
}

// ------------------------------------------------------------------ policy form

const FLOAT_FIELDS = ["max_accuracy_drop", "latency_target_ms", "time_budget_s", "min_speedup", "canary_s", "canary_latency_tolerance", "canary_search_tolerance"];
const INT_FIELDS = ["max_trials", "canary_shadow_samples"];

function fillPolicy(p) {
  const f = $("#policy-form");
  for (const k of [...FLOAT_FIELDS, ...INT_FIELDS]) f.elements[k].value = p[k] === null ? "" : p[k];
  f.elements.latency_percentile.value = p.latency_percentile;
  f.elements.objective.value = p.objective;
  f.elements.auto_deploy.checked = p.auto_deploy;
  f.elements.backends.value = p.backends ? p.backends.join(", ") : "";
  f.dataset.version = p.version;
  setDirty(false);
}

function setDirty(dirty) {
  state.policyDirty = dirty;
  $("#policy-form").classList.toggle("dirty", dirty);
}

function readPolicy() {
  const f = $("#policy-form");
  const body = {};
  for (const k of FLOAT_FIELDS) {
    const raw = f.elements[k].value.trim();
    if (raw === "") {
      if (k === "latency_target_ms") body[k] = null;
      continue;
    }
    body[k] = Number(raw);
  }
  for (const k of INT_FIELDS) {
    const raw = f.elements[k].value.trim();
    if (raw !== "") body[k] = Number(raw);
  }
  body.latency_percentile = f.elements.latency_percentile.value;
  body.objective = f.elements.objective.value;
  body.auto_deploy = f.elements.auto_deploy.checked;
  const backends = f.elements.backends.value.split(",").map((b) => b.trim()).filter(Boolean);
  body.backends = backends.length ? backends : null;
  return body;
}

async function savePolicy(ev) {
  ev.preventDefault();
  if (!state.selected) return;
  const status = $("#policy-status");
  const btn = $("#policy-form button[type=submit]");
  btn.disabled = true;
  try {
    const r = await api(`models/${encodeURIComponent(state.selected)}/policy`, { method: "PUT", body: JSON.stringify(readPolicy()) });
    if (r.ok) {
      fillPolicy(r.body);
      status.className = "note ok";
      status.textContent = `Saved: policy version ${r.body.version}. A new policy starts a new search.`;
      refresh();
    } else {
      status.className = "note error";
      status.textContent = `Not saved (${r.status}): ${authHint(r)}`;
    }
  } finally {
    btn.disabled = false;
  }
}

// ------------------------------------------------------------------ refresh loop

async function refreshModel(name) {
  const m = encodeURIComponent(name);
  const range = Number($("#timeline-range").value);
  const since = range ? Date.now() / 1000 - range : 0;
  const model = state.models.find((x) => x.name === name);
  const activeId = model && model.active && !model.active.is_baseline ? model.active.variant_id : null;
  const runId = model && model.search ? model.search.run_id : null;
  const [front, baseProfile, activeProfile, timeline, deployments, searches, events, policy, trials] = await Promise.all([
    getJSON(`models/${m}/front`),
    getJSON(`models/${m}/profile`),
    activeId ? getJSON(`models/${m}/profile?variant_id=${activeId}`) : Promise.resolve(null),
    getJSON(`models/${m}/timeline?since=${since.toFixed(3)}&points=240`),
    getJSON(`models/${m}/deployments`),
    getJSON(`models/${m}/searches`),
    getJSON(`models/${m}/events?limit=30`),
    state.policyDirty ? Promise.resolve(null) : getJSON(`models/${m}/policy`),
    runId ? getJSON(`models/${m}/trials?run_id=${runId}`) : Promise.resolve([]),
  ]);
  if (state.selected !== name) return; // the user picked another model meanwhile
  Object.assign(state.data, { model, front, baseProfile, activeProfile, timeline, deployments, searches, events, trials });
  $("#model-view").hidden = false;
  renderCards(model, front);
  renderFront(front);
  renderLayers(model, baseProfile, activeProfile);
  renderTimeline(timeline);
  renderSearch(searches, trials);
  renderDeployments(deployments);
  renderEvents(events);
  if (policy && !state.policyDirty) {
    if (!state.data.policy) $("#timeline-q").value = policy.latency_percentile;
    state.data.policy = policy;
    fillPolicy(policy);
  }
}

async function refresh() {
  clearTimeout(state.timer);
  const status = $("#status");
  try {
    state.models = await getJSON("models");
    if (!state.selected || !state.models.some((m) => m.name === state.selected)) {
      const fromHash = decodeURIComponent((window.location.hash.match(/^#\/models\/(.+)$/) || [])[1] || "");
      const pick = state.models.find((m) => m.name === fromHash) || state.models[0];
      state.selected = pick ? pick.name : null;
    }
    renderModels();
    if (state.selected) await refreshModel(state.selected);
    else $("#model-view").hidden = true;
    state.refreshes += 1;
    document.body.dataset.refreshes = String(state.refreshes);
    status.className = "status";
    status.textContent = `updated ${new Date().toLocaleTimeString([], { hour12: false })} · every ${REFRESH_MS / 1000} s`;
  } catch (err) {
    status.className = "status error";
    status.textContent = `cannot reach the API (${err.message}); retrying`;
  } finally {
    state.timer = setTimeout(refresh, REFRESH_MS);
  }
}

function init() {
  const tok = $("#token");
  tok.value = window.localStorage.getItem("pgc.token") || "";
  tok.addEventListener("change", () => window.localStorage.setItem("pgc.token", token()));
  const form = $("#policy-form");
  form.addEventListener("input", () => setDirty(true));
  form.addEventListener("submit", savePolicy);
  $("#policy-reset").addEventListener("click", () => {
    setDirty(false);
    $("#policy-status").textContent = "";
    refresh();
  });
  $("#optimize").addEventListener("click", optimizeNow);
  $("#front-y").addEventListener("change", () => ($("#front-y").dataset.touched = "1"));
  for (const id of ["#front-y", "#timeline-q", "#timeline-range"]) $(id).addEventListener("change", refresh);
  window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));
  window.addEventListener("hashchange", () => {
    const name = decodeURIComponent((window.location.hash.match(/^#\/models\/(.+)$/) || [])[1] || "");
    if (name && name !== state.selected) select(name);
  });
  refresh();
}

window.pgc = { state, charts, refresh };
init();
