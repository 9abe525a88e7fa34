// idem console: the page's script. It talks to the console's own API only
// (same origin, with the session token the page carries); the console
// calls the plane. Text from the plane goes into the page as text, never
// as markup.
"use strict";

const TOKEN = document.querySelector('meta[name="idem-console-token"]').content;
const SVG_NS = "http://www.w3.org/2000/svg";

// ---- the API -------------------------------------------------------------

/** GETs `path`, or POSTs `body` as JSON: `{ok, status, data}`. */
async function api(path, body) {
  const init = { headers: { "x-idem-console-token": TOKEN }, cache: "no-store" };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    return { ok: false, status: 0, data: { error: `the console did not answer: ${error.message}` } };
  }
  let data;
  try {
    data = await response.json();
  } catch {
    data = { error: `the console answered ${response.status} without JSON` };
  }
  return { ok: response.ok, status: response.status, data };
}

// ---- small DOM helpers ---------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "onclick") node.addEventListener("click", value);
    else if (typeof value === "boolean") node[name] = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
  }
  return node;
}

function svg(tag, attributes = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function cell(value, className) {
  return el("td", className ? { class: className } : {}, value);
}

function number(value) {
  return cell(Number(value).toLocaleString("en"), "number");
}

/** An instant as UTC, to the second. */
function when(value) {
  if (!value) return "—";
  const date = new Date(value);
  return Number.isNaN(date.getTime()) ? String(value) : date.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function duration(ms) {
  const s = Math.round(Number(ms) / 1000);
  if (s < 120) return `${s} s`;
  if (s < 7200) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${Math.round(s / 3600)} h`;
  return `${Math.round(s / 86400)} d`;
}

/** Fills `table`'s body with `rows`, or one line saying why not. */
function fill(table, rows, columns, empty) {
  const body = table.tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    body.append(el("tr", {}, el("td", { class: "empty", colspan: String(columns) }, empty)));
  }
  for (const row of rows) body.append(row);
}

function failed(table, columns, error) {
  const body = table.tBodies[0];
  body.replaceChildren(el("tr", {}, el("td", { class: "failed", colspan: String(columns) }, `could not read: ${error}`)));
}

function say(text, isError = false) {
  const message = document.getElementById("message");
  message.textContent = text;
  message.classList.toggle("error", isError);
}

/** "bound N reached: more may be waiting" when a panel filled its bound. */
function boundNote(data) {
  return data.rows.length >= data.bound ? ` (the first ${data.bound}: more may be waiting)` : "";
}

// ---- the confirm step ----------------------------------------------------

/** Shows `text` in the page's confirm dialog, its confirm button saying
 * `okLabel`; resolves whether confirmed. */
function confirmStep(title, text, okLabel = "Confirm") {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = okLabel;
  return new Promise((resolve) => {
    const ok = document.getElementById("confirm-ok");
    const cancel = document.getElementById("confirm-cancel");
    const done = (answer) => {
      ok.removeEventListener("click", yes);
      cancel.removeEventListener("click", no);
      dialog.removeEventListener("cancel", no);
      if (dialog.open) dialog.close();
      resolve(answer);
    };
    const yes = () => done(true);
    const no = () => done(false);
    ok.addEventListener("click", yes);
    cancel.addEventListener("click", no);
    dialog.addEventListener("cancel", no);
    dialog.showModal();
  });
}

/** Runs a confirmed action: POSTs `body` to `path`, says what happened. */
async function act(path, body) {
  say("…");
  const { ok, data } = await api(path, body);
  const text = data.message ?? data.error ?? "no answer";
  say(text, !ok);
  return { ok, data };
}

// ---- the panels ----------------------------------------------------------

const state = {
  selected: new Set(),
  processingScope: null,
  routes: [],
};

/** Which read of each panel is the latest: an answer to an older one that
 * arrives after it is dropped, so a panel never goes back to older rows. */
const reads = new Map();

/** Starts a read of `panel`: answers whether it is still the latest. */
function reading(panel) {
  const n = (reads.get(panel) ?? 0) + 1;
  reads.set(panel, n);
  return () => reads.get(panel) === n;
}

/** Reads and actions under way, and those done, on body as data-loading
 * and data-loaded (a counter): the page is settled when data-loading is 0,
 * every panel showing the latest answer it asked for. */
let loading = 0;
let loaded = 0;

/** Runs `load`, counted in data-loading until done, then in data-loaded. */
async function tracked(load) {
  loading += 1;
  document.body.dataset.loading = String(loading);
  try {
    return await load();
  } finally {
    loading -= 1;
    loaded += 1;
    document.body.dataset.loading = String(loading);
    document.body.dataset.loaded = String(loaded);
  }
}

async function loadAbout() {
  const { ok, data } = await api("/api/about");
  const plane = document.getElementById("plane");
  if (!ok) {
    plane.textContent = `could not read the console's settings: ${data.error}`;
    return;
  }
  state.routes = data.routes;
  plane.textContent = `the plane at ${data.plane} (row cap ${data.row_cap})`;
  document.getElementById("routes").textContent = data.routes.length
    ? `Re-drive routes: ${data.routes.join(", ")}.`
    : "No re-drive route named: start the console with --route SCOPE=URL to re-drive from here.";
}

async function loadInFlight() {
  const table = document.getElementById("in-flight");
  const latest = reading("in-flight");
  const { ok, data } = await api("/api/in-flight");
  if (!latest()) return;
  if (!ok) return failed(table, 7, data.error);
  const rows = data.rows.map((row) =>
    el(
      "tr",
      { dataset: { scope: row.scope } },
      cell(row.scope, "key"),
      number(row.processing),
      number(row.live),
      number(row.orphans),
      cell(when(row.oldest_claimed_at)),
      cell(when(row.oldest_lease_expires_at)),
      el("td", {}, el("button", { type: "button", class: "show-claims", onclick: () => tracked(() => showProcessing(row.scope)) }, "Show claims")),
    )
  );
  fill(table, rows, 7, "nothing in flight" + boundNote(data));
}

async function showProcessing(scope) {
  state.processingScope = scope;
  await loadProcessing();
}

async function loadProcessing() {
  const scope = state.processingScope;
  const panel = document.getElementById("processing-panel");
  const latest = reading("processing");
  if (scope === null) {
    panel.hidden = true;
    return;
  }
  panel.hidden = false;
  document.getElementById("processing-title").textContent = `Claims processing in ${scope}`;
  const table = document.getElementById("processing");
  const { ok, data } = await api(`/api/processing?scope=${encodeURIComponent(scope)}`);
  if (!latest()) return;
  if (!ok) return failed(table, 8, data.error);
  const rows = data.rows.map((claim) =>
    el(
      "tr",
      { dataset: { claimId: claim.id } },
      cell(claim.key, "key"),
      cell(claim.organization_id, "key"),
      cell(when(claim.claimed_at)),
      cell(when(claim.lease_expires_at)),
      cell(claim.lease_live ? "live" : "passed"),
      number(claim.attempt),
      cell(claim.carries_work ? "kept" : "none"),
      el(
        "td",
        {},
        el("button", { type: "button", class: "abandon danger", onclick: () => tracked(() => abandon(claim)) }, "End as failure…"),
      ),
    )
  );
  fill(table, rows, 8, `nothing processing in ${scope}` + boundNote(data));
}

async function abandon(claim) {
  const what =
    `${claim.scope} / ${claim.key} (claim ${claim.id}, attempt ${claim.attempt}) will be journaled as a failure ` +
    "(abandoned_by_operator), and its worker fenced off, if it is unchanged since shown. ";
  // Without its work, the failure can never be sent back to re-drive: the
  // key answers it until its retention ends.
  const confirmed = claim.carries_work
    ? await confirmStep(
      "End this claim as a failure?",
      what + "Every later claim of its key replays the failure until it is sent back.",
      "End as failure",
    )
    : await confirmStep(
      "End this claim permanently?",
      what +
        "It carries no work, so this cannot be undone: it cannot be sent back, and every retry of this key " +
        "will be answered with this failure until its retention ends.",
      "End permanently",
    );
  if (!confirmed) return say("nothing done");
  const { ok } = await act("/api/abandon", { id: claim.id, version: claim.version });
  if (ok) await loadAll();
}

async function loadOrphans() {
  const table = document.getElementById("orphans");
  const latest = reading("orphans");
  const { ok, data } = await api("/api/orphans");
  if (!latest()) return;
  if (!ok) return failed(table, 5, data.error);
  const rows = data.rows.map((row) =>
    el(
      "tr",
      { dataset: { scope: row.scope } },
      cell(row.scope, "key"),
      number(row.orphans),
      cell(when(row.oldest)),
      cell(duration(row.waited_ms)),
      el(
        "td",
        {},
        el(
          "button",
          {
            type: "button",
            class: "redrive",
            disabled: !row.route,
            title: row.route ? "ask the scope's re-drive route for a pass" : "no re-drive route named for this scope",
            onclick: () => tracked(() => redriveNow(row.scope, row.orphans)),
          },
          "Re-drive now…",
        ),
      ),
    )
  );
  fill(table, rows, 5, "no orphan waiting" + boundNote(data));
}

async function redriveNow(scope, orphans) {
  const confirmed = await confirmStep(
    "Re-drive now?",
    `Ask the re-drive route of ${scope} to take over its orphans now (${orphans} waiting): ` +
      "the route runs their work again, as idem redrive --to does.",
  );
  if (!confirmed) return say("nothing done");
  await act("/api/redrive", { scope });
  await loadAll();
}

async function loadFailures() {
  const table = document.getElementById("failures");
  const latest = reading("failures");
  const { ok, data } = await api("/api/failures");
  if (!latest()) return;
  if (!ok) return failed(table, 8, data.error);
  const shown = new Set(data.rows.map((row) => row.id));
  for (const id of state.selected) if (!shown.has(id)) state.selected.delete(id);
  const rows = data.rows.map((row) => {
    const box = el("input", {
      type: "checkbox",
      class: "select",
      "aria-label": `select ${row.scope} / ${row.key}`,
      disabled: !row.redrivable,
      checked: state.selected.has(row.id),
    });
    box.addEventListener("change", () => {
      if (box.checked) state.selected.add(row.id);
      else state.selected.delete(row.id);
      updateSendBack();
    });
    return el(
      "tr",
      { dataset: { claimId: row.id, scope: row.scope } },
      el("td", {}, box),
      cell(row.scope, "key"),
      cell(row.key, "key"),
      cell(row.error ?? "—", "error"),
      number(row.attempts),
      cell(`${row.requeues}×`, "number"),
      cell(row.redrivable ? "can be sent back" : "no: its work was not kept", "redrivable"),
      cell(when(row.claimed_at)),
    );
  });
  fill(table, rows, 8, "no journaled failure" + boundNote(data));
  updateSendBack();
}

function updateSendBack() {
  const button = document.getElementById("send-back");
  button.disabled = state.selected.size === 0;
  button.textContent = state.selected.size ? `Send back selected (${state.selected.size})…` : "Send back selected…";
}

async function sendBack() {
  const ids = [...state.selected];
  if (!ids.length) return;
  const confirmed = await confirmStep(
    `Send ${ids.length} failure(s) back?`,
    "Only once the bug behind them is fixed: each becomes an orphan again, which the next re-drive runs; " +
      "what it replaced is kept in its row for the audit.",
  );
  if (!confirmed) return say("nothing done");
  const { ok } = await act("/api/send-back", { claim_ids: ids });
  if (ok) state.selected.clear();
  await loadAll();
}

async function loadFailureCounts() {
  const table = document.getElementById("dead-letters");
  const latest = reading("failure-counts");
  const { ok, data } = await api("/api/failure-counts");
  if (!latest()) return;
  if (!ok) return failed(table, 6, data.error);
  const rows = data.rows.map((row) =>
    el(
      "tr",
      { dataset: { scope: row.scope } },
      cell(row.scope.startsWith("queue.") ? row.scope.slice("queue.".length) : "—", "key"),
      cell(row.scope, "key"),
      number(row.dead_lettered),
      number(row.failures),
      number(row.redrivable),
      cell(when(row.oldest_claimed_at)),
    )
  );
  fill(table, rows, 6, "no failure, no dead letter" + boundNote(data));
}

async function loadSweepBacklog() {
  const table = document.getElementById("sweep-backlog");
  const latest = reading("sweep-backlog");
  const { ok, data } = await api("/api/sweep-backlog");
  if (!latest()) return;
  if (!ok) return failed(table, 2, data.error);
  const rows = data.rows.map((row) => el("tr", {}, cell(row.retain_date), number(row.rows)));
  fill(table, rows, 2, "nothing waits for the sweep" + boundNote(data));
}

// ---- the plot ------------------------------------------------------------

const SERIES = ["claims", "replays", "failures"];

async function loadActivity() {
  const windowName = document.getElementById("window").value;
  const target = document.getElementById("activity");
  const totals = document.getElementById("activity-totals");
  const latest = reading("activity");
  const { ok, data } = await api(`/api/activity?window=${encodeURIComponent(windowName)}`);
  if (!latest()) return;
  if (!ok) {
    totals.textContent = `could not read: ${data.error}`;
    target.replaceChildren();
    return;
  }
  const sums = Object.fromEntries(SERIES.map((name) => [name, data.rows.reduce((sum, row) => sum + Number(row[name]), 0)]));
  totals.textContent = SERIES.map((name) => `${name} ${sums[name].toLocaleString("en")}`).join(", ") +
    ` since ${when(data.since)}, in buckets of ${duration(data.bucket_s * 1000)}`;
  target.replaceChildren(plot(data));
}

/** A line plot of the three series over the window: the plane answers
 * every bucket, zeros included, oldest first. */
function plot(data) {
  const width = 720;
  const height = 220;
  const margin = { left: 44, right: 12, top: 12, bottom: 28 };
  const step = data.bucket_s * 1000;
  const byTime = new Map(data.rows.map((row) => [new Date(row.bucket).getTime(), row]));
  const times = [...byTime.keys()].sort((a, b) => a - b);
  const value = (t, name) => Number(byTime.get(t)?.[name] ?? 0);
  const top = Math.max(1, ...times.flatMap((t) => SERIES.map((name) => value(t, name))));
  const x0 = times[0] ?? new Date(data.since).getTime();
  const x1 = Math.max(times[times.length - 1] ?? Date.now(), x0 + step);
  const x = (t) => margin.left + ((t - x0) / (x1 - x0)) * (width - margin.left - margin.right);
  const y = (v) => height - margin.bottom - (v / top) * (height - margin.top - margin.bottom);

  const root = svg("svg", { class: "plot", viewBox: `0 0 ${width} ${height}`, role: "img" });
  root.append(svg("title", {}, "claims, replays and failures over time"));
  for (const v of [0, top / 2, top]) {
    root.append(svg("line", { class: v ? "grid" : "axis", x1: margin.left, x2: width - margin.right, y1: y(v), y2: y(v) }));
    root.append(svg("text", { x: margin.left - 6, y: y(v) + 4, "text-anchor": "end" }, Math.round(v).toLocaleString("en")));
  }
  // Times in UTC: the hour for an hour's window, the day too for longer ones.
  const ticks = [[x0, "start"], [(x0 + x1) / 2, "middle"], [x1, "end"]];
  for (const [t, anchor] of ticks) {
    const label = new Date(t).toISOString().slice(data.bucket_s >= 900 ? 5 : 11, 16).replace("T", " ");
    root.append(svg("text", { x: x(t), y: height - 8, "text-anchor": anchor }, label));
  }
  for (const name of SERIES) {
    const points = times.map((t) => `${x(t).toFixed(1)},${y(value(t, name)).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { class: `series ${name}`, points, "data-series": name }));
    for (const t of times) {
      if (!value(t, name)) continue;
      const dot = svg("circle", { class: name, cx: x(t).toFixed(1), cy: y(value(t, name)).toFixed(1), r: 3 });
      dot.append(svg("title", {}, `${when(new Date(t).toISOString())}: ${value(t, name)} ${name}`));
      root.append(dot);
    }
  }
  SERIES.forEach((name, i) => {
    const lx = margin.left + 10 + i * 90;
    root.append(svg("rect", { class: name, x: lx, y: margin.top, width: 10, height: 10 }));
    root.append(svg("text", { x: lx + 14, y: margin.top + 9 }, name));
  });
  return root;
}

// ---- start ---------------------------------------------------------------

/** Reads every panel again; done when each shows its answer. */
function loadAll() {
  return tracked(() =>
    Promise.all([
      loadInFlight(),
      loadProcessing(),
      loadOrphans(),
      loadFailures(),
      loadFailureCounts(),
      loadSweepBacklog(),
      loadActivity(),
    ])
  );
}

document.getElementById("refresh").addEventListener("click", () => loadAll());
document.getElementById("send-back").addEventListener("click", () => tracked(sendBack));
document.getElementById("window").addEventListener("change", () => tracked(loadActivity));
tracked(() => loadAbout().then(loadAll));
