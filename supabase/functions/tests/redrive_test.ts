// Work that outlives its worker, through the TypeScript client against a
// real plane: a claim carries its work, a heartbeat keeps the lease, a
// re-drive hands orphans out once with a fresh fence, and dead-letters what
// was handed out too often.

import assert from "node:assert/strict";
import {
  bodyOf,
  codes,
  EffectDriver,
  IdempotencyPlane,
  idempotent,
  PlaneError,
  type PlaneEvent,
  type Redelivery,
  type RedriveReport,
  sha256HexOfBytes,
  silent,
  storedBody,
  storedBodyBound,
  success,
  Timing,
  WebhookGate,
} from "../_shared/idempotency/mod.ts";
import { hashOf, Lossy, organization, plane, sleep, superuserSql, uniqueKey } from "./support.ts";

const SCOPE = "webhook.svix";

async function claimWithWork(p: IdempotencyPlane, org: string, key: string, work: unknown, leaseMs = 2_000) {
  const hash = await hashOf({ key });
  const outcome = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs, work });
  if (outcome.outcome !== "claimed") throw new Error(`expected a claim, got ${outcome.outcome}`);
  return { claim: outcome.claim, hash };
}

Deno.test("a claim carries its work, which only a re-drive hands out, once, with a fresh fence", async () => {
  const p = plane();
  const org = organization();
  const key = uniqueKey();
  const work = { event: "evt_ts_carried", body: "ünïcode" };
  const { claim, hash } = await claimWithWork(p, org, key, work);
  const rival = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000 });
  assert.equal(rival.outcome, "processing");
  assert.ok(!JSON.stringify(rival).includes("evt_ts_carried"), "another caller never sees the work");
  assert.deepEqual(await p.redrive({ scope: "webhook.*", limit: 10, leaseMs: 30_000, organizationId: org }), []);

  await sleep(2_300);
  const taken = await p.redrive({ scope: "webhook.*", limit: 10, leaseMs: 30_000, organizationId: org });
  assert.equal(taken.length, 1);
  const [orphan] = taken;
  assert.equal(orphan.outcome, "redriven");
  if (orphan.outcome !== "redriven") return;
  assert.deepEqual(orphan.request, work);
  assert.equal(orphan.attempt, 2);
  assert.equal(orphan.claim.id, claim.id);
  assert.notEqual(orphan.claim.leaseToken, claim.leaseToken);
  assert.deepEqual(await p.redrive({ scope: SCOPE, limit: 10, leaseMs: 30_000, organizationId: org }), []);

  // The old holder wakes up: fenced off everywhere.
  assert.equal(await p.extend(claim, 30_000), null);
  assert.equal(await p.complete(claim, { response: { ok: true, output: 1 } }), "lease_moved_on");
  assert.equal(await p.complete(orphan.claim, { response: { ok: true, output: 2 } }), "recorded");
  const replay = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000 });
  assert.equal(replay.outcome, "completed");
  assert.ok(!JSON.stringify(replay).includes("evt_ts_carried"));
});

Deno.test("a heartbeat keeps the lease of its holder alone, and answers null once the fence moved on", async () => {
  const p = plane();
  const org = organization();
  const key = uniqueKey();
  // A 2 s lease and a heartbeat every 400 ms for three leases: a beat may be
  // 1.6 s late on a loaded machine before a rival could take the claim.
  const { claim, hash } = await claimWithWork(p, org, key, { n: 1 }, 2_000);
  for (let beat = 0; beat < 15; beat++) {
    await sleep(400);
    const end = await p.extend(claim, 2_000);
    assert.ok(end !== null && Date.parse(end) > Date.parse(claim.leaseExpiresAt), `beat ${beat}: ${end}`);
    const rival = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000 });
    assert.equal(rival.outcome, "processing", `beat ${beat}`);
  }
  assert.equal(await p.extend({ ...claim, leaseToken: crypto.randomUUID() }, 1_000), null, "another token");
  await assert.rejects(p.extend(claim, 10), (e: unknown) => e instanceof PlaneError && e.reason === "lease_too_short");
  await sleep(2_300);
  const taken = await p.redrive({ scope: SCOPE, limit: 10, leaseMs: 30_000, organizationId: org });
  assert.deepEqual(taken.map((t) => t.outcome), ["redriven"]);
  assert.equal(await p.extend(claim, 1_000), null, "taken over: the holder must stop");
});

Deno.test("work handed out max_attempts times is journaled as a dead letter that every later claim replays", async () => {
  const p = plane();
  const org = organization();
  const key = uniqueKey();
  const { hash } = await claimWithWork(p, org, key, { poison: true }, 1_000);
  const attempts: number[] = [];
  let dead;
  for (let round = 0; round < 6 && dead === undefined; round++) {
    await sleep(1_200);
    const [taken] = await p.redrive({ scope: SCOPE, limit: 10, leaseMs: 1_000, organizationId: org });
    assert.ok(taken !== undefined, `round ${round}: the orphan is re-driven`);
    if (taken.outcome === "redriven") attempts.push(taken.attempt);
    else dead = taken;
  }
  assert.deepEqual(attempts, [2, 3, 4, 5]);
  assert.ok(dead !== undefined && dead.outcome === "dead_lettered");
  assert.equal(dead.attempts, 5);
  assert.deepEqual([dead.answer.ok, dead.answer.error], [false, "dead_lettered"]);
  const replay = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000 });
  assert.equal(replay.outcome, "completed");
  if (replay.outcome === "completed") assert.equal(replay.answer.error, "dead_lettered");
});

Deno.test("bad input to a re-drive or a claim's work is refused with a clear reason or code, and changes nothing", async () => {
  const p = plane();
  const org = organization();
  const refused = (reason: string) => (e: unknown) => e instanceof PlaneError && e.reason === reason;
  await assert.rejects(p.redrive({ scope: SCOPE, limit: 1001, leaseMs: 30_000 }), refused("bound_above_cap"));
  await assert.rejects(p.redrive({ scope: SCOPE, limit: 0, leaseMs: 30_000 }), refused("bound_above_cap"));
  await assert.rejects(p.redrive({ scope: "Webhook.*", limit: 1, leaseMs: 30_000 }), refused("malformed_scope"));
  await assert.rejects(p.redrive({ scope: SCOPE, limit: 1, leaseMs: 999 }), refused("lease_too_short"));
  await assert.rejects(
    p.redrive({ scope: "nope.*", limit: 1, leaseMs: 30_000 }),
    (e: unknown) => e instanceof PlaneError && e.kind === "unknown_scope",
  );
  const key = uniqueKey();
  const hash = await hashOf({ key });
  const large = { body: "x".repeat(400_000) };
  let deep: unknown = 1;
  for (let i = 0; i < 70; i++) deep = [deep];
  for (const [work, code] of [[large, codes.REQUEST_TOO_LARGE], [deep, codes.REQUEST_TOO_DEEP]] as const) {
    await assert.rejects(
      p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000, work }),
      (e: unknown) => e instanceof PlaneError && e.code === code && e.status === 400,
    );
    const read = await p.read({ organizationId: org, scope: SCOPE, key, requestHash: hash });
    assert.equal(read.outcome, "absent", "nothing written");
  }
});

Deno.test("under heartbeats an effect running past three of its leases keeps its claim, and journals", async () => {
  const p = plane();
  const driver = new EffectDriver(p);
  const timing = new Timing(15_000, 4_000, 1_000).withHeartbeats(3_000);
  assert.equal(timing.leaseMs, 3_000, "a stopped worker's claim is free after 3 s");
  const spec = { organizationId: organization(), scope: SCOPE, key: uniqueKey(), requestHash: await hashOf(1), timing };
  const begun = await driver.begin(spec);
  assert.equal(begun.kind, "held");
  if (begun.kind !== "held") return;
  const rivals: string[] = [];
  const ran = await begun.held.run(async () => {
    const until = performance.now() + 9_500;
    while (performance.now() < until) {
      const rival = await p.claim({ ...spec, leaseMs: 3_000 });
      rivals.push(rival.outcome);
      await sleep(250);
    }
    return "rendered";
  });
  assert.deepEqual(ran, { value: "rendered" });
  assert.ok(rivals.length >= 20 && rivals.every((outcome) => outcome === "processing"), rivals.join());
  assert.deepEqual(await begun.held.settle({ journal: success("rendered") }), { ending: "journaled" });
});

Deno.test("a heartbeat that finds the claim taken over aborts the effect's signal", async () => {
  const timing = new Timing(15_000, 4_000, 1_000).withHeartbeats(3_000);
  const spec = { organizationId: organization(), scope: SCOPE, key: uniqueKey(), requestHash: await hashOf(2), timing };
  const begun = await new EffectDriver(plane(), { log: silent }).begin(spec);
  assert.equal(begun.kind, "held");
  if (begun.kind !== "held") return;
  const claimId = begun.held.claim.id;
  // This worker's beats still land, but the database ends its lease early (as
  // a step of its clock would), and another worker takes the claim over: the
  // next beat finds the fence moved on, long before this worker's own clock
  // would stop the effect. (A beat landing in between moves the lease again:
  // then end it again.)
  const taken = (async () => {
    for (let tries = 0; tries < 5; tries++) {
      await superuserSql(
        `update agent.idempotency_keys set lease_expires_at = clock_timestamp() - interval '1 second' where id = '${claimId}'`,
      );
      const rival = await plane().claim({ ...spec, leaseMs: 30_000 });
      if (rival.outcome !== "processing") return rival.outcome;
    }
    return "processing";
  })();
  let aborted: unknown;
  const ran = await begun.held.run((signal) =>
    new Promise((resolve) => {
      signal.addEventListener("abort", () => {
        aborted = signal.reason;
        resolve("stopped");
      });
    })
  );
  assert.equal(await taken, "reclaimed");
  assert.deepEqual(ran, { cut: "fence_lost" });
  assert.ok(aborted instanceof PlaneError, String(aborted));
  assert.ok(begun.held.fenceLost);
  assert.deepEqual(await begun.held.settle({ journal: success(1) }), { ending: "lease_moved_on" });
});

Deno.test("beats that fail stop the effect before its lease can pass: its signal aborts while the key is still held", async () => {
  const lossy = new Lossy();
  const events: PlaneEvent[] = [];
  const timing = new Timing(15_000, 4_000, 1_000).withHeartbeats(3_000);
  const spec = { organizationId: organization(), scope: SCOPE, key: uniqueKey(), requestHash: await hashOf(5), timing };
  const begun = await new EffectDriver(plane({ fetch: lossy.fetch }), { log: (event) => events.push(event) })
    .begin(spec);
  assert.equal(begun.kind, "held");
  if (begun.kind !== "held") return;
  // Cut off from the plane from the claim on: every beat fails.
  lossy.refuseAll();
  let aborted: unknown;
  let rivalAtAbort: Promise<string> | undefined;
  let late = false;
  const ran = await begun.held.run((signal) =>
    new Promise((resolve) => {
      signal.addEventListener("abort", () => {
        aborted = signal.reason;
        // Stopped before the lease passes: the key is not free yet.
        rivalAtAbort = plane().claim({ ...spec, leaseMs: 30_000 }).then((rival) => rival.outcome);
        // A value after the cut: ignored.
        setTimeout(() => (late = true, resolve("late")), 100);
      });
    })
  );
  assert.deepEqual(ran, { cut: "lease_unconfirmed" });
  assert.ok(aborted instanceof PlaneError && aborted.kind === "lease_lapsed", String(aborted));
  assert.match(aborted.message, /could not be confirmed/);
  assert.equal(await rivalAtAbort, "processing", "the effect was told to stop while the key was still held");
  assert.equal(begun.held.fenceLost, false);
  assert.ok(lossy.count("idempotency_extend") >= 1, "beats were tried");
  assert.ok(events.some((event) => event.event === "idempotency.heartbeat_failed"));
  const logged = events.find((event) => event.event === "idempotency.lease_unconfirmed");
  assert.ok(logged && logged.level === "warn" && logged.key === spec.key, JSON.stringify(logged));
  assert.ok(!JSON.stringify(logged).includes(begun.held.claim.leaseToken), "the lease token is never logged");
  const settled = await begun.held.settle({ unknown: "the lease could not be confirmed" });
  assert.equal(settled.ending, "left_to_lease");
  await sleep(200);
  assert.equal(late, true);
  // Nothing was written: once the lease passes, another worker takes it over.
  let rival = "processing";
  for (let poll = 0; poll < 40 && rival === "processing"; poll++) {
    await sleep(250);
    rival = (await plane().claim({ ...spec, leaseMs: 30_000 })).outcome;
  }
  assert.equal(rival, "reclaimed");
});

Deno.test("an effect that overran its timeout is not waited for past a lease no beat confirmed, nor its late value journaled", async () => {
  const lossy = new Lossy();
  const options = {
    plane: plane({ fetch: lossy.fetch }),
    organizationId: organization(),
    scope: "tool.email.send",
    key: uniqueKey(),
    request: { to: "late@example.com" },
    timeoutMs: 1_000,
    journalDeadlineMs: 8_000,
    marginMs: 1_000,
    heartbeatLeaseMs: 3_000,
    log: silent,
  };
  // The effect overruns its 1 s timeout, ignoring its signal, and answers at
  // 3 s. Meanwhile the plane cannot be reached for 2.5 s from its start: the
  // lease is confirmed until 3 s after the claim, so the wait for its late
  // value ends 2 s after the claim, with nothing journaled, although the
  // plane is back by the time the value comes.
  const result = await idempotent(async () => {
    lossy.refuseAll();
    setTimeout(() => lossy.refuseAll(false), 2_500);
    await sleep(3_000);
    return success("late");
  }, options);
  assert.equal(result.status, "failed");
  if (result.status !== "failed") return;
  assert.equal(result.why, "lease_unconfirmed");
  assert.equal(result.settled.ending, "left_to_lease");
  assert.ok(result.error instanceof PlaneError && result.error.kind === "lease_lapsed", String(result.error));
  await sleep(1_500);
  const read = await plane().read({ ...options, requestHash: await hashOf(options.request) });
  assert.notEqual(read.outcome, "completed", "the late value was never journaled");
  assert.equal(lossy.count("idempotency_complete"), 0, "no journal was tried");
});

Deno.test("a run after heartbeats kept failing confirms the lease first: taken over meanwhile, the effect never starts", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const timing = new Timing(15_000, 4_000, 1_000).withHeartbeats(3_000);
  const spec = { organizationId: organization(), scope: SCOPE, key: uniqueKey(), requestHash: await hashOf(3), timing };
  const begun = await new EffectDriver(p).begin(spec);
  assert.equal(begun.kind, "held");
  if (begun.kind !== "held") return;
  // Between two runs every heartbeat fails; the lease passes and another
  // worker takes the claim over. Then the plane answers again.
  lossy.refuseAll();
  await sleep(3_300);
  assert.equal((await plane().claim({ ...spec, leaseMs: 30_000 })).outcome, "reclaimed");
  lossy.refuseAll(false);
  let started = false;
  const ran = await begun.held.run(() => {
    started = true;
    return "ran twice";
  });
  assert.deepEqual(ran, { cut: "fence_lost" });
  assert.equal(started, false, "the effect never started under a lease that had moved on");
  assert.ok(begun.held.fenceLost);
  assert.deepEqual(await begun.held.settle({ journal: success(1) }), { ending: "lease_moved_on" });
});

Deno.test("beats that fail until the deadline never start the effect, and the claim is left to its lease", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const timing = new Timing(4_000, 1_000, 1_000).withHeartbeats(3_000);
  const spec = { organizationId: organization(), scope: SCOPE, key: uniqueKey(), requestHash: await hashOf(4), timing };
  const begun = await new EffectDriver(p).begin(spec);
  assert.equal(begun.kind, "held");
  if (begun.kind !== "held") return;
  lossy.refuseAll();
  await sleep(1_100);
  let started = false;
  const ran = await begun.held.run(() => {
    started = true;
    return "ran";
  });
  assert.deepEqual(ran, { cut: "not_started" });
  assert.equal(started, false, "the effect never started under a lease nobody confirmed");
  lossy.refuseAll(false);
  const settled = await begun.held.settle({ unknown: "the lease could not be confirmed" });
  assert.equal(settled.ending, "left_to_lease");
  const read = await plane().read(spec);
  assert.ok(read.outcome === "processing" || read.outcome === "absent", JSON.stringify(read));
});

Deno.test("an event a worker ACKed and then lost its plane on is re-driven by another worker, once, with its bytes", async () => {
  const org = organization();
  const deliveryId = uniqueKey("evt");
  // Not UTF-8: stored losslessly, handed back byte for byte.
  const body = new Uint8Array([123, 34, 105, 100, 34, 58, 0xff, 0x00, 0xfe, 125]);
  const lossy = new Lossy();
  const first = new WebhookGate(plane({ fetch: lossy.fetch }), {
    deadlineMs: 1_000,
    processingTimeoutMs: 4_000,
    journalDeadlineMs: 2_000,
    marginMs: 1_000,
    heartbeatLeaseMs: 3_000,
    closeOnBeforeUnload: false,
    log: silent,
  });
  let started = 0;
  const ack = await first.handle(
    { organizationId: org, scope: "webhook.stripe", deliveryId, body },
    () => {
      started += 1;
      return new Promise(() => {}); // never returns, as a worker stopped mid-processing
    },
  );
  assert.deepEqual(ack, { ack: "accepted", status: 200 });
  // The first worker is cut off from the plane: no heartbeat, no journal.
  lossy.refuseAll();

  const second = new WebhookGate(plane(), { heartbeatLeaseMs: 3_000, closeOnBeforeUnload: false, log: silent });
  const seen: Redelivery[] = [];
  const process = (redelivery: Redelivery) => {
    seen.push(redelivery);
    return Promise.resolve({ processed: true });
  };
  let report: RedriveReport | undefined;
  for (let poll = 0; poll < 40 && !report?.redriven; poll++) {
    await sleep(250);
    report = await second.redrive({ scope: "webhook.*", limit: 10, organizationId: org }, process);
  }
  assert.deepEqual(report, { redriven: 1, journaled: 1, deadLettered: 0, left: 0 });
  assert.equal(started, 1);
  assert.equal(seen.length, 1);
  assert.deepEqual([seen[0].deliveryId, seen[0].attempt, seen[0].organizationId], [deliveryId, 2, org]);
  assert.deepEqual(seen[0].body, body);
  const again = await second.handle({ organizationId: org, scope: "webhook.stripe", deliveryId, body }, () => {
    throw new Error("never run again");
  });
  assert.deepEqual(again, { ack: "dropped", status: 200, reason: "duplicate" });
  // The first worker's own ending, which cannot land, runs out before the test ends.
  await sleep(3_500);
});

Deno.test("a delivery too large to store with its claim is answered 413 unclaimed; a closing gate claims nothing", async () => {
  const p = plane();
  const org = organization();
  // A gate told to take more than its scope stores (1 MiB against the
  // 384 KiB webhook.* keeps): the store refuses the work, 413, unclaimed.
  const gate = new WebhookGate(p, { closeOnBeforeUnload: false, log: silent, bodyLimitBytes: 1024 * 1024 });
  const key = uniqueKey("evt");
  const big = new Uint8Array(400_000).fill(120);
  let runs = 0;
  const ack = await gate.handle({ organizationId: org, scope: "webhook.stripe", deliveryId: key, body: big }, () => {
    runs += 1;
    return Promise.resolve(1);
  });
  assert.deepEqual(ack, { ack: "retry", status: 413, reason: "delivery_too_large" });
  const hash = await sha256HexOfBytes(big);
  assert.deepEqual(await p.read({ organizationId: org, scope: "webhook.stripe", key, requestHash: hash }), {
    outcome: "absent",
  });
  gate.close();
  const closing = await gate.handle(
    { organizationId: org, scope: "webhook.stripe", deliveryId: key, body: "{}" },
    () => {
      runs += 1;
      return Promise.resolve(1);
    },
  );
  assert.deepEqual(closing, { ack: "retry", status: 503, reason: "closing" });
  assert.equal(runs, 0);
});

Deno.test("a stored body comes back byte for byte, text or not", () => {
  for (
    const bytes of [
      new TextEncoder().encode('{"id": "evt_1"}'),
      new Uint8Array(),
      new TextEncoder().encode("ünï😀"),
      new Uint8Array([97, 0, 98]),
      new Uint8Array([0xff, 0xfe, 0]),
    ]
  ) {
    assert.deepEqual(bodyOf(storedBody(bytes)), bytes);
  }
  assert.deepEqual(storedBody(new TextEncoder().encode('{"a":1}')), { body_text: '{"a":1}' });
  assert.equal(bodyOf({ id: 1 }), undefined);
  assert.equal(bodyOf({ body_text: "a", body_base64: "" }), undefined);
});

Deno.test("every shared stored-body vector is stored as the Rust gate stores it: the shorter form, within the bound", async () => {
  const vectors: {
    bodies: Array<{ about: string; body_base64: string; stored: unknown; stored_bytes: number }>;
  } = JSON.parse(await Deno.readTextFile(new URL("../../../tests/vectors/stored_bodies.json", import.meta.url)));
  assert.ok(vectors.bodies.length >= 10);
  for (const vector of vectors.bodies) {
    const bytes = Uint8Array.from(atob(vector.body_base64), (char) => char.charCodeAt(0));
    const stored = storedBody(bytes);
    assert.deepEqual(stored, vector.stored, vector.about);
    const size = new TextEncoder().encode(JSON.stringify(stored)).length;
    assert.equal(size, vector.stored_bytes, vector.about);
    assert.ok(size <= storedBodyBound(bytes.length), vector.about);
    assert.deepEqual(bodyOf(stored), bytes, vector.about);
  }
});
