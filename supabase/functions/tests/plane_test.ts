// The four operations against a real plane: every claim outcome, a lost
// answer asked again with the same lease token, the typed errors.

import assert from "node:assert/strict";
import { IdempotencyPlane, PlaneError, success } from "../_shared/idempotency/mod.ts";
import { functionOf, hashOf, KEY, Lossy, organization, plane, sleep, uniqueKey, URL_ } from "./support.ts";

const SCOPE = "tool.email.send";

async function claimOf(
  p: IdempotencyPlane,
  org: string,
  key: string,
  hash: string,
  leaseMs = 30_000,
  leaseToken?: string,
) {
  return await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs, leaseToken });
}

Deno.test("claimed, then processing for others, conflict for another request, completed after the journal", async () => {
  const p = plane();
  const org = organization();
  const key = uniqueKey();
  const hash = await hashOf({ to: "a@example.com" });
  const first = await claimOf(p, org, key, hash);
  assert.equal(first.outcome, "claimed");
  if (first.outcome !== "claimed") return;
  assert.equal(first.claim.reclaimed, false);
  assert.equal((await claimOf(p, org, key, hash)).outcome, "processing");
  assert.equal((await claimOf(p, org, key, await hashOf({ to: "b@example.com" }))).outcome, "conflict");
  assert.deepEqual(await p.read({ organizationId: org, scope: SCOPE, key, requestHash: hash }), {
    outcome: "processing",
    leaseExpiresAt: first.claim.leaseExpiresAt,
  });
  const stored = { ok: true, output: { message_id: "m-1" } };
  assert.equal(await p.complete(first.claim, { response: stored }), "recorded");
  // A repeat of the completion after a lost answer lands on the same row.
  assert.equal(await p.complete(first.claim, { response: stored }), "recorded");
  const replay = await claimOf(p, org, key, hash);
  assert.deepEqual(replay, { outcome: "completed", answer: success({ message_id: "m-1" }) });
  assert.deepEqual(await p.read({ organizationId: org, scope: SCOPE, key, requestHash: hash }), replay);
  // The hash is compared before anything else, completed or not.
  assert.equal((await claimOf(p, org, key, await hashOf("other"))).outcome, "conflict");
});

Deno.test("a claim whose lease passed is reclaimed with a new token, and the old holder's journal is fenced off", async () => {
  const p = plane();
  const org = organization();
  const key = uniqueKey();
  const hash = await hashOf({ n: 1 });
  const first = await claimOf(p, org, key, hash, 1_000);
  assert.equal(first.outcome, "claimed");
  await sleep(1_300);
  assert.deepEqual(await p.read({ organizationId: org, scope: SCOPE, key, requestHash: hash }), { outcome: "absent" });
  const second = await claimOf(p, org, key, hash);
  assert.equal(second.outcome, "reclaimed");
  if (first.outcome !== "claimed" || second.outcome !== "reclaimed") return;
  assert.ok(second.claim.reclaimed);
  assert.notEqual(second.claim.leaseToken, first.claim.leaseToken);
  assert.equal(await p.complete(first.claim, { response: { ok: true, output: 1 } }), "lease_moved_on");
  assert.equal(await p.release(first.claim), "lease_moved_on");
  assert.equal(await p.complete(second.claim, { response: { ok: true, output: 2 } }), "recorded");
});

Deno.test("a lost claim answer is retried with the same lease token and answers the caller's own claim", async () => {
  const lossy = new Lossy().loseNext("idempotency_claim");
  const p = plane({ fetch: lossy.fetch });
  const org = organization();
  const key = uniqueKey();
  const hash = await hashOf({ lost: true });
  const outcome = await claimOf(p, org, key, hash);
  assert.equal(lossy.count("idempotency_claim"), 2, "the client asked again");
  assert.equal(outcome.outcome, "claimed", "the repeat answered our own row, not processing");
  // The same, done by hand: the caller asks again with its token.
  const token = crypto.randomUUID();
  const key2 = uniqueKey();
  assert.equal((await claimOf(plane(), org, key2, hash, 30_000, token)).outcome, "claimed");
  assert.equal((await claimOf(plane(), org, key2, hash, 30_000, token)).outcome, "claimed");
  assert.equal((await claimOf(plane(), org, key2, hash)).outcome, "processing");
});

Deno.test("the lease token reaches its holder alone: no read answers it, whoever reads", async () => {
  // Every answer the plane sends this client, by function.
  const answers: { fn: string; body: string }[] = [];
  const recording: typeof fetch = async (input, init) => {
    const response = await fetch(input, init);
    answers.push({ fn: functionOf(input), body: await response.clone().text() });
    return response;
  };
  const p = plane({ fetch: recording });
  const org = organization();
  const key = uniqueKey();
  const hash = await hashOf({ fence: true });
  const held = await claimOf(p, org, key, hash);
  if (held.outcome !== "claimed") throw new Error(held.outcome);
  const token = held.claim.leaseToken;
  // Another worker, and reads through the client and by hand (as curl would).
  assert.equal((await claimOf(p, org, key, hash)).outcome, "processing");
  assert.equal((await p.read({ organizationId: org, scope: SCOPE, key, requestHash: hash })).outcome, "processing");
  assert.equal(await p.rowExists(held.claim), true);
  const raw = await recording(`${URL_}/rpc/idempotency_get`, {
    method: "POST",
    headers: {
      authorization: `Bearer ${KEY}`,
      "content-type": "application/json",
      "content-profile": "agent",
      "accept-profile": "agent",
    },
    body: JSON.stringify({ p_organization_id: org, p_scope: SCOPE, p_key: key }),
  });
  const rows = await raw.json();
  assert.equal(rows.length, 1);
  assert.equal(rows[0].lease_token, null);
  assert.equal(rows[0].lease_live, true, "whether a worker holds it is lease_live");
  const carrying = answers.filter((answer) => answer.body.includes(token)).map((answer) => answer.fn);
  assert.deepEqual(carrying, ["idempotency_claim"], "only the holder's own claim answer carries the token");
  assert.equal(answers.filter((answer) => answer.fn === "idempotency_get").length, 3);
  assert.equal(await p.complete(held.claim, { response: { ok: true } }), "recorded");
});

Deno.test("release gives the key back, and a release whose answer was lost is not sent again", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const org = organization();
  const key = uniqueKey();
  const hash = await hashOf({ r: 1 });
  const first = await claimOf(p, org, key, hash);
  if (first.outcome !== "claimed") throw new Error(first.outcome);
  lossy.loseNext("idempotency_release");
  await assert.rejects(p.release(first.claim), (error: unknown) => {
    assert.ok(error instanceof PlaneError && error.kind === "transport", String(error));
    return true;
  });
  assert.equal(lossy.count("idempotency_release"), 1, "release is unsafe to repeat: not retried");
  assert.equal((await claimOf(p, org, key, hash)).outcome, "claimed", "the release did happen");
});

Deno.test("the service key goes over plain http:// to loopback or a named host only, and a URL's password is never shown", () => {
  const refusedWith = (connect: () => unknown, ...needles: string[]) =>
    assert.throws(connect, (error: unknown) => {
      assert.ok(error instanceof PlaneError && error.reason === "bad_configuration", String(error));
      for (const needle of needles) assert.ok(error.message.includes(needle), error.message);
      assert.ok(!error.message.includes("hunter2"), error.message);
      return true;
    });
  for (
    const url of [
      "http://localhost:3000",
      "http://127.0.0.1:54321/rest/v1",
      "http://[::1]:3000",
      "https://x.supabase.co/rest/v1",
    ]
  ) {
    IdempotencyPlane.connect({ url, key: KEY });
  }
  refusedWith(
    () => IdempotencyPlane.connect({ url: "http://kong:8000/rest/v1", key: KEY }),
    "unencrypted",
    "IDEM_ALLOW_PLAIN_HTTP=kong",
  );
  IdempotencyPlane.connect({ url: "http://kong:8000/rest/v1", key: KEY, allowPlainHttpTo: ["kong"] });
  const env = (vars: Record<string, string>) => (name: string) => vars[name];
  refusedWith(() => IdempotencyPlane.fromEnv(env({ SUPABASE_URL: "http://kong:8000", IDEM_SERVICE_KEY: KEY })), "kong");
  IdempotencyPlane.fromEnv(
    env({ SUPABASE_URL: "http://kong:8000", IDEM_SERVICE_KEY: KEY, IDEM_ALLOW_PLAIN_HTTP: " db , kong" }),
  );
  refusedWith(
    () => IdempotencyPlane.connect({ url: "https://ops:hunter2@x.supabase.co/rest/v1", key: KEY }),
    "credentials",
  );
  refusedWith(() => IdempotencyPlane.connect({ url: "ops:hunter2@nowhere", key: KEY }), "http(s)");
  refusedWith(() => IdempotencyPlane.connect({ url: "//ops:hunter2@nowhere", key: KEY }), "not a URL");
  // A supabase-js client is held to the same rule by the URL it shows.
  const supabaseLike = (supabaseUrl: string) => ({
    supabaseUrl,
    schema: () => ({ rpc: () => ({ abortSignal: () => Promise.resolve({ data: null, error: null, status: 200 }) }) }),
  });
  refusedWith(() => IdempotencyPlane.connect(supabaseLike("http://kong:8000")), "kong");
  IdempotencyPlane.connect(supabaseLike("http://kong:8000"), { allowPlainHttpTo: ["kong"] });
  IdempotencyPlane.connect(supabaseLike("http://127.0.0.1:54321"));
});

Deno.test("bad input is refused before any request, with a reason", async () => {
  const lossy = new Lossy();
  const p = plane({ fetch: lossy.fetch });
  const org = organization();
  const hash = await hashOf(1);
  const cases: Array<[string, () => Promise<unknown>]> = [
    ["empty_key", () => claimOf(p, org, "", hash)],
    ["key_too_long", () => claimOf(p, org, "k".repeat(513), hash)],
    ["key_has_nul", () => claimOf(p, org, "a\0b", hash)],
    [
      "malformed_scope",
      () => p.claim({ organizationId: org, scope: "Tool", key: "k", requestHash: hash, leaseMs: 5000 }),
    ],
    ["malformed_hash", () => claimOf(p, org, "k", "ABC")],
    ["lease_too_short", () => claimOf(p, org, "k", hash, 999)],
    ["lease_too_long", () => claimOf(p, org, "k", hash, 24 * 3600 * 1000 + 1)],
    ["malformed_organization", () => claimOf(p, "not-a-uuid", "k", hash)],
  ];
  for (const [reason, call] of cases) {
    await assert.rejects(call(), (error: unknown) => {
      assert.ok(error instanceof PlaneError, String(error));
      assert.equal(error.kind, "invalid_input");
      assert.equal(error.reason, reason);
      return true;
    });
  }
  assert.equal(lossy.calls.length, 0, "nothing was sent");
});

Deno.test("the plane's own refusals come back typed: IDEM1, 22023, PGRST202, 401", async () => {
  const p = plane();
  const org = organization();
  await assert.rejects(
    p.claim({ organizationId: org, scope: "nobody.knows", key: "k", requestHash: await hashOf(1), leaseMs: 5000 }),
    (error: unknown) => error instanceof PlaneError && error.kind === "unknown_scope" && error.code === "IDEM1",
  );
  // What a client that skips the checks sends is refused by the SQL itself.
  await assert.rejects(
    p.client.rpc("idempotency_claim", {
      p_organization_id: org,
      p_scope: SCOPE,
      p_key: "k",
      p_request_hash: "not-a-hash",
      p_lease_token: crypto.randomUUID(),
      p_lease_ms: 5000,
    }),
    (error: unknown) => error instanceof PlaneError && error.code === "22023" && error.status === 400,
  );
  await assert.rejects(
    p.client.rpc("no_such_function", {}),
    (error: unknown) => error instanceof PlaneError && error.code === "PGRST202" && !error.isTransient,
  );
  const forged = IdempotencyPlane.connect({ url: Deno.env.get("IDEM_POSTGREST_URL")!, key: KEY.slice(0, -4) + "AAAA" });
  await assert.rejects(
    forged.read({ organizationId: org, scope: SCOPE, key: "k", requestHash: await hashOf(1) }),
    (error: unknown) => error instanceof PlaneError && error.kind === "api" && error.status === 401,
  );
});

Deno.test("an unreachable plane is a transport error that never reached it, retried within the deadline", async () => {
  const lossy = new Lossy().refuseAll();
  const p = plane({ fetch: lossy.fetch, retry: { maxRetries: 2, initialBackoffMs: 5 } });
  await assert.rejects(
    p.read({ organizationId: organization(), scope: SCOPE, key: "k", requestHash: await hashOf(1) }),
    (error: unknown) => {
      assert.ok(error instanceof PlaneError);
      assert.equal(error.kind, "transport");
      assert.equal(error.transport, "connect");
      assert.ok(error.neverReachedThePlane);
      return true;
    },
  );
  assert.equal(lossy.calls.length, 3, "the first try and two retries");
});

Deno.test("a slow plane is cut at the call's deadline, and the error says a request was in flight", async () => {
  const lossy = new Lossy().delay("idempotency_get", 2_000);
  const p = plane({ fetch: lossy.fetch, deadlineMs: 300 });
  const started = Date.now();
  await assert.rejects(
    p.read({ organizationId: organization(), scope: SCOPE, key: "k", requestHash: await hashOf(1) }),
    (error: unknown) => error instanceof PlaneError && error.kind === "deadline" && error.inFlight === true,
  );
  assert.ok(Date.now() - started < 1_500, "cut at the deadline");
});
