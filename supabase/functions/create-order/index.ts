// The shortest useful Edge Function over the plane, to copy: POST with an
// Idempotency-Key runs createOrder once per key and caller, and answers every
// retry with the first answer (`Idempotent-Replayed: true`), a retry with
// another body 422, one while the first still runs 409. Replace createOrder's
// body with your effect. (`orders/` is the full contract the tests drive.)
//
//   npx -y supabase@3.1.0 functions deploy create-order   # verify_jwt stays on: the gateway checks the JWT
//   curl -X POST https://<ref>.supabase.co/functions/v1/create-order -H "authorization: Bearer $USER_JWT" \
//     -H 'x-region: <the database's region>' \
//     -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"sku":"A","qty":1}'
//
// `x-region` runs the function next to the database: every claim and journal
// is a round trip to it, and Supabase otherwise runs a function nearest its
// caller (docs/deploying.md, "Run the functions that claim in the database's
// region").

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
    const bytes = Uint8Array.from(atob(payload.replaceAll("-", "+").replaceAll("_", "/")), (c) => c.charCodeAt(0));
    const sub = JSON.parse(new TextDecoder().decode(bytes)).sub;
    return typeof sub === "string" && sub !== "" ? sub : undefined;
  } catch {
    return undefined;
  }
}

const idempotent = withIdempotencyKey(createOrder, {
  plane: IdempotencyPlane.fromEnv((name) => Deno.env.get(name)), // SUPABASE_URL and the service key
  organizationId: Deno.env.get("ORGANIZATION_ID") ?? "00000000-0000-4000-8000-000000000001", // your tenant
  principal: caller,
  route: "/create-order",
});

/** POST only: the middleware passes other methods through unguarded. */
export function handler(req: Request): Promise<Response> | Response {
  return req.method === "POST" ? idempotent(req) : new Response(null, { status: 405, headers: { allow: "POST" } });
}

// Loopback unless HOST says otherwise: run locally, it is not reachable from
// the network (on Supabase the runtime routes requests to it).
if (import.meta.main) Deno.serve({ hostname: Deno.env.get("HOST") ?? "127.0.0.1" }, handler);
