// The quick start's function (create-order/): once per key and caller, the
// first answer replayed, the caller taken from the JWT's `sub`.

import assert from "node:assert/strict";
import { handler } from "../create-order/index.ts";
import { IdempotencyPlane, planeKey } from "../_shared/idempotency/mod.ts";
import { KEY, URL_ } from "./support.ts";

/** A JWT as the gateway passes it on (the signature is the gateway's business, not the function's). */
function jwt(sub: string): string {
  const part = (value: unknown) =>
    btoa(String.fromCharCode(...new TextEncoder().encode(JSON.stringify(value))))
      .replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
  return `${part({ alg: "HS256", typ: "JWT" })}.${part({ sub, role: "authenticated" })}.c2ln`;
}

function order(key: string, token: string | undefined, body = '{"sku":"A","qty":1}'): Request {
  const headers: Record<string, string> = { "content-type": "application/json", "idempotency-key": key };
  if (token) headers.authorization = `Bearer ${token}`;
  return new Request("http://127.0.0.1/functions/v1/create-order", { method: "POST", headers, body });
}

Deno.test("create-order: one order per key and caller, the first answer replayed", async () => {
  const key = crypto.randomUUID();
  const alice = jwt(crypto.randomUUID());
  const first = await handler(order(key, alice));
  assert.equal(first.status, 201);
  const created = await first.json();
  const again = await handler(order(key, alice, '{"qty":1,"sku":"A"}'));
  assert.equal(again.status, 201);
  assert.equal(again.headers.get("idempotent-replayed"), "true");
  assert.deepEqual(await again.json(), created, "the same order, not a second one");
  const changed = await handler(order(key, alice, '{"sku":"B","qty":1}'));
  assert.equal(changed.status, 422, "the key was used for another order");
  await changed.body?.cancel();

  const bob = await handler(order(key, jwt(crypto.randomUUID())));
  assert.equal(bob.status, 201);
  assert.notEqual((await bob.json()).id, created.id, "another caller's key is its own");
  const anonymous = await handler(order(key, undefined));
  assert.equal(anonymous.status, 401);
  await anonymous.body?.cancel();
});

Deno.test("create-order: a sub of any length and script keys the caller as the Rust layer does; other methods 405", async () => {
  const plane = IdempotencyPlane.connect({ url: URL_, key: KEY });
  for (const sub of ["a", "ab", "abc", "zoë-ü", "用户-😀-42"]) {
    const key = crypto.randomUUID();
    const answer = await handler(order(key, jwt(sub)));
    assert.equal(answer.status, 201, sub);
    await answer.body?.cancel();
    // The row is under SHA-256(sub) § key, the sub read as UTF-8: any other
    // hash under that key reads as a conflict, and an absent key as absent.
    const read = await plane.read({
      organizationId: "00000000-0000-4000-8000-000000000001",
      scope: "http.post.create-order",
      key: await planeKey(key, sub),
      requestHash: "0".repeat(64),
    });
    assert.equal(read.outcome, "conflict", `the claim of ${sub} is under its caller-scoped key`);
  }
  const put = await handler(new Request("http://127.0.0.1/", { method: "PUT", body: "{}" }));
  assert.equal(put.status, 405);
  assert.equal(put.headers.get("allow"), "POST");
});
