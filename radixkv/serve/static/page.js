// The live page of radixkv's cache: a chat panel over /v1/chat/completions and the tree,
// gauges and last request pushed by /ui/events. Every text reaches the DOM through
// textContent (el() below), never as HTML: prompts and replies may hold markup.
"use strict";

const HISTORY = 120; // points per gauge
const GHOST_MS = 2000; // an evicted node fades out for this long
const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---------------------------------------------------------------- the tree

const view = {
  snapshot: null,
  known: new Map(), // node id -> node of the previous snapshot
  ghosts: new Map(), // node id -> {node, until, why}
  fresh: new Map(), // node id -> "new" | "split", until the next snapshot
  lastOffloaded: 0,
  lastSeq: 0,
};

function onSnapshot(snap) {
  const offloaded = snap.gauges.offloaded_blocks;
  const why = offloaded > view.lastOffloaded ? "→ host" : "evicted";
  const now = Date.now();
  const ids = new Map(snap.tree.nodes.map((n) => [n.id, n]));
  const folded = new Set(snap.tree.folded.map((f) => f.parent));
  view.fresh = new Map();
  if (view.snapshot) {
    for (const [id, old] of view.known) {
      // A node not listed under a parent that folds children may only be folded away.
      if (!ids.has(id) && !folded.has(old.parent)) view.ghosts.set(id, { node: old, until: now + GHOST_MS, why });
    }
    for (const n of snap.tree.nodes) {
      const old = view.known.get(n.id);
      if (!old) view.fresh.set(n.id, "new");
      else if (old.start !== n.start) view.fresh.set(n.id, "split");
    }
  }
  for (const id of ids.keys()) view.ghosts.delete(id);
  view.known = ids;
  view.lastOffloaded = offloaded;
  view.snapshot = snap;
  render();
  if (view.ghosts.size) setTimeout(render, GHOST_MS + 50);
}

function render() {
  const snap = view.snapshot;
  if (!snap) return;
  const now = Date.now();
  for (const [id, g] of view.ghosts) if (g.until <= now) view.ghosts.delete(id);
  $("model").textContent = snap.model;
  renderTotals(snap);
  renderGauges(snap.gauges);
  renderWindow(snap.window_layers);
  renderState(snap.state_layers);
  renderTree(snap);
}

function pathClasses(snap) {
  // node id -> class: "hit" up to the last request's cached tokens, "computed" after them;
  // "branch" where the hit ended at a fork (the node has another child than the path's)
  const classes = new Map();
  const req = snap.last_request;
  if (!req) return classes;
  const byId = new Map(snap.tree.nodes.map((n) => [n.id, n]));
  const children = new Map();
  for (const n of snap.tree.nodes) if (n.parent !== null) children.set(n.parent, (children.get(n.parent) || 0) + 1);
  for (const f of snap.tree.folded) children.set(f.parent, (children.get(f.parent) || 0) + f.subtrees);
  for (const id of snap.tree.path) {
    const n = byId.get(id);
    if (!n) continue;
    let cls = n.start < req.cached_tokens ? "hit" : "computed";
    const fork = (children.get(id) || 0) >= 2;
    if (n.end === req.cached_tokens && n.start < req.cached_tokens && fork) cls += " branch";
    classes.set(id, cls);
  }
  return classes;
}

function renderTree(snap) {
  const children = new Map();
  const add = (parent, item) => {
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(item);
  };
  let root = null;
  for (const n of snap.tree.nodes) {
    if (n.parent === null) root = n;
    else add(n.parent, { kind: "node", n });
  }
  const tree = $("tree");
  if (!root) {
    tree.replaceChildren(el("li", "folded", "(empty tree)"));
    return;
  }
  for (const [id, g] of view.ghosts) {
    add(view.known.has(g.node.parent) ? g.node.parent : root.id, { kind: "ghost", n: g.node, why: g.why });
  }
  for (const f of snap.tree.folded) add(f.parent, { kind: "folded", f });
  const classes = pathClasses(snap);
  const build = (id) => {
    const items = children.get(id) || [];
    items.sort((a, b) => (a.kind === "folded") - (b.kind === "folded") || (a.n && b.n ? a.n.start - b.n.start || a.n.id - b.n.id : 0));
    const ul = el("ul");
    for (const item of items) {
      if (item.kind === "folded") {
        const f = item.f;
        ul.append(el("li", "folded", `+ ${f.subtrees} more subtree(s): ${f.nodes} nodes, ${f.tokens} tokens`));
        continue;
      }
      const li = nodeItem(item.n, item.kind === "ghost" ? "gone" : classes.get(item.n.id) || "", item);
      if (item.kind === "node" && children.has(item.n.id)) li.append(build(item.n.id));
      ul.append(li);
    }
    return ul;
  };
  const top = build(root.id);
  tree.replaceChildren(...top.childNodes);
}

function nodeItem(n, cls, item) {
  const li = el("li", "node");
  li.dataset.id = String(n.id);
  li.dataset.start = String(n.start);
  li.dataset.end = String(n.end);
  for (const c of cls.split(" ")) if (c) li.classList.add(c);
  if (n.locks > 0) li.classList.add("locked");
  const fresh = view.fresh.get(n.id);
  if (fresh) li.classList.add("new");
  const row = el("div", "row");
  const tokens = n.end - n.start;
  let meta = `#${n.id} [${n.start},${n.end}) ${tokens} tok · ${n.shared_head ? "~" : ""}${n.blocks} blk`;
  meta += n.locks ? ` · locked ×${n.locks}` : " · unlocked";
  meta += n.recency ? ` · ${n.recency} use(s) before the latest` : " · latest use";
  if (n.host) meta += ` · ${n.host} on host`;
  if (n.snapshots) {
    li.classList.add("snapshot");
    meta += ` · ${n.snapshots} snapshot${n.snapshots > 1 ? "s" : ""}`;
  }
  if (item.kind === "ghost") meta += ` · ${item.why}`;
  if (fresh === "split") meta += ` · split at ${n.start}`;
  row.append(el("span", "meta", meta + "  "));
  if (n.text) row.append(el("span", "text", n.text.replace(/\n/g, "⏎")));
  li.append(row);
  return li;
}

function renderTotals(snap) {
  const g = snap.gauges;
  $("hit-tokens").textContent = String(g.cached_tokens);
  $("prompt-tokens").textContent = String(g.prompt_tokens);
  $("node-count").textContent = String(snap.tree.num_nodes);
  $("token-count").textContent = String(snap.tree.num_tokens);
  const req = snap.last_request;
  let line = "no request yet";
  if (req) {
    line = `last request: ${req.prompt_tokens} prompt tokens, ${req.cached_tokens} cached, ${req.prompt_tokens - req.cached_tokens} computed`;
    if (req.cut_reason) line += ` (${req.cut_reason})`;
  }
  $("last-request").textContent = line;
}

// ---------------------------------------------------------------- gauges

const series = new Map(); // gauge id -> values

function pct(used, total) {
  return total > 0 ? (100 * used) / total : 0;
}

function renderGauges(g) {
  const tps = g.tokens_per_s; // the server's, over its last couple of seconds
  const values = {
    "g-hit": [100 * g.hit_rate, `${(100 * g.hit_rate).toFixed(1)}%`],
    "g-device": [pct(g.device_used, g.blocks), `${g.device_used}/${g.blocks} blk`],
    "g-host": [pct(g.host_used, g.host_blocks), g.host_blocks ? `${g.host_used}/${g.host_blocks} blk` : "off"],
    "g-disk": [pct(g.disk_bytes, g.disk_budget), g.disk_budget ? `${(g.disk_bytes / 2 ** 20).toFixed(1)} MiB` : "off"],
    "g-evicted": [g.evicted_blocks, String(g.evicted_blocks)],
    "g-queue": [g.queue + g.running, `${g.queue} · ${g.running}`],
    "g-tps": [tps, tps.toFixed(1)],
  };
  for (const [id, [value, text]] of Object.entries(values)) {
    const box = $(id);
    box.querySelector(".value").textContent = text;
    box.dataset.value = String(value);
    const s = series.get(id) || [];
    s.push(value);
    if (s.length > HISTORY) s.shift();
    series.set(id, s);
    spark(box.querySelector("canvas"), s, id === "g-evicted" || id === "g-queue" || id === "g-tps" ? null : 100);
  }
}

// ---------------------------------------------------------------- the window layers

function mib(bytes) {
  return (bytes / 2 ** 20).toFixed(2);
}

function renderWindow(w) {
  // A model with window layers has a second KV group: its rows go below the gauges, which
  // then are labelled as the full layers'. A full-attention model's page has neither.
  if (!w) return;
  if (!$("window-panel")) {
    const full = el("div", "group-label", "full layers");
    full.id = "full-label";
    const panel = el("div");
    panel.id = "window-panel";
    $("gauges").before(full);
    $("gauges").after(panel);
  }
  const d = w.device;
  const rows = [
    ["w-device", "device", d, `${d.in_use} in use · ${d.tails} in tails · ${d.free} free of ${d.blocks} blk`],
  ];
  const h = w.host;
  const hostText = h
    ? `${h.held}/${h.blocks} blk · loaded ${h.loaded_blocks} · offloaded ${h.offloaded_blocks} · ` +
      `moved ${mib(h.moves.load.bytes + h.moves.offload.bytes)} MiB`
    : "off";
  rows.push(["w-host", "host", h, hostText]);
  const k = w.disk;
  const diskText = k
    ? `${k.files} files, ${mib(k.bytes)}/${mib(k.budget)} MiB · read ${k.read_blocks} · ` +
      `written ${k.written_blocks} · moved ${mib(k.moves.disk_read.bytes + k.moves.disk_write.bytes)} MiB`
    : "off";
  rows.push(["w-disk", "disk", k, diskText]);
  const items = rows.map(([id, label, figures, text]) => {
    const row = el("div", "window-row");
    row.id = id;
    // the row's numbers, as attributes too (data-held, data-in_use, ...): tests read them
    for (const [key, value] of Object.entries(figures || {})) {
      if (typeof value === "number") row.dataset[key] = String(value);
    }
    row.append(el("span", "label", label), el("span", "value", text));
    return row;
  });
  $("window-panel").replaceChildren(el("div", "group-label", `window layers (${w.window} tokens)`), ...items);
}

// ---------------------------------------------------------------- the recurrent layers

function figureRows(rows) {
  return rows.map(([id, label, figures, text]) => {
    const row = el("div", "window-row");
    row.id = id;
    // the row's numbers, as attributes too (data-held, data-running, ...): tests read them
    for (const [key, value] of Object.entries(figures || {})) {
      if (typeof value === "number") row.dataset[key] = String(value);
    }
    row.append(el("span", "label", label), el("span", "value", text));
    return row;
  });
}

function renderState(s) {
  // A hybrid model's recurrent layers keep one state per request and snapshots of it where
  // later requests resume: their rows go below the gauges (and the window layers' panel).
  if (!s) return;
  if (!$("state-panel")) {
    const panel = el("div");
    panel.id = "state-panel";
    ($("window-panel") || $("gauges")).after(panel);
  }
  const d = s.device;
  const hits = s.hits;
  const rows = [
    ["s-device", "device", d, `${d.running} running · ${d.snapshots} snapshots (${mib(d.bytes)} MiB) · ${d.free} free of ${d.slots} slots`],
    ["s-hits", "hits", hits, `${hits.hits} resumed from a snapshot (${hits.tokens} tokens)` + (s.host ? ` · ${hits.lower} from host or disk` : "")],
  ];
  const h = s.host;
  const hostText = h
    ? `${h.held}/${h.snapshots} snapshots · loaded ${h.loaded} · offloaded ${h.offloaded} · ` +
      `moved ${mib(h.moves.load.bytes + h.moves.offload.bytes)} MiB`
    : "off";
  rows.push(["s-host", "host", h, hostText]);
  const k = s.disk;
  const diskText = k
    ? `${k.files} files, ${mib(k.bytes)}/${mib(k.budget)} MiB · read ${k.read} · written ${k.written}`
    : "off";
  rows.push(["s-disk", "disk", k, diskText]);
  $("state-panel").replaceChildren(el("div", "group-label", "recurrent state snapshots"), ...figureRows(rows));
}

function spark(canvas, values, top) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width;
  const h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const max = top || Math.max(1, ...values);
  ctx.strokeStyle = "#3b6fd1";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = values.length > 1 ? (i * (w - 2)) / (HISTORY - 1) + 1 : 1;
    const y = h - 2 - (v / max) * (h - 4);
    if (i === 0) ctx.moveTo(x, y);
    else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

// ---------------------------------------------------------------- the stream

function connect() {
  const source = new EventSource("/ui/events");
  source.addEventListener("snapshot", (e) => {
    $("status").textContent = "live";
    $("status").classList.add("live");
    onSnapshot(JSON.parse(e.data));
  });
  source.onerror = () => {
    $("status").textContent = "reconnecting…";
    $("status").classList.remove("live");
  };
}

// ---------------------------------------------------------------- the chat

const chat = { messages: [], busy: false };

function addMessage(role, text) {
  const box = el("div", `msg ${role}`);
  box.append(el("span", "who", role === "user" ? "you" : role));
  const body = el("span", "body", text);
  box.append(body);
  $("chat-log").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, body };
}

function statsLine(usage, ttftMs, finishReason) {
  const line = el("div", "reply-stats");
  const prompt = usage.prompt_tokens;
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  line.append(el("span", "", `prompt ${prompt} tok · `));
  line.append(el("span", "cached", `cached ${cached}`));
  line.append(el("span", "", " · "));
  line.append(el("span", "computed", `computed ${prompt - cached}`));
  line.append(el("span", "", ` · ttft ${Math.round(ttftMs)} ms · reply ${usage.completion_tokens} tok`));
  if (finishReason === "length") line.append(el("span", "cut", " · cut at the token limit"));
  return line;
}

async function send(text) {
  chat.busy = true;
  $("send").disabled = true;
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.box.classList.add("streaming");
  const started = performance.now();
  let ttft = null;
  let usage = null;
  let finishReason = null;
  let content = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: view.snapshot ? view.snapshot.model : undefined,
        messages: chat.messages,
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: Number($("max-tokens").value) || 64,
        temperature: temperature(),
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
    }
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.finish_reason) finishReason = choice.finish_reason;
      const delta = choice && choice.delta;
      if (delta && delta.content) {
        if (ttft === null) ttft = performance.now() - started;
        content += delta.content;
        reply.body.textContent = content;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    chat.messages.push({ role: "assistant", content });
    if (finishReason === "length") reply.box.classList.add("cut");
    if (usage) reply.box.append(statsLine(usage, ttft === null ? performance.now() - started : ttft, finishReason));
  } catch (err) {
    chat.messages.pop(); // the turn is not kept
    reply.box.classList.add("error");
    reply.body.textContent = `error: ${err.message}`;
  } finally {
    reply.box.classList.remove("streaming");
    reply.box.classList.add("done");
    chat.busy = false;
    $("send").disabled = false;
  }
}

function temperature() {
  const text = $("temperature").value.trim();
  return text === "" ? undefined : Number(text); // empty: the server's default
}

async function* events(response) {
  // Server-sent events of a fetch body: "data: {...}" records separated by blank lines.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const record = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of record.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function setUpChat() {
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value.trim();
    if (!text || chat.busy) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("new-chat").addEventListener("click", () => {
    if (chat.busy) return;
    chat.messages = [];
    $("chat-log").replaceChildren();
  });
}

setUpChat();
connect();
