// The webhook gate's sequences, as the Rust gate's: every ending an ACK with
// a counted reason, processing carried past the answer, and a claim cut by
// the deadline carried to its end so an ACKed redelivery loses nothing.

import assert from "node:assert/strict";
import {
  FAILED_ACK_ERROR_CHARS,
  type GateOptions,
  largestStorableBody,
  lookupProviderJob,
  PlaneError,
  type PlaneEvent,
  ProcessingError,
  type ProviderCallback,
  type ProviderJob,
  type Redelivery,
  type RedriveReport,
  registerProviderJob,
  sha256HexOfBytes,
  silent,
  storedBody,
  storedBodyBound,
  success,
  WEBHOOK_SCOPE_MAX_REQUEST_BYTES,
  WebhookGate,
  webhookHandler,
} from "../_shared/idempotency/mod.ts";
import { DEFAULT_WEBHOOK_BODY_LIMIT_BYTES, type WebhookRoute } from "../_shared/idempotency/webhook.ts";
import {
  eventually,
  HOUR_MS,
  Lossy,
  organization,
  plane,
  restoreWallClock,
  sleep,
  stepWallClock,
  uniqueKey,
} from "./support.ts";

const SCOPE = "webhook.slack";

function delivery(org: string, id: string, body = '{"event":"message"}') {
  return { organizationId: org, scope: SCOPE, deliveryId: id, body };
}

/** Whether the plane journaled the delivery, and with what answer. */
async function journaled(org: string, id: string, body = '{"event":"message"}') {
  const bytes = new TextEncoder().encode(body);
  const digest = await crypto.subtle.digest("SHA-256", bytes);
  const hash = Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
  return await plane().read({ organizationId: org, scope: SCOPE, key: id, requestHash: hash });
}

Deno.test("processed once; a redelivery is a counted duplicate; another body under the id is a hash mismatch", async () => {
  const gate = new WebhookGate(plane());
  const org = organization();
  const id = uniqueKey("Ev");
  let runs = 0;
  const process = () => {
    runs += 1;
    return Promise.resolve({ handled: true });
  };
  assert.deepEqual(await gate.handle(delivery(org, id), process), { ack: "processed", status: 200 });
  assert.deepEqual(await gate.handle(delivery(org, id), process), { ack: "dropped", status: 200, reason: "duplicate" });
  assert.deepEqual(await gate.handle(delivery(org, id, '{"event":"other"}'), process), {
    ack: "dropped",
    status: 200,
    reason: "hash_mismatch",
  });
  assert.equal(runs, 1);
  assert.equal(gate.drops("duplicate"), 1);
  assert.equal(gate.drops("hash_mismatch"), 1);
  const read = await journaled(org, id);
  assert.ok(read.outcome === "completed" && read.answer.ok, JSON.stringify(read));
});

// Provider callbacks, as the Rust gate's (tests/plane/callers/webhook.rs):
// the tenant comes from `agent.provider_jobs` before the claim, and a
// callback for a job the platform does not hold, or whose body names another
// job, is ACKed with a counted, logged reason and claims nothing.

const PROVIDER = "transcribe";
const CALLBACK_SCOPE = `webhook.${PROVIDER}`;

/** A gate whose events are kept, and the events. */
function loggedGate(options: Partial<GateOptions> = {}): { gate: WebhookGate; events: PlaneEvent[] } {
  const events: PlaneEvent[] = [];
  return { gate: new WebhookGate(plane(), { ...options, log: (event) => void events.push(event) }), events };
}

/** What the plane holds for a callback's delivery under `org`. */
async function callbackClaim(org: string, callback: ProviderCallback) {
  const bytes = typeof callback.body === "string" ? new TextEncoder().encode(callback.body) : callback.body;
  const requestHash = await sha256HexOfBytes(bytes);
  return await plane().read({ organizationId: org, scope: CALLBACK_SCOPE, key: callback.deliveryId, requestHash });
}

/**
 * Asserts the plane holds nothing for `callback` under `org` (an earlier drop
 * claimed nothing), then that it is processed once, and its repeat is a duplicate.
 */
async function unclaimedThenProcessedOnce(gate: WebhookGate, org: string, callback: ProviderCallback): Promise<void> {
  assert.equal((await callbackClaim(org, callback)).outcome, "absent", "nothing claimed");
  let runs = 0;
  const process = () => Promise.resolve(++runs);
  assert.deepEqual(await gate.handleProviderCallback(callback, process), { ack: "processed", status: 200 });
  assert.deepEqual(await gate.handleProviderCallback(callback, process), {
    ack: "dropped",
    status: 200,
    reason: "duplicate",
  });
  assert.equal(runs, 1);
}

/** The drop reasons the gate logged, in order. */
function droppedReasons(events: PlaneEvent[]): unknown[] {
  return events.filter((event) => event.event === "webhook.dropped").map((event) => event.drop_reason);
}

Deno.test("a provider callback resolves its tenant from agent.provider_jobs before it claims; a redelivery is a duplicate", async () => {
  const org = organization();
  const jobId = uniqueKey("job");
  assert.deepEqual(await registerProviderJob(plane(), { organizationId: org, provider: PROVIDER, jobId }), {
    organizationId: org,
    provider: PROVIDER,
    jobId,
  });
  const { gate, events } = loggedGate();
  const callback: ProviderCallback = {
    provider: PROVIDER,
    pathJobId: jobId,
    bodyJobId: jobId,
    deliveryId: uniqueKey("evt"),
    body: JSON.stringify({ job_id: jobId, status: "done" }),
  };
  const seen: ProviderJob[] = [];
  const process = (job: ProviderJob) => {
    seen.push(job);
    return Promise.resolve("stored transcript");
  };
  assert.deepEqual(await gate.handleProviderCallback(callback, process), { ack: "processed", status: 200 });
  assert.deepEqual(seen, [{ organizationId: org, provider: PROVIDER, jobId }], "processed as the job's tenant's");
  const claim = await callbackClaim(org, callback);
  assert.ok(claim.outcome === "completed" && claim.answer.ok, JSON.stringify(claim));
  assert.deepEqual(claim.answer, success("stored transcript"));
  assert.equal((await callbackClaim(organization(), callback)).outcome, "absent", "claimed under the tenant only");
  assert.deepEqual(await gate.handleProviderCallback(callback, process), {
    ack: "dropped",
    status: 200,
    reason: "duplicate",
  });
  assert.equal(seen.length, 1, "the redelivery performed nothing");
  assert.equal(gate.drops("duplicate"), 1);
  assert.deepEqual(droppedReasons(events), ["duplicate"]);
  // The job's tenant is the one registered: another organization cannot take it over.
  await assert.rejects(
    () => registerProviderJob(plane(), { organizationId: organization(), provider: PROVIDER, jobId }),
    (error: unknown) => error instanceof PlaneError && error.code === "23505",
  );
  assert.equal((await lookupProviderJob(plane(), PROVIDER, jobId))?.organizationId, org);
});

Deno.test("a callback for a job the platform does not hold is ACKed as unknown_job, counted, and claims nothing", async () => {
  const { gate, events } = loggedGate();
  const jobId = uniqueKey("job");
  const callback: ProviderCallback = {
    provider: PROVIDER,
    pathJobId: jobId,
    deliveryId: uniqueKey("evt"),
    body: "{}",
  };
  const never = () => Promise.reject(new Error("no tenant, no processing"));
  const unknown = { ack: "dropped", status: 200, reason: "unknown_job" };
  assert.deepEqual(await gate.handleProviderCallback(callback, never), unknown);
  // Looked up before the body is compared: an unknown job naming another in its body is unknown.
  assert.deepEqual(await gate.handleProviderCallback({ ...callback, bodyJobId: uniqueKey("job") }, never), unknown);
  // The job another provider started under this id is not this provider's.
  const org = organization();
  await registerProviderJob(plane(), { organizationId: org, provider: "other-provider", jobId });
  assert.deepEqual(await gate.handleProviderCallback(callback, never), unknown);
  assert.equal(gate.drops("unknown_job"), 3);
  assert.deepEqual(droppedReasons(events), ["unknown_job", "unknown_job", "unknown_job"]);
  // Nothing was claimed: once the job is held, the same delivery is processed, not a duplicate.
  await registerProviderJob(plane(), { organizationId: org, provider: PROVIDER, jobId });
  await unclaimedThenProcessedOnce(gate, org, callback);
});

Deno.test("a callback whose body names another job than its path is ACKed as job_mismatch, counted, and claims nothing", async () => {
  const org = organization();
  const jobId = uniqueKey("job");
  await registerProviderJob(plane(), { organizationId: org, provider: PROVIDER, jobId });
  const { gate, events } = loggedGate();
  const deliveryId = uniqueKey("evt");
  const body = JSON.stringify({ job_id: jobId, status: "done" });
  const never = () => Promise.reject(new Error("mismatched job"));
  // Another job the platform holds too, of the same tenant: still not the path's.
  const otherJob = uniqueKey("job");
  await registerProviderJob(plane(), { organizationId: org, provider: PROVIDER, jobId: otherJob });
  for (const named of [otherJob, "", jobId.toUpperCase()]) {
    assert.deepEqual(
      await gate.handleProviderCallback(
        { provider: PROVIDER, pathJobId: jobId, bodyJobId: named, deliveryId, body },
        never,
      ),
      { ack: "dropped", status: 200, reason: "job_mismatch" },
      `the body names ${JSON.stringify(named)}`,
    );
  }
  assert.equal(gate.drops("job_mismatch"), 3);
  assert.deepEqual(droppedReasons(events), ["job_mismatch", "job_mismatch", "job_mismatch"]);
  // The same delivery naming its own job is processed: the mismatches claimed nothing.
  await unclaimedThenProcessedOnce(gate, org, {
    provider: PROVIDER,
    pathJobId: jobId,
    bodyJobId: jobId,
    deliveryId,
    body,
  });
  // A body that names no job is taken on its path's word.
  const unnamed: ProviderCallback = { provider: PROVIDER, pathJobId: jobId, deliveryId: uniqueKey("evt"), body };
  assert.deepEqual(await gate.handleProviderCallback(unnamed, () => Promise.resolve("ok")), {
    ack: "processed",
    status: 200,
  });
});

Deno.test("a provider callback whose lookup fails is a 503 and claims nothing; one above the body limit is a 413 before the lookup", async () => {
  const org = organization();
  const jobId = uniqueKey("job");
  await registerProviderJob(plane(), { organizationId: org, provider: PROVIDER, jobId });
  const lossy = new Lossy().refuseAll();
  const down = new WebhookGate(plane({ fetch: lossy.fetch, retry: { maxRetries: 0 } }), {
    deadlineMs: 500,
    log: silent,
  });
  const callback: ProviderCallback = {
    provider: PROVIDER,
    pathJobId: jobId,
    deliveryId: uniqueKey("evt"),
    body: "{}",
  };
  const never = () => Promise.reject(new Error("never processed"));
  assert.deepEqual(await down.handleProviderCallback(callback, never), {
    ack: "retry",
    status: 503,
    reason: "plane_unavailable",
  });
  assert.deepEqual(lossy.calls, ["provider_job_lookup"], "no claim was tried");
  const small = new WebhookGate(plane({ fetch: lossy.refuseAll(false).fetch }), { bodyLimitBytes: 2, log: silent });
  assert.deepEqual(await small.handleProviderCallback({ ...callback, body: "{ }" }, never), {
    ack: "retry",
    status: 413,
    reason: "delivery_too_large",
  });
  assert.deepEqual(lossy.calls, ["provider_job_lookup"], "refused before the lookup");
  assert.equal(small.drops("unknown_job"), 0);
  assert.equal((await callbackClaim(org, callback)).outcome, "absent");
});

Deno.test("slow processing is accepted at the deadline, carried through waitUntil, and journaled once", async () => {
  const carried: Promise<unknown>[] = [];
  const gate = new WebhookGate(plane(), { deadlineMs: 300, waitUntil: (work) => carried.push(work) });
  const org = organization();
  const id = uniqueKey("Ev");
  let runs = 0;
  const process = async () => {
    runs += 1;
    await sleep(1_000);
    return { slow: true };
  };
  const started = performance.now();
  assert.deepEqual(await gate.handle(delivery(org, id), process), { ack: "accepted", status: 200 });
  assert.ok(performance.now() - started < 900, "answered within the deadline");
  assert.equal(carried.length, 1, "the work was handed to waitUntil");
  // A redelivery meanwhile meets the live claim: a duplicate, not a second run.
  assert.equal((await gate.handle(delivery(org, id), process)).ack, "dropped");
  await Promise.all(carried);
  assert.equal(runs, 1);
  const read = await journaled(org, id);
  assert.ok(read.outcome === "completed" && read.answer.ok, JSON.stringify(read));
});

Deno.test("a retryable failure is retried in process; one that lasts to the timeout is left for a re-drive, which finishes it", async () => {
  const gate = new WebhookGate(plane(), {
    processingTimeoutMs: 1_000,
    journalDeadlineMs: 1_000,
    marginMs: 1_000,
    closeOnBeforeUnload: false,
  });
  const org = organization();
  let tries = 0;
  const flaky = () => {
    tries += 1;
    if (tries < 3) return Promise.reject(ProcessingError.retryable("vendor busy"));
    return Promise.resolve({ third: true });
  };
  const id = uniqueKey("Ev");
  assert.equal((await gate.handle(delivery(org, id), flaky)).ack, "processed");
  assert.equal(tries, 3);

  // Still failing at the timeout: held by the plane with its body, never a
  // stored failure that every later delivery would replay.
  const stuck = uniqueKey("Ev");
  const ack = await gate.handle(delivery(org, stuck), () => Promise.reject(ProcessingError.retryable("still busy")));
  assert.deepEqual(ack, { ack: "accepted", status: 200 });
  assert.equal((await journaled(org, stuck)).outcome, "processing");
  assert.equal((await gate.handle(delivery(org, stuck), flaky)).ack, "dropped", "a duplicate while its lease runs");
  // Once the lease passed (its backoff), a re-drive carries it on with the
  // body its first delivery stored.
  const seen: Redelivery[] = [];
  let report: RedriveReport | undefined;
  for (let poll = 0; poll < 40 && !report?.redriven; poll++) {
    await sleep(250);
    report = await gate.redrive({ scope: SCOPE, limit: 10, organizationId: org }, (redelivery) => {
      seen.push(redelivery);
      return Promise.resolve({ later: true });
    });
  }
  assert.deepEqual(report, { redriven: 1, journaled: 1, deadLettered: 0, left: 0 });
  assert.deepEqual([seen[0].deliveryId, seen[0].attempt], [stuck, 2]);
  assert.equal(new TextDecoder().decode(seen[0].body), '{"event":"message"}');
  const read = await journaled(org, stuck);
  assert.ok(read.outcome === "completed" && read.answer.ok, JSON.stringify(read));
  // A permanent failure is the event's answer, not a drop: acknowledged
  // (2xx, so the vendor stops), saying that it failed.
  const permanent = uniqueKey("Ev");
  assert.deepEqual(
    await gate.handle(delivery(org, permanent), () => Promise.reject(ProcessingError.permanent("bad event"))),
    { ack: "failed", status: 200, error: "bad event" },
  );
  const long = uniqueKey("Ev");
  const cut = await gate.handle(delivery(org, long), () => Promise.reject(ProcessingError.permanent("é".repeat(500))));
  assert.deepEqual(cut, { ack: "failed", status: 200, error: "é".repeat(FAILED_ACK_ERROR_CHARS) });
  const stored = await journaled(org, long);
  assert.ok(stored.outcome === "completed" && stored.answer.error === "é".repeat(500), "journaled whole");
});

Deno.test("a wall clock stepped back an hour mid-processing does not stretch its retries past the timeout", async () => {
  const carried: Promise<unknown>[] = [];
  const gate = new WebhookGate(plane(), {
    processingTimeoutMs: 500,
    journalDeadlineMs: 1_000,
    marginMs: 1_000,
    deadlineMs: 2_400,
    waitUntil: (work) => carried.push(work),
  });
  const org = organization();
  const id = uniqueKey("Ev");
  let tries = 0;
  const started = performance.now();
  try {
    const ack = await gate.handle(delivery(org, id), () => {
      tries += 1;
      if (tries === 1) stepWallClock(-HOUR_MS);
      return Promise.reject(ProcessingError.retryable("vendor busy"));
    });
    // Retried within the 500 ms timeout only, then left for a re-drive:
    // answered by the processing's own ending, well before the gate's
    // 2.4 s deadline, and nothing was handed to waitUntil.
    assert.deepEqual(ack, { ack: "accepted", status: 200 });
    const took = performance.now() - started;
    assert.ok(took < 2_000, `answered by processing's own ending, not by the deadline: ${took} ms`);
  } finally {
    restoreWallClock();
    await Promise.all(carried);
  }
  assert.ok(tries >= 2 && tries <= 5, `retried with backoff inside its timeout: ${tries} tries`);
  assert.equal((await journaled(org, id)).outcome, "processing", "left for a re-drive, not journaled");
});

Deno.test("a throw or an overrun is journaled as processing_aborted, never released", async () => {
  const gate = new WebhookGate(plane(), { processingTimeoutMs: 1_000, journalDeadlineMs: 2_000, marginMs: 1_000 });
  const org = organization();
  const threw = uniqueKey("Ev");
  assert.deepEqual(await gate.handle(delivery(org, threw), () => Promise.reject(new Error("bug"))), {
    ack: "dropped",
    status: 200,
    reason: "processing_aborted",
  });
  const overran = uniqueKey("Ev");
  const carried: Promise<unknown>[] = [];
  const slowGate = new WebhookGate(plane(), {
    processingTimeoutMs: 1_000,
    journalDeadlineMs: 2_000,
    marginMs: 1_000,
    deadlineMs: 2_000,
    waitUntil: (work) => carried.push(work),
  });
  const ack = await slowGate.handle(delivery(org, overran), () => sleep(3_000).then(() => "late"));
  assert.deepEqual(ack, { ack: "dropped", status: 200, reason: "processing_aborted" });
  for (const [id, error] of [[threw, "processing_threw"], [overran, "processing_timed_out"]]) {
    const read = await journaled(org, id);
    assert.ok(read.outcome === "completed" && read.answer.error === error, JSON.stringify(read));
  }
  // Let the overrunning effect's timer end inside the test.
  await sleep(2_100);
});

Deno.test("a claim cut by the deadline is answered 503, carried in the background, and the ACKed redelivery loses nothing", async () => {
  const lossy = new Lossy().delay("idempotency_claim", 800);
  const carried: Promise<unknown>[] = [];
  const gate = new WebhookGate(plane({ fetch: lossy.fetch }), {
    deadlineMs: 300,
    waitUntil: (work) => carried.push(work),
  });
  const org = organization();
  const id = uniqueKey("Ev");
  let runs = 0;
  const process = () => {
    runs += 1;
    return Promise.resolve({ carried: true });
  };
  assert.deepEqual(await gate.handle(delivery(org, id), process), {
    ack: "retry",
    status: 503,
    reason: "plane_unavailable",
  });
  // The vendor redelivers at once, to another worker on a healthy path: the
  // first worker's claim is live, so it is a duplicate — and not a loss,
  // because the first worker carries the event.
  const other = new WebhookGate(plane());
  assert.deepEqual(await other.handle(delivery(org, id), process), {
    ack: "dropped",
    status: 200,
    reason: "duplicate",
  });
  await Promise.all(carried);
  assert.equal(runs, 1);
  await eventually("the event is journaled", async () => (await journaled(org, id)).outcome === "completed");
});

Deno.test("a claim answer lost after the commit is asked again with the same token, and the event is processed", async () => {
  const lossy = new Lossy().loseNext("idempotency_claim", 6);
  const carried: Promise<unknown>[] = [];
  const gate = new WebhookGate(plane({ fetch: lossy.fetch, retry: { maxRetries: 0 } }), {
    waitUntil: (work) => carried.push(work),
  });
  const org = organization();
  const id = uniqueKey("Ev");
  let runs = 0;
  const ack = await gate.handle(delivery(org, id), () => {
    runs += 1;
    return Promise.resolve("ok");
  });
  assert.equal(ack.ack, "retry", "the first answer was lost: the vendor is asked to redeliver");
  await Promise.all(carried);
  assert.equal(runs, 1, "the claim the database made was found again and processed");
  assert.ok(lossy.count("idempotency_claim") >= 7);
  assert.equal((await journaled(org, id)).outcome, "completed");
});

Deno.test("a claim answered after the processing timeout never starts processing and leaves the event for a re-drive", async () => {
  // The claim lands, and its answer arrives 1.3 s on: past the processing
  // timeout (1 s) but within the time the gate asks for. Nothing ran, so
  // nothing may be journaled as processing_timed_out (a failure the event
  // never had): the claim is left to its lease, with its body, for a re-drive.
  const lossy = new Lossy().delay("idempotency_claim", 1_300);
  const gate = new WebhookGate(plane({ fetch: lossy.fetch }), {
    processingTimeoutMs: 1_000,
    journalDeadlineMs: 2_000,
    marginMs: 1_000,
    deadlineMs: 5_000,
  });
  const org = organization();
  const id = uniqueKey("Ev");
  let runs = 0;
  const process = () => {
    runs += 1;
    return Promise.resolve("stored");
  };
  assert.deepEqual(await gate.handle(delivery(org, id), process), { ack: "accepted", status: 200 });
  assert.equal(runs, 0, "processing never started");
  assert.equal(gate.drops("processing_aborted"), 0, "nothing journaled as aborted");
  const read = await journaled(org, id);
  assert.equal(read.outcome, "processing", `left to its lease: ${JSON.stringify(read)}`);
  assert.deepEqual(await new WebhookGate(plane()).handle(delivery(org, id), process), {
    ack: "dropped",
    status: 200,
    reason: "duplicate",
  });
  assert.equal(runs, 0, "a duplicate runs nothing");
});

Deno.test("an unreachable plane is a 503; an unclaimable delivery id is a counted drop", async () => {
  const down = new WebhookGate(plane({ fetch: new Lossy().refuseAll().fetch, retry: { maxRetries: 0 } }), {
    deadlineMs: 500,
  });
  const org = organization();
  assert.equal((await down.handle(delivery(org, uniqueKey("Ev")), () => Promise.resolve(1))).status, 503);
  const gate = new WebhookGate(plane());
  assert.deepEqual(await gate.handle(delivery(org, ""), () => Promise.resolve(1)), {
    ack: "dropped",
    status: 200,
    reason: "invalid_delivery",
  });
  assert.equal(gate.drops("invalid_delivery"), 1);
});

Deno.test("a lease that outlives the vendor's redeliveries is refused when the gate is built", () => {
  assert.throws(() => new WebhookGate(plane(), { processingTimeoutMs: 10 * 60_000 }), /outlasts/);
});

Deno.test("webhookHandler answers 200 with the ack, and 503 with Retry-After", async () => {
  const org = organization();
  const handler = webhookHandler({
    gate: new WebhookGate(plane()),
    scope: SCOPE,
    organizationOf: () => org,
    deliveryIdOf: (request) => request.headers.get("webhook-id") ?? "",
    process: ({ body }) => Promise.resolve({ bytes: body.length }),
  });
  const id = uniqueKey("Ev");
  const post = () =>
    handler(new Request("http://gate/slack", { method: "POST", headers: { "webhook-id": id }, body: "{}" }));
  const first = await post();
  assert.equal(first.status, 200);
  assert.deepEqual(await first.json(), { ack: "processed" });
  assert.deepEqual(await (await post()).json(), { ack: "dropped", drop_reason: "duplicate" });
  const down = webhookHandler({
    gate: new WebhookGate(plane({ fetch: new Lossy().refuseAll().fetch, retry: { maxRetries: 0 } })),
    scope: SCOPE,
    organizationOf: () => org,
    deliveryIdOf: () => uniqueKey("Ev"),
    process: () => Promise.resolve(1),
  });
  const refused = await down(new Request("http://gate/slack", { method: "POST", body: "{}" }));
  assert.equal(refused.status, 503);
  assert.equal(refused.headers.get("retry-after"), "1");
  await refused.body?.cancel();
});

Deno.test("processing that answers something with no JSON form is still journaled, never a 503", async () => {
  const gate = new WebhookGate(plane());
  const org = organization();
  const id = uniqueKey("Ev");
  assert.deepEqual(await gate.handle(delivery(org, id), () => Promise.resolve({ amount: 10n })), {
    ack: "processed",
    status: 200,
  });
  assert.equal((await journaled(org, id)).outcome, "completed");
});

/** A webhook endpoint over the real plane whose application counts every call it gets. */
function countedEndpoint(extra: Partial<WebhookRoute> = {}, log?: (event: PlaneEvent) => void) {
  const calls = { organizationOf: 0, deliveryIdOf: 0, process: 0 };
  const org = organization();
  const handler = webhookHandler({
    gate: new WebhookGate(plane(), log ? { log } : {}),
    scope: SCOPE,
    organizationOf: () => (calls.organizationOf += 1, org),
    deliveryIdOf: (request) => (calls.deliveryIdOf += 1, request.headers.get("webhook-id") ?? ""),
    process: ({ body }) => (calls.process += 1, Promise.resolve({ bytes: body.length })),
    ...extra,
  });
  return { handler, calls, org };
}

/**
 * A body stream that would give `total` bytes in `chunk`-byte pieces, pulled
 * only when read (no read-ahead), counting what it gave and whether it was
 * cancelled.
 */
function countedStream(total: number, chunk: number) {
  const counted = { pulled: 0, cancelled: false };
  const stream = new ReadableStream<Uint8Array>({
    pull(controller) {
      if (counted.pulled >= total) return controller.close();
      counted.pulled += chunk;
      controller.enqueue(new Uint8Array(chunk).fill(0x61));
    },
    cancel() {
      counted.cancelled = true;
    },
  }, { highWaterMark: 0 });
  return { stream, counted };
}

async function rejection(response: Response, status: number, reason: string): Promise<string> {
  assert.equal(response.status, status);
  const text = await response.text();
  assert.equal(JSON.parse(text).ack, "rejected");
  assert.equal(JSON.parse(text).reason, reason);
  return text;
}

Deno.test("webhookHandler refuses a body whose Content-Length is above its limit 413, unread, before the application", async () => {
  const limit = 64 * 1024;
  const { handler, calls } = countedEndpoint({ bodyLimitBytes: limit });
  const { stream, counted } = countedStream(400 * 1024 * 1024, 16 * 1024);
  const request = new Request("http://gate/slack", {
    method: "POST",
    headers: { "content-length": String(400 * 1024 * 1024), "webhook-id": uniqueKey("Ev") },
    body: stream,
  });
  await rejection(await handler(request), 413, "body_too_large");
  assert.equal(counted.pulled, 0, "not a byte read");
  assert.ok(counted.cancelled, "the body's stream was cancelled");
  assert.deepEqual(calls, { organizationOf: 0, deliveryIdOf: 0, process: 0 });
});

Deno.test("webhookHandler refuses a streamed body 413 once it passes the limit, having read about the limit", async () => {
  const limit = 64 * 1024;
  const chunk = 4 * 1024;
  const { handler, calls } = countedEndpoint({ bodyLimitBytes: limit });
  // No Content-Length: 400 MiB on offer, refused after about 64 KiB.
  const { stream, counted } = countedStream(400 * 1024 * 1024, chunk);
  const request = new Request("http://gate/slack", {
    method: "POST",
    headers: { "webhook-id": uniqueKey("Ev") },
    body: stream,
  });
  assert.equal(request.headers.get("content-length"), null);
  await rejection(await handler(request), 413, "body_too_large");
  assert.ok(counted.pulled > limit, `read until past the limit: ${counted.pulled}`);
  assert.ok(counted.pulled <= limit + 2 * chunk, `stopped at once: ${counted.pulled} bytes pulled`);
  assert.ok(counted.cancelled, "the body's stream was cancelled");
  assert.deepEqual(calls, { organizationOf: 0, deliveryIdOf: 0, process: 0 });
});

Deno.test("webhookHandler over a real server: a body at the limit is processed, one byte more is 413; 256 KiB by default", async () => {
  assert.equal(DEFAULT_WEBHOOK_BODY_LIMIT_BYTES, 256 * 1024);
  assert.equal(new WebhookGate(plane(), { closeOnBeforeUnload: false }).bodyLimitBytes, 256 * 1024);
  const limit = 32 * 1024;
  const { handler, calls, org } = countedEndpoint({ bodyLimitBytes: limit });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, handler);
  try {
    const post = (size: number, id: string) =>
      fetch(`http://127.0.0.1:${server.addr.port}/slack`, {
        method: "POST",
        headers: { "webhook-id": id },
        body: new Uint8Array(size).fill(0x62),
      });
    const atLimit = uniqueKey("Ev");
    const accepted = await post(limit, atLimit);
    assert.equal(accepted.status, 200);
    assert.deepEqual(await accepted.json(), { ack: "processed" });
    const read = await plane().read({
      organizationId: org,
      scope: SCOPE,
      key: atLimit,
      requestHash: await sha256HexOfBytes(new Uint8Array(limit).fill(0x62)),
    });
    assert.ok(read.outcome === "completed" && read.answer.ok, JSON.stringify(read));
    await rejection(await post(limit + 1, uniqueKey("Ev")), 413, "body_too_large");
    assert.deepEqual(calls, { organizationOf: 1, deliveryIdOf: 1, process: 1 }, "the refused one reached nothing");
  } finally {
    await server.shutdown();
  }
});

Deno.test("webhookHandler answers an application's throw 400 with a fixed message; its text goes to the log only", async () => {
  const secret = "connection to 10.0.0.7 refused for user billing_admin";
  const events: PlaneEvent[] = [];
  const { handler, calls } = countedEndpoint({
    organizationOf: () => {
      throw new Error(secret);
    },
  }, (event) => void events.push(event));
  const response = await handler(
    new Request("http://gate/slack", { method: "POST", headers: { "webhook-id": "Ev-1" }, body: "{}" }),
  );
  assert.equal(response.status, 400);
  const text = await response.text();
  assert.ok(!text.includes("10.0.0.7") && !text.includes("billing_admin"), `no application text: ${text}`);
  assert.deepEqual(JSON.parse(text), {
    ack: "rejected",
    reason: "delivery_unreadable",
    error: "the delivery's tenant or delivery id could not be read from it",
  });
  assert.equal(calls.process, 0);
  const logged = events.filter((event) => event.event === "webhook.rejected");
  assert.equal(logged.length, 1);
  assert.equal(logged[0].reason, "delivery_unreadable");
  assert.equal(logged[0].scope, SCOPE);
  assert.equal(logged[0].error, secret, "the operator gets the application's text");
});

Deno.test("webhookHandler verifies first: a bad signature is 401 and never claimed; a delivery without an event id is 400", async () => {
  const events: PlaneEvent[] = [];
  const secret = "expected v1,abc but got v1,xyz for whsec_SECRET";
  const signed = (request: Request) => {
    const signature = request.headers.get("webhook-signature");
    if (signature === "throw") throw new Error(secret);
    return signature === "good";
  };
  const { handler, calls } = countedEndpoint({ verify: signed }, (event) => void events.push(event));
  const send = (headers: Record<string, string>) =>
    handler(new Request("http://gate/slack", { method: "POST", headers, body: '{"type":"ping"}' }));

  for (const signature of ["bad", "throw"]) {
    const refused = await send({ "webhook-id": uniqueKey("evt"), "webhook-signature": signature });
    assert.equal(refused.status, 401, signature);
    const text = await refused.text();
    assert.ok(!text.includes("whsec") && !text.includes("xyz"), `no verifier text: ${text}`);
    assert.deepEqual(JSON.parse(text), {
      ack: "rejected",
      reason: "signature_invalid",
      error: "the delivery's signature could not be verified",
    });
  }
  assert.deepEqual([calls.organizationOf, calls.deliveryIdOf, calls.process], [0, 0, 0], "nothing claimed");
  const logged = events.filter((event) => event.event === "webhook.rejected" && event.reason === "signature_invalid");
  assert.equal(logged.length, 2);
  assert.equal(logged[1].error, secret, "the operator gets the verifier's text");

  const anonymous = await send({ "webhook-signature": "good" });
  assert.equal(anonymous.status, 400, "not acknowledged: the vendor sees the failure");
  assert.equal((await anonymous.json()).reason, "no_event_id");
  assert.equal(calls.process, 0);

  const good = await send({ "webhook-id": uniqueKey("evt"), "webhook-signature": "good" });
  assert.deepEqual([good.status, await good.json()], [200, { ack: "processed" }]);
  assert.equal(calls.process, 1);
});

/** A JSON event of exactly `size` bytes. */
function eventOf(id: string, size: number): Uint8Array {
  const head = JSON.stringify({ type: "message", id, text: "" }).slice(0, -2);
  return new TextEncoder().encode(head + "w".repeat(size - head.length - 2) + '"}');
}

Deno.test("one body limit: the webhook.* scope stores every body up to the gate's default, whatever its bytes", () => {
  assert.equal(WEBHOOK_SCOPE_MAX_REQUEST_BYTES, 384 * 1024);
  assert.equal(storedBodyBound(DEFAULT_WEBHOOK_BODY_LIMIT_BYTES), 349_546);
  assert.ok(storedBodyBound(DEFAULT_WEBHOOK_BODY_LIMIT_BYTES) <= WEBHOOK_SCOPE_MAX_REQUEST_BYTES);
  assert.equal(largestStorableBody(64 * 1024), 49_137);
  assert.equal(largestStorableBody(WEBHOOK_SCOPE_MAX_REQUEST_BYTES), 294_897);
  for (const limit of [1024, 65_536, 65_537, 65_538, 65_539, 393_216, 4_194_304]) {
    assert.ok(storedBodyBound(largestStorableBody(limit)) <= limit, String(limit));
    assert.ok(storedBodyBound(largestStorableBody(limit) + 1) > limit, String(limit));
  }
  // Whatever the bytes, the stored form is never above the bound.
  for (const fill of [0x01, 0x22, 0x0a, 0x78, 0xff]) {
    for (let n = 0; n < 40; n++) {
      const stored = JSON.stringify(storedBody(new Uint8Array(n).fill(fill)));
      assert.ok(new TextEncoder().encode(stored).length <= storedBodyBound(n), `${n} × ${fill}: ${stored}`);
    }
  }
});

Deno.test("webhookHandler over a real server: a signed event at the default limit is taken, stored whole and re-driven; one byte more is 413 before verify", async () => {
  const org = organization();
  const limit = DEFAULT_WEBHOOK_BODY_LIMIT_BYTES;
  // Processing keeps failing, so the event is left, with its body, for a
  // re-drive. The timeout counts from before the claim, which carries the
  // whole body: long enough that a busy machine still reaches processing.
  const gate = new WebhookGate(plane(), {
    processingTimeoutMs: 2_000,
    heartbeatLeaseMs: 3_000,
    closeOnBeforeUnload: false,
    log: silent,
  });
  let verified = 0;
  const handler = webhookHandler({
    gate,
    scope: SCOPE,
    verify: (request) => (verified += 1, request.headers.get("webhook-signature") === "good"),
    organizationOf: () => org,
    deliveryIdOf: (request) => request.headers.get("webhook-id") ?? "",
    process: () => Promise.reject(ProcessingError.retryable("downstream 503")),
  });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, handler);
  try {
    const post = (id: string, signature: string, body: Uint8Array) =>
      fetch(`http://127.0.0.1:${server.addr.port}/slack`, {
        method: "POST",
        headers: { "webhook-id": id, "webhook-signature": signature },
        body: body as BodyInit,
      });
    const events = [
      [uniqueKey("Ev"), eventOf("evt-104kb", 104_000)],
      [uniqueKey("Ev"), eventOf("evt-at-limit", limit)],
      // Text whose JSON escapes are six times its size: stored as base64.
      [uniqueKey("Ev"), new Uint8Array(limit).fill(0x01)],
    ] as const;
    for (const [id, body] of events) {
      const taken = await post(id, "good", body);
      assert.deepEqual([taken.status, await taken.json()], [200, { ack: "accepted" }], `${body.length} bytes`);
    }

    for (const signature of ["good", "forged"]) {
      const over = eventOf("evt-over", limit + 1);
      await rejection(await post(uniqueKey("Ev"), signature, over), 413, "body_too_large");
    }
    assert.equal(verified, events.length, "no body above the limit reached verify");

    const seen: Redelivery[] = [];
    let report: RedriveReport = { redriven: 0, journaled: 0, deadLettered: 0, left: 0 };
    await eventually("the three events are re-driven once their lease passed", async () => {
      await sleep(200);
      const pass = await gate.redrive({ scope: SCOPE, limit: 10, organizationId: org }, (redelivery) => {
        seen.push(redelivery);
        return Promise.resolve({ done: true });
      });
      report = { ...report, redriven: report.redriven + pass.redriven, journaled: report.journaled + pass.journaled };
      return report.journaled === events.length;
    }, 20_000);
    assert.equal(report.redriven, events.length);
    assert.equal(seen.length, events.length);
    for (const [id, body] of events) {
      const redriven = seen.find((r) => r.deliveryId === id);
      assert.ok(redriven !== undefined && redriven.attempt === 2, id);
      assert.deepEqual(redriven.body, body, "the very bytes the vendor sent");
      const again = await post(id, "good", body);
      assert.deepEqual(await again.json(), { ack: "dropped", drop_reason: "duplicate" });
    }
  } finally {
    await server.shutdown();
  }
});
