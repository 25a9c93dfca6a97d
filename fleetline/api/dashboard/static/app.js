// The fleetline console: one page per hash route, every number read from the API with the
// signed-in user's bearer token (so a tenant's users see what the API shows them, no more),
// pages re-read when the server-sent event stream says the view or the jobs changed.
"use strict";

const TOKEN_KEY = "fleetline.token";
const $ = (selector) => document.querySelector(selector);
const state = { me: null, rendering: false, pending: false, stream: null, charts: [] };

// -- talking to the API ----------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, detail) {
    super(`${status}: ${detail}`);
    this.status = status;
  }
}

async function api(path) {
  const response = await fetch(path, {
    headers: { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}` },
  });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) {
    // The server's reason (expired, a key rotated away, no second factor) is the user's to see.
    signOut(`Not signed in: ${typeof body.detail === "string" ? body.detail : "sign in again"}.`);
    throw new ApiError(401, "not signed in");
  }
  if (!response.ok) {
    const detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    throw new ApiError(response.status, detail || response.statusText);
  }
  return body;
}

// An API call whose failure (a store not configured: 503) is shown in place, not thrown.
async function maybe(path) {
  try {
    return { ok: true, body: await api(path) };
  } catch (error) {
    if (error.status === 401) throw error;
    return { ok: false, error: error.message };
  }
}

// -- formatting --------------------------------------------------------------------------------

const esc = (value) =>
  String(value ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const num = (value, digits = 0) =>
  value === null || value === undefined ? "–" : Number(value).toFixed(digits);
const time = (ms) => (ms ? new Date(Number(ms)).toISOString().replace("T", " ").slice(0, 19) : "–");
const badge = (word) => `<span class="badge ${esc(word)}">${esc(word)}</span>`;
const tid = (...parts) => `data-testid="${esc(parts.join("-"))}"`;
const can = (permission) => state.me && state.me.permissions.includes(permission);
const popcount = (mask) => {
  let n = 0;
  for (let m = Number(mask); m; m >>= 1) n += m & 1;
  return n;
};
const jobGpus = (job) =>
  Object.values(job.allocation || {}).reduce(
    (sum, nodes) => sum + Object.values(nodes).reduce((s, m) => s + popcount(m), 0),
    0,
  );
const toSeconds = (value) => {
  if (typeof value === "number") return value > 1e11 ? value / 1000 : value;
  const text = String(value);
  return Date.parse(/Z|[+-]\d\d:?\d\d$/.test(text) ? text : `${text.replace(" ", "T")}Z`) / 1000;
};

// -- pages ---------------------------------------------------------------------------------------

const PAGES = {
  fleet: { live: true, render: fleetPage },
  cluster: { live: true, render: clusterPage },
  jobs: { live: true, render: jobsPage },
  job: { live: true, render: jobPage },
  services: { live: true, render: servicesPage },
  tickets: { live: true, render: ticketsPage },
  history: { live: false, render: historyPage },
  audit: { live: false, render: auditPage },
  incident: { live: false, render: incidentPage },
  logs: { live: false, render: logsPage },
};

async function fleetPage() {
  const [clusters, degraded, failed] = await Promise.all([
    api("/v1/clusters"),
    api("/v1/gpus?health=degraded"),
    api("/v1/gpus?health=failed"),
  ]);
  const fields = ["gpus", "idle", "allocated", "degraded", "failed", "unavailable"];
  const totals = Object.fromEntries(
    fields.map((f) => [f, clusters.items.reduce((s, c) => s + c[f], 0)]),
  );
  const regions = {};
  for (const c of clusters.items) (regions[c.region] ||= []).push(c);
  const sick = [...failed.items, ...degraded.items];
  const shown = sick.slice(0, 200);
  return `
    <h1>Fleet <span class="dim" ${tid("view-version")}>view ${esc(clusters.view_version)}</span></h1>
    <div class="totals">${fields
      .map((f) => `<div class="stat"><b ${tid("fleet-total", f)}>${totals[f]}</b><span>${f === "gpus" ? "GPUs" : f}</span></div>`)
      .join("")}</div>
    ${Object.entries(regions)
      .sort()
      .map(
        ([region, list]) => `
      <h2>${esc(region)}</h2>
      <div class="cards">${list.map(clusterCard).join("")}</div>`,
      )
      .join("")}
    <h2>Degraded and failed GPUs <span ${tid("sick-count")}>${sick.length}</span></h2>
    <table ${tid("sick-gpus")}>
      <tr><th>cluster</th><th>node</th><th>GPU</th><th>health</th><th>cause</th><th>since</th></tr>
      ${shown
        .map(
          (g) => `<tr ${tid("sick", g.node_id, g.gpu_index)}><td>${esc(g.cluster_id)}</td>
          <td>${esc(g.node_id)}</td><td class="num">${g.gpu_index}</td><td>${badge(g.health)}</td>
          <td>${esc(g.cause)}</td><td>${time(g.health_since_ms)}</td></tr>`,
        )
        .join("")}
    </table>
    ${sick.length > shown.length ? `<p class="dim">and ${sick.length - shown.length} more</p>` : ""}`;
}

function clusterCard(c) {
  const rows = ["gpus", "idle", "allocated", "degraded", "failed", "unavailable", "nodes", "nodes_up"];
  const control = c.control ? `<p class="dim">${esc(c.control.reason || "")}</p>` : "";
  return `
    <div class="card" ${tid("cluster", c.cluster_id)}>
      <h3><a href="#/cluster/${encodeURIComponent(c.cluster_id)}">${esc(c.cluster_id)}</a>
        <span ${tid("cluster", c.cluster_id, "health")}>${badge(c.health)}</span></h3>
      <dl class="kv">${rows
        .map((f) => `<dt>${f.replace("_", " ")}</dt><dd ${tid("cluster", c.cluster_id, f)}>${c[f]}</dd>`)
        .join("")}</dl>${control}
    </div>`;
}

function gpuColour(util) {
  const u = Math.max(0, Math.min(100, Number(util) || 0));
  return `hsl(${220 - u * 2.2}, 70%, ${38 + u * 0.22}%)`;
}

async function clusterPage(clusterId) {
  const id = encodeURIComponent(clusterId);
  const [topology, gpus, cluster] = await Promise.all([
    api(`/v1/clusters/${id}/topology`),
    api(`/v1/gpus?cluster=${id}`),
    api(`/v1/clusters/${id}`),
  ]);
  const byNode = {};
  for (const g of gpus.items) (byNode[g.node_id] ||= {})[g.gpu_index] = g;
  const cell = (node, index) => {
    const g = (byNode[node] || {})[index];
    if (!g) return `<div class="gpu c-unavailable" title="no telemetry">?</div>`;
    const title = `${node} GPU ${index}: ${num(g.gpu_util_pct)}% util, ${g.fb_used_mib}/${g.fb_total_mib} MiB, ${num(g.power_w)} W, ${num(g.temperature_c)} C; ${g.health}${g.cause ? ` (${g.cause})` : ""}; ${g.capacity}${g.job_id ? ` to ${g.job_id}` : ""}`;
    return `<div class="gpu h-${esc(g.health)} c-${esc(g.capacity)}" style="background:${gpuColour(g.gpu_util_pct)}"
      title="${esc(title)}" ${tid("gpu", node, index)} data-util="${num(g.gpu_util_pct)}"
      data-health="${esc(g.health)}">${index}</div>`;
  };
  const islands = (n) => {
    const known = n.nvlink_islands.length ? n.nvlink_islands : [Object.keys(byNode[n.node_id] || {}).map(Number)];
    return known.map((island) => `<div class="island">${island.map((i) => cell(n.node_id, i)).join("")}</div>`).join("");
  };
  return `
    <h1>${esc(clusterId)} ${badge(cluster.health)}</h1>
    <p class="dim">${cluster.gpus} GPUs: ${cluster.idle} idle, ${cluster.allocated} allocated,
      ${cluster.degraded} degraded, ${cluster.failed} failed, ${cluster.unavailable} out of reach</p>
    <div class="legend"><span>colour: utilisation (blue idle, red busy)</span>
      <span>amber outline: degraded</span><span>red: failed</span><span>faded: out of reach</span>
      <span>boxes: NVLink islands, under their node, leaf and spine switch</span></div>
    ${topology.spines
      .map(
        (spine) => `<div class="spine"><div class="label">spine ${esc(spine.spine_switch)}</div>
        ${spine.leaves
          .map(
            (leaf) => `<div class="leaf"><div class="label">leaf ${esc(leaf.leaf_switch)}</div>
            <div class="nodes">${leaf.nodes
              .map(
                (n) => `<div class="node ${esc(n.status)}" ${tid("node", n.node_id)}>
                <div class="label">${esc(n.node_id)} · ${esc(n.status)}</div>
                <div class="islands">${islands(n)}</div></div>`,
              )
              .join("")}</div></div>`,
          )
          .join("")}</div>`,
      )
      .join("")}`;
}

function jobRow(j) {
  const actual = j.actual && j.actual.state ? j.actual.state : "–";
  const clusters = Object.keys(j.allocation || {}).join(", ") || "–";
  const [tenant, name] = j.key.split("/");
  return `<tr ${tid("job", j.key)}>
    <td><a href="#/job/${encodeURIComponent(tenant)}/${encodeURIComponent(name)}">${esc(j.key)}</a></td>
    <td>${esc(j.kind)}</td><td ${tid("job", j.key, "phase")}>${badge(j.phase)}</td>
    <td>${esc(actual)}</td><td class="num">${j.priority}</td><td>${esc(clusters)}</td>
    <td class="num" ${tid("job", j.key, "gpus")}>${jobGpus(j)}</td>
    <td class="dim" ${tid("job", j.key, "why")}>${esc(j.why || j.queued_reason || "")}</td></tr>`;
}

const JOB_HEAD = `<tr><th>job</th><th>kind</th><th>phase</th><th>actual</th><th>priority</th>
  <th>clusters</th><th>GPUs</th><th>why (the latest decision)</th></tr>`;

async function jobsPage() {
  const [jobs, fits] = await Promise.all([
    api("/v1/jobs").then((page) => page.items),
    maybe("/v1/queue"),
  ]);
  const queued = jobs
    .filter((j) => j.phase === "Queued")
    .sort((a, b) => b.priority - a.priority || a.order - b.order);
  // What would make each queued job fit: the binding constraint and a change checked by
  // placing the job again with it (GET /v1/queue).
  const fit = fits.ok
    ? `<h2>What would place them</h2>
    <table ${tid("fits")}><tr><th>job</th><th>GPUs</th><th>binding</th><th>why</th><th>the smallest change that places it</th><th>then in</th></tr>
    ${fits.body.items.map((f) => `<tr ${tid("fit", f.job)}><td>${esc(f.job)}</td><td class="num">${f.gpus}</td>
      <td>${badge(f.binding)}</td><td class="dim">${esc(f.why)}</td>
      <td ${tid("fit", f.job, "change")}>${esc(f.change || "nothing found")}${f.checked ? "" : " (not checked)"}</td>
      <td>${esc(f.places_in || "–")}</td></tr>`).join("")}</table>`
    : `<p class="error">${esc(fits.error)}</p>`;
  return `
    <h1>Jobs <span class="dim" ${tid("job-count")}>${jobs.length}</span></h1>
    <h2>Queue <span ${tid("queue-length")}>${queued.length}</span></h2>
    <table ${tid("queue")}>${JOB_HEAD}${queued.map(jobRow).join("")}</table>
    ${queued.length ? fit : ""}
    <h2>Every job</h2>
    <table ${tid("jobs")}>${JOB_HEAD}${jobs.map(jobRow).join("")}</table>`;
}

async function jobPage(tenant, name) {
  const path = `/v1/jobs/${encodeURIComponent(tenant)}/${encodeURIComponent(name)}`;
  const [job, explain, progress] = await Promise.all([
    api(path),
    api(`${path}/explain`),
    maybe(`${path}/progress`),
  ]);
  const trace = job.trace_id ? await maybe(`/v1/traces/${job.trace_id}`) : null;
  const decision = explain.decision || {};
  const rows = progress.ok ? progress.body.rows.map((r) => Object.fromEntries(progress.body.columns.map((c, i) => [c, r[i]]))) : [];
  const losses = rows.filter((r) => r.event === "PROGRESS" && r.loss !== null);
  const checkpoints = rows.filter((r) => r.event === "CHECKPOINTED");
  const actual = job.actual || {};
  afterRender(() => {
    if (losses.length) {
      lineChart("#loss", "training loss by step", losses.map((r) => Number(r.step)), [
        { label: "loss", values: losses.map((r) => Number(r.loss)) },
      ], null);
    }
  });
  return `
    <h1>${esc(job.key)} ${badge(job.phase)}</h1>
    <div class="cards">
      <div class="card"><dl class="kv">
        <dt>kind</dt><dd>${esc(job.kind)}</dd><dt>priority</dt><dd>${job.priority}</dd>
        <dt>actual</dt><dd ${tid("actual")}>${esc(actual.state || "–")}</dd>
        <dt>epoch / attempt</dt><dd>${job.epoch ?? "–"} / ${job.attempt ?? "–"}</dd>
        <dt>GPUs</dt><dd>${jobGpus(job)}</dd>
        <dt>clusters</dt><dd>${esc(Object.keys(job.allocation || {}).join(", ") || "–")}</dd>
        <dt>last checkpoint step</dt><dd ${tid("checkpoint-step")}>${job.checkpoint_step ?? "–"}</dd>
        <dt>trace</dt><dd ${tid("trace-id")}>${esc(job.trace_id || "–")}</dd>
      </dl></div>
      <div class="card"><h3>Why</h3><p ${tid("why")}>${esc(decision.reason || job.why || "no decision yet")}</p>
        ${actual.detail ? `<p class="dim">${esc(actual.detail)}</p>` : ""}</div>
    </div>
    <h2>Loss</h2>
    ${progress.ok ? (losses.length ? `<div id="loss" class="chart" ${tid("loss-chart")} data-points="${losses.length}"></div>` : `<p class="dim">no progress reported yet</p>`) : `<p class="error">${esc(progress.error)}</p>`}
    <h2>Checkpoints <span ${tid("checkpoint-count")}>${checkpoints.length}</span></h2>
    <table ${tid("checkpoints")}><tr><th>at</th><th>cluster</th><th>epoch</th><th>step</th><th>bytes</th><th>seconds</th><th>where</th></tr>
      ${checkpoints.map((c) => `<tr><td>${time(c.ts_ms)}</td><td>${esc(c.cluster_id)}</td><td class="num">${c.epoch}</td>
        <td class="num">${c.step ?? "–"}</td><td class="num">${c.bytes ?? "–"}</td><td class="num">${num(c.seconds, 3)}</td>
        <td class="dim">${esc(c.checkpoint_uri)}</td></tr>`).join("")}</table>
    <h2>Alternatives at the latest decision</h2>
    <table ${tid("alternatives")}><tr><th>cluster</th><th>score</th><th>parts, or why not</th></tr>
      ${(decision.alternatives || []).map((a) => `<tr><td>${esc(a.cluster_id)}</td><td class="num">${num(a.total, 3)}</td>
        <td class="dim">${esc(a.rejected || Object.entries(a.parts || {}).map(([k, v]) => `${k} ${num(v, 2)}`).join(", "))}</td></tr>`).join("")}</table>
    ${trace ? traceTable(trace) : ""}`;
}

function traceTable(trace) {
  if (!trace.ok) return `<h2>Trace</h2><p class="error">${esc(trace.error)}</p>`;
  const rows = trace.body.rows;
  const first = rows.length ? Number(rows[0][0]) : 0;
  return `<h2>Trace: the request across the fleet</h2>
    <table class="timeline" ${tid("trace")}><tr><th>+s</th><th>hop</th><th>cluster</th><th>what</th><th>detail</th></tr>
    ${rows.map(([ts, hop, cluster, what, , , detail]) => `<tr><td>+${((Number(ts) - first) / 1000).toFixed(3)}</td>
      <td>${esc(hop)}</td><td>${esc(cluster || "–")}</td><td>${esc(what)}</td><td class="dim">${esc(detail)}</td></tr>`).join("")}
    </table>`;
}

async function servicesPage() {
  const jobs = (await api("/v1/jobs")).items.filter((j) => j.kind === "InferenceService");
  return `
    <h1>Services <span class="dim" ${tid("service-count")}>${jobs.length}</span></h1>
    <table ${tid("services")}><tr><th>service</th><th>phase</th><th>model</th><th>replicas (min–max)</th>
      <th>GPUs held</th><th>clusters</th><th>latency target</th><th>latency p50 / p95 / p99</th></tr>
    ${jobs.map((j) => {
      const spec = (j.document || {}).spec || {};
      const replicas = spec.replicas || {};
      return `<tr ${tid("service", j.key)}><td>${esc(j.key)}</td><td>${badge(j.phase)}</td><td>${esc(spec.model)}</td>
        <td class="num">${replicas.min ?? "–"}–${replicas.max ?? replicas.min ?? "–"}</td>
        <td class="num">${jobGpus(j)}</td><td>${esc(Object.keys(j.allocation || {}).join(", ") || "–")}</td>
        <td class="num">${spec.latency_target_ms ?? "–"} ms</td>
        <td class="dim">not reported: replicas do not send request latencies yet</td></tr>`;
    }).join("")}</table>`;
}

const RANGES = ["-1h", "-6h", "-24h", "-7d", "-30d"];

function rangeSelect(id, chosen) {
  return `<select id="${id}">${RANGES.map((r) => `<option ${r === chosen ? "selected" : ""}>${r}</option>`).join("")}</select>`;
}

// rows of [series, time, value] -> one x axis (seconds) and a value array per series
function pivot(rows) {
  const xs = [...new Set(rows.map((r) => toSeconds(r[1])))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const series = {};
  for (const [name, at, value] of rows) {
    (series[name] ||= new Array(xs.length).fill(null))[index.get(toSeconds(at))] = Number(value);
  }
  return { xs, series: Object.entries(series).map(([label, values]) => ({ label, values })) };
}

const RANGE_S = { "-1h": 3600, "-6h": 21600, "-24h": 86400, "-7d": 604800, "-30d": 2592000 };

async function historyPage() {
  const since = sessionStorage.getItem("fleetline.range") || "-1h";
  const unit = RANGE_S[since] <= 21600 ? "minute" : "hour";
  const q = (name) => maybe(`/v1/queries/${name}?from=${encodeURIComponent(since)}`);
  const [util, energy, waits] = await Promise.all([
    q(`utilisation-by-cluster-${unit}`),
    q(`energy-by-cluster-${unit}`),
    q("job-wait-by-hour"),
  ]);
  const span = [Date.now() / 1000 - RANGE_S[since], Date.now() / 1000];
  afterRender(() => {
    $("#range").addEventListener("change", (e) => {
      sessionStorage.setItem("fleetline.range", e.target.value);
      refresh(true);
    });
    if (util.ok && util.body.rows.length) {
      const p = pivot(util.body.rows.map((r) => [r[0], r[1], r[2]]));
      lineChart("#util", `GPU utilisation % by cluster (per ${unit})`, p.xs, p.series, span);
    }
    if (energy.ok && energy.body.rows.length) {
      const p = pivot(energy.body.rows);
      lineChart("#energy", `GPU energy kWh by cluster (per ${unit})`, p.xs, p.series, span);
    }
    if (waits.ok && waits.body.rows.length) {
      const xs = waits.body.rows.map((r) => toSeconds(r[0]));
      lineChart("#waits", "job wait from submission to placement, s", xs, [
        { label: "p50", values: waits.body.rows.map((r) => Number(r[2])) },
        { label: "p95", values: waits.body.rows.map((r) => Number(r[3])) },
      ], span);
    }
  });
  const block = (id, result, what) =>
    !result.ok
      ? `<p class="error">${esc(result.error)}</p>`
      : result.body.rows.length
        ? `<div id="${id}" class="chart" ${tid(id + "-chart")} data-rows="${result.body.rows.length}"></div>`
        : `<p class="dim">no ${what} in this range</p>`;
  return `
    <h1>History</h1>
    <div class="toolbar">range ${rangeSelect("range", since)}<span class="dim">over every storage tier (hot, warm, cold)</span></div>
    <h2>Utilisation</h2>${block("util", util, "samples")}
    <h2>Energy</h2>${block("energy", energy, "samples")}
    <h2>Wait times</h2>${block("waits", waits, "placements")}`;
}

async function ticketsPage() {
  const { tickets } = await api("/v1/tickets");
  const open = tickets.filter((t) => t.state !== "CLOSED");
  const newest = [...tickets].reverse();
  return `
    <h1>Repair tickets <span class="dim"><b ${tid("tickets-open")}>${open.length}</b> open of ${tickets.length}</span></h1>
    <p class="dim">Opened by self-healing: the node is cordoned and drained until an operator marks it repaired
    (<code>fleetline tickets move ID REPAIRED</code>) and its burn-in passes.</p>
    <table ${tid("tickets")}><tr><th>opened</th><th>ticket</th><th>node</th><th>rule</th><th>severity</th><th>state</th><th>why</th><th>latest evidence</th></tr>
    ${newest.map((t) => {
      const last = t.evidence[t.evidence.length - 1] || {};
      return `<tr ${tid("ticket", t.node_id)} class="${t.state === "CLOSED" ? "dim" : ""}"><td>${time(t.opened_ms)}</td>
        <td>${esc(t.ticket_id)}</td><td><a href="#/cluster/${esc(t.cluster_id)}">${esc(t.node_id)}</a></td><td>${esc(t.rule)}</td>
        <td>${esc(t.severity)}</td><td ${tid("ticket-state", t.node_id)}>${esc(t.state)}</td><td>${esc(t.reason)}</td>
        <td class="dim">${esc(last.summary || "")}</td></tr>`;
    }).join("")}
    </table>`;
}

async function auditPage() {
  const form = JSON.parse(sessionStorage.getItem("fleetline.audit") || "{}");
  const params = new URLSearchParams({ limit: "500" });
  if (form.op) params.set("op", form.op);
  if (form.actor) params.set("actor", form.actor);
  const since = form.since || "-24h";
  params.set("from", String(Date.now() - RANGE_S[since] * 1000));
  const records = (await api(`/v1/audit?${params}`)).items;
  const text = (form.text || "").toLowerCase();
  const matches = records.filter((r) => !text || JSON.stringify(r).toLowerCase().includes(text));
  afterRender(() => {
    $("#audit-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const data = Object.fromEntries(new FormData(e.target).entries());
      sessionStorage.setItem("fleetline.audit", JSON.stringify(data));
      refresh(true);
    });
  });
  return `
    <h1>Audit log</h1>
    <form id="audit-form" class="toolbar">
      <input name="text" placeholder="search anything" value="${esc(form.text || "")}" ${tid("audit-search")}>
      <input name="op" placeholder="operation (prefix)" value="${esc(form.op || "")}">
      <input name="actor" placeholder="actor" value="${esc(form.actor || "")}">
      <select name="since">${RANGES.map((r) => `<option ${r === since ? "selected" : ""}>${r}</option>`).join("")}</select>
      <button type="submit">Search</button>
      <span class="dim" ${tid("audit-count")}>${matches.length}</span><span class="dim">of ${records.length} records</span>
    </form>
    <table ${tid("audit")}><tr><th>at</th><th>actor</th><th>role</th><th>tenant</th><th>operation</th><th>target</th><th>outcome</th><th>trace</th></tr>
    ${matches.map((r) => `<tr><td>${time(r.ts)}</td><td>${esc(r.actor)}</td><td>${esc(r.actor_role)}</td><td>${esc(r.tenant || "–")}</td>
      <td>${esc(r.operation)}</td><td>${esc(r.target)}</td><td>${esc(r.outcome)}</td><td class="dim">${esc(r.trace_id || "")}</td></tr>`).join("")}
    </table>`;
}

// An incident report of a window (GET /v1/postmortem): the same content as
// `fleetline postmortem`'s files, and a link to its self-contained HTML.
async function incidentPage() {
  const form = JSON.parse(sessionStorage.getItem("fleetline.incident") || "{}");
  const since = form.since || "-1h";
  const to = Date.now();
  const params = new URLSearchParams({ from: String(to - RANGE_S[since] * 1000), to: String(to) });
  for (const key of ["cluster", "job", "node", "service"]) if (form[key]) params.set(key, form[key]);
  const result = await maybe(`/v1/postmortem?${params}`);
  afterRender(() => {
    $("#incident-form").addEventListener("submit", (e) => {
      e.preventDefault();
      sessionStorage.setItem("fleetline.incident", JSON.stringify(Object.fromEntries(new FormData(e.target).entries())));
      refresh(true);
    });
    if (!result.ok) return;
    const report = result.body;
    const span = [report.window.from_ms / 1000, report.window.to_ms / 1000];
    const chart = (id, title, byName) => {
      const names = Object.keys(byName).sort();
      const xs = [...new Set(names.flatMap((n) => byName[n].map((p) => p[0])))].sort((a, b) => a - b);
      if (!xs.length) return;
      const series = names.map((n) => {
        const at = new Map(byName[n].map((p) => [p[0], p[1]]));
        return { label: n, values: xs.map((x) => (at.has(x) ? Number(at.get(x)) : null)) };
      });
      lineChart(id, title, xs.map((x) => x / 1000), series, span);
    };
    chart("#incident-util", "GPU utilisation % by cluster", report.series.utilisation);
    chart("#incident-usable", "usable GPUs by cluster", report.series.usable_gpus);
    chart("#incident-progress", "training step of each job that moved", report.series.progress);
    $("#incident-html").addEventListener("click", async () => {
      const response = await fetch(`/v1/postmortem?${params}&format=html`, {
        headers: { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY)}` },
      });
      const url = URL.createObjectURL(await response.blob());
      const link = Object.assign(document.createElement("a"), { href: url, download: "postmortem.html" });
      link.click();
      URL.revokeObjectURL(url);
    });
  });
  const toolbar = `<form id="incident-form" class="toolbar">
      <select name="since">${RANGES.map((r) => `<option ${r === since ? "selected" : ""}>${r}</option>`).join("")}</select>
      ${["cluster", "job", "node", "service"].map((k) => `<input name="${k}" placeholder="${k}" value="${esc(form[k] || "")}">`).join("")}
      <button type="submit">Report</button></form>`;
  if (!result.ok) return `<h1>Incident</h1>${toolbar}<p class="error" ${tid("incident-error")}>${esc(result.error)}</p>`;
  const r = result.body;
  const audit = r.audit.ok
    ? `audit chain verified: ${r.audit.checked} links, ${r.audit.window_links} in the window, ${r.audit.digests_named.length} signed digests over it`
    : `audit chain BROKEN: ${esc(r.audit.first_broken)}`;
  const moves = r.impact.jobs.flatMap((j) => j.moves.map((m) => ({ job: j.job, ...m })));
  return `
    <h1>Incident</h1>${toolbar}
    <p ${tid("incident-summary")}><b>${esc(r.summary)}</b></p>
    <p class="${r.audit.ok ? "" : "error"}" ${tid("incident-audit")}>${esc(audit)}
      <button id="incident-html" type="button">Download the HTML report</button></p>
    <div id="incident-util" class="chart"></div><div id="incident-usable" class="chart"></div>
    <div id="incident-progress" class="chart"></div>
    <h2>Faults and their detection</h2>
    <table ${tid("incident-faults")}><tr><th>at</th><th>kind</th><th>what failed</th><th>detected after</th><th>by</th></tr>
    ${r.faults.map((f) => `<tr ${tid("fault", f.kind, f.subject)}><td>${time(f.at_ms)}</td><td>${esc(f.kind)}</td><td>${esc(f.subject)}</td>
      <td class="num">${f.detection_s === null ? "never" : `${f.detection_s} s`}</td><td class="dim">${esc(f.detected_by || "NOT DETECTED")}</td></tr>`).join("")}</table>
    <h2>Impact on jobs</h2>
    <table ${tid("incident-moves")}><tr><th>job</th><th>moved</th><th>why</th><th>steps redone</th><th>fault to running</th><th>checkpoint</th></tr>
    ${moves.map((m) => `<tr><td>${esc(m.job)}</td><td>${esc(m.from)} → ${esc(m.to)}</td><td>${esc(m.fault || m.decision || "–")}</td>
      <td class="num">${m.steps_redone ?? "–"}</td><td class="num">${m.recovery_s ?? "–"} s</td><td class="dim">${esc(m.checkpoint || "–")}</td></tr>`).join("")}</table>
    <h2>What followed <span class="dim">${r.actions.length}</span></h2>
    <table ${tid("incident-actions")}><tr><th>at</th><th>actor</th><th>action</th><th>target</th><th>where</th><th>reason</th></tr>
    ${r.actions.slice(0, 500).map((a) => `<tr><td>${time(a.at_ms)}</td><td>${esc(a.actor)}</td><td>${esc(a.operation)}</td>
      <td>${esc(a.target)}</td><td>${esc(a.where)}</td><td class="dim">${esc(a.reason)}</td></tr>`).join("")}</table>`;
}

async function logsPage() {
  const form = JSON.parse(sessionStorage.getItem("fleetline.logs") || "{}");
  const params = new URLSearchParams({ from: form.since || "-1h", limit: "500" });
  for (const key of ["q", "level", "process", "trace_id"]) if (form[key]) params.set(key, form[key]);
  const result = await maybe(`/v1/logs?${params}`);
  afterRender(() => {
    $("#logs-form").addEventListener("submit", (e) => {
      e.preventDefault();
      sessionStorage.setItem("fleetline.logs", JSON.stringify(Object.fromEntries(new FormData(e.target).entries())));
      refresh(true);
    });
  });
  const rows = result.ok ? result.body.rows : [];
  return `
    <h1>Logs</h1>
    <form id="logs-form" class="toolbar">
      <input name="q" placeholder="words in the message" value="${esc(form.q || "")}">
      <select name="level"><option value="">any level</option>${["error", "warning", "info"].map((l) => `<option ${form.level === l ? "selected" : ""}>${l}</option>`).join("")}</select>
      <input name="process" placeholder="process (prefix)" value="${esc(form.process || "")}">
      <input name="trace_id" placeholder="trace id" value="${esc(form.trace_id || "")}">
      <select name="since">${RANGES.map((r) => `<option ${r === (form.since || "-1h") ? "selected" : ""}>${r}</option>`).join("")}</select>
      <button type="submit">Search</button><span class="dim" ${tid("log-count")}>${rows.length}</span>
    </form>
    ${result.ok ? "" : `<p class="error">${esc(result.error)}</p>`}
    <table ${tid("logs")}><tr><th>at</th><th>level</th><th>process</th><th>cluster</th><th>message</th><th>trace</th></tr>
    ${rows.map(([ts, level, process, cluster, , message, trace]) => `<tr><td>${time(ts)}</td><td>${esc(level)}</td><td>${esc(process)}</td>
      <td>${esc(cluster || "–")}</td><td>${esc(message)}</td><td class="dim">${esc(trace)}</td></tr>`).join("")}</table>`;
}

// -- charts (uPlot, vendored) -----------------------------------------------------------------

const PALETTE = ["#58a6ff", "#3fb950", "#d29922", "#f85149", "#bc8cff", "#39c5cf", "#ff9bce"];

// timeRange: [from, to] in seconds for a time axis, null for a plain one
function lineChart(selector, title, xs, series, timeRange) {
  const element = $(selector);
  if (!element) return;
  const width = Math.max(320, element.clientWidth - 12);
  const chart = new uPlot(
    {
      title,
      width,
      height: 260,
      scales: { x: timeRange ? { time: true, range: () => timeRange } : { time: false } },
      axes: [{ stroke: "#8b98a5", grid: { stroke: "#2a3440" } }, { stroke: "#8b98a5", grid: { stroke: "#2a3440" } }],
      series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true, points: { size: 6 } }))],
    },
    [xs, ...series.map((s) => s.values)],
    element,
  );
  state.charts.push(chart);
}

// -- the shell: sign in, routing, live updates --------------------------------------------------

let afterRenderHooks = [];
const afterRender = (hook) => afterRenderHooks.push(hook);

function route() {
  const [name, ...args] = (location.hash.replace(/^#\/?/, "") || "fleet").split("/").map(decodeURIComponent);
  return PAGES[name] ? { name, args } : { name: "fleet", args: [] };
}

async function render() {
  if (!state.me) return;
  if (state.rendering) {
    state.pending = true;
    return;
  }
  state.rendering = true;
  const { name, args } = route();
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.page === name);
  afterRenderHooks = [];
  try {
    const html = await PAGES[name].render(...args);
    for (const chart of state.charts.splice(0)) chart.destroy();
    const page = $("#page");
    const scroll = window.scrollY;
    page.innerHTML = html;
    page.dataset.page = name;
    page.dataset.rendered = String(Date.now());
    for (const hook of afterRenderHooks) hook();
    window.scrollTo(0, scroll);
  } catch (error) {
    if (error.status !== 401) $("#page").innerHTML = `<p class="error" ${tid("page-error")}>${esc(error.message)}</p>`;
  } finally {
    state.rendering = false;
    if (state.pending) {
      state.pending = false;
      render();
    }
  }
}

// A live update re-reads the page on show (a page with a form waits to be asked).
function refresh(force = false) {
  if (force || PAGES[route().name].live) render();
}

async function listen() {
  const controller = new AbortController();
  state.stream = controller;
  while (state.stream === controller) {
    try {
      const response = await fetch("/v1/stream?every_s=1", {
        headers: { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY)}` },
        signal: controller.signal,
      });
      if (!response.ok) throw new ApiError(response.status, "stream refused");
      $("#live").textContent = "live";
      $("#live").classList.add("on");
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let first = true;
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const message = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          if (message.startsWith("event: update")) {
            const data = JSON.parse(message.split("\ndata: ")[1] || "{}");
            $("#live").dataset.viewVersion = String(data.view_version);
            if (!first) refresh();
            first = false;
          }
        }
      }
    } catch (error) {
      if (controller.signal.aborted) return;
    }
    $("#live").textContent = "reconnecting";
    $("#live").classList.remove("on");
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function signOut(message = "") {
  sessionStorage.removeItem(TOKEN_KEY);
  state.me = null;
  if (state.stream) state.stream.abort();
  state.stream = null;
  $("#nav").hidden = true;
  $("#signout").hidden = true;
  $("#who").textContent = "";
  $("#page").innerHTML = "";
  $("#login").hidden = false;
  $("#login-error").textContent = message;
  $("#live").textContent = "offline";
  $("#live").classList.remove("on");
}

async function signIn() {
  try {
    state.me = await api("/v1/me");
  } catch (error) {
    if (error.status !== 401) $("#login-error").textContent = error.message;
    return;
  }
  $("#login").hidden = true;
  $("#nav").hidden = false;
  $("#signout").hidden = false;
  $("#who").textContent = `${state.me.subject} · ${state.me.role}${state.me.tenant ? ` · ${state.me.tenant}` : ""}`;
  for (const link of document.querySelectorAll("nav a[data-needs]")) link.hidden = !can(link.dataset.needs);
  listen();
  render();
}

// -- signing in through the organisation's identity provider (authorization code + PKCE) ----

const PENDING_KEY = "fleetline.sign-in";

function base64url(bytes) {
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

async function provider() {
  const response = await fetch("/v1/sign-in");
  const config = response.ok ? await response.json() : {};
  if (!config.issuer || !config.console_client) return null;
  const discovery = await fetch(`${config.issuer.replace(/\/$/, "")}/.well-known/openid-configuration`);
  if (!discovery.ok) throw new Error(`the identity provider answered ${discovery.status}`);
  return { ...config, metadata: await discovery.json() };
}

async function startSignIn(sso) {
  const verifier = base64url(crypto.getRandomValues(new Uint8Array(32)));
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier));
  const nonce = base64url(crypto.getRandomValues(new Uint8Array(16)));
  const redirect = `${location.origin}${location.pathname}`;
  sessionStorage.setItem(
    PENDING_KEY,
    JSON.stringify({
      verifier,
      state: nonce,
      redirect,
      client: sso.console_client,
      tokenEndpoint: sso.metadata.token_endpoint,
      page: location.hash,
    }),
  );
  const url = new URL(sso.metadata.authorization_endpoint);
  url.search = new URLSearchParams({
    response_type: "code",
    client_id: sso.console_client,
    redirect_uri: redirect,
    scope: sso.scope,
    state: nonce,
    code_challenge: base64url(new Uint8Array(digest)),
    code_challenge_method: "S256",
  }).toString();
  location.assign(url.toString());
}

// The provider sent the browser back with ?code=&state= (or ?error=): trade the code and the
// verifier for the id token, which is then the bearer token like any other. True if this
// page load was such a return.
async function finishSignIn() {
  const answer = new URLSearchParams(location.search);
  if (!answer.has("code") && !answer.has("error")) return false;
  const pending = JSON.parse(sessionStorage.getItem(PENDING_KEY) || "null");
  sessionStorage.removeItem(PENDING_KEY);
  history.replaceState(null, "", location.pathname + (pending?.page || ""));
  if (answer.has("error")) {
    signOut(`The identity provider refused: ${answer.get("error_description") || answer.get("error")}`);
  } else if (!pending || pending.state !== answer.get("state")) {
    signOut("That sign-in answer is not for a sign-in this page started; sign in again.");
  } else {
    const response = await fetch(pending.tokenEndpoint, {
      method: "POST",
      headers: { "Content-Type": "application/x-www-form-urlencoded" },
      body: new URLSearchParams({
        grant_type: "authorization_code",
        code: answer.get("code"),
        redirect_uri: pending.redirect,
        client_id: pending.client,
        code_verifier: pending.verifier,
      }),
    });
    const tokens = await response.json().catch(() => ({}));
    if (!response.ok || !tokens.id_token) {
      signOut(`Sign-in failed: ${tokens.error_description || tokens.error || response.status}`);
    } else {
      sessionStorage.setItem(TOKEN_KEY, tokens.id_token);
      signIn();
    }
  }
  return true;
}

async function offerSignIn() {
  try {
    const sso = await provider();
    if (!sso) return;
    $("#sso-offer").hidden = false;
    $("#sso").onclick = () => startSignIn(sso);
  } catch (error) {
    $("#login-error").textContent = `Single sign-on is unavailable: ${error.message}`;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("#login").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    $("#token").value = "";
    signIn();
  });
  $("#signout").addEventListener("click", () => signOut());
  window.addEventListener("hashchange", () => render());
  offerSignIn();
  finishSignIn().then((returned) => {
    if (returned) return;
    if (sessionStorage.getItem(TOKEN_KEY)) signIn();
    else signOut();
  });
});
