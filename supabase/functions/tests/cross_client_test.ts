// What one client stores, the other replays, byte for byte, on one plane:
//
// - an answer: the Rust `Idempotency-Key` layer (examples/echo_api.rs, a
//   process of its own) answers a request and journals it, and the
//   TypeScript middleware set up alike replays it: the same status, kept
//   headers and body bytes, its handler never run; then the other way round.
//   Both store each answer in the same form.
// - a webhook body: the Rust gate (examples/webhook_gate.rs) claims a
//   delivery with its body and is killed mid-processing, and the TypeScript
//   gate's re-drive hands its process the very bytes delivered; then a
//   delivery the TypeScript gate left for a re-drive is carried by the Rust
//   gate's re-drive, which forwards the very bytes downstream.
//
// Run by tests/run.sh, which hands the two Rust processes over in
// ECHO_API_BIN and WEBHOOK_GATE_BIN.

import assert from "node:assert/strict";
import { Webhook } from "standardwebhooks";
import {
  planeKey,
  ProcessingError,
  type Redelivery,
  sha256HexOfBytes,
  silent,
  vendorKey,
  WebhookGate,
  withIdempotencyKey,
} from "../_shared/idempotency/mod.ts";
import { base64 } from "../_shared/idempotency/stored_response.ts";
import { KEY, killHard, organization, plane, serve, type Served, sleep, uniqueKey, URL_ } from "./support.ts";

function bin(name: string): string {
  const path = Deno.env.get(name);
  if (!path) throw new Error(`${name} is not set: run the tests through tests/run.sh`);
  return path;
}

/** The headers the layer and the middleware keep with an answer, set up alike. */
const KEPT = ["content-type", "location", "x-answer"];
const ROUTE = "/answers";

/** An answer the echo handlers are asked for: its status, headers and body. */
interface Asked {
  about: string;
  status: number;
  headers: [string, string][];
  body: Uint8Array;
}

const text = (value: string) => new TextEncoder().encode(value);

const ANSWERS: Asked[] = [
  {
    about: "JSON text, not ASCII",
    status: 201,
    headers: [["content-type", "application/json"], ["location", "/answers/1"]],
    body: text('{"id":"ключ-é-😀","n":1.0,"e":"\\u00e9"}'),
  },
  {
    about: "bytes that are not UTF-8",
    status: 200,
    headers: [["content-type", "application/octet-stream"]],
    body: new Uint8Array([0, 255, 254, 10, 0x80, 0xc3, 0x28]),
  },
  { about: "text holding U+0000", status: 202, headers: [["content-type", "text/plain"]], body: text("a\u0000b") },
  { about: "an empty body", status: 200, headers: [], body: new Uint8Array() },
  {
    about: "a header value that is not visible ASCII: the first caller's only, never kept",
    status: 201,
    headers: [["content-type", "text/plain; charset=utf-8"], ["location", "/answers/ключ"]],
    body: text("ключ"),
  },
  {
    about: "a kept header twice, and headers never kept",
    status: 404,
    headers: [
      ["content-type", "application/problem+json"],
      ["x-answer", "given by the request"],
      ["x-other", "not kept"],
      ["set-cookie", "session=1"],
    ],
    body: text('{"title":"not here"}'),
  },
];

/**
 * The echo handler, as examples/echo_api.rs answers: the status, headers and
 * body the request asks for, and one more `x-answer`, fresh each run.
 */
async function echo(request: Request): Promise<Response> {
  const asked = await request.json();
  const headers = new Headers();
  // A value's UTF-8 bytes, one character a byte, as Rust's `HeaderValue` takes them.
  for (const [name, value] of asked.headers) headers.append(name, String.fromCharCode(...text(value)));
  headers.append("x-answer", crypto.randomUUID());
  const body = Uint8Array.from(atob(asked.body_base64), (c) => c.charCodeAt(0));
  return new Response(body, { status: asked.status, headers });
}

/** The request asking for `asked`, under `key`, of `user` of `org`. */
function ask(url: string, asked: Asked, key: string, org: string, user: string): Request {
  return new Request(url, {
    method: "POST",
    headers: {
      "content-type": "application/json",
      "idempotency-key": key,
      "x-organization-id": org,
      "x-user-id": user,
    },
    body: JSON.stringify({ status: asked.status, headers: asked.headers, body_base64: base64(asked.body) }),
  });
}

/** An answer as compared: its status, every kept header's value, its body's bytes. */
async function answerOf(response: Response) {
  const kept = KEPT.map((name) => [name, response.headers.get(name)]);
  return { status: response.status, kept, body: new Uint8Array(await response.arrayBuffer()) };
}

/**
 * What a replay of `first` answers: all of it, but for a kept header whose
 * value is not visible ASCII, which neither client journals (Rust's
 * `HeaderValue::to_str` reads no other).
 */
function replayOf(first: Answer): Answer {
  const kept = first.kept.map((
    [name, value],
  ) => [name, value !== null && /^[\t\x20-\x7e]*$/.test(value) ? value : null]);
  return { ...first, kept };
}

type Answer = Awaited<ReturnType<typeof answerOf>>;

/** A handler's answer to the first request: what was asked, never a replay. */
async function firstAnswer(response: Response, asked: Asked): Promise<Answer> {
  assert.equal(response.headers.get("idempotent-replayed"), null, asked.about);
  const answer = await answerOf(response);
  assert.equal(answer.status, asked.status, asked.about);
  assert.deepEqual(answer.body, asked.body, asked.about);
  return answer;
}

/** Asserts `replay` is marked a replay of `first` and answers what it did, but for the headers never kept. */
async function assertReplays(replay: Response, first: Answer, what: string): Promise<void> {
  assert.equal(replay.headers.get("idempotent-replayed"), "true", what);
  assert.equal(replay.headers.get("x-other"), null, `${what}: only the kept headers`);
  assert.equal(replay.headers.get("set-cookie"), null, `${what}: never a credential`);
  assert.deepEqual(await answerOf(replay), replayOf(first), what);
}

/** The answer as the plane stores it, the fresh UUID of its `x-answer` written as `<fresh>`. */
async function stored(org: string, user: string, key: string): Promise<unknown> {
  const rows = await plane().client.rpc("idempotency_get", {
    p_organization_id: org,
    p_scope: "http.post.answers",
    p_key: await planeKey(key, user),
  }) as { response: { output: { headers: [string, string][] } } }[];
  assert.equal(rows.length, 1);
  const response = structuredClone(rows[0].response);
  response.output.headers = response.output.headers.map(([name, value]) => [
    name,
    name === "x-answer" ? value.replace(/[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$/, "<fresh>") : value,
  ]);
  return response;
}

Deno.test("an answer one client journaled, the other replays byte for byte: Rust's layer and the TypeScript middleware", async () => {
  const rust = await serve(bin("ECHO_API_BIN"), [], { IDEM_POSTGREST_URL: URL_, IDEM_SERVICE_KEY: KEY, PORT: "0" });
  try {
    let tsRuns = 0;
    const typescript = withIdempotencyKey((request) => (tsRuns++, echo(request)), {
      plane: plane(),
      organizationId: (request) => request.headers.get("x-organization-id") ?? undefined,
      principal: (request) => request.headers.get("x-user-id") ?? undefined,
      route: ROUTE,
      keepHeaders: ["x-answer"],
      log: silent,
    });
    const org = organization();
    const user = uniqueKey("user");
    for (const asked of ANSWERS) {
      // Rust answers and journals; TypeScript replays.
      const byRust = uniqueKey("by-rust");
      const first = await firstAnswer(await fetch(ask(`${rust.url}${ROUTE}`, asked, byRust, org, user)), asked);
      const runsBefore = tsRuns;
      const replayedByTs = await typescript(ask(`http://typescript.test${ROUTE}`, asked, byRust, org, user));
      await assertReplays(replayedByTs, first, `${asked.about}: TypeScript replays Rust's answer`);
      assert.equal(tsRuns, runsBefore, `${asked.about}: the TypeScript handler never ran`);

      // TypeScript answers and journals; Rust replays.
      const byTs = uniqueKey("by-ts");
      const firstByTs = await firstAnswer(
        await typescript(ask(`http://typescript.test${ROUTE}`, asked, byTs, org, user)),
        asked,
      );
      assert.equal(tsRuns, runsBefore + 1, asked.about);
      const replayedByRust = await fetch(ask(`${rust.url}${ROUTE}`, asked, byTs, org, user));
      await assertReplays(replayedByRust, firstByTs, `${asked.about}: Rust replays TypeScript's answer`);

      // Either stored the answer in the one form.
      assert.deepEqual(await stored(org, user, byTs), await stored(org, user, byRust), asked.about);
    }
  } finally {
    await killHard(rust.child);
  }
});

const SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SCOPE = "webhook.standard";

/**
 * Delivery bodies both gates must store and hand back as delivered: kept as
 * text, as base64 for U+0000 and for text whose JSON escapes would be longer.
 * The Rust gate's signature check takes UTF-8 only, so bytes that are not
 * UTF-8 go through the TypeScript gate alone.
 */
const BODIES = [
  text('{"type":"invoice.paid","name":"ключ-é-😀","amount":1.50}'),
  text('{"type":"a\u0000b"}'),
  text("\u0001".repeat(40)),
];
const NOT_UTF8 = new Uint8Array([0x7b, 0xff, 0xfe, 0x00, 0x80, 0x7d]);

/**
 * The downstream service the Rust gate forwards to: records each body by its
 * Idempotency-Key; while `holding`, answers nothing until closed.
 */
function downstream(holding: boolean) {
  const bodies = new Map<string, Uint8Array>();
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    const body = new Uint8Array(await request.arrayBuffer());
    bodies.set(request.headers.get("idempotency-key") ?? "", body);
    if (holding) await released;
    return new Response("{}", { status: 200 });
  });
  return {
    url: `http://127.0.0.1:${server.addr.port}/`,
    bodies,
    async close() {
      release();
      await server.shutdown();
    },
  };
}

/** The Rust gate as a process, for `org`, forwarding to `processUrl`. */
async function rustGate(org: string, processUrl: string): Promise<Served> {
  return await serve(bin("WEBHOOK_GATE_BIN"), [], {
    IDEM_POSTGREST_URL: URL_,
    IDEM_SERVICE_KEY: KEY,
    IDEM_MAX_ROWS: Deno.env.get("IDEM_MAX_ROWS") ?? "1000",
    PORT: "0",
    WEBHOOK_SECRET: SECRET,
    PROCESS_URL: processUrl,
    ORGANIZATION_ID: org,
    HEARTBEAT_LEASE_MS: "3000",
  });
}

/** Polls `step` every 250 ms, for at most 20 s, until it answers true. */
async function until(what: string, step: () => Promise<boolean>): Promise<void> {
  for (let poll = 0; poll < 80; poll++) {
    if (await step()) return;
    await sleep(250);
  }
  throw new Error(`not within 20 s: ${what}`);
}

/** Whether the plane journaled `id` of `org` with `body` (its hash) as processed. */
async function journaledOk(org: string, id: string, body: Uint8Array): Promise<boolean> {
  const read = await plane().read({
    organizationId: org,
    scope: SCOPE,
    key: id,
    requestHash: await sha256HexOfBytes(body),
  });
  return read.outcome === "completed" && read.answer.ok;
}

Deno.test("a webhook body the Rust gate stored is re-driven by the TypeScript gate byte for byte, and the other way round", async () => {
  // Rust claims each delivery with its body, then dies mid-processing.
  const org = organization();
  const held = downstream(true);
  const ids = BODIES.map(() => uniqueKey("msg"));
  const gate = await rustGate(org, held.url);
  let killed = false;
  try {
    const signer = new Webhook(SECRET);
    for (const [n, body] of BODIES.entries()) {
      const timestamp = new Date();
      const answer = await fetch(gate.url, {
        method: "POST",
        headers: {
          "webhook-id": ids[n],
          "webhook-timestamp": String(Math.floor(timestamp.getTime() / 1000)),
          "webhook-signature": signer.sign(ids[n], timestamp, new TextDecoder().decode(body)),
        },
        body,
      });
      assert.equal(answer.status, 200, await answer.text());
    }
    const keys = await Promise.all(ids.map((id) => vendorKey(org, SCOPE, id)));
    await until(
      "the Rust gate processing every delivery",
      () => Promise.resolve(keys.every((k) => held.bodies.has(k))),
    );
    await killHard(gate.child);
    killed = true;

    // TypeScript's re-drive takes them over once their lease passed, each with the body as delivered.
    const typescript = new WebhookGate(plane(), { log: silent });
    const redriven = new Map<string, Redelivery>();
    await until("the TypeScript gate re-driving every delivery", async () => {
      await typescript.redrive({ scope: SCOPE, limit: 10, organizationId: org }, (redelivery) => {
        redriven.set(redelivery.deliveryId, redelivery);
        return Promise.resolve({ redriven: true });
      });
      return redriven.size === ids.length;
    });
    for (const [n, body] of BODIES.entries()) {
      const redelivery = redriven.get(ids[n])!;
      assert.deepEqual(redelivery.body, body, `body ${n}`);
      assert.equal(redelivery.organizationId, org);
      assert.equal(redelivery.scope, SCOPE);
      assert.ok(await journaledOk(org, ids[n], body), `body ${n} journaled under its hash`);
    }
  } finally {
    if (!killed) await killHard(gate.child);
    await held.close();
  }

  // TypeScript claims each delivery with its body, and leaves it for a re-drive.
  const other = organization();
  const service = downstream(false);
  const bodies = [...BODIES, NOT_UTF8];
  const otherIds = bodies.map(() => uniqueKey("msg"));
  const typescript = new WebhookGate(plane(), {
    processingTimeoutMs: 1_000,
    journalDeadlineMs: 1_000,
    marginMs: 1_000,
    log: silent,
  });
  const acks = await Promise.all(bodies.map((body, n) =>
    typescript.handle(
      { organizationId: other, scope: SCOPE, deliveryId: otherIds[n], body },
      () => Promise.reject(ProcessingError.retryable("downstream unavailable")),
    )
  ));
  assert.deepEqual(acks.map((ack) => ack.ack), bodies.map(() => "accepted"), "left for a re-drive");
  // Rust's re-drive route takes them over once their lease passed, and forwards each body as delivered.
  const rust = await rustGate(other, service.url);
  try {
    const keys = await Promise.all(otherIds.map((id) => vendorKey(other, SCOPE, id)));
    await until("the Rust gate re-driving every delivery", async () => {
      const answer = await fetch(`${rust.url}/redrive`, {
        method: "POST",
        headers: { authorization: `Bearer ${KEY}` },
        body: JSON.stringify({ limit: 10 }),
      });
      assert.equal(answer.status, 200, await answer.text());
      return keys.every((key) => service.bodies.has(key));
    });
    for (const [n, body] of bodies.entries()) {
      assert.deepEqual(service.bodies.get(keys[n]), body, `body ${n}`);
      assert.ok(await journaledOk(other, otherIds[n], body), `body ${n} journaled under its hash`);
    }
  } finally {
    await killHard(rust.child);
    await service.close();
  }
});
