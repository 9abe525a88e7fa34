// Exactly once under faults, with real pgmq. A producer puts 10,000 orders on
// the queue `kill_test`, 1,000 of them twice (a retrying producer: the same
// idempotency key and payload, a second message). Four consumers, each the
// example Edge Function (queue-consumer/index.ts) as a process of its own,
// drain it in batches while the test kills one of them with SIGKILL at
// random moments (before a read, mid-effect, between the journal and the
// archive: wherever the kill lands) and starts a new one. Some orders fail
// for good downstream (422), some fail once (503) and then succeed.
//
// At the end:
// - every order's effect happened once at the downstream service (which
//   applies an Idempotency-Key once, as Stripe does, and counts every
//   request); an order none of whose messages was ever read twice reached
//   it once, however often the producer sent it (twice for an order that
//   failed once, by design);
// - no message was archived before its order's effect was applied and its
//   answer journaled: every second the test reads, in one snapshot, the
//   archive and the plane's claims (each archived message's claim must be
//   journaled), then checks that each archived order was applied by then
//   (and an archive before the effect followed by a kill would leave the
//   order never applied, which the end catches);
// - every message is archived exactly once and the queue is empty;
// - every order that failed for good is in the dead-letter queue, with its
//   failure journaled in the plane.
// The counts are printed.

import assert from "node:assert/strict";
import { IdempotencyPlane, Queues, requestHash, vendorKey } from "../_shared/idempotency/mod.ts";
import { KEY, killHard, serve, type Served, sleep, URL_ } from "./support.ts";

const QUEUE = "kill_test";
const DLQ = "kill_test_dlq";
const ORDERS = Number(Deno.env.get("QUEUE_KILL_ORDERS") ?? 10_000);
const SENT_TWICE = Math.floor(ORDERS / 10);
const CONSUMERS = 4;
const BATCH = 50;
/** Every 100th order fails for good, every 50th fails once. */
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
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    const key = request.headers.get("idempotency-key") ?? "";
    const order = await request.json() as { n: number };
    const seen = (requests.get(key) ?? 0) + 1;
    requests.set(key, seen);
    await sleep(Math.floor(random() * 40));
    if (failsForGood(order.n)) return new Response(null, { status: 422 });
    if (failsOnce(order.n) && seen === 1) return new Response(null, { status: 503 });
    if (!appliedAt.has(key)) appliedAt.set(key, Date.now());
    return new Response("{}", { status: 200 });
  });
  return { url: `http://127.0.0.1:${server.addr.port}/`, requests, appliedAt, close: () => server.shutdown() };
}

Deno.test(`${ORDERS} orders, ${SENT_TWICE} sent twice, ${CONSUMERS} consumers killed at random: each effect once`, async () => {
  const seed = Number(Deno.env.get("IDEM_RANDOM_SEED") ?? Math.floor(Math.random() * 2 ** 31));
  console.log(`queue kill test: seed ${seed} (IDEM_RANDOM_SEED=${seed} runs it again)`);
  const killerRandom = generator(seed ^ 0x4b111);
  const service = downstream(generator(seed ^ 0x5eed));
  const organizationId = crypto.randomUUID();
  const queues = Queues.connect({ url: URL_, key: KEY });
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
  const command = Deno.execPath();
  const args = ["run", "--frozen", "--allow-net", "--allow-env", "queue-consumer/index.ts"];

  // The producer, through the Data API as a Supabase client sends:
  // send_batch, the orders sent twice again at the end.
  const key = (n: number) => `order-${organizationId}-${n}`;
  const order = (n: number) => ({ idempotency_key: key(n), payload: { n } });
  const all = Array.from({ length: ORDERS }, (_, n) => n);
  const twice = all.filter((n) => n % 10 === 1).slice(0, SENT_TWICE);
  for (const chunk of [...chunks(all, 500), ...chunks(twice, 500)]) {
    const ids = await queues.client.rpc("send_batch", { queue_name: QUEUE, messages: chunk.map(order) });
    assert.ok(Array.isArray(ids) && ids.length === chunk.length, "send_batch answered an id per message");
  }
  const sent = ORDERS + twice.length;
  const vendorKeyOf = new Map<string, string>();
  for (const n of all) vendorKeyOf.set(key(n), await vendorKey(organizationId, `queue.${QUEUE}`, key(n)));

  const counts = { drains: 0, kills: 0, unreachable: 0, ran: 0, replayed: 0 };
  const slots: Served[] = [];
  for (let i = 0; i < CONSUMERS; i++) slots.push(await serve(command, args, env));
  let running = true;
  const started = Date.now();
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
            if (drained.read === 0) await sleep(200);
          } catch {
            counts.unreachable += 1;
            await sleep(50);
          }
        }
      })()
    );
    const killer = (async () => {
      while (running) {
        await sleep(300 + Math.floor(killerRandom() * 1200));
        if (!running) break;
        const slot = Math.floor(killerRandom() * CONSUMERS);
        await killHard(slots[slot].child);
        counts.kills += 1;
        slots[slot] = await serve(command, args, env);
      }
    })();
    // Every second: each message archived so far must have had its order's
    // effect applied (checked after the archive is read, so an archive that
    // came before its effect is caught while the effect is missing), and
    // the run is done when every message is archived and the queue empty.
    for (;;) {
      await sleep(1_000);
      // In one snapshot: no archived message whose claim is not journaled
      // (an archive that came before its journal would show here).
      const unjournaled = await sql(
        `select a.msg_id, a.message->>'idempotency_key' from pgmq.a_${QUEUE} a
           left join agent.idempotency_keys k
             on k.organization_id = '${organizationId}' and k.scope = 'queue.${QUEUE}'
            and k.key = a.message->>'idempotency_key'
          where k.status is distinct from 'completed'`,
      );
      assert.deepEqual(unjournaled, [], "messages archived before their answer was journaled");
      const archivedKeys = await sql(`select distinct message->>'idempotency_key' from pgmq.a_${QUEUE}`);
      for (const [k] of archivedKeys) {
        const n = Number(k.slice(k.lastIndexOf("-") + 1));
        if (failsForGood(n)) continue;
        assert.ok(
          service.appliedAt.has(vendorKeyOf.get(k) ?? ""),
          `order ${n} was archived before its effect was applied`,
        );
      }
      const [[queued]] = await sql(`select count(*) from pgmq.q_${QUEUE}`);
      if (archivedKeys.length > 0 && Number(queued) === 0 && await archivedCount() >= sent) break;
      assert.ok(
        Date.now() - started < 600_000,
        `not drained in 10 minutes: ${archivedKeys.length} orders archived, ${queued} queued`,
      );
    }
    running = false;
    await killer;
    await Promise.all(drivers);
  } finally {
    running = false;
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
    if (failsForGood(n)) {
      assert.ok(!service.appliedAt.has(vendor), `order ${n} fails for good`);
      continue;
    }
    assert.ok(service.appliedAt.has(vendor), `order ${n} was applied`);
    const expected = failsOnce(n) ? 2 : 1;
    if (!readTwice.has(key(n))) {
      assert.equal(requests, expected, `order ${n}, never redelivered, reached the vendor ${requests} times`);
    }
    repeats += Math.max(0, requests - expected);
  }
  // Orders that failed for good: in the dead-letter queue, their failure journaled.
  const letters = await sql(`select distinct message->>'idempotency_key' from pgmq.q_${DLQ}`);
  const failed = all.filter(failsForGood);
  assert.deepEqual(letters.map(([k]) => k).sort(), failed.map(key).sort(), "the dead-letter queue holds exactly them");
  for (const n of failed) {
    const read = await plane.read({
      organizationId,
      scope: `queue.${QUEUE}`,
      key: key(n),
      requestHash: await requestHash({ n }),
    });
    assert.ok(read.outcome === "completed" && !read.answer.ok, `order ${n}'s failure is journaled`);
  }
  const deliveries = archive.reduce((sum, [, , reads]) => sum + Number(reads), 0);
  const dlqRows = Number((await sql(`select count(*) from pgmq.q_${DLQ}`))[0][0]);
  console.log(
    `queue kill test: ${sent} messages (${ORDERS} orders, ${twice.length} sent twice) in ${seconds.toFixed(0)} s, ` +
      `${counts.kills} kills, ${counts.drains} drains answered, ${deliveries} deliveries (${
        deliveries - sent
      } redeliveries), ` +
      `${counts.ran} effects run, ${counts.replayed} replayed, ${readTwice.size} orders read more than once, ` +
      `${repeats} repeat requests absorbed by the vendor key, ${ORDERS - failed.length} orders applied once, ` +
      `${failed.length} dead-lettered (${dlqRows} dead letters), ${counts.unreachable} requests to a killed consumer`,
  );
});

async function archivedCount(): Promise<number> {
  return Number((await sql(`select count(*) from pgmq.a_${QUEUE}`))[0][0]);
}

function chunks<T>(items: T[], size: number): T[][] {
  return Array.from({ length: Math.ceil(items.length / size) }, (_, i) => items.slice(i * size, (i + 1) * size));
}
