// OpenTelemetry through the TypeScript client against a real plane, with
// the OpenTelemetry JS SDK registered as an application registers it (test
// dependencies only: the client imports none of it): a span per plane call
// and per effect with the `idempotency.*` attributes, a claim's traceparent
// kept with its work, the re-drive of that work linked to the trace that
// claimed it (not made its child), the outcome metrics under the Rust
// crate's names, and nothing at all without a registered API.

import assert from "node:assert/strict";
import * as api from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { AggregationTemporality, MeterProvider, MetricReader } from "@opentelemetry/sdk-metrics";
import {
  BasicTracerProvider,
  InMemorySpanExporter,
  type ReadableSpan,
  SimpleSpanProcessor,
} from "@opentelemetry/sdk-trace-base";
import {
  EffectDriver,
  failure,
  Held,
  keyHash,
  METRIC_KINDS,
  METRICS,
  QueueConsumer,
  Queues,
  runAndEnd,
  silent,
  success,
  type TelemetryApi,
  Timing,
} from "../_shared/idempotency/mod.ts";
import { hashOf, KEY, organization, plane, sleep, uniqueKey, URL_ } from "./support.ts";

const SCOPE = "webhook.svix";
/** This file's own queues (tests/run.sh asks `idem up` for them). */
const QUEUE = "telemetry_test";
const DLQ = "telemetry_test_dlq";
const GLOBAL_KEY = Symbol.for("opentelemetry.js.api.1");

/** Whether a tracer provider is registered globally (an unregistered API leaves its bare version behind). */
function tracerRegistered(): boolean {
  const registry = (globalThis as Record<symbol, { trace?: unknown } | undefined>)[GLOBAL_KEY];
  return registry?.trace !== undefined;
}

// The module an application imported is what `telemetry` takes.
const moduleAsOption: TelemetryApi = api;

/** A metric reader the test collects from when it wants. */
class Collector extends MetricReader {
  constructor() {
    super({ aggregationTemporalitySelector: () => AggregationTemporality.CUMULATIVE });
  }
  protected override async onForceFlush(): Promise<void> {}
  protected override async onShutdown(): Promise<void> {}
}

interface Sdk {
  exporter: InMemorySpanExporter;
  tracerProvider: BasicTracerProvider;
  contextManager: AsyncLocalStorageContextManager;
  meterProvider: MeterProvider;
  collector: Collector;
}

function sdk(): Sdk {
  const exporter = new InMemorySpanExporter();
  const tracerProvider = new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] });
  const contextManager = new AsyncLocalStorageContextManager().enable();
  const collector = new Collector();
  const meterProvider = new MeterProvider({ readers: [collector] });
  return { exporter, tracerProvider, contextManager, meterProvider, collector };
}

/** Registers `sdk` as an application's setup does, runs `body`, and unregisters it. */
async function withRegistered(body: (sdk: Sdk) => Promise<void>): Promise<void> {
  const registered = sdk();
  assert.ok(api.trace.setGlobalTracerProvider(registered.tracerProvider));
  assert.ok(api.context.setGlobalContextManager(registered.contextManager));
  assert.ok(api.metrics.setGlobalMeterProvider(registered.meterProvider));
  try {
    await body(registered);
  } finally {
    api.trace.disable();
    api.context.disable();
    api.metrics.disable();
    await registered.meterProvider.shutdown();
    await registered.tracerProvider.shutdown();
  }
}

/** Every attribute value of every span, as text: no raw key may be among them. */
function everyAttribute(spans: readonly ReadableSpan[]): string {
  return JSON.stringify(spans.map((span) => [span.name, span.attributes, span.links.map((link) => link.attributes)]));
}

function named(spans: readonly ReadableSpan[], name: string): ReadableSpan[] {
  return spans.filter((span) => span.name === name);
}

/** The data points of `metric`, as `{ attributes, value }`. */
async function points(collector: Collector, metric: string): Promise<{ attributes: api.Attributes; value: unknown }[]> {
  const { resourceMetrics, errors } = await collector.collect();
  assert.deepEqual(errors, []);
  return resourceMetrics.scopeMetrics.flatMap((scope) =>
    scope.metrics.filter((m) => m.descriptor.name === metric).flatMap((m) =>
      (m.dataPoints as { attributes: api.Attributes; value: unknown }[]).map((point) => ({
        attributes: point.attributes,
        value: point.value,
      }))
    )
  );
}

/** The fetch of a plane that keeps every request body sent, by SQL function. */
function recordingFetch(): { fetch: typeof fetch; sent: { fn: string; body: Record<string, unknown> }[] } {
  const sent: { fn: string; body: Record<string, unknown> }[] = [];
  const recording: typeof fetch = async (input, init) => {
    const url = typeof input === "string" ? input : input instanceof URL ? input.href : input.url;
    sent.push({ fn: url.slice(url.lastIndexOf("/") + 1), body: JSON.parse(String(init?.body ?? "{}")) });
    return await fetch(input, init);
  };
  return { fetch: recording, sent };
}

Deno.test("keyHash is the Rust crate's key_hash: the shared vectors", async () => {
  const vectors: { key_hash: { key: string; key_hash: string }[] } = JSON.parse(
    await Deno.readTextFile(new URL("../../../tests/vectors/key_hash.json", import.meta.url)),
  );
  assert.ok(vectors.key_hash.some((vector) => vector.key === "order-42"));
  for (const vector of vectors.key_hash) assert.equal(await keyHash(vector.key), vector.key_hash, vector.key);
  // printf %s order-42 | sha256sum | cut -c1-16
  assert.equal(await keyHash("order-42"), "3bf8b157c4238eef");
});

Deno.test("the metrics are the Rust crate's: names, kinds and labels of tests/vectors/metric_names.json", async () => {
  const listed: { name: string; kind: string; labels: string[]; description: string }[] = JSON.parse(
    await Deno.readTextFile(new URL("../../../tests/vectors/metric_names.json", import.meta.url)),
  );
  const names = Object.values(METRICS);
  assert.equal(new Set(names).size, names.length);
  for (const name of names) {
    const rust = listed.find((metric) => metric.name === name);
    assert.ok(rust, `${name} is not in tests/vectors/metric_names.json`);
    assert.equal(METRIC_KINDS[name].kind, rust.kind, name);
    assert.deepEqual([...METRIC_KINDS[name].labels], rust.labels, name);
    assert.equal(METRIC_KINDS[name].description, rust.description, name);
  }
});

Deno.test("without an OpenTelemetry API: no span, no traceparent sent, nothing fails", async () => {
  assert.ok(!tracerRegistered(), "no API is registered globally");
  const { fetch: recording, sent } = recordingFetch();
  const p = plane({ fetch: recording });
  const org = organization();
  const key = uniqueKey("order");
  const hash = await hashOf({ key });
  const outcome = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000, work: 1 });
  assert.equal(outcome.outcome, "claimed");
  if (outcome.outcome !== "claimed") return;
  assert.equal(outcome.claim.traceparent, undefined);
  await sleep(1_300);
  const [taken] = await p.redrive({ scope: SCOPE, limit: 1, leaseMs: 30_000, organizationId: org });
  assert.equal(taken?.outcome, "redriven");
  if (taken?.outcome !== "redriven") return;
  assert.equal(taken.claim.traceparent, undefined);
  const driver = new EffectDriver(p, { log: silent });
  const ended = await runAndEnd(
    new Held(driver, taken.claim, { startedAt: performance.now() }, new Timing(5_000)),
    () => success("ran"),
  );
  assert.equal(ended.settled.ending, "journaled");
  assert.ok(sent.length >= 3);
  assert.ok(sent.every(({ body }) => !("p_traceparent" in body)), JSON.stringify(sent.map(({ fn }) => fn)));

  // An API registered, and turned off for this plane: still nothing.
  await withRegistered(async ({ exporter }) => {
    const off = plane({ telemetry: false });
    const replay = await off.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000 });
    assert.equal(replay.outcome, "completed");
    assert.deepEqual(exporter.getFinishedSpans(), []);
  });
});

Deno.test("a claim with work keeps its trace; the replay says so; the re-drive links to that trace", async () => {
  await withRegistered(async ({ exporter, collector }) => {
    const tracer = api.trace.getTracer("telemetry_test");
    const { fetch: recording, sent } = recordingFetch();
    const p = plane({ fetch: recording });
    const org = organization();
    const key = uniqueKey("order-42");
    const hash = await hashOf({ key });

    // The first worker claims inside its request's span, and stops.
    const first = await tracer.startActiveSpan("worker.request", async (request) => {
      try {
        return await p.claim({
          organizationId: org,
          scope: SCOPE,
          key,
          requestHash: hash,
          leaseMs: 1_000,
          work: { order: 42 },
        });
      } finally {
        request.end();
      }
    });
    assert.equal(first.outcome, "claimed");
    const [request] = named(exporter.getFinishedSpans(), "worker.request");
    const [claimSpan] = named(exporter.getFinishedSpans(), "idempotency.claim");
    assert.ok(request && claimSpan);
    assert.equal(claimSpan.parentSpanContext?.spanId, request.spanContext().spanId, "the claim is the request's child");
    assert.equal(claimSpan.kind, api.SpanKind.CLIENT);
    assert.deepEqual(claimSpan.attributes, {
      "idempotency.scope": SCOPE,
      "idempotency.key_hash": await keyHash(key),
      "idempotency.outcome": "claimed",
      "idempotency.replayed": false,
      "idempotency.reclaimed": false,
      "idempotency.attempt": 1,
    });
    const originTrace = claimSpan.spanContext().traceId;
    const sentTraceparent = sent.find(({ fn }) => fn === "idempotency_claim")?.body.p_traceparent;
    assert.equal(sentTraceparent, `00-${originTrace}-${claimSpan.spanContext().spanId}-01`);

    // Another worker, in a trace of its own, re-drives the orphan: the
    // plane hands out the stored traceparent, and the effect's span links
    // to it, as a link and never as its parent.
    await sleep(1_300);
    const driver = new EffectDriver(p, { log: silent });
    const ended = await tracer.startActiveSpan("redrive.route", async (route) => {
      try {
        const [taken] = await p.redrive({ scope: SCOPE, limit: 5, leaseMs: 30_000, organizationId: org });
        assert.equal(taken?.outcome, "redriven");
        if (taken?.outcome !== "redriven") throw new Error("nothing re-driven");
        assert.equal(taken.claim.traceparent, sentTraceparent, "the plane kept the claim's traceparent");
        assert.equal(taken.attempt, 2);
        const held = new Held(driver, taken.claim, { startedAt: performance.now() }, new Timing(5_000), {
          attempt: taken.attempt,
        });
        return await runAndEnd(held, () => success({ shipped: 42 }));
      } finally {
        route.end();
      }
    });
    assert.equal(ended.settled.ending, "journaled");
    const spans = exporter.getFinishedSpans();
    const [route] = named(spans, "redrive.route");
    const [effect] = named(spans, "idempotency.effect");
    assert.ok(route && effect);
    assert.notEqual(route.spanContext().traceId, originTrace);
    assert.equal(effect.spanContext().traceId, route.spanContext().traceId, "the effect runs in the re-drive's trace");
    assert.equal(effect.parentSpanContext?.spanId, route.spanContext().spanId);
    assert.deepEqual(
      effect.links.map((link) => [link.context.traceId, link.context.spanId]),
      [[originTrace, claimSpan.spanContext().spanId]],
      "linked to the claim that first carried the work",
    );
    assert.equal(effect.kind, api.SpanKind.INTERNAL);
    assert.equal(effect.attributes["idempotency.outcome"], "reclaimed");
    assert.equal(effect.attributes["idempotency.attempt"], 2);
    assert.equal(effect.attributes["idempotency.key_hash"], await keyHash(key));
    assert.equal(effect.status.code, api.SpanStatusCode.UNSET);
    const [settle] = named(spans, "idempotency.settle");
    assert.equal(settle?.attributes["idempotency.ending"], "journaled");
    const [redrive] = named(spans, "idempotency.redrive");
    assert.equal(redrive?.attributes["idempotency.redriven"], 1);
    assert.equal(redrive?.parentSpanContext?.spanId, route.spanContext().spanId);

    // A duplicate is answered from the journal: replayed.
    const replay = await p.claim({ organizationId: org, scope: SCOPE, key, requestHash: hash, leaseMs: 1_000 });
    assert.equal(replay.outcome, "completed");
    const replaySpan = named(exporter.getFinishedSpans(), "idempotency.claim").at(-1);
    assert.equal(replaySpan?.attributes["idempotency.outcome"], "replayed");
    assert.equal(replaySpan?.attributes["idempotency.replayed"], true);
    assert.equal(replaySpan?.attributes["idempotency.key_hash"], await keyHash(key));
    assert.ok(!("p_traceparent" in (sent.at(-1)?.body ?? {})), "a claim without work sends no traceparent");

    // The key itself is on no span.
    const all = exporter.getFinishedSpans();
    assert.ok(all.length >= 6);
    assert.ok(!everyAttribute(all).includes(key), "the raw key is on a span");
    assert.ok(!everyAttribute(all).includes(key.slice("order-42-".length)), "part of the raw key is on a span");

    // The outcome metrics, by the Rust crate's names and labels.
    const outcomes = await points(collector, METRICS.outcomes);
    // The Rust crate's values: the plane's outcome, `completed` for a replay.
    for (const outcome of ["claimed", "completed"]) {
      assert.ok(
        outcomes.some((point) =>
          point.attributes.operation === "claim" && point.attributes.scope === SCOPE &&
          point.attributes.outcome === outcome && point.value === 1
        ),
        `${outcome}: ${JSON.stringify(outcomes)}`,
      );
    }
    assert.deepEqual(
      (await points(collector, METRICS.redrives)).map((point) => [point.attributes, point.value]),
      [[{ scope: SCOPE, outcome: "redriven" }, 1]],
    );
    assert.deepEqual(
      (await points(collector, METRICS.effectEndings)).map((point) => [point.attributes, point.value]),
      [[{ scope: SCOPE, ending: "journaled" }, 1]],
    );
    const [duration] = await points(collector, METRICS.effectDuration);
    assert.deepEqual(duration?.attributes, { scope: SCOPE, ending: "journaled" });
    assert.equal((duration?.value as { count: number }).count, 1);
    const rpc = await points(collector, METRICS.rpcDuration);
    for (const fn of ["idempotency_claim", "idempotency_redrive", "idempotency_complete"]) {
      assert.ok(rpc.some((point) => point.attributes.function === fn), `${fn}: ${JSON.stringify(rpc)}`);
    }
  });
});

Deno.test("a batch's items carry its trace; a claim the plane refuses ends its span in error, by kind", async () => {
  await withRegistered(async ({ exporter, collector }) => {
    const p = plane();
    const org = organization();
    const keys = [uniqueKey("batch"), uniqueKey("batch")];
    const outcomes = await p.claimMany({
      organizationId: org,
      scope: SCOPE,
      leaseMs: 1_000,
      items: await Promise.all(keys.map(async (key) => ({ key, requestHash: await hashOf({ key }), work: { key } }))),
    });
    assert.deepEqual(outcomes.map((outcome) => outcome.outcome), ["claimed", "claimed"]);
    const [batch] = named(exporter.getFinishedSpans(), "idempotency.claim_many");
    assert.ok(batch);
    const traceparent = `00-${batch.spanContext().traceId}-${batch.spanContext().spanId}-01`;
    for (const outcome of outcomes) {
      if (outcome.outcome === "claimed") assert.equal(outcome.claim.traceparent, traceparent);
    }
    await sleep(1_300);
    const taken = await p.redrive({ scope: SCOPE, limit: 5, leaseMs: 30_000, organizationId: org });
    assert.deepEqual(taken.map((work) => work.outcome === "redriven" && work.claim.traceparent), [
      traceparent,
      traceparent,
    ]);

    // A scope with no policy row: IDEM1, kind unknown_scope.
    await assert.rejects(
      p.claim({
        organizationId: org,
        scope: "no.such.scope",
        key: "k",
        requestHash: await hashOf(1),
        leaseMs: 1_000,
      }),
      (error: Error & { kind?: string }) => error.kind === "unknown_scope",
    );
    const failed = named(exporter.getFinishedSpans(), "idempotency.claim").at(-1);
    assert.equal(failed?.status.code, api.SpanStatusCode.ERROR);
    assert.equal(failed?.attributes["error.type"], "unknown_scope");
    assert.equal(failed?.attributes["idempotency.outcome"], undefined);
    const errors = await points(collector, METRICS.rpcErrors);
    assert.ok(
      errors.some((point) =>
        point.attributes.function === "idempotency_claim" && point.attributes.kind === "unknown_scope"
      ),
      JSON.stringify(errors),
    );
  });
});

Deno.test("an API given as the option is used without any global registration", async () => {
  assert.ok(!tracerRegistered());
  const { exporter, tracerProvider, contextManager, meterProvider, collector } = sdk();
  try {
    const given: TelemetryApi = { trace: tracerProvider, context: contextManager, metrics: meterProvider };
    const p = plane({ telemetry: given });
    const org = organization();
    const key = uniqueKey();
    const outcome = await p.read({ organizationId: org, scope: SCOPE, key, requestHash: await hashOf(key) });
    assert.equal(outcome.outcome, "absent");
    const [read] = named(exporter.getFinishedSpans(), "idempotency.read");
    assert.equal(read?.attributes["idempotency.outcome"], "absent");
    assert.equal(read?.attributes["idempotency.key_hash"], await keyHash(key));
    const outcomes = await points(collector, METRICS.outcomes);
    assert.deepEqual(outcomes.map((point) => point.attributes), [{
      operation: "read",
      scope: SCOPE,
      outcome: "absent",
    }]);
    // The module itself is accepted as the option too (a type check: it is a TelemetryApi).
    assert.equal(typeof moduleAsOption.trace?.getTracer, "function");
  } finally {
    contextManager.disable();
    await meterProvider.shutdown();
    await tracerProvider.shutdown();
  }
});

Deno.test("a queue message delivered again runs in a span linked to the take that first claimed it", async () => {
  await withRegistered(async ({ exporter }) => {
    const tracer = api.trace.getTracer("telemetry_test");
    const org = organization();
    const consumer = new QueueConsumer(
      new EffectDriver(plane(), { log: silent }),
      Queues.connect({ url: URL_, key: KEY }),
      {
        queue: QUEUE,
        deadLetterQueue: DLQ,
        organizationId: org,
        timing: new Timing(1_000, 1_500, 1_000),
        path: "plane",
      },
    );
    const key = uniqueKey("queued");
    await consumer.queues.send(QUEUE, { idempotency_key: key, payload: { n: 1 } });
    const drain = (name: string, process: () => ReturnType<Parameters<QueueConsumer["drain"]>[0]>) =>
      tracer.startActiveSpan(name, async (span) => {
        try {
          return await consumer.drain(process);
        } finally {
          span.end();
        }
      });

    // The first consumer's effect throws: its outcome is unknown, the claim
    // is left to its lease and the message comes back.
    const first = await drain("drain.first", () => {
      throw new Error("the worker stopped");
    });
    assert.deepEqual([first.read, first.ran, first.left], [1, 1, 1], JSON.stringify(first));
    await sleep(6_000);
    const second = await drain("drain.second", () => ({ journal: success("shipped") }));
    assert.deepEqual([second.read, second.ran, second.archived], [1, 1, 1], JSON.stringify(second));

    const spans = exporter.getFinishedSpans();
    const [drainFirst] = named(spans, "drain.first");
    const [drainSecond] = named(spans, "drain.second");
    const takes = named(spans, "idempotency.queue_take");
    const firstTake = takes.find((span) => span.parentSpanContext?.spanId === drainFirst?.spanContext().spanId);
    assert.ok(drainFirst && drainSecond && firstTake);
    const effects = named(spans, "idempotency.effect");
    assert.equal(effects.length, 2);
    const [failed, redelivered] = effects;
    assert.equal(failed.status.code, api.SpanStatusCode.ERROR);
    assert.equal(failed.attributes["error.type"], "Error");
    assert.equal(failed.attributes["idempotency.cut"], "threw");
    assert.equal(failed.attributes["idempotency.outcome"], "claimed");
    assert.deepEqual(failed.links, [], "a fresh claim links to nothing");
    assert.equal(redelivered.attributes["idempotency.outcome"], "reclaimed");
    assert.equal(redelivered.attributes["idempotency.key_hash"], await keyHash(key));
    assert.equal(redelivered.spanContext().traceId, drainSecond.spanContext().traceId);
    assert.deepEqual(
      redelivered.links.map((link) => [link.context.traceId, link.context.spanId]),
      [[firstTake.spanContext().traceId, firstTake.spanContext().spanId]],
      "linked to the take that first claimed the message",
    );
    assert.ok(!everyAttribute(spans).includes(key));
  });
});

Deno.test("a failure sent back after a fix keeps its first trace: its re-drive links there", async () => {
  await withRegistered(async ({ exporter }) => {
    const tracer = api.trace.getTracer("telemetry_test");
    const p = plane();
    const org = organization();
    const key = uniqueKey("refund");
    const hash = await hashOf({ key });
    const driver = new EffectDriver(p, { log: silent });

    // The first run fails for good: its failure is journaled, with the work.
    const claimed = await tracer.startActiveSpan("worker.first", async (span) => {
      try {
        const begun = await driver.begin({
          organizationId: org,
          scope: SCOPE,
          key,
          requestHash: hash,
          timing: new Timing(5_000),
          work: { refund: 7 },
        });
        if (begun.kind !== "held") throw new Error(`expected a claim, got ${begun.kind}`);
        const ended = await runAndEnd(begun.held, () => failure("card_declined"));
        assert.equal(ended.settled.ending, "journaled");
        return begun.held.claim;
      } finally {
        span.end();
      }
    });
    const [first] = named(exporter.getFinishedSpans(), "worker.first");
    const firstClaim = named(exporter.getFinishedSpans(), "idempotency.claim").find((span) =>
      span.parentSpanContext?.spanId === first?.spanContext().spanId
    );
    assert.ok(first && firstClaim);
    const origin = `00-${firstClaim.spanContext().traceId}-${firstClaim.spanContext().spanId}-01`;
    assert.equal(claimed.traceparent, origin);

    // After the fix, an operator sends it back; a re-drive in another trace takes it.
    const sentBack = await p.client.rpc("idempotency_redrive_failed", {
      p_scope: SCOPE,
      p_limit: 10,
      p_organization_id: org,
      p_claim_ids: [claimed.id],
    });
    assert.equal((sentBack as unknown[]).length, 1);
    await tracer.startActiveSpan("operator.redrive", async (span) => {
      try {
        const [taken] = await p.redrive({ scope: SCOPE, limit: 5, leaseMs: 30_000, organizationId: org });
        if (taken?.outcome !== "redriven") throw new Error(`nothing re-driven: ${JSON.stringify(taken)}`);
        assert.equal(taken.claim.traceparent, origin, "the send-back kept the first trace");
        const held = new Held(driver, taken.claim, { startedAt: performance.now() }, new Timing(5_000), {
          attempt: taken.attempt,
        });
        assert.equal((await runAndEnd(held, () => success("refunded"))).settled.ending, "journaled");
      } finally {
        span.end();
      }
    });
    const spans = exporter.getFinishedSpans();
    const [operator] = named(spans, "operator.redrive");
    const rerun = named(spans, "idempotency.effect").find((span) =>
      span.parentSpanContext?.spanId === operator?.spanContext().spanId
    );
    assert.ok(operator && rerun);
    assert.notEqual(rerun.spanContext().traceId, firstClaim.spanContext().traceId);
    assert.deepEqual(
      rerun.links.map((link) => [link.context.traceId, link.context.spanId]),
      [[firstClaim.spanContext().traceId, firstClaim.spanContext().spanId]],
    );
  });
});
