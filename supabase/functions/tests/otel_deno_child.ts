// Run by otel_deno_test.ts as a process of its own under Deno's built-in
// OpenTelemetry (OTEL_DENO=true): no OpenTelemetry import anywhere, only
// the client, which finds the API Deno registers. Claims a key, runs and
// journals its effect, replays it, and claims a second key with work;
// prints what each answered as one JSON line, and exits (Deno exports its
// spans and metrics then).

import { IdempotencyPlane, idempotent, requestHash, silent, success } from "../_shared/idempotency/mod.ts";

const env = (name: string): string => {
  const value = Deno.env.get(name);
  if (!value) throw new Error(`set ${name}`);
  return value;
};
const plane = IdempotencyPlane.fromEnv(Deno.env.get);
const organizationId = env("OTEL_TEST_ORGANIZATION");
const scope = env("OTEL_TEST_SCOPE");
const key = env("OTEL_TEST_KEY");
const options = { plane, organizationId, scope, key, request: { key }, timeoutMs: 5_000, log: silent };

const ran = await idempotent(() => success({ shipped: true }), options);
const replayed = await idempotent(() => success({ shipped: "twice" }), options);
const carried = await plane.claim({
  organizationId,
  scope,
  key: `${key}-work`,
  requestHash: await requestHash({ work: 1 }),
  leaseMs: 5_000,
  work: { work: 1 },
});
console.log(JSON.stringify({
  ran: ran.status,
  replayed: replayed.status,
  carried: carried.outcome,
  traceparent: carried.outcome === "claimed" ? carried.claim.traceparent ?? null : null,
}));
