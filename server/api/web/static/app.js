// linserve's page: playground, sessions, server view. Plain JavaScript, no build step, nothing fetched from
// anywhere but this server. Everything the server or the user wrote is put into the page as text
// (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "linserve-api-key"; // this tab only (sessionStorage), sent only to this server

// ------------------------------------------------------------------ talking to the server
function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function failure(response) {
  try {
    const body = await response.json();
    return new Error(`${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`);
  } catch (_) {
    return new Error(`${response.status} ${response.statusText}`);
  }
}

async function api(path, options = {}) {
  let response = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  if (response.status === 401 && askForKey()) {  // the server has keys: ask once, keep it for this tab
    response = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  }
  if (!response.ok) throw await failure(response);
  return response.status === 204 ? null : response.json();
}

// A 401: ask for the key (kept in this tab's sessionStorage, as the field is); false if none was given.
function askForKey() {
  const key = window.prompt("This server needs an API key:", $("api-key").value);
  if (!key || !key.trim()) return false;
  $("api-key").value = key.trim();
  sessionStorage.setItem(KEY_STORE, key.trim());
  return true;
}

// POST `body` with stream: true; `onEvent(json)` for every SSE data event until [DONE].
async function stream(path, body, onEvent, signal) {
  const send = () => fetch(path, {
    method: "POST", headers: headers(), body: JSON.stringify({ ...body, stream: true }), signal,
  });
  let response = await send();
  if (response.status === 401 && askForKey()) response = await send();
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const json = JSON.parse(data);
        if (json.error) throw new Error(json.error.message);
        onEvent(json);
      }
    }
  }
}

// ------------------------------------------------------------------ playground
let running = null; // the AbortController of the stream in flight

function number(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function requestBody(maxTokens, ignoreEos) {
  const body = { max_tokens: maxTokens, temperature: number("temperature"), top_p: number("top-p"),
                 top_k: number("top-k"), seed: number("seed"), ignore_eos: ignoreEos };
  const stop = $("stop-text").value;
  if (stop) body.stop = [stop];
  for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
  return body;
}

async function generate(maxTokens, ignoreEos) {
  const chat = $("mode").value === "chat";
  const body = requestBody(maxTokens, ignoreEos);
  if (chat) body.messages = [{ role: "user", content: $("prompt").value }];
  else body.prompt = $("prompt").value;
  const output = textSink($("output"), chat ? "" : $("prompt").value);
  resetChart();
  drawChart();
  running = new AbortController();
  setRunning(true, "streaming…");
  try {
    await stream(chat ? "/v1/chat/completions" : "/v1/completions", body, (event) => {
      const choice = event.choices && event.choices[0];
      if (!choice) return;
      const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
      if (text) output.add(text); // into a text node: whatever the model writes stays text
      // one event per token; not a token: chat's opening role event, a finish event that carries nothing
      const opening = chat && choice.delta && choice.delta.role;
      const bareFinish = choice.finish_reason && choice.finish_reason !== "length" && !text;
      if (!opening && !bareFinish) tokenArrived();
    }, running.signal);
    drawChart();
    setRunning(false, "done");
  } catch (error) {
    drawChart();
    setRunning(false, error.name === "AbortError" ? "stopped" : "error: " + error.message);
  }
}

function setRunning(on, message) {
  $("generate").disabled = $("long-run").disabled = on;
  $("stop").disabled = !on;
  $("status").textContent = message;
  if (!on) running = null;
}

// ------------------------------------------------------------------ sessions
let sessionsAfter = null, openSession = null;

async function listSessions(more = false) {
  const query = new URLSearchParams({ limit: "20" });
  if (more && sessionsAfter) query.set("after", sessionsAfter);
  const page = await api("/v1/sessions?" + query);
  $("sessions-error").hidden = true;
  const body = $("session-list").tBodies[0];
  if (!more) body.replaceChildren();
  for (const s of page.data) {
    const row = body.insertRow();
    row.dataset.id = s.id;
    const link = document.createElement("button");
    link.type = "button";
    link.className = "link";
    link.textContent = s.id;
    link.addEventListener("click", () => showSession(s.id).catch(report));
    row.insertCell().append(link);
    for (const value of [s.tokens, s.state_bytes.toLocaleString("en"), s.tier, clockTime(s.last_used)]) {
      row.insertCell().textContent = String(value);
    }
  }
  sessionsAfter = page.last_id;
  $("more-sessions").hidden = !page.has_more;
}

function clockTime(unixSeconds) {
  return new Date(unixSeconds * 1000).toLocaleTimeString();
}

// A session's text comes from the server (each turn's prompt and completion, as the session keeps them), so
// what is shown under a session is that session's, whichever was opened before.
async function showSession(id) {
  const [info, turns] = await Promise.all([api(`/v1/sessions/${id}`), api(`/v1/sessions/${id}/turns`)]);
  openSession = id;
  $("session-detail").hidden = false;
  $("session-title").textContent = id;
  $("session-info").textContent = `${info.tokens} tokens · state ${info.state_bytes.toLocaleString("en")} bytes `
    + `(the same at any length) · tier ${info.tier}`;
  const list = $("turns"), output = $("session-output");
  list.replaceChildren();
  output.replaceChildren();
  if (turns.length && turns[0].prompt === null && turns[0].turn > 1) output.append("(earlier text not kept)\n");
  for (const t of turns) {
    if (t.prompt !== null) output.append(t.prompt, t.completion);
    const item = document.createElement("li");
    item.append(t.turn ? `turn ${t.turn}: ${t.tokens} tokens ` : `before the fork or import: ${t.tokens} tokens`);
    if (t.rewindable) {
      const rewind = document.createElement("button");
      rewind.type = "button";
      rewind.textContent = "rewind here";
      rewind.addEventListener("click", () => rewindTo(id, t.turn).catch(report));
      item.append(rewind);
    }
    list.append(item);
  }
}

async function continueSession() {
  const id = openSession, output = $("session-output");
  const body = { prompt: $("session-input").value, max_tokens: number("session-max-tokens") };
  output.append($("session-input").value);
  $("session-input").value = "";
  await stream(`/v1/sessions/${id}/completions`, body, (event) => {
    const choice = event.choices && event.choices[0];
    if (choice && choice.text) output.append(choice.text);
  });
  await showSession(id);
  await listSessions();
}

async function rewindTo(id, turn) {
  await api(`/v1/sessions/${id}/rewind`, { method: "POST", body: JSON.stringify({ turn }) });
  await showSession(id);
  await listSessions();
}

function report(error) {
  $("sessions-error").textContent = "error: " + error.message;  // shown above the list: never an empty list
  $("sessions-error").hidden = false;
}

// ------------------------------------------------------------------ server view
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const pair of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

function bucketQuantile(buckets, q) { // upper bound of the bucket holding quantile q
  const total = buckets.length ? buckets[buckets.length - 1].count : 0;
  const hit = buckets.find((b) => b.count >= q * total);
  return total && hit ? hit.le : NaN;
}

async function refreshServer() {
  const [models, ready, metricsText] = await Promise.all([
    api("/v1/models"), fetch("/ready").then((r) => r.json()),
    fetch("/metrics", { headers: headers(false) }).then((r) => r.text()),
  ]);
  const samples = parseMetrics(metricsText);
  const one = (name, label) => samples.find((s) => s.name === name && (!label || s.labels[label[0]] === label[1]));
  const perSession = one("linserve_state_bytes_per_session").value;
  const drafted = one("linserve_spec_draft_tokens_total").value;
  const accepted = one("linserve_spec_accepted_tokens_total").value;
  const facts = {
    model: models.data.map((m) => m.id).join(", "),
    device: ready.device || "?",
    "decode step": ready.decode_step ? `${ready.decode_step.status} (compile ${ready.decode_step.compile})` : "-",
    "slots in use": `${one("linserve_state_pool_bytes", ["kind", "in_use"]).value / perSession} of `
      + `${one("linserve_state_pool_bytes", ["kind", "total"]).value / perSession}`,
    "state bytes per session": perSession.toLocaleString("en"),
    running: one("linserve_requests_running").value,
    waiting: one("linserve_requests_waiting").value,
    sessions: ["device", "host", "store"].map((t) => `${t} ${one("linserve_sessions", ["tier", t]).value}`).join(", "),
    "speculative acceptance": drafted
      ? `${(100 * accepted / drafted).toFixed(1)}% (${accepted.toLocaleString("en")} of ${drafted.toLocaleString("en")} drafted tokens)`
      : "- (nothing drafted yet)",
  };
  const list = $("server-facts");
  list.replaceChildren();
  for (const [k, v] of Object.entries(facts)) {
    const term = document.createElement("dt"), detail = document.createElement("dd");
    term.textContent = k;
    detail.textContent = String(v);
    detail.dataset.fact = k;
    list.append(term, detail);
  }
  const body = $("itl-buckets").tBodies[0];
  body.replaceChildren();
  for (const context of ["0-1k", "1k-4k", "4k-16k", "16k-64k", "64k+"]) {
    const mine = samples.filter((s) => s.labels.context === context);
    const count = mine.find((s) => s.name.endsWith("_count")).value;
    const sum = mine.find((s) => s.name.endsWith("_sum")).value;
    const buckets = mine.filter((s) => s.name.endsWith("_bucket"))
      .map((s) => ({ le: Number(s.labels.le), count: s.value })).sort((a, b) => a.le - b.le);
    const ms = (v) => (Number.isFinite(v) ? (v * 1000).toFixed(2) : "-");
    const row = body.insertRow();
    row.dataset.context = context;
    for (const v of [context, count, count ? ms(sum / count) : "-", ms(bucketQuantile(buckets, 0.5)),
                     ms(bucketQuantile(buckets, 0.99))]) row.insertCell().textContent = String(v);
  }
}

// ------------------------------------------------------------------ wiring
function showTab(name) {
  for (const button of document.querySelectorAll("nav button")) button.classList.toggle("active", button.dataset.tab === name);
  for (const tab of document.querySelectorAll(".tab")) tab.hidden = tab.id !== "tab-" + name;
  if (name === "sessions") listSessions().catch(report);
  if (name === "server") refreshServer().catch((e) => { $("server-facts").textContent = "error: " + e.message; });
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("input", () => sessionStorage.setItem(KEY_STORE, $("api-key").value));
  for (const button of document.querySelectorAll("nav button")) {
    button.addEventListener("click", () => showTab(button.dataset.tab));
  }
  $("generate").addEventListener("click", () => generate(number("max-tokens"), false));
  $("long-run").addEventListener("click", () => generate(8192, true));
  $("stop").addEventListener("click", () => running && running.abort());
  $("new-session").addEventListener("click", async () => {
    try {
      const made = await api("/v1/sessions", { method: "POST", body: JSON.stringify({ prompt: $("new-session-prompt").value }) });
      $("new-session-prompt").value = "";
      await listSessions();
      await showSession(made.id);
    } catch (error) { report(error); }
  });
  $("refresh-sessions").addEventListener("click", () => listSessions().catch(report));
  $("more-sessions").addEventListener("click", () => listSessions(true).catch(report));
  $("session-continue").addEventListener("click", () => continueSession().catch(report));
  for (const [box, send] of [["new-session-prompt", "new-session"], ["session-input", "session-continue"]]) {
    $(box).addEventListener("keydown", (event) => {  // Ctrl+Enter sends; Enter is a new line
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); $(send).click(); }
    });
  }
  $("session-fork").addEventListener("click", async () => {
    try {
      const fork = await api(`/v1/sessions/${openSession}/fork`, { method: "POST" });
      await listSessions();
      await showSession(fork.id);
    } catch (error) { report(error); }
  });
  $("session-delete").addEventListener("click", async () => {
    try {
      await api(`/v1/sessions/${openSession}`, { method: "DELETE" });
      $("session-detail").hidden = true;
      openSession = null;
      await listSessions();
    } catch (error) { report(error); }
  });
  $("refresh-server").addEventListener("click", () => showTab("server"));
  resetChart();
  drawChart();
});
