// The vgpu pool dashboard: polls the JSON views of the visible tab (every 2 s, never two
// requests at once, not while the page is hidden) and draws them. No external code.
// The address's fragment names the view: #pool (the default), #tenants, #cluster,
// #tenant/NAME (one tenant, with its usage over the last hour drawn as an SVG plot).
// After each successful draw, <body data-drawn="VIEW"> says which view is on the page.
"use strict";
const POLL_MS = 2000;
const state = { view: "pool", tenant: "", tokens: { pool: [""], tenants: [""] }, timer: null };

const $ = (id) => document.getElementById(id);
const esc = (text) => String(text).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";");
const gib = (bytes) => (bytes / 2 ** 30).toFixed(bytes >= 10 * 2 ** 30 ? 0 : 1) + " GiB";
const ago = (ms) => (ms ? Math.max(0, Math.round((Date.now() - ms) / 1000)) + " s ago" : "never");
const stat = (label, value, bad) => `<div class="stat"><b class="${bad ? "bad" : ""}">${esc(value)}</b>${esc(label)}</div>`;
const hue = (name) => { let h = 0; for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360; return h; };

function query(view) {
  const params = new URLSearchParams();
  const form = view === "pool" ? $("pool-filters") : view === "tenants" ? $("tenant-filters") : null;
  if (form) for (const [key, value] of new FormData(form)) if (value) params.set(key, value);
  const tokens = state.tokens[view];
  if (tokens && tokens[tokens.length - 1]) params.set("page_token", tokens[tokens.length - 1]);
  if (view === "tenant") params.set("name", state.tenant);
  return params.toString();
}

async function load(view) {
  const response = await fetch(`api/${view}?${query(view)}`, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function drawPool(page) {
  const o = page.overview;
  $("overview").innerHTML = [
    stat("nodes", o.nodes), stat("GPUs", o.gpus),
    stat("compute allocated", (o.compute_allocated_percent / Math.max(1, o.gpus)).toFixed(0) + " %"),
    stat("memory allocated", gib(o.memory_allocated_bytes) + " / " + gib(o.memory_bytes)),
    stat("tenants placed", o.tenants_placed), stat("tenants pending", o.tenants_pending, o.tenants_pending > 0),
    stat("unhealthy GPUs", o.gpus_unhealthy, o.gpus_unhealthy > 0),
    ...Object.entries(o.nodes_by_state).map(([s, n]) => stat("nodes " + s, n, s !== "ready")),
    ...Object.entries(o.gpus_by_model).map(([m, n]) => stat(m, n)),
    stat("matching filters", page.nodes_matched),
  ].join("");
  $("nodes").innerHTML = page.nodes.map((node) => `
    <div class="node ${esc(node.state)}" data-node="${esc(node.name)}">
      <h3><span>${esc(node.name)}</span><span>${esc(node.state)}${node.kubernetes_managed ? " · kubernetes" : ""} · ${esc(ago(node.last_heartbeat_unix_ms))}</span></h3>
      <div class="meta">${Object.entries(node.labels).map(([k, v]) => esc(k + "=" + v)).join(" ")}</div>
      ${node.gpus.map(drawGpu).join("")}
    </div>`).join("") || "<p>No node matches.</p>";
  state.next = page.next_page_token;
}

function drawGpu(gpu) {
  const h = gpu.health;
  const problems = h ? [
    h.xid_errors ? `XID ${h.last_xid} (${h.xid_errors})` : "",
    h.ecc_uncorrected ? `ECC ${h.ecc_uncorrected}` : "",
    h.throttle_reasons.length ? "throttled: " + h.throttle_reasons.join(",") : "",
  ].filter(Boolean) : [];
  const segments = gpu.segments.map((s) =>
    `<div class="seg" title="${esc(s.tenant)}: ${s.compute_percent}% · ${esc(gib(s.memory_bytes))}" style="width:${s.compute_percent}%;background:hsl(${hue(s.tenant)},55%,55%)"></div>`).join("");
  const used = gpu.utilization_percent == null ? "" : ` · util ${gpu.utilization_percent}%`;
  const memUsed = gpu.memory_used_bytes == null ? "" : ` · used ${gib(gpu.memory_used_bytes)}`;
  return `<div class="gpu" data-gpu="${gpu.index}">
    <div class="meta"><span>GPU ${gpu.index} ${esc(gpu.model)}</span><span>${gpu.compute_allocated_percent}% · ${esc(gib(gpu.memory_allocated_bytes))}/${esc(gib(gpu.memory_bytes))}${used}${memUsed}</span></div>
    <div class="bar">${segments}</div>
    ${problems.length ? `<div class="meta bad">${esc(problems.join(" · "))}</div>` : ""}
  </div>`;
}

function drawTenants(page) {
  $("tenant-counts").innerHTML = Object.entries(page.counts).map(([s, n]) => stat(s, n, s !== "placed")).join("");
  $("tenant-rows").innerHTML = page.tenants.map((t) => {
    const r = t.request;
    const ask = (r.whole_gpus ? `${r.whole_gpus} GPU` : `${r.milli_gpus / 1000} GPU`) + (r.nodes > 1 ? ` × ${r.nodes} nodes` : "") + ` · prio ${r.priority}`;
    const placed = t.placement.map((s) => `${s.node}/${s.gpu_index} ${s.compute_percent}%`).join(", ");
    const u = t.usage;
    const latency = u && u.latency_p99_us ? `${u.latency_p99_us} / ${u.latency_target_us} µs` : (r.latency_target_us ? `– / ${r.latency_target_us} µs` : "");
    const last = t.history.length ? t.history[t.history.length - 1].message : "";
    return `<tr data-tenant="${esc(t.name)}"><td><a href="#tenant/${encodeURIComponent(t.name)}">${esc(t.name)}</a></td><td>${esc(t.owner)}</td><td class="${esc(t.state)}">${esc(t.state)}</td>
      <td>${esc(ask)}</td><td>${esc(placed)}</td><td>${u ? esc(gib(u.memory_used_bytes)) : ""}</td><td>${esc(latency)}</td><td>${esc(t.reason || last)}</td></tr>`;
  }).join("");
  state.next = page.next_page_token;
}

// The usage plot: memory used and GPU time (as GPUs busy) over the history's window, one
// polyline each, scaled to their own maximum; drawn as SVG markup from numbers only.
function usagePlot(history) {
  const W = 960, H = 220, L = 8, R = 8, T = 12, B = 22;
  const samples = history.samples;
  const start = history.now_unix_ms - history.window_ms;
  const x = (ms) => (L + (W - L - R) * Math.max(0, ms - start) / history.window_ms).toFixed(1);
  const busy = samples.slice(1).map((s, i) => {
    const before = samples[i], dt = s.unix_ms - before.unix_ms;
    return { unix_ms: s.unix_ms, value: dt > 0 ? Math.max(0, s.gpu_time_ns - before.gpu_time_ns) / (dt * 1e6) : 0 };
  });
  const memory = samples.map((s) => ({ unix_ms: s.unix_ms, value: s.memory_used_bytes }));
  const line = (points, colour, name) => {
    const top = Math.max(...points.map((p) => p.value), 1e-9);
    const y = (v) => (T + (H - T - B) * (1 - v / top)).toFixed(1);
    const coords = points.map((p) => `${x(p.unix_ms)},${y(p.value)}`).join(" ");
    const dots = points.length === 1 ? `<circle cx="${x(points[0].unix_ms)}" cy="${y(points[0].value)}" r="3" fill="${colour}"/>` : "";
    return `<polyline class="series" data-series="${name}" data-points="${points.length}" fill="none" stroke="${colour}" stroke-width="2" points="${coords}"/>${dots}`;
  };
  const peakMemory = Math.max(0, ...memory.map((p) => p.value));
  const peakBusy = Math.max(0, ...busy.map((p) => p.value));
  const axis = `<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#9aa3b2"/>
    <text x="${L}" y="${H - 6}" font-size="11" fill="#56627a">${Math.round(history.window_ms / 60000)} min ago</text>
    <text x="${W - R}" y="${H - 6}" font-size="11" fill="#56627a" text-anchor="end">now</text>`;
  return `<svg id="usage-plot" viewBox="0 0 ${W} ${H}" width="100%" role="img" aria-label="usage over the last hour">
    ${axis}${memory.length ? line(memory, "#3c6df0", "memory") : ""}${busy.length ? line(busy, "#e07b00", "gpu") : ""}
  </svg>
  <div class="legend"><span class="key memory"></span>memory used (peak ${esc(gib(peakMemory))})
    <span class="key gpu"></span>GPU busy (peak ${(peakBusy * 100).toFixed(0)} % of one GPU)</div>`;
}

function drawTenant(page) {
  const t = page.tenant, r = t.request, u = t.usage;
  $("tenant-name").textContent = t.name;
  $("tenant-facts").innerHTML = [stat("state", t.state, t.state !== "placed"), stat("owner", t.owner || "–"),
    stat("request", (r.whole_gpus ? `${r.whole_gpus} GPU` : `${r.milli_gpus / 1000} GPU`) + (r.nodes > 1 ? ` × ${r.nodes} nodes` : "")),
    stat("priority", r.priority), stat("memory used", u ? gib(u.memory_used_bytes) : "–"),
    stat("latency p99 / target", u && u.latency_p99_us ? `${u.latency_p99_us} / ${u.latency_target_us} µs` : (r.latency_target_us ? `– / ${r.latency_target_us} µs` : "–")),
    // A best-effort tenant an MPS node's SM redistribution follows: its lowest cap, its progress.
    ...(u && u.sm_cap_permille ? [stat("SM share (redistributed)", (u.side_by_side ? "side by side · " : "turns · ")
      + (u.sm_cap_permille >= 1000 ? "uncapped" : `${Math.round(u.sm_cap_permille / 10)} %`)
      + (u.progress_per_s ? ` · ${u.progress_per_s.toFixed(1)} ${u.progress_hinted ? "units" : "steps"}/s` : "")
      + (u.progress_per_s && u.progress_alone_per_s ? ` (alone ${u.progress_alone_per_s.toFixed(1)}: ${(u.progress_per_s / u.progress_alone_per_s).toFixed(2)} of it)` : ""))] : []),
  ].join("");
  // When the leader could not be asked, the last history received for this tenant stays drawn.
  let h = page.usage_history, note = "";
  if (h) state.history = { tenant: t.name, history: h };
  else if (state.history && state.history.tenant === t.name) {
    h = state.history.history;
    note = "<p>The leader could not be asked just now; the plot is from the last answer.</p>";
  }
  $("tenant-plot").innerHTML = !h ? "<p>The leader could not be asked for the usage history.</p>"
    : note + (h.samples.length ? usagePlot(h) : "<p>No usage reported in the last hour.</p>");
  $("tenant-placement").innerHTML = t.placement.map((s) => `<tr><td>${esc(s.node)}</td><td>${s.gpu_index}</td><td>${s.compute_percent}%</td><td>${esc(gib(s.memory_bytes))}</td></tr>`).join("");
  $("tenant-events").innerHTML = t.history.slice().reverse().map((e) => `<tr><td>${esc(new Date(e.unix_ms).toLocaleString())}</td><td>${esc(e.state)}</td><td>${esc(e.message)}</td></tr>`).join("");
}

function drawCluster(view) {
  $("cluster-facts").innerHTML = [stat("cluster", view.cluster_id), stat("leader", view.leader || "none", !view.leader),
    stat("term", view.term), stat("last log index", view.last_log_index), stat("applied", view.last_applied), stat("answered by", view.responder)].join("");
  $("member-rows").innerHTML = view.members.map((m) => `<tr><td>${m.id}</td><td>${esc(m.address)}</td>
    <td>${m.id === view.leader ? "leader" : m.voter ? "voter" : "learner"}</td><td>${m.matched_index || ""}</td></tr>`).join("");
  $("election-rows").innerHTML = view.elections.map((e) => `<tr data-term="${e.term}"><td>${esc(new Date(e.unix_ms).toLocaleString())}</td><td>${e.term}</td><td>${e.leader || "none"}</td></tr>`).join("");
  const agents = view.agents;
  $("agent-ages").innerHTML = agents ? Object.entries(agents.heartbeat_age).map(([b, n]) => stat("heard " + b, n, b === "older" || b === "never")).join("") : "<p>Agents are shown to admins.</p>";
  $("agent-rows").innerHTML = agents ? agents.stalest.map((a) => `<tr><td>${esc(a.node)}</td><td>${esc(ago(a.last_heartbeat_unix_ms))}</td></tr>`).join("") : "";
}

async function refresh() {
  clearTimeout(state.timer);
  const view = state.view;
  try {
    const body = await load(view);
    if (view !== state.view) return;
    ({ pool: drawPool, tenants: drawTenants, tenant: drawTenant, cluster: drawCluster })[view](body);
    $("status").textContent = "updated " + new Date().toLocaleTimeString();
    $("status").className = "";
    document.body.dataset.drawn = view;
  } catch (error) {
    $("status").textContent = error.message;
    $("status").className = "error";
  }
  // A hidden page stops polling; `visibilitychange` starts it again.
  state.timer = setTimeout(() => { if (!document.hidden) refresh(); }, POLL_MS);
}

function show(view) {
  state.view = view;
  delete document.body.dataset.drawn;
  const tab = view === "tenant" ? "tenants" : view;
  for (const button of document.querySelectorAll("nav button")) button.classList.toggle("active", button.dataset.view === tab);
  for (const section of document.querySelectorAll("main section")) section.hidden = section.id !== view;
  refresh();
}

// The fragment picks the view: #tenant/NAME, or a tab's name.
function route() {
  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash.startsWith("tenant/") && hash.length > 7) {
    state.tenant = hash.slice(7);
    show("tenant");
  } else show(["tenants", "cluster"].includes(hash) ? hash : "pool");
}

document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => { location.hash = b.dataset.view; }));
window.addEventListener("hashchange", route);
document.querySelectorAll(".filters").forEach((form) => form.addEventListener("change", () => {
  state.tokens[state.view] = [""];
  refresh();
}));
document.querySelectorAll(".filters").forEach((form) => form.addEventListener("submit", (e) => e.preventDefault()));
document.querySelectorAll(".pager button").forEach((b) => b.addEventListener("click", () => {
  const tokens = state.tokens[b.parentElement.dataset.for];
  if (b.dataset.page === "first") tokens.splice(1);
  else if (state.next) tokens.push(state.next);
  refresh();
}));
document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
route();
