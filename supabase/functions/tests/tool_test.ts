// The tool guard's decisions against a real plane (`idem up`), as the Rust
// guard's tests make them: what is raised (never returned) to a replaying
// orchestrator, the retry horizon, read → checkpoint → claim, the three
// endings, the reconcile hook, and the keys both clients derive alike. The
// crash cases stop a worker process with SIGKILL after its vendor applied the
// call and before the answer was journaled.

import assert from "node:assert/strict";
import {
  type Answer,
  EffectDriver,
  failure,
  type Held,
  isToolKey,
  NothingHappened,
  planeKey,
  type Reconciler,
  RetryHorizon,
  silent,
  success,
  Timing,
  type ToolCall,
  toolCallKey,
  ToolError,
  type ToolErrorKind,
  ToolGuard,
  type ToolGuardOptions,
  type ToolInvocation,
  type ToolKey,
  toolKey,
  toolSpec,
  vendorKey,
} from "../_shared/idempotency/mod.ts";
import { functionOf, hashOf, Lossy, organization, plane, readUntil, sleep } from "./support.ts";

const SCOPE = "tool.email.send";
const HOUR = RetryHorizon.untilLastAttempt(60 * 60_000);

/** A guard with short deadlines: a 1 s tool's lease is 3 s. */
function guard(options: Partial<ToolGuardOptions> & { fetch?: typeof fetch } = {}): ToolGuard {
  return new ToolGuard(plane({ fetch: options.fetch }), {
    horizon: HOUR,
    journalDeadlineMs: 1_000,
    leaseMarginMs: 1_000,
    ...options,
  });
}

/** The orchestrator step of the calls below. */
const STEP = "send-welcome";

/** One call of a fresh Run's step, with `tool` counting its runs. */
function invocation(extra: Partial<ToolInvocation> = {}): ToolInvocation & { runs: () => number; runId: string } {
  let runs = 0;
  const tool = extra.tool ?? (() => success({ message_id: "m-1" }));
  const runId = crypto.randomUUID();
  return {
    organizationId: organization(),
    spec: toolSpec(SCOPE, 1_000, "vendor_key"),
    key: toolKey(runId, STEP),
    runId,
    arguments: { to: "a@example.com" },
    ...extra,
    tool: (call) => {
      runs += 1;
      return tool(call);
    },
    runs: () => runs,
  };
}

/** Asserts `promise` rejects with a ToolError of `kind`, and answers it. */
async function raises(promise: Promise<unknown>, kind: ToolErrorKind): Promise<ToolError> {
  try {
    const value = await promise;
    assert.fail(`expected a ToolError of kind ${kind}, got the value ${JSON.stringify(value)}`);
  } catch (error) {
    if (!(error instanceof ToolError)) throw error;
    assert.equal(error.kind, kind, error.message);
    return error;
  }
}

/** A predicate for assert.throws: a ToolError of `kind`. */
function isKind(kind: ToolErrorKind): (error: unknown) => boolean {
  return (error) => error instanceof ToolError && error.kind === kind;
}

/** What the journal answers for the call now. */
async function journal(call: ToolInvocation): Promise<string> {
  const read = await plane().read({
    organizationId: call.organizationId,
    scope: call.spec.scope,
    key: call.key,
    requestHash: await hashOf(call.arguments),
  });
  return read.outcome;
}

Deno.test("the vendor, step and caller keys are the ones the Rust client derives (shared vectors)", async () => {
  const vectors = JSON.parse(
    await Deno.readTextFile(new URL("../../../tests/vectors/keys.json", import.meta.url)),
  );
  assert.ok(vectors.vendor_key.length >= 5 && vectors.tool_key.length >= 5);
  for (const v of vectors.vendor_key) {
    assert.equal(await vendorKey(v.organization_id, v.scope, v.key), v.vendor_key, JSON.stringify(v));
  }
  for (const v of vectors.tool_key) {
    const key = v.call_index === undefined
      ? toolKey(v.run_id, v.step_id)
      : toolCallKey(v.run_id, v.step_id, v.call_index);
    assert.equal(key, v.key, JSON.stringify(v));
  }
  for (const v of vectors.caller_key) {
    assert.equal(await planeKey(v.key, v.principal), v.caller_key, JSON.stringify(v).slice(0, 200));
  }
  // Injective where a step id looks like a call suffix.
  assert.notEqual(toolKey("r", "charge:call:0"), toolCallKey("r", "charge", 0));
  assert.notEqual(toolKey("r:1", "s"), toolKey("r", "1:s"));
  assert.throws(() => toolKey("", "s"), /empty/);
  assert.throws(() => toolCallKey("r", "s", -1), /call index/);
  await assert.rejects(() => vendorKey("not-a-uuid", SCOPE, "k"), /UUID/);
});

// A model's tool-call ids, as providers mint them: OpenAI's Chat Completions
// and Responses, Anthropic's, Gemini's, Mistral's. A replayed agent segment
// gets new ones, so none of them may key a call.
const MODEL_TOOL_CALL_IDS = [
  "call_abc123XYZ",
  "call_0",
  "fc_67ab12cd34ef",
  "toolu_01A09q90qw90lq917835lq9",
  "toolu_vrtx_01XYZ",
  "srvtoolu_014hJH82Qum7Td6UV8gDXThB",
  "tooluse_kZJMlvQmRJ6eAyJE5GIl7Q",
  "a1b2c3d4e",
  crypto.randomUUID(),
];

Deno.test("a call key is a ToolKey: the guard refuses a model's tool-call id, or any string toolKey or toolCallKey did not build, before the plane is asked", async () => {
  // Compile time, as Rust's ToolKey has no constructor from a string: a plain string is not a ToolKey.
  const typed: Pick<ToolInvocation, "key">[] = [
    // @ts-expect-error a model's tool-call id is a string, not a ToolKey
    { key: "call_abc123XYZ" },
    // @ts-expect-error nor is any other string, however shaped
    { key: `run:${crypto.randomUUID()}:step:${STEP}` },
    { key: toolKey(crypto.randomUUID(), STEP) },
    { key: toolCallKey(crypto.randomUUID(), STEP, 2) },
  ];
  assert.equal(typed.length, 4);
  // Run time, for JavaScript callers and casts: only a key the builders would build passes.
  const run = crypto.randomUUID();
  const forged = [
    ...MODEL_TOOL_CALL_IDS,
    "",
    `run:${run}`,
    `run:${run}:step:a:b`, // a `:` the builder would have escaped
    `run:${run}:step:a%`, // a `%` it would have escaped
    `run:${run}:step:a%3a`, // an escape it never writes
    `run:${run.toUpperCase()}:step:${STEP}`, // a UUID it writes in lowercase
    `run:${run}:step:${STEP}:call:01`,
    `run:${run}:step:${STEP}:call:4294967296`,
    `run:${run}:step:${STEP}:call:`,
    `run::step:${STEP}`,
    ` run:${run}:step:${STEP}`,
  ];
  const lossy = new Lossy();
  const g = guard({ fetch: lossy.fetch, log: silent });
  for (const key of [...forged, undefined, 42]) {
    assert.equal(isToolKey(key), false, JSON.stringify(key));
    const call = invocation({ key: key as ToolKey });
    const error = await raises(g.run(call), "bad_configuration");
    assert.equal(error.retryable, false);
    assert.match(error.message, /never by the model's tool-call id/);
    assert.equal(call.runs(), 0, `${JSON.stringify(key)}: the tool never ran`);
  }
  assert.deepEqual(lossy.calls, [], "nothing was read or claimed under a foreign key");
  // What the builders make passes, whatever the ids hold (a step id shaped like a tool-call id too, as in Rust).
  const vectors = JSON.parse(
    await Deno.readTextFile(new URL("../../../tests/vectors/keys.json", import.meta.url)),
  );
  for (const v of vectors.tool_key) assert.ok(isToolKey(v.key), v.key);
  const ids = ["", "s", "a:b", "%", "%3A", "a%25:b", ":call:0", "ключ-😀", "call_abc123XYZ", "toolu_01A"];
  for (const runId of [run, run.toUpperCase(), "01HZX3K4ZC9W8V7T6S5R4Q3P2N", "r:1", "%25"]) {
    for (const stepId of ids) {
      assert.ok(isToolKey(toolKey(runId, stepId)), `${runId} ${stepId}`);
      assert.ok(isToolKey(toolCallKey(runId, stepId, 0)), `${runId} ${stepId} 0`);
      assert.ok(isToolKey(toolCallKey(runId, stepId, 0xffff_ffff)), `${runId} ${stepId} max`);
    }
  }
  const built = invocation();
  assert.equal((await g.run(built)).status, "executed", "a built key is claimed");
  assert.equal(built.runs(), 1);
});

Deno.test("a tool spec refuses non-tool scopes and timeouts above the step budget; a guard refuses margins out of range", () => {
  assert.doesNotThrow(() => toolSpec(SCOPE, 120_000, "vendor_key"));
  for (const [scope, timeout] of [[SCOPE, 120_001], [SCOPE, 0], ["webhook.nylas", 5_000], ["tool.", 5_000]] as const) {
    assert.throws(() => toolSpec(scope, timeout, "vendor_key"), isKind("bad_configuration"), `${scope} ${timeout}`);
  }
  assert.throws(() => toolSpec(SCOPE, 1_000, {} as never), /repeat safety/);
  for (const leaseMarginMs of [0, 999, 300_001]) {
    assert.throws(() => guard({ leaseMarginMs }), isKind("bad_configuration"));
  }
  assert.throws(() => guard({ heartbeatLeaseMs: 2_000 }), isKind("bad_configuration"));
  const spec = toolSpec(SCOPE, 3_000, "vendor_key");
  assert.equal(guard({ leaseMarginMs: 7_000 }).leaseFor(spec), 3_000 + 1_000 + 7_000, "timeout + journal + margin");
});

Deno.test("retry horizon: a lease that outlasts the orchestrator's last attempt is refused, one that passes before it is not", async () => {
  // Four retries from 1 s, doubling up to a minute: the last attempt comes 15 s after the first.
  const horizon = RetryHorizon.exponential(4, 1_000, 60_000);
  assert.equal(horizon.untilLastMs, 15_000);
  assert.equal(
    RetryHorizon.exponential(10, 10_000, 30_000).untilLastMs,
    10_000 + 20_000 + 30_000 * 8,
    "each wait capped",
  );
  const g = guard({ horizon, leaseMarginMs: 4_000 });
  assert.doesNotThrow(() => g.check(toolSpec(SCOPE, 9_000, "vendor_key")), "lease 14 s < 15 s");
  assert.throws(
    () => g.check(toolSpec(SCOPE, 10_000, "vendor_key")),
    isKind("lease_outlasts_retries"),
    "15 s is not < 15 s",
  );
  // run() refuses it too, before anything is read or claimed.
  const call = invocation({ spec: toolSpec(SCOPE, 10_000, "vendor_key") });
  const error = await raises(g.run(call), "lease_outlasts_retries");
  assert.equal(error.retryable, false);
  assert.equal(call.runs(), 0);
  assert.equal(await journal(call), "absent");
});

Deno.test("time spent in the checkpoint counts against the retry horizon, and no key is taken", async () => {
  // Lease 3 s against a 4 s horizon: a 1.2 s checkpoint leaves it outlasting the last attempt.
  const g = guard({ horizon: RetryHorizon.untilLastAttempt(4_000) });
  const call = invocation({ checkpoint: async () => (await sleep(1_200), "allow" as const) });
  await raises(g.run(call), "lease_outlasts_retries");
  assert.equal(call.runs(), 0);
  assert.equal(await journal(call), "absent");
});

Deno.test("a success is journaled and every later attempt replays it without running the tool or the checkpoint", async () => {
  const g = guard();
  let checkpoints = 0;
  const call = invocation({
    tool: (c: ToolCall) => success({ message_id: "m-1", vendor_key: c.vendorKey }),
    checkpoint: () => (checkpoints++, "allow"),
  });
  const first = await g.run(call);
  assert.equal(first.status, "executed");
  const replay = await g.run(call);
  assert.deepEqual(replay, { status: "replayed", answer: (first as { answer: Answer }).answer });
  assert.equal(
    JSON.stringify(replay.status === "replayed" && replay.answer),
    JSON.stringify((first as { answer: Answer }).answer),
  );
  assert.equal(call.runs(), 1);
  assert.equal(checkpoints, 1, "a replay never calls the checkpoint");
  const expected = await vendorKey(call.organizationId, SCOPE, call.key);
  assert.equal(
    ((first as { answer: Answer }).answer.output as { vendor_key?: string }).vendor_key,
    expected,
    "the tool got the tenant's vendor key",
  );
});

Deno.test("a business failure completes the claim and replays as the same failure", async () => {
  const g = guard();
  const call = invocation({ tool: () => failure("not_found", { id: 7 }) });
  const first = await g.run(call);
  assert.equal(first.status, "executed");
  const replay = await g.run(call);
  assert.equal(replay.status, "replayed");
  assert.deepEqual(replay.status === "replayed" && replay.answer, (first as { answer: Answer }).answer);
  assert.equal((first as { answer: Answer }).answer.ok, false);
  assert.equal(call.runs(), 1);
});

Deno.test("a retryable failure (NothingHappened) releases the claim and is raised; the next attempt executes", async () => {
  const g = guard();
  let fail = true;
  const call = invocation({
    tool: () => {
      if (fail) throw new NothingHappened("vendor answered 429");
      return success({ message_id: "m-2" });
    },
  });
  const error = await raises(g.run(call), "retryable_failure");
  assert.equal(error.retryable, true);
  assert.equal(error.settled?.ending, "released");
  assert.equal(await journal(call), "absent", "released: no claim is left");
  fail = false;
  assert.equal((await g.run(call)).status, "executed");
  assert.equal(call.runs(), 2);
});

Deno.test("a live claim on the call's own key is raised as in_flight with when to retry, never a result", async () => {
  const g = guard();
  let release!: () => void;
  const blocked = new Promise<void>((resolve) => (release = resolve));
  const entered = Promise.withResolvers<void>();
  const call = invocation({
    spec: toolSpec(SCOPE, 20_000, "vendor_key"),
    tool: async () => (entered.resolve(), await blocked, success({ n: 1 })),
  });
  const first = g.run(call);
  await entered.promise;
  let checkpoints = 0;
  const second = await raises(g.run({ ...call, checkpoint: () => (checkpoints++, "allow") }), "in_flight");
  assert.equal(second.retryable, true);
  assert.ok(second.retryAfter instanceof Date && second.retryAfter.getTime() > Date.now(), "the lease is live");
  assert.equal(checkpoints, 0, "a call in flight never calls the checkpoint");
  release();
  assert.equal((await first).status, "executed");
  assert.equal(call.runs(), 1);
});

Deno.test("the journal is read before the checkpoint and claimed after it: a held call takes no key", async () => {
  const g = guard();
  const call = invocation({ checkpoint: () => "hold" });
  assert.deepEqual(await g.run(call), { status: "held" });
  assert.equal(call.runs(), 0);
  assert.equal(await journal(call), "absent", "no key was taken while the call waits for approval");
  assert.equal((await g.run({ ...call, checkpoint: () => "allow" })).status, "executed");
  assert.equal(call.runs(), 1);
});

Deno.test("the same key with other arguments is a conflict, not retryable, and nothing runs", async () => {
  const g = guard();
  const call = invocation();
  await g.run(call);
  const error = await raises(g.run({ ...call, arguments: { to: "b@example.com" } }), "conflict");
  assert.equal(error.retryable, false);
  assert.equal(call.runs(), 1);
});

Deno.test("a tool that overruns its timeout is raised as timed_out and its claim waits for the lease", async () => {
  const g = guard({ leaseMarginMs: 10_000 });
  const call = invocation({ tool: () => new Promise<Answer>(() => {}) });
  const error = await raises(g.run(call), "timed_out");
  assert.equal(error.retryable, true);
  assert.equal(error.settled?.ending, "left_to_lease");
  assert.equal(await journal(call), "processing", "the effect is unknown: nothing released");
  await raises(g.run({ ...call, tool: () => success({}) }), "in_flight");
});

Deno.test("a tool that throws leaves its claim to the lease; after it, the retry reclaims with the same vendor key", async () => {
  const g = guard();
  const keys: string[] = [];
  let throwing = true;
  const call = invocation({
    tool: (c: ToolCall) => {
      keys.push(c.vendorKey);
      if (throwing) throw new Error("socket closed after the request was sent");
      return success({ reclaimed: c.claim.reclaimed });
    },
  });
  const error = await raises(g.run(call), "threw");
  assert.equal(error.retryable, true);
  assert.equal(error.settled?.ending, "left_to_lease");
  const inFlight = await raises(g.run(call), "in_flight");
  await sleep(Math.max(0, (inFlight.retryAfter?.getTime() ?? 0) - Date.now()) + 300);
  throwing = false;
  const run = await g.run(call);
  assert.deepEqual(run, { status: "executed", answer: success({ reclaimed: true }) });
  assert.equal(keys.length, 2);
  assert.equal(keys[0], keys[1], "the vendor sees one key for both attempts");
});

Deno.test("an answer the plane never receives is raised as not_journaled; the retry after the lease reclaims the call", async () => {
  // Every completion is refused before it leaves: the answer is not journaled.
  const refusing: typeof fetch = (input, init) =>
    functionOf(input) === "idempotency_complete"
      ? Promise.reject(new TypeError("error sending request: Connection refused (os error 111)"))
      : fetch(input, init);
  const call = invocation({ tool: (c: ToolCall) => success({ reclaimed: c.claim.reclaimed }) });
  const error = await raises(guard({ fetch: refusing }).run(call), "not_journaled");
  assert.equal(error.retryable, true);
  assert.equal(error.settled?.ending, "left_to_lease");
  assert.equal(await journal(call), "processing", "left to its lease, not released");
  const g = guard();
  await afterTheLease(await raises(g.run(call), "in_flight"));
  assert.deepEqual(await g.run(call), { status: "executed", answer: success({ reclaimed: true }) });
  assert.equal(call.runs(), 2, "run again after the lease, with the same vendor key");
});

Deno.test("an answer whose acknowledgement is lost is raised as not_journaled; the retry replays it", async () => {
  // The completions commit and their answers are lost: journaled, unconfirmed.
  const lossy = new Lossy().loseNext("idempotency_complete", 1_000);
  const call = invocation();
  const error = await raises(guard({ fetch: lossy.fetch }).run(call), "not_journaled");
  assert.equal(error.retryable, true);
  assert.equal(await journal(call), "completed");
  assert.equal((await guard().run(call)).status, "replayed");
  assert.equal(call.runs(), 1);
});

Deno.test("a checkpoint that throws is raised as checkpoint_failed, retryable, and takes no key", async () => {
  const call = invocation({ checkpoint: () => Promise.reject(new Error("the approvals service is down")) });
  const error = await raises(guard().run(call), "checkpoint_failed");
  assert.equal(error.retryable, true);
  assert.equal(call.runs(), 0);
  assert.equal(await journal(call), "absent");
});

Deno.test("a second run under one claim that never starts leaves nothing to wait for, not the first run's ending", async () => {
  // A reclaimed call runs its reconciler, then its tool, under one claim: a
  // tool that cannot start (the deadline passed) never starts, and is never
  // answered by the reconciler's ending.
  const p = plane();
  const driver = new EffectDriver(p, { log: silent });
  const begun = await driver.begin({
    organizationId: organization(),
    scope: SCOPE,
    key: toolKey(crypto.randomUUID(), "s"),
    requestHash: await hashOf({}),
    timing: new Timing(300, 1_000, 1_000),
  });
  assert.equal(begun.kind, "held");
  const held = (begun as { held: Held }).held;
  assert.deepEqual(await held.run(() => undefined), { value: undefined });
  await sleep(400);
  assert.deepEqual(await held.run(() => success({})), { cut: "not_started" });
  assert.equal(await held.late(held.lateDeadline), undefined, "nothing of this run is running");
  await held.settle({ unknown: "test" });
});

Deno.test("a plane that cannot be reached is a retryable ToolError of kind plane, before any tool runs", async () => {
  const lossy = new Lossy().refuseAll();
  const call = invocation();
  const error = await raises(guard({ fetch: lossy.fetch }).run(call), "plane");
  assert.equal(error.retryable, true);
  assert.equal(call.runs(), 0);
  const invalid = await raises(guard().run({ ...call, organizationId: "nope" }), "plane");
  assert.equal(invalid.retryable, false, "invalid input is not retried");
});

Deno.test("with heartbeats a call is claimed for a short lease that its beats keep past its end", async () => {
  const g = guard({ heartbeatLeaseMs: 3_000 });
  const spec = toolSpec(SCOPE, 8_000, "vendor_key");
  assert.equal(g.leaseFor(spec), 3_000);
  const done = Promise.withResolvers<void>();
  const call = invocation({ spec, tool: async () => (await done.promise, success({ slow: true })) });
  const run = g.run(call);
  await sleep(4_500);
  const held = await journal(call);
  done.resolve();
  assert.equal(held, "processing", "the beats kept the 3 s lease alive past its end");
  assert.equal((await run).status, "executed");
});

// A simulated vendor: applies each request once per Idempotency-Key (when
// given), and lists what it sent by the caller's reference.
function vendor() {
  const byKey = new Map<string, unknown>();
  const sent: { id: string; reference: string }[] = [];
  let requests = 0;
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    requests += 1;
    const body = await request.json();
    const key = request.headers.get("idempotency-key");
    if (key && byKey.has(key)) return Response.json(byKey.get(key));
    const message = { id: `msg-${sent.length + 1}`, reference: body.reference as string };
    sent.push(message);
    if (key) byKey.set(key, message);
    return Response.json(message);
  });
  return {
    url: `http://127.0.0.1:${server.addr.port}/`,
    sent,
    requests: () => requests,
    stop: () => server.shutdown(),
  };
}

/** Runs tool_step_worker.ts and kills it with SIGKILL once its vendor applied the call. */
async function killedAfterTheVendor(
  call: ToolInvocation & { runId: string },
  vendorUrl: string,
  repeat: string,
): Promise<void> {
  const child = new Deno.Command(Deno.execPath(), {
    args: [
      "run",
      "--frozen",
      "--allow-net",
      "--allow-env",
      "--allow-read",
      new URL("./tool_step_worker.ts", import.meta.url).pathname,
    ],
    env: {
      ORGANIZATION_ID: call.organizationId,
      RUN_ID: call.runId,
      STEP_ID: STEP,
      ARGUMENTS: JSON.stringify(call.arguments),
      VENDOR_URL: vendorUrl,
      REPEAT: repeat,
      TIMEOUT_MS: String(call.spec.timeoutMs),
    },
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  try {
    await readUntil(reader, "vendor answered", "the worker");
  } finally {
    child.kill("SIGKILL");
  }
  const status = await child.status;
  assert.equal(status.signal, "SIGKILL", "the worker was killed, not ended");
  await reader.cancel().catch(() => {});
}

/** Waits until the lease an in_flight error names has passed. */
async function afterTheLease(error: ToolError): Promise<void> {
  assert.ok(error.retryAfter, "in_flight says when to retry");
  await sleep(Math.max(0, error.retryAfter.getTime() - Date.now()) + 300);
}

Deno.test("a worker killed after its vendor applied the call: the retry reclaims, and the vendor key makes it a replay at the vendor", async () => {
  const v = vendor();
  try {
    const g = guard();
    const call = invocation({
      spec: toolSpec(SCOPE, 3_000, "vendor_key"),
      tool: async (c: ToolCall) => {
        const response = await fetch(v.url, {
          method: "POST",
          headers: { "idempotency-key": c.vendorKey },
          body: JSON.stringify({ reference: call.key }),
          signal: c.signal,
        });
        return success({ message: await response.json(), reclaimed: c.claim.reclaimed });
      },
    });
    await killedAfterTheVendor(call, v.url, "vendor_key");
    assert.equal(v.sent.length, 1);
    // The orchestrator's retry meets the dead worker's live claim: raised, with when to retry.
    await afterTheLease(await raises(g.run(call), "in_flight"));
    const run = await g.run(call);
    assert.deepEqual(run, { status: "executed", answer: success({ message: v.sent[0], reclaimed: true }) });
    assert.equal(v.requests(), 2, "the retry reached the vendor");
    assert.equal(v.sent.length, 1, "and the vendor applied it once");
    assert.deepEqual(await g.run(call), {
      status: "replayed",
      answer: success({ message: v.sent[0], reclaimed: true }),
    });
    assert.equal(v.requests(), 2);
  } finally {
    await v.stop();
  }
});

Deno.test("reconcile: a worker killed after a keyless vendor applied the call is reconciled, and the vendor is not called again", async () => {
  const v = vendor();
  try {
    const g = guard();
    const reconciler: Reconciler = (c) => {
      const found = v.sent.find((m) => m.reference === c.claim.key);
      return Promise.resolve(found ? success({ message: found }) : undefined);
    };
    const call = invocation({
      spec: toolSpec(SCOPE, 3_000, { reconcile: reconciler }),
      tool: () => assert.fail("the vendor must not be called again"),
    });
    await killedAfterTheVendor(call, v.url, "reconcile");
    await afterTheLease(await raises(g.run(call), "in_flight"));
    const run = await g.run(call);
    assert.deepEqual(run, { status: "reconciled", answer: success({ message: v.sent[0] }) });
    assert.equal(call.runs(), 0);
    assert.equal(v.sent.length, 1);
    assert.deepEqual(await g.run(call), { status: "replayed", answer: success({ message: v.sent[0] }) });
  } finally {
    await v.stop();
  }
});

/** A call whose first attempt threw after claiming (its effect unknown), with the lease then passed. */
async function abandoned(g: ToolGuard, call: ToolInvocation): Promise<void> {
  await raises(g.run({ ...call, tool: () => Promise.reject(new Error("stopped")) }), "threw");
  await afterTheLease(await raises(g.run(call), "in_flight"));
}

Deno.test("reconcile that finds nothing executes exactly once; a first attempt never asks the reconciler", async () => {
  const g = guard();
  let asked = 0;
  const reconciler: Reconciler = () => (asked++, Promise.resolve(undefined));
  const spec = toolSpec(SCOPE, 1_000, { reconcile: reconciler });
  const fresh = invocation({ spec });
  assert.equal((await g.run(fresh)).status, "executed");
  assert.equal(asked, 0, "a first claim is not a repeat");
  const call = invocation({ spec });
  await abandoned(g, call);
  assert.equal((await g.run(call)).status, "executed");
  assert.equal(asked, 1);
  assert.equal(call.runs(), 1);
});

Deno.test("reconcile that cannot tell keeps the claim, so the next attempt asks again", async () => {
  const g = guard();
  let tell = false;
  const reconciler: Reconciler = () =>
    tell ? Promise.resolve(success({ found: true })) : Promise.reject(new Error("vendor search is down"));
  const call = invocation({ spec: toolSpec(SCOPE, 1_000, { reconcile: reconciler }) });
  await abandoned(g, call);
  const error = await raises(g.run(call), "reconcile_failed");
  assert.equal(error.retryable, true);
  assert.equal(error.settled?.ending, "left_to_lease");
  assert.equal(await journal(call), "processing", "kept: a release would let the next attempt run without asking");
  await afterTheLease(await raises(g.run(call), "in_flight"));
  tell = true;
  assert.deepEqual(await g.run(call), { status: "reconciled", answer: success({ found: true }) });
  assert.equal(call.runs(), 0);
});

Deno.test("a tool that answers something other than an Answer is a bad_configuration, not retried, and its claim waits for the lease", async () => {
  const g = guard();
  const call = invocation({ tool: () => Promise.resolve({ message_id: "m-1" } as unknown as Answer) });
  const error = await raises(g.run(call), "bad_configuration");
  assert.equal(error.retryable, false);
  assert.equal(call.runs(), 1);
  assert.equal(await journal(call), "processing", "whatever the tool did is unknown: nothing released or journaled");
});

Deno.test("a reconciler that answers something other than an Answer is a bad_configuration; the tool never runs", async () => {
  const g = guard();
  const reconciler = (() => Promise.resolve("found it")) as unknown as Reconciler;
  const call = invocation({ spec: toolSpec(SCOPE, 1_000, { reconcile: reconciler }) });
  await abandoned(g, call);
  const error = await raises(g.run(call), "bad_configuration");
  assert.equal(error.retryable, false);
  assert.equal(error.settled?.ending, "left_to_lease");
  assert.equal(call.runs(), 0, "an unreadable reconciler never lets the tool run again");
  assert.equal(await journal(call), "processing");
});

Deno.test("a reconciler that overruns the tool's timeout is raised as timed_out and keeps the claim", async () => {
  const g = guard();
  const reconciler: Reconciler = () => new Promise<Answer | undefined>(() => {});
  const call = invocation({ spec: toolSpec(SCOPE, 1_000, { reconcile: reconciler }) });
  await abandoned(g, call);
  const error = await raises(g.run(call), "timed_out");
  assert.equal(error.retryable, true);
  assert.equal(error.settled?.ending, "left_to_lease");
  assert.equal(call.runs(), 0);
  assert.equal(await journal(call), "processing", "kept: the next attempt asks the reconciler again");
});
