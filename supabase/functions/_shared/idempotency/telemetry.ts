// OpenTelemetry, when the application has it: a span per plane call and per
// effect, and the outcome metrics the Rust crate names (src/telemetry.rs),
// through the OpenTelemetry API, never a dependency of this client.
//
// The API is found without importing it: `@opentelemetry/api` keeps what an
// SDK registers (its tracer provider, context manager, meter provider) at
// `globalThis[Symbol.for("opentelemetry.js.api.1")]`, and so does Deno's
// built-in OpenTelemetry (`OTEL_DENO=true`) without any import. An
// application with its own copy of the API passes it instead
// (`telemetry: api`, the `@opentelemetry/api` module). With neither, every
// call here is a check of one global and nothing more: no span, no hash.
//
// Spans carry `idempotency.*` attributes, never the raw key: its hash
// (`keyHash`, the Rust crate's `telemetry::key_hash`). A claim that carries
// work sends its span's W3C traceparent to the plane, which keeps it with
// the work; the span that runs work handed out again (a re-drive, a reclaim,
// a queue redelivery) is linked to it, not made its child.

import { sha256Hex } from "./hash.ts";

/** An attribute's value, as OpenTelemetry takes it (undefined: left out). */
export type TelemetryValue = string | number | boolean;

/** The OpenTelemetry Context, as this client uses it. */
export interface OtelContext {
  getValue(key: symbol): unknown;
  setValue(key: symbol, value: unknown): OtelContext;
}

/** A span's identity: W3C trace id (32 hex), span id (16 hex) and flags. */
export interface OtelSpanContext {
  traceId: string;
  spanId: string;
  traceFlags: number;
  isRemote?: boolean;
}

/** The OpenTelemetry Span, as this client uses it. */
export interface OtelSpan {
  spanContext(): OtelSpanContext;
  setAttribute(key: string, value: TelemetryValue): unknown;
  setStatus(status: { code: number; message?: string }): unknown;
  end(): void;
}

/** The OpenTelemetry Tracer, as this client uses it. */
export interface OtelTracer {
  startSpan(
    name: string,
    options?: {
      kind?: number;
      attributes?: Record<string, TelemetryValue>;
      links?: { context: OtelSpanContext }[];
    },
    context?: OtelContext,
  ): OtelSpan;
}

/** The OpenTelemetry Meter, as this client uses it. */
export interface OtelMeter {
  createCounter(
    name: string,
    options?: { description?: string; unit?: string },
  ): { add(value: number, attributes?: Record<string, TelemetryValue>): void };
  createHistogram(
    name: string,
    options?: { description?: string; unit?: string },
  ): { record(value: number, attributes?: Record<string, TelemetryValue>): void };
}

/**
 * What this client calls of the OpenTelemetry API: the `@opentelemetry/api`
 * module itself (`import * as api from "@opentelemetry/api"`), or what an
 * SDK registered globally. Each part may be missing: without `trace` there
 * are no spans, without `context` every span is a root, without `metrics`
 * no metrics.
 */
export interface TelemetryApi {
  trace?: { getTracer(name: string, version?: string): OtelTracer };
  context?: { active(): OtelContext; with<T>(context: OtelContext, fn: () => T): T };
  metrics?: { getMeter(name: string, version?: string): OtelMeter };
}

/** The tracer's and meter's name. */
export const INSTRUMENTATION_SCOPE = "@idempotency-plane/client";

/** Where `@opentelemetry/api` 1.x (and Deno's built-in OpenTelemetry) register the global API. */
const GLOBAL_KEY = Symbol.for("opentelemetry.js.api.1");
/** The context key the OpenTelemetry API keeps the active span under. */
const SPAN_KEY = Symbol.for("OpenTelemetry Context Key SPAN");

/** OpenTelemetry's SpanKind: a span of work in this process, or a call to a server. */
const SPAN_KIND = { internal: 0, client: 2 } as const;
/** OpenTelemetry's SpanStatusCode.ERROR. */
const STATUS_ERROR = 2;

/**
 * The metrics this client emits, named as the Rust crate names them
 * (src/telemetry, listed in tests/vectors/metric_names.json), with the same
 * label names. The sweeper's are the Rust crate's alone.
 */
export const METRICS = {
  /** Counter `{operation, scope, outcome}`: what each claim or read answered. */
  outcomes: "idempotency_outcomes_total",
  /** Counter `{operation, scope, ending}`: completions and releases, recorded or fenced off. */
  endings: "idempotency_endings_total",
  /** Counter `{scope, ending}`: how each effect ended (journaled, released, lease_moved_on, left_to_lease). */
  effectEndings: "idempotency_effect_endings_total",
  /** Histogram `{scope, ending}`: seconds from a claim this worker held to its ending. */
  effectDuration: "idempotency_effect_duration_seconds",
  /** Counter `{operation, scope}`: claims and reads that met another worker's live claim. */
  waits: "idempotency_waits_total",
  /** Counter `{reason}`: webhook deliveries acknowledged without processing. */
  webhookDrops: "idempotency_webhook_drops_total",
  /** Counter: heartbeats that found the claim taken over. */
  heartbeatsFenced: "idempotency_heartbeats_fenced_total",
  /** Counter: effects stopped because no heartbeat confirmed their lease in time. */
  leasesUnconfirmed: "idempotency_leases_unconfirmed_total",
  /** Counter `{scope, outcome}`: orphans a re-drive took over (redriven) or journaled as dead letters. */
  redrives: "idempotency_redrives_total",
  /** Histogram `{function}`: seconds per SQL function call, retries included. */
  rpcDuration: "idempotency_rpc_duration_seconds",
  /** Counter `{function, kind}`: SQL function calls that failed, by error kind. */
  rpcErrors: "idempotency_rpc_errors_total",
} as const;

/** One metric's name. */
export type MetricName = typeof METRICS[keyof typeof METRICS];

/** How one metric is made: its instrument, unit, label names and help text. */
export interface MetricKind {
  kind: "counter" | "histogram";
  unit?: string;
  labels: readonly string[];
  description: string;
}

/** Each metric's instrument, unit, labels and help text (the Rust crate's). */
export const METRIC_KINDS: Readonly<Record<MetricName, MetricKind>> = {
  idempotency_outcomes_total: {
    kind: "counter",
    labels: ["operation", "scope", "outcome"],
    description: "Reads and claims, by operation, scope and outcome.",
  },
  idempotency_endings_total: {
    kind: "counter",
    labels: ["operation", "scope", "ending"],
    description: "Completions and releases, by operation, scope and ending (recorded, or lease_moved_on: fenced off).",
  },
  idempotency_effect_endings_total: {
    kind: "counter",
    labels: ["scope", "ending"],
    description:
      "Effects ended by the driver, by scope and ending (journaled, released, lease_moved_on, left_to_lease).",
  },
  idempotency_effect_duration_seconds: {
    kind: "histogram",
    unit: "s",
    labels: ["scope", "ending"],
    description:
      "Seconds from a claim this worker held to its ending (the effect and its journal), by scope and ending.",
  },
  idempotency_waits_total: {
    kind: "counter",
    labels: ["operation", "scope"],
    description: "Reads and claims that met another worker's live claim (processing): the caller waits or comes back.",
  },
  idempotency_webhook_drops_total: {
    kind: "counter",
    labels: ["reason"],
    description: "Webhook deliveries acknowledged without processing, by reason.",
  },
  idempotency_heartbeats_fenced_total: {
    kind: "counter",
    labels: [],
    description: "Heartbeats that found the claim taken over; the effect under them was stopped.",
  },
  idempotency_leases_unconfirmed_total: {
    kind: "counter",
    labels: [],
    description: "Effects stopped because no heartbeat confirmed their lease in time; each was left to its lease.",
  },
  idempotency_redrives_total: {
    kind: "counter",
    labels: ["scope", "outcome"],
    description:
      "Orphaned claims a re-drive took over (redriven) or journaled as dead letters (dead_lettered), by scope.",
  },
  idempotency_rpc_duration_seconds: {
    kind: "histogram",
    unit: "s",
    labels: ["function"],
    description: "SQL function calls over PostgREST, by function, retries included.",
  },
  idempotency_rpc_errors_total: {
    kind: "counter",
    labels: ["function", "kind"],
    description: "SQL function calls that failed, by function and error kind.",
  },
};

/**
 * The key as spans show it: the first 16 hex digits of the SHA-256 of its
 * UTF-8 bytes (the Rust crate's `telemetry::key_hash`). A key may hold
 * personal data; its hash finds the spans of one key without showing it.
 */
export async function keyHash(key: string): Promise<string> {
  return (await sha256Hex(key)).slice(0, 16);
}

const TRACE_ID = /^[0-9a-f]{32}$/;
const SPAN_ID = /^[0-9a-f]{16}$/;
const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/** The W3C traceparent (version 00) of `context`; undefined when its ids are not valid ones. */
export function traceparentOf(context: OtelSpanContext): string | undefined {
  const { traceId, spanId } = context;
  if (!TRACE_ID.test(traceId) || !SPAN_ID.test(spanId) || /^0+$/.test(traceId) || /^0+$/.test(spanId)) {
    return undefined;
  }
  const flags = (context.traceFlags & 0xff).toString(16).padStart(2, "0");
  return `00-${traceId}-${spanId}-${flags}`;
}

/** The span context a W3C traceparent names (remote), or undefined for one that is not valid. */
export function spanContextOf(traceparent: string): OtelSpanContext | undefined {
  const match = TRACEPARENT.exec(traceparent);
  if (!match || match[1] === "ff" || /^0+$/.test(match[2]) || /^0+$/.test(match[3])) return undefined;
  return { traceId: match[2], spanId: match[3], traceFlags: parseInt(match[4], 16), isRemote: true };
}

/** A span this client opened, as the code inside it sees it. */
export interface SpanScope {
  /** Adds attributes (an undefined value is left out). */
  set(attributes: Record<string, TelemetryValue | undefined>): void;
  /** Marks the span failed: `error.type` is `kind`, its status ERROR. */
  fail(kind: string, message?: string): void;
  /** This span's W3C traceparent, for the plane to keep with a claim's work; undefined without tracing. */
  readonly traceparent: string | undefined;
}

const NO_SPAN: SpanScope = Object.freeze({ set() {}, fail() {}, traceparent: undefined });

/** What a span starts with. */
export interface SpanStart {
  /** `client` for a call to the plane (default), `internal` for an effect. */
  kind?: "client" | "internal";
  /** `idempotency.scope`. */
  scope?: string;
  /** Shown as `idempotency.key_hash`, never as it is. */
  key?: string;
  attributes?: Record<string, TelemetryValue | undefined>;
  /**
   * Traceparents of the traces this span's work came from: each a link
   * (never a parent), unless it names the trace the span is in.
   */
  links?: readonly (string | undefined)[];
}

/** The empty context, for an API registered without a context manager. */
class RootContext implements OtelContext {
  readonly #values: ReadonlyMap<symbol, unknown>;

  constructor(values: ReadonlyMap<symbol, unknown> = new Map()) {
    this.#values = values;
  }

  getValue(key: symbol): unknown {
    return this.#values.get(key);
  }

  setValue(key: symbol, value: unknown): OtelContext {
    return new RootContext(new Map([...this.#values, [key, value]]));
  }
}

const ROOT = new RootContext();

/** The API an SDK (or Deno) registered globally, when one did. */
function registered(): TelemetryApi | undefined {
  const api = (globalThis as Record<symbol, unknown>)[GLOBAL_KEY];
  return api !== null && typeof api === "object" ? api as TelemetryApi : undefined;
}

/** A kind for a thrown value: the client's own (`PlaneError.kind`, `ToolError.kind`), else its class name. */
export function errorKind(error: unknown): string {
  if (error !== null && typeof error === "object") {
    const kind = (error as { kind?: unknown }).kind;
    if (typeof kind === "string" && kind !== "") return kind;
    const name = (error as { name?: unknown }).name;
    if (typeof name === "string" && name !== "") return name;
  }
  return typeof error;
}

/** An error's PostgREST or PostgreSQL code, when it has one. */
function errorCode(error: unknown): string | undefined {
  const code = error !== null && typeof error === "object" ? (error as { code?: unknown }).code : undefined;
  return typeof code === "string" && code !== "" ? code : undefined;
}

/**
 * The client's telemetry: spans and metrics through the OpenTelemetry API
 * given, or the one registered globally (looked up at each use, so an SDK
 * registered after the plane was made is used), or none (`false`).
 */
export class Telemetry {
  readonly #given: TelemetryApi | false | undefined;
  readonly #tracers = new WeakMap<object, OtelTracer>();
  readonly #meters = new WeakMap<object, Map<string, unknown>>();

  constructor(api?: TelemetryApi | false) {
    this.#given = api;
  }

  #api(): TelemetryApi | undefined {
    return this.#given === false ? undefined : this.#given ?? registered();
  }

  #tracer(api: TelemetryApi): OtelTracer | undefined {
    const provider = api.trace;
    if (!provider || typeof provider.getTracer !== "function") return undefined;
    let tracer = this.#tracers.get(provider);
    if (!tracer) {
      tracer = provider.getTracer(INSTRUMENTATION_SCOPE);
      this.#tracers.set(provider, tracer);
    }
    return tracer;
  }

  /**
   * Runs `run` inside a span `name` (the active one while it runs, so the
   * spans it opens are its children), ended when `run` settles. A throw is
   * recorded (`error.type`, status ERROR) and passed on. Without a tracer,
   * runs `run` alone.
   */
  async span<T>(name: string, start: SpanStart, run: (span: SpanScope) => Promise<T>): Promise<T> {
    const api = this.#api();
    const tracer = api && this.#tracer(api);
    if (!api || !tracer) return await run(NO_SPAN);
    const attributes: Record<string, TelemetryValue> = {};
    if (start.scope !== undefined) attributes["idempotency.scope"] = start.scope;
    if (start.key !== undefined) attributes["idempotency.key_hash"] = await keyHash(start.key);
    for (const [field, value] of Object.entries(start.attributes ?? {})) {
      if (value !== undefined) attributes[field] = value;
    }
    const manager = api.context && typeof api.context.active === "function" ? api.context : undefined;
    const parent = manager?.active() ?? ROOT;
    // A trace is linked only from another: a fresh claim answers its own.
    const within = (parent.getValue(SPAN_KEY) as OtelSpan | undefined)?.spanContext?.().traceId;
    const links = (start.links ?? []).flatMap((traceparent) => {
      const context = traceparent === undefined ? undefined : spanContextOf(traceparent);
      return context && context.traceId !== within ? [{ context }] : [];
    });
    const span = tracer.startSpan(name, {
      kind: SPAN_KIND[start.kind ?? "client"],
      attributes,
      ...(links.length > 0 ? { links } : {}),
    }, parent);
    let failed = false;
    const scope: SpanScope = {
      set(more) {
        for (const [field, value] of Object.entries(more)) {
          if (value !== undefined) span.setAttribute(field, value);
        }
      },
      fail(kind, message) {
        failed = true;
        span.setAttribute("error.type", kind);
        span.setStatus({ code: STATUS_ERROR, message: message ?? kind });
      },
      get traceparent() {
        return traceparentOf(span.spanContext());
      },
    };
    try {
      const inside = parent.setValue(SPAN_KEY, span);
      return manager ? await manager.with(inside, () => run(scope)) : await run(scope);
    } catch (error) {
      if (!failed) {
        // The kind and code only: a message may quote what the caller sent.
        const code = errorCode(error);
        scope.fail(errorKind(error), code === undefined ? undefined : `${errorKind(error)} ${code}`);
      }
      throw error;
    } finally {
      span.end();
    }
  }

  #instrument(metric: MetricName): unknown {
    const provider = this.#api()?.metrics;
    if (!provider || typeof provider.getMeter !== "function") return undefined;
    let instruments = this.#meters.get(provider);
    if (!instruments) {
      instruments = new Map();
      this.#meters.set(provider, instruments);
    }
    let instrument = instruments.get(metric);
    if (instrument === undefined) {
      const meter = provider.getMeter(INSTRUMENTATION_SCOPE);
      const { kind, unit, description } = METRIC_KINDS[metric];
      const options = unit === undefined ? { description } : { description, unit };
      instrument = kind === "counter" ? meter.createCounter(metric, options) : meter.createHistogram(metric, options);
      instruments.set(metric, instrument);
    }
    return instrument;
  }

  /** Adds `value` (1) to counter `metric` with `labels`. */
  count(metric: MetricName, labels: Record<string, TelemetryValue> = {}, value = 1): void {
    const counter = this.#instrument(metric) as { add?: (value: number, labels: object) => void } | undefined;
    if (typeof counter?.add === "function") counter.add(value, labels);
  }

  /** Records `value` in histogram `metric` with `labels`. */
  record(metric: MetricName, value: number, labels: Record<string, TelemetryValue> = {}): void {
    const histogram = this.#instrument(metric) as { record?: (value: number, labels: object) => void } | undefined;
    if (typeof histogram?.record === "function") histogram.record(value, labels);
  }
}

/** Telemetry through the globally registered API: what a plane made without the option uses. */
export const globalTelemetry: Telemetry = new Telemetry();
