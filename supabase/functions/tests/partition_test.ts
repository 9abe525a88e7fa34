// A worker cut off from the plane mid-effect, by a real partition: worker A
// reaches the plane through a TCP proxy that stops forwarding one second into
// the effect (PartitionProxy: connections held open, unanswered), with a 3 s
// heartbeat lease and a long timeout; worker B reaches the plane directly and
// keeps trying the same key until it takes it over and runs its effect. A's
// effect must be told to stop (its signal aborted) before B's starts, A's
// ending must be left to its lease with nothing of its own journaled, and the
// key's answer must be B's. One test per caller that takes heartbeats:
// `idempotent()`, the tool guard, the Idempotency-Key middleware, the
// webhook gate and the queue consumer (on its own queue, partition_test,
// which tests/run.sh asks `idem up` for).
//
// Only the order is asserted, which the design guarantees: A stops at its
// confirmed lease end less a second, measured from before the request that
// confirmed it was sent, and the database's lease (which B must outlast)
// ends at least that second later.

import assert from "node:assert/strict";
import {
  type Drained,
  EffectDriver,
  IdempotencyPlane,
  idempotent,
  PlaneError,
  type PlaneEvent,
  QueueConsumer,
  Queues,
  RetryHorizon,
  sha256HexOfBytes,
  silent,
  success,
  Timing,
  ToolError,
  ToolGuard,
  toolKey,
  toolSpec,
  WebhookGate,
  withIdempotencyKey,
} from "../_shared/idempotency/mod.ts";
import { hashOf, KEY, organization, PartitionProxy, plane, sleep, uniqueKey, URL_, within } from "./support.ts";

const HEARTBEAT_LEASE_MS = 3_000;
/** How far into A's effect the proxy stops forwarding. */
const PARTITION_AFTER_MS = 1_000;
/** A's timeout: far beyond everything else, so only the heartbeat can stop it in time. */
const LONG_TIMEOUT_MS = 20_000;
/** The bound on every wait of these tests (never a wait itself: each ends when its promise does). */
const GIVE_UP_MS = 30_000;
/** How often worker B tries the key again. */
const RETRY_EVERY_MS = 100;

/** What the two workers did, on the monotonic clock. */
class Timeline {
  readonly #aStarted = Promise.withResolvers<void>();
  /** When A's effect started. */
  readonly aStarted: Promise<void> = this.#aStarted.promise;
  /** When A's signal aborted, and why. */
  aAborted?: number;
  aReason?: unknown;
  /** When B's effect started, and whether A's signal had aborted by then. */
  bStarted?: number;
  aAbortedWhenBStarted?: boolean;
  bRuns = 0;

  /** A's effect: starts, then waits for its signal and answers `late` after it (a value never to be journaled). */
  async a<T>(signal: AbortSignal, late: T): Promise<T> {
    this.#aStarted.resolve();
    await new Promise<void>((resolve) => {
      signal.addEventListener("abort", () => {
        this.aAborted = performance.now();
        this.aReason = signal.reason;
        resolve();
      }, { once: true });
    });
    return late;
  }

  /** B's effect starts. */
  b(): void {
    this.bRuns += 1;
    this.bStarted ??= performance.now();
    this.aAbortedWhenBStarted ??= this.aAborted !== undefined;
  }

  /** A was told to stop, by a lease it could not confirm, before B started. */
  check(): void {
    assert.equal(this.bRuns, 1, "B ran its effect once");
    assert.equal(this.aAbortedWhenBStarted, true, "A's signal had aborted when B's effect started");
    assert.ok(
      this.aAborted !== undefined && this.bStarted !== undefined && this.aAborted < this.bStarted,
      `A aborted at ${this.aAborted}, B started at ${this.bStarted}`,
    );
    assert.ok(this.aReason instanceof PlaneError, `A's abort reason: ${String(this.aReason)}`);
    assert.equal(this.aReason.kind, "lease_lapsed");
    assert.match(this.aReason.message, /could not be confirmed/);
  }
}

/** Runs `body` with a fresh proxy, worker A's plane through it, and a timeline; closes the proxy after. */
async function partitioned(
  body: (setup: { proxy: PartitionProxy; proxied: IdempotencyPlane; timeline: Timeline }) => Promise<void>,
): Promise<void> {
  const proxy = new PartitionProxy();
  try {
    const proxied = IdempotencyPlane.connect({ url: proxy.url, key: KEY });
    await body({ proxy, proxied, timeline: new Timeline() });
  } finally {
    await proxy.close();
  }
}

/** Waits for A's effect to start, then partitions A's plane `PARTITION_AFTER_MS` later. */
async function partitionMidEffect(proxy: PartitionProxy, timeline: Timeline): Promise<void> {
  await within("worker A's effect starting", timeline.aStarted, GIVE_UP_MS);
  await sleep(PARTITION_AFTER_MS);
  proxy.partition();
}

/** Worker B: `attempt` again every `RETRY_EVERY_MS` until it answers something (it took the key over). */
async function takeOver<T>(what: string, attempt: () => Promise<T | undefined>): Promise<T> {
  const until = performance.now() + GIVE_UP_MS;
  while (performance.now() < until) {
    const answered = await attempt();
    if (answered !== undefined) return answered;
    await sleep(RETRY_EVERY_MS);
  }
  throw new Error(`${what} did not take the key over within ${GIVE_UP_MS} ms`);
}

/** A logger that keeps every event. */
function kept(): { log: (event: PlaneEvent) => void; events: PlaneEvent[] } {
  const events: PlaneEvent[] = [];
  return { log: (event) => events.push(event), events };
}

/** The unconfirmed lease was logged, by scope and key, and no lease token was. */
function assertLogged(events: PlaneEvent[], key: string): void {
  const logged = events.find((event) => event.event === "idempotency.lease_unconfirmed");
  assert.ok(logged, JSON.stringify(events.map((event) => event.event)));
  assert.equal(logged.level, "warn");
  assert.equal(logged.key, key);
  assert.ok(!("lease_token" in logged) && !("leaseToken" in logged), JSON.stringify(logged));
  assert.ok(events.some((event) => event.event === "idempotency.heartbeat_failed"), "the beats failed first");
}

Deno.test("partition: idempotent() stops its effect before another worker takes the key over, and journals nothing", async () => {
  await partitioned(async ({ proxy, proxied, timeline }) => {
    const { log, events } = kept();
    const base = {
      organizationId: organization(),
      scope: "tool.email.send",
      key: uniqueKey("partition"),
      request: { to: "a@example.com" },
    };
    const a = idempotent((context) => timeline.a(context.signal, success("A's late answer")), {
      ...base,
      plane: proxied,
      timeoutMs: LONG_TIMEOUT_MS,
      heartbeatLeaseMs: HEARTBEAT_LEASE_MS,
      log,
    });
    await partitionMidEffect(proxy, timeline);
    const b = await takeOver("worker B's idempotent()", async () => {
      const result = await idempotent(() => (timeline.b(), success("B's answer")), {
        ...base,
        plane: plane(),
        timeoutMs: 5_000,
        log: silent,
      });
      return result.status === "in_flight" ? undefined : result;
    });
    assert.equal(b.status, "ran");
    if (b.status !== "ran") return;
    assert.equal(b.settled.ending, "journaled");
    timeline.check();

    const first = await within("worker A's idempotent()", a, GIVE_UP_MS);
    assert.equal(first.status, "failed");
    if (first.status !== "failed") return;
    assert.equal(first.why, "lease_unconfirmed");
    assert.equal(first.settled.ending, "left_to_lease");
    assert.ok(first.error instanceof PlaneError && first.error.kind === "lease_lapsed", String(first.error));
    assertLogged(events, base.key);
    const stored = await plane().read({ ...base, requestHash: await hashOf(base.request) });
    assert.equal(stored.outcome, "completed");
    if (stored.outcome !== "completed") return;
    assert.deepEqual(stored.answer.output, "B's answer", "the key's answer is B's");
  });
});

Deno.test("partition: the tool guard stops its tool before another worker takes the call over, and raises in_flight", async () => {
  await partitioned(async ({ proxy, proxied, timeline }) => {
    const { log, events } = kept();
    const call = {
      organizationId: organization(),
      spec: toolSpec("tool.email.send", LONG_TIMEOUT_MS, "vendor_key"),
      key: toolKey(crypto.randomUUID(), "send-welcome"),
      arguments: { to: "a@example.com" },
    };
    const horizon = RetryHorizon.untilLastAttempt(60 * 60_000);
    const guardA = new ToolGuard(proxied, { horizon, heartbeatLeaseMs: HEARTBEAT_LEASE_MS, log });
    const a = guardA.run({ ...call, tool: (context) => timeline.a(context.signal, success("A's late answer")) })
      .then(() => undefined, (error: unknown) => error);
    await partitionMidEffect(proxy, timeline);
    const guardB = new ToolGuard(plane(), { horizon, log: silent });
    const b = await takeOver("worker B's tool guard", async () => {
      try {
        return await guardB.run({ ...call, tool: () => (timeline.b(), success("B's answer")) });
      } catch (error) {
        if (error instanceof ToolError && error.kind === "in_flight") return undefined;
        throw error;
      }
    });
    assert.equal(b.status, "executed");
    timeline.check();

    const raised = await within("worker A's tool guard", a, GIVE_UP_MS);
    assert.ok(raised instanceof ToolError, String(raised));
    assert.equal(raised.kind, "in_flight");
    assert.match(raised.message, /could not be confirmed/);
    assert.equal(raised.settled?.ending, "left_to_lease");
    assertLogged(events, call.key);
    const stored = await plane().read({
      organizationId: call.organizationId,
      scope: call.spec.scope,
      key: call.key,
      requestHash: await hashOf(call.arguments),
    });
    assert.equal(stored.outcome, "completed");
    if (stored.outcome !== "completed") return;
    assert.deepEqual(stored.answer.output, "B's answer", "the call's answer is B's");
  });
});

Deno.test("partition: the Idempotency-Key middleware stops its handler before another worker takes the key over, and answers 503", async () => {
  await partitioned(async ({ proxy, proxied, timeline }) => {
    const { log, events } = kept();
    const organizationId = organization();
    const key = crypto.randomUUID();
    const options = { organizationId, sharedAcrossCallers: true as const, route: "/orders" };
    const request = () =>
      new Request("http://orders.test/orders", {
        method: "POST",
        headers: { "content-type": "application/json", "idempotency-key": key },
        body: '{"sku":"A","qty":1}',
      });
    const serveA = withIdempotencyKey(async (req) => {
      await timeline.a(req.signal, undefined);
      return Response.json({ by: "A" }, { status: 201 });
    }, { ...options, plane: proxied, handlerTimeoutMs: LONG_TIMEOUT_MS, heartbeatLeaseMs: HEARTBEAT_LEASE_MS, log });
    const a = serveA(request());
    await partitionMidEffect(proxy, timeline);
    const serveB = withIdempotencyKey(() => {
      timeline.b();
      return Response.json({ by: "B" }, { status: 201 });
    }, { ...options, plane: plane(), handlerTimeoutMs: 5_000, log: silent });
    const b = await takeOver("worker B's middleware", async () => {
      const response = await serveB(request());
      if (response.status !== 409) return response;
      await response.body?.cancel();
      return undefined;
    });
    assert.equal(b.status, 201);
    assert.deepEqual(await b.json(), { by: "B" });
    timeline.check();

    const first = await within("worker A's middleware", a, GIVE_UP_MS);
    assert.equal(first.status, 503);
    assert.equal(first.headers.get("retry-after"), "5");
    const problem = await first.json();
    assert.match(problem.type, /unavailable/);
    assert.ok(
      events.some((event) => event.event === "idempotency.http" && event.outcome === "lease_unconfirmed"),
      JSON.stringify(events.map((event) => [event.event, event.outcome])),
    );
    assertLogged(events, key);
    const replay = await serveB(request());
    assert.equal(replay.headers.get("idempotent-replayed"), "true");
    assert.deepEqual(await replay.json(), { by: "B" }, "every repeat gets B's answer");
  });
});

Deno.test("partition: the webhook gate stops processing before a re-drive takes the event over, and journals nothing of its own", async () => {
  await partitioned(async ({ proxy, proxied, timeline }) => {
    const { log, events } = kept();
    const organizationId = organization();
    const deliveryId = uniqueKey("evt");
    const body = new TextEncoder().encode('{"event":"partitioned"}');
    let carried: Promise<unknown> | undefined;
    const gateA = new WebhookGate(proxied, {
      deadlineMs: 500,
      processingTimeoutMs: LONG_TIMEOUT_MS,
      heartbeatLeaseMs: HEARTBEAT_LEASE_MS,
      closeOnBeforeUnload: false,
      waitUntil: (work) => (carried = work),
      log,
    });
    const ack = gateA.handle(
      { organizationId, scope: "webhook.stripe", deliveryId, body },
      (signal) => timeline.a(signal, { by: "A" }),
    );
    await partitionMidEffect(proxy, timeline);
    assert.deepEqual(await ack, { ack: "accepted", status: 200 }, "answered at the gate's deadline, still processing");
    const gateB = new WebhookGate(plane(), { closeOnBeforeUnload: false, log: silent });
    const report = await takeOver("worker B's re-drive", async () => {
      const report = await gateB.redrive({ scope: "webhook.*", limit: 10, organizationId }, () => {
        timeline.b();
        return Promise.resolve({ by: "B" });
      });
      return report.redriven > 0 ? report : undefined;
    });
    assert.deepEqual(report, { redriven: 1, journaled: 1, deadLettered: 0, left: 0 });
    timeline.check();

    assert.ok(carried, "the gate handed its work to waitUntil");
    await within("worker A's processing to end", carried, GIVE_UP_MS);
    const cut = events.find((event) => event.event === "webhook.processing_cut");
    assert.ok(cut, JSON.stringify(events.map((event) => event.event)));
    assert.match(String(cut.why), /could not be confirmed/);
    const settled = events.find((event) => event.event === "idempotency.settle");
    assert.equal(settled?.ending, "left_to_lease");
    assertLogged(events, deliveryId);
    const stored = await plane().read({
      organizationId,
      scope: "webhook.stripe",
      key: deliveryId,
      requestHash: await sha256HexOfBytes(body),
    });
    assert.equal(stored.outcome, "completed");
    if (stored.outcome !== "completed") return;
    assert.deepEqual(stored.answer.output, { by: "B" }, "the event's answer is B's");
  });
});

for (const path of ["plane", "data_api"] as const) {
  Deno.test(`partition (${path} path): the queue consumer stops a message's effect before another consumer takes it over, and leaves it`, async () => {
    const queue = "partition_test";
    const deadLetterQueue = "partition_test_dlq";
    const direct = Queues.connect({ url: URL_, key: KEY });
    for (const name of [queue, deadLetterQueue]) {
      for (const message of await direct.read(name, 60, 100)) await direct.delete(name, message.msgId);
    }
    await partitioned(async ({ proxy, proxied, timeline }) => {
      const { log, events } = kept();
      const organizationId = organization();
      const key = uniqueKey("msg");
      await direct.send(queue, { idempotency_key: key, payload: { to: "a@example.com" } });
      // Worker A reaches the plane and the queue through the proxy; on the
      // plane's path its heartbeats also keep the message hidden.
      const consumerA = new QueueConsumer(
        new EffectDriver(proxied, { log }),
        Queues.connect({ url: proxy.url, key: KEY }),
        {
          queue,
          deadLetterQueue,
          organizationId,
          timing: new Timing(LONG_TIMEOUT_MS).withHeartbeats(HEARTBEAT_LEASE_MS),
          batchSize: 1,
          path,
        },
      );
      const a = consumerA.drain((_payload, context) =>
        timeline.a(context.signal, { journal: success("A's late answer") })
      );
      await partitionMidEffect(proxy, timeline);
      // Worker B takes the key over once A's lease passed: by reading the
      // message again once its visibility passes, or (on the plane's path)
      // by re-driving A's claim from the plane before that.
      const consumerB = new QueueConsumer(new EffectDriver(plane(), { log: silent }), direct, {
        queue,
        deadLetterQueue,
        organizationId,
        timing: new Timing(1_000, 1_000, 1_000),
        batchSize: 1,
        path,
      });
      const runB = () => consumerB.drain(() => (timeline.b(), { journal: success("B's answer") }));
      const b = await takeOver("worker B's queue consumer", async () => {
        const drained = await runB();
        return drained.ran > 0 ? drained : undefined;
      });
      assert.equal(b.ran, 1, JSON.stringify(b));
      if (b.redriven === 1) {
        assert.equal(path, "plane", "only the plane re-drives");
        // Its message, still hidden then, comes back once its visibility
        // passes: it replays B's answer and is archived, never run again.
        const replay = await takeOver("the message coming back", async () => {
          const drained = await runB();
          return drained.read > 0 ? drained : undefined;
        });
        assert.deepEqual(
          { read: replay.read, ran: replay.ran, replayed: replay.replayed, archived: replay.archived },
          { read: 1, ran: 0, replayed: 1, archived: 1 },
        );
      } else {
        assert.equal(b.archived, 1, JSON.stringify(b));
      }
      timeline.check();

      const first: Drained = await within("worker A's drain", a, GIVE_UP_MS);
      assert.deepEqual(first, {
        read: 1,
        ran: 1,
        replayed: 0,
        failed: 1,
        archived: 0,
        dead_lettered: 0,
        left: 1,
        redriven: 0,
      });
      const settled = events.find((event) => event.event === "idempotency.settle");
      assert.equal(settled?.ending, "left_to_lease");
      assert.match(String(settled?.why), /lease_unconfirmed/);
      assertLogged(events, key);
      const stored = await plane().read({
        organizationId,
        scope: `queue.${queue}`,
        key,
        requestHash: await hashOf({ to: "a@example.com" }),
      });
      assert.equal(stored.outcome, "completed");
      if (stored.outcome !== "completed") return;
      assert.deepEqual(stored.answer.output, "B's answer", "the message's answer is B's");
    });
  });
}
