// Calls the idempotency plane with @supabase/supabase-js under Deno, the way
// a Supabase Edge Function does: `createClient(SUPABASE_URL, key)`, which
// calls `<SUPABASE_URL>/rest/v1/...`, with the plane's functions reached
// through `.schema('agent')`. Against `idem up` (or any Supabase project
// whose API exposes schema agent):
//
//   SUPABASE_URL=http://127.0.0.1:PORT SUPABASE_SERVICE_ROLE_KEY=... [SUPABASE_ANON_KEY=...] \
//     deno run --allow-net --allow-env check.ts
//
// Checks: a fresh key is claimed ('claimed'), another caller's repeat is
// answered 'processing', the claim reads back through idempotency_get, and
// a call that names no schema goes to the default schema (public) and fails
// with PGRST202 (function not found), as on Supabase. With SUPABASE_ANON_KEY,
// also that the anon role may not execute the plane's functions. Prints one
// line per check; exits 1 on the first failure, 2 on bad configuration.

import { createClient } from "@supabase/supabase-js";

const REQUEST_TIMEOUT_MS = 15_000;

const url = (Deno.env.get("SUPABASE_URL") ?? "").replace(/\/+$/, "");
const serviceKey = Deno.env.get("SUPABASE_SERVICE_ROLE_KEY") ?? "";
const anonKey = Deno.env.get("SUPABASE_ANON_KEY") ?? "";
if (!url || !serviceKey) {
  if (!url) console.error("config: SUPABASE_URL is not set (the project URL, e.g. http://127.0.0.1:54321)");
  if (!serviceKey) console.error("config: SUPABASE_SERVICE_ROLE_KEY is not set (the service_role JWT)");
  Deno.exit(2);
}

/** Every request bounded, so a stuck server fails the check instead of CI. */
function boundedFetch(input: RequestInfo | URL, init: RequestInit = {}): Promise<Response> {
  return fetch(input, { ...init, signal: init.signal ?? AbortSignal.timeout(REQUEST_TIMEOUT_MS) });
}

function client(key: string) {
  return createClient(url, key, {
    auth: { persistSession: false, autoRefreshToken: false, detectSessionInUrl: false },
    global: { fetch: boundedFetch },
  });
}

class CheckFailed extends Error {}

function expect(condition: boolean, message: string, detail?: unknown): void {
  if (!condition) {
    throw new CheckFailed(detail === undefined ? message : `${message}\n       ${JSON.stringify(detail)}`);
  }
}

let failures = 0;
async function check(name: string, body: () => Promise<void>): Promise<void> {
  if (failures > 0) return;
  try {
    await body();
    console.log(`ok    ${name}`);
  } catch (error) {
    failures += 1;
    const text = error instanceof CheckFailed ? error.message : (error instanceof Error ? error.stack : String(error));
    console.log(`FAIL  ${name}: ${text}`);
  }
}

async function sha256Hex(text: string): Promise<string> {
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

type Row = Record<string, unknown>;

/** The one row a set-returning function answered, or a failed check. */
function oneRow(name: string, answer: { data: unknown; error: unknown; status: number }): Row {
  expect(answer.error === null, `${name} answered an error (HTTP ${answer.status})`, answer.error);
  expect(Array.isArray(answer.data) && answer.data.length === 1, `${name} should answer exactly one row`, answer.data);
  return (answer.data as Row[])[0];
}

const service = client(serviceKey);
const organization = crypto.randomUUID();
const scope = "tool.email.send";
const key = `supabase-js-${crypto.randomUUID()}`;
// The request's RFC 8785 form: one member, so JSON.stringify writes it canonically.
const requestHash = await sha256Hex(JSON.stringify({ to: "a@example.com" }));
const token = crypto.randomUUID();
const claimArgs = (leaseToken: string) => ({
  p_organization_id: organization,
  p_scope: scope,
  p_key: key,
  p_request_hash: requestHash,
  p_lease_token: leaseToken,
  p_lease_ms: 30_000,
});
let claimId: unknown;

await check("schema('agent').rpc('idempotency_claim'): a fresh key is claimed, with our token", async () => {
  const row = oneRow("idempotency_claim", await service.schema("agent").rpc("idempotency_claim", claimArgs(token)));
  expect(row.outcome === "claimed" && row.status === "processing", "outcome 'claimed', processing", row);
  expect(row.lease_token === token && row.lease_live === true, "our token, a live lease", row);
  claimId = row.id;
});

await check("schema('agent').rpc('idempotency_claim'): another caller's repeat is answered 'processing'", async () => {
  const row = oneRow(
    "idempotency_claim (repeat)",
    await service.schema("agent").rpc("idempotency_claim", claimArgs(crypto.randomUUID())),
  );
  expect(row.outcome === "processing" && row.lease_live === true, "outcome 'processing', a live lease", row);
  expect(row.lease_token === null, "processing discloses no token", row);
});

await check("schema('agent').rpc('idempotency_get'): reads the claim back", async () => {
  const answer = await service.schema("agent").rpc("idempotency_get", {
    p_organization_id: organization,
    p_scope: scope,
    p_key: key,
  });
  const row = oneRow("idempotency_get", answer);
  expect(row.id === claimId && row.status === "processing", "the claim, processing", row);
  expect(row.lease_token === null, "a read never discloses the holder's lease token", row);
});

await check("rpc('idempotency_get') without a schema goes to public and fails with PGRST202", async () => {
  const answer = await service.rpc("idempotency_get", { p_organization_id: organization, p_scope: scope, p_key: key });
  expect(answer.error !== null && answer.error.code === "PGRST202", "error code PGRST202", answer.error);
  expect(answer.status === 404 && answer.data === null, "HTTP 404, no data", { status: answer.status });
});

if (anonKey) {
  await check("the anon key may not execute the plane's functions (42501)", async () => {
    const answer = await client(anonKey).schema("agent").rpc("idempotency_claim", claimArgs(crypto.randomUUID()));
    expect(answer.error !== null && answer.error.code === "42501", "error code 42501, permission denied", answer.error);
  });
}

if (failures > 0) {
  Deno.exit(1);
}
console.log("all supabase-js checks passed");
