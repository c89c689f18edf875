// The proxy's operator page: models with their state and replicas, load/unload buttons (jobs
// through /jobs), the job list, a chart of recent requests (/activity) and a live log (/logs/stream).
// Polls once a second; rows are updated in place, so a button stays put under the pointer.
import { call, element, events, getJson, post, showError } from "/static/api.js";

const $ = (id) => document.getElementById(id);
const LOG_LINES = 500;

function cells(row, values) {
  values.forEach((value, i) => {
    row.cells[i].textContent = value;
  });
}

function modelRow(name) {
  const body = $("models").tBodies[0];
  let row = body.querySelector(`tr[data-model="${CSS.escape(name)}"]`);
  if (row) return row;
  row = body.insertRow();
  row.dataset.model = name;
  for (let i = 0; i < 6; i++) row.insertCell();
  const actions = row.insertCell();
  for (const type of ["load", "unload"]) {
    const button = element("button", type === "load" ? "Load" : "Unload", type);
    button.type = "button";
    button.addEventListener("click", () => post("/jobs", { type, model: name }).then(refresh).catch(showError));
    actions.append(button, " ");
  }
  return row;
}

function showModels(models, running) {
  const live = new Map(running.map((m) => [m.model, m]));
  const names = new Set(models.map((m) => m.id));
  for (const row of [...$("models").tBodies[0].rows]) {
    if (!names.has(row.dataset.model)) row.remove();  // its profile left the config
  }
  for (const m of models) {
    const r = live.get(m.id);
    const replicas = r?.replicas ?? [];
    const status = m.status.value;
    const row = modelRow(m.id);
    const busy = replicas.reduce((n, x) => n + x.slots_busy, 0);
    const total = replicas.reduce((n, x) => n + x.slots_total, 0);
    cells(row, [m.id, status, `${replicas.filter((x) => x.state === "ready").length} / ${m.meta.replicas}`,
      `${busy} / ${total}`, `${r?.in_flight ?? 0} / ${r?.queue_depth ?? 0}`, r?.last_error ?? ""]);
    row.cells[1].className = `status ${status}`;
    row.cells[5].className = "reason";
    row.querySelector("button.load").disabled = status === "loading" || status === "ready";
    row.querySelector("button.unload").disabled = status === "unloaded" || status === "unloading";
  }
  const logModel = $("log-model");
  for (const m of models) {
    if (![...logModel.options].some((o) => o.value === m.id)) logModel.append(new Option(m.id, m.id));
  }
}

function duration(job) {
  if (job.duration_s != null) return `${job.duration_s.toFixed(1)} s`;
  if (job.started_at != null) return `${(Date.now() / 1000 - job.started_at).toFixed(0)} s…`;
  return "";
}

function showJobs(jobs) {
  const rows = jobs.map((job) => {
    const row = element("tr");
    row.dataset.job = job.id;
    const when = new Date(job.created_at * 1000).toLocaleTimeString();
    for (const text of [when, job.type, job.model, job.trigger, job.status, duration(job), job.error ?? job.message]) {
      row.append(element("td", text));
    }
    row.cells[4].className = `status ${job.status}`;
    row.cells[6].className = job.error ? "reason" : "muted";
    const actions = row.insertCell();
    if (job.status === "queued" || (job.status === "running" && job.type === "load")) {
      const cancel = element("button", "Cancel", "cancel");
      cancel.type = "button";
      cancel.addEventListener("click", () => call(`/jobs/${job.id}`, { method: "DELETE" }).then(refresh).catch(showError));
      actions.append(cancel);
    }
    return row;
  });
  $("jobs").tBodies[0].replaceChildren(...rows);
}

// Two bands, TG above PP, each scaled to its own maximum: PP is often ten times TG.
function showActivity(records) {
  const canvas = $("chart");
  const g = canvas.getContext("2d");
  const { width, height } = canvas;
  g.clearRect(0, 0, width, height);
  g.font = "12px system-ui, sans-serif";
  const band = height / 2;
  const series = [["TG", "predicted_per_second", "#2759c7"], ["PP", "prompt_per_second", "#c76a27"]];
  series.forEach(([label, field, color], i) => {
    const top = i * band;
    const values = records.map((r) => r[field]);
    const max = Math.max(1, ...values);
    g.fillStyle = "#687080";
    g.fillText(`${label} (max ${max.toFixed(0)} t/s)`, 6, top + 14);
    g.strokeStyle = "#d9dde5";
    g.beginPath();
    g.moveTo(0, top + band - 0.5);
    g.lineTo(width, top + band - 0.5);
    g.stroke();
    g.fillStyle = color;
    const step = width / Math.max(records.length, 1);
    values.forEach((v, k) => {
      const h = (v / max) * (band - 22);
      g.fillRect(k * step + 1, top + band - h - 1, Math.max(step - 2, 1), h);
    });
  });
  canvas.dataset.requests = records.length;
  if (!records.length) {
    g.fillStyle = "#687080";
    g.fillText("no requests yet", width / 2 - 40, band);
  }
}

async function refresh() {
  const [models, running, jobs, activity] = await Promise.all([
    getJson("/v1/models"), getJson("/running"), getJson("/jobs?limit=30"), getJson("/activity?limit=200")]);
  showModels(models.data, running.models);
  showJobs(jobs);
  showActivity(activity);
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  showError(null);
}

let logStream = null;

async function followLog() {
  logStream?.abort();
  logStream = new AbortController();
  const model = $("log-model").value;
  const lines = [];
  $("log").textContent = "";
  const response = await call(`/logs/stream${model ? `?model=${encodeURIComponent(model)}` : ""}`,
    { signal: logStream.signal });
  for await (const entry of events(response)) {
    const who = entry.model ? `${entry.model}${entry.replica != null ? `#${entry.replica}` : ""}` : entry.source;
    lines.push(`${new Date(entry.ts * 1000).toLocaleTimeString()} ${who} ${entry.line}`);
    if (lines.length > LOG_LINES) lines.shift();
    const log = $("log");
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = lines.join("\n");
    if (atEnd) log.scrollTop = log.scrollHeight;
  }
}

function followLogShowingErrors() {
  followLog().catch((error) => {
    if (error.name !== "AbortError") showError(error);
  });
}

$("log-model").addEventListener("change", followLogShowingErrors);

async function poll() {
  try {
    await refresh();
  } catch (error) {
    showError(error);
  }
  setTimeout(poll, 1000);
}

poll();
followLogShowingErrors();
