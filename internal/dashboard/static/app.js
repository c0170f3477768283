// dsec's dashboard: a client of the public API (Connect's JSON protocol).
// Everything a sandbox controls (labels, output, file names) is untrusted:
// the page builds its DOM with text nodes only, never HTML strings.
"use strict";

const keyName = "dsec-api-key";
let timers = [];

function key() { return sessionStorage.getItem(keyName) || ""; }

// el builds an element: attrs are properties (on* are listeners), children
// strings (as text) or nodes.
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e[k] = v;
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs, ...children) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

class Unauthorized extends Error {}

// rpc calls a unary procedure of the native API.
async function rpc(service, method, body) {
  const res = await fetch(`/dsec.v1.${service}/${method}`, {
    method: "POST",
    headers: { "Content-Type": "application/json", "Connect-Protocol-Version": "1", "Authorization": "Bearer " + key() },
    body: JSON.stringify(body || {}),
  });
  if (res.status === 401) throw new Unauthorized("the key was refused");
  const data = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(data.message || res.statusText);
  return data;
}

function when(ts) { return ts ? new Date(ts).toLocaleString() : "-"; }
function bytes(n) {
  n = Number(n || 0);
  for (const u of ["B", "KiB", "MiB", "GiB"]) {
    if (n < 1024 || u === "GiB") return (u === "B" ? n : n.toFixed(1)) + " " + u;
    n /= 1024;
  }
}
function b64text(s) {
  if (!s) return "";
  try { return new TextDecoder().decode(Uint8Array.from(atob(s), c => c.charCodeAt(0))); } catch { return "(binary)"; }
}
function labelText(labels) { return Object.entries(labels || {}).map(([k, v]) => `${k}=${v}`).join(", "); }

function show(...nodes) {
  const view = document.getElementById("view");
  view.replaceChildren(...nodes);
}

function every(ms, f) { f(); timers.push(setInterval(f, ms)); }

// Routes.

async function overview() {
  const cards = el("div", { class: "cards", id: "cards" });
  const nodes = el("tbody");
  const rates = el("p", { id: "rates" });
  show(el("h1", {}, "Overview"), cards, el("h2", {}, "Rates"), rates,
    el("h2", {}, "Nodes"),
    el("table", { id: "nodes" }, el("thead", {}, el("tr", {}, ["Node", "State", "Kinds", "Sandboxes", "CPUs", "Memory"].map(h => el("th", {}, h)))), nodes));
  const [info, cap] = await Promise.all([rpc("SystemService", "GetInfo"), rpc("SystemService", "GetCapacity")]);
  const card = (label, value, id) => el("div", { class: "card", id }, el("b", {}, value), label);
  cards.replaceChildren(
    card("running", cap.running || 0, "running"), card("free slots", cap.freeSlots || 0),
    card("waiting to start", cap.queueDepth || 0), card("starts/s", Number(cap.startsPerS || 0).toFixed(1)),
    card("nodes", (info.nodes || []).length));
  nodes.replaceChildren(...(info.nodes || []).map(n => el("tr", {},
    el("td", {}, n.name), el("td", {}, n.state || "ready"),
    el("td", {}, (n.kinds || []).filter(k => k.available).map(k => k.kind).join(", ")),
    el("td", {}, `${n.sandboxes || 0} / ${n.maxSandboxes || 0}`), el("td", {}, n.cpuCores || ""), el("td", {}, bytes((n.memoryMb || 0) * 1048576)))));
  // Rates come from the metrics (an operator's key): two scrapes apart.
  let last = null;
  every(5000, async () => {
    const res = await fetch("/metrics", { headers: { "Authorization": "Bearer " + key() } });
    if (!res.ok) { rates.textContent = "Rates need an operator's (admin) key."; return; }
    const now = { t: Date.now(), c: countsOf(await res.text()) };
    if (last) {
      const dt = (now.t - last.t) / 1000;
      const rate = k => (((now.c[k] || 0) - (last.c[k] || 0)) / dt).toFixed(2);
      rates.textContent = `creates/s ${rate("create/ok")} (failed ${rate("create/error")}, infra ${rate("create/infra")}) · ` +
        `execs/s ${rate("exec/ok")} (failed ${rate("exec/error")}, infra ${rate("exec/infra")})`;
    } else rates.textContent = "measuring…";
    last = now;
  });
}

// countsOf sums dsec_sandbox_operation_duration_seconds_count by
// operation/outcome from a text exposition.
function countsOf(text) {
  const out = {};
  const re = /^dsec_sandbox_operation_duration_seconds_count\{([^}]*)\} ([0-9.e+]+)$/gm;
  for (const m of text.matchAll(re)) {
    const l = Object.fromEntries([...m[1].matchAll(/(\w+)="([^"]*)"/g)].map(x => [x[1], x[2]]));
    const k = `${l.operation}/${l.outcome}`;
    out[k] = (out[k] || 0) + Number(m[2]);
  }
  return out;
}

async function sandboxes(params) {
  const f = { state: params.get("state") || "", kind: params.get("kind") || "", labels: params.get("labels") || "", session: params.get("session") || "" };
  const input = (name, placeholder) => el("label", {}, name, el("input", { name, value: f[name], placeholder }));
  const select = (name, options) => el("label", {}, name, el("select", { name },
    options.map(o => el("option", { value: o, selected: o === f[name] }, o || "any"))));
  const form = el("form", { class: "filters", id: "filters", onsubmit: e => {
    e.preventDefault();
    const q = new URLSearchParams(new FormData(form));
    for (const [k, v] of [...q]) if (!v) q.delete(k);
    location.hash = "#/sandboxes?" + q;
  } }, select("state", ["", "running", "paused"]), select("kind", ["", "container", "microvm", "vm", "function"]),
  input("labels", "job=rollout-7,step!=3"), input("session", "trainer session"), el("button", { type: "submit" }, "Filter"));
  const rows = el("tbody");
  const more = el("button", { id: "more", hidden: true }, "More");
  show(el("h1", {}, "Sandboxes"), form,
    el("table", { id: "sandboxes" }, el("thead", {}, el("tr", {}, ["Sandbox", "Kind", "Image", "State", "Labels", "Created", "Expires"].map(h => el("th", {}, h)))), rows), more);
  const selector = [f.labels, f.session ? `dsec.io/session=${f.session}` : ""].filter(Boolean).join(",");
  let token = "";
  const page = async () => {
    const res = await rpc("LifecycleService", "ListSandboxes", { labelSelector: selector, state: f.state, pageSize: 100, pageToken: token });
    for (const s of res.sandboxes || []) {
      const spec = s.spec || {};
      if (f.kind && (spec.kind || "container") !== f.kind) continue;
      rows.append(el("tr", {}, el("td", { class: "mono" }, el("a", { href: "#/sandbox/" + encodeURIComponent(s.id) }, s.id)),
        el("td", {}, spec.kind || "container"), el("td", {}, spec.image || spec.snapshot || ""), el("td", {}, s.state),
        el("td", { class: "mono" }, labelText(spec.labels)), el("td", {}, when(s.createdAt)), el("td", {}, when(s.expiresAt))));
    }
    token = res.nextPageToken || "";
    more.hidden = !token;
  };
  more.onclick = page;
  await page();
}

// sendInput sends one input action to a sandbox's screen after the ones
// before it have been delivered: keys typed fast must reach the guest in
// the order they were typed (concurrent requests may arrive in any order).
let inputs = Promise.resolve();
function sendInput(id, action) {
  inputs = inputs.then(() => rpc("ScreenService", "SendInput", { sandboxId: id, actions: [action] })).catch(() => {});
}

async function sandbox(id) {
  const s = await rpc("LifecycleService", "GetSandbox", { id });
  const spec = s.spec || {};
  const res = spec.resources || {};
  const live = s.state === "running" || s.state === "paused";
  const facts = [["ID", s.id], ["Node", s.node], ["State", s.state], ["Kind", spec.kind || "container"], ["Image", spec.image || spec.snapshot || ""],
    ["Resources", `${res.cpu || "-"} CPU, ${res.memoryMb || "-"} MiB, ${res.pids || "-"} processes`], ["Labels", labelText(spec.labels)],
    ["Created", when(s.createdAt)], [live ? "Expires" : "Ended", when(live ? s.expiresAt : (s.endedAt || s.expiresAt))]];
  if (s.reason) facts.push(["Reason", s.reason]);
  if (s.endCause) facts.push(["End", `${s.endCause}${s.infra ? " (infra: the platform ended it)" : ""}`]);
  const charts = el("div", { id: "charts" });
  const log = el("tbody");
  const parts = [el("h1", {}, "Sandbox ", el("span", { class: "mono" }, s.id)),
    el("dl", { id: "facts" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", { class: k === "End" && s.infra ? "infra" : "" }, v)])),
    el("h2", {}, "Use"), charts];
  if (live && spec.kind === "vm") {
    const img = el("img", { id: "screen", alt: "the sandbox's screen", tabIndex: 0 });
    img.addEventListener("click", e => {
      const r = img.getBoundingClientRect();
      const x = Math.round((e.clientX - r.left) * img.naturalWidth / r.width), y = Math.round((e.clientY - r.top) * img.naturalHeight / r.height);
      sendInput(id, { click: { x, y } });
    });
    img.addEventListener("keydown", e => {
      e.preventDefault();
      const named = { Enter: "Return", Backspace: "BackSpace", ArrowUp: "Up", ArrowDown: "Down", ArrowLeft: "Left", ArrowRight: "Right", " ": "space" };
      let k = named[e.key] || e.key;
      const mods = [e.ctrlKey && "ctrl", e.altKey && "alt"].filter(Boolean);
      const action = (k.length === 1 && !mods.length) ? { text: k } : { keys: [...mods, k].join("+") };
      sendInput(id, action);
    });
    parts.push(el("h2", {}, "Screen (click to focus; keys and clicks go to the sandbox)"), img);
    every(1000, async () => {
      const shot = await rpc("ScreenService", "Screenshot", { sandboxId: id });
      if (shot.png) img.src = "data:image/png;base64," + shot.png;
    });
  }
  parts.push(el("h2", {}, "Trajectory log"),
    el("table", { id: "log" }, el("thead", {}, el("tr", {}, ["#", "Call", "Result", "Took", "Output"].map(h => el("th", {}, h)))), log));
  show(...parts);
  if (live) every(5000, async () => {
    const st = await rpc("LifecycleService", "GetSandboxStats", { id, history: true });
    charts.replaceChildren(...useCharts(st));
  });
  else charts.append(el("p", {}, "The sandbox has ended: its history ended with it."));
  const entries = (await rpc("LogService", "GetLog", { sandboxId: id, limit: 500 })).entries || [];
  log.replaceChildren(...entries.map(e => {
    const r = e.result || {};
    const call = e.op === "exec" ? (e.argv || []).join(" ") : `${e.op} ${e.path || ""}${e.to ? " → " + e.to : ""}`;
    const result = e.error ? el("span", { class: e.error.infra ? "infra" : "error" }, e.error.message || e.error.kind)
      : e.op === "exec" ? `exit ${r.exitCode || 0}${r.replayed ? " (replayed)" : ""}${r.timedOut ? " (timed out)" : ""}` : "ok";
    return el("tr", {}, el("td", {}, e.seq), el("td", { class: "mono" }, call), el("td", {}, result), el("td", {}, `${e.durationMs || 0} ms`),
      el("td", {}, el("pre", {}, b64text(r.stdout) + b64text(r.stderr))));
  }));
}

// useCharts draws CPU and memory over the sandbox's history.
function useCharts(st) {
  const h = st.history || [];
  if (h.length < 2) return [el("p", {}, "Collecting samples (one every 5 s)…")];
  const t = h.map(s => new Date(s.at).getTime());
  const cpu = h.slice(1).map((s, i) => Math.max(0, (Number(s.cpuTimeMs || 0) - Number(h[i].cpuTimeMs || 0)) / Math.max(1, t[i + 1] - t[i]) * 100));
  const mem = h.map(s => Number(s.memoryBytes || 0) / 1048576);
  return [chart("CPU %", t.slice(1), cpu, "cpu"), chart("Memory MiB", t, mem, "memory"),
    el("p", {}, `now: ${bytes(st.memoryBytes)} memory of ${st.memoryLimitMb} MiB, ${bytes(st.diskBytes)} disk, ${st.pids || 0} processes, ${st.oomKills || 0} OOM kills`)];
}

function chart(title, xs, ys, id) {
  const W = 420, H = 120, P = 24;
  const x0 = xs[0], x1 = xs[xs.length - 1] || x0 + 1, y1 = Math.max(1, ...ys);
  const pts = xs.map((x, i) => `${(P + (x - x0) / Math.max(1, x1 - x0) * (W - 2 * P)).toFixed(1)},${(H - P - ys[i] / y1 * (H - 2 * P)).toFixed(1)}`).join(" ");
  return svg("svg", { class: "chart", id: "chart-" + id, width: W, height: H, viewBox: `0 0 ${W} ${H}` },
    svg("text", { x: P, y: 14 }, `${title} (max ${y1.toFixed(1)})`), svg("polyline", { points: pts }));
}

// Navigation.

async function route() {
  timers.forEach(clearInterval);
  timers = [];
  const login = document.getElementById("login");
  if (!key()) {
    login.hidden = false;
    show();
    document.getElementById("signout").hidden = true;
    return;
  }
  login.hidden = true;
  document.getElementById("signout").hidden = false;
  const [path, query] = location.hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  try {
    if (path.startsWith("/sandbox/")) await sandbox(decodeURIComponent(path.slice("/sandbox/".length)));
    else if (path === "/sandboxes") await sandboxes(params);
    else await overview();
  } catch (e) {
    if (e instanceof Unauthorized) {
      sessionStorage.removeItem(keyName);
      document.getElementById("loginerror").textContent = "The API key was refused.";
      return route();
    }
    show(el("p", { class: "error", id: "error" }, e.message));
  }
}

document.getElementById("login").addEventListener("submit", e => {
  e.preventDefault();
  sessionStorage.setItem(keyName, document.getElementById("key").value);
  document.getElementById("loginerror").textContent = "";
  route();
});
document.getElementById("signout").addEventListener("click", () => { sessionStorage.removeItem(keyName); route(); });
window.addEventListener("hashchange", route);
route();
