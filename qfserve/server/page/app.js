// qfserve's chat page: streams answers from /v1/chat/completions, keeps conversations in
// this browser's storage, shows the KV cache's memory live (/v1/status) and shades each
// message by how much of the cache still holds it (kv_cache_detail). Nothing is fetched from
// anywhere but this server.
"use strict";

const STORE = "qfserve.conversations";
const KEY = "qfserve.key"; // sessionStorage: gone with the tab
const SETTINGS = "qfserve.settings";
const POLL_MS = 400;
const FIELDS = ["kv_method", "qfilters_budget", "qfilters_recent", "qfilters_chunk",
  "temperature", "top_p", "max_tokens", "system", "kv_cache_detail"];

const $ = (id) => document.getElementById(id);
const state = {
  conversations: [], current: null, model: null, defaults: {},
  controller: null, poll: null, polling: null, asking: null, streaming: null,
};

// -- storage ---------------------------------------------------------------------------

function load() {
  try { state.conversations = JSON.parse(localStorage.getItem(STORE)) || []; } catch { state.conversations = []; }
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS)) || {};
    for (const name of FIELDS) {
      if (!(name in saved)) continue;
      const el = $(name);
      if (el.type === "checkbox") el.checked = saved[name]; else el.value = saved[name];
    }
  } catch { /* defaults */ }
  state.current = state.conversations.length ? state.conversations[0].id : null;
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state.conversations));
  } catch {
    // Over the storage quota: the shading goes first, the conversations stay.
    for (const c of state.conversations) for (const m of c.messages) delete m.kept;
    try { localStorage.setItem(STORE, JSON.stringify(state.conversations)); } catch { /* full */ }
  }
}

function saveSettings() {
  const saved = {};
  for (const name of FIELDS) {
    const el = $(name);
    saved[name] = el.type === "checkbox" ? el.checked : el.value;
  }
  localStorage.setItem(SETTINGS, JSON.stringify(saved));
}

function conversation() {
  let c = state.conversations.find((x) => x.id === state.current);
  if (!c) {
    c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [], kv: null };
    state.conversations.unshift(c);
    state.current = c.id;
  }
  return c;
}

// -- the server --------------------------------------------------------------------------

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function askKey() {
  // One prompt at a time; Escape (the dialog's cancel) rejects, and the caller says why.
  if (state.asking) return state.asking;
  state.asking = new Promise((resolve, reject) => {
    const dialog = $("key-dialog");
    const form = $("key-form");
    const finish = (ok) => {
      form.removeEventListener("submit", submit);
      dialog.removeEventListener("cancel", cancel);
      if (dialog.open) dialog.close();
      state.asking = null;
      if (ok) resolve(); else reject(new Error("this server needs its API key"));
    };
    const submit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, $("key").value.trim());
      finish(true);
    };
    const cancel = (event) => { event.preventDefault(); finish(false); };
    form.addEventListener("submit", submit);
    dialog.addEventListener("cancel", cancel);
    dialog.showModal();
    $("key").focus();
  });
  return state.asking;
}

async function api(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers(Boolean(options.body)) });
    if (response.status !== 401) return response;
    await askKey(); // a wrong or missing key: ask, then try again
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function connect() {
  const health = await fetch("/health");
  if (!health.ok) {
    showError("the server is not ready: " + (await errorOf(health)));
    setTimeout(connect, 2000);
    return;
  }
  const h = await health.json();
  if (h.api_key_required && !sessionStorage.getItem(KEY)) await askKey();
  const models = await api("/v1/models");
  if (!models.ok) { showError(await errorOf(models)); return; }
  const card = (await models.json()).data[0];
  state.model = card.id;
  $("model").textContent = card.id;
  $("context").textContent = `· context ${card.context_length.toLocaleString()} tokens`;
  showError(null);
  await refreshStatus(null);
}

async function refreshStatus(requestId) {
  const query = requestId ? "?request=" + encodeURIComponent(requestId) : "";
  const response = await api("/v1/status" + query);
  if (!response.ok) return;
  const status = await response.json();
  if (requestId && requestId !== state.polling) return; // the answer ended meanwhile
  state.defaults = status.defaults || {};
  const m = status.memory;
  $("m-server").textContent = `${bytes(m.kv_used_bytes)} of ${bytes(m.max_kv_bytes)}`;
  $("server-meter").value = m.max_kv_bytes ? m.kv_used_bytes / m.max_kv_bytes : 0;
  if (status.request && state.current === state.streaming) showCache(status.request);
}

// -- streaming an answer -------------------------------------------------------------------

function settings() {
  const body = {};
  for (const name of ["kv_method"]) if ($(name).value) body[name] = $(name).value;
  for (const name of ["qfilters_budget", "qfilters_recent", "qfilters_chunk", "max_tokens"]) {
    if ($(name).value !== "") body[name] = parseInt($(name).value, 10);
  }
  for (const name of ["temperature", "top_p"]) if ($(name).value !== "") body[name] = parseFloat($(name).value);
  // A full cache keeps every row: there is nothing to show, and the server says so (400).
  const method = body.kv_method || state.defaults.kv_method;
  if ($("kv_cache_detail").checked && method !== "full") body.kv_cache_detail = true;
  return body;
}

function requestMessages(c) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of c.messages) messages.push({ role: m.role, content: m.content });
  return { messages, offset: system ? 1 : 0 };
}

async function answer() {
  const c = conversation();
  const { messages, offset } = requestMessages(c);
  const reply = { role: "assistant", content: "" };
  c.messages.push(reply);
  render();
  const controller = (state.controller = new AbortController());
  state.streaming = c.id;
  $("messages").setAttribute("aria-busy", "true");
  busy(true);
  showError(null);
  let requestId = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      body: JSON.stringify({ model: state.model, messages, stream: true, ...settings() }),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorOf(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let finished = false;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") { finished = true; continue; }
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (!requestId && chunk.id) { requestId = chunk.id; startPolling(requestId); }
          const choice = chunk.choices && chunk.choices[0];
          if (choice && choice.delta && choice.delta.content) {
            reply.content += choice.delta.content;
            if (state.current === c.id) updateLast(reply);
          }
          if (chunk.kv_cache) {
            c.kv = chunk.kv_cache;
            if (state.current === c.id) showCache(chunk.kv_cache);
          }
          if (chunk.kv_cache_detail) applyDetail(c, chunk.kv_cache_detail, offset);
          if (choice && choice.finish_reason) reply.finish = choice.finish_reason;
        }
      }
    }
    if (!finished) throw new Error("the answer's stream ended early");
  } catch (error) {
    if (error.name === "AbortError") reply.note = "stopped";
    else { reply.note = "failed"; showError(error.message); }
  } finally {
    stopPolling();
    state.controller = null;
    state.streaming = null;
    $("messages").setAttribute("aria-busy", "false");
    busy(false);
    if (c.title === "New chat" && c.messages.length) c.title = c.messages[0].content.slice(0, 40);
    save();
    render();
    refreshStatus(null);
  }
}

function startPolling(requestId) {
  stopPolling();
  state.polling = requestId;
  state.poll = setInterval(() => refreshStatus(requestId).catch(() => {}), POLL_MS);
}

function stopPolling() {
  if (state.poll) clearInterval(state.poll);
  state.poll = null;
  state.polling = null;
}

function applyDetail(c, detail, offset) {
  // detail.messages follows the request's messages; the answer just written is not in it.
  for (const m of c.messages) { delete m.kept; }
  detail.messages.forEach((runs, i) => {
    const m = c.messages[i - offset];
    if (m && runs) { m.kept = runs; m.heads = detail.layer_heads; }
  });
}

// -- showing it ------------------------------------------------------------------------------

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function showCache(kv) {
  $("m-method").textContent = kv.budget !== undefined && kv.method !== "full" ? `${kv.method}, budget ${kv.budget}` : kv.method;
  $("m-seen").textContent = kv.tokens_seen.toLocaleString();
  $("m-kept").textContent = kv.tokens_kept.toLocaleString();
  const share = kv.tokens_seen ? kv.tokens_kept / kv.tokens_seen : 1;
  $("kept-share").textContent = `${Math.round(100 * share)}%`;
  $("m-bytes").textContent = `${bytes(kv.kept_bytes)} of ${bytes(kv.full_seq_bytes)} (full cache)`;
  $("bytes-meter").value = kv.full_seq_bytes ? kv.kept_bytes / kv.full_seq_bytes : 0;
}

function showError(text) {
  const el = $("error");
  el.hidden = !text;
  el.textContent = text || "";
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("regenerate").disabled = on || !conversation().messages.some((m) => m.role === "assistant");
}

function shaded(m) {
  const p = document.createElement("p");
  p.className = "content";
  if (!m.kept) { p.textContent = m.content; return p; }
  const chars = Array.from(m.content); // the server counts code points, not UTF-16 units
  let at = 0;
  for (const [count, length] of m.kept) {
    const span = document.createElement("span");
    span.className = count ? "kept" : "kept none";
    span.dataset.count = count;
    span.title = `held by ${count} of ${m.heads} layer × KV-head caches`;
    span.style.backgroundColor = `rgba(11, 92, 173, ${(0.45 * count / m.heads).toFixed(3)})`;
    span.textContent = chars.slice(at, at + length).join("");
    p.append(span);
    at += length;
  }
  if (at < chars.length) p.append(chars.slice(at).join(""));
  return p;
}

function heldShare(m) {
  // The same figure in words, for whoever cannot see the shading's colours.
  let held = 0, total = 0;
  for (const [count, length] of m.kept) { held += count * length; total += length; }
  return total ? Math.round((100 * held) / (total * m.heads)) : 100;
}

function messageElement(m) {
  const div = document.createElement("div");
  div.className = "message " + m.role;
  const role = document.createElement("p");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant";
  div.append(role, shaded(m));
  if (m.kept) {
    const held = document.createElement("p");
    held.className = "note held";
    held.textContent = `the cache holds ${heldShare(m)}% of this message's rows (layers × KV heads)`;
    div.append(held);
  }
  if (m.note) {
    const note = document.createElement("p");
    note.className = "note";
    note.textContent = m.note === "stopped" ? "stopped" : "the answer failed";
    div.append(note);
  }
  return div;
}

function render() {
  const c = conversation();
  const list = $("messages");
  list.replaceChildren(...c.messages.map(messageElement));
  list.scrollTop = list.scrollHeight;
  const nav = $("conversations");
  nav.replaceChildren(...state.conversations.map((x) => {
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = x.title || "New chat";
    open.setAttribute("aria-current", String(x.id === state.current));
    open.addEventListener("click", () => { state.current = x.id; render(); });
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete conversation: ${x.title || "New chat"}`);
    remove.addEventListener("click", () => {
      state.conversations = state.conversations.filter((y) => y.id !== x.id);
      if (state.current === x.id) state.current = state.conversations.length ? state.conversations[0].id : null;
      save();
      render();
    });
    li.append(open, remove);
    return li;
  }));
  if (c.kv) showCache(c.kv);
  if (!state.controller) busy(false);
}

function updateLast(reply) {
  const list = $("messages");
  const last = list.lastElementChild;
  if (last) last.replaceWith(messageElement(reply));
  list.scrollTop = list.scrollHeight;
}

// -- what the user does ------------------------------------------------------------------------

function send(event) {
  if (event) event.preventDefault();
  const text = $("input").value;
  if (!text.trim() || state.controller || !state.model) return;
  const c = conversation();
  c.messages.push({ role: "user", content: text });
  $("input").value = "";
  answer();
}

function stop() {
  if (state.controller) state.controller.abort();
}

function regenerate() {
  const c = conversation();
  if (state.controller || !c.messages.length) return;
  while (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  if (c.messages.length) answer();
}

document.addEventListener("DOMContentLoaded", () => {
  load();
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape" && state.controller) stop(); });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => {
    state.current = null;
    conversation();
    save();
    render();
    $("input").focus();
  });
  for (const name of FIELDS) $(name).addEventListener("change", saveSettings);
  render();
  connect().catch((error) => showError(error.message));
});
