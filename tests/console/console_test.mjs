// `idem console` in a real headless Chromium (Debian's /usr/bin/chromium,
// driven by playwright-core), against a local plane (`idem up`): the page
// lists a failure this test journaled; sending it back from the page (tick,
// click, confirm) and asking the scope's re-drive route from the page runs
// its work exactly once, and a second re-drive finds nothing; ending a
// stuck claim from the page is refused once the claim changed behind the
// page's back, and done once the page shows it afresh; ending one that
// carries no work is confirmed as permanent. Around the page:
// the API refuses a request without the session token (403, nothing
// changed), a foreign Host (403), another origin (403); no answer carries a
// CORS header; and no answer the browser saw holds the service key.
//
// Run by tests/console/run.sh, which starts the plane and exports
// IDEM_POSTGREST_URL, IDEM_SERVICE_KEY and IDEM_BIN (an `idem` built with the
// console), and CONSOLE_TEST_DEPS (where playwright-core is installed).
//
//   node --test console_test.mjs

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createHash, randomUUID } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import http from "node:http";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import path from "node:path";
import { after, before, test } from "node:test";

const require = createRequire(path.join(process.env.CONSOLE_TEST_DEPS ?? process.cwd(), "package.json"));
const { chromium } = require("playwright-core");

const PLANE = (process.env.IDEM_POSTGREST_URL ?? "").replace(/\/+$/, "");
const KEY = process.env.IDEM_SERVICE_KEY ?? "";
const IDEM = process.env.IDEM_BIN ?? "";
const CHROMIUM = process.env.CHROMIUM_BIN ?? "/usr/bin/chromium";
const CHROMIUM_FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];
const TIMEOUT_MS = 15_000;
// A scope of this run's own, so a plane used before holds nothing of it.
const SCOPE = `webhook.console_${randomUUID().slice(0, 8)}`;
const ORG = randomUUID();
const WORK = { event: "invoice.paid", invoice: "in_console_1", amount: 4200 };
const STUCK_WORK = { event: "invoice.paid", invoice: "in_console_stuck" };
const BARE_REQUEST = { event: "invoice.paid", invoice: "in_console_bare" };

for (const [name, value] of [["IDEM_POSTGREST_URL", PLANE], ["IDEM_SERVICE_KEY", KEY], ["IDEM_BIN", IDEM]]) {
  if (!value) throw new Error(`${name} is not set: run tests/console/run.sh`);
}

// ---- the plane, called as any client calls it ----------------------------

async function rpc(fn, args) {
  const response = await fetch(`${PLANE}/rpc/${fn}`, {
    method: "POST",
    headers: {
      authorization: `Bearer ${KEY}`,
      "content-type": "application/json",
      "content-profile": "agent",
      "accept-profile": "agent",
    },
    body: JSON.stringify(args),
    signal: AbortSignal.timeout(TIMEOUT_MS),
  });
  const text = await response.text();
  if (!response.ok) throw new Error(`${fn}: ${response.status} ${text}`);
  return JSON.parse(text);
}

const sha256 = (value) => createHash("sha256").update(JSON.stringify(value)).digest("hex");

/** Claims `key` carrying `work` (none when `carry` is false: only its
 * hash), held for `leaseMs`; answers the claim. */
async function claim(key, work, leaseMs, carry = true) {
  const token = randomUUID();
  const [row] = await rpc("idempotency_claim", {
    p_organization_id: ORG,
    p_scope: SCOPE,
    p_key: key,
    p_request_hash: sha256(work),
    p_lease_token: token,
    p_lease_ms: leaseMs,
    ...(carry ? { p_request: work } : {}),
  });
  assert.equal(row.outcome, "claimed", JSON.stringify(row));
  return { id: row.id, token };
}

async function complete(id, token, response) {
  return rpc("idempotency_complete", {
    p_claim_id: id,
    p_lease_token: token,
    p_response: response,
    p_organization_id: ORG,
  });
}

/** The key's claim as the plane holds it. */
async function get(key) {
  const rows = await rpc("idempotency_get", { p_organization_id: ORG, p_scope: SCOPE, p_key: key });
  return Array.isArray(rows) ? rows[0] : rows;
}

/** One re-drive of SCOPE, as a worker runs it: the work it takes over. */
async function redrive(limit) {
  const tokens = Array.from({ length: limit }, () => randomUUID());
  return rpc("idempotency_redrive", { p_scope: SCOPE, p_lease_tokens: tokens, p_lease_ms: 30_000 });
}

async function failuresOfScope() {
  return rpc("idempotency_failures", { p_scope: SCOPE, p_limit: 100 });
}

// ---- the scope's re-drive route: runs each piece of work it is handed -----

const runs = [];
let routeAsks = 0;
const route = http.createServer(async (request, response) => {
  const answer = (status, body) => {
    response.writeHead(status, { "content-type": "application/json" });
    response.end(JSON.stringify(body));
  };
  try {
    if (request.method !== "POST" || request.url !== "/redrive") return answer(404, { error: "not here" });
    if (request.headers.authorization !== `Bearer ${KEY}`) return answer(401, { error: "the service key, please" });
    let body = "";
    for await (const chunk of request) body += chunk;
    const ask = JSON.parse(body);
    routeAsks += 1;
    if (ask.scope !== SCOPE) return answer(400, { error: `this route re-drives ${SCOPE}, not ${ask.scope}` });
    const taken = await redrive(ask.limit);
    for (const work of taken) {
      runs.push({ key: work.key, request: work.request, attempt: work.attempt });
      await complete(work.id, work.lease_token, { ok: true, output: { ran: work.key } });
    }
    answer(200, { redriven: taken.length, journaled: taken.length, dead_lettered: 0, left: 0 });
  } catch (error) {
    answer(500, { error: String(error) });
  }
});

// ---- the console, as an operator starts it -------------------------------

let consoleProcess;
let consoleUrl;
let consoleLog = "";

async function startConsole(routeUrl) {
  consoleProcess = spawn(IDEM, ["console", "--route", `${SCOPE}=${routeUrl}`], {
    env: { ...process.env, RUST_LOG: "info" },
    stdio: ["ignore", "pipe", "pipe"],
  });
  consoleProcess.stderr.on("data", (chunk) => (consoleLog += chunk));
  return new Promise((resolve, reject) => {
    let out = "";
    const timer = setTimeout(() => reject(new Error(`idem console printed no URL:\n${out}\n${consoleLog}`)), TIMEOUT_MS);
    consoleProcess.on("exit", (code) => reject(new Error(`idem console exited ${code}:\n${out}\n${consoleLog}`)));
    consoleProcess.stdout.on("data", (chunk) => {
      out += chunk;
      const newline = out.indexOf("\n");
      if (newline >= 0) {
        clearTimeout(timer);
        resolve(out.slice(0, newline).trim());
      }
    });
  });
}

/** A raw request to the console, any Host and headers: `{status, headers, body}`. */
function raw(method, target, headers = {}, body) {
  const url = new URL(target, consoleUrl);
  return new Promise((resolve, reject) => {
    const request = http.request(
      { host: url.hostname, port: url.port, path: url.pathname + url.search, method, headers },
      (response) => {
        let text = "";
        response.on("data", (chunk) => (text += chunk));
        response.on("end", () => resolve({ status: response.statusCode, headers: response.headers, body: text }));
      },
    );
    request.on("error", reject);
    request.setTimeout(TIMEOUT_MS, () => request.destroy(new Error(`${method} ${target}: no answer`)));
    if (body !== undefined) request.write(body);
    request.end();
  });
}

function assertNoCors(headers, what) {
  const cors = Object.keys(headers).filter((name) => name.toLowerCase().startsWith("access-control-"));
  assert.deepEqual(cors, [], `${what}: no CORS header at all`);
}

// ---- the browser ---------------------------------------------------------

let userDataDir;
let browser;
let page;
const seen = []; // every answer the browser got: [url, headers, body]
const recording = new Set(); // answers whose body is still being read into `seen`
const pageProblems = [];

/** Until the page is settled: every read and action it started is done and
 * shown (body's data-loading, which the page counts, is 0). What the test
 * reads of the panels is read after this, never while answers arrive. */
async function settled() {
  await page.waitForFunction(() => document.body.dataset.loading === "0", null, { timeout: TIMEOUT_MS });
}

/** The action's message, once the page is settled after it (the panels
 * read again). */
async function message() {
  await page.waitForFunction(() => {
    const text = document.getElementById("message").textContent;
    return text && text !== "…";
  }, null, { timeout: TIMEOUT_MS });
  await settled();
  return page.textContent("#message");
}

/** The open confirm dialog: its title, text and confirm button. */
async function dialogShown() {
  const dialog = page.locator("dialog#confirm");
  await dialog.waitFor({ state: "visible", timeout: TIMEOUT_MS });
  return {
    title: await dialog.locator("#confirm-title").textContent(),
    text: await dialog.locator("#confirm-text").textContent(),
    ok: await dialog.locator("#confirm-ok").textContent(),
  };
}

async function answerDialog(button) {
  const dialog = page.locator("dialog#confirm");
  await dialog.waitFor({ state: "visible", timeout: TIMEOUT_MS });
  await page.evaluate(() => (document.getElementById("message").textContent = ""));
  await dialog.locator(button).click();
  await dialog.waitFor({ state: "hidden", timeout: TIMEOUT_MS });
}

const confirmInPage = () => answerDialog("#confirm-ok");
const cancelInPage = () => answerDialog("#confirm-cancel");

/** Clicks Refresh; done once that read (and any under way) is shown. */
async function refresh() {
  const before = Number(await page.getAttribute("body", "data-loaded"));
  await page.click("#refresh");
  await page.waitForFunction(
    (was) => Number(document.body.dataset.loaded) > was && document.body.dataset.loading === "0",
    before,
    { timeout: TIMEOUT_MS },
  );
}

// ---- fixtures ------------------------------------------------------------

const failed = {};
const stuck = {};
const bare = {};

/** Claims, replays and failures summed over an activity answer's buckets. */
function activityTotals(buckets) {
  const sum = (name) => buckets.reduce((total, bucket) => total + Number(bucket[name]), 0);
  return { claims: sum("claims"), replays: sum("replays"), failures: sum("failures") };
}

before(async () => {
  // A failure journaled with its work: the first attempt failed.
  Object.assign(failed, await claim("evt-console-failed", WORK, 30_000));
  await complete(failed.id, failed.token, { ok: false, error: "vendor_timeout: the vendor did not answer" });
  // A claim its worker holds (a long lease), carrying work: stuck.
  Object.assign(stuck, await claim("evt-console-stuck", STUCK_WORK, 600_000));
  // Another, whose caller kept no work with it: ending it is for good.
  Object.assign(bare, await claim("evt-console-bare", BARE_REQUEST, 600_000, false));

  await new Promise((resolve) => route.listen(0, "127.0.0.1", resolve));
  consoleUrl = await startConsole(`http://127.0.0.1:${route.address().port}/redrive`);
  assert.match(consoleUrl, /^http:\/\/127\.0\.0\.1:\d+\/$/, "the first line is the page's URL, on loopback");

  userDataDir = mkdtempSync(path.join(tmpdir(), "idem-console-chromium-"));
  browser = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    args: CHROMIUM_FLAGS,
    timeout: 60_000,
  });
  page = browser.pages()[0] ?? (await browser.newPage());
  page.setDefaultTimeout(TIMEOUT_MS);
  page.on("pageerror", (error) => pageProblems.push(`page error: ${error.message}`));
  page.on("console", (entry) => {
    if (entry.type() === "error") pageProblems.push(`console error: ${entry.text()}`);
  });
  page.on("response", (response) => {
    const record = (async () => {
      try {
        seen.push([response.url(), await response.allHeaders(), await response.text()]);
      } catch {
        // A body the browser no longer holds (a navigation moved on).
      }
    })();
    recording.add(record);
    record.finally(() => recording.delete(record));
  });
});

after(async () => {
  await browser?.close();
  if (userDataDir) rmSync(userDataDir, { recursive: true, force: true });
  consoleProcess?.kill("SIGTERM");
  route.close();
});

// ---- the tests -----------------------------------------------------------

test("the page is served on loopback, framed by nobody, with its own script only", async () => {
  const response = await page.goto(consoleUrl);
  assert.equal(response.status(), 200);
  const headers = response.headers();
  assert.equal(headers["x-frame-options"], "DENY");
  const csp = headers["content-security-policy"];
  assert.match(csp, /default-src 'none'/);
  assert.match(csp, /script-src 'self'(;|$)/, "no inline script, no other origin");
  assert.match(csp, /frame-ancestors 'none'/);
  assertNoCors(headers, "the page");
  await page.waitForSelector("body[data-loaded]");
  await settled();
  assert.match(await page.textContent("#plane"), /the plane at http:\/\/127\.0\.0\.1:\d+\//);
});

test("the page lists the failure this test journaled, with its error and attempts, as one that can be sent back", async () => {
  // Read afresh, keeping the activity answer the page plots.
  const activityAnswer = page.waitForResponse((response) => response.url().includes("/api/activity?"));
  await refresh();
  const activity = await (await activityAnswer).json();
  const row = page.locator(`#failures tr[data-claim-id="${failed.id}"]`);
  await row.waitFor();
  const cells = await row.locator("td").allTextContents();
  assert.equal(cells[1], SCOPE);
  assert.equal(cells[2], "evt-console-failed");
  assert.equal(cells[3], "vendor_timeout: the vendor did not answer");
  assert.equal(cells[4], "1", "one attempt");
  assert.equal(cells[5], "0×", "never sent back");
  assert.equal(cells[6], "can be sent back");
  assert.equal(await row.locator("input.select").isEnabled(), true);
  // The stuck claims are in flight in their scope; the dead-letter panel counts the failure.
  const inFlight = await page.locator(`#in-flight tr[data-scope="${SCOPE}"] td`).allTextContents();
  assert.deepEqual(inFlight.slice(0, 4), [SCOPE, "2", "2", "0"], "two claims processing, live, no orphan");
  const counts = await page.locator(`#dead-letters tr[data-scope="${SCOPE}"] td`).allTextContents();
  assert.deepEqual(counts.slice(0, 5), ["—", SCOPE, "0", "1", "1"], "no dead letter, one failure, re-drivable");
  // Activity: the page shows what the console answered it, which counts
  // this test's three claims and its failure (and whatever else the plane
  // did in the window: it may be shared).
  const { claims, replays, failures } = activityTotals(activity.rows);
  assert.ok(claims >= 3 && failures >= 1, JSON.stringify(activity));
  assert.equal(activity.bucket_s, 900, "a day in quarters of an hour");
  const totals = `claims ${claims.toLocaleString("en")}, replays ${replays.toLocaleString("en")}, ` +
    `failures ${failures.toLocaleString("en")} since`;
  assert.ok((await page.textContent("#activity-totals")).startsWith(totals), totals);
  assert.equal(await page.locator("#activity svg polyline.series").count(), 3);
});

test("an action without the session token is refused with 403 and changes nothing", async () => {
  const body = JSON.stringify({ claim_ids: [failed.id] });
  const json = { "content-type": "application/json" };
  const without = await raw("POST", "/api/send-back", json, body);
  assert.equal(without.status, 403, without.body);
  assertNoCors(without.headers, "a refusal");
  const wrong = await raw("POST", "/api/send-back", { ...json, "x-idem-console-token": "0".repeat(64) }, body);
  assert.equal(wrong.status, 403, wrong.body);
  const read = await raw("GET", "/api/failures");
  assert.equal(read.status, 403, "reads need the token too");
  const [still] = await failuresOfScope();
  assert.equal(still?.id, failed.id, "the failure is still journaled, not sent back");
  assert.equal(still.status, "completed");
  assert.equal(still.requeues, 0);
});

test("a foreign Host or another origin is refused, and nothing answers with CORS headers", async () => {
  const token = await page.getAttribute('meta[name="idem-console-token"]', "content");
  const port = new URL(consoleUrl).port;
  const rebound = await raw("GET", "/", { host: `evil.example:${port}` });
  assert.equal(rebound.status, 403, "DNS rebinding: a name of another's that resolves here");
  assert.doesNotMatch(rebound.body, /idem-console-token/);
  const api = await raw("GET", "/api/about", { host: `evil.example:${port}`, "x-idem-console-token": token });
  assert.equal(api.status, 403);
  const origin = await raw(
    "POST",
    "/api/send-back",
    { "content-type": "application/json", "x-idem-console-token": token, origin: "http://evil.example" },
    JSON.stringify({ claim_ids: [failed.id] }),
  );
  assert.equal(origin.status, 403, origin.body);
  const preflight = await raw("OPTIONS", "/api/send-back", {
    origin: "http://evil.example",
    "access-control-request-method": "POST",
    "access-control-request-headers": "x-idem-console-token, content-type",
  });
  assertNoCors(preflight.headers, "a preflight");
  const about = await raw("GET", "/api/about", { "x-idem-console-token": token, origin: "http://evil.example" });
  assertNoCors(about.headers, "an API answer");
  const [still] = await failuresOfScope();
  assert.equal(still?.requeues, 0, "still not sent back");
});

test("sending the failure back from the page (tick, confirm) makes the next re-drive run it exactly once", async () => {
  await page.locator(`#failures tr[data-claim-id="${failed.id}"] input.select`).check();
  await page.click("#send-back");
  await confirmInPage();
  assert.equal(await message(), "sent back 1");
  // Sent back (the panels read again since): an orphan again, which the
  // page offers to re-drive.
  const orphans = page.locator(`#orphans tr[data-scope="${SCOPE}"]`);
  assert.equal(await orphans.count(), 1, "listed as an orphan");
  assert.equal((await orphans.locator("td").allTextContents())[1], "1");
  assert.equal(await page.locator(`#failures tr[data-claim-id="${failed.id}"]`).count(), 0, "no longer listed as failed");

  await orphans.locator("button.redrive").click();
  await confirmInPage();
  assert.equal(await message(), `re-driven 1 of ${SCOPE} (bound 50): journaled 1, dead-lettered 0, left 0`);
  assert.equal(routeAsks, 1, "the route was asked once");
  assert.deepEqual(runs, [{ key: "evt-console-failed", request: WORK, attempt: 2 }], "its work ran once, the second attempt");
  assert.deepEqual(await redrive(10), [], "a second re-drive finds nothing");
  const done = await get("evt-console-failed");
  assert.equal(done.status, "completed");
  assert.deepEqual(done.response, { ok: true, output: { ran: "evt-console-failed" } });
  await refresh();
  assert.equal(await page.locator(`#orphans tr[data-scope="${SCOPE}"]`).count(), 0, "no orphan left");
});

test("ending a stuck claim from the page is refused once it changed since shown, and done once shown afresh", async () => {
  await page.locator(`#in-flight tr[data-scope="${SCOPE}"] button.show-claims`).click();
  const row = page.locator(`#processing tr[data-claim-id="${stuck.id}"]`);
  await row.waitFor();
  await settled();
  assert.deepEqual((await row.locator("td").allTextContents()).slice(4, 7), ["live", "1", "kept"]);

  // Its worker extends the lease behind the page's back: the claim changed.
  const extended = await rpc("idempotency_extend", {
    p_claim_id: stuck.id,
    p_lease_token: stuck.token,
    p_lease_ms: 900_000,
    p_organization_id: ORG,
  });
  assert.ok(extended, "the worker still holds it: its lease was extended");
  await row.locator("button.abandon").click();
  const shown = await dialogShown();
  assert.equal(shown.title, "End this claim as a failure?");
  assert.match(shown.text, /Every later claim of its key replays the failure until it is sent back\.$/);
  assert.equal(shown.ok, "End as failure");
  await confirmInPage();
  assert.match(await message(), /^changed since shown: refresh/);
  const unchanged = await get("evt-console-stuck");
  assert.equal(unchanged.status, "processing", "nothing was written");
  assert.equal(unchanged.response ?? null, null);

  await refresh();
  await page.locator(`#processing tr[data-claim-id="${stuck.id}"] button.abandon`).click();
  await confirmInPage();
  assert.equal(await message(), `ended ${SCOPE}/evt-console-stuck as a failure (abandoned_by_operator)`);
  const ended = await get("evt-console-stuck");
  assert.equal(ended.status, "completed");
  assert.equal(ended.response.error, "abandoned_by_operator");
  // Its worker is fenced off: its completion changes nothing.
  assert.deepEqual(await complete(stuck.id, stuck.token, { ok: true }), [], "the old holder's completion is refused");
  assert.equal((await get("evt-console-stuck")).response.error, "abandoned_by_operator");
  // The page lists it as a failure that can be sent back.
  const listed = page.locator(`#failures tr[data-claim-id="${stuck.id}"]`);
  await listed.waitFor();
  const cells = await listed.locator("td").allTextContents();
  assert.equal(cells[3], "abandoned_by_operator");
  assert.equal(cells[6], "can be sent back");
});

test("ending a claim that carries no work is confirmed as permanent, and it cannot be sent back", async () => {
  const row = page.locator(`#processing tr[data-claim-id="${bare.id}"]`);
  await row.waitFor();
  await settled();
  assert.equal((await row.locator("td").allTextContents())[6], "none", "no work kept");
  await row.locator("button.abandon").click();
  const shown = await dialogShown();
  assert.equal(shown.title, "End this claim permanently?");
  assert.match(shown.text, /cannot be sent back/);
  assert.match(shown.text, /every retry of this key will be answered with this failure until its retention ends\.$/);
  assert.doesNotMatch(shown.text, /until it is sent back/);
  assert.equal(shown.ok, "End permanently");
  // Cancelled: nothing written.
  await cancelInPage();
  assert.equal(await message(), "nothing done");
  assert.equal((await get("evt-console-bare")).status, "processing");

  await row.locator("button.abandon").click();
  assert.equal((await dialogShown()).ok, "End permanently");
  await confirmInPage();
  assert.equal(await message(), `ended ${SCOPE}/evt-console-bare as a failure (abandoned_by_operator)`);
  const ended = await get("evt-console-bare");
  assert.equal(ended.status, "completed");
  assert.equal(ended.response.error, "abandoned_by_operator");
  const cells = await page.locator(`#failures tr[data-claim-id="${bare.id}"] td`).allTextContents();
  assert.equal(cells[3], "abandoned_by_operator");
  assert.equal(cells[6], "no: its work was not kept");
  assert.equal(await page.locator(`#failures tr[data-claim-id="${bare.id}"] input.select`).isEnabled(), false);
});

test("the browser never saw the service key, and the page raised no error", async () => {
  await settled();
  await Promise.all([...recording]);
  assert.ok(seen.length >= 10, `the browser's answers were recorded (${seen.length})`);
  for (const [url, headers, body] of seen) {
    assert.ok(url.startsWith(consoleUrl), `the page talked to the console only, not ${url}`);
    assert.ok(!body.includes(KEY) && !JSON.stringify(headers).includes(KEY), `${url} holds the service key`);
    assertNoCors(headers, url);
  }
  // Chromium logs every answer of 4xx: the one refused abandon (409) is expected.
  const expected = "console error: Failed to load resource: the server responded with a status of 409 (Conflict)";
  assert.deepEqual(pageProblems, [expected], "no error but the refused abandon's 409");
});
