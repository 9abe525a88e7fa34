// The webhook gate: the edge adapter at an HTTP boundary, with the Rust
// gate's rules.
//
// A webhook handler is the outermost frame, and a 5xx tells the vendor that a
// delivery which succeeded failed (Slack disables a subscription that answers
// 5xx often enough). So every duplicate ending is an ACK with a counted,
// logged drop reason; none is silent.
//
// The invariant. Once any delivery of an event has been answered 2xx
// (processed, or dropped as a duplicate of a claim in flight or done), the
// event is processed to completion exactly once, or its failure is journaled
// and counted as a drop reason (`processing_aborted`, `dead_lettered`);
// it is never silently lost. A redelivery that meets a live claim is ACKed as
// a duplicate, so the gate never gives up a claim it holds: it never releases
// one. It carries the event to a journaled ending itself:
//
// - processing runs to its own timeout (15 s by default), never cut by the
//   answer's deadline; a retryable failure (`ProcessingError.retryable`) is
//   retried in process, with backoff, within that timeout; what still fails
//   at the end is not journaled (a stored failure would answer every later
//   delivery, even once the downstream is back) but left to its lease with
//   its body, for a re-drive: the lease is its backoff, and the scope's
//   `max_attempts` makes it a dead letter at last. A permanent failure is
//   journaled as the event's answer;
// - the answer leaves within the gate's deadline (2.5 s by default, inside
//   Slack's 3 s window): processing still running then is answered
//   `accepted` (200) and finished after the answer — through the runtime's
//   `waitUntil` (`EdgeRuntime.waitUntil` on Supabase, which keeps a worker up
//   to its wall-clock limit: 150 s on the free plan, 400 s on paid plans;
//   `ctx.waitUntil` on Cloudflare Workers), so the runtime does not stop the
//   work when the response is sent;
// - a claim that does not answer within the deadline is answered 503 (the
//   plane could not decide), and the gate keeps asking with the same lease
//   token: if the database did make the claim, the gate processes the event,
//   so the vendor's redelivery, which meets that claim and is ACKed as a
//   duplicate, is not a loss.
//
// The only non-2xx answers are `retry`: 503 when the gate holds no claim
// (the plane could not decide, or the gate is closing), 413 when the delivery
// is above the gate's body limit or too large to store with its claim
// (below).
//
// The work outlives the worker. Every delivery is claimed together with its
// body, in the same statement, losslessly (`body_text`, or `body_base64` for
// bytes that are not UTF-8 text, or whose JSON text would be longer),
// bounded by the scope's `max_request_bytes`. A delivery above it is never
// acknowledged unstored: 413, unclaimed, so the vendor keeps the event for a
// resend once the limit is raised. A worker stopped while holding a claim
// (wall-clock, CPU or memory limit, early drop) leaves the event in the
// plane: `redrive()`, called from anything on a schedule (a pg_cron job
// calling the function's re-drive route), takes such orphans over once their
// lease passes, with a fresh fence, and runs them through the same `process`
// with the same endings; an event handed out as often as its scope's
// `max_attempts` allows is journaled as `dead_lettered`. With
// `heartbeatLeaseMs` the claim is made for a short lease kept alive by
// heartbeats while processing runs, so a stopped worker's event is re-driven
// within seconds; processing on a worker whose beats no longer reach the
// plane is aborted before its lease can pass, and the event left to
// re-drive. On `beforeunload` the gate stops claiming new deliveries (503)
// and leaves what it holds to re-drive.
//
// One body limit. So that the store never refuses a delivery the gate took,
// a body of n bytes is stored in at most 4 * ceil(n / 3) + 18 bytes of work
// (`storedBodyBound`), whatever its bytes; the gate takes bodies up to
// `bodyLimitBytes` (default 256 KiB) and refuses a larger one 413 before
// anything else (`webhookHandler`: before the signature is checked); and the
// `webhook.*` scope keeps 384 KiB of work, which holds every such body.
// Raise the two together (`idem doctor` checks they agree): the numbers are
// shared with the Rust gate through `webhook_limits.json`.

import { failure, success } from "./answer.ts";
import { readBody } from "./body.ts";
import { sleep } from "./client.ts";
import { monotonicNow } from "./clock.ts";
import { sha256HexOfBytes } from "./hash.ts";
import { codes, PlaneError } from "./errors.ts";
import { DEFAULT_JOURNAL_DEADLINE_MS, Timing } from "./timing.ts";
import { Held, type Settle } from "./held.ts";
import { Attempt, type Begun, EffectDriver, type EffectSpec } from "./driver.ts";
import type { IdempotencyPlane } from "./plane.ts";
import { lookupProviderJob, type ProviderJob } from "./provider_jobs.ts";
import { consoleLogger, type Logger } from "./log.ts";
import limits from "./webhook_limits.json" with { type: "json" };
import { METRICS } from "./telemetry.ts";

/** How long processing one delivery may take, in-process retries included. */
export const DEFAULT_PROCESSING_TIMEOUT_MS = 15_000;
/** How long the gate takes to answer a delivery: inside Slack's 3 s window. */
export const DEFAULT_GATE_DEADLINE_MS = 2_500;
/** Added to make the lease: 15 + 10 + 5 = the 30 s lease `webhook.*` scopes use. */
export const WEBHOOK_LEASE_MARGIN_MS = 5_000;
/** When the vendor makes its last redelivery: Slack's schedule (now, 1 min, 5 min). */
export const DEFAULT_VENDOR_HORIZON_MS = 6 * 60_000;

/**
 * The largest body a gate (and `webhookHandler`) takes, unless told
 * otherwise: 256 KiB (262,144 bytes), the Rust gate's too
 * (`webhook_limits.json`). Vendors' event payloads are typically a few KiB
 * (Stripe's, Slack's, those sent through Svix), so this leaves a large one
 * room many times over, and every body up to it fits the `webhook.*`
 * scope's `WEBHOOK_SCOPE_MAX_REQUEST_BYTES` as its claim stores it, so none
 * is refused for good by the store after the gate took it. A sender whose
 * events can be larger (GitHub's reach 25 MB, Nylas's 1 MB) needs both
 * raised together: `bodyLimitBytes` and the scope's `max_request_bytes`
 * (at least `storedBodyBound(bodyLimitBytes)`, in a migration).
 */
export const DEFAULT_WEBHOOK_BODY_LIMIT_BYTES: number = limits.body_limit_bytes;

/**
 * The `max_request_bytes` of the `webhook.*` scope the plane ships: 384 KiB
 * (393,216 bytes), enough for any body up to DEFAULT_WEBHOOK_BODY_LIMIT_BYTES
 * as its claim stores it (at most 349,546 bytes).
 */
export const WEBHOOK_SCOPE_MAX_REQUEST_BYTES: number = limits.webhook_scope_max_request_bytes;

/** The bytes `{"body_base64":""}` adds to a body's base64. */
const BASE64_WRAPPER_BYTES = 18;
/** The bytes `{"body_text":""}` adds to a body's escaped text. */
const TEXT_WRAPPER_BYTES = 16;

/**
 * The most bytes a body of `bodyBytes` bytes takes as its claim stores it,
 * counted as the plane counts work (compact JSON): its base64 and the
 * wrapper, 4 * ceil(n / 3) + 18. The text form is used only when no longer.
 */
export function storedBodyBound(bodyBytes: number): number {
  return 4 * Math.ceil(bodyBytes / 3) + BASE64_WRAPPER_BYTES;
}

/**
 * The largest body every one of whose byte strings a scope keeping
 * `maxRequestBytes` of work stores: 3 * floor((maxRequestBytes - 18) / 4)
 * (49,137 bytes for 64 KiB, 294,897 for 384 KiB).
 */
export function largestStorableBody(maxRequestBytes: number): number {
  return 3 * Math.floor(Math.max(0, maxRequestBytes - BASE64_WRAPPER_BYTES) / 4);
}

const FIRST_PROCESSING_BACKOFF_MS = 100;
const MAX_PROCESSING_BACKOFF_MS = 2_000;

/** Why a delivery was acknowledged without being processed now. */
export type DropReason =
  /** Handled already, or being handled right now by another worker. */
  | "duplicate"
  /** The delivery id was seen with a different body. */
  | "hash_mismatch"
  /** The callback path names a job this platform does not hold. */
  | "unknown_job"
  /** The body names a different job than the path. */
  | "job_mismatch"
  /** The delivery id cannot be claimed at all (empty, too long, NUL). */
  | "invalid_delivery"
  /** Processing threw something other than a ProcessingError, or overran its timeout; journaled. */
  | "processing_aborted"
  /** A re-drive found the event handed out as often as its scope's `max_attempts` allows: journaled as a failure. */
  | "dead_lettered";

/** The most characters of a failure a `failed` ack carries (its whole text is journaled). */
export const FAILED_ACK_ERROR_CHARS = 200;

/** Why a claim whose processing kept failing retryably is left to its lease. */
const LEFT_FOR_REDRIVE = "processing kept failing; left for a re-drive";

/** What the gate answers the vendor. */
export type Ack =
  /** Processed, and its success journaled: 200. */
  | { ack: "processed"; status: 200 }
  /**
   * Processed, and it failed for good (a `ProcessingError` that is not
   * retryable): the failure is journaled as the event's answer and the
   * vendor is told it failed in a 2xx, so it stops delivering it (every
   * redelivery would replay the failure); `idem redrive --failed` sends it
   * back once the cause is fixed. `error` is the failure, cut to
   * FAILED_ACK_ERROR_CHARS characters: 200.
   */
  | { ack: "failed"; status: 200; error: string }
  /**
   * Claimed and held by the plane with its body, not yet journaled: still
   * processing at the deadline (it goes on after the answer), or processing
   * kept failing retryably and the event is left for a re-drive: 200.
   */
  | { ack: "accepted"; status: 200 }
  /** Not processed now, with a counted reason: 200. */
  | { ack: "dropped"; status: 200; reason: DropReason }
  /** The gate holds no claim (the plane could not decide): 503, redeliver. */
  | { ack: "retry"; status: 503; reason: "plane_unavailable" }
  /**
   * The delivery is larger (or nests deeper) than its scope's
   * `max_request_bytes` lets a claim carry: never acknowledged unstored (no
   * other worker could finish it), so 413, and the vendor keeps the event
   * for a resend once the limit is raised.
   */
  | { ack: "retry"; status: 413; reason: "delivery_too_large" }
  /** The worker is shutting down (`beforeunload`, `close()`): nothing claimed, 503, redeliver. */
  | { ack: "retry"; status: 503; reason: "closing" };

/** An event a re-drive handed to this worker: what its first delivery carried. */
export interface Redelivery {
  organizationId: string;
  scope: string;
  deliveryId: string;
  /** The body exactly as first delivered (and verified). */
  body: Uint8Array;
  /** Which attempt this is: 2 for the first re-drive. */
  attempt: number;
}

/** What one re-drive did. */
export interface RedriveReport {
  /** Orphans taken over and run through `process`. */
  redriven: number;
  /** Of those, journaled (processed, or failed for good). */
  journaled: number;
  /** Orphans journaled as dead letters (their scope's `max_attempts` reached). */
  deadLettered: number;
  /** Taken over but not journaled: re-driven again once the lease given to them passes. */
  left: number;
}

/** A failure of processing. `retryable` ones are tried again in process, within the timeout. */
export class ProcessingError extends Error {
  override readonly name = "ProcessingError";
  readonly retryable: boolean;

  constructor(message: string, options: { retryable: boolean }) {
    super(message);
    this.retryable = options.retryable;
  }

  /** Nothing happened; trying again may help. */
  static retryable(message: string): ProcessingError {
    return new ProcessingError(message, { retryable: true });
  }

  /** Trying again will not help: journaled as the event's answer. */
  static permanent(message: string): ProcessingError {
    return new ProcessingError(message, { retryable: false });
  }
}

/** One delivery: the tenant, the vendor's scope (`webhook.slack`), its delivery id and body. */
export interface Delivery {
  organizationId: string;
  scope: string;
  deliveryId: string;
  body: Uint8Array | string;
}

/** A provider callback: the tenant is found from `agent.provider_jobs` before the claim. */
export interface ProviderCallback {
  provider: string;
  /** The job id in the callback's path. */
  pathJobId: string;
  /** The job id the body names, if any: must match the path's. */
  bodyJobId?: string;
  deliveryId: string;
  body: Uint8Array | string;
}

export type { ProviderJob } from "./provider_jobs.ts";

/** Options of a gate. */
export interface GateOptions {
  /** How long the answer may take. Default 2.5 s. */
  deadlineMs?: number;
  processingTimeoutMs?: number;
  journalDeadlineMs?: number;
  marginMs?: number;
  /** When the vendor redelivers for the last time; the lease must pass before. Default 6 min. */
  vendorHorizonMs?: number;
  /**
   * The largest body the gate takes, in bytes (default 256 KiB,
   * DEFAULT_WEBHOOK_BODY_LIMIT_BYTES): a larger one is answered 413
   * (`delivery_too_large`) before anything else, never looked up or claimed,
   * and `webhookHandler` refuses it before reading past the limit or
   * verifying its signature. Keep the scope's `max_request_bytes` at least
   * `storedBodyBound(bodyLimitBytes)` so every body taken can be stored.
   */
  bodyLimitBytes?: number;
  /**
   * Claims for this short lease (at least 3 s) kept alive by heartbeats while
   * processing and its journal run, instead of the whole processing timeout:
   * a worker that is stopped is re-driven after it, while a live one keeps
   * its claim as long as its own deadlines allow. Processing whose lease no
   * beat could confirm in time (the plane unreachable) has its signal
   * aborted before the lease can pass, and the event is left to re-drive.
   */
  heartbeatLeaseMs?: number;
  /**
   * Stops starting new work when the runtime announces shutdown
   * (`beforeunload`, which Supabase's Edge Runtime dispatches): deliveries
   * are answered 503 unclaimed, and held claims are left to re-drive.
   * Default true where the runtime has `addEventListener`.
   */
  closeOnBeforeUnload?: boolean;
  /**
   * Keeps work running after the response: `EdgeRuntime.waitUntil` on
   * Supabase (found by itself when present), `ctx.waitUntil` on Workers.
   * Without one (Deno, Node) the work simply goes on in the process.
   */
  waitUntil?: (work: Promise<unknown>) => void;
  log?: Logger;
}

/** The webhook gate. One per process; it counts its drops. */
export class WebhookGate {
  readonly driver: EffectDriver;
  readonly timing: Timing;
  readonly deadlineMs: number;
  /** The largest body the gate takes, in bytes. */
  readonly bodyLimitBytes: number;
  readonly #waitUntil?: (work: Promise<unknown>) => void;
  readonly #log: Logger;
  readonly #drops = new Map<DropReason, number>();
  #closing = false;

  constructor(plane: IdempotencyPlane, options: GateOptions = {}) {
    this.#log = options.log ?? consoleLogger("warn");
    this.driver = new EffectDriver(plane, { log: this.#log });
    this.timing = new Timing(
      options.processingTimeoutMs ?? DEFAULT_PROCESSING_TIMEOUT_MS,
      options.journalDeadlineMs ?? DEFAULT_JOURNAL_DEADLINE_MS,
      options.marginMs ?? WEBHOOK_LEASE_MARGIN_MS,
    );
    if (options.heartbeatLeaseMs !== undefined) this.timing = this.timing.withHeartbeats(options.heartbeatLeaseMs);
    this.timing.check(options.vendorHorizonMs ?? DEFAULT_VENDOR_HORIZON_MS);
    const target = globalThis as { addEventListener?: (type: string, listener: () => void) => void };
    if ((options.closeOnBeforeUnload ?? true) && typeof target.addEventListener === "function") {
      target.addEventListener("beforeunload", () => this.close());
    }
    this.deadlineMs = options.deadlineMs ?? DEFAULT_GATE_DEADLINE_MS;
    if (!(this.deadlineMs > 0)) throw PlaneError.invalid("zero_duration", "the gate's deadline must be above zero");
    this.bodyLimitBytes = checkedBodyLimit(options.bodyLimitBytes ?? DEFAULT_WEBHOOK_BODY_LIMIT_BYTES);
    this.#waitUntil = options.waitUntil ?? edgeRuntimeWaitUntil();
  }

  /**
   * Stops starting new work: every later delivery is answered 503 without a
   * claim (the vendor redelivers to a live worker), and claims held now are
   * finished if the worker lives long enough, or re-driven if it does not.
   */
  close(): void {
    if (!this.#closing) this.#log({ event: "webhook.closing", level: "warn" });
    this.#closing = true;
  }

  /** The lease every claim takes: processing timeout + journal deadline + margin (or the heartbeat lease). */
  get leaseMs(): number {
    return this.timing.leaseMs;
  }

  /** How many deliveries were dropped for `reason`. */
  drops(reason: DropReason): number {
    return this.#drops.get(reason) ?? 0;
  }

  /**
   * Claims the delivery and processes it once. `process` may be called again
   * after a retryable ProcessingError; its value is journaled as the event's
   * answer (as JSON). Its `signal` aborts at the processing timeout, and with
   * heartbeats when a beat finds the claim taken over or none could confirm
   * the lease in time (pass it to fetch): what it gives after that is never
   * journaled. A body above `bodyLimitBytes` is answered 413 first, unclaimed.
   */
  async handle(delivery: Delivery, process: (signal: AbortSignal) => Promise<unknown>): Promise<Ack> {
    const refused = this.#refuseAboveLimit(delivery.scope, delivery.body);
    if (refused) return refused;
    return await this.#handleBy(monotonicNow() + this.deadlineMs, delivery, process);
  }

  /** The 413 a body above the body limit gets, before anything else. */
  #refuseAboveLimit(scope: string, body: Uint8Array | string): Ack | undefined {
    const bytes = typeof body === "string" ? new TextEncoder().encode(body).length : body.length;
    if (bytes <= this.bodyLimitBytes) return undefined;
    this.#log({
      event: "webhook.body_too_large",
      level: "warn",
      scope,
      body_bytes: bytes,
      limit_bytes: this.bodyLimitBytes,
    });
    return { ack: "retry", status: 413, reason: "delivery_too_large" };
  }

  /**
   * A provider's callback: its tenant is the one `agent.provider_jobs` holds
   * for the job (an unknown job is dropped, a body naming another job too),
   * in scope `webhook.<provider>`. A body above `bodyLimitBytes` is answered
   * 413 first, before the lookup.
   */
  async handleProviderCallback(
    callback: ProviderCallback,
    process: (job: ProviderJob, signal: AbortSignal) => Promise<unknown>,
  ): Promise<Ack> {
    const refused = this.#refuseAboveLimit(`webhook.${callback.provider}`, callback.body);
    if (refused) return refused;
    const answerBy = monotonicNow() + this.deadlineMs;
    let job: ProviderJob | undefined;
    try {
      job = await this.#lookup(callback.provider, callback.pathJobId, answerBy - monotonicNow());
    } catch (error) {
      return this.#unavailable(error);
    }
    if (!job) return this.#drop("unknown_job");
    if (callback.bodyJobId !== undefined && callback.bodyJobId !== callback.pathJobId) {
      return this.#drop("job_mismatch");
    }
    const found = job;
    return await this.#handleBy(answerBy, {
      organizationId: found.organizationId,
      scope: `webhook.${callback.provider}`,
      deliveryId: callback.deliveryId,
      body: callback.body,
    }, (signal) => process(found, signal));
  }

  /**
   * Takes over up to `limit` orphaned events of `scope` (or a family,
   * `webhook.*`; default this gate's deliveries' family) and runs each
   * through `process`, concurrently, with a delivery's endings: retried in
   * process while retryable within the processing timeout, journaled, kept
   * alive by heartbeats when the gate has them. An event past its scope's
   * `max_attempts` comes back journaled as a dead letter (counted as
   * `dead_lettered`). A limit above the plane's `maxRows` is refused.
   * `signal` aborts as `handle`'s does.
   */
  async redrive(
    request: { scope: string; limit: number; organizationId?: string },
    process: (redelivery: Redelivery, signal: AbortSignal) => Promise<unknown>,
  ): Promise<RedriveReport> {
    const startedAt = monotonicNow();
    const taken = await this.driver.plane.redrive({ ...request, leaseMs: this.timing.leaseMs });
    const report: RedriveReport = { redriven: 0, journaled: 0, deadLettered: 0, left: 0 };
    const running: Promise<boolean>[] = [];
    for (const work of taken) {
      if (work.outcome === "dead_lettered") {
        report.deadLettered += 1;
        this.#drop("dead_lettered");
        continue;
      }
      report.redriven += 1;
      const held = new Held(this.driver, work.claim, { startedAt }, this.timing, { attempt: work.attempt });
      running.push(this.#carryAgain(held, work.request, work.attempt, process));
    }
    for (const journaled of await Promise.all(running)) {
      if (journaled) report.journaled += 1;
      else report.left += 1;
    }
    this.#log({ event: "webhook.redrive", scope: request.scope, ...report });
    return report;
  }

  async #carryAgain(
    held: Held,
    stored: unknown,
    attempt: number,
    process: (redelivery: Redelivery, signal: AbortSignal) => Promise<unknown>,
  ): Promise<boolean> {
    const body = bodyOf(stored);
    if (body === undefined) {
      this.#log({
        event: "webhook.unknown_work",
        level: "error",
        scope: held.claim.scope,
        delivery_id: held.claim.key,
      });
      await held.settle({ unknown: "the claim carries work this gate did not store" });
      return false;
    }
    const redelivery: Redelivery = {
      organizationId: held.claim.organizationId,
      scope: held.claim.scope,
      deliveryId: held.claim.key,
      body,
      attempt,
    };
    const [settle, dropped] = await this.#processToAnAnswer(held, (signal) => process(redelivery, signal));
    const settled = await held.settle(settle);
    if (settled.ending !== "journaled") return false;
    if (dropped) this.#drop(dropped);
    return true;
  }

  async #lookup(provider: string, jobId: string, deadlineMs: number): Promise<ProviderJob | undefined> {
    return await lookupProviderJob(this.driver.plane, provider, jobId, { deadlineMs: Math.max(1, deadlineMs) });
  }

  async #handleBy(
    answerBy: number,
    delivery: Delivery,
    process: (signal: AbortSignal) => Promise<unknown>,
  ): Promise<Ack> {
    if (this.#closing) {
      this.#log({ event: "webhook.closing", level: "warn", scope: delivery.scope, delivery_id: delivery.deliveryId });
      return { ack: "retry", status: 503, reason: "closing" };
    }
    let closed = false;
    let resolve!: (ack: Ack) => void;
    const answered = new Promise<Ack>((r) => (resolve = r));
    // Sends the answer once; false when the answer had left already.
    const say = (ack: Ack): boolean => {
      if (closed) return false;
      closed = true;
      resolve(ack);
      return true;
    };
    const state = { held: false };
    const carried = this.#carry(delivery, process, say, state).catch((error) => {
      this.#log({
        event: "webhook.carry_failed",
        level: "error",
        scope: delivery.scope,
        delivery_id: delivery.deliveryId,
        error: String(error),
      });
      say(this.#unavailable(error, { scope: delivery.scope, key: delivery.deliveryId }));
    });
    this.#waitUntil?.(carried);
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<undefined>((
      r,
    ) => (timer = setTimeout(() => r(undefined), Math.max(0, answerBy - monotonicNow()))));
    const ack = await Promise.race([answered, late]);
    clearTimeout(timer);
    if (ack) return ack;
    closed = true;
    if (state.held) {
      this.#log({
        event: "webhook.accepted",
        scope: delivery.scope,
        delivery_id: delivery.deliveryId,
        ack: "accepted",
      });
      return { ack: "accepted", status: 200 };
    }
    this.#log({
      event: "webhook.undecided",
      level: "warn",
      scope: delivery.scope,
      delivery_id: delivery.deliveryId,
      ack: "retry",
    });
    return { ack: "retry", status: 503, reason: "plane_unavailable" };
  }

  async #carry(
    delivery: Delivery,
    process: (signal: AbortSignal) => Promise<unknown>,
    say: (ack: Ack) => boolean,
    state: { held: boolean },
  ): Promise<void> {
    const bytes = typeof delivery.body === "string" ? new TextEncoder().encode(delivery.body) : delivery.body;
    const spec: EffectSpec = {
      organizationId: delivery.organizationId,
      scope: delivery.scope,
      key: delivery.deliveryId,
      requestHash: await sha256HexOfBytes(bytes),
      timing: this.timing,
      work: storedBody(bytes),
    };
    const held = await this.#claim(spec, say);
    if (!held) return;
    state.held = true;
    const [settle, dropped] = await this.#processToAnAnswer(held, process);
    const left = typeof settle === "object" && "unknown" in settle;
    const settled = await held.settle(settle);
    if (settled.ending !== "journaled" && !left) {
      this.#log({
        event: "webhook.not_journaled",
        level: "error",
        scope: spec.scope,
        delivery_id: spec.key,
        ending: settled.ending,
      });
    }
    // A failure journaled with its reason is counted whether or not the
    // vendor still hears the answer: it is the event's record. An event left
    // for a re-drive is held by the plane with its body: accepted.
    if (dropped) say(this.#drop(dropped));
    else if (left) say({ ack: "accepted", status: 200 });
    else if (typeof settle === "object" && "journal" in settle && !settle.journal.ok) {
      const error = [...(settle.journal.error ?? "failed")].slice(0, FAILED_ACK_ERROR_CHARS).join("");
      say({ ack: "failed", status: 200, error });
    } else say({ ack: "processed", status: 200 });
  }

  async #claim(spec: EffectSpec, say: (ack: Ack) => boolean): Promise<Held | undefined> {
    const attempt = new Attempt();
    // Ask while an answer could still be journaled before the lease passes.
    const askUntil = attempt.startedAt + this.timing.effectMs + this.timing.journalMs / 2;
    let begun: Begun | undefined;
    let error: unknown;
    try {
      begun = await this.driver.begin(spec, attempt, Math.max(1, askUntil - monotonicNow()));
    } catch (caught) {
      error = caught;
    }
    let answered = false;
    if (error instanceof PlaneError && error.mayHaveWritten) {
      // The vendor hears now; the gate keeps asking as the same attempt.
      say(this.#unavailable(error, spec));
      answered = true;
      try {
        begun = await this.driver.beginUntil(spec, attempt, askUntil);
        error = undefined;
      } catch (caught) {
        error = caught;
      }
    }
    if (begun) {
      if (begun.kind === "held") return begun.held;
      if (answered) {
        this.#log({ event: "webhook.late_claim", scope: spec.scope, delivery_id: spec.key, outcome: begun.kind });
        return undefined;
      }
      if (begun.kind === "replayed" || begun.kind === "in_flight") {
        this.#sayDrop(say, "duplicate", begun.kind === "replayed");
      } else this.#sayDrop(say, "hash_mismatch", false);
      return undefined;
    }
    if (
      error instanceof PlaneError && (error.code === codes.REQUEST_TOO_LARGE || error.code === codes.REQUEST_TOO_DEEP)
    ) {
      this.#log({
        event: "webhook.too_large",
        level: "error",
        scope: spec.scope,
        delivery_id: spec.key,
        error: error.message,
      });
      if (!answered) say({ ack: "retry", status: 413, reason: "delivery_too_large" });
      return undefined;
    }
    if (
      error instanceof PlaneError && error.kind === "invalid_input" &&
      ["empty_key", "key_too_long", "key_has_nul"].includes(error.reason ?? "")
    ) {
      this.#log({ event: "webhook.invalid_delivery", level: "warn", scope: spec.scope, error: error.message });
      this.#sayDrop(say, "invalid_delivery", false);
      return undefined;
    }
    if (!answered) say(this.#unavailable(error, spec));
    return undefined;
  }

  #sayDrop(say: (ack: Ack) => boolean, reason: DropReason, replayed: boolean): void {
    // A drop is counted where it is answered: one the vendor never heard is none.
    if (say({ ack: "dropped", status: 200, reason })) this.#drop(reason, replayed);
  }

  async #processToAnAnswer(
    held: Held,
    process: (signal: AbortSignal) => Promise<unknown>,
  ): Promise<[Settle, DropReason | undefined]> {
    let backoff = FIRST_PROCESSING_BACKOFF_MS;
    for (;;) {
      const ran = await held.run((signal) => process(signal));
      if ("value" in ran) return [{ journal: success(ran.value === undefined ? null : ran.value) }, undefined];
      if (ran.cut === "fence_lost") {
        // Another worker (a re-driver, or a redelivery after our lease passed)
        // carries the event now: its ending is the one that counts.
        this.#log({
          event: "webhook.processing_cut",
          level: "warn",
          scope: held.claim.scope,
          delivery_id: held.claim.key,
          why: "taken over by another worker",
        });
        return [{ unknown: "the claim was taken over by another worker" }, undefined];
      }
      if (ran.cut === "lease_unconfirmed") {
        // This worker cannot reach the plane: processing was stopped before
        // the lease could pass. The event and its body wait for a re-drive,
        // whose ending counts; nothing of this run is journaled.
        this.#log({
          event: "webhook.processing_cut",
          level: "warn",
          scope: held.claim.scope,
          delivery_id: held.claim.key,
          why: "the lease could not be confirmed",
        });
        return [
          { unknown: "the lease could not be confirmed (no heartbeat answered); processing was stopped" },
          undefined,
        ];
      }
      if (ran.cut === "not_started") {
        // Nothing ran: the event and its body wait for a re-drive.
        this.#log({
          event: "webhook.left_for_redrive",
          level: "warn",
          scope: held.claim.scope,
          delivery_id: held.claim.key,
          outcome: "left_for_redrive",
          error: "processing never started: its timeout passed before the claim was answered or its lease confirmed",
        });
        return [{ unknown: "processing never started: its timeout passed first" }, undefined];
      }
      if (ran.cut === "timed_out") {
        this.#log({
          event: "webhook.processing_cut",
          level: "error",
          scope: held.claim.scope,
          delivery_id: held.claim.key,
          why: "timed out",
        });
        return [{ journal: failure("processing_timed_out") }, "processing_aborted"];
      }
      const error = ran.error;
      if (!(error instanceof ProcessingError)) {
        this.#log({
          event: "webhook.processing_cut",
          level: "error",
          scope: held.claim.scope,
          delivery_id: held.claim.key,
          why: String(error),
        });
        return [{ journal: failure("processing_threw") }, "processing_aborted"];
      }
      if (!error.retryable) return [{ journal: failure(error.message) }, undefined];
      if (monotonicNow() + backoff < held.effectDeadline) {
        this.#log({
          event: "webhook.processing_retry",
          level: "info",
          scope: held.claim.scope,
          delivery_id: held.claim.key,
          error: error.message,
          backoff_ms: backoff,
        });
        await sleep(backoff);
        backoff = Math.min(backoff * 2, MAX_PROCESSING_BACKOFF_MS);
        continue;
      }
      // Journaling this failure would answer every later delivery with it,
      // even once the downstream is back. The event and its body stay in the
      // plane instead: a re-drive takes it over once the lease passes (that
      // wait is its backoff), and the scope's max_attempts makes it a dead
      // letter at last.
      this.#log({
        event: "webhook.left_for_redrive",
        level: "warn",
        scope: held.claim.scope,
        delivery_id: held.claim.key,
        error: error.message,
        outcome: "left_for_redrive",
      });
      return [{ unknown: LEFT_FOR_REDRIVE }, undefined];
    }
  }

  #drop(reason: DropReason, replayed = false): Ack {
    this.#drops.set(reason, this.drops(reason) + 1);
    this.driver.plane.telemetry.count(METRICS.webhookDrops, { reason });
    this.#log({ event: "webhook.dropped", level: "info", drop_reason: reason, replayed });
    return { ack: "dropped", status: 200, reason };
  }

  #unavailable(error: unknown, where: { scope?: string; key?: string } = {}): Ack {
    this.#log({
      event: "webhook.unavailable",
      level: "error",
      scope: where.scope,
      delivery_id: where.key,
      error: error instanceof Error ? error.message : String(error),
    });
    return { ack: "retry", status: 503, reason: "plane_unavailable" };
  }
}

/** What a webhook endpoint takes from each request. */
export interface WebhookRoute {
  gate: WebhookGate;
  /** The vendor's scope, e.g. `webhook.slack` (needs a policy row: `webhook.*` is seeded). */
  scope: string;
  /**
   * Checks the delivery's signature (e.g. with the `standardwebhooks`
   * package) before anything else looks at it: false or a throw answers 401
   * with a fixed message (the throw's text goes to the gate's log only, as a
   * `webhook.rejected` event), and the delivery is never claimed.
   */
  verify?: (request: Request, body: Uint8Array) => boolean | Promise<boolean>;
  /** The tenant the delivery belongs to (after you verified the vendor's signature). */
  organizationOf: (request: Request, body: Uint8Array) => string | Promise<string>;
  /** The vendor's delivery id (Slack's `event_id`, a header such as `webhook-id`). */
  deliveryIdOf: (request: Request, body: Uint8Array) => string | Promise<string>;
  /**
   * Processes the event once; its value is journaled. Throw ProcessingError
   * to fail. `signal` aborts as `WebhookGate.handle`'s does: pass it to fetch.
   */
  process: (event: { request: Request; body: Uint8Array; signal: AbortSignal }) => Promise<unknown>;
  /**
   * The largest body read, in bytes (default the gate's `bodyLimitBytes`,
   * 256 KiB unless set there): a larger one is refused 413 before anything
   * else sees it, the signature unchecked. Set the limit on the gate
   * (`GateOptions.bodyLimitBytes`), which holds it for every route; one
   * above the gate's is still refused 413 by the gate, after `verify`.
   */
  bodyLimitBytes?: number;
}

/** Why `webhookHandler` refused a request before the gate saw it. */
type Rejection = "body_too_large" | "body_unreadable" | "signature_invalid" | "delivery_unreadable" | "no_event_id";

/** The fixed answer to a refused request: never the application's error text. */
function rejected(reason: Rejection, limit: number): Response {
  const [status, error] = reason === "body_too_large"
    ? [413, `the body is larger than this endpoint reads (${limit} bytes)`]
    : reason === "body_unreadable"
    ? [400, "the body could not be read"]
    : reason === "signature_invalid"
    ? [401, "the delivery's signature could not be verified"]
    : reason === "no_event_id"
    ? [400, "the delivery names no event id, so it cannot be processed exactly once"]
    : [400, "the delivery's tenant or delivery id could not be read from it"];
  return Response.json({ ack: "rejected", reason, error }, { status });
}

/**
 * A `(Request) => Response` handler over the gate: 200 with
 * `{"ack": …, "drop_reason"?: …}` for every ending the gate holds a claim on
 * or drops, 503 with `Retry-After` when the plane could not decide.
 *
 * The body is read up to the limit first (the gate's `bodyLimitBytes`,
 * 256 KiB by default, what the `webhook.*` scope always stores), before the
 * signature is checked: one whose Content-Length is above it is refused 413
 * unread, and one that passes it while streaming is refused 413 as soon as
 * it does, its stream cancelled. What the
 * application's `organizationOf` or `deliveryIdOf` throws is refused 400
 * with a fixed message: its text (which may say what the sender should not
 * learn) goes to the gate's log only, as a `webhook.rejected` event.
 */
export function webhookHandler(route: WebhookRoute): (request: Request) => Promise<Response> {
  const limit = checkedBodyLimit(route.bodyLimitBytes ?? route.gate.bodyLimitBytes);
  const log = route.gate.driver.log;
  const reject = (reason: Rejection, fields: Record<string, unknown> = {}): Response => {
    log({ event: "webhook.rejected", level: "warn", scope: route.scope, reason, limit_bytes: limit, ...fields });
    return rejected(reason, limit);
  };
  return async (request: Request) => {
    const declared = declaredLength(request.headers);
    if (declared !== undefined && declared > limit) {
      request.body?.cancel().catch(() => {});
      return reject("body_too_large", { content_length: declared });
    }
    const read = await readBody(request.body, limit);
    if ("tooLarge" in read) return reject("body_too_large");
    if ("broke" in read) return reject("body_unreadable", { error: errorText(read.broke) });
    // Read without a deadline, a body is never late.
    if (!("bytes" in read)) return reject("body_unreadable");
    const body = read.bytes;
    if (route.verify) {
      let verified = false;
      try {
        verified = await route.verify(request, body);
      } catch (error) {
        return reject("signature_invalid", { error: errorText(error) });
      }
      if (verified !== true) return reject("signature_invalid");
    }
    let organizationId: string;
    let deliveryId: string;
    try {
      organizationId = await route.organizationOf(request, body);
      deliveryId = await route.deliveryIdOf(request, body);
    } catch (error) {
      return reject("delivery_unreadable", { error: errorText(error) });
    }
    // Without its id an event cannot be told from its redeliveries: refused,
    // so the vendor sees the failure, rather than acknowledged and dropped.
    if (typeof deliveryId !== "string" || deliveryId === "") return reject("no_event_id");
    const ack = await route.gate.handle(
      { organizationId, scope: route.scope, deliveryId, body },
      (signal) => route.process({ request, body, signal }),
    );
    const payload = ack.ack === "dropped"
      ? { ack: ack.ack, drop_reason: ack.reason }
      : ack.ack === "failed"
      ? { ack: ack.ack, error: ack.error }
      : ack.ack === "retry" && ack.reason !== "plane_unavailable"
      ? { ack: ack.ack, reason: ack.reason }
      : { ack: ack.ack };
    const headers: Record<string, string> = ack.status === 503 ? { "Retry-After": "1" } : {};
    return Response.json(payload, { status: ack.status, headers });
  };
}

/** The body limit, refused unless a whole number of bytes. */
function checkedBodyLimit(limit: number): number {
  if (!Number.isSafeInteger(limit) || limit < 0) {
    throw PlaneError.invalid(
      "bad_configuration",
      `the webhook body limit must be a whole number of bytes, got ${limit}`,
    );
  }
  return limit;
}

/** The Content-Length a request declares, when it declares a well-formed one. */
function declaredLength(headers: Headers): number | undefined {
  const value = headers.get("content-length")?.trim();
  if (value === undefined || !/^[0-9]+$/.test(value)) return undefined;
  return Number(value);
}

function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** Supabase's `EdgeRuntime.waitUntil`, when this runs there. */
function edgeRuntimeWaitUntil(): ((work: Promise<unknown>) => void) | undefined {
  const runtime = (globalThis as { EdgeRuntime?: { waitUntil?: (work: Promise<unknown>) => void } }).EdgeRuntime;
  return typeof runtime?.waitUntil === "function" ? (work) => runtime.waitUntil!(work) : undefined;
}

/**
 * A delivery's body as its claim stores it, losslessly: `{"body_text": …}`
 * for UTF-8 without U+0000 (which `jsonb` cannot hold) whose JSON text is no
 * longer than its base64 would be, `{"body_base64": …}` for anything else,
 * so it never takes more than `storedBodyBound(bytes.length)`. The Rust
 * gate's keys and choice, so either re-drives the other's.
 */
export function storedBody(bytes: Uint8Array): { body_text: string } | { body_base64: string } {
  let text: string | undefined;
  try {
    text = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(bytes);
  } catch {
    text = undefined;
  }
  if (text !== undefined && !text.includes("\0") && textStoredBytes(bytes) <= storedBodyBound(bytes.length)) {
    return { body_text: text };
  }
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return { body_base64: btoa(binary) };
}

/** The bytes escaped in two in JSON text: `"`, `\`, and the control characters with a short escape (`\n`). */
const SHORT_ESCAPES = new Set([0x22, 0x5c, 0x08, 0x0c, 0x0a, 0x0d, 0x09]);

/**
 * The bytes `{"body_text": …}` of a UTF-8 body takes as compact JSON, as
 * PostgreSQL writes `jsonb` (and `JSON.stringify`): `"` and `\` and the
 * control characters with a short escape take two bytes, the other control
 * characters six (`\u001f`), every other byte one.
 */
function textStoredBytes(bytes: Uint8Array): number {
  let size = TEXT_WRAPPER_BYTES;
  for (const byte of bytes) size += SHORT_ESCAPES.has(byte) ? 2 : byte < 0x20 ? 6 : 1;
  return size;
}

/** The bytes a stored body holds; undefined for anything a gate did not store. */
export function bodyOf(stored: unknown): Uint8Array | undefined {
  if (stored === null || typeof stored !== "object" || Array.isArray(stored)) return undefined;
  const members = Object.entries(stored);
  if (members.length !== 1) return undefined;
  const [[key, value]] = members;
  if (typeof value !== "string") return undefined;
  if (key === "body_text") return new TextEncoder().encode(value);
  if (key !== "body_base64") return undefined;
  try {
    return Uint8Array.from(atob(value), (char) => char.charCodeAt(0));
  } catch {
    return undefined;
  }
}
