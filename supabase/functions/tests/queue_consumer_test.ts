// The queue consumer (supabase/functions/queue-consumer/) against a real
// plane with real pgmq: `idem up --with-pgmq --queue consumer_test --queue
// consumer_test_dlq` (tests/run.sh asks for them), which also grants the
// plane its queue functions on them. A message's effect happens once per
// idempotency key, however often pgmq delivers it and however often the
// producer sent it; a message is archived only once its answer is
// journaled; failures for good go to the dead-letter queue with their
// failure journaled. Both paths are tried: the plane's own queue functions
// (`path: "plane"`, what `auto` picks on this plane) and Supabase's
// pgmq_public (`path: "data_api"`, a plane without them).

import assert from "node:assert/strict";
import { consumer } from "../queue-consumer/index.ts";
import {
  type Drained,
  EffectDriver,
  failure,
  IdempotencyPlane,
  type MessageContext,
  PlaneError,
  type PlaneEvent,
  QueueConsumer,
  type QueuePath,
  Queues,
  requestHash,
  silent,
  success,
  Timing,
  vendorKey,
} from "../_shared/idempotency/mod.ts";
import {
  functionOf,
  idem,
  KEY,
  killHard,
  Lossy,
  organization,
  serve,
  sleep,
  superuserSql,
  uniqueKey,
  URL_,
} from "./support.ts";

const QUEUE = "consumer_test";
const DLQ = "consumer_test_dlq";
const SCOPE = `queue.${QUEUE}`;
const PATHS: readonly QueuePath[] = ["plane", "data_api"];

/** A downstream service: counts each vendor key's 2xx effects; answers as `answerFor` says. */
function vendor(answerFor: (payload: { fail?: number }) => number) {
  const effects = new Map<string, number>();
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    const payload = await request.json();
    const status = answerFor(payload);
    if (status < 300) {
      const key = request.headers.get("idempotency-key") ?? "";
      effects.set(key, (effects.get(key) ?? 0) + 1);
    }
    return new Response(null, { status });
  });
  return { effects, url: `http://127.0.0.1:${server.addr.port}/`, stop: () => server.shutdown() };
}

/**
 * A fetch that refuses, before sending, every call of a function named in
 * `refused` (a connection refused): the call makes nothing happen, however
 * often the client tries it.
 */
function refusing(refused: Set<string>): typeof fetch {
  return (input, init) =>
    refused.has(functionOf(input))
      ? Promise.reject(new TypeError("error sending request: Connection refused (os error 111)"))
      : fetch(input, init);
}

/** The example function over the test plane: `drain` posts to it as Supabase Cron does. */
function setup(
  org: string,
  processUrl: string,
  extra: Record<string, string> = {},
  queueFetch?: typeof fetch,
  planeFetch?: typeof fetch,
) {
  const queues = Queues.connect({ url: URL_, key: KEY, fetch: queueFetch });
  const env: Record<string, string> = {
    QUEUE_NAME: QUEUE,
    DEAD_LETTER_QUEUE: DLQ,
    PROCESS_URL: processUrl,
    ORGANIZATION_ID: org,
    IDEM_SERVICE_KEY: KEY,
    // A 3.5 s lease: a message read is hidden for 5 s.
    EFFECT_TIMEOUT_MS: "1000",
    JOURNAL_DEADLINE_MS: "1500",
    LEASE_MARGIN_MS: "1000",
    BATCH: "20",
    ...extra,
  };
  const plane = IdempotencyPlane.connect({ url: URL_, key: KEY, fetch: planeFetch });
  const handler = consumer(plane, queues, (name) => env[name]);
  const drain = async (): Promise<Drained> => {
    const answer = await handler(
      new Request("http://fn/", { method: "POST", headers: { authorization: `Bearer ${KEY}` } }),
    );
    assert.equal(answer.status, 200);
    return await answer.json();
  };
  return { queues, handler, drain };
}

/** A consumer of the test queue built directly, to see each effect's context. */
function direct(
  org: string,
  options: {
    path?: QueuePath;
    organizations?: string[];
    timing?: Timing;
    batchSize?: number;
    fetch?: typeof fetch;
    queueFetch?: typeof fetch;
  } = {},
): QueueConsumer {
  return new QueueConsumer(
    new EffectDriver(IdempotencyPlane.connect({ url: URL_, key: KEY, fetch: options.fetch }), { log: silent }),
    Queues.connect({ url: URL_, key: KEY, fetch: options.queueFetch }),
    {
      queue: QUEUE,
      deadLetterQueue: DLQ,
      organizationId: org,
      organizations: options.organizations,
      timing: options.timing ?? new Timing(1_000, 1_500, 1_000),
      batchSize: options.batchSize ?? 20,
      path: options.path,
    },
  );
}

/**
 * Empties the queue and the dead-letter queue, hidden messages too, so each
 * test starts clean (a message left hidden by an earlier test would come back
 * in a later one).
 */
async function empty(): Promise<void> {
  await superuserSql(`delete from pgmq.q_${QUEUE}; delete from pgmq.q_${DLQ}`);
}

/** Every dead letter, hidden or not, without reading them (a read would hide them). */
async function letters(): Promise<Array<{ dead_letter: Record<string, unknown> } & Record<string, unknown>>> {
  const rows = await superuserSql(`select message::text from pgmq.q_${DLQ} order by msg_id`);
  return rows.map(([text]) => JSON.parse(text));
}

/**
 * Sends `text` (a JSON text) to `queue` as a producer in another language
 * would: JavaScript could not write it (`1e400`), the queue takes it.
 */
async function sendRaw(queue: string, text: string): Promise<number> {
  const answer = await fetch(`${URL_}/rpc/send`, {
    method: "POST",
    headers: {
      "Authorization": `Bearer ${KEY}`,
      "apikey": KEY,
      "Content-Type": "application/json",
      "Content-Profile": "pgmq_public",
    },
    body: `{"queue_name": ${JSON.stringify(queue)}, "message": ${text}}`,
  });
  const ids = await answer.json();
  assert.equal(answer.status, 200, JSON.stringify(ids));
  return Array.isArray(ids) ? ids[0] : ids;
}

/** The messages archived from the test queue, by id. */
async function archived(ids: readonly number[]): Promise<Map<number, number>> {
  if (ids.length === 0) return new Map();
  const rows = await superuserSql(`select msg_id, read_ct from pgmq.a_${QUEUE} where msg_id in (${ids.join(",")})`);
  return new Map(rows.map(([id, reads]) => [Number(id), Number(reads)]));
}

function counts(drained: Drained, ...fields: (keyof Drained)[]): Partial<Drained> {
  return Object.fromEntries(fields.map((field) => [field, drained[field]]));
}

Deno.test("pgmq_public path: a message sent twice, and delivered again, has its effect once; both are archived", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: "data_api" });
  await empty();
  try {
    const key = `order-${crypto.randomUUID()}`;
    await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 7 } });
    await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 7 } });
    await queues.send(QUEUE, { payload: { sku: 8 } });
    const first = await drain();
    assert.deepEqual(
      { read: first.read, archived: first.archived, dead_lettered: first.dead_lettered, left: first.left },
      { read: 3, archived: 2, dead_lettered: 0, left: 1 },
      JSON.stringify(first),
    );
    // The duplicate found the first message's claim held by this batch: left,
    // it comes back once its visibility passes, replays the answer, and goes.
    await sleep(6_000);
    const second = await drain();
    assert.deepEqual({ read: second.read, replayed: second.replayed, archived: second.archived }, {
      read: 1,
      replayed: 1,
      archived: 1,
    });
    assert.equal(downstream.effects.get(await vendorKey(org, SCOPE, key)), 1, "one effect for the key");
    assert.equal([...downstream.effects.values()].reduce((a, b) => a + b, 0), 2, "and one for the keyless message");
    assert.equal((await drain()).read, 0, "nothing left");
  } finally {
    await downstream.stop();
  }
});

Deno.test("plane path: a key twice in one batch is a copy, archived with its first in the same drain; the effect once", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url);
  await empty();
  try {
    const key = `order-${crypto.randomUUID()}`;
    const first = await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 7 } });
    const copy = await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 7 } });
    const keyless = await queues.send(QUEUE, { payload: { sku: 8 } });
    const drained = await drain();
    assert.deepEqual(
      drained,
      { read: 3, ran: 2, replayed: 1, failed: 0, archived: 3, dead_lettered: 0, left: 0, redriven: 0 },
      JSON.stringify(drained),
    );
    assert.deepEqual(
      [...(await archived([first, copy, keyless])).keys()].sort((a, b) => a - b),
      [first, copy, keyless],
      "all three archived by this drain, the copy with its first",
    );
    assert.equal(downstream.effects.get(await vendorKey(org, SCOPE, key)), 1, "one effect for the key");
    assert.equal([...downstream.effects.values()].reduce((a, b) => a + b, 0), 2, "and one for the keyless message");
    assert.equal((await drain()).read, 0, "nothing left");
  } finally {
    await downstream.stop();
  }
});

for (const path of PATHS) {
  Deno.test(`${path} path: a failure for good goes to the dead-letter queue with its failure journaled`, async () => {
    const downstream = vendor((payload) => payload.fail ?? 200);
    const org = organization();
    const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: path });
    await empty();
    try {
      const key = `refund-${crypto.randomUUID()}`;
      await queues.send(QUEUE, { idempotency_key: key, payload: { fail: 422 } });
      await queues.send(QUEUE, "not an object");
      const drained = await drain();
      assert.deepEqual(counts(drained, "ran", "failed", "dead_lettered", "archived", "left"), {
        ran: 1,
        failed: 1,
        dead_lettered: 2,
        archived: 2,
        left: 0,
      });
      const all = await letters();
      assert.equal(all.length, 2);
      const letter = all.find((m) => m.idempotency_key === key);
      const failure = letter?.dead_letter.failure as { ok: boolean; error: string };
      assert.deepEqual([failure.ok, failure.error], [false, "process_failed"]);
      const malformed = all.find((m) => m.idempotency_key === undefined);
      assert.equal(malformed?.dead_letter.message_text, '"not an object"', JSON.stringify(malformed));
      assert.equal((malformed?.dead_letter.failure as { error: string }).error, "malformed_message");
      const read = await IdempotencyPlane.connect({ url: URL_, key: KEY }).read({
        organizationId: org,
        scope: SCOPE,
        key,
        requestHash: await requestHash({ fail: 422 }),
      });
      assert.ok(read.outcome === "completed" && !read.answer.ok, "the failure is journaled: a duplicate replays it");
      assert.equal(downstream.effects.size, 0);
    } finally {
      await downstream.stop();
    }
  });

  Deno.test(`${path} path: a message that keeps failing is left until max_reads, then dead-lettered as such`, async () => {
    const downstream = vendor(() => 503);
    const org = organization();
    const { queues, drain } = setup(org, downstream.url, { MAX_READS: "2", QUEUE_PATH: path });
    await empty();
    try {
      await queues.send(QUEUE, { idempotency_key: `flaky-${crypto.randomUUID()}`, payload: { n: 1 } });
      const first = await drain();
      assert.deepEqual({ ran: first.ran, failed: first.failed, left: first.left }, { ran: 1, failed: 1, left: 1 });
      await sleep(6_000);
      assert.deepEqual((await drain()).left, 1, "read twice: still within max_reads");
      await sleep(6_000);
      const third = await drain();
      assert.deepEqual({ dead_lettered: third.dead_lettered, archived: third.archived }, {
        dead_lettered: 1,
        archived: 1,
      });
      const [letter] = await letters();
      assert.equal((letter.dead_letter.failure as { error: string }).error, "dead_lettered");
      assert.equal((await drain()).read, 0, "nothing left");
    } finally {
      await downstream.stop();
    }
  });

  Deno.test(`${path} path: the same key with another payload is a conflict: dead-lettered, never run`, async () => {
    const downstream = vendor(() => 200);
    const org = organization();
    const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: path });
    await empty();
    try {
      const key = `order-${crypto.randomUUID()}`;
      await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 1 } });
      assert.equal((await drain()).archived, 1);
      await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 2 } });
      const drained = await drain();
      assert.deepEqual({ ran: drained.ran, dead_lettered: drained.dead_lettered, archived: drained.archived }, {
        ran: 0,
        dead_lettered: 1,
        archived: 1,
      });
      const [letter] = await letters();
      assert.equal((letter.dead_letter.failure as { error: string }).error, "conflict");
    } finally {
      await downstream.stop();
    }
  });

  Deno.test(`${path} path: a message no client can read is dead-lettered alone, as its text, and the rest of its batch runs`, async () => {
    const downstream = vendor(() => 200);
    const org = organization();
    const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: path });
    await empty();
    try {
      const [a, b] = [uniqueKey("order"), uniqueKey("order")];
      const sent = [
        await queues.send(QUEUE, { idempotency_key: a, payload: { sku: 1 } }),
        // JavaScript reads 1e400 as Infinity: no client can hash it or hand it on.
        await sendRaw(QUEUE, `{"idempotency_key": "${uniqueKey("poison")}", "payload": {"amount": 1e400}}`),
        await queues.send(QUEUE, "not an object"),
        await queues.send(QUEUE, { idempotency_key: 42, payload: { sku: 3 } }),
        await queues.send(QUEUE, { idempotency_key: b, payload: { sku: 2 } }),
      ];
      const drained = await drain();
      assert.deepEqual(
        drained,
        { read: 5, ran: 2, replayed: 0, failed: 0, archived: 5, dead_lettered: 3, left: 0, redriven: 0 },
        JSON.stringify(drained),
      );
      for (const key of [a, b]) {
        assert.equal(downstream.effects.get(await vendorKey(org, SCOPE, key)), 1, `${key} ran once`);
      }
      const dead = await letters();
      const texts = new Map(dead.map((letter) => [letter.dead_letter.msg_id, letter.dead_letter.message_text]));
      assert.deepEqual(
        [...texts.keys()].map(Number).sort((x, y) => x - y),
        sent.slice(1, 4),
        "one letter for each, and only them",
      );
      for (const letter of dead) {
        assert.deepEqual(Object.keys(letter), ["dead_letter"], "a letter carries nobody's members but its own");
        assert.equal((letter.dead_letter.failure as { error: string }).error, "malformed_message");
      }
      // As sent: the plane's jsonb prints 1e400 in full, Deno keeps its source.
      assert.match(String(texts.get(sent[1])), /"amount": ?1(e400|0{400})\}/);
      assert.equal(texts.get(sent[2]), '"not an object"');
      assert.match(String(texts.get(sent[3])), /"idempotency_key": ?42/);
      assert.equal((await archived(sent)).size, 5, "every message archived");
      assert.equal((await drain()).read, 0, "nothing left");
    } finally {
      await downstream.stop();
    }
  });

  Deno.test(`${path} path: a message naming an accepted organization is claimed under it; one naming another is dead-lettered as malformed`, async () => {
    const [home, tenant, stranger] = [organization(), organization(), organization()];
    const consumer = direct(home, { path, organizations: [home, tenant] });
    await empty();
    const keys = { tenant: uniqueKey("t"), stranger: uniqueKey("s"), home: uniqueKey("h"), broken: uniqueKey("b") };
    await consumer.queues.send(QUEUE, { idempotency_key: keys.tenant, organization_id: tenant, payload: { n: 1 } });
    await consumer.queues.send(QUEUE, { idempotency_key: keys.stranger, organization_id: stranger, payload: { n: 2 } });
    await consumer.queues.send(QUEUE, { idempotency_key: keys.home, payload: { n: 3 } });
    await consumer.queues.send(QUEUE, { idempotency_key: keys.broken, organization_id: "tenant-7", payload: { n: 4 } });
    const ran = new Map<string, string>();
    const drained = await consumer.drain((_payload, context) => {
      ran.set(context.claim.key, context.claim.organizationId);
      return { journal: success({ by: context.claim.organizationId }) };
    });
    assert.deepEqual(counts(drained, "read", "ran", "archived", "dead_lettered", "left"), {
      read: 4,
      ran: 2,
      archived: 4,
      dead_lettered: 2,
      left: 0,
    }, JSON.stringify(drained));
    assert.deepEqual(Object.fromEntries(ran), { [keys.tenant]: tenant, [keys.home]: home });
    const plane = IdempotencyPlane.connect({ url: URL_, key: KEY });
    const read = async (organizationId: string, key: string, n: number) =>
      (await plane.read({ organizationId, scope: SCOPE, key, requestHash: await requestHash({ n }) })).outcome;
    assert.equal(await read(tenant, keys.tenant, 1), "completed", "claimed under the message's organization");
    assert.equal(await read(home, keys.tenant, 1), "absent", "not under the consumer's own");
    assert.equal(await read(stranger, keys.stranger, 2), "absent");
    // Each letter by the message it carries as text (sent at once, in no set order).
    const reasons = new Map((await letters()).map((letter) => {
      const failure = letter.dead_letter.failure as { error: string; output: { reason: string } };
      assert.equal(failure.error, "malformed_message");
      const text = String(letter.dead_letter.message_text);
      return [text.includes(keys.stranger) ? "stranger" : text.includes(keys.broken) ? "broken" : text, failure];
    }));
    assert.deepEqual([...reasons.keys()].sort(), ["broken", "stranger"]);
    assert.match(
      reasons.get("stranger")?.output.reason ?? "",
      new RegExp(`organization_id ${stranger} is not one this consumer accepts`),
    );
    assert.match(reasons.get("broken")?.output.reason ?? "", /organization_id is not a UUID/);
  });
}

Deno.test("plane path: a failed command sent back with idem redrive --failed after a fix runs once more on the next drain, exactly once", async () => {
  const org = organization();
  const consumer = direct(org, { path: "plane" });
  await empty();
  const key = uniqueKey("refund");
  let fixed = false;
  const runs: { fixed: boolean; message?: unknown; attempt?: number; payload: unknown }[] = [];
  const process = (payload: unknown, context: MessageContext) => {
    runs.push({ fixed, message: context.message?.message, attempt: context.attempt, payload });
    return fixed ? { journal: success({ refunded: true }) } : { journal: failure("downstream_bug", { status: 500 }) };
  };
  const msgId = await consumer.queues.send(QUEUE, { idempotency_key: key, payload: { amount: 5 } });
  const first = await consumer.drain(process);
  assert.deepEqual(counts(first, "ran", "failed", "dead_lettered", "archived", "redriven"), {
    ran: 1,
    failed: 1,
    dead_lettered: 1,
    archived: 1,
    redriven: 0,
  });

  // The operator finds it, fixes the bug, and sends it back.
  const listed = await idem("failures", "--scope", SCOPE, "--org", org, "--json");
  assert.equal(listed.code, 0, listed.stderr);
  const failures = listed.stdout.trim().split("\n").map((line) => JSON.parse(line));
  assert.deepEqual(failures.map((f) => [f.key, f.error, f.redrivable]), [[key, "downstream_bug", true]]);
  fixed = true;
  const sentBack = await idem("redrive", "--failed", "--scope", SCOPE, "--id", failures[0].id, "--json");
  assert.equal(sentBack.code, 0, sentBack.stderr);

  const second = await consumer.drain(process);
  assert.deepEqual(
    second,
    { read: 0, ran: 1, replayed: 0, failed: 0, archived: 0, dead_lettered: 0, left: 0, redriven: 1 },
    JSON.stringify(second),
  );
  assert.deepEqual(runs, [
    {
      fixed: false,
      message: { idempotency_key: key, payload: { amount: 5 } },
      attempt: undefined,
      payload: { amount: 5 },
    },
    // Run from the plane: no message (it was archived with its failure), the stored payload, its attempt.
    { fixed: true, message: undefined, attempt: 2, payload: { amount: 5 } },
  ]);
  const third = await consumer.drain(process);
  assert.deepEqual(counts(third, "read", "ran", "redriven"), { read: 0, ran: 0, redriven: 0 });
  assert.equal(runs.length, 2, "exactly once more");
  const read = await consumer.driver.plane.read({
    organizationId: org,
    scope: SCOPE,
    key,
    requestHash: await requestHash({ amount: 5 }),
  });
  assert.ok(read.outcome === "completed" && read.answer.ok, JSON.stringify(read));
  assert.deepEqual((await letters()).map((letter) => letter.idempotency_key), [key], "one dead letter, never a second");
  assert.deepEqual([...(await archived([msgId])).keys()], [msgId]);
});

Deno.test("plane path: a failing command sent twice, in two drains, is one dead letter", async () => {
  const downstream = vendor((payload) => payload.fail ?? 200);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: "plane" });
  await empty();
  try {
    const key = `refund-${crypto.randomUUID()}`;
    const ids = [await queues.send(QUEUE, { idempotency_key: key, payload: { fail: 422 } })];
    const first = await drain();
    assert.deepEqual(counts(first, "ran", "failed", "dead_lettered", "archived"), {
      ran: 1,
      failed: 1,
      dead_lettered: 1,
      archived: 1,
    });
    // The producer retries the command.
    ids.push(await queues.send(QUEUE, { idempotency_key: key, payload: { fail: 422 } }));
    const second = await drain();
    assert.deepEqual(
      second,
      { read: 1, ran: 0, replayed: 1, failed: 0, archived: 1, dead_lettered: 0, left: 0, redriven: 0 },
      JSON.stringify(second),
    );
    assert.deepEqual((await letters()).map((letter) => letter.idempotency_key), [key], "one letter for the command");
    assert.equal((await archived(ids)).size, 2, "both messages archived");
  } finally {
    await downstream.stop();
  }
});

Deno.test("plane path: a drain is two round trips, a take and a settle, and nothing through pgmq_public", async () => {
  const downstream = vendor((payload) => payload.fail ?? 200);
  const org = organization();
  const [planeCalls, queueCalls] = [new Lossy(), new Lossy()];
  const { queues, drain } = setup(org, downstream.url, {}, queueCalls.fetch, planeCalls.fetch);
  await empty();
  try {
    const key = uniqueKey("order");
    for (let n = 0; n < 4; n++) await queues.send(QUEUE, { idempotency_key: `${key}-${n}`, payload: { n } });
    await queues.send(QUEUE, { idempotency_key: `${key}-0`, payload: { n: 0 } });
    await queues.send(QUEUE, { idempotency_key: `${key}-fails`, payload: { fail: 422 } });
    await queues.send(QUEUE, { idempotency_key: `${key}-unknown`, payload: { fail: 503 } });
    queueCalls.calls.length = 0;
    const drained = await drain();
    assert.deepEqual(
      drained,
      { read: 7, ran: 6, replayed: 1, failed: 2, archived: 6, dead_lettered: 1, left: 1, redriven: 0 },
      JSON.stringify(drained),
    );
    assert.deepEqual(planeCalls.calls, ["idempotency_queue_take", "idempotency_queue_settle"]);
    assert.deepEqual(queueCalls.calls, []);
    planeCalls.calls.length = 0;
    assert.equal((await drain()).read, 0);
    assert.deepEqual(planeCalls.calls, ["idempotency_queue_take"], "nothing to settle, no settle");
  } finally {
    await downstream.stop();
    // The message left to its lease comes back after this test: it is not this test's to see.
    await empty();
  }
});

Deno.test("plane path: a heartbeat keeps a long effect's message hidden: another consumer draining meanwhile reads nothing", async () => {
  const org = organization();
  const calls = new Lossy();
  // A 4 s heartbeat lease: without the queue's heartbeat the message would
  // come back 5 s after the take, while the 9 s effect still runs.
  const beating = direct(org, {
    path: "plane",
    batchSize: 1,
    fetch: calls.fetch,
    timing: new Timing(20_000, 3_000, 2_000).withHeartbeats(4_000),
  });
  const other = direct(org, { path: "plane", batchSize: 5 });
  await empty();
  const msgId = await beating.queues.send(QUEUE, { idempotency_key: uniqueKey("long"), payload: { n: 1 } });
  let started = false;
  let stop: unknown;
  const long = beating.drain(async (_payload, { signal }) => {
    started = true;
    await new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, 9_000);
      signal.addEventListener("abort", () => {
        stop = signal.reason;
        clearTimeout(timer);
        resolve();
      }, { once: true });
    });
    return stop === undefined ? { journal: success("done") } : { unknown: String(stop) };
  });
  const meanwhile = { drains: 0, late: 0, read: 0, ran: 0 };
  while (!started) await sleep(20);
  // Without the queue's heartbeat the message would be visible again 5 s
  // after the take: drains from 6 s on would read it.
  const comesBackAt = performance.now() + 6_000;
  let done = false;
  long.then(() => done = true, () => done = true);
  while (!done) {
    const late = performance.now() >= comesBackAt;
    const drained = await other.drain(() => {
      throw new Error("the other consumer ran the held message");
    });
    meanwhile.drains += 1;
    if (late) meanwhile.late += 1;
    meanwhile.read += drained.read;
    meanwhile.ran += drained.ran;
    await sleep(250);
  }
  const drained = await long;
  assert.equal(stop, undefined, `the effect was stopped: ${String(stop)}`);
  assert.deepEqual(counts(drained, "read", "ran", "failed", "archived", "left"), {
    read: 1,
    ran: 1,
    failed: 0,
    archived: 1,
    left: 0,
  });
  assert.ok(
    meanwhile.late >= 2,
    `the other consumer drained ${meanwhile.late} of ${meanwhile.drains} times once the message could be back`,
  );
  assert.deepEqual({ read: meanwhile.read, ran: meanwhile.ran }, { read: 0, ran: 0 }, "it never saw the message");
  assert.deepEqual([...(await archived([msgId])).entries()], [[msgId, 1]], "archived, read once");
  const beats = calls.count("idempotency_queue_extend");
  assert.ok(beats >= 5, `${beats} heartbeats`);
  assert.equal(calls.count("idempotency_extend"), 0, "every beat kept the message hidden too");
});

Deno.test("plane path: a heartbeat that finds the claim taken over stops the effect; nothing of it is journaled, the message is left", async () => {
  const org = organization();
  const events: PlaneEvent[] = [];
  const worker = new QueueConsumer(
    new EffectDriver(IdempotencyPlane.connect({ url: URL_, key: KEY }), { log: (event) => events.push(event) }),
    Queues.connect({ url: URL_, key: KEY }),
    {
      queue: QUEUE,
      deadLetterQueue: DLQ,
      organizationId: org,
      timing: new Timing(20_000, 3_000, 2_000).withHeartbeats(3_000),
      batchSize: 1,
      path: "plane",
    },
  );
  await empty();
  const key = uniqueKey("taken");
  const msgId = await worker.queues.send(QUEUE, { idempotency_key: key, payload: { n: 1 } });
  const started = Promise.withResolvers<void>();
  let reason: unknown;
  const drain = worker.drain(async (_payload, { signal }) => {
    started.resolve();
    await new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, 15_000);
      signal.addEventListener("abort", () => {
        reason = signal.reason;
        clearTimeout(timer);
        resolve();
      }, { once: true });
    });
    return { journal: success("the first worker's late answer") };
  });
  await started.promise;
  // The lease passes (as a database clock step would move it) and another
  // worker takes the key over, in one transaction: no beat of the first
  // worker's lands in between.
  const rows = await superuserSql(
    `update agent.idempotency_keys set lease_expires_at = clock_timestamp() - interval '1 second'
      where organization_id = '${org}' and scope = '${SCOPE}' and key = '${key}';
     select outcome from agent.idempotency_claim(p_organization_id => '${org}', p_scope => '${SCOPE}',
       p_key => '${key}', p_request_hash => '${await requestHash({ n: 1 })}',
       p_lease_token => '${crypto.randomUUID()}', p_lease_ms => 60000)`,
  );
  assert.deepEqual(rows.at(-1), ["reclaimed"], JSON.stringify(rows));
  const drained = await drain;
  assert.ok(reason instanceof PlaneError && /taken over/.test(reason.message), String(reason));
  assert.deepEqual(counts(drained, "read", "ran", "failed", "archived", "left"), {
    read: 1,
    ran: 1,
    failed: 1,
    archived: 0,
    left: 1,
  });
  const settled = events.find((event) => event.event === "idempotency.settle");
  assert.equal(settled?.ending, "left_to_lease");
  assert.match(String(settled?.why), /fence_lost/);
  assert.equal((await archived([msgId])).size, 0, "not archived");
  const read = await worker.driver.plane.read({
    organizationId: org,
    scope: SCOPE,
    key,
    requestHash: await requestHash({ n: 1 }),
  });
  assert.equal(read.outcome, "processing", "the new holder's, nothing of the first worker's journaled");
  await empty();
});

Deno.test("both paths store an answer as the batch journal stores it: an output above the limit and one the store cannot hold read back alike", async () => {
  const answers = [success("x".repeat(70_000)), success({ text: "a\u0000b" })];
  const stored: Record<string, unknown[]> = {};
  for (const path of PATHS) {
    const org = organization();
    const consumer = direct(org, { path });
    await empty();
    const keys = answers.map(() => uniqueKey(path));
    for (const [n, key] of keys.entries()) await consumer.queues.send(QUEUE, { idempotency_key: key, payload: { n } });
    const drained = await consumer.drain((payload) => ({ journal: answers[(payload as { n: number }).n] }));
    assert.deepEqual(counts(drained, "ran", "failed", "archived"), { ran: 2, failed: 0, archived: 2 });
    stored[path] = await Promise.all(keys.map(async (key, n) => {
      const read = await consumer.driver.plane.read({
        organizationId: org,
        scope: SCOPE,
        key,
        requestHash: await requestHash({ n }),
      });
      assert.equal(read.outcome, "completed");
      return read.outcome === "completed" ? read.answer : undefined;
    }));
  }
  assert.deepEqual(stored.plane, stored.data_api);
  assert.ok(
    JSON.stringify(stored.plane[0]).includes('"$elided"'),
    "the output above the limit is a stand-in",
  );
  assert.deepEqual(stored.plane[1], answers[1], "the NUL is kept, as text");
});

Deno.test("plane path: a settle that cannot be sent leaves the batch: nothing journaled, nothing archived; it comes back and runs again", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const refused = new Set(["idempotency_queue_settle"]);
  const { queues, drain } = setup(org, downstream.url, {}, undefined, refusing(refused));
  await empty();
  try {
    const key = uniqueKey("order");
    const msgId = await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 1 } });
    const first = await drain();
    assert.deepEqual(counts(first, "read", "ran", "failed", "archived", "left"), {
      read: 1,
      ran: 1,
      failed: 1,
      archived: 0,
      left: 1,
    }, JSON.stringify(first));
    assert.equal((await archived([msgId])).size, 0, "not archived");
    const read = await IdempotencyPlane.connect({ url: URL_, key: KEY }).read({
      organizationId: org,
      scope: SCOPE,
      key,
      requestHash: await requestHash({ sku: 1 }),
    });
    assert.equal(read.outcome, "processing", "nothing journaled: the claim is left to its lease");
    refused.clear();
    await sleep(6_000);
    const second = await drain();
    assert.deepEqual(counts(second, "read", "ran", "archived", "left"), { read: 1, ran: 1, archived: 1, left: 0 });
    // Run again under the same vendor key, which the vendor applies once.
    assert.equal(downstream.effects.get(await vendorKey(org, SCOPE, key)), 2);
    assert.deepEqual([...(await archived([msgId])).keys()], [msgId]);
  } finally {
    await downstream.stop();
  }
});

Deno.test("auto path: a plane without its queue functions (PGRST202) is drained through pgmq_public from then on", async () => {
  const org = organization();
  // The take goes to a function this plane does not have: the real server answers PGRST202.
  const calls: string[] = [];
  const olderPlane: typeof fetch = (input, init) => {
    const url = String(input instanceof Request ? input.url : input);
    calls.push(functionOf(input));
    return fetch(
      url.replace(/\/rpc\/idempotency_queue_(take|settle|extend)$/, "/rpc/idempotency_queue_$1_absent"),
      init,
    );
  };
  const auto = direct(org, { fetch: olderPlane });
  const plane = direct(org, { path: "plane", fetch: olderPlane });
  await empty();
  await assert.rejects(plane.drain(() => ({ journal: success(1) })), (error) => {
    assert.ok(error instanceof PlaneError && error.code === "PGRST202", String(error));
    return true;
  });
  const key = uniqueKey("order");
  await auto.queues.send(QUEUE, { idempotency_key: key, payload: { n: 1 } });
  calls.length = 0;
  const first = await auto.drain(() => ({ journal: success(1) }));
  assert.deepEqual(counts(first, "read", "ran", "archived"), { read: 1, ran: 1, archived: 1 });
  assert.deepEqual(calls, ["idempotency_queue_take", "idempotency_claim_many", "idempotency_complete"]);
  calls.length = 0;
  await auto.queues.send(QUEUE, { idempotency_key: uniqueKey("order"), payload: { n: 2 } });
  const second = await auto.drain(() => ({ journal: success(2) }));
  assert.deepEqual(counts(second, "read", "ran", "archived"), { read: 1, ran: 1, archived: 1 });
  assert.deepEqual(calls, ["idempotency_claim_many", "idempotency_complete"], "the take is not tried again");
});

Deno.test("pgmq_public path: an archive that fails leaves the message; its next delivery replays the answer and archives it, the effect once", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const refused = new Set<string>();
  const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: "data_api" }, refusing(refused));
  await empty();
  try {
    const key = `order-${crypto.randomUUID()}`;
    await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 9 } });
    refused.add("archive");
    const first = await drain();
    assert.deepEqual(
      { ran: first.ran, archived: first.archived, left: first.left },
      { ran: 1, archived: 0, left: 1 },
      JSON.stringify(first),
    );
    refused.clear();
    await sleep(6_000);
    const second = await drain();
    assert.deepEqual(
      { read: second.read, ran: second.ran, replayed: second.replayed, archived: second.archived },
      { read: 1, ran: 0, replayed: 1, archived: 1 },
      JSON.stringify(second),
    );
    assert.equal(downstream.effects.get(await vendorKey(org, SCOPE, key)), 1, "one effect");
    assert.equal((await drain()).read, 0, "nothing left");
  } finally {
    await downstream.stop();
  }
});

Deno.test("pgmq_public path: a dead-letter send that fails leaves the message, never archived unseen; its next delivery dead-letters it once", async () => {
  const downstream = vendor((payload) => payload.fail ?? 200);
  const org = organization();
  const refused = new Set<string>();
  const { queues, drain } = setup(org, downstream.url, { QUEUE_PATH: "data_api" }, refusing(refused));
  await empty();
  try {
    const key = `refund-${crypto.randomUUID()}`;
    await queues.send(QUEUE, { idempotency_key: key, payload: { fail: 422 } });
    refused.add("send");
    const first = await drain();
    assert.deepEqual(
      { failed: first.failed, dead_lettered: first.dead_lettered, archived: first.archived, left: first.left },
      { failed: 1, dead_lettered: 0, archived: 0, left: 1 },
      JSON.stringify(first),
    );
    assert.equal((await letters()).length, 0, "nothing reached the dead-letter queue");
    refused.clear();
    await sleep(6_000);
    const second = await drain();
    assert.deepEqual(
      { replayed: second.replayed, dead_lettered: second.dead_lettered, archived: second.archived },
      { replayed: 1, dead_lettered: 1, archived: 1 },
      JSON.stringify(second),
    );
    const all = await letters();
    assert.equal(all.length, 1);
    assert.equal(all[0].idempotency_key, key);
    assert.equal(downstream.effects.size, 0);
    assert.equal((await drain()).read, 0, "nothing left");
  } finally {
    await downstream.stop();
  }
});

Deno.test("anything but POST / with the service key gets 401 and drains nothing", async () => {
  const { handler } = setup(organization(), "http://127.0.0.1:9/");
  for (
    const request of [
      new Request("http://fn/", { method: "POST" }),
      new Request("http://fn/", { method: "POST", headers: { authorization: "Bearer nope" } }),
      new Request("http://fn/", { method: "GET", headers: { authorization: `Bearer ${KEY}` } }),
      new Request("http://fn/other", { method: "POST", headers: { authorization: `Bearer ${KEY}` } }),
    ]
  ) {
    const answer = await handler(request);
    assert.equal(answer.status, 401, `${request.method} ${request.url}`);
    await answer.body?.cancel();
  }
});

Deno.test("the function as a process: the Supabase Cron recipe's request drains a batch", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const queues = Queues.connect({ url: URL_, key: KEY });
  await empty();
  const fn = await serve(
    Deno.execPath(),
    ["run", "--frozen", "--allow-net", "--allow-env", "queue-consumer/index.ts"],
    {
      IDEM_POSTGREST_URL: URL_,
      IDEM_SERVICE_KEY: KEY,
      PORT: "0",
      QUEUE_NAME: QUEUE,
      PROCESS_URL: downstream.url,
      ORGANIZATION_ID: org,
    },
  );
  try {
    await queues.send(QUEUE, { idempotency_key: `order-${crypto.randomUUID()}`, payload: { sku: 3 } });
    // The recipe's request, as pg_net would send it: its path and body, read
    // from the recipe; the key comes from Vault, never from the job's text.
    const recipe = await Deno.readTextFile("../../sql/recipes/pg_cron_queue_consumer.sql");
    const job = recipe.slice(recipe.indexOf("select cron.schedule("));
    assert.ok(!/sb_secret_\w|eyJ\w/.test(job), "no key in the job's text");
    assert.match(job, /'Bearer ' \|\| \(select decrypted_secret from vault\.decrypted_secrets/);
    const path = /'(\/functions\/v1\/queue-consumer)'/.exec(job)?.[1];
    const body = /body := '([^']+)'::jsonb/.exec(job)?.[1];
    assert.ok(path && body, job);
    const answer = await fetch(new URL(path, fn.url), {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${KEY}` },
      body,
    });
    const drained = await answer.json();
    assert.equal(answer.status, 200);
    assert.deepEqual({ read: drained.read, ran: drained.ran, archived: drained.archived }, {
      read: 1,
      ran: 1,
      archived: 1,
    });
    const refused = await fetch(fn.url, { method: "POST" });
    assert.equal(refused.status, 401);
    await refused.body?.cancel();
  } finally {
    await killHard(fn.child);
    await downstream.stop();
  }
});
