// tokengate status page: polls admin/status every 2 s and renders it. Plain JS, no library,
// no network access beyond the admin listener. Every value from the gateway is inserted as
// text (never as HTML): model names and request ids come from clients.
"use strict";

const POLL_MS = 2000;
const WINDOW_MS = 15 * 60 * 1000;
const HIT_WINDOW_MS = 30 * 1000;
const COLORS = { blue: "#2f6fed", green: "#12a172", amber: "#d98a04", red: "#d93f3f", violet: "#7c4dd8", teal: "#0f9bb0", slate: "#667085" };
const SVG_NS = "http://www.w3.org/2000/svg";

let updates = 0;
let lastOk = 0;
let lastData = null;

// ---- small helpers -------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("data-")) el.setAttribute(k, v);
    else if (k === "title") el.title = v;
    else if (k === "style") el.setAttribute("style", v);
    else el.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function s(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  return el;
}

const nf0 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const nf1 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });
const nf2 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 2 });

function fmtInt(v) { return v === null || v === undefined ? "–" : nf0.format(v); }
function fmtNum(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return nf1.format(v / 1e9) + "G";
  if (a >= 1e6) return nf1.format(v / 1e6) + "M";
  if (a >= 1e3) return nf1.format(v / 1e3) + "k";
  if (a >= 100) return nf0.format(v);
  if (a >= 10) return nf1.format(v);
  return nf2.format(v);
}
function fmtMs(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  if (v >= 10000) return nf1.format(v / 1000) + " s";
  if (v >= 1000) return nf2.format(v / 1000) + " s";
  if (v >= 10) return nf0.format(v) + " ms";
  return nf1.format(v) + " ms";
}
// The nearest-rank quantile of `values` (null when empty).
function quantile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.max(0, Math.ceil(q * sorted.length) - 1)];
}
function fmtPct(v) { return v === null || v === undefined || !isFinite(v) ? "–" : nf1.format(v * 100) + "%"; }
function fmtBytes(v) {
  if (v === null || v === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i === 0 ? nf0.format(v) : nf1.format(v)) + " " + u[i];
}
function fmtDuration(ms) {
  const sec = Math.floor(ms / 1000);
  const d = Math.floor(sec / 86400), hh = Math.floor(sec % 86400 / 3600), mm = Math.floor(sec % 3600 / 60), ss = sec % 60;
  if (d > 0) return `${d}d ${hh}h`;
  if (hh > 0) return `${hh}h ${mm}m`;
  if (mm > 0) return `${mm}m ${ss}s`;
  return `${ss}s`;
}
function fmtAgo(ms) { return ms < 1500 ? "just now" : fmtDuration(ms) + " ago"; }
function clock(wallMs) {
  const d = new Date(wallMs);
  return d.toLocaleTimeString("en-GB", { hour12: false });
}

function setKpi(name, value, unit, sub, level) {
  const el = document.querySelector(`[data-kpi="${name}"]`);
  if (!el) return;
  const v = el.querySelector(".value");
  v.replaceChildren(document.createTextNode(value));
  if (unit) v.append(h("small", {}, unit));
  el.querySelector(".sub").textContent = sub;
  el.classList.toggle("warn", level === "warn");
  el.classList.toggle("bad", level === "bad");
}

// ---- charts (inline SVG) ---------------------------------------------------------------------

// series: [{name, color, dash, area, points: [[t, y|null], ...]}]; t in the gateway's ms.
function lineChart(svg, series, opts) {
  const w = Math.max(200, svg.clientWidth || svg.getBoundingClientRect().width || 400);
  const ht = Math.max(60, svg.clientHeight || 120);
  const pad = { l: 40, r: 6, t: 6, b: 18 };
  svg.setAttribute("viewBox", `0 0 ${w} ${ht}`);
  svg.replaceChildren();
  const x1 = opts.now, x0 = Math.min(x1 - 2 * 60 * 1000, Math.max(x1 - WINDOW_MS, opts.start));
  let ymax = opts.yMax || 0;
  for (const se of series) for (const [, y] of se.points) if (y !== null && y > ymax) ymax = y;
  const empty = ymax === 0 && !opts.yMax;
  if (ymax <= 0) ymax = 1;
  if (!(opts.yMax && ymax <= opts.yMax)) ymax = niceCeil(ymax * 1.08);
  const X = t => pad.l + (t - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = y => pad.t + (1 - y / ymax) * (ht - pad.t - pad.b);
  for (let i = 0; i <= 3; i++) {
    const y = ymax * i / 3;
    svg.append(s("line", { class: "grid", x1: pad.l, x2: w - pad.r, y1: Y(y), y2: Y(y) }));
    const lbl = s("text", { class: "axis", x: pad.l - 6, y: Y(y) + 3.5, "text-anchor": "end" });
    lbl.textContent = opts.yFmt(y);
    svg.append(lbl);
  }
  const span = x1 - x0;
  const step = span > 10 * 60 * 1000 ? 5 * 60 * 1000 : span > 4 * 60 * 1000 ? 2 * 60 * 1000 : 60 * 1000;
  for (let t = x1; t >= x0; t -= step) {
    const lbl = s("text", { class: "axis", x: X(t), y: ht - 4, "text-anchor": t === x1 ? "end" : "middle" });
    lbl.textContent = t === x1 ? "now" : `-${Math.round((x1 - t) / 60000)}m`;
    svg.append(lbl);
  }
  let drawn = 0;
  for (const se of series) {
    const pts = se.points.filter(([t]) => t >= x0);
    let d = "", pen = false, area = "", segStart = null, lastX = null;
    const lone = []; // points with no neighbour to draw a line to: drawn as dots
    for (let k = 0; k < pts.length; k++) {
      const [t, y] = pts[k];
      if (y === null || y === undefined || !isFinite(y)) {
        if (se.area && segStart !== null) area += `L${lastX},${Y(0)}L${segStart},${Y(0)}Z`;
        pen = false; segStart = null;
        continue;
      }
      const next = pts[k + 1];
      if (!pen && !(next && next[1] !== null && next[1] !== undefined && isFinite(next[1]))) lone.push([X(t), Y(y)]);
      const px = X(t).toFixed(1), py = Y(y).toFixed(1);
      d += (pen ? "L" : "M") + px + "," + py;
      if (se.area) { area += (segStart === null ? "M" : "L") + px + "," + py; if (segStart === null) segStart = px; }
      lastX = px; pen = true; drawn++;
    }
    if (se.area && segStart !== null) area += `L${lastX},${Y(0)}L${segStart},${Y(0)}Z`;
    if (se.area && area) svg.append(s("path", { class: "area", d: area, fill: se.color }));
    if (d) {
      const p = s("path", { class: "line", d, stroke: se.color, "data-series": se.name });
      if (se.dash) p.setAttribute("stroke-dasharray", se.dash);
      svg.append(p);
    }
    for (const [cx, cy] of lone) svg.append(s("circle", { cx: cx.toFixed(1), cy: cy.toFixed(1), r: 2.5, fill: se.color }));
  }
  svg.dataset.points = String(drawn);
  if (drawn === 0 || empty) {
    const t = s("text", { class: "empty", x: (pad.l + w) / 2, y: ht / 2, "text-anchor": "middle" });
    t.textContent = opts.emptyText || "no traffic yet";
    svg.append(t);
  }
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function legend(id, items) {
  const el = document.getElementById(id);
  el.replaceChildren(...items.map(([name, color, dash]) =>
    h("span", { style: `color:${color}` }, h("i", { class: dash ? "dash" : "", style: dash ? "" : `background:${color}` }), h("span", { style: "color:var(--muted)" }, name))));
}

// ---- rendering -------------------------------------------------------------------------------

function render(d) {
  const hist = d.history || [];
  const ivs = (d.interval_ms || 5000) / 1000;
  const last = hist.length ? hist[hist.length - 1] : null;
  const wallOffset = Date.now() - d.now_ms; // gateway ms -> wall clock ms
  const start = hist.length ? hist[0].t : d.now_ms;

  document.getElementById("version").textContent = "v" + d.version;
  document.getElementById("uptime").textContent = fmtDuration(d.uptime_ms);
  // Several replicas sharing state on Redis: "cluster: ok" or "cluster: degraded".
  const cl = d.cluster;
  document.getElementById("cluster").hidden = !cl || cl.state === "off";
  if (cl && cl.state !== "off") {
    const el = document.getElementById("cluster-state");
    el.textContent = cl.summary;
    el.title = `replica ${cl.replica}; Redis calls ${fmtInt(cl.redis_calls.ok)} ok, ${fmtInt(cl.redis_calls.error)} failed, ${fmtInt(cl.redis_calls.timeout)} timed out; ` +
      `routing-path round trip ${cl.rtt.mean_ms.toFixed(2)} ms mean; events applied ${fmtInt(cl.events_applied.placed)} placed, ${fmtInt(cl.events_applied.released)} released; ` +
      `local fallbacks ${fmtInt(cl.local_fallbacks.session + cl.local_fallbacks.lease)}`;
    el.className = cl.state === "ok" ? "" : "bad-text";
  }

  // KPIs
  const recentPts = hist.slice(-12); // the last minute
  const sum = (arr, f) => arr.reduce((a, p) => a + f(p), 0);
  const rps = last ? last.requests / ivs : 0;
  setKpi("rps", fmtNum(rps), "", `${fmtInt(d.totals.requests)} total`);
  const minReq = sum(recentPts, p => p.requests), min5xx = sum(recentPts, p => p.server_errors), min4xx = sum(recentPts, p => p.client_errors);
  const errShare = minReq > 0 ? min5xx / minReq : 0;
  setKpi("errors", fmtPct(errShare), "", `last min: 5xx ${fmtInt(min5xx)} · 4xx ${fmtInt(min4xx)}`,
    errShare > 0.05 ? "bad" : errShare > 0 ? "warn" : null);
  // TTFT of the streamed requests among the recent ones (a non-stream answer's first token
  // is its whole body: its TTFT is its duration, counted in the chart's duration line).
  const ttfts = (d.recent || []).filter(r => r.stream && r.ttft_ms !== null).map(r => r.ttft_ms);
  const t50 = quantile(ttfts, 0.5), t95 = quantile(ttfts, 0.95);
  setKpi("ttft", fmtMs(t50), "",
    ttfts.length ? `p95 ${fmtMs(t95)} · ${fmtInt(ttfts.length)} streams` : "no streamed request yet");
  document.querySelector('[data-kpi="ttft"]').dataset.ms = t50 === null ? "" : String(t50);
  const inst = d.instances || [];
  const inflight = sum(inst, i => i.inflight_requests), waiting = sum(inst, i => i.waiting), decoding = sum(inst, i => i.decoding);
  setKpi("inflight", fmtInt(inflight), inflight === 1 ? "request" : "requests", `${fmtInt(waiting)} prefill · ${fmtInt(decoding)} decode`);
  const tps = last ? (last.prompt_tokens + last.completion_tokens) / ivs : 0;
  setKpi("tokens", fmtNum(tps), "", `total ${fmtNum(d.totals.prompt_tokens)} in · ${fmtNum(d.totals.completion_tokens)} out`);
  const up = inst.filter(i => i.health.healthy && !i.health.ejected).length;
  const ejected = inst.filter(i => i.health.ejected).length;
  setKpi("instances", `${up}/${inst.length}`, "", ejected ? `${ejected} ejected` : up === inst.length ? "all healthy" : `${inst.length - up} unhealthy`,
    up === inst.length ? null : up === 0 ? "bad" : "warn");

  // Charts
  const opts = { now: d.now_ms, start };
  lineChart(document.getElementById("chart-requests"), [
    { name: "all", color: COLORS.blue, area: true, points: hist.map(p => [p.t, p.requests / ivs]) },
    { name: "4xx", color: COLORS.amber, points: hist.map(p => [p.t, p.client_errors / ivs]) },
    { name: "5xx", color: COLORS.red, points: hist.map(p => [p.t, p.server_errors / ivs]) },
  ], { ...opts, yFmt: fmtNum });
  legend("legend-requests", [["all", COLORS.blue], ["4xx", COLORS.amber], ["5xx", COLORS.red]]);
  lineChart(document.getElementById("chart-ttft"), [
    { name: "p50", color: COLORS.violet, points: hist.map(p => [p.t, p.ttft_p50_ms]) },
    { name: "p95", color: COLORS.violet, dash: "4 3", points: hist.map(p => [p.t, p.ttft_p95_ms]) },
    { name: "duration p50", color: COLORS.slate, dash: "1 3", points: hist.map(p => [p.t, p.duration_p50_ms]) },
  ], { ...opts, yFmt: v => fmtMs(v).replace(" ", ""), emptyText: "no streamed request yet" });
  legend("legend-ttft", [["p50", COLORS.violet], ["p95", COLORS.violet, true], ["duration p50", COLORS.slate, true]]);
  lineChart(document.getElementById("chart-tokens"), [
    { name: "prompt", color: COLORS.teal, area: true, points: hist.map(p => [p.t, p.prompt_tokens / ivs]) },
    { name: "completion", color: COLORS.amber, points: hist.map(p => [p.t, p.completion_tokens / ivs]) },
  ], { ...opts, yFmt: fmtNum });
  legend("legend-tokens", [["prompt", COLORS.teal], ["completion", COLORS.amber]]);

  renderInstances(inst);
  renderServices(d, hist, opts);
  renderRecent(d.recent || [], wallOffset);
  renderBars("reasons", (d.reasons || []).map(r => [r.reason, r.count]), "no routed request yet");
  const calls = (d.decision_calls || []).map(c => [`${c.route} → ${c.outcome}` + (c.mean_latency_ms === null ? "" : ` · ${fmtMs(c.mean_latency_ms)} mean`), c.count]).sort((a, b) => b[1] - a[1]);
  document.getElementById("decision-card").hidden = calls.length === 0;
  renderBars("decisions", calls, "");
  renderGlobal(d.global);
  renderSplit(d.split);
  renderTenants(d.top_tenants);
  renderMirror(d.mirror);
  renderTracing(d.tracing);
  renderConfig(d, wallOffset);
}

const PHASES = ["prefill", "decode", "total"];

// "1/2 prefill · 0/4 total": the throttling slots of an instance in use against their limits
// (the phases that have one). null when the instance's service is not throttled.
function slotsText(sl) {
  if (!sl) return null;
  const parts = PHASES.filter(p => sl.limits && sl.limits[p] > 0).map(p => `${fmtInt(sl[p])}/${fmtInt(sl.limits[p])} ${p}`);
  return parts.length ? parts.join(" · ") : "service pool";
}

function roleText(i) {
  if (i.role === "prefill") return "prefill" + (i.bootstrap_port ? ` · bootstrap :${i.bootstrap_port}` : "");
  return i.role || "integrated";
}

// One "name value" fact of a service card; value in bold.
function fact(field, name, value, cls) {
  return h("span", { "data-field": field, class: cls || null }, name ? name + " " : "", h("b", {}, value));
}

function renderInstances(inst) {
  const maxIn = Math.max(1, ...inst.map(i => i.inflight_requests));
  const rows = inst.map(i => {
    const hl = i.health;
    const ej = `${fmtInt(hl.ejections)} passive ejection${hl.ejections === 1 ? "" : "s"} since start`;
    const badge = hl.ejected ? h("span", { class: "badge ejected", title: `ejected for ${fmtDuration(hl.ejected_for_ms)} more; ${ej}` }, "ejected")
      : hl.healthy ? h("span", { class: "badge up", title: ej }, "healthy") : h("span", { class: "badge down", title: ej }, "down");
    const ejections = hl.ejections > 0 ? h("span", { class: "ej", title: ej }, ` ${fmtInt(hl.ejections)}× ejected`) : null;
    const num = (field, v, fmt) => h("td", { class: "num" + (v === 0 ? " zero" : ""), "data-field": field }, (fmt || fmtInt)(v));
    const e = i.engine;
    const engine = e ? `${fmtInt(e.running)} run · ${fmtInt(e.waiting)} wait · KV ${fmtPct(e.kv_usage)}` : "not scraped";
    const legs = i.pd_prefill;
    const roleTitle = legs ? `prefill legs: ${fmtInt(legs.ok)} ok · ${fmtInt(legs.error)} error · ${fmtInt(legs.aborted)} aborted` : null;
    const sl = slotsText(i.slots);
    const full = i.slots && PHASES.some(p => i.slots.limits && i.slots.limits[p] > 0 && i.slots[p] >= i.slots.limits[p]);
    return h("tr", { "data-instance": i.id, "data-role": i.role },
      h("td", { class: "id" }, i.id, h("div", { class: "addr" }, i.addr)),
      h("td", {}, i.service, h("div", { class: "role role-" + i.role, "data-field": "role", title: roleTitle }, roleText(i))),
      h("td", { "data-field": "health" }, badge, ejections),
      h("td", { class: "num" + (i.inflight_requests === 0 ? " zero" : ""), "data-field": "inflight_requests" }, fmtInt(i.inflight_requests),
        h("span", { class: "meter" }, h("span", { style: `width:${Math.round(100 * i.inflight_requests / maxIn)}%` }))),
      num("inflight_tokens", i.inflight_tokens, fmtNum),
      h("td", { class: "num" + (i.waiting === 0 ? " zero" : ""), "data-field": "waiting" }, fmtInt(i.waiting),
        i.held > 0 ? h("div", { class: "addr", "data-field": "held", title: "held at the gateway while the engine is saturated (services[].engine_queue)" }, `${fmtInt(i.held)} held`) : null),
      num("decoding", i.decoding),
      h("td", { class: "slots" + (sl === null ? " zero" : full ? " full" : ""), "data-field": "slots",
        title: sl === null ? "not throttled" : sl === "service pool" ? "throttling scope service: the slots are the service's pool (its card)" : "throttling slots in use / limit" }, sl === null ? "–" : sl),
      num("queued_prefill_tokens", i.queued_prefill_tokens, fmtNum),
      num("completed", i.completed),
      h("td", { class: "num" + (i.errors ? " errs" : " zero"), "data-field": "errors" }, fmtInt(i.errors)),
      num("cancelled", i.cancelled),
      h("td", { class: "num", "data-field": "learned_prefill" }, i.learned.prefill_tokens_per_second ? fmtNum(i.learned.prefill_tokens_per_second) + "/s" : "–"),
      h("td", { class: "num", "data-field": "learned_step" }, i.learned.decode_step_ms ? fmtMs(i.learned.decode_step_ms) : "–"),
      h("td", { class: "engine" }, engine));
  });
  document.querySelector("#instances tbody").replaceChildren(...rows);
}

// Hit ratio of a service over the HIT_WINDOW_MS before each point, from cumulative counters
// [prompt, ceiling, predicted, engine prompt, engine cached].
function hitSeries(hist, name) {
  const c = hist.map(p => { const e = (p.prefix || []).find(x => x[0] === name); return e ? e[1] : null; });
  const out = { ceiling: [], predicted: [], engine: [] };
  let j = 0;
  for (let i = 0; i < hist.length; i++) {
    while (j < i && hist[j + 1].t <= hist[i].t - HIT_WINDOW_MS) j++;
    const a = c[j === i ? Math.max(0, i - 1) : j], b = c[i], t = hist[i].t;
    if (!a || !b || i === 0) { out.ceiling.push([t, null]); out.predicted.push([t, null]); out.engine.push([t, null]); continue; }
    const dp = b[0] - a[0], de = b[3] - a[3];
    out.ceiling.push([t, dp > 0 ? (b[1] - a[1]) / dp : null]);
    out.predicted.push([t, dp > 0 ? (b[2] - a[2]) / dp : null]);
    out.engine.push([t, de > 0 ? (b[4] - a[4]) / de : null]);
  }
  return out;
}

function renderServices(d, hist, opts) {
  const box = document.getElementById("services");
  const cards = (d.services || []).map(sv => {
    const hs = hitSeries(hist, sv.name);
    const svg = s("svg", { role: "img", "aria-label": `prefix hit ratio of ${sv.name}` });
    const idx = sv.index || {};
    const more = [];
    more.push(`${sv.available}/${sv.instances} up`);
    if (sv.sessions !== null && sv.sessions !== undefined) more.push(`${fmtInt(sv.sessions)} sessions`);
    const r = sv.hit_ratio;
    more.push(`${fmtNum(sv.tokens.prompt)} tokens in · ${fmtNum(sv.tokens.completion)} out`);
    const index = `prefix index: ${fmtInt(idx.blocks)} blocks · ${fmtInt(idx.nodes)} nodes · ${fmtBytes(idx.bytes)} · evicted ${fmtBytes(idx.evicted_bytes)} · trimmed ${fmtInt(idx.trimmed_blocks)} blocks · over cache size ${fmtInt(idx.capacity_evicted_blocks)} blocks`;
    const card = h("div", { class: "card", "data-service": sv.name },
      h("div", { class: "svc-head" }, h("span", { class: "name" }, sv.name), h("span", { class: "badge mode" }, sv.mode || "balance"),
        h("span", { class: "more", title: "prefix hit ratios since start; the chart: over 30 s windows" }, "since start · chart: 30 s windows")),
      h("div", { class: "ratios" },
        ratio("ceiling", r.ceiling, COLORS.slate, "since start: best cached prefix on any instance"),
        ratio("predicted", r.predicted, COLORS.blue, "since start: cached prefix on the chosen instance, by the gateway's index"),
        ratio("engine", r.engine, COLORS.green, "since start: cached tokens the engines reported")),
      h("div", { class: "svc-more" }, more.join(" · ")),
      h("div", { class: "svc-more wrap", "data-field": "index", title: index }, index),
      sv.throttle ? throttleFacts(sv.throttle) : null,
      sv.pd ? pdFacts(sv.pd, (d.instances || []).filter(i => i.service === sv.name && i.pd_prefill)) : null,
      svg,
      h("div", { class: "pipeline", title: sv.pipeline || "" }, sv.pipeline || ""));
    return [card, svg, hs];
  });
  const routes = (d.routes || []).map(rt => h("div", { class: "card", "data-route": rt.name },
    h("div", { class: "svc-head" }, h("span", { class: "name" }, rt.name), h("span", { class: "badge mode" }, "route · " + rt.mode),
      h("span", { class: "more" }, rt.sessions !== null && rt.sessions !== undefined ? `${fmtInt(rt.sessions)} sessions` : "")),
    h("div", { class: "pipeline" }, "targets: " + rt.targets.join(", "))));
  box.replaceChildren(...cards.map(c => c[0]), ...routes);
  for (const [, svg, hs] of cards) {
    lineChart(svg, [
      { name: "ceiling", color: COLORS.slate, dash: "4 3", points: hs.ceiling },
      { name: "predicted", color: COLORS.blue, points: hs.predicted },
      { name: "engine", color: COLORS.green, points: hs.engine },
    ], { ...opts, yMax: 1, yFmt: v => nf0.format(v * 100) + "%", emptyText: "no prompts in the last 30 s" });
  }
}

// A throttled service: its queue, slots in use against their limits (over its instances),
// refusals by reason and the queue's waits.
function throttleFacts(t) {
  const slots = PHASES.filter(p => t.slots[p] && t.slots[p].limit > 0)
    .map(p => fact("slots-" + p, p + " slots", `${fmtInt(t.slots[p].in_use)}/${fmtInt(t.slots[p].limit)}`, t.slots[p].in_use >= t.slots[p].limit ? "full" : null));
  const r = t.rejections;
  const refused = r.limit + r.queue_full + r.queue_timeout;
  const w = t.queue_wait;
  return h("div", { class: "svc-facts", "data-field": "throttle", title: `throttling: overflow ${t.overflow}, scope ${t.scope}, queue_timeout ${fmtMs(t.queue_timeout_ms)}` },
    h("span", { class: "badge mode" }, "throttle · " + t.overflow),
    t.overflow === "queue" ? fact("queued", "queue", `${fmtInt(t.queued)}/${fmtInt(t.max_queue)}`, t.queued > 0 ? "busy" : null) : null,
    ...slots,
    fact("rejections", "refused", refused === 0 ? "0" : `${fmtInt(r.queue_full)} queue full · ${fmtInt(r.queue_timeout)} timed out · ${fmtInt(r.limit)} at limit`, refused > 0 ? "busy" : null),
    t.overflow === "queue" ? fact("queue-wait", "waited", w.count ? `${fmtInt(w.count)}× · mean ${fmtMs(w.mean_ms)}` : "0") : null,
    t.overflow === "queue" && w.by_class ? fact("queue-wait-class", "by class (all services)",
      Object.entries(w.by_class).filter(([, v]) => v.count > 0).map(([c, v]) => `${c} ${fmtInt(v.count)}× · ${fmtMs(v.mean_ms)}`).join(" · ") || "0") : null);
}

// A prefill/decode-disaggregated service: its protocol, its nodes and the prefill legs by
// outcome (per prefill node when there are several).
function pdFacts(pd, prefills) {
  const legs = (name, o) => fact("pd-prefill", name, `${fmtInt(o.ok)} ok · ${fmtInt(o.error)} error · ${fmtInt(o.aborted)} aborted`, o.error + o.aborted > 0 ? "busy" : null);
  return h("div", { class: "svc-facts", "data-field": "pd" },
    h("span", { class: "badge mode" }, "prefill/decode · " + pd.mode),
    fact("pd-nodes", "", `${fmtInt(pd.prefill_instances)} prefill + ${fmtInt(pd.decode_instances)} decode`),
    fact("pd-policy", "decode by", pd.decode_policy),
    ...(prefills.length > 1 ? prefills.map(i => legs(i.id + " legs", i.pd_prefill)) : [legs("prefill legs", pd.prefill)]));
}

// Member gateways of other regions: health and what they answered.
function renderGlobal(g) {
  const members = (g && g.members) || [];
  document.getElementById("global-card").hidden = members.length === 0;
  document.getElementById("global-name").textContent = g ? `${g.name} → what it cannot take` : "";
  const num = (field, v, bad) => h("td", { class: "num" + (v === 0 ? " zero" : bad ? " errs" : ""), "data-field": field }, fmtInt(v));
  document.querySelector("#members tbody").replaceChildren(...members.map(m => h("tr", { "data-member": m.name },
    h("td", { class: "id", title: `${m.name} · ${m.url}` }, m.name, h("div", { class: "addr" }, m.url)),
    h("td", { "data-field": "health" }, m.available ? h("span", { class: "badge up" }, "up") : h("span", { class: "badge down" }, "down")),
    num("ok", m.outcomes.ok), num("refused", m.outcomes.refused), num("error", m.outcomes.error, true), num("cancelled", m.outcomes.cancelled))));
}

// Split proxy: each entry (local = our own services), how it is chosen, whether it is
// reachable, and its attempts by outcome.
function renderSplit(sp) {
  const entries = (sp && sp.proxies) || [];
  document.getElementById("split-card").hidden = entries.length === 0;
  if (entries.length === 0) return;
  document.getElementById("split-name").textContent = `by ${sp.strategy}`;
  const num = (field, v, bad) => h("td", { class: "num" + (v === 0 ? " zero" : bad ? " errs" : ""), "data-field": field }, fmtInt(v));
  const share = e => sp.strategy === "prefix" ? (e.prefix || "–") : `weight ${fmtInt(e.weight || 0)}`;
  document.querySelector("#split tbody").replaceChildren(...entries.map(e => h("tr", { "data-entry": e.name },
    h("td", { class: "id", title: e.address ? `${e.name} · ${e.address}` + (e.model ? ` as ${e.model}` : "") : "our own services" },
      e.name, h("div", { class: "addr" }, e.local ? "our services" : e.address + (e.model ? ` → ${e.model}` : ""))),
    h("td", { "data-field": "share" }, share(e), " ",
      !e.enabled ? h("span", { class: "badge down" }, "off")
        : e.available ? null : h("span", { class: "badge down" }, "unresolved")),
    num("ok", e.outcomes.ok), num("refused", e.outcomes.refused), num("error", e.outcomes.error, true), num("cancelled", e.outcomes.cancelled))));
}

// The tenants that used the most tokens since start, with their in-flight requests and
// refusals (shown when tenants or api_keys are configured).
function renderTenants(top) {
  const list = top || [];
  document.getElementById("tenants-card").hidden = list.length === 0;
  const num = (field, v, bad) => h("td", { class: "num" + (v === 0 ? " zero" : bad ? " errs" : ""), "data-field": field }, fmtInt(v));
  document.querySelector("#tenants tbody").replaceChildren(...list.map(t => h("tr", { "data-tenant": t.tenant },
    h("td", { class: "id", title: `${t.tenant} · ${t.priority}` }, t.tenant, h("div", { class: "addr" }, t.priority)),
    num("tokens", t.tokens), num("input", t.input_tokens), num("output", t.output_tokens),
    num("requests", t.requests), num("inflight", t.inflight), num("refused", t.rejections, true))));
}

// Traffic mirroring: where the copies go, what became of them, the queue and the answered
// copies' latency. Shown while configured, and after a reload removed it if it ever sent.
function renderMirror(mi) {
  const o = mi ? mi.outcomes : null;
  const ever = o && Object.values(o).some(v => v > 0);
  const card = document.getElementById("mirror-card");
  card.hidden = !mi || (!mi.settings && !ever);
  if (card.hidden) return;
  const st = mi.settings;
  document.getElementById("mirror-name").textContent = st
    ? `${nf2.format(st.ratio)}% → ${st.target}` + (st.target_model ? ` as ${st.target_model}` : "")
    : "not configured (counts since start)";
  const lat = p => mi.latency && mi.latency[p] && mi.latency[p].count ? fmtMs(mi.latency[p].mean_ms) : "–";
  const facts = [
    ["sent", "sent", fmtInt(o.sent), false],
    ["answered", "answered", `${fmtInt(o.ok)} ok · ${fmtInt(o.http_error)} http error`, o.http_error > 0],
    ["failed", "failed", `${fmtInt(o.error)} error · ${fmtInt(o.timeout)} timeout`, o.error + o.timeout > 0],
    ["unsent", "not sent", `${fmtInt(o.dropped)} dropped · ${fmtInt(o.expired)} expired`, o.dropped + o.expired > 0],
    ["queue", "queue", `${fmtInt(mi.queued)} waiting · ${fmtInt(mi.inflight)} in flight`, false],
    ["latency", "latency (mean)", `first token ${lat("ttft")} · last byte ${lat("total")}`, false],
  ];
  const kids = [];
  for (const [field, k, v, warn] of facts) kids.push(h("dt", {}, k), h("dd", { "data-field": field, class: warn ? "warn" : null }, v));
  document.getElementById("mirror").replaceChildren(...kids);
}

// OpenTelemetry traces: where the spans go and what became of them. Shown while configured.
function renderTracing(t) {
  const card = document.getElementById("tracing-card");
  card.hidden = !t || !t.endpoint;
  if (card.hidden) return;
  document.getElementById("tracing-name").textContent = `OTLP${t.protocol === "grpc" ? "/gRPC" : ""} → ${t.endpoint}`;
  const s = t.spans;
  const facts = [
    ["exported", "spans exported", fmtInt(s.exported), false],
    ["dropped", "spans dropped", `${fmtInt(s.dropped_queue_full)} queue full · ${fmtInt(s.dropped_export_failed)} export failed`,
      s.dropped_queue_full + s.dropped_export_failed > 0],
  ];
  const kids = [];
  for (const [field, k, v, warn] of facts) kids.push(h("dt", {}, k), h("dd", { "data-field": field, class: warn ? "warn" : null }, v));
  document.getElementById("tracing").replaceChildren(...kids);
}

function ratio(name, v, color, title) {
  return h("div", { class: "ratio", title, "data-ratio": name },
    h("div", { class: "k" }, h("i", { style: `background:${color}` }), name), h("div", { class: "v" }, fmtPct(v)));
}

function renderRecent(recent, wallOffset) {
  const rows = recent.slice(0, 14).map(r => h("tr", { "data-request": r.request_id, title: `request id ${r.request_id}` },
    h("td", {}, clock(r.at_ms + wallOffset)),
    h("td", {}, r.model),
    h("td", {}, r.instance),
    h("td", { class: "status-" + String(r.status)[0] }, r.status === 0 ? "—" : r.status),
    h("td", { class: "reason", title: r.reason }, r.reason || "–"),
    h("td", { class: "num" }, r.ttft_ms === null ? "–" : fmtMs(r.ttft_ms)),
    h("td", { class: "num" }, fmtMs(r.duration_ms)),
    h("td", { class: "num" }, r.prompt_tokens === null ? "–" : `${fmtInt(r.prompt_tokens)} → ${fmtInt(r.completion_tokens)}`),
    h("td", { class: "num" }, r.cached_tokens === null ? "–" : fmtInt(r.cached_tokens))));
  const body = document.querySelector("#recent tbody");
  if (rows.length === 0) rows.push(h("tr", {}, h("td", { colspan: "9", class: "empty-note" }, "no request yet")));
  body.replaceChildren(...rows);
}

function renderBars(id, items, emptyText) {
  const el = document.getElementById(id);
  const top = items.slice(0, 8);
  const rest = items.slice(8).reduce((a, x) => a + x[1], 0);
  if (rest > 0) top.push([`${items.length - 8} more`, rest]);
  const max = Math.max(1, ...top.map(x => x[1]));
  const rows = top.map(([label, n]) => h("div", { class: "row" },
    h("div", { class: "lbl", title: label }, h("span", { class: "fill", style: `width:${(100 * n / max).toFixed(1)}%` }), h("span", { class: "txt" }, label)),
    h("div", { class: "cnt" }, fmtInt(n))));
  if (rows.length === 0 && emptyText) rows.push(h("div", { class: "empty-note" }, emptyText));
  el.replaceChildren(...rows);
}

function renderConfig(d, wallOffset) {
  const r = d.reload;
  const st = document.getElementById("config-state");
  const facts = [["generation", String(r.generation)], ["reloads applied", fmtInt(r.ok)], ["reloads rejected", fmtInt(r.errors)],
    ["slow heads closed (408)", fmtInt(d.protocol_errors.head_timeout)],
    ["heads refused (400/431)", fmtInt((d.protocol_errors.head_too_large || 0) + (d.protocol_errors.too_many_headers || 0) + (d.protocol_errors.bad_request || 0))]];
  if (r.last) {
    facts.push(["last reload", `${r.last.ok ? "applied" : "rejected"} at ${clock(r.last.at_ms + wallOffset)} (${fmtAgo(d.now_ms - r.last.at_ms)})`]);
  } else {
    facts.push(["last reload", "none since start"]);
  }
  st.textContent = r.last_ok ? (r.last ? "reloaded ✓" : "as started") : "reload rejected";
  st.className = r.last_ok ? "ok-text" : "bad-text";
  const dl = document.getElementById("config");
  const kids = [];
  for (const [k, v] of facts) kids.push(h("dt", {}, k), h("dd", {}, v));
  if (r.last && !r.last.ok && r.last.message) kids.push(h("dt", {}, "error"), h("dd", { class: "err" }, r.last.message));
  dl.replaceChildren(...kids);
}

// ---- polling -----------------------------------------------------------------------------------

function setConn(state, text) {
  const c = document.getElementById("conn");
  c.className = "pill " + state;
  c.textContent = text;
  document.body.dataset.state = state;
}

async function poll() {
  try {
    const r = await fetch("admin/status", { cache: "no-store", credentials: "same-origin" });
    if (r.status === 401) {
      setConn("down", "admin token needed: open /?token=…");
    } else if (!r.ok) {
      setConn("down", `error ${r.status}`);
    } else {
      lastData = await r.json();
      render(lastData);
      updates++;
      lastOk = Date.now();
      document.body.dataset.updates = String(updates);
      setConn("live", "live");
    }
  } catch (e) {
    setConn("down", lastOk ? `disconnected · last update ${fmtAgo(Date.now() - lastOk)}` : "cannot reach the gateway");
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("resize", () => { if (lastData) render(lastData); });
poll();
