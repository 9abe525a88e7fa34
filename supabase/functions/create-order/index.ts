// The shortest useful Edge Function over the plane, to copy: POST with an
// Idempotency-Key runs createOrder once per key and caller, and answers every
// retry with the first answer (`Idempotent-Replayed: true`), a retry with
// another body 422, one while the first still runs 409. Replace createOrder's
// body with your effect. (`orders/` is the full contract the tests drive.)
//
//   npx -y supabase@3.1.0 functions deploy create-order   # verify_jwt stays on: the gateway checks the JWT
//   curl -X POST https://<ref>.supabase.co/functions/v1/create-order -H "authorization: Bearer $USER_JWT" \
//     -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"sku":"A","qty":1}'

import { IdempotencyPlane, withIdempotencyKey } from "../_shared/idempotency/mod.ts";

/** Your effect: runs once per key; its response, whatever its status, is what every retry gets. */
async function createOrder(req: Request): Promise<Response> {
  const order = await req.json();
  const id = crypto.randomUUID(); // insert the order, charge the card (passing the vendor a key), …
  return Response.json({ id, order, status: "created" }, { status: 201 });
}

/** The caller: the `sub` of the JWT the gateway verified, so two users never share a key (none: 401). */
function caller(req: Request): string | undefined {
  const payload = req.headers.get("authorization")?.match(/^Bearer [\w-]+\.([\w-]+)\./)?.[1];
  if (!payload) return undefined;
  try {
    const json = atob(payload.replaceAll("-", "+").replaceAll("_", "/").padEnd(Math.ceil(payload.length / 4) * 4, "="));
    const sub = JSON.parse(json).sub;
    return typeof sub === "string" && sub !== "" ? sub : undefined;
  } catch {
    return undefined;
  }
}

export const handler = withIdempotencyKey(createOrder, {
  plane: IdempotencyPlane.fromEnv((name) => Deno.env.get(name)), // SUPABASE_URL and the service key
  organizationId: Deno.env.get("ORGANIZATION_ID") ?? "00000000-0000-0000-0000-000000000001", // your tenant
  principal: caller,
  route: "/create-order",
});

if (import.meta.main) Deno.serve(handler);
