// The whole road in one call: `idempotent()` claims, runs the effect under
// the claim, and ends it (journal, release or leave to its lease, decided in
// run_effect.ts), as AWS Powertools' `makeIdempotent` does for Lambda;
// `makeIdempotent()` wraps an effect so each call goes through it.

import type { Answer } from "./answer.ts";
import { PlaneError } from "./errors.ts";
import { requestHash as hashOf } from "./hash.ts";
import type { IdempotencyPlane } from "./plane.ts";
import type { Logger } from "./log.ts";
import { DEFAULT_JOURNAL_DEADLINE_MS, DEFAULT_MARGIN_MS, Timing, withHeartbeat } from "./timing.ts";
import type { Settled } from "./held.ts";
import { Attempt, EffectDriver, type EffectSpec } from "./driver.ts";
import { type EffectContext, type NoAnswer, runAndEnd } from "./run_effect.ts";

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
  /**
   * The effect gave no answer to journal (`why`: it threw, timed out, or was
   * stopped by a heartbeat): released (NothingHappened) or left to its lease.
   */
  | { status: "failed"; why: NoAnswer; error: unknown; settled: Settled };

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
   * a slow live one keeps it. The effect's signal is aborted and the result
   * is `failed` (a `lease_lapsed` error, the claim left to its lease) when a
   * heartbeat finds the key taken over (`why: "fence_lost"`; the new holder's
   * ending counts), or when no beat could confirm the lease in time
   * (`why: "lease_unconfirmed"`: the plane is unreachable, and the effect is
   * stopped before another worker can take the key over).
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
  const ended = await runAndEnd(begun.held, effect);
  return ended.status === "ran"
    ? ended
    : { status: "failed", why: ended.why, error: ended.error, settled: ended.settled };
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
