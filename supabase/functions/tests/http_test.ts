// The Idempotency-Key middleware (http.ts) against a real plane:
// IDEM_POSTGREST_URL and IDEM_SERVICE_KEY, as `idem up --env-file` writes
// them (the runner starts one). Its parts, which need no plane, are
// http_parts_test.ts.
//
//   cd supabase/functions && deno test --allow-net --allow-env tests/http_test.ts

import {
  fingerprint,
  IdempotencyPlane,
  NothingHappened,
  planeKey,
  type PlaneOptions,
  scopeOf,
  silent,
  withIdempotencyKey,
} from "../_shared/idempotency/mod.ts";
import type { IdempotencyKeyOptions } from "../_shared/idempotency/http.ts";
import { assert, assertEquals } from "./assert.ts";
import { HOUR_MS, restoreWallClock, sleep, stepWallClock, within } from "./support.ts";

function env(name: string): string {
  const value = Deno.env.get(name);
  if (!value) throw new Error(`${name} is not set: run these tests against \`idem up --env-file\` (see the header)`);
  return value;
}

function livePlane(options: PlaneOptions = {}): IdempotencyPlane {
  return IdempotencyPlane.connect({ url: env("IDEM_POSTGREST_URL"), key: env("IDEM_SERVICE_KEY") }, options);
}

/** A counting handler behind the middleware, one fresh tenant per call. */
function setup(
  handler: (req: Request, n: number) => Promise<Response> | Response,
  options: Partial<IdempotencyKeyOptions> = {},
) {
  let runs = 0;
  const organizationId = crypto.randomUUID();
  const serve = withIdempotencyKey(async (req) => await handler(req, ++runs), {
    plane: options.plane ?? livePlane(),
    organizationId,
    principal: (req) => req.headers.get("x-user-id") ?? "alice",
    route: "/orders",
    log: silent,
    ...options,
  });
  return { serve, organizationId, runs: () => runs };
}

function request(
  key: string | null,
  body = '{"sku":"A","qty":1}',
  init: Record<string, string> = {},
  path = "/orders",
) {
  const headers = new Headers({ "content-type": "application/json", ...init });
  if (key !== null) headers.set("idempotency-key", key);
  return new Request(`http://orders.test${path}`, { method: "POST", headers, body });
}

function created(req: Request, n: number): Response {
  return new Response(JSON.stringify({ id: n, path: new URL(req.url).pathname }), {
    status: 201,
    headers: { "content-type": "application/json", location: `/orders/${n}`, "x-other": "no", "set-cookie": "s=1" },
  });
}

async function problemOf(response: Response, status: number, slug: string): Promise<Record<string, unknown>> {
  assertEquals(response.status, status, slug);
  assertEquals(response.headers.get("content-type"), "application/problem+json");
  const body = await response.json();
  assertEquals(body.type, `https://github.com/idempotency-plane/idempotency-plane#idempotency-key-problems-${slug}`);
  assertEquals(body.status, status);
  return body;
}

/** The raw stored response of a key, as the table holds it. */
async function storedRow(plane: IdempotencyPlane, organizationId: string, scope: string, key: string) {
  const rows = await plane.client.rpc("idempotency_get", {
    p_organization_id: organizationId,
    p_scope: scope,
    p_key: key,
  }) as Record<string, unknown>[];
  return rows[0];
}

Deno.test("plane: the first request runs (201), a repeat replays it byte for byte, marked", async () => {
  const plane = livePlane();
  const { serve, organizationId, runs } = setup(created, { plane });
  const key = crypto.randomUUID();
  const first = await serve(request(key));
  assertEquals(first.status, 201);
  assertEquals(first.headers.get("idempotent-replayed"), null);
  assertEquals(first.headers.get("set-cookie"), "s=1", "the first caller gets the handler's answer whole");
  const firstBody = await first.text();
  const again = await serve(request(key, '{ "qty": 1.0, "sku": "A" }'));
  assertEquals(again.status, 201);
  assertEquals(again.headers.get("idempotent-replayed"), "true");
  assertEquals(again.headers.get("location"), "/orders/1");
  assertEquals(again.headers.get("content-type"), "application/json");
  assertEquals(again.headers.get("x-other"), null, "only the kept headers");
  assertEquals(again.headers.get("set-cookie"), null, "never a credential");
  assertEquals(await again.text(), firstBody);
  assertEquals(runs(), 1);
  // The stored form is the Rust layer's: a success whose output is the StoredResponse.
  const row = await storedRow(plane, organizationId, "http.post.orders", await planeKey(key, "alice"));
  assertEquals(row.response, {
    ok: true,
    output: {
      status: 201,
      headers: [["content-type", "application/json"], ["location", "/orders/1"]],
      body_text: firstBody,
    },
  });
});

Deno.test("plane: an answer the Rust layer journaled replays through this one", async () => {
  const plane = livePlane();
  const { serve, organizationId, runs } = setup(created, { plane });
  const key = crypto.randomUUID();
  const req = request(key);
  const body = new Uint8Array(await req.clone().arrayBuffer());
  const claimed = await plane.claim({
    organizationId,
    scope: await scopeOf("POST", "/orders"),
    key: await planeKey(key, "alice"),
    requestHash: await fingerprint("POST", "/orders", req.headers, body),
    leaseMs: 5_000,
  });
  assert(claimed.outcome === "claimed");
  // What serde writes for the Rust StoredResponse, a binary body and a credential a hand put there included.
  await plane.complete(claimed.claim, {
    response: {
      ok: true,
      output: {
        status: 202,
        headers: [["content-type", "application/octet-stream"], ["set-cookie", "s=1"], ["location", "/x"]],
        body_base64: "AP8=",
      },
    },
  });
  const replayed = await serve(req);
  assertEquals(replayed.status, 202);
  assertEquals(replayed.headers.get("idempotent-replayed"), "true");
  assertEquals(replayed.headers.get("set-cookie"), null);
  assertEquals(replayed.headers.get("location"), "/x");
  assertEquals([...new Uint8Array(await replayed.arrayBuffer())], [0, 255]);
  assertEquals(runs(), 0);
});

Deno.test("plane: a journaled answer that is not an HTTP answer is 500 unreadable-answer", async () => {
  const plane = livePlane();
  const { serve, organizationId } = setup(created, { plane });
  const key = crypto.randomUUID();
  const req = request(key);
  const claimed = await plane.claim({
    organizationId,
    scope: "http.post.orders",
    key: await planeKey(key, "alice"),
    requestHash: await fingerprint("POST", "/orders", req.headers, new Uint8Array(await req.clone().arrayBuffer())),
    leaseMs: 5_000,
  });
  assert(claimed.outcome === "claimed");
  await plane.complete(claimed.claim, { response: { ok: true, output: { order: 1 } } });
  await problemOf(await serve(req), 500, "unreadable-answer");
});

Deno.test("plane: the key with another body is 422; another path or query too", async () => {
  const { serve } = setup(created);
  const key = crypto.randomUUID();
  assertEquals((await serve(request(key))).status, 201);
  await problemOf(await serve(request(key, '{"sku":"B"}')), 422, "key-reused");
  await problemOf(await serve(request(key, undefined, {}, "/orders?x=1")), 422, "key-reused");
  await problemOf(await serve(request(key, undefined, { "content-type": "text/plain" })), 422, "key-reused");
});

Deno.test("plane: a repeat while the first is in flight is 409 with Retry-After, then replays", async () => {
  let entered!: () => void;
  const inside = new Promise<void>((resolve) => (entered = resolve));
  let open!: () => void;
  const gate = new Promise<void>((resolve) => (open = resolve));
  const { serve, runs } = setup(async (req, n) => {
    entered();
    await gate;
    return created(req, n);
  });
  const key = crypto.randomUUID();
  const first = serve(request(key));
  await inside;
  const busy = await serve(request(key));
  await problemOf(busy, 409, "in-flight");
  assertEquals(busy.headers.get("retry-after"), "1");
  open();
  assertEquals((await first).status, 201);
  assertEquals((await serve(request(key))).headers.get("idempotent-replayed"), "true");
  assertEquals(runs(), 1);
});

Deno.test("plane: with heartbeats a handler outlives its short lease, and a retry past it is still 409", async () => {
  const plane = livePlane();
  const { serve, organizationId, runs } = setup(async (req, n) => {
    await new Promise((resolve) => setTimeout(resolve, 6_500));
    return created(req, n);
  }, { plane, heartbeatLeaseMs: 3_000 });
  const key = crypto.randomUUID();
  const started = performance.now();
  const first = serve(request(key));
  const storedKey = await planeKey(key, "alice");
  let row: Record<string, unknown> | undefined;
  while (!row && performance.now() - started < 3_000) {
    await new Promise((resolve) => setTimeout(resolve, 50));
    row = await storedRow(plane, organizationId, "http.post.orders", storedKey);
  }
  assert(row !== undefined, "the claim was made");
  // The 3 s heartbeat lease (a beat may have moved it a little since), not the whole 45 s.
  const leaseMs = Date.parse(String(row.lease_expires_at)) - Date.parse(String(row.claimed_at));
  assert(leaseMs >= 3_000 && leaseMs < 10_000, `claimed for the heartbeat lease: ${leaseMs} ms`);
  await new Promise((resolve) => setTimeout(resolve, Math.max(0, 3_600 - (performance.now() - started))));
  await problemOf(await serve(request(key)), 409, "in-flight");
  assertEquals((await first).status, 201);
  assertEquals(runs(), 1);
  let refused: unknown;
  try {
    withIdempotencyKey((req) => created(req, 0), {
      plane,
      organizationId,
      sharedAcrossCallers: true,
      route: "/orders",
      heartbeatLeaseMs: 2_000,
    });
  } catch (error) {
    refused = error;
  }
  assert(refused instanceof Error, "a heartbeat lease below 3 s is refused when the middleware is built");
});

Deno.test("plane: no key, an empty or over-long key is 400; optional passes a keyless request through", async () => {
  const { serve, runs } = setup(created);
  await problemOf(await serve(request(null)), 400, "missing-key");
  await problemOf(await serve(request("")), 400, "malformed-key");
  await problemOf(await serve(request("k".repeat(256))), 400, "malformed-key");
  assertEquals((await serve(request("k".repeat(255)))).status, 201);
  assertEquals(runs(), 1);
  const get = await serve(new Request("http://orders.test/orders"));
  assertEquals(get.status, 201, "GET is not a keyed method: it passes straight through");
  const optional = setup(created, { optional: true });
  assertEquals((await optional.serve(request(null))).status, 201);
  assertEquals((await optional.serve(request(null))).headers.get("idempotent-replayed"), null);
  assertEquals(optional.runs(), 2);
});

Deno.test("plane: callers are 401 without a principal or tenant, 500 with no scoping chosen", async () => {
  const noPrincipal = setup(created, { principal: () => undefined });
  await problemOf(await noPrincipal.serve(request(crypto.randomUUID())), 401, "no-principal");
  const noTenant = setup(created, { organizationId: () => undefined });
  await problemOf(await noTenant.serve(request(crypto.randomUUID())), 401, "no-tenant");
  const badTenant = setup(created, { organizationId: "not-a-uuid" });
  await problemOf(await badTenant.serve(request(crypto.randomUUID())), 500, "not-configured");
  const unchosen = setup(created, { principal: undefined });
  await problemOf(await unchosen.serve(request(crypto.randomUUID())), 500, "not-configured");
  const noRoute = setup(created, { route: () => undefined });
  await problemOf(await noRoute.serve(request(crypto.randomUUID())), 500, "not-configured");
  assertEquals(noPrincipal.runs() + noTenant.runs() + badTenant.runs() + unchosen.runs() + noRoute.runs(), 0);
  const throwing = setup(created, {
    principal: () => {
      throw new Error("token verification failed");
    },
  });
  await problemOf(await throwing.serve(request(crypto.randomUUID())), 500, "handler-failed");
});

Deno.test("plane: two callers' keys are their own unless shared across callers", async () => {
  const each = setup(created);
  const key = crypto.randomUUID();
  assertEquals((await each.serve(request(key, undefined, { "x-user-id": "alice" }))).status, 201);
  const bob = await each.serve(request(key, undefined, { "x-user-id": "bob" }));
  assertEquals([bob.status, bob.headers.get("idempotent-replayed")], [201, null]);
  assertEquals(each.runs(), 2);
  const shared = setup(created, { principal: undefined, sharedAcrossCallers: true });
  assertEquals((await shared.serve(request(key, undefined, { "x-user-id": "alice" }))).status, 201);
  const other = await shared.serve(request(key, undefined, { "x-user-id": "bob" }));
  assertEquals(other.headers.get("idempotent-replayed"), "true");
  assertEquals(shared.runs(), 1);
});

Deno.test("plane: a handler that started keeps its answer for the key, a 5xx and a throw included", async () => {
  const { serve, runs } = setup((req, n) => {
    const flag = req.headers.get("x-case");
    if (flag === "throw") throw new Error("the database went away after the order was written");
    if (flag === "503") return new Response("busy", { status: 503 });
    if (flag === "500") return new Response("oops", { status: 500 });
    return created(req, n);
  });
  // A throw after the handler started: a 500 problem, kept; the retry gets it again.
  const thrown = crypto.randomUUID();
  const problem = await problemOf(
    await serve(request(thrown, undefined, { "x-case": "throw" })),
    500,
    "handler-failed",
  );
  assert(String(problem.detail).includes("new key"), String(problem.detail));
  const again = await serve(request(thrown));
  assertEquals([again.status, again.headers.get("idempotent-replayed")], [500, "true"]);
  assertEquals(await again.json(), problem);
  // An unmarked 5xx is the answer too: kept and replayed byte for byte.
  for (const status of ["503", "500"]) {
    const key = crypto.randomUUID();
    const first = await serve(request(key, undefined, { "x-case": status }));
    const firstBody = await first.text();
    const replayed = await serve(request(key));
    assertEquals([replayed.status, replayed.headers.get("idempotent-replayed"), await replayed.text()], [
      Number(status),
      "true",
      firstBody,
    ]);
    assertEquals(first.status, Number(status));
  }
  assertEquals(runs(), 3, "no handler that started ran twice");
});

Deno.test("plane: a handler that throws NothingHappened is released: a retry runs it again", async () => {
  const { serve, runs } = setup((req, n) => {
    if (n === 1) throw new NothingHappened("payments down", { response: new Response("busy", { status: 503 }) });
    if (n === 2) throw new NothingHappened("rate limited before anything was written");
    if (n === 4) throw new NothingHappened("but it answered a success", { response: created(req, n) });
    return created(req, n);
  });
  const key = crypto.randomUUID();
  const busy = await serve(request(key));
  assertEquals([busy.status, await busy.text()], [503, "busy"], "the response it carries");
  const problem = await problemOf(await serve(request(key)), 500, "handler-failed");
  assert(String(problem.detail).includes("retry with the same key"), String(problem.detail));
  const ran = await serve(request(key));
  assertEquals([ran.status, ran.headers.get("idempotent-replayed")], [201, null]);
  assertEquals((await serve(request(key))).headers.get("idempotent-replayed"), "true");
  assertEquals(runs(), 3);
  // A success marked NothingHappened is kept all the same: a success was given.
  const marked = crypto.randomUUID();
  const success = await serve(request(marked));
  assertEquals([success.status, (await success.json()).id], [201, 4]);
  const again = await serve(request(marked));
  assertEquals([again.status, again.headers.get("idempotent-replayed"), (await again.json()).id], [201, "true", 4]);
  assertEquals(runs(), 4);
});

Deno.test("plane: a 4xx answer is the answer: journaled and replayed", async () => {
  const { serve, runs } = setup(() => new Response("no such sku", { status: 404 }));
  const key = crypto.randomUUID();
  assertEquals((await serve(request(key))).status, 404);
  const again = await serve(request(key));
  assertEquals([again.status, again.headers.get("idempotent-replayed"), await again.text()], [
    404,
    "true",
    "no such sku",
  ]);
  assertEquals(again.headers.get("content-type"), "text/plain;charset=UTF-8");
  assertEquals(runs(), 1);
});

Deno.test("plane: a handler past its timeout that ends late keeps its late answer for the key", async () => {
  let aborted = false;
  const { serve, runs } = setup(async (req, n) => {
    if (n === 1) {
      await new Promise((resolve) => req.signal.addEventListener("abort", resolve, { once: true }));
      aborted = true;
      return created(req, n);
    }
    return created(req, n);
  }, { handlerTimeoutMs: 400, journalDeadlineMs: 1_000, marginMs: 1_000 });
  const key = crypto.randomUUID();
  const started = performance.now();
  const first = await serve(request(key));
  assert(performance.now() - started < 2_000, "cut at its timeout, then waited on for a while");
  assert(aborted, "the handler's signal aborted");
  // It answered once aborted: that answer is the key's, and the first caller's.
  assertEquals([first.status, first.headers.get("idempotent-replayed")], [201, null]);
  assertEquals(first.headers.get("idempotent-body-omitted"), null, "its body read whole");
  const firstBody = await first.text();
  assertEquals(JSON.parse(firstBody).id, 1);
  const retry = await serve(request(key));
  assertEquals([retry.status, retry.headers.get("idempotent-replayed"), await retry.text()], [201, "true", firstBody]);
  assertEquals(runs(), 1);
});

Deno.test("plane: a late 2xx that comes past half the journal's deadline, while its journal can still land, is kept, never released", async () => {
  // Lease 300 + 6 000 + 1 000 ms. The journal keeps its last 2 s, so the
  // middleware waits on a late handler until 4 s past its timeout (half the
  // journal's deadline would stop at 3 s): this one answers 3.25 s on.
  let cut!: () => void;
  const aborted = new Promise<void>((resolve) => (cut = resolve));
  const { serve, runs } = setup(async (req, n) => {
    if (n === 1) {
      await new Promise((resolve) => req.signal.addEventListener("abort", resolve, { once: true }));
      cut();
      await sleep(3_250);
    }
    return created(req, n);
  }, { handlerTimeoutMs: 300, journalDeadlineMs: 6_000, marginMs: 1_000 });
  const key = crypto.randomUUID();
  const first = serve(request(key));
  await aborted;
  // Past its timeout and still running: held, not released, so a retry
  // neither runs it beside the first nor gets an answer yet.
  await problemOf(await serve(request(key)), 409, "in-flight");
  const answer = await first;
  assertEquals([answer.status, answer.headers.get("idempotent-replayed")], [201, null]);
  const firstBody = await answer.text();
  assertEquals(JSON.parse(firstBody).id, 1);
  const retry = await serve(request(key));
  assertEquals([retry.status, retry.headers.get("idempotent-replayed"), await retry.text()], [201, "true", firstBody]);
  assertEquals(runs(), 1, "the late handler ran once; no retry ran it again");
});

Deno.test("plane: a handler that ignores its signal past the timeout keeps its 504 for the key: never run twice", async () => {
  let finish!: () => void;
  const finished = new Promise<void>((resolve) => (finish = resolve));
  const { serve, runs } = setup(async (req, n) => {
    if (n === 1) await finished;
    return created(req, n);
  }, { handlerTimeoutMs: 400, journalDeadlineMs: 1_000, marginMs: 1_000 });
  const key = crypto.randomUUID();
  const problem = await problemOf(await serve(request(key)), 504, "handler-timeout");
  // Still running, it may yet take effect: the problem is the key's answer,
  // so a retry neither runs beside it nor after its lease.
  const retry = await serve(request(key));
  assertEquals([retry.status, retry.headers.get("idempotent-replayed")], [504, "true"]);
  assertEquals(await retry.json(), problem);
  assertEquals(runs(), 1);
  finish();
});

Deno.test("plane: a wall clock stepped back an hour mid-handler stretches no wait: its 504 is kept before its lease", async () => {
  let finish!: () => void;
  const finished = new Promise<void>((resolve) => (finish = resolve));
  // Lease 400 + 1 000 + 1 000 ms: the 504 must be journaled well inside it.
  const { serve, runs } = setup(async (req, n) => {
    if (n === 1) {
      stepWallClock(-HOUR_MS);
      await finished;
    }
    return created(req, n);
  }, { handlerTimeoutMs: 400, journalDeadlineMs: 1_000, marginMs: 1_000 });
  const key = crypto.randomUUID();
  try {
    const first = await within("the timed-out handler's answer", serve(request(key)), 2_400);
    const problem = await problemOf(first, 504, "handler-timeout");
    const retry = await serve(request(key));
    assertEquals([retry.status, retry.headers.get("idempotent-replayed")], [504, "true"]);
    assertEquals(await retry.json(), problem);
    assertEquals(runs(), 1);
  } finally {
    restoreWallClock();
    finish();
  }
});

Deno.test("plane: a wall clock stepped forward an hour mid-handler gives up no journal: its answer replays", async () => {
  const { serve, runs } = setup((req, n) => {
    if (n === 1) stepWallClock(HOUR_MS);
    return created(req, n);
  }, { handlerTimeoutMs: 2_000, journalDeadlineMs: 2_000, marginMs: 1_000 });
  const key = crypto.randomUUID();
  try {
    const first = await serve(request(key));
    assertEquals([first.status, first.headers.get("idempotent-replayed")], [201, null]);
    const firstBody = await first.text();
    const retry = await serve(request(key));
    assertEquals([retry.status, retry.headers.get("idempotent-replayed"), await retry.text()], [
      201,
      "true",
      firstBody,
    ]);
    assertEquals(runs(), 1);
  } finally {
    restoreWallClock();
  }
});

Deno.test("plane: an answer above the store limit keeps its status and headers, its body omitted", async () => {
  const big = "x".repeat(70_000);
  const { serve, runs } = setup(() => new Response(big, { status: 201, headers: { location: "/orders/big" } }));
  const key = crypto.randomUUID();
  const first = await serve(request(key));
  assertEquals([first.status, await first.text()], [201, ""], "the first caller gets what a replay will");
  assertEquals(first.headers.get("idempotent-body-omitted"), String(big.length));
  assertEquals(first.headers.get("idempotent-replayed"), null);
  const again = await serve(request(key));
  assertEquals(again.status, 201);
  assertEquals(again.headers.get("idempotent-replayed"), "true");
  assertEquals(again.headers.get("idempotent-body-omitted"), String(big.length));
  assertEquals(again.headers.get("location"), "/orders/big");
  assertEquals(await again.text(), "");
  assertEquals(runs(), 1);
});

Deno.test("plane: with onOversize refuse, the first caller and every repeat get 500 answer-not-kept", async () => {
  const { serve, runs } = setup(() => new Response("x".repeat(70_000), { status: 201 }), { onOversize: "refuse" });
  const key = crypto.randomUUID();
  const first = await serve(request(key));
  await problemOf(first, 500, "answer-not-kept");
  assertEquals(first.headers.get("idempotent-replayed"), null);
  const again = await serve(request(key));
  assertEquals(again.headers.get("idempotent-replayed"), "true");
  await problemOf(again, 500, "answer-not-kept");
  assertEquals(runs(), 1);
});

Deno.test("plane: an answer the store refuses (the scope's limit below the client's) is journaled without its body", async () => {
  // The client believes in 1 MiB; the http.* policy keeps 64 KiB: the store answers IDEM2.
  const plane = livePlane({ responseLimitBytes: 1024 * 1024 });
  const body = "y".repeat(100_000);
  const events: string[] = [];
  const log = (event: { event: string }) => void events.push(event.event);
  const { serve, runs } = setup(() => new Response(body, { status: 200 }), { plane, log });
  const key = crypto.randomUUID();
  const first = await serve(request(key));
  assertEquals([first.status, first.headers.get("idempotent-body-omitted"), await first.text()], [
    200,
    String(body.length),
    "",
  ], "the first caller gets what a replay will");
  const again = await serve(request(key));
  assertEquals([again.status, again.headers.get("idempotent-body-omitted")], [200, String(body.length)]);
  assertEquals(await again.text(), "");
  assertEquals(runs(), 1);
  assert(events.includes("idempotency.http_answer_refused"), `the store refused it first: ${events}`);
});

Deno.test("plane: an answer above the response buffer is kept without its body, for the first caller too", async () => {
  const { serve, runs } = setup(() => new Response("z".repeat(2_000), { status: 201 }), {
    responseBodyLimitBytes: 1_000,
  });
  const key = crypto.randomUUID();
  const first = await serve(request(key));
  assertEquals([first.status, first.headers.get("idempotent-body-omitted"), await first.text()], [201, "1000", ""]);
  const again = await serve(request(key));
  assertEquals([again.status, again.headers.get("idempotent-body-omitted")], [201, "1000"]);
  assertEquals(runs(), 1);
});

Deno.test("plane: a request body above the limit is 413, before any claim", async () => {
  const { serve, runs } = setup(created, { bodyLimitBytes: 10 });
  await problemOf(await serve(request(crypto.randomUUID(), '{"sku":"ABCDEFGHIJ"}')), 413, "body-too-large");
  assertEquals((await serve(request(crypto.randomUUID(), "{}"))).status, 201);
  assertEquals(runs(), 1);
});

/** A port nothing listens on. */
function closedPort(): number {
  const listener = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = (listener.addr as Deno.NetAddr).port;
  listener.close();
  return port;
}

/** A stand-in PostgREST answering every call with `status` and `body`. */
function fakePlane(status: number, body: Record<string, unknown>) {
  const server = Deno.serve(
    { hostname: "127.0.0.1", port: 0, onListen: () => {} },
    () => Response.json(body, { status }),
  );
  const plane = IdempotencyPlane.connect({ url: `http://127.0.0.1:${server.addr.port}`, key: "k" }, {
    retry: { initialBackoffMs: 1, maxBackoffMs: 5 },
  });
  return { plane, close: () => server.shutdown() };
}

Deno.test("fail-open: only when the plane was never reached", async () => {
  const unreachable = IdempotencyPlane.connect({ url: `http://127.0.0.1:${closedPort()}`, key: "k" }, {
    retry: { initialBackoffMs: 1, maxBackoffMs: 5 },
  });
  const closed = setup(created, { plane: unreachable });
  const refused = await closed.serve(request(crypto.randomUUID()));
  await problemOf(refused, 503, "unavailable");
  assertEquals(refused.headers.get("retry-after"), "5");
  const open = setup(created, { plane: unreachable, failOpen: true });
  const unprotected = await open.serve(request(crypto.randomUUID()));
  assertEquals([unprotected.status, unprotected.headers.get("idempotent-replayed")], [201, null]);
  assertEquals(await unprotected.json(), { id: 1, path: "/orders" }, "the handler got the request whole");
  assertEquals([closed.runs(), open.runs()], [0, 1]);

  // PostgREST's own "never reached the database" (503 PGRST000): may fail open.
  const down = fakePlane(503, { code: "PGRST000", message: "Database client error" });
  try {
    assertEquals((await setup(created, { plane: down.plane, failOpen: true }).serve(request("k"))).status, 201);
  } finally {
    await down.close();
  }
  // The plane answered, and failed: it may hold the key. 503 even failing open.
  for (const [status, code] of [[500, "XX000"], [503, ""], [504, ""]] as const) {
    const failing = fakePlane(status, { code, message: "boom" });
    try {
      const answered = setup(created, { plane: failing.plane, failOpen: true });
      await problemOf(await answered.serve(request("k")), 503, "unavailable");
      assertEquals(answered.runs(), 0, `${status} ${code}`);
    } finally {
      await failing.close();
    }
  }
});
