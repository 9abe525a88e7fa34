// An effect run under a claim this worker holds, and the claim ended by what
// the effect did: the one place that decides it, for every front door that
// runs an effect of its own (`idempotent()` in idempotent.ts, the tool guard
// in tool.ts), as the Rust crate's `Held::settle` is for its callers.
//
// - an answer (success or business failure) is journaled, and the first
//   caller is answered with it as the journal keeps it;
// - a throw of `NothingHappened` releases the claim: the effect knows it made
//   no effect, and the next attempt runs it;
// - any other throw, a timeout while the effect still runs, a claim taken
//   over, a lease no heartbeat could confirm, or a value that is not an
//   answer leaves the claim to its lease: the effect may have happened, so
//   the next attempt after the lease reclaims it and the vendor key (or a
//   reconciler) decides.

import { type Answer, replayable } from "./answer.ts";
import { PlaneError } from "./errors.ts";
import type { Held, Settle, Settled } from "./held.ts";
import type { Claim } from "./plane.ts";
import { vendorKey } from "./vendor_key.ts";

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
  /**
   * Aborted at the effect's timeout, or with heartbeats when a beat finds the
   * claim taken over or none could confirm the lease in time: pass it to fetch.
   */
  signal: AbortSignal;
  /**
   * Pass this to the vendor as its idempotency key: stable across attempts
   * (a reclaim after a crash sends the same one), distinct across tenants.
   */
  vendorKey: string;
}

/** Why an effect run under a claim gave no answer to journal. */
export type NoAnswer =
  /** It threw `NothingHappened`: released. */
  | "nothing_happened"
  /** It threw something else: left to the lease. */
  | "threw"
  /** It did not return within its timeout, nor by the late deadline: left to the lease. */
  | "timed_out"
  /** A heartbeat found the claim taken over; the effect's signal was aborted. */
  | "fence_lost"
  /**
   * No heartbeat confirmed the lease before it could pass (the plane was not
   * reached): the effect's signal was aborted, and the claim left to its lease.
   */
  | "lease_unconfirmed"
  /** With heartbeats, the lease could not be confirmed before the deadline: the effect never started. */
  | "not_started"
  /** It returned something that is not an `Answer`: left to the lease. */
  | "not_an_answer";

/** How an effect run under a claim ended. */
export type EffectEnded =
  /** It answered, and the answer was settled (`settled.ending === "journaled"` once it is kept). */
  | { status: "ran"; answer: Answer; settled: Settled }
  /** It gave no answer: `error` is what it threw, or says why. */
  | { status: "failed"; why: NoAnswer; error: unknown; settled: Settled };

/**
 * Runs `effect` under `held`, cut at the effect's timeout, and ends the claim
 * by what it did (see the top of this file). An effect that overruns its
 * timeout and ignores its signal is waited for until `held.lateDeadline`: a
 * value that comes then is its answer; one still running is left to its
 * lease, never released. An effect cut because no heartbeat confirmed its
 * lease (`lease_unconfirmed`, while it runs or while it is waited for) is
 * left to its lease, and nothing it gives is journaled. Never throws: every
 * way the effect can end is answered.
 */
export async function runAndEnd(
  held: Held,
  effect: (context: EffectContext) => Promise<unknown> | unknown,
): Promise<EffectEnded> {
  const failed = async (why: NoAnswer, error: unknown, settle: Settle): Promise<EffectEnded> => ({
    status: "failed",
    why,
    error,
    settled: await held.settle(settle),
  });
  const vendor = await vendorKey(held.claim.organizationId, held.claim.scope, held.claim.key);
  const ran = await held.run((signal) => effect({ claim: held.claim, signal, vendorKey: vendor }));
  if ("cut" in ran && ran.cut === "not_started") {
    const error = new PlaneError(
      "deadline",
      "the effect's deadline passed before its lease was confirmed or its claim answered; it never started",
    );
    return await failed("not_started", error, {
      unknown: "the effect never started: its deadline passed first",
    });
  }
  if ("cut" in ran && ran.cut === "fence_lost") {
    const error = new PlaneError("lease_lapsed", "the claim was taken over by another worker; the effect was stopped");
    return await failed("fence_lost", error, { unknown: "the claim was taken over by another worker" });
  }
  const ended = "value" in ran || ran.cut === "threw" || ran.cut === "lease_unconfirmed"
    ? ran
    : await held.late(held.lateDeadline);
  if (ended && "cut" in ended && ended.cut === "lease_unconfirmed") {
    const error = new PlaneError(
      "lease_lapsed",
      "the lease could not be confirmed: the plane did not answer a heartbeat; the effect was stopped",
    );
    return await failed("lease_unconfirmed", error, {
      unknown: "the lease could not be confirmed (no heartbeat answered); the effect was stopped",
    });
  }
  if (!ended) {
    const error = new PlaneError("deadline", "the effect did not return within its timeout");
    return await failed("timed_out", error, { unknown: "timed out, and still running" });
  }
  if ("value" in ended) {
    if (!isAnswer(ended.value)) {
      const error = PlaneError.invalid(
        "bad_configuration",
        "the effect must return an Answer ({ ok, output, error?, resource? })",
      );
      return await failed("not_an_answer", error, { unknown: "the effect returned something that is not an Answer" });
    }
    // The first answer as the journal holds it, so every replay equals it.
    const answer = replayable(ended.value);
    const settled = await held.settle({ journal: answer });
    return { status: "ran", answer: held.journaled ?? answer, settled };
  }
  if (ended.error instanceof NothingHappened) return await failed("nothing_happened", ended.error, "release");
  return await failed("threw", ended.error, { unknown: "the effect threw" });
}

function isAnswer(value: unknown): value is Answer {
  return value !== null && typeof value === "object" && typeof (value as Answer).ok === "boolean";
}
