// The three endings through `idempotent`, as the Rust driver's: journaled
// (success and business failure, any bytes, any size), released (only on
// NothingHappened), left to its lease (a throw, a timeout, a journal that
// does not land) — and a journal the database refuses after the effect.

import assert from "node:assert/strict";
import {
  type Answer,
  EffectDriver,
  elidedOf,
  failure,
  idempotent,
  type IdempotentOptions,
  makeIdempotent,
  MIN_MARGIN_MS,
  NothingHappened,
  PlaneError,
  responseRefOf,
  success,
  Timing,
  vendorKey,
  WebhookGate,
  withIdempotencyKey,
} from "../_shared/idempotency/mod.ts";
import {
  hashOf,
  HOUR_MS,
  Lossy,
  organization,
  plane,
  restoreWallClock,
  sleep,
  stepWallClock,
  uniqueKey,
} from "./support.ts";

const SCOPE = "tool.email.send";

function options(extra: Partial<IdempotentOptions> = {}): IdempotentOptions {
  return {
    plane: plane(),
    organizationId: organization(),
    scope: SCOPE,
    key: uniqueKey(),
    request: { to: "a@example.com" },
    timeoutMs: 2_000,
    journalDeadlineMs: 2_000,
    marginMs: 1_000,
    ...extra,
  };
}

Deno.test("a success is journaled once and replayed to every duplicate, equal to the first answer", async () => {
  const opts = options();
  let runs = 0;
  const effect = () => {
    runs += 1;
    return success({ message_id: "m-1", text: "nul \0 inside" }, { resourceType: "email", resourceId: "m-1" });
  };
  const first = await idempotent(effect, opts);
  assert.equal(first.status, "ran");
  if (first.status !== "ran") return;
  assert.deepEqual(first.settled, { ending: "journaled" });
  const again = await idempotent(effect, opts);
  assert.deepEqual(again, { status: "replayed", answer: first.answer });
  assert.equal(runs, 1);
  assert.equal((await idempotent(effect, { ...opts, request: { to: "b@example.com" } })).status, "conflict");
});

Deno.test("idempotent() with heartbeats claims a short lease that its beats keep past its end", async () => {
  const opts = options({ timeoutMs: 8_000, heartbeatLeaseMs: 3_000 });
  let rival: string | undefined;
  const first = await idempotent(async () => {
    await sleep(3_600);
    // Past the first lease's end, a rival claim still finds it in flight.
    const hash = await hashOf(opts.request);
    const seen = await opts.plane.claim({
      organizationId: opts.organizationId,
      scope: opts.scope,
      key: opts.key,
      requestHash: hash,
      leaseMs: 30_000,
    });
    rival = seen.outcome;
    return success("rendered");
  }, opts);
  assert.equal(rival, "processing");
  assert.equal(first.status, "ran");
  assert.throws(() => new Timing(8_000).withHeartbeats(2_000));
});

Deno.test("a business failure is journaled and replays as the same failure", async () => {
  const opts = options();
  const declined = failure("card_declined", { code: 51 });
  const first = await idempotent(() => declined, opts);
  assert.equal(first.status, "ran");
  assert.deepEqual(await idempotent(() => success("never"), opts), { status: "replayed", answer: declined });
});

Deno.test("NothingHappened releases the claim, so the next attempt runs the effect", async () => {
  const opts = options();
  const first = await idempotent(() => {
    throw new NothingHappened("the vendor refused the connection");
  }, opts);
  assert.equal(first.status, "failed");
  if (first.status !== "failed") return;
  assert.deepEqual(first.settled, { ending: "released" });
  assert.equal((await idempotent(() => success(2), opts)).status, "ran");
});

Deno.test("any other throw, or a timeout, leaves the claim to its lease: a duplicate meanwhile is in flight", async () => {
  for (
    const effect of [
      () => {
        throw new Error("the vendor's answer was lost");
      },
      async () => {
        await sleep(1_500);
        return success("late");
      },
    ]
  ) {
    const opts = options({ timeoutMs: 500, journalDeadlineMs: 500, marginMs: 1_000 });
    const first = await idempotent(effect, opts);
    assert.equal(first.status, "failed");
    if (first.status !== "failed") return;
    assert.equal(first.settled.ending, "left_to_lease");
    assert.equal((await idempotent(() => success("again"), opts)).status, "in_flight");
    // After the lease (2 s), the next attempt reclaims and runs.
    await sleep(2_100);
    const after = await idempotent(() => success("again"), opts);
    assert.equal(after.status, "ran");
  }
});

Deno.test("a completion whose answer was lost is asked again inside the journal's deadline and lands once", async () => {
  const lossy = new Lossy().loseNext("idempotency_complete", 2);
  const opts = options({ plane: plane({ fetch: lossy.fetch }) });
  const first = await idempotent(() => success("once"), opts);
  assert.equal(first.status, "ran");
  if (first.status !== "ran") return;
  assert.deepEqual(first.settled, { ending: "journaled" });
  assert.equal(lossy.count("idempotency_complete"), 3);
  assert.deepEqual(await idempotent(() => success("twice"), { ...opts, plane: plane() }), {
    status: "replayed",
    answer: success("once"),
  });
});

Deno.test("a release whose answer was lost and whose repeat deletes nothing is reported released, as it landed", async () => {
  const lossy = new Lossy().loseNext("idempotency_release");
  const opts = options({ plane: plane({ fetch: lossy.fetch }) });
  const first = await idempotent(() => {
    throw new NothingHappened("vendor 429");
  }, opts);
  assert.equal(first.status, "failed");
  if (first.status !== "failed") return;
  assert.deepEqual(first.settled, { ending: "released" }, "not lease_moved_on: the row is gone");
  assert.equal(lossy.count("idempotency_release"), 2, "the lost release, and its repeat");
  assert.equal((await idempotent(() => success("ran"), opts)).status, "ran", "the key is free");
});

Deno.test("a journal the plane refuses after the effect goes by reference, keeping ok, error and resource", async () => {
  // This client believes the limit is 1 MiB; the scope's policy keeps 64 KiB,
  // so the database refuses the answer (IDEM2) after the effect happened.
  const big = "x".repeat(200_000);
  const resource = { resourceType: "report", resourceId: "r-7" };
  const opts = options({ plane: plane({ responseLimitBytes: 1024 * 1024 }) });
  const first = await idempotent(() => failure("partial", big, resource), opts);
  assert.equal(first.status, "ran");
  if (first.status !== "ran") return;
  assert.deepEqual(first.settled, { ending: "journaled", standIn: "refused" });
  const again = await idempotent(() => success("never"), opts);
  assert.equal(again.status, "replayed");
  if (again.status !== "replayed") return;
  assert.equal(again.answer.ok, false);
  assert.equal(again.answer.error, "partial");
  assert.deepEqual(again.answer.resource, resource);
  const reference = responseRefOf(again.answer.output);
  assert.ok(reference, JSON.stringify(again.answer.output));
  assert.equal(reference.size, big.length + 2);
  // Without a resource: a summary, and still a failure.
  const bare = options({ plane: plane({ responseLimitBytes: 1024 * 1024 }) });
  await idempotent(() => failure("partial", big), bare);
  const summary = await idempotent(() => success("never"), bare);
  assert.ok(summary.status === "replayed" && elidedOf(summary.answer.output), JSON.stringify(summary));
});

Deno.test("an answer above the store limit goes by reference to its resource", async () => {
  const opts = options();
  const big = { rows: "y".repeat(100_000) };
  const first = await idempotent(() => success(big, { resourceType: "export", resourceId: "e-1" }), opts);
  assert.ok(first.status === "ran" && first.settled.ending === "journaled" && first.settled.standIn === "too_large");
  const again = await idempotent(() => success("never"), opts);
  assert.ok(again.status === "replayed" && responseRefOf(again.answer.output)?.resource_id === "e-1");
});

Deno.test("journalExact gives a refused answer back with the claim still held", async () => {
  const p = plane({ responseLimitBytes: 1024 * 1024 });
  const driver = new EffectDriver(p);
  const spec = {
    organizationId: organization(),
    scope: SCOPE,
    key: uniqueKey(),
    requestHash: await hashOf(1),
    timing: new Timing(2_000, 2_000, 1_000),
  };
  const begun = await driver.begin(spec);
  assert.equal(begun.kind, "held");
  if (begun.kind !== "held") return;
  const refused = await begun.held.journalExact(success("z".repeat(100_000)));
  assert.ok("refused" in refused && refused.refused.code === "IDEM2", JSON.stringify(refused));
  assert.deepEqual(await begun.held.settle({ journal: success("small") }), { ending: "journaled" });
  await assert.rejects(begun.held.settle("release"), /already settled/);
});

Deno.test("a lease margin under the 1 s floor is refused before any request, in every caller's options", async () => {
  for (const margin of [0, 999, -1, Number.NaN]) {
    assert.throws(
      () => new Timing(1_000, 1_000, margin),
      (error: unknown) => error instanceof PlaneError && error.reason === "margin_below_floor",
      `margin ${margin}`,
    );
  }
  assert.equal(new Timing(1_000, 1_000, MIN_MARGIN_MS).leaseMs, 3_000);
  const lossy = new Lossy();
  let runs = 0;
  await assert.rejects(
    idempotent(() => {
      runs += 1;
      return success("never");
    }, options({ plane: plane({ fetch: lossy.fetch }), marginMs: 500 })),
    (error: unknown) => error instanceof PlaneError && error.reason === "margin_below_floor",
  );
  assert.equal(runs, 0);
  assert.equal(lossy.count("idempotency_claim"), 0, "nothing was sent");
  const belowFloor = (error: unknown) => error instanceof PlaneError && error.reason === "margin_below_floor";
  assert.throws(() => new WebhookGate(plane(), { marginMs: 0 }), belowFloor, "the webhook gate");
  assert.throws(
    () =>
      withIdempotencyKey(() => new Response("never"), {
        plane: plane(),
        organizationId: organization(),
        route: "orders.create",
        marginMs: 0,
      }),
    belowFloor,
    "the Idempotency-Key middleware",
  );
});

Deno.test("a lease that outlives the caller's retries is refused, and the vendor key is the Rust one", async () => {
  assert.throws(() => new Timing(60_000).check(30_000), /outlasts/);
  // The Rust tool guard's unit tests pin the same value.
  assert.equal(
    await vendorKey("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "tool.email.send", "run:1:step:2"),
    "3aa05fba1bec70f2b5b4cda4819d67efe3d250b2e4970c266b7b9448155f71df",
  );
});

Deno.test("makeIdempotent wraps an effect whose key and tenant come from its input", async () => {
  const org = organization();
  let runs = 0;
  const send = makeIdempotent(
    (input: { id: string; to: string }): Answer => {
      runs += 1;
      return success({ sent: input.to });
    },
    { plane: plane(), scope: SCOPE, timeoutMs: 2_000, keyOf: (i) => i.id, organizationOf: () => org },
  );
  const id = uniqueKey();
  assert.equal((await send({ id, to: "a" })).status, "ran");
  assert.equal((await send({ id, to: "a" })).status, "replayed");
  assert.equal((await send({ id, to: "b" })).status, "conflict");
  assert.equal(runs, 1);
});

Deno.test("the first answer is the journal's JSON form, so a replay equals it; one with no JSON form is still journaled", async () => {
  const dated = options();
  const first = await idempotent(() => success({ at: new Date(0), gone: undefined, n: NaN }), dated);
  assert.ok(first.status === "ran" && first.settled.ending === "journaled", JSON.stringify(first));
  assert.deepEqual(first.answer, success({ at: "1970-01-01T00:00:00.000Z", n: null }));
  assert.deepEqual(await idempotent(() => success("never"), dated), { status: "replayed", answer: first.answer });

  const unserializable = options();
  const big = await idempotent(() => success({ amount: 10n }), unserializable);
  assert.ok(big.status === "ran" && big.settled.ending === "journaled", JSON.stringify(big, (_, v) => String(v)));
  assert.ok(elidedOf(big.answer.output)?.reason === "refused");
  assert.deepEqual(await idempotent(() => success("never"), unserializable), {
    status: "replayed",
    answer: big.answer,
  });
});

Deno.test("an effect that ignores its signal but ends soon after its timeout is journaled, not run again", async () => {
  const opts = options({ timeoutMs: 300, journalDeadlineMs: 2_000, marginMs: 1_000 });
  let runs = 0;
  const first = await idempotent(async () => {
    runs += 1;
    await sleep(600);
    return success("late but done");
  }, opts);
  assert.ok(first.status === "ran" && first.settled.ending === "journaled", JSON.stringify(first));
  assert.deepEqual(await idempotent(() => success("again"), opts), {
    status: "replayed",
    answer: success("late but done"),
  });
  assert.equal(runs, 1);
});

Deno.test("a wall clock stepped back or forward an hour moves no deadline: the effect runs, is cut at its timeout, its journal lands", async () => {
  for (const step of [-HOUR_MS, HOUR_MS]) {
    const driver = new EffectDriver(plane());
    const spec = {
      organizationId: organization(),
      scope: SCOPE,
      key: uniqueKey(),
      requestHash: await hashOf({ step }),
      timing: new Timing(300, 1_000, 1_000),
    };
    const begun = await driver.begin(spec);
    assert.equal(begun.kind, "held");
    if (begun.kind !== "held") return;
    let started = false;
    let lateTimer: ReturnType<typeof setTimeout> | undefined;
    stepWallClock(step);
    try {
      const before = performance.now();
      // Ignores its signal; ends 3 s on unless cut (and then never).
      const ran = await begun.held.run((signal) => {
        started = true;
        return new Promise((resolve) => {
          lateTimer = setTimeout(() => resolve("too late"), 3_000);
          signal.addEventListener("abort", () => clearTimeout(lateTimer));
        });
      });
      const took = performance.now() - before;
      assert.ok(started, `step ${step}: the effect ran (its deadline had not passed)`);
      assert.deepEqual(ran, { cut: "timed_out" }, `step ${step}`);
      assert.ok(took < 1_500, `step ${step}: cut at its 300 ms timeout, not ${Math.round(took)} ms on`);
      assert.deepEqual(await begun.held.settle({ journal: failure("timed_out") }), { ending: "journaled" });
    } finally {
      clearTimeout(lateTimer);
      restoreWallClock();
    }
    const again = await driver.begin(spec);
    assert.deepEqual(again, { kind: "replayed", answer: failure("timed_out") }, `step ${step}`);
  }
});

Deno.test("the first answer is the replay's, byte for byte, whatever it holds", async () => {
  const deep = Array.from({ length: 100 }).reduce<unknown>((inner) => [inner], 1);
  const cases: Array<[string, Answer]> = [
    ["member order", success({ zeta: 1, a: { yy: [3, { b: 1, aa: 2 }], x: null }, "10": "n", "2": "m", éé: true })],
    ["long error", failure("e".repeat(70_000), { field: "to" })],
    ["nul", failure("bad\0byte", { body: "PK\0\u0003", z: 1, a: 2 })],
    ["oversized", success({ rows: "x".repeat(100 * 1024), b: 1, a: 2 })],
    [
      "oversized with resource",
      success({ rows: "x".repeat(100 * 1024) }, { resourceType: "export", resourceId: "x-1" }),
    ],
    ["deep", success(deep)],
    ["marker-shaped", success({ $json: "{}" })],
    // A member named __proto__ is data: kept, never made a prototype.
    ["proto", success(JSON.parse('{"__proto__": {"isAdmin": true}, "a": 1}'))],
  ];
  for (const [name, made] of cases) {
    const opts = options();
    const first = await idempotent(() => made, opts);
    assert.equal(first.status, "ran", name);
    if (first.status !== "ran") return;
    assert.equal(first.settled.ending, "journaled", name);
    const again = await idempotent(() => success("never"), opts);
    assert.equal(again.status, "replayed", name);
    if (again.status !== "replayed") return;
    assert.equal(
      JSON.stringify(first.answer),
      JSON.stringify(again.answer),
      `${name}: the first answer is the replay's`,
    );
    assert.equal(first.answer.ok, made.ok, name);
    if (name === "proto") {
      const output = again.answer.output as Record<string, unknown>;
      assert.ok(Object.hasOwn(output, "__proto__"), JSON.stringify(again.answer));
      assert.equal((output as { isAdmin?: unknown }).isAdmin, undefined, "no prototype was set");
      assert.ok(JSON.stringify(first.answer).includes("isAdmin"), "the member is kept");
    }
  }
});

Deno.test("idempotent() without timeoutMs or leaseMs is refused before any request, naming both", async () => {
  const lossy = new Lossy();
  const { timeoutMs: _timeout, ...rest } = options({ plane: plane({ fetch: lossy.fetch }) });
  await assert.rejects(idempotent(() => success(1), rest), (error: unknown) => {
    assert.ok(error instanceof PlaneError, String(error));
    assert.equal(error.kind, "invalid_input");
    assert.equal(error.reason, "bad_configuration");
    assert.match(error.message, /timeoutMs/);
    assert.match(error.message, /leaseMs/);
    return true;
  });
  assert.equal(lossy.calls.length, 0, "nothing was sent");
});

Deno.test("idempotent() throws a PlaneError of the documented kind, and only before the effect ran", async () => {
  let ran = 0;
  const effect = () => {
    ran += 1;
    return success(1);
  };
  const kinds: Array<[string, Partial<IdempotentOptions>, (error: PlaneError) => boolean]> = [
    ["malformed organization", { organizationId: "not-a-uuid" }, (e) => e.reason === "malformed_organization"],
    ["key over 512 characters", { key: "k".repeat(513) }, (e) => e.reason === "key_too_long"],
    ["unknown scope", { scope: "nobody.knows" }, (e) => e.kind === "unknown_scope"],
    [
      "plane unreachable",
      { plane: plane({ fetch: new Lossy().refuseAll().fetch }), askForMs: 300 },
      (e) => e.isTransient,
    ],
  ];
  for (const [name, extra, expected] of kinds) {
    await assert.rejects(idempotent(effect, options(extra)), (error: unknown) => {
      assert.ok(error instanceof PlaneError, `${name}: ${error}`);
      assert.ok(expected(error), `${name}: ${error.kind} ${error.reason ?? ""} ${error.message}`);
      return true;
    });
  }
  assert.equal(ran, 0, "the effect never ran");
});
