// The environments a worker meets, read as the Rust client reads them
// (tests/vectors/service_key_env.json): the variable the service key comes
// from, the URL called and the headers sent, or the same refusal. The
// requests are caught by a fetch standing in for the network, so what is
// checked is what would go on the wire.

import assert from "node:assert/strict";
import { IdempotencyPlane, PlaneError } from "../_shared/idempotency/mod.ts";
import { serviceKeyFromEnv } from "../_shared/idempotency/service_key.ts";

interface Case {
  name: string;
  env: Record<string, string>;
  expect?: { variable: string; url: string; authorization: string | null; apikey: string | null };
  error?: string;
}

const vectors: { cases: Case[] } = JSON.parse(
  await Deno.readTextFile(new URL("../../../tests/vectors/service_key_env.json", import.meta.url)),
);

/** What each refusal of the vectors says (the Rust client's KeyError, in words). */
const REFUSALS: Record<string, RegExp> = {
  missing: /set one of IDEM_SERVICE_KEY \/ SUPABASE_SECRET_KEYS \/ SUPABASE_SECRET_KEY \/ SUPABASE_SERVICE_ROLE_KEY/,
  publishable: /holds a publishable key/,
  wrong_kind: /should hold a secret key \(sb_secret_…\), but holds a JWT/,
  secret_keys_malformed: /SUPABASE_SECRET_KEYS is not a JSON object/,
  secret_key_not_found: /SUPABASE_SECRET_KEYS has no key named/,
};

/** The one request a plane from `env` sends, caught before the network. */
async function firstRequest(env: Record<string, string>): Promise<{ url: string; headers: Headers }> {
  const real = globalThis.fetch;
  let caught: { url: string; headers: Headers } | undefined;
  globalThis.fetch = (input: RequestInfo | URL, init?: RequestInit) => {
    caught = { url: String(input), headers: new Headers(init?.headers) };
    return Promise.resolve(new Response(JSON.stringify([]), { status: 200 }));
  };
  try {
    const plane = IdempotencyPlane.fromEnv((name) => env[name]);
    await plane.read({
      organizationId: "00000000-0000-4000-8000-000000000001",
      scope: "tool.email.send",
      key: "k",
      requestHash: "0".repeat(64),
    }).catch(() => undefined);
  } finally {
    globalThis.fetch = real;
  }
  assert.ok(caught, "a request was sent");
  return caught;
}

Deno.test("every environment of the shared vectors is read as the Rust client reads it", async () => {
  assert.ok(vectors.cases.length >= 20);
  for (const c of vectors.cases) {
    const refusal = c.error;
    if (refusal !== undefined) {
      assert.throws(() => IdempotencyPlane.fromEnv((name) => c.env[name]), (error: unknown) => {
        assert.ok(error instanceof PlaneError, `${c.name}: ${error}`);
        assert.match(error.message, REFUSALS[refusal], c.name);
        assert.doesNotMatch(error.message, /sb_secret_[a-z]|sb_publishable_[a-z]|eyJ/, `${c.name}: no key shown`);
        return true;
      }, c.name);
      continue;
    }
    const expect = c.expect!;
    assert.equal(serviceKeyFromEnv((name) => c.env[name])?.variable, expect.variable, c.name);
    const { url, headers } = await firstRequest(c.env);
    assert.equal(url, `${expect.url}/rpc/idempotency_get`, c.name);
    assert.equal(headers.get("authorization"), expect.authorization, c.name);
    assert.equal(headers.get("apikey"), expect.apikey, c.name);
  }
});

Deno.test("a publishable key handed to connect is refused before any request", () => {
  assert.throws(
    () => IdempotencyPlane.connect({ url: "https://abcdefgh.supabase.co/rest/v1", key: "sb_publishable_x" }),
    /publishable key/,
  );
});

Deno.test("a plane from only SUPABASE_URL and SUPABASE_SECRET_KEYS, as a hosted function has them, claims and replays", async () => {
  const hosted: Record<string, string | undefined> = {
    SUPABASE_URL: Deno.env.get("SUPABASE_URL"),
    SUPABASE_SECRET_KEYS: Deno.env.get("SUPABASE_SECRET_KEYS"),
  };
  assert.ok(hosted.SUPABASE_URL && hosted.SUPABASE_SECRET_KEYS, "idem up --env-file writes both");
  assert.equal(serviceKeyFromEnv((name) => hosted[name])?.kind, "secret");
  const plane = IdempotencyPlane.fromEnv((name) => hosted[name]);
  const request = {
    organizationId: "00000000-0000-4000-8000-000000000001",
    scope: "tool.email.send",
    key: `sb-keys-${crypto.randomUUID()}`,
    requestHash: "a".repeat(64),
    leaseMs: 30_000,
  };
  const first = await plane.claim(request);
  assert.equal(first.outcome, "claimed");
  if (first.outcome !== "claimed") return;
  assert.equal(await plane.complete(first.claim, { response: { sent: 1 } }), "recorded");
  const again = await plane.claim(request);
  assert.equal(again.outcome, "completed");
});
