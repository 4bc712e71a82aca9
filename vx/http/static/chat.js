// vx chat: streams /v1/chat/completions over SSE (fetch + ReadableStream), Stop = AbortController.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["temperature", "top_p", "max_tokens", "seed", "system", "ignore_eos", "json_mode",
                  "tools", "tool_choice"];
const state = { history: [], controller: null, model: null };

// ── settings, persisted in localStorage ──
function loadSettings() {
  const saved = JSON.parse(localStorage.getItem("vx.settings") || "{}");
  for (const name of SETTINGS) {
    const el = $(name);
    if (!(name in saved)) continue;
    if (el.type === "checkbox") el.checked = !!saved[name];
    else el.value = saved[name];
  }
  $("api-key").value = localStorage.getItem("vx.apiKey") || "";
  showRangeValues();
}

function saveSettings() {
  const out = {};
  for (const name of SETTINGS) {
    const el = $(name);
    out[name] = el.type === "checkbox" ? el.checked : el.value;
  }
  localStorage.setItem("vx.settings", JSON.stringify(out));
  localStorage.setItem("vx.apiKey", $("api-key").value.trim());
  showRangeValues();
}

function showRangeValues() {
  $("temperature-out").textContent = Number($("temperature").value).toFixed(2);
  $("top_p-out").textContent = Number($("top_p").value).toFixed(2);
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// ── server status ──
function setHealth(kind, text) {
  $("health-dot").className = `dot ${kind}`;
  $("health-text").textContent = text;
}

async function refreshModel() {
  try {
    const r = await fetch("/v1/models", { headers: authHeaders() });
    if (r.status === 401) {
      setHealth("warn", "API key needed");
      return;
    }
    const body = await r.json();
    state.model = body.data[0].id;
    $("model").textContent = state.model;
    $("model").title = `max_model_len ${body.data[0].max_model_len}`;
  } catch (e) {
    setHealth("bad", "unreachable");
  }
}

async function pollHealth() {
  try {
    const r = await fetch("/health");
    if (r.ok) {
      if (!state.model) await refreshModel();
      if (state.model) setHealth("ok", "ready");
    } else {
      setHealth("bad", r.status === 503 ? "unavailable" : `HTTP ${r.status}`);
    }
  } catch (e) {
    setHealth("bad", "unreachable");
  }
}

// ── messages ──
function addMessage(role, text) {
  $("empty")?.remove();
  const msg = document.createElement("div");
  msg.className = `msg ${role}`;
  msg.innerHTML = `<div class="avatar">${role === "user" ? "you" : "vx"}</div>
    <div class="body"><div class="who"></div><div class="bubble"></div><div class="meta"></div></div>`;
  msg.querySelector(".who").textContent = role === "user" ? "You" : state.model || "assistant";
  msg.querySelector(".bubble").textContent = text;
  $("messages").appendChild(msg);
  scrollDown();
  return msg;
}

function scrollDown() {
  const box = $("messages");
  if (box.scrollHeight - box.scrollTop - box.clientHeight < 160) box.scrollTop = box.scrollHeight;
}

function chip(label, value, cls = "") {
  const el = document.createElement("span");
  el.className = `chip ${cls}`;
  el.innerHTML = `${label} <b></b>`;
  el.querySelector("b").textContent = value;
  return el;
}

// Timing is measured here, in the browser: TTFT to the first streamed choice, tokens/s over the
// decode phase (first to last token), as `vx bench serve` measures them.
function renderMeta(msg, run) {
  const meta = msg.querySelector(".meta");
  meta.replaceChildren();
  if (run.ttft != null) meta.appendChild(chip("TTFT", `${Math.round(run.ttft)} ms`, "ttft"));
  const decodeS = (run.tLast - run.tFirst) / 1000;
  if (run.tokens > 1 && decodeS > 0) {
    meta.appendChild(chip("speed", `${((run.tokens - 1) / decodeS).toFixed(1)} tok/s`, "tps"));
  }
  if (run.tokens) meta.appendChild(chip("tokens", String(run.tokens), "tokens"));
  if (run.finish) meta.appendChild(chip("finish", run.finish, `finish finish-${run.finish}`));
}

function showError(msg, text) {
  const el = document.createElement("div");
  el.className = "error";
  el.textContent = text;
  msg.querySelector(".body").appendChild(el);
}

// Tool calls the model made (streamed as delta.tool_calls), one card each: name and arguments.
function renderToolCalls(msg, calls) {
  const body = msg.querySelector(".body");
  for (const [i, call] of calls.entries()) {
    if (!call) continue;
    let card = body.querySelector(`.tool-card[data-index="${i}"]`);
    if (!card) {
      card = document.createElement("div");
      card.className = "tool-card";
      card.dataset.index = String(i);
      card.innerHTML = '<div class="tool-name"></div><pre class="tool-args"></pre>';
      body.appendChild(card);
    }
    card.querySelector(".tool-name").textContent = `⚙ ${call.name}`;
    card.querySelector(".tool-args").textContent = call.args;
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = {
    model: state.model || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top_p").value),
    max_tokens: Math.max(1, parseInt($("max_tokens").value, 10) || 256),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  if ($("ignore_eos").checked) body.ignore_eos = true;
  if ($("json_mode").checked) body.response_format = { type: "json_object" };
  const tools = $("tools").value.trim();
  if (tools) {
    body.tools = JSON.parse(tools); // a bad array fails the send with its parse error
    body.tool_choice = $("tool_choice").value;
  }
  return body;
}

async function errorText(r) {
  try {
    const body = await r.json();
    return `HTTP ${r.status}: ${body.error?.message || JSON.stringify(body)}`;
  } catch (e) {
    return `HTTP ${r.status}`;
  }
}

// Parses `data:` lines from the SSE byte stream and hands each JSON payload to onEvent.
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
      if (!line.startsWith("data:")) continue; // blank separators and ": keep-alive" comments
      const payload = line.slice(5).trim();
      if (payload === "[DONE]") return;
      onEvent(JSON.parse(payload));
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

async function send(text) {
  if (state.controller || !text.trim()) return;
  saveSettings();
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const msg = addMessage("assistant", "");
  msg.dataset.state = "streaming";
  const bubble = msg.querySelector(".bubble");
  const run = { t0: performance.now(), ttft: null, tFirst: 0, tLast: 0, tokens: 0, finish: null, text: "", calls: [] };
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let usageTokens = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    let lastPaint = 0;
    await readSSE(r, (event) => {
      if (event.error) throw new Error(event.error.message || "the server reported an error");
      if (event.usage) usageTokens = event.usage.completion_tokens;
      const choice = event.choices && event.choices[0];
      if (!choice) return;
      const now = performance.now();
      if (run.ttft === null) {
        run.ttft = now - run.t0;
        run.tFirst = now;
      }
      for (const tc of choice.delta?.tool_calls || []) {
        const call = (run.calls[tc.index] ||= { name: "", args: "" });
        call.name += tc.function?.name || "";
        call.args += tc.function?.arguments || "";
      }
      const piece = choice.delta?.content;
      if (piece) {
        run.text += piece;
        run.tokens += 1;
        run.tLast = now;
      }
      if (choice.finish_reason) run.finish = choice.finish_reason;
      // Repaint at most every animation frame's worth of time: fast streams stay smooth.
      if (now - lastPaint > 30 || run.finish) {
        lastPaint = now;
        bubble.textContent = run.text;
        renderToolCalls(msg, run.calls);
        renderMeta(msg, run);
        scrollDown();
      }
    });
    if (usageTokens != null) run.tokens = usageTokens;
    msg.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      run.finish = "abort";
      msg.dataset.state = "aborted";
    } else {
      run.finish = run.finish || "error";
      msg.dataset.state = "error";
      showError(msg, e.message);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    bubble.textContent = run.text;
    renderToolCalls(msg, run.calls);
    msg.dataset.finish = run.finish || "";
    msg.dataset.tokens = String(run.tokens);
    renderMeta(msg, run);
    scrollDown();
    if (run.text) state.history.push({ role: "assistant", content: run.text });
  }
}

// ── wiring ──
function autosize() {
  const ta = $("prompt");
  ta.style.height = "auto";
  ta.style.height = `${Math.min(ta.scrollHeight, 200)}px`;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  $("prompt").value = "";
  autosize();
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("prompt").addEventListener("input", autosize);
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", () => {
  state.controller?.abort();
  state.history = [];
  $("messages").replaceChildren();
});
for (const el of document.querySelectorAll(".suggestion")) {
  el.addEventListener("click", () => send(el.textContent));
}
for (const name of SETTINGS) $(name).addEventListener("change", saveSettings);
$("temperature").addEventListener("input", showRangeValues);
$("top_p").addEventListener("input", showRangeValues);
$("api-key").addEventListener("change", () => {
  saveSettings();
  state.model = null;
  pollHealth();
});

loadSettings();
pollHealth();
setInterval(pollHealth, 5000);
$("prompt").focus();
