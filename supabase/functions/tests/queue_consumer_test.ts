// The queue consumer (supabase/functions/queue-consumer/) against a real
// plane with real pgmq: `idem up --with-pgmq --queue consumer_test --queue
// consumer_test_dlq` (tests/run.sh asks for them). A message's effect
// happens once per idempotency key, however often pgmq delivers it and
// however often the producer sent it; a message is archived only once its
// answer is journaled; failures for good go to the dead-letter queue with
// their failure journaled.

import assert from "node:assert/strict";
import { consumer } from "../queue-consumer/index.ts";
import { type Drained, IdempotencyPlane, Queues, requestHash, vendorKey } from "../_shared/idempotency/mod.ts";
import { functionOf, KEY, killHard, organization, serve, sleep, URL_ } from "./support.ts";

const QUEUE = "consumer_test";
const DLQ = "consumer_test_dlq";

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
 * A fetch for the queue's Data API that refuses, before sending, every call
 * of a function named in `refused` (a connection refused): the call makes
 * nothing happen, however often the client tries it.
 */
function refusing(refused: Set<string>): typeof fetch {
  return (input, init) =>
    refused.has(functionOf(input))
      ? Promise.reject(new TypeError("error sending request: Connection refused (os error 111)"))
      : fetch(input, init);
}

function setup(org: string, processUrl: string, extra: Record<string, string> = {}, queueFetch?: typeof fetch) {
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
  const handler = consumer(IdempotencyPlane.connect({ url: URL_, key: KEY }), queues, (name) => env[name]);
  const drain = async (): Promise<Drained> => {
    const answer = await handler(
      new Request("http://fn/", { method: "POST", headers: { authorization: `Bearer ${KEY}` } }),
    );
    assert.equal(answer.status, 200);
    return await answer.json();
  };
  return { queues, handler, drain };
}

/** Drains the queue and the dead-letter queue empty, so each test starts clean. */
async function empty(queues: Queues): Promise<void> {
  for (const queue of [QUEUE, DLQ]) {
    for (;;) {
      const messages = await queues.read(queue, 60, 100);
      if (messages.length === 0) break;
      await Promise.all(messages.map((m) => queues.delete(queue, m.msgId)));
    }
  }
}

Deno.test("a message sent twice, and delivered again, has its effect once; both are archived", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url);
  await empty(queues);
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
    const scope = `queue.${QUEUE}`;
    assert.equal(downstream.effects.get(await vendorKey(org, scope, key)), 1, "one effect for the key");
    assert.equal([...downstream.effects.values()].reduce((a, b) => a + b, 0), 2, "and one for the keyless message");
    assert.equal((await drain()).read, 0, "nothing left");
  } finally {
    await downstream.stop();
  }
});

Deno.test("a failure for good goes to the dead-letter queue with its failure journaled", async () => {
  const downstream = vendor((payload) => payload.fail ?? 200);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url);
  await empty(queues);
  try {
    const key = `refund-${crypto.randomUUID()}`;
    await queues.send(QUEUE, { idempotency_key: key, payload: { fail: 422 } });
    await queues.send(QUEUE, "not an object");
    const drained = await drain();
    assert.deepEqual({ ran: drained.ran, failed: drained.failed, dead_lettered: drained.dead_lettered }, {
      ran: 1,
      failed: 1,
      dead_lettered: 2,
    });
    const letters = await queues.read(DLQ, 60, 10);
    assert.equal(letters.length, 2);
    const letter = letters.find((m) => (m.message as { idempotency_key?: string }).idempotency_key === key);
    const failure = (letter?.message as { dead_letter: { failure: { ok: boolean; error: string } } }).dead_letter;
    assert.deepEqual([failure.failure.ok, failure.failure.error], [false, "process_failed"]);
    const plane = IdempotencyPlane.connect({ url: URL_, key: KEY });
    const read = await plane.read({
      organizationId: org,
      scope: `queue.${QUEUE}`,
      key,
      requestHash: await requestHash({ fail: 422 }),
    });
    assert.ok(read.outcome === "completed" && !read.answer.ok, "the failure is journaled: a duplicate replays it");
    assert.equal(downstream.effects.size, 0);
  } finally {
    await downstream.stop();
  }
});

Deno.test("a message that keeps failing is left until max_reads, then dead-lettered as such", async () => {
  const downstream = vendor(() => 503);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url, { MAX_READS: "2" });
  await empty(queues);
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
    const [letter] = await queues.read(DLQ, 60, 10);
    const failure = (letter.message as { dead_letter: { failure: { error: string } } }).dead_letter.failure;
    assert.equal(failure.error, "dead_lettered");
  } finally {
    await downstream.stop();
  }
});

Deno.test("the same key with another payload is a conflict: dead-lettered, never run", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const { queues, drain } = setup(org, downstream.url);
  await empty(queues);
  try {
    const key = `order-${crypto.randomUUID()}`;
    await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 1 } });
    assert.equal((await drain()).archived, 1);
    await queues.send(QUEUE, { idempotency_key: key, payload: { sku: 2 } });
    const drained = await drain();
    assert.deepEqual({ ran: drained.ran, dead_lettered: drained.dead_lettered }, { ran: 0, dead_lettered: 1 });
    const [letter] = await queues.read(DLQ, 60, 10);
    assert.equal(
      (letter.message as { dead_letter: { failure: { error: string } } }).dead_letter.failure.error,
      "conflict",
    );
  } finally {
    await downstream.stop();
  }
});

Deno.test("an archive that fails leaves the message; its next delivery replays the answer and archives it, the effect once", async () => {
  const downstream = vendor(() => 200);
  const org = organization();
  const refused = new Set<string>();
  const { queues, drain } = setup(org, downstream.url, {}, refusing(refused));
  await empty(queues);
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
    assert.equal(downstream.effects.get(await vendorKey(org, `queue.${QUEUE}`, key)), 1, "one effect");
    assert.equal((await drain()).read, 0, "nothing left");
  } finally {
    await downstream.stop();
  }
});

Deno.test("a dead-letter send that fails leaves the message, never archived unseen; its next delivery dead-letters it once", async () => {
  const downstream = vendor((payload) => payload.fail ?? 200);
  const org = organization();
  const refused = new Set<string>();
  const { queues, drain } = setup(org, downstream.url, {}, refusing(refused));
  await empty(queues);
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
    assert.equal((await queues.read(DLQ, 60, 10)).length, 0, "nothing reached the dead-letter queue");
    refused.clear();
    await sleep(6_000);
    const second = await drain();
    assert.deepEqual(
      { replayed: second.replayed, dead_lettered: second.dead_lettered, archived: second.archived },
      { replayed: 1, dead_lettered: 1, archived: 1 },
      JSON.stringify(second),
    );
    const letters = await queues.read(DLQ, 60, 10);
    assert.equal(letters.length, 1);
    assert.equal((letters[0].message as { idempotency_key: string }).idempotency_key, key);
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
  await empty(queues);
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
