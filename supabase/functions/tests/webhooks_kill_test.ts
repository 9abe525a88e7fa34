// Real process deaths at scale. Each webhook receiver — the example Edge
// Function (webhooks/index.ts, under Deno) and the Rust gate
// (examples/webhook_gate.rs) — runs as a process of its own against the local
// plane. A vendor sends 100 signed events, each redelivered until ACKed and
// some once more after, while the test kills the receiver with SIGKILL at
// random moments (before a claim, mid-processing after the ACK, during the
// journal: wherever the kill lands) and starts a new one. Then the new one's
// re-drive route is asked, through `idem redrive`, until nothing is left.
//
// Every ACKed event must end processed to completion exactly once at the
// downstream service (it applies an Idempotency-Key once, as Stripe does, and
// counts every request), or journaled as `dead_lettered`; nothing is left
// processing. The counts are printed.

import assert from "node:assert/strict";
import { Webhook } from "standardwebhooks";
import { sha256HexOfBytes, vendorKey } from "../_shared/idempotency/mod.ts";
import { idemRedrive, KEY, killHard, plane, serve, type Served, sleep, URL_ } from "./support.ts";

const SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const signer = new Webhook(SECRET);
const SCOPE = "webhook.standard";
const EVENTS = 100;
/** Deliveries in flight at once, as a vendor's senders. */
const SENDERS = 8;
/** The receivers' heartbeat lease: a killed worker's events are re-drivable after it. */
const HEARTBEAT_LEASE_MS = 3_000;

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

/** The downstream service: applies each Idempotency-Key once, counts every request, answers after a random delay. */
function downstream(random: () => number) {
  const requests = new Map<string, number>();
  const applied = new Set<string>();
  const server = Deno.serve({ port: 0, hostname: "127.0.0.1", onListen() {} }, async (request) => {
    const key = request.headers.get("idempotency-key") ?? "";
    await request.arrayBuffer();
    requests.set(key, (requests.get(key) ?? 0) + 1);
    // The effect: applied under its key once, whatever the retries.
    applied.add(key);
    await sleep(Math.floor(random() * 500));
    return new Response("{}", { status: 200 });
  });
  return { url: `http://127.0.0.1:${server.addr.port}/`, requests, applied, close: () => server.shutdown() };
}

type Worker = Served;

/** Starts a receiver. */
async function start(command: string, args: string[], env: Record<string, string>): Promise<Worker> {
  return await serve(command, args, env);
}

async function kill(worker: Worker): Promise<void> {
  await killHard(worker.child);
}

/** The receivers under test: how to start each. */
function receivers(): { name: string; command: string; args: string[] }[] {
  const gate = Deno.env.get("WEBHOOK_GATE_BIN");
  if (!gate) throw new Error("WEBHOOK_GATE_BIN is not set: run the tests through tests/run.sh");
  return [
    {
      name: "Edge Function (Deno)",
      command: Deno.execPath(),
      args: ["run", "--frozen", "--allow-net", "--allow-env", "webhooks/index.ts"],
    },
    { name: "Rust gate", command: gate, args: [] },
  ];
}

/** `idem redrive --to <route> --json --bound 100`: the counts the route answered. */
async function redrive(route: string): Promise<Record<string, number>> {
  const pass = await idemRedrive(route, "--bound", "100");
  assert.ok(pass.code === 0 || pass.code === 3, `idem redrive exited ${pass.code}: ${pass.stderr}`);
  return JSON.parse(pass.stdout);
}

for (const receiver of receivers()) {
  Deno.test(`${receiver.name}: 100 events through SIGKILLs at random moments, each processed once or dead-lettered`, async () => {
    const seed = Number(Deno.env.get("IDEM_RANDOM_SEED") ?? Math.floor(Math.random() * 2 ** 31));
    console.log(`${receiver.name}: seed ${seed} (IDEM_RANDOM_SEED=${seed} runs it again)`);
    // The seed fixes every random choice (the timing of processes does not
    // replay): the senders', the killer's and the downstream's draw apart.
    const random = generator(seed);
    const killerRandom = generator(seed ^ 0x4b111);
    const service = downstream(generator(seed ^ 0x5eed));
    const organizationId = crypto.randomUUID();
    const env = {
      IDEM_POSTGREST_URL: URL_,
      IDEM_SERVICE_KEY: KEY,
      IDEM_MAX_ROWS: Deno.env.get("IDEM_MAX_ROWS") ?? "1000",
      PORT: "0",
      WEBHOOK_SECRET: SECRET,
      PROCESS_URL: service.url,
      ORGANIZATION_ID: organizationId,
      HEARTBEAT_LEASE_MS: String(HEARTBEAT_LEASE_MS),
    };
    const events = Array.from({ length: EVENTS }, (_, n) => {
      const id = `msg_${organizationId}_${n}`;
      return { id, body: JSON.stringify({ type: "invoice.paid", n }), acked: false };
    });
    const counts = { deliveries: 0, acks: 0, refused: 0, unreachable: 0, kills: 0, redriven: 0, passes: 0 };
    let current = await start(receiver.command, receiver.args, env);
    let killing = true;
    let killer: Promise<void> = Promise.resolve();
    try {
      // The killer: SIGKILL at a random moment, then a new worker.
      killer = (async () => {
        while (killing) {
          await sleep(150 + Math.floor(killerRandom() * 600));
          if (!killing) break;
          const dead = current;
          await kill(dead);
          counts.kills += 1;
          current = await start(receiver.command, receiver.args, env);
        }
      })();

      // The vendor: every event until ACKed (any 2xx), retrying anything else.
      const deliver = async (event: (typeof events)[number]) => {
        for (let attempt = 0; attempt < 200; attempt++) {
          const timestamp = new Date();
          const signature = signer.sign(event.id, timestamp, event.body);
          counts.deliveries += 1;
          try {
            const answer = await fetch(current.url, {
              method: "POST",
              headers: {
                "content-type": "application/json",
                "webhook-id": event.id,
                "webhook-timestamp": String(Math.floor(timestamp.getTime() / 1000)),
                "webhook-signature": signature,
              },
              body: event.body,
            });
            await answer.body?.cancel();
            if (answer.ok) {
              counts.acks += 1;
              return true;
            }
            counts.refused += 1;
          } catch {
            counts.unreachable += 1;
          }
          await sleep(50 + Math.floor(random() * 200));
        }
        return false;
      };
      const queue = [...events];
      await Promise.all(Array.from({ length: SENDERS }, async () => {
        for (let event = queue.shift(); event; event = queue.shift()) {
          event.acked = await deliver(event);
          // At least once: a vendor sometimes delivers an ACKed event again.
          if (random() < 0.3) await deliver(event);
        }
      }));
      killing = false;
      await killer;
      assert.deepEqual(events.filter((event) => !event.acked).map((event) => event.id), [], "every event was ACKed");

      // One worker is left; its re-drive route, asked by `idem redrive`,
      // carries on what the killed ones held, until nothing is processing.
      const reader = plane();
      const states = async () =>
        await Promise.all(events.map(async (event) => {
          const requestHash = await sha256HexOfBytes(new TextEncoder().encode(event.body));
          return await reader.read({ organizationId, scope: SCOPE, key: event.id, requestHash });
        }));
      let read = await states();
      for (let pass = 0; pass < 60 && read.some((state) => state.outcome !== "completed"); pass++) {
        await sleep(500);
        const report = await redrive(`${current.url}/redrive`);
        counts.redriven += report.redriven;
        counts.passes += 1;
        read = await states();
      }

      // Every event is journaled: processed (ok) or a dead letter; nothing else.
      const left = read.flatMap((state, n) =>
        state.outcome === "completed" ? [] : [`${events[n].id}: ${state.outcome}`]
      );
      assert.deepEqual(left, [], "nothing is left processing");
      let processed = 0;
      let deadLettered = 0;
      for (const [n, state] of read.entries()) {
        if (state.outcome !== "completed") continue;
        const key = await vendorKey(organizationId, SCOPE, events[n].id);
        if (state.answer.ok) {
          processed += 1;
          assert.ok(service.applied.has(key), `${events[n].id}: processed, so applied downstream`);
          continue;
        }
        assert.equal(state.answer.error, "dead_lettered", `${events[n].id}: ${JSON.stringify(state.answer)}`);
        deadLettered += 1;
      }
      // At the downstream service: one effect per processed event, under one
      // key each; a dead letter's effect may or may not have happened once.
      // Every effect downstream is one of these events', under its own key.
      const eventKeys = new Set(await Promise.all(events.map((event) => vendorKey(organizationId, SCOPE, event.id))));
      const keys = [...service.applied];
      assert.deepEqual(keys.filter((key) => !eventKeys.has(key)), [], "no effect under any other key");
      const requests = [...service.requests.values()].reduce((a, b) => a + b, 0);
      console.log(
        `${receiver.name}: ${EVENTS} events, ${counts.deliveries} deliveries (${counts.acks} ACKed, ` +
          `${counts.refused} refused, ${counts.unreachable} unreachable), ${counts.kills} kills, ` +
          `${counts.redriven} re-driven in ${counts.passes} passes; ${processed} processed once, ` +
          `${deadLettered} dead-lettered; downstream: ${keys.length} effects from ${requests} requests ` +
          `(${requests - keys.length} repeats absorbed by the vendor key)`,
      );
      assert.equal(processed + deadLettered, EVENTS);
    } finally {
      killing = false;
      await killer.catch(() => {});
      await kill(current);
      await service.close();
    }
  });
}
