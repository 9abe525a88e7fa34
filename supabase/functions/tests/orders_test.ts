// The orders Edge Function's routes (supabase/functions/orders): /orders and
// /functions/v1/orders are one request, other paths 404, other methods 405.
// Against a real plane: IDEM_POSTGREST_URL and IDEM_SERVICE_KEY, as for
// http_test.ts. The black-box check of its whole contract is
// .ci/orders-function-check.sh.

import { serve } from "../orders/index.ts";
import { readUntil } from "./support.ts";

function assertEquals(actual: unknown, expected: unknown, message = ""): void {
  const a = JSON.stringify(actual);
  const e = JSON.stringify(expected);
  if (a !== e) throw new Error(`${message ? message + ": " : ""}expected ${e}, got ${a}`);
}

function order(path: string, key: string, body = '{"sku":"A"}'): Request {
  return new Request(`http://127.0.0.1:8000${path}`, {
    method: "POST",
    headers: { "content-type": "application/json", "idempotency-key": key, "x-user-id": "orders-test" },
    body,
  });
}

Deno.test("orders: /orders and /functions/v1/orders are one request; other paths 404, other methods 405", async () => {
  const key = crypto.randomUUID();
  const first = await serve(order("/functions/v1/orders?delay_ms=0", key));
  assertEquals(first.status, 201);
  const body = await first.text();
  const again = await serve(order("/orders?delay_ms=0", key));
  assertEquals([again.status, again.headers.get("idempotent-replayed"), await again.text()], [201, "true", body]);
  assertEquals((await serve(order("/orders", key))).status, 422, "another query");
  assertEquals((await serve(order("/order", key))).status, 404);
  const get = await serve(new Request("http://127.0.0.1:8000/orders"));
  assertEquals([get.status, get.headers.get("allow")], [405, "POST"]);
});

Deno.test("orders: the 201 body is written as the Rust example writes it", async () => {
  const answer = await serve(order("/orders", crypto.randomUUID(), '{"b":1E2,"a":1,"a":2,"c":[1.50,-0.0]}'));
  const text = await answer.text();
  const id = JSON.parse(text).id;
  assertEquals(text, `{"id":"${id}","order":{"a":2,"b":1e+2,"c":[1.50,-0.0]},"status":"created"}`);
  assertEquals(answer.headers.get("location"), `/orders/${id}`);
});

Deno.test("the function as a process answers an order and a replay without Deno's request.signal warning", async () => {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "--frozen", "--allow-net", "--allow-env", new URL("../orders/index.ts", import.meta.url).pathname],
    env: { PORT: "0" },
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const stdout = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  try {
    const text = await readUntil(stdout, "\n", "the function starting to serve");
    const url = /listening on (\S+)/.exec(text)?.[1];
    if (!url) throw new Error(`no listening line: ${text}`);
    const key = crypto.randomUUID();
    for (const [path, expected] of [["/orders", 201], ["/functions/v1/orders", 201]] as const) {
      const answer = await fetch(`${url}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", "idempotency-key": key, "x-user-id": "orders-test" },
        body: '{"sku":"A"}',
      });
      await answer.body?.cancel();
      assertEquals(answer.status, expected);
      if (path !== "/orders") {
        assertEquals(answer.headers.get("idempotent-replayed"), "true", "the same order, replayed");
      }
    }
  } finally {
    child.kill("SIGTERM");
    await child.status;
    await stdout.cancel().catch(() => {});
  }
  const stderr = await new Response(child.stderr).text();
  if (stderr.includes("legacy behavior") || stderr.includes("request.signal")) {
    throw new Error(`the function printed Deno's request.signal warning:\n${stderr}`);
  }
});
