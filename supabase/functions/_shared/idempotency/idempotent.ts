// The whole road in one call: `idempotent()` claims, runs the effect under
// the claim, and ends it (journal, release or leave to its lease), as AWS
// Powertools' `makeIdempotent` does for Lambda; `makeIdempotent()` wraps an
// effect so each call goes through it. Also what an effect sees
// (EffectContext), the throw that says it did nothing (NothingHappened), and
// the vendor key it passes on (vendorKey).

import { type Answer, replayable } from "./answer.ts";
import { PlaneError } from "./errors.ts";
import { requestHash as hashOf, sha256HexOfBytes } from "./hash.ts";
import type { Claim, IdempotencyPlane } from "./plane.ts";
import type { Logger } from "./log.ts";
import { DEFAULT_JOURNAL_DEADLINE_MS, DEFAULT_MARGIN_MS, Timing, withHeartbeat } from "./timing.ts";
import type { Settle, Settled } from "./held.ts";
import { Attempt, EffectDriver, type EffectSpec } from "./driver.ts";

/**
 * Thrown by an effect that knows it did nothing (it failed before reaching
 * its vendor, or the vendor refused it outright): the claim is released and
 * the next attempt runs the effect. Any other throw leaves the claim to its
 * lease, since the effect may have happened.
 */
export class NothingHappened extends Error {
  override readonly name = "NothingHappened";
  /**
   * What an Idempotency-Key handler answers the caller (its claim released,
   * so a retry with the same key runs it again); without one the middleware
   * answers a 500 problem saying so. `idempotent()` ignores it.
   */
  readonly response?: Response;

  constructor(message?: string, options?: { response?: Response; cause?: unknown }) {
    super(message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.response = options?.response;
  }
}

/** What an effect sees. */
export interface EffectContext {
  claim: Claim;
  /** Aborted at the effect's timeout: pass it to fetch. */
  signal: AbortSignal;
  /**
   * Pass this to the vendor as its idempotency key: stable across attempts
   * (a reclaim after a crash sends the same one), distinct across tenants.
   */
  vendorKey: string;
}

/** What `idempotent` answers. */
export type IdempotentResult =
  /** The effect ran now. Answer it only once `settled.ending === "journaled"`. */
  | { status: "ran"; answer: Answer; settled: Settled }
  /** The effect had already happened: its journaled answer. */
  | { status: "replayed"; answer: Answer }
  /** Another worker holds the key; retry after a while. */
  | { status: "in_flight"; leaseExpiresAt: string }
  /** The key was used with another request. */
  | { status: "conflict" }
  /** The effect threw or timed out: released (NothingHappened) or left to its lease. */
  | { status: "failed"; error: unknown; settled: Settled };

/** Options of `idempotent`. */
export interface IdempotentOptions {
  plane: IdempotencyPlane;
  organizationId: string;
  scope: string;
  key: string;
  /** The request, hashed with RFC 8785 (or give `requestHash`). */
  request?: unknown;
  requestHash?: string;
  /** The effect's timeout. */
  timeoutMs?: number;
  /** Or the whole lease: the timeout is what it leaves after the journal deadline and margin. */
  leaseMs?: number;
  journalDeadlineMs?: number;
  marginMs?: number;
  /** Ask again for a lost claim answer up to this long (default: half the timeout). */
  askForMs?: number;
  /**
   * Claims for this short lease (at least 3 s) instead of the whole one, and
   * keeps it alive with a heartbeat every third of it while the effect runs
   * and journals: a worker stopped mid-effect frees the key after this long,
   * a slow live one keeps it. A heartbeat that finds the key taken over
   * aborts the effect's signal, and the result is `failed` with a
   * `lease_lapsed` error (the new holder's ending counts).
   */
  heartbeatLeaseMs?: number;
  log?: Logger;
}

/**
 * Runs `effect` at most once for this key and request, the way AWS
 * Powertools' `makeIdempotent` does for Lambda, with the plane's guarantees:
 * claim, run (cut at its timeout), and journal its answer (business
 * failures included, oversized ones by reference); release when it throws
 * `NothingHappened`; leave the claim to its lease when it throws anything
 * else or times out; replay the journaled answer to duplicates. A first
 * answer (`ran`) is the journaled one, exactly as every replay returns it:
 * `JSON.stringify` of both is the same string.
 *
 * What the effect throws is answered as `failed`, never thrown. What this
 * function throws is a `PlaneError`, always before the effect ran (no claim
 * of this call is held, or the one that may exist is left to its lease):
 *
 * - `kind: "invalid_input"`: the options were refused before any request
 *   (`reason`: a malformed organization, an empty key or one over 512
 *   characters, a malformed scope, `bad_configuration` for a missing
 *   `timeoutMs`/`leaseMs` or two that disagree): a bug or bad input, 400/500;
 * - `kind: "unknown_scope"`: the scope has no policy row in the plane
 *   (IDEM1): a deployment fault, 500;
 * - `isTransient` (`transport`, `deadline`, a 5xx): the plane could not be
 *   reached or answer in time, after the client's own retries: 503, and the
 *   caller retries later with the same key;
 * - anything else (`api`, `decode`, `inconsistent`): the plane answered
 *   something unexpected: 502.
 */
export async function idempotent(
  effect: (context: EffectContext) => Promise<Answer> | Answer,
  options: IdempotentOptions,
): Promise<IdempotentResult> {
  const journalMs = options.journalDeadlineMs ?? DEFAULT_JOURNAL_DEADLINE_MS;
  const marginMs = options.marginMs ?? DEFAULT_MARGIN_MS;
  if (options.timeoutMs === undefined && options.leaseMs === undefined) {
    throw PlaneError.invalid(
      "bad_configuration",
      "idempotent() needs timeoutMs (how long the effect may run) or leaseMs (the whole lease); neither was given",
    );
  }
  const timeoutMs = options.timeoutMs ?? (options.leaseMs as number) - journalMs - marginMs;
  if (
    options.timeoutMs !== undefined && options.leaseMs !== undefined &&
    options.leaseMs !== timeoutMs + journalMs + marginMs
  ) {
    throw PlaneError.invalid("bad_configuration", "give timeoutMs or leaseMs, not two that disagree");
  }
  const timing = withHeartbeat(new Timing(timeoutMs, journalMs, marginMs), options.heartbeatLeaseMs);
  const requestHash = options.requestHash ?? await hashOf(options.request ?? null);
  const driver = new EffectDriver(options.plane, { log: options.log });
  const spec: EffectSpec = {
    organizationId: options.organizationId,
    scope: options.scope,
    key: options.key,
    requestHash,
    timing,
  };
  const attempt = new Attempt();
  const begun = await driver.beginUntil(spec, attempt, attempt.startedAt + (options.askForMs ?? timing.effectMs / 2));
  switch (begun.kind) {
    case "replayed":
      return { status: "replayed", answer: begun.answer };
    case "in_flight":
      return { status: "in_flight", leaseExpiresAt: begun.leaseExpiresAt };
    case "conflict":
      return { status: "conflict" };
    case "held":
      break;
  }
  const held = begun.held;
  const vendor = await vendorKey(held.claim.organizationId, held.claim.scope, held.claim.key);
  const ran = await held.run((signal) => effect({ claim: held.claim, signal, vendorKey: vendor }));
  if ("cut" in ran && ran.cut === "not_started") {
    // The lease could not be confirmed: nothing ran, the claim is left to it.
    return {
      status: "failed",
      error: new PlaneError(
        "deadline",
        "the lease could not be confirmed before the deadline; the effect never started",
      ),
      settled: await held.settle({ unknown: "the lease could not be confirmed; the effect never started" }),
    };
  }
  if ("cut" in ran && ran.cut === "fence_lost") {
    // A heartbeat found the claim taken over: the new holder's ending counts.
    return {
      status: "failed",
      error: new PlaneError("lease_lapsed", "the claim was taken over by another worker; the effect was stopped"),
      settled: await held.settle({ unknown: "the claim was taken over by another worker" }),
    };
  }
  let ended: { value: unknown } | { cut: "threw"; error: unknown } | undefined = "value" in ran || ran.cut === "threw"
    ? ran
    : undefined;
  if (!ended) {
    // Timed out: an effect that ignores its signal may still be running. Wait
    // for it until the journal's deadline has LATE_JOURNAL_RESERVE_MS left
    // (half of it, when shorter) for the journal itself: a value that comes
    // then is the effect's answer; an effect still running is left to its
    // lease, never released.
    ended = await held.late(held.lateDeadline);
    if (!ended) {
      return {
        status: "failed",
        error: new PlaneError("deadline", "the effect did not return within its timeout"),
        settled: await held.settle({ unknown: "timed out, and still running" }),
      };
    }
  }
  if ("value" in ended) {
    if (!isAnswer(ended.value)) {
      const error = PlaneError.invalid(
        "bad_configuration",
        "the effect must return an Answer ({ ok, output, error?, resource? })",
      );
      return {
        status: "failed",
        error,
        settled: await held.settle({ unknown: "the effect returned something that is not an Answer" }),
      };
    }
    // The first answer as the journal holds it, so every replay equals it.
    const answer = replayable(ended.value);
    const settled = await held.settle({ journal: answer });
    return { status: "ran", answer: held.journaled ?? answer, settled };
  }
  const settle: Settle = ended.error instanceof NothingHappened ? "release" : { unknown: "the effect threw" };
  return { status: "failed", error: ended.error, settled: await held.settle(settle) };
}

/**
 * `makeIdempotent(effect, config)`: `effect` wrapped so that each call runs
 * it through `idempotent`, its key (and tenant) taken from its input, and
 * the input itself hashed as the request.
 */
export function makeIdempotent<I>(
  effect: (input: I, context: EffectContext) => Promise<Answer> | Answer,
  config: Omit<IdempotentOptions, "key" | "organizationId" | "request" | "requestHash"> & {
    keyOf: (input: I) => string;
    organizationOf: (input: I) => string;
  },
): (input: I) => Promise<IdempotentResult> {
  return (input: I) =>
    idempotent((context) => effect(input, context), {
      ...config,
      key: config.keyOf(input),
      organizationId: config.organizationOf(input),
      request: input,
    });
}

function isAnswer(value: unknown): value is Answer {
  return value !== null && typeof value === "object" && typeof (value as Answer).ok === "boolean";
}

/** `hex(sha256(organization bytes ":" scope ":" key))`, as the Rust tool guard computes it. */
export async function vendorKey(organizationId: string, scope: string, key: string): Promise<string> {
  const hex = organizationId.replaceAll("-", "");
  const organization = new Uint8Array(16);
  for (let i = 0; i < 16; i++) organization[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  const rest = new TextEncoder().encode(`:${scope}:${key}`);
  const bytes = new Uint8Array(16 + rest.length);
  bytes.set(organization);
  bytes.set(rest, 16);
  return await sha256HexOfBytes(bytes);
}
