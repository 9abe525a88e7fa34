// The same module under Node.js (20 or later), as a Node service or a
// Cloudflare Worker would run it: the shared hash vectors, and — with
// IDEM_POSTGREST_URL and IDEM_SERVICE_KEY set — one effect through
// `idempotent` over plain fetch (supabase-js 2.119 needs Node 22 for its
// WebSocket, so Node drives the module with a URL and key). Run with tsx:
//
//   npx tsx supabase/functions/tests/node_check.ts
//
// Prints one line per check; exits 1 on a failure.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import process from "node:process";
import { canonicalize, IdempotencyPlane, idempotent, requestHash, success } from "../_shared/idempotency/mod.ts";

const vectors: Array<{ input: unknown; canonical: string; sha256: string }> = JSON.parse(
  readFileSync(new URL("../../../tests/vectors/request_hash.json", import.meta.url), "utf8"),
);

async function main(): Promise<void> {
  assert.ok(vectors.length >= 25);
  for (const vector of vectors) {
    assert.equal(canonicalize(vector.input), vector.canonical);
    assert.equal(await requestHash(vector.input), vector.sha256);
  }
  console.log(`node ${process.version}: ${vectors.length} request-hash vectors match`);

  const url = process.env.IDEM_POSTGREST_URL;
  const key = process.env.IDEM_SERVICE_KEY;
  if (!url || !key) {
    console.log("node: IDEM_POSTGREST_URL / IDEM_SERVICE_KEY unset: the plane round trip is skipped");
    return;
  }
  const plane = IdempotencyPlane.connect({ url, key });
  const options = {
    plane,
    organizationId: crypto.randomUUID(),
    scope: "tool.email.send",
    key: `node-${crypto.randomUUID()}`,
    request: { to: "a@example.com" },
    timeoutMs: 5_000,
  };
  let runs = 0;
  const effect = () => {
    runs += 1;
    return success({ message_id: "m-node" });
  };
  const first = await idempotent(effect, options);
  assert.ok(first.status === "ran" && first.settled.ending === "journaled", JSON.stringify(first));
  const again = await idempotent(effect, options);
  assert.deepEqual(again, { status: "replayed", answer: success({ message_id: "m-node" }) });
  assert.equal(runs, 1);
  console.log("node: claimed, journaled and replayed through idempotent() over fetch");
}

main().catch((error) => {
  console.error(`node check failed: ${error instanceof Error ? error.stack : String(error)}`);
  process.exit(1);
});
