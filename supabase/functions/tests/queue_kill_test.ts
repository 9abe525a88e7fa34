// Exactly once under faults, with real pgmq. A producer puts 10,000 orders on
// the queue `kill_test`, 1,000 of them twice (a retrying producer: the same
// idempotency key and payload, a second message), and among them poison
// messages no client can read (a number beyond every double, messages that
// are not objects, a key that is not a string, another tenant's message).
// Four consumers, each a process of its own, two the example Edge Function
// (queue-consumer/index.ts) and two its Rust twin (examples/queue_consumer.rs,
// QUEUE_CONSUMER_BIN), drain it in batches (through the plane's queue
// functions, which `auto` picks on this plane) while the test kills one of
// them with SIGKILL at random moments (before a take, mid-effect, during a
// settle: wherever the kill lands) and starts a new one. Some orders fail for
// good downstream (422), some fail once (503) and then succeed. Once the
// queue is drained, the downstream is "fixed", the killing stops, and the
// failures are sent back with `idem redrive --failed --scope queue.kill_test
// --since <start>`: the consumers run each once more, from the plane.
//
// Every second, in one SQL statement (one snapshot):
// - every archived message's key is journaled in the plane (completed), but
//   a poison message (dead-lettered as malformed) and a failure the operator
//   sent back and that has not run again yet;
// - every key journaled has an archived message, but work re-driven from the
//   plane (a killed consumer's, or sent back) whose message is still in the
//   queue: it is archived when it comes back;
// - every failed command has exactly one dead letter, and no key has two;
// and each archived order was applied downstream by then.
// At the end:
// - every order's effect happened once at the downstream service (which
//   applies an Idempotency-Key once, as Stripe does, and counts every
//   request); an order none of whose messages was ever read twice reached
//   it once, however often the producer sent it (twice for an order that
//   failed once, by design); an order that failed for good reached it once
//   more after the fix, and was applied then;
// - every message is archived exactly once and the queue is empty;
// - the dead-letter queue holds one letter per failed order and one per
//   poison message, which carries the poison as its text.
// The counts are printed.

import assert from "node:assert/strict";
import { IdempotencyPlane, requestHash, vendorKey } from "../_shared/idempotency/mod.ts";
import { idem, KEY, killHard, serve, type Served, sleep, URL_ } from "./support.ts";

const QUEUE = "kill_test";
const DLQ = "kill_test_dlq";
const SCOPE = `queue.${QUEUE}`;
const ORDERS = Number(Deno.env.get("QUEUE_KILL_ORDERS") ?? 10_000);
const SENT_TWICE = Math.floor(ORDERS / 10);
const POISONS = Math.max(5, Math.floor(ORDERS / 100));
const CONSUMERS = 4;
const BATCH = 50;
/** Every 100th order fails for good (until the fix), every 50th fails once. */
const failsForGood = (n: number) => n % 100 === 7;
const failsOnce = (n: number) => n % 50 === 3;

/** A seeded generator (mulberry32), so a failing run can be read again from its seed. */
function generator(seed: number): () => number {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** SQL over a superuser connection to the database served (pgmq's tables, which the API does not show). */
async function sql(query: string): Promise<string[][]> {
  const url = Deno.env.get("IDEM_TEST_DATABASE_URL");
  if (!url) throw new Error("IDEM_TEST_DATABASE_URL is not set: run this through .ci/with-local-plane.sh");
  const output = await new Deno.Command("psql", {
    args: [url, "-X", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1", "-c", query],
    stdout: "piped",
    stderr: "piped",
  }).output();
  const text = new TextDecoder().decode(output.stdout);
  if (output.code !== 0) throw new Error(`psql failed: ${new TextDecoder().decode(output.stderr)}`);
  return text.split("\n").filter((line) => line !== "").map((line) => line.split("\t"));
}

/** The downstream service: applies each Idempotency-Key once (noting when), counts every request. */
function downstream(random: () => number) {
  const requests = new Map<string, number>();
  const appliedAt = new Map<string, number>();
  const state = { fixed: false };
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    const key = request.headers.get("idempotency-key") ?? "";
    const order = await request.json() as { n: number };
    const seen = (requests.get(key) ?? 0) + 1;
    requests.set(key, seen);
    await sleep(Math.floor(random() * 40));
    if (failsForGood(order.n) && !state.fixed) return new Response(null, { status: 422 });
    if (failsOnce(order.n) && seen === 1) return new Response(null, { status: 503 });
    if (!appliedAt.has(key)) appliedAt.set(key, Date.now());
    return new Response("{}", { status: 200 });
  });
  return { url: `http://127.0.0.1:${server.addr.port}/`, requests, appliedAt, state, close: () => server.shutdown() };
}

/** The poison messages, as JSON texts (JavaScript could not write the first kind), each with its own kind. */
function poisons(organizationId: string): string[] {
  const stranger = crypto.randomUUID();
  return Array.from({ length: POISONS }, (_, i) => {
    const key = JSON.stringify(`poison-${organizationId}-${i}`);
    switch (i % 5) {
      case 0:
        return `{"idempotency_key": ${key}, "payload": {"n": 1e400}}`;
      case 1:
        return JSON.stringify(`poison ${i}`);
      case 2:
        return `[${i}]`;
      case 3:
        return `{"idempotency_key": ${i}, "payload": {"n": ${i}}}`;
      default:
        return `{"idempotency_key": ${key}, "organization_id": "${stranger}", "payload": {"n": ${i}}}`;
    }
  });
}

/**
 * `pgmq_public.send_batch` of `messages` (JSON texts of objects: PostgREST
 * hands a jsonb[] its elements as text, so a string would lose its quotes),
 * or one `send` per message (`one`), as a producer in any language sends them.
 */
async function send(messages: string[], one = false): Promise<void> {
  const bodies = one
    ? messages.map((message) => ({ fn: "send", body: `{"queue_name": "${QUEUE}", "message": ${message}}`, n: 1 }))
    : [{
      fn: "send_batch",
      body: `{"queue_name": "${QUEUE}", "messages": [${messages.join(",")}]}`,
      n: messages.length,
    }];
  for (const { fn, body, n } of bodies) {
    const answer = await fetch(`${URL_}/rpc/${fn}`, {
      method: "POST",
      headers: {
        "Authorization": `Bearer ${KEY}`,
        "apikey": KEY,
        "Content-Type": "application/json",
        "Content-Profile": "pgmq_public",
      },
      body,
    });
    const ids = await answer.json();
    assert.ok(answer.status === 200 && Array.isArray(ids) && ids.length === n, JSON.stringify(ids));
  }
}

/**
 * What must hold in every snapshot, read in one statement: a row per
 * violation (none when all holds). See the top of this file.
 */
function invariants(organizationId: string): string {
  return `
    with malformed as (
      select (message -> 'dead_letter' ->> 'msg_id')::bigint as msg_id
        from pgmq.q_${DLQ}
       where message -> 'dead_letter' -> 'failure' ->> 'error' = 'malformed_message'
    ), messages as (
      -- Per key: whether a message of it is archived (poison aside), and whether one is still queued.
      select m.key, bool_or(m.archived) as archived, bool_or(not m.archived) as queued
        from (select a.message ->> 'idempotency_key' as key, true as archived
                from pgmq.a_${QUEUE} a
               where a.msg_id not in (select msg_id from malformed)
              union all
              select q.message ->> 'idempotency_key', false from pgmq.q_${QUEUE} q) m
       group by m.key
    ), keys as (
      select k.key, k.status, k.response -> 'ok' as ok, k.reclaims, k.replaced
        from agent.idempotency_keys k
       where k.organization_id = '${organizationId}' and k.scope = '${SCOPE}'
    ), letters as (
      select message ->> 'idempotency_key' as key, count(*) as n
        from pgmq.q_${DLQ}
       where message -> 'dead_letter' -> 'failure' ->> 'error' is distinct from 'malformed_message'
       group by 1
    )
    select 'archived, not journaled', coalesce(m.key, '(no key)')
      from messages m left join keys k on k.key = m.key
     where m.archived and k.status is distinct from 'completed' and k.replaced is null
    union all
    select 'journaled, nothing archived', k.key
      from keys k left join messages m on m.key = k.key
     where k.status = 'completed' and not coalesce(m.archived, false)
       and not (k.reclaims > 0 and coalesce(m.queued, false))
    union all
    select 'dead letters for one key', coalesce(l.key, '(no key)') || ': ' || l.n from letters l where l.n <> 1
    union all
    select 'a failure without its dead letter', k.key
      from keys k left join letters l on l.key = k.key
     where k.status = 'completed' and k.ok = 'false' and l.n is null`;
}

Deno.test(`${ORDERS} orders, ${SENT_TWICE} sent twice, ${POISONS} poison messages, ${CONSUMERS} consumers killed at random: each effect once`, async () => {
  const seed = Number(Deno.env.get("IDEM_RANDOM_SEED") ?? Math.floor(Math.random() * 2 ** 31));
  console.log(`queue kill test: seed ${seed} (IDEM_RANDOM_SEED=${seed} runs it again)`);
  const killerRandom = generator(seed ^ 0x4b111);
  const service = downstream(generator(seed ^ 0x5eed));
  const organizationId = crypto.randomUUID();
  const plane = IdempotencyPlane.connect({ url: URL_, key: KEY });
  const env = {
    IDEM_POSTGREST_URL: URL_,
    IDEM_SERVICE_KEY: KEY,
    IDEM_MAX_ROWS: Deno.env.get("IDEM_MAX_ROWS") ?? "1000",
    PORT: "0",
    QUEUE_NAME: QUEUE,
    DEAD_LETTER_QUEUE: DLQ,
    PROCESS_URL: service.url,
    ORGANIZATION_ID: organizationId,
    BATCH: String(BATCH),
    MAX_READS: "20",
    // A 5 s lease: a killed consumer's messages come back after 6 s.
    EFFECT_TIMEOUT_MS: "2000",
    JOURNAL_DEADLINE_MS: "2000",
    LEASE_MARGIN_MS: "1000",
  };
  const rust = Deno.env.get("QUEUE_CONSUMER_BIN");
  if (!rust) {
    throw new Error("QUEUE_CONSUMER_BIN is not set (tests/run.sh sets it: cargo build --example queue_consumer)");
  }
  // Even slots the Edge Function, odd ones the Rust consumer: both kinds are killed.
  const start = (slot: number) =>
    slot % 2 === 0
      ? serve(Deno.execPath(), ["run", "--frozen", "--allow-net", "--allow-env", "queue-consumer/index.ts"], env)
      : serve(rust, [], env);
  // The database's clock, for --since.
  const [[since]] = await sql(`select to_char(now() at time zone 'utc', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`);

  // The producer, through the Data API as a Supabase client sends:
  // send_batch, a few poison messages after each chunk of orders, the orders
  // sent twice again at the end.
  const key = (n: number) => `order-${organizationId}-${n}`;
  const order = (n: number) => JSON.stringify({ idempotency_key: key(n), payload: { n } });
  const all = Array.from({ length: ORDERS }, (_, n) => n);
  const twice = all.filter((n) => n % 10 === 1).slice(0, SENT_TWICE);
  const poisoned = poisons(organizationId);
  const orderChunks = [...chunks(all, 500), ...chunks(twice, 500)];
  const poisonChunks = chunks(poisoned, Math.ceil(poisoned.length / orderChunks.length));
  for (const [index, chunk] of orderChunks.entries()) {
    await send(chunk.map(order));
    if (poisonChunks[index]) await send(poisonChunks[index], true);
  }
  for (const chunk of poisonChunks.slice(orderChunks.length)) await send(chunk, true);
  const sent = ORDERS + twice.length + poisoned.length;
  const vendorKeyOf = new Map<string, string>();
  for (const n of all) vendorKeyOf.set(key(n), await vendorKey(organizationId, SCOPE, key(n)));
  const failed = all.filter(failsForGood);

  const counts = { drains: 0, kills: 0, rustKills: 0, unreachable: 0, ran: 0, replayed: 0, redriven: 0, snapshots: 0 };
  const slots: Served[] = [];
  for (let i = 0; i < CONSUMERS; i++) slots.push(await start(i));
  let running = true;
  let killing = true;
  const started = Date.now();
  // One snapshot: no violation of the invariants, and each archived order applied by then.
  const snapshot = async () => {
    counts.snapshots += 1;
    assert.deepEqual(await sql(invariants(organizationId)), [], "the invariants of the queue and the plane");
    const archivedKeys = await sql(
      `select distinct message->>'idempotency_key' from pgmq.a_${QUEUE} where message->>'idempotency_key' like 'order-%'`,
    );
    for (const [k] of archivedKeys) {
      const n = Number(k.slice(k.lastIndexOf("-") + 1));
      if (failsForGood(n)) continue;
      assert.ok(
        service.appliedAt.has(vendorKeyOf.get(k) ?? ""),
        `order ${n} was archived before its effect was applied`,
      );
    }
    return archivedKeys.length;
  };
  const requestsBeforeFix = new Map<number, number>();
  let sentBack = 0;
  try {
    const drivers = slots.map((_, slot) =>
      (async () => {
        while (running) {
          try {
            const answer = await fetch(slots[slot].url, {
              method: "POST",
              headers: { authorization: `Bearer ${KEY}` },
            });
            if (answer.status !== 200) {
              await answer.body?.cancel();
              continue;
            }
            const drained = await answer.json();
            counts.drains += 1;
            counts.ran += drained.ran;
            counts.replayed += drained.replayed;
            counts.redriven += drained.redriven;
            if (drained.read === 0 && drained.ran === 0) await sleep(200);
          } catch {
            counts.unreachable += 1;
            await sleep(50);
          }
        }
      })()
    );
    const killer = (async () => {
      while (killing) {
        await sleep(300 + Math.floor(killerRandom() * 1200));
        if (!killing) break;
        // A random consumer of each kind in turn: the Edge Function's, then a Rust one.
        const slot = 2 * Math.floor(killerRandom() * (CONSUMERS / 2)) + (counts.kills % 2);
        await killHard(slots[slot].child);
        counts.kills += 1;
        if (slot % 2 === 1) counts.rustKills += 1;
        slots[slot] = await start(slot);
      }
    })();
    // Every second, a snapshot; the first phase is done when every message
    // is archived and the queue empty.
    for (;;) {
      await sleep(1_000);
      const archivedKeys = await snapshot();
      const [[queued]] = await sql(`select count(*) from pgmq.q_${QUEUE}`);
      if (archivedKeys > 0 && Number(queued) === 0 && await archivedCount() >= sent) break;
      assert.ok(
        Date.now() - started < 600_000,
        `not drained in 10 minutes: ${archivedKeys} orders archived, ${queued} queued`,
      );
    }
    killing = false;
    await killer;

    // The fix: the downstream now takes the orders that failed for good, and
    // the operator sends their failures back; the consumers run each once more.
    for (const n of failed) requestsBeforeFix.set(n, service.requests.get(vendorKeyOf.get(key(n)) ?? "") ?? 0);
    service.state.fixed = true;
    const back = await idem(
      "redrive",
      "--failed",
      "--scope",
      SCOPE,
      "--org",
      organizationId,
      "--since",
      since,
      "--bound",
      "1000",
      "--json",
    );
    assert.equal(back.code, 0, back.stderr);
    sentBack = back.stdout.trim().split("\n").filter((line) => line !== "").length;
    assert.equal(sentBack, failed.length, "every failure sent back, and only them");
    const fixedAt = Date.now();
    for (;;) {
      await sleep(1_000);
      await snapshot();
      const [[pending]] = await sql(
        `select count(*) from agent.idempotency_keys where organization_id = '${organizationId}'
            and scope = '${SCOPE}' and (status <> 'completed' or response -> 'ok' <> 'true'::jsonb)`,
      );
      if (Number(pending) === 0) break;
      assert.ok(Date.now() - fixedAt < 120_000, `${pending} failures sent back did not run again in 2 minutes`);
    }
    running = false;
    await Promise.all(drivers);
    await snapshot();
  } finally {
    running = false;
    killing = false;
    for (const slot of slots) await killHard(slot.child);
    await service.close();
  }
  const seconds = (Date.now() - started) / 1000;

  // Every message archived exactly once, the queue empty.
  const archive = await sql(
    `select msg_id, message->>'idempotency_key', read_ct from pgmq.a_${QUEUE}`,
  );
  assert.equal(archive.length, sent, "every message archived");
  assert.equal(new Set(archive.map(([id]) => id)).size, sent, "each once");
  assert.deepEqual(await sql(`select count(*) from pgmq.q_${QUEUE}`), [["0"]]);

  // Every order's effect applied once, and never after its message was archived.
  const readTwice = new Set(archive.filter(([, , reads]) => Number(reads) > 1).map(([, k]) => k));
  let repeats = 0;
  for (const n of all) {
    const vendor = vendorKeyOf.get(key(n)) ?? "";
    const requests = service.requests.get(vendor) ?? 0;
    assert.ok(service.appliedAt.has(vendor), `order ${n} was applied`);
    if (failsForGood(n)) {
      assert.equal(requests, (requestsBeforeFix.get(n) ?? 0) + 1, `order ${n} ran once more after the fix`);
      continue;
    }
    const expected = failsOnce(n) ? 2 : 1;
    if (!readTwice.has(key(n))) {
      assert.equal(requests, expected, `order ${n}, never redelivered, reached the vendor ${requests} times`);
    }
    repeats += Math.max(0, requests - expected);
  }
  // The dead-letter queue: one letter per order that failed, one per poison.
  const letters = await sql(
    `select message->>'idempotency_key', message->'dead_letter'->'failure'->>'error',
            message->'dead_letter'->>'msg_id', message->'dead_letter'->>'message_text'
       from pgmq.q_${DLQ}`,
  );
  const orderLetters = letters.filter(([, error]) => error !== "malformed_message");
  assert.deepEqual(orderLetters.map(([k]) => k).sort(), failed.map(key).sort(), "one letter per failed order");
  const poisonLetters = letters.filter(([, error]) => error === "malformed_message");
  assert.equal(poisonLetters.length, poisoned.length, "one letter per poison message");
  assert.equal(new Set(poisonLetters.map(([, , msgId]) => msgId)).size, poisoned.length, "each poison once");
  assert.ok(poisonLetters.every(([, , , text]) => text !== ""), "each poison carried as its text");
  for (const n of failed) {
    const read = await plane.read({ organizationId, scope: SCOPE, key: key(n), requestHash: await requestHash({ n }) });
    assert.ok(read.outcome === "completed" && read.answer.ok, `order ${n}'s answer after the fix is journaled`);
  }
  assert.ok(counts.kills < 2 || counts.rustKills >= 1, "both kinds of consumer were killed");
  const deliveries = archive.reduce((sum, [, , reads]) => sum + Number(reads), 0);
  console.log(
    `queue kill test: ${sent} messages (${ORDERS} orders, ${twice.length} sent twice, ${poisoned.length} poison) ` +
      `in ${
        seconds.toFixed(0)
      } s, ${counts.kills} kills (${counts.rustKills} of Rust consumers), ${counts.drains} drains answered, ${deliveries} deliveries ` +
      `(${deliveries - sent} redeliveries), ${counts.ran} effects run (${counts.redriven} re-driven from the plane), ` +
      `${counts.replayed} replayed, ${readTwice.size} orders read more than once, ` +
      `${repeats} repeat requests absorbed by the vendor key, ${ORDERS - failed.length} orders applied once, ` +
      `${failed.length} failed for good (${orderLetters.length} dead letters), sent back and applied once after ` +
      `the fix (${sentBack} sent back), ${poisonLetters.length} poison messages dead-lettered, ` +
      `${counts.snapshots} snapshots checked, ${counts.unreachable} requests to a killed consumer`,
  );
});

async function archivedCount(): Promise<number> {
  return Number((await sql(`select count(*) from pgmq.a_${QUEUE}`))[0][0]);
}

function chunks<T>(items: T[], size: number): T[][] {
  return Array.from({ length: Math.ceil(items.length / size) }, (_, i) => items.slice(i * size, (i + 1) * size));
}
