// The plane over a supabase-js client, as an Edge Function builds one:
// `createClient(SUPABASE_URL, key)` against the local plane's `/rest/v1`,
// with the plane calling `.schema("agent")` itself.

import assert from "node:assert/strict";
import { createClient } from "@supabase/supabase-js";
import { IdempotencyPlane, idempotent, PlaneError, success } from "../_shared/idempotency/mod.ts";
import { hashOf, organization, uniqueKey } from "./support.ts";

const url = Deno.env.get("SUPABASE_URL") ?? "";
const key = Deno.env.get("SUPABASE_SERVICE_ROLE_KEY") ?? "";
if (!url || !key) throw new Error("set SUPABASE_URL and SUPABASE_SERVICE_ROLE_KEY (idem up --env-file writes both)");

function supabase(apiKey = key) {
  return createClient(url, apiKey, {
    auth: { autoRefreshToken: false, persistSession: false, detectSessionInUrl: false },
  });
}

/** One effect through a plane over `client`: it runs and is journaled, then replays. */
async function claimJournalReplay(client: ReturnType<typeof supabase>) {
  const options = {
    plane: IdempotencyPlane.connect(client),
    organizationId: organization(),
    scope: "tool.email.send",
    key: uniqueKey(),
    request: { to: "a@example.com" },
    timeoutMs: 5_000,
  };
  const first = await idempotent(() => success({ id: 1 }), options);
  assert.ok(first.status === "ran" && first.settled.ending === "journaled", JSON.stringify(first));
  assert.deepEqual(await idempotent(() => success({ id: 2 }), options), {
    status: "replayed",
    answer: success({ id: 1 }),
  });
}

Deno.test("claim, journal and replay through a supabase-js client", async () => {
  await claimJournalReplay(supabase());
});

Deno.test("errors through supabase-js keep the plane's codes", async () => {
  const plane = IdempotencyPlane.connect(supabase());
  await assert.rejects(
    plane.claim({
      organizationId: organization(),
      scope: "nobody.knows",
      key: "k",
      requestHash: await hashOf(1),
      leaseMs: 5_000,
    }),
    (error: unknown) => error instanceof PlaneError && error.code === "IDEM1" && error.kind === "unknown_scope",
  );
});

Deno.test("a call without the agent schema fails locally as it does on Supabase", async () => {
  const { error } = await supabase().rpc("idempotency_get", {
    p_organization_id: organization(),
    p_scope: "tool.email.send",
    p_key: "k",
  });
  assert.ok(error, "the default schema has no such function");
  assert.equal(error.code, "PGRST202");
});

Deno.test("supabase-js with the project's sb_secret_ key (SUPABASE_SECRET_KEYS) claims, journals and replays", async () => {
  const secret = JSON.parse(Deno.env.get("SUPABASE_SECRET_KEYS") ?? "{}").default;
  assert.ok(
    typeof secret === "string" && secret.startsWith("sb_secret_"),
    "idem up --env-file writes SUPABASE_SECRET_KEYS",
  );
  await claimJournalReplay(supabase(secret));
});
