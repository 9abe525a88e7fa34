// Batches through the TypeScript client against a real plane: many claims in
// one round trip, answered exactly as the single claims would be; the batch
// driver ends each item as a single effect ends, one round trip per kind of
// ending, and falls back to each item's own ending when a batch call fails.

import assert from "node:assert/strict";
import {
  type ClaimOutcome,
  driveMany,
  EffectDriver,
  endingName,
  type IdempotencyPlane,
  PlaneError,
  type Settle,
  silent,
  success,
  Timing,
} from "../_shared/idempotency/mod.ts";
import { hashOf, Lossy, organization, plane, sleep, uniqueKey } from "./support.ts";

const SCOPE = "tool.batch";

/** What a batch and the single claims must agree on. */
function seen(outcome: ClaimOutcome, token: string) {
  switch (outcome.outcome) {
    case "claimed":
    case "reclaimed":
      return [outcome.outcome, outcome.claim.leaseToken === token];
    case "completed":
      return [outcome.outcome, JSON.stringify(outcome.answer)];
    default:
      return [outcome.outcome];
  }
}

/** Under `org`: a completed key, a key held by another worker, a key of another request, an orphan. */
async function everyState(p: IdempotencyPlane, org: string, hash: string): Promise<void> {
  const claim = (key: string, requestHash = hash, leaseMs = 60_000) =>
    p.claim({ organizationId: org, scope: SCOPE, key, requestHash, leaseMs });
  const done = await claim("done");
  if (done.outcome !== "claimed") throw new Error("done is free");
  assert.equal(await p.complete(done.claim, { response: { ok: true, output: "sent" } }), "recorded");
  await claim("held");
  await claim("other", await hashOf({ another: 1 }));
  await claim("orphan", hash, 1_000);
}

Deno.test("a batch answers exactly what its items' single claims would, in one round trip", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const hash = await hashOf({ batch: 1 });
  const changed = await hashOf({ changed: 1 });
  const [singlesOrg, batchOrg] = [organization(), organization()];
  await everyState(p, singlesOrg, hash);
  await everyState(p, batchOrg, hash);
  await sleep(1_200); // the orphans' leases pass
  const plan: [string, string][] = [
    ["fresh", hash],
    ["done", hash],
    ["held", hash],
    ["other", hash],
    ["orphan", hash],
    ["fresh", hash],
    ["fresh", changed],
    ["second", hash],
  ];
  const tokens = plan.map(() => crypto.randomUUID());
  const singles: ClaimOutcome[] = [];
  for (const [index, [key, requestHash]] of plan.entries()) {
    singles.push(
      await p.claim({
        organizationId: singlesOrg,
        scope: SCOPE,
        key,
        requestHash,
        leaseMs: 60_000,
        leaseToken: tokens[index],
      }),
    );
  }
  const before = lossy.count("idempotency_claim_many");
  const items = plan.map(([key, requestHash], index) => ({ key, requestHash, leaseToken: tokens[index] }));
  const batch = await p.claimMany({ organizationId: batchOrg, scope: SCOPE, leaseMs: 60_000, items });
  assert.equal(lossy.count("idempotency_claim_many") - before, 1, "one round trip");
  assert.deepEqual(
    batch.map((o) => o.outcome),
    ["claimed", "completed", "processing", "conflict", "reclaimed", "processing", "conflict", "claimed"],
  );
  for (const [index, outcome] of batch.entries()) {
    assert.deepEqual(seen(outcome, tokens[index]), seen(singles[index], tokens[index]), `item ${index}`);
  }
  const again = await p.claimMany({ organizationId: batchOrg, scope: SCOPE, leaseMs: 60_000, items });
  const held = (outcomes: ClaimOutcome[]) =>
    outcomes.map((o) => "claim" in o ? [o.outcome, o.claim.id, o.claim.leaseToken] : [o.outcome]);
  assert.deepEqual(held(again), held(batch), "a repeat answers each item's own claim");
});

Deno.test("a batch above the row cap or with a bad item is refused whole and nothing is written", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const org = organization();
  const hash = await hashOf({ bounded: 1 });
  const items = Array.from({ length: 1001 }, (_, i) => ({ key: `k-${i}`, requestHash: hash }));
  await assert.rejects(
    p.claimMany({ organizationId: org, scope: SCOPE, leaseMs: 60_000, items }),
    (e: unknown) => e instanceof PlaneError && e.reason === "bound_above_cap",
  );
  assert.equal(lossy.calls.length, 0, "refused before any request");
  await assert.rejects(
    p.claimMany({
      organizationId: org,
      scope: SCOPE,
      leaseMs: 60_000,
      items: [items[0], items[1], { key: "k-2", requestHash: "not-a-hash" }],
    }),
    (e: unknown) => e instanceof PlaneError && e.reason === "malformed_hash" && e.message.startsWith("items[2]:"),
  );
  // The plane's own check, as curl would meet it: a token two items share.
  const token = crypto.randomUUID();
  await assert.rejects(
    p.claimMany({
      organizationId: org,
      scope: SCOPE,
      leaseMs: 60_000,
      items: [{ ...items[0], leaseToken: token }, { ...items[1], leaseToken: token }],
    }),
    (e: unknown) => e instanceof PlaneError && e.code === "22023" && e.message.includes("p_items[1].lease_token"),
  );
  const big = { blob: "x".repeat(70_000) };
  await assert.rejects(
    p.claimMany({
      organizationId: org,
      scope: SCOPE,
      leaseMs: 60_000,
      items: [items[0], { ...items[1], work: big }],
    }),
    (e: unknown) => e instanceof PlaneError && e.code === "IDEM5" && e.message.includes("p_items[1]"),
  );
  const read = await p.read({ organizationId: org, scope: SCOPE, key: "k-0", requestHash: hash });
  assert.equal(read.outcome, "absent", "no refused batch wrote anything");
});

/** A driver over a plane whose requests `lossy` sees. */
function driverOver(lossy: Lossy): EffectDriver {
  return new EffectDriver(plane({ fetch: lossy.fetch }), { log: silent });
}

function ending(key: string): Settle {
  if (key.startsWith("release")) return "release";
  if (key.startsWith("unknown")) return { unknown: "the vendor did not answer" };
  return { journal: success({ sent: key }) };
}

async function drive(driver: EffectDriver, org: string, keys: string[], runs: Map<string, number>) {
  const hash = await hashOf({ drive: 1 });
  const report = await driveMany(
    driver,
    {
      organizationId: org,
      scope: SCOPE,
      timing: new Timing(2_000, 3_000, 1_000),
      items: keys.map((key) => ({ key, requestHash: hash })),
    },
    (index, claim) => {
      const key = keys[index];
      assert.equal(claim.key, key, "the effect gets its own item's claim");
      runs.set(key, (runs.get(key) ?? 0) + 1);
      if (key.startsWith("throw")) throw new Error(`the effect of ${key} threw`);
      return ending(key);
    },
    { concurrency: 3 },
  );
  return report;
}

Deno.test("the batch driver ends each item as a single effect would, one round trip per kind", async () => {
  const lossy = new Lossy();
  const driver = driverOver(lossy);
  const org = organization();
  const runs = new Map<string, number>();
  const keys = ["j-1", "j-2", "release-1", "unknown-1", "throw-1", "j-3"];
  const report = await drive(driver, org, keys, runs);
  assert.deepEqual(report.items.map(endingName), [
    "journaled",
    "journaled",
    "released",
    "left_to_lease",
    "left_to_lease",
    "journaled",
  ]);
  assert.deepEqual(report.failures, [2, 3, 4]);
  assert.deepEqual(
    ["idempotency_claim_many", "idempotency_complete_many", "idempotency_release_many"].map((fn) => lossy.count(fn)),
    [1, 1, 1],
  );
  assert.deepEqual(["idempotency_claim", "idempotency_complete", "idempotency_release"].map((fn) => lossy.count(fn)), [
    0,
    0,
    0,
  ]);
  const first = report.items[0];
  assert.ok(first.kind === "ran" && first.answer?.output && (first.answer.output as { sent: string }).sent === "j-1");

  const again = await drive(driver, org, keys, runs);
  assert.deepEqual(again.items.map(endingName), [
    "replayed",
    "replayed",
    "released",
    "in_flight",
    "in_flight",
    "replayed",
  ]);
  assert.deepEqual(keys.map((key) => runs.get(key)), [1, 1, 2, 1, 1, 1]);
});

Deno.test("a lost batch journal or release falls back to each item's own ending, and nothing runs twice", async () => {
  const lossy = new Lossy().loseNext("idempotency_complete_many", 5).loseNext("idempotency_release_many");
  const driver = driverOver(lossy);
  const org = organization();
  const runs = new Map<string, number>();
  const report = await drive(driver, org, ["a", "b", "release-a", "release-b"], runs);
  assert.deepEqual(report.items.map(endingName), ["journaled", "journaled", "released", "released"]);
  assert.equal(lossy.count("idempotency_complete"), 2, "each journal on its own after the batch's answer was lost");
  const replay = await drive(driver, org, ["a", "b"], runs);
  assert.deepEqual(replay.items.map(endingName), ["replayed", "replayed"]);
  assert.deepEqual([runs.get("a"), runs.get("b")], [1, 1]);
});

Deno.test("a lost batch claim is asked again with the same tokens: each claim is this batch's own", async () => {
  const lossy = new Lossy().loseNext("idempotency_claim_many");
  const driver = driverOver(lossy);
  const runs = new Map<string, number>();
  const report = await drive(driver, organization(), [uniqueKey("a"), uniqueKey("b")], runs);
  assert.deepEqual(report.items.map(endingName), ["journaled", "journaled"]);
  assert.ok(lossy.count("idempotency_claim_many") >= 2);
  assert.deepEqual([...runs.values()], [1, 1]);
});
