// Deno's built-in OpenTelemetry (OTEL_DENO=true) exporting the client's
// spans and metrics over OTLP/HTTP (JSON) to a receiver this test serves:
// a process of its own (otel_deno_child.ts) imports only the client, which
// finds the API Deno registers; its claims, effect and replay arrive with
// their `idempotency.*` attributes, the key as its hash alone.

import assert from "node:assert/strict";
import { keyHash, METRICS } from "../_shared/idempotency/mod.ts";
import { eventually, KEY, organization, uniqueKey, URL_ } from "./support.ts";

const SCOPE = "webhook.svix";

/** An OTLP attribute: `{ key, value: { stringValue | boolValue | intValue | doubleValue } }`. */
interface OtlpAttribute {
  key: string;
  value: { stringValue?: string; boolValue?: boolean; intValue?: string | number; doubleValue?: number };
}

interface OtlpSpan {
  traceId: string;
  spanId: string;
  parentSpanId?: string;
  name: string;
  kind: number;
  attributes?: OtlpAttribute[];
  status?: { code?: number };
}

/** An attribute's value as JSON has it (numbers as numbers). */
function valueOf(attribute: OtlpAttribute["value"]): unknown {
  if (attribute.stringValue !== undefined) return attribute.stringValue;
  if (attribute.boolValue !== undefined) return attribute.boolValue;
  if (attribute.intValue !== undefined) return Number(attribute.intValue);
  if (attribute.doubleValue !== undefined) return attribute.doubleValue;
  return undefined;
}

function attributes(span: OtlpSpan): Record<string, unknown> {
  return Object.fromEntries((span.attributes ?? []).map((attribute) => [attribute.key, valueOf(attribute.value)]));
}

/** An OTLP/HTTP receiver on loopback: every JSON body posted to /v1/traces and /v1/metrics. */
function receiver() {
  const traces: { resourceSpans: { scopeSpans: { scope?: { name?: string }; spans: OtlpSpan[] }[] }[] }[] = [];
  const metrics: { resourceMetrics: { scopeMetrics: { metrics: { name: string }[] }[] }[] }[] = [];
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen() {} }, async (request) => {
    const path = new URL(request.url).pathname;
    if (request.method !== "POST") return new Response(null, { status: 405 });
    if (!(request.headers.get("content-type") ?? "").includes("json")) {
      return new Response("this receiver reads OTLP/HTTP JSON only", { status: 415 });
    }
    const body = await request.json();
    if (path === "/v1/traces") traces.push(body);
    else if (path === "/v1/metrics") metrics.push(body);
    return Response.json({});
  });
  const spans = (): { scope?: string; span: OtlpSpan }[] =>
    traces.flatMap((export_) =>
      export_.resourceSpans.flatMap((resource) =>
        resource.scopeSpans.flatMap((scope) => scope.spans.map((span) => ({ scope: scope.scope?.name, span })))
      )
    );
  const metricNames = (): string[] =>
    metrics.flatMap((export_) =>
      export_.resourceMetrics.flatMap((resource) =>
        resource.scopeMetrics.flatMap((scope) => scope.metrics.map((metric) => metric.name))
      )
    );
  return { server, spans, metricNames, traces };
}

Deno.test("Deno's built-in OpenTelemetry exports the client's spans and metrics, with no OpenTelemetry import", async () => {
  const otlp = receiver();
  try {
    const organizationId = organization();
    const key = uniqueKey("order-42");
    const child = new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "--config",
        new URL("../deno.json", import.meta.url).pathname,
        "--frozen",
        "--allow-net",
        "--allow-env",
        new URL("./otel_deno_child.ts", import.meta.url).pathname,
      ],
      env: {
        OTEL_DENO: "true",
        OTEL_EXPORTER_OTLP_ENDPOINT: `http://127.0.0.1:${otlp.server.addr.port}`,
        OTEL_EXPORTER_OTLP_PROTOCOL: "http/json",
        OTEL_SERVICE_NAME: "idempotency-ts-otel-test",
        IDEM_POSTGREST_URL: URL_,
        IDEM_SERVICE_KEY: KEY,
        OTEL_TEST_ORGANIZATION: organizationId,
        OTEL_TEST_SCOPE: SCOPE,
        OTEL_TEST_KEY: key,
      },
      stdout: "piped",
      stderr: "piped",
    });
    const output = await child.output();
    const stdout = new TextDecoder().decode(output.stdout);
    assert.equal(output.code, 0, `the child failed: ${stdout}${new TextDecoder().decode(output.stderr)}`);
    const answered = JSON.parse(stdout.trim().split("\n").at(-1) ?? "{}");
    assert.deepEqual(
      { ran: answered.ran, replayed: answered.replayed, carried: answered.carried },
      { ran: "ran", replayed: "replayed", carried: "claimed" },
    );

    const ours = () =>
      otlp.spans().filter(({ scope }) => scope === "@idempotency-plane/client").map(({ span }) => span);
    await eventually("the client's spans arrive", async () => await Promise.resolve(ours().length >= 5), 15_000);
    const spans = ours();
    const claims = spans.filter((span) => span.name === "idempotency.claim").map(attributes);
    const hash = await keyHash(key);
    assert.ok(
      claims.some((claim) =>
        claim["idempotency.outcome"] === "claimed" && claim["idempotency.replayed"] === false &&
        claim["idempotency.key_hash"] === hash && claim["idempotency.scope"] === SCOPE &&
        claim["idempotency.attempt"] === 1
      ),
      JSON.stringify(claims),
    );
    assert.ok(
      claims.some((claim) =>
        claim["idempotency.outcome"] === "replayed" && claim["idempotency.replayed"] === true &&
        claim["idempotency.key_hash"] === hash
      ),
      JSON.stringify(claims),
    );
    const effect = spans.find((span) => span.name === "idempotency.effect");
    assert.ok(effect, `no effect span among ${spans.map((span) => span.name)}`);
    assert.equal(attributes(effect)["idempotency.key_hash"], hash);
    assert.equal(
      spans.find((span) => span.name === "idempotency.settle" && attributes(span)["idempotency.key_hash"] === hash)
        ?.attributes?.find((attribute) => attribute.key === "idempotency.ending")?.value.stringValue,
      "journaled",
    );

    // The claim with work sent its own span's traceparent, which the plane keeps.
    const carried = spans.find((span) =>
      span.name === "idempotency.claim" && attributes(span)["idempotency.key_hash"] === undefined
    );
    assert.equal(carried, undefined, "every claim span has its key's hash");
    const withWork = spans.find((span) => `00-${span.traceId}-${span.spanId}-01` === answered.traceparent);
    assert.ok(withWork, `no span has the traceparent ${answered.traceparent}`);
    assert.equal(withWork.name, "idempotency.claim");
    assert.equal(attributes(withWork)["idempotency.key_hash"], await keyHash(`${key}-work`));

    // Never the key itself, on any span of the child's.
    const everything = JSON.stringify(otlp.traces);
    assert.ok(!everything.includes(key), "the raw key was exported on a span");

    await eventually("the outcome metrics arrive", async () => {
      return await Promise.resolve(otlp.metricNames().includes(METRICS.outcomes));
    }, 15_000);
    assert.ok(otlp.metricNames().includes(METRICS.rpcDuration), JSON.stringify(otlp.metricNames()));
  } finally {
    await otlp.server.shutdown();
  }
});
