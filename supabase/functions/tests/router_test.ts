// The tenant router: each organization's calls reach its own plane only,
// complete and release follow the claim, the default plane, an unrouted
// organization refused before anything is sent, configurations refused.
// Every plane here is the same live server behind its own counting fetch,
// so which plane a call went to is read off the counts.

import assert from "node:assert/strict";
import { type Claim, PlaneError, success, TenantRouter } from "../_shared/idempotency/mod.ts";
import { hashOf, Lossy, organization, plane, uniqueKey } from "./support.ts";

const SCOPE = "tool.email.send";

/** Planes `one`, `two` and `three`, each over a fetch of its own that records its calls. */
function planes() {
  const fetches = { one: new Lossy(), two: new Lossy(), three: new Lossy() };
  const named = Object.entries(fetches).map(([name, lossy]) => [name, plane({ fetch: lossy.fetch })] as const);
  return { fetches, named };
}

function invalid(reason: string) {
  return (error: unknown) => {
    assert.ok(error instanceof PlaneError, String(error));
    assert.equal(error.kind, "invalid_input");
    assert.equal(error.reason, reason, error.message);
    return true;
  };
}

Deno.test("each organization's calls reach its own plane only, complete and release included", async () => {
  const { fetches, named } = planes();
  const [a, b] = [organization(), organization()];
  const router = new TenantRouter({ planes: named, assignments: [[a, "one"], [b, "two"]] });
  const hash = await hashOf({ to: "a@example.com" });
  const claimOf = (organizationId: string, key: string) =>
    router.claim({ organizationId, scope: SCOPE, key, requestHash: hash, leaseMs: 30_000 });

  const first = await claimOf(a, uniqueKey());
  if (first.outcome !== "claimed") throw new Error(first.outcome);
  assert.equal(await router.complete(first.claim, { response: { ok: true, output: 1 } }), "recorded");
  const given = await claimOf(b, uniqueKey());
  if (given.outcome !== "claimed") throw new Error(given.outcome);
  assert.equal(await router.release(given.claim), "recorded");
  assert.deepEqual(
    await router.read({ organizationId: b, scope: SCOPE, key: given.claim.key, requestHash: hash }),
    { outcome: "absent" },
  );

  assert.deepEqual(fetches.one.calls, ["idempotency_claim", "idempotency_complete"]);
  assert.deepEqual(fetches.two.calls, ["idempotency_claim", "idempotency_release", "idempotency_get"]);
  assert.deepEqual(fetches.three.calls, []);
  assert.equal(router.planeFor(a), named[0][1]);
  assert.equal(router.planeFor(b.toUpperCase()), named[1][1], "an id in capitals is the same organization");
  assert.deepEqual(router.planes().map(([name]) => name), ["one", "two", "three"]);
});

Deno.test("a claim through the router replays its completion through the router", async () => {
  const { named } = planes();
  const org = organization();
  const router = new TenantRouter({ planes: named, assignments: [[org, "two"]] });
  const request = {
    organizationId: org,
    scope: SCOPE,
    key: uniqueKey(),
    requestHash: await hashOf(1),
    leaseMs: 30_000,
  };
  const first = await router.claim(request);
  if (first.outcome !== "claimed") throw new Error(first.outcome);
  assert.equal(
    await router.complete(first.claim, { response: { ok: true, output: { message_id: "m-1" } } }),
    "recorded",
  );
  const replay = { outcome: "completed", answer: success({ message_id: "m-1" }) };
  assert.deepEqual(await router.claim(request), replay);
  assert.deepEqual(await named[1][1].read(request), replay, "the journal is on plane two");
});

Deno.test("an organization with no assignment goes to the default plane", async () => {
  const { fetches, named } = planes();
  const [a, other] = [organization(), organization()];
  const router = new TenantRouter({ planes: named, assignments: [[a, "one"]], defaultPlane: "three" });
  const requestHash = await hashOf(1);
  await router.read({ organizationId: other, scope: SCOPE, key: "k", requestHash });
  await router.read({ organizationId: a, scope: SCOPE, key: "k", requestHash });
  assert.deepEqual([fetches.one.calls.length, fetches.two.calls.length, fetches.three.calls.length], [1, 0, 1]);
  assert.equal(router.planeFor(other), named[2][1]);
});

Deno.test("an unrouted organization is refused by every call, and nothing is sent", async () => {
  const { fetches, named } = planes();
  const router = new TenantRouter({ planes: named, assignments: [[organization(), "one"]] });
  const stranger = organization();
  const requestHash = await hashOf(1);
  const claim: Claim = {
    id: crypto.randomUUID(),
    organizationId: stranger,
    scope: SCOPE,
    key: "k",
    leaseToken: crypto.randomUUID(),
    leaseExpiresAt: new Date().toISOString(),
    reclaimed: false,
  };
  const calls: Array<() => unknown> = [
    () => router.claim({ organizationId: stranger, scope: SCOPE, key: "k", requestHash, leaseMs: 30_000 }),
    () => router.complete(claim, { response: { ok: true, output: 1 } }),
    () => router.release(claim),
    () => router.read({ organizationId: stranger, scope: SCOPE, key: "k", requestHash }),
  ];
  for (const call of calls) await assert.rejects(async () => await call(), invalid("unrouted_organization"));
  assert.throws(() => router.planeFor(stranger), invalid("unrouted_organization"));
  assert.throws(() => router.planeFor("not-a-uuid"), invalid("malformed_organization"));
  let refused: unknown;
  try {
    router.planeFor(stranger);
  } catch (error) {
    refused = error;
  }
  assert.ok(refused instanceof PlaneError && !refused.mayHaveWritten && !refused.isTransient);
  assert.ok(!refused.neverReachedThePlane, "a misconfiguration is never a reason to fail open");
  assert.deepEqual(Object.values(fetches).map((lossy) => lossy.calls.length), [0, 0, 0]);
});

Deno.test("a configuration that cannot route exactly is refused", () => {
  const { named } = planes();
  const org = organization();
  const refused = [
    { planes: [] },
    { planes: [named[0], ["one", named[1][1]] as const] },
    { planes: named, assignments: [[org, "four"]] as const },
    { planes: named, defaultPlane: "four" },
    { planes: named, assignments: [[org, "one"], [org.toUpperCase(), "two"]] as const },
  ];
  for (const [index, options] of refused.entries()) {
    assert.throws(() => new TenantRouter(options), invalid("bad_configuration"), `case ${index}`);
  }
  assert.throws(
    () => new TenantRouter({ planes: named, assignments: [["nope", "one"]] }),
    invalid("malformed_organization"),
  );
  // The same assignment twice is one assignment.
  assert.equal(
    new TenantRouter({ planes: named, assignments: [[org, "two"], [org, "two"]] }).planeFor(org),
    named[1][1],
  );
  // A Map, or a record's entries, serve as well as arrays of pairs.
  const router = new TenantRouter({ planes: new Map(named), assignments: Object.entries({ [org]: "three" }) });
  assert.equal(router.planeFor(org), named[2][1]);
});
