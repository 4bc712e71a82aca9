// vx dashboard: renders the /v1/engine/events feed (JSON snapshots over SSE, up to 10 a second).
// Counters in a snapshot are cumulative: rates and abort events come from differencing them.
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY = 300; // samples kept per series (30 s at 10 Hz)
const STEP_BARS = 120; // sampled steps in the composition chart (12 s)
const COLORS = {
  used: "#7c6cff", cached: "#2dd4bf", free: "#222c3f",
  prefill: "#f5a524", decode: "#7c6cff", grid: "#222b3d", text: "#5d6679",
  blue: "#60a5fa", violet: "#a78bfa", amber: "#f5a524", cyan: "#2dd4bf",
};
const series = { tput: [], step: [], running: [], waiting: [], kv: [], prefill: [], decode: [] };
const recent = []; // {t, front, queries, hits}, the last ~12 s, for windowed rates
let prev = null;
let budget = 0;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const fmt = (x, digits = 1) => (x == null || !isFinite(x) ? "–" : x.toFixed(digits));
const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

function authHeaders() {
  const key = (localStorage.getItem("vx.apiKey") || "").trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function setConn(kind, text) {
  $("conn-dot").className = `dot ${kind}`;
  $("conn-text").textContent = text;
}

function showBanner(kind, text) {
  const el = $("banner");
  el.hidden = !text;
  el.className = `banner ${kind}`;
  el.textContent = text || "";
}

function push(name, value) {
  const a = series[name];
  a.push(value);
  if (a.length > HISTORY) a.shift();
}

// ── the feed ──
async function readSSE(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let nl;
    while ((nl = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, nl).replace(/\r$/, "");
      buffer = buffer.slice(nl + 1);
      if (line.startsWith("data:")) onEvent(JSON.parse(line.slice(5)));
    }
  }
}

async function connect() {
  let backoff = 500;
  for (;;) {
    try {
      const r = await fetch("/v1/engine/events", { headers: authHeaders(), cache: "no-store" });
      if (r.status === 401) {
        setConn("warn", "API key needed");
        showBanner("warn", "This server needs an API key: enter it on the Chat page (this browser keeps it).");
      } else if (!r.ok) {
        setConn("bad", `HTTP ${r.status}`);
      } else {
        setConn("ok", "live");
        backoff = 500;
        await readSSE(r, onSnapshot);
        setConn("warn", "reconnecting");
      }
    } catch (e) {
      setConn("bad", "disconnected");
    }
    await sleep(backoff);
    backoff = Math.min(backoff * 2, 8000);
  }
}

// ── one snapshot ──
function aggregate(s) {
  const a = { running: 0, waiting: 0, constrained: 0, preempted: 0, blocks: 0, free: 0,
              cachedFree: 0, queries: 0, hits: 0, prefill: 0, decode: 0, budget: 0, stepS: 0,
              drafts: 0, accepted: 0, haveStats: false };
  for (const e of s.engines) {
    const st = e.stats;
    a.budget += e.max_num_batched_tokens;
    if (!st) { a.blocks += e.num_blocks; a.free += e.num_blocks; continue; }
    a.haveStats = true;
    a.running += st.num_running;
    a.waiting += st.num_waiting;
    a.constrained += st.num_constrained || 0;
    a.preempted += st.num_preempted_total;
    a.blocks += st.num_blocks;
    a.free += st.num_free_blocks;
    a.cachedFree += st.num_cached_free_blocks;
    a.queries += st.prefix_queries_total;
    a.hits += st.prefix_hits_total;
    a.drafts += st.spec_num_draft_tokens_total || 0;
    a.accepted += st.spec_num_accepted_tokens_total || 0;
    a.prefill += st.step_num_prefill_tokens;
    a.decode += st.step_num_decode_tokens;
    a.stepS = Math.max(a.stepS, st.step_time_s);
  }
  a.used = a.blocks - a.free;
  a.idle = a.running + a.waiting === 0;
  return a;
}

// The oldest kept sample at most `windowS` old (or the oldest kept, when younger).
function since(windowS, t) {
  for (const r of recent) if (t - r.t <= windowS) return r;
  return recent[recent.length - 1];
}

function onSnapshot(s) {
  const a = aggregate(s);
  const f = s.front;
  $("model").textContent = s.model || "…";
  $("conn-detail").textContent = `${Math.round(1 / s.interval_s)} Hz · ${s.watchers} watching`;
  if (s.dead) showBanner("bad", `Engine dead: ${s.dead_reason || "unknown reason"}`);
  else if (s.draining) showBanner("warn", "The server is draining: no new requests are admitted.");
  else showBanner("", "");

  // Rates over windows, from cumulative counters.
  const base = recent.length ? since(1.0, s.t) : null;
  const dt = base ? s.t - base.t : 0;
  const tput = dt > 0.2 ? (f.generation_tokens - base.front.generation_tokens) / dt : 0;
  const promptRate = dt > 0.2 ? (f.prompt_tokens - base.front.prompt_tokens) / dt : 0;
  const old = recent.length ? since(10.0, s.t) : null;
  const dTtftN = old ? f.ttft_count - old.front.ttft_count : 0;
  const ttftMs = dTtftN > 0 ? (1000 * (f.ttft_sum - old.front.ttft_sum)) / dTtftN : null;
  const dItlN = old ? f.itl_count - old.front.itl_count : 0;
  const itlMs = dItlN > 0 ? (1000 * (f.itl_sum - old.front.itl_sum)) / dItlN : null;
  let q = old ? a.queries - old.queries : 0;
  let h = old ? a.hits - old.hits : 0;
  const windowed = q > 0;
  if (!windowed) { q = a.queries; h = a.hits; }
  recent.push({ t: s.t, front: f, queries: a.queries, hits: a.hits });
  while (recent.length > 2 && s.t - recent[0].t > 12) recent.shift();

  // KPIs.
  const kv = a.blocks ? a.used / a.blocks : 0;
  $("kpi-running").textContent = a.running;
  $("kpi-running-sub").textContent = `of ${s.engines.reduce((x, e) => x + e.max_num_seqs, 0)} seqs` +
    (a.constrained ? ` · ${a.constrained} constrained` : "");
  $("kpi-waiting").textContent = a.waiting;
  $("kpi-inflight").textContent = `${s.in_flight} in flight`;
  $("kpi-preempted").textContent = a.preempted;
  $("kpi-kv").textContent = `${fmt(100 * kv)}%`;
  $("kpi-kv-sub").textContent = `${a.used} / ${a.blocks} blocks`;
  $("kpi-hits").innerHTML = q ? `${fmt((100 * h) / q)}<small>%</small>` : "–";
  $("kpi-hits-sub").textContent = q ? `${h}/${q} tok · ${windowed ? "10 s" : "all time"}` : "no lookups yet";
  $("kpi-tput").innerHTML = `${fmt(tput, 0)}<small>tok/s</small>`;
  // speculative decoding: the share of drafts accepted, since start
  const drafts = a.drafts ? ` · drafts ${fmt((100 * a.accepted) / a.drafts, 0)}% accepted` : "";
  $("kpi-prompt").textContent = `prompt ${fmt(promptRate, 0)} tok/s${drafts}`;
  $("kpi-ttft").innerHTML = ttftMs == null ? "–" : `${fmt(ttftMs, ttftMs < 100 ? 1 : 0)}<small>ms</small>`;
  $("kpi-itl").textContent = itlMs == null ? "ITL –" : `ITL ${fmt(itlMs, 2)} ms`;
  for (const [id, v] of [["kpi-running", a.running], ["kpi-waiting", a.waiting], ["kpi-kv", kv]]) {
    $(id).dataset.value = String(v);
  }

  // Step composition (the engine's latest step; nothing while idle).
  budget = a.budget;
  const prefill = a.idle ? 0 : a.prefill;
  const decode = a.idle ? 0 : a.decode;
  $("budget-prefill").style.width = `${budget ? (100 * prefill) / budget : 0}%`;
  $("budget-decode").style.width = `${budget ? (100 * decode) / budget : 0}%`;
  $("step-prefill").textContent = prefill;
  $("step-decode").textContent = decode;
  $("step-budget").textContent = budget;
  const share = (100 * (prefill + decode)) / Math.max(budget, 1);
  $("step-detail").textContent = a.idle ? "idle" : `${share > 0 && share < 0.1 ? "<0.1" : fmt(share)}% of budget`;

  push("tput", tput);
  push("step", a.idle ? null : 1000 * a.stepS);
  push("running", a.running);
  push("waiting", a.waiting);
  push("kv", 100 * kv);
  push("prefill", prefill);
  push("decode", decode);
  $("spark-tput-now").innerHTML = `${fmt(tput, 0)}<small>tok/s</small>`;
  $("spark-step-now").innerHTML = a.idle ? "idle" : `${fmt(1000 * a.stepS, 1)}<small>ms</small>`;
  $("spark-queue-now").innerHTML = `${a.running}<small>/</small>${a.waiting}`;
  $("spark-kv-now").innerHTML = `${fmt(100 * kv)}<small>%</small>`;

  // Block pool.
  $("pool-used").textContent = a.used;
  $("pool-cached").textContent = a.cachedFree;
  $("pool-free").textContent = a.free - a.cachedFree;
  const group = s.engines[0]?.block_map?.group_size || 1;
  $("pool-detail").textContent = `${a.blocks} blocks × ${s.engines[0]?.block_size || 16} tokens` +
    (group > 1 ? ` · 1 cell = ${group} blocks` : "");
  drawBlockMaps(s.engines);

  // Requests and events.
  const finished = sum(f.finished), aborted = sum(f.aborted), rejected = sum(f.rejected);
  $("cnt-received").textContent = Math.round(f.received);
  $("cnt-finished").textContent = Math.round(finished);
  $("cnt-aborted").textContent = Math.round(aborted);
  $("cnt-rejected").textContent = Math.round(rejected);
  $("req-detail").textContent = `${Math.round(f.generation_tokens)} tokens out`;
  if (prev) {
    for (const [cause, n] of Object.entries(f.aborted)) {
      const d = n - (prev.front.aborted[cause] || 0);
      if (d > 0) addEvent("abort", "aborted", `${d > 1 ? `${d} requests` : "request"} · ${cause.replaceAll("_", " ")}`);
    }
    for (const [status, n] of Object.entries(f.rejected)) {
      const d = n - (prev.front.rejected[status] || 0);
      if (d > 0) addEvent("reject", `HTTP ${status}`, `${d > 1 ? `${d} requests` : "request"} rejected`);
    }
    if (s.dead && !prev.dead) addEvent("abort", "dead", s.dead_reason || "engine dead");
    if (s.draining && !prev.draining) addEvent("info", "drain", "server draining");
    if (a.preempted > prev.agg.preempted) addEvent("reject", "preempt", `${a.preempted - prev.agg.preempted} request(s) preempted`);
  }
  prev = { ...s, agg: a };
  drawCharts();
}

function addEvent(kind, tag, text) {
  const list = $("events");
  list.querySelector(".empty-note")?.remove();
  const li = document.createElement("li");
  li.className = `event ${kind}`;
  const time = new Date().toLocaleTimeString([], { hour12: false }) + `.${String(Date.now() % 1000).padStart(3, "0")}`;
  li.innerHTML = `<time></time><span class="tag ${kind}"></span><span class="text"></span>`;
  li.querySelector("time").textContent = time;
  li.querySelector(".tag").textContent = tag;
  li.querySelector(".text").textContent = text;
  list.prepend(li);
  while (list.children.length > 60) list.lastChild.remove();
}

// ── canvases ──
function setup(canvas, cssHeight) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth;
  const h = cssHeight ?? canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    canvas.style.height = `${h}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}

function drawBlockMaps(engines) {
  const box = $("blockmaps");
  while (box.children.length < engines.length * 2) {
    const label = document.createElement("div");
    label.className = "engine-label";
    const canvas = document.createElement("canvas");
    canvas.className = "blockmap";
    box.append(label, canvas);
  }
  engines.forEach((e, i) => {
    const label = box.children[2 * i];
    const canvas = box.children[2 * i + 1];
    label.hidden = engines.length < 2;
    label.textContent = `engine ${e.index}`;
    drawBlockMap(canvas, e.block_map, e.num_blocks);
  });
}

// One cell per block (or per group of blocks): violet in use, teal cached but evictable, dark free.
function drawBlockMap(canvas, map, numBlocks) {
  const grouped = map && map.group_size > 1;
  const n = map ? (grouped ? map.cells.length / 2 : map.cells.length) : numBlocks;
  const w = canvas.clientWidth || 600;
  let size = 2;
  for (let s = 18; s >= 2; s--) {
    const cols = Math.floor(w / s);
    if (Math.ceil(n / cols) * s <= 280) { size = s; break; }
  }
  const cols = Math.max(1, Math.floor(w / size));
  const rows = Math.max(1, Math.ceil(n / cols));
  const { ctx } = setup(canvas, rows * size);
  const gap = size >= 6 ? 1.5 : size >= 4 ? 1 : 0;
  const radius = size >= 8 ? 2 : 0;
  let used = 0, cached = 0;
  const cell = (i, color, frac = 1) => {
    const x = (i % cols) * size, y = Math.floor(i / cols) * size;
    const inner = size - gap;
    ctx.fillStyle = color;
    if (frac >= 1) {
      if (radius) { ctx.beginPath(); ctx.roundRect(x, y, inner, inner, radius); ctx.fill(); }
      else ctx.fillRect(x, y, inner, inner);
    } else if (frac > 0) {
      ctx.fillRect(x, y + inner * (1 - frac), inner, inner * frac);
    }
  };
  for (let i = 0; i < n; i++) {
    if (!map) { cell(i, COLORS.free); continue; }
    if (!grouped) {
      const c = map.cells[i];
      if (c === "u") used++; else if (c === "c") cached++;
      cell(i, c === "u" ? COLORS.used : c === "c" ? COLORS.cached : COLORS.free);
    } else {
      const u = parseInt(map.cells[2 * i], 16) / 15, c = parseInt(map.cells[2 * i + 1], 16) / 15;
      if (u > 0) used++;
      if (c > 0) cached++;
      cell(i, COLORS.free);
      cell(i, COLORS.cached, Math.min(1, u + c)); // stacked: in use at the bottom, cached above
      cell(i, COLORS.used, u);
    }
  }
  canvas.dataset.cells = String(n);
  canvas.dataset.used = String(used);
  canvas.dataset.cached = String(cached);
}

// A line (or several) over the last HISTORY samples; null values break the line.
function sparkline(canvas, lines, { max = null, unit = "" } = {}) {
  const { ctx, w, h } = setup(canvas);
  const pad = 4;
  let top = max ?? 0;
  if (max == null) for (const l of lines) for (const v of l.values) if (v != null && v > top) top = v;
  if (max == null) top = top > 0 ? top * 1.15 : 1;
  ctx.strokeStyle = COLORS.grid;
  ctx.lineWidth = 1;
  ctx.setLineDash([2, 4]);
  ctx.beginPath(); ctx.moveTo(0, pad + 0.5); ctx.lineTo(w, pad + 0.5); ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = COLORS.text;
  ctx.font = "10px ui-monospace, monospace";
  ctx.textAlign = "left";
  ctx.fillText(`${top >= 10 ? Math.round(top) : top.toFixed(1)}${unit}`, 2, pad + 11);
  const x = (i) => (w * i) / (HISTORY - 1);
  const y = (v) => h - pad - ((h - 2 * pad) * v) / top;
  for (const { values, color, fill } of lines) {
    const off = HISTORY - values.length;
    const path = new Path2D();
    let open = false, first = null, last = null;
    values.forEach((v, i) => {
      if (v == null) { open = false; return; }
      const px = x(i + off), py = y(v);
      if (!open) { path.moveTo(px, py); open = true; if (first === null) first = px; } else path.lineTo(px, py);
      last = px;
    });
    if (fill && first !== null) {
      const area = new Path2D(path);
      area.lineTo(last, h);
      area.lineTo(first, h);
      const grad = ctx.createLinearGradient(0, 0, 0, h);
      grad.addColorStop(0, `${color}55`);
      grad.addColorStop(1, `${color}00`);
      ctx.fillStyle = grad;
      ctx.fill(area);
    }
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.75;
    ctx.lineJoin = "round";
    ctx.stroke(path);
  }
}

// Stacked bars: prefill under decode tokens per sampled step, scaled to the window's largest.
function stepsChart(canvas) {
  const { ctx, w, h } = setup(canvas);
  const prefill = series.prefill.slice(-STEP_BARS);
  const decode = series.decode.slice(-STEP_BARS);
  const n = prefill.length;
  let top = 8;
  for (let i = 0; i < n; i++) top = Math.max(top, prefill[i] + decode[i]);
  top *= 1.1;
  const bw = w / STEP_BARS;
  const off = STEP_BARS - n;
  ctx.fillStyle = COLORS.grid;
  ctx.fillRect(0, h - 1, w, 1);
  for (let i = 0; i < n; i++) {
    const hp = ((h - 14) * prefill[i]) / top;
    const hd = ((h - 14) * decode[i]) / top;
    const x = (i + off) * bw;
    ctx.fillStyle = COLORS.prefill;
    ctx.fillRect(x, h - hp, Math.max(bw - 1, 1), hp);
    ctx.fillStyle = COLORS.decode;
    ctx.fillRect(x, h - hp - hd, Math.max(bw - 1, 1), hd);
  }
  ctx.fillStyle = COLORS.text;
  ctx.font = "10px ui-monospace, monospace";
  ctx.textAlign = "left";
  ctx.fillText(`${Math.round(top)} tok/step`, 2, 10);
  if (budget && budget <= top) {
    const yb = h - ((h - 14) * budget) / top;
    ctx.strokeStyle = "#f8717199";
    ctx.setLineDash([4, 4]);
    ctx.beginPath(); ctx.moveTo(0, yb); ctx.lineTo(w, yb); ctx.stroke();
    ctx.setLineDash([]);
  }
}

let drawPending = false;
function drawCharts() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    sparkline($("spark-tput"), [{ values: series.tput, color: COLORS.blue, fill: true }]);
    sparkline($("spark-step"), [{ values: series.step, color: COLORS.violet, fill: true }], { unit: " ms" });
    sparkline($("spark-queue"), [
      { values: series.waiting, color: COLORS.amber, fill: true },
      { values: series.running, color: COLORS.violet, fill: true },
    ]);
    sparkline($("spark-kv"), [{ values: series.kv, color: COLORS.cyan, fill: true }], { max: 100, unit: "%" });
    stepsChart($("steps-chart"));
  });
}

window.addEventListener("resize", () => { drawCharts(); if (prev) drawBlockMaps(prev.engines); });
connect();
