// The one road from claim to journal that every TypeScript caller takes —
// `idempotent()` (idempotent.ts), the webhook gate and the Idempotency-Key
// middleware are front doors over it, as the Rust crate's callers are over
// its EffectDriver.
//
// This file claims: an effect (EffectSpec) is begun as one Attempt, and the
// plane's answer is a claim this worker holds (Held, held.ts, which runs the
// effect and ends it in one of three ways), the answer to replay, a claim
// another worker holds, or a conflict. The lease the claim takes is the
// effect's Timing (timing.ts).

import type { Answer } from "./answer.ts";
import { sleep } from "./client.ts";
import { monotonicNow } from "./clock.ts";
import { PlaneError } from "./errors.ts";
import type { IdempotencyPlane } from "./plane.ts";
import { consoleLogger, type Logger } from "./log.ts";
import type { Timing } from "./timing.ts";
import { FIRST_ENDING_BACKOFF_MS, Held, MAX_ENDING_BACKOFF_MS } from "./held.ts";

/** One effect: who, which key, which request, and its timing. */
export interface EffectSpec {
  organizationId: string;
  scope: string;
  key: string;
  requestHash: string;
  timing: Timing;
  /**
   * The work the claim carries (JSON), stored with it so that another worker
   * can re-drive it if this one is stopped; see `IdempotencyPlane.claim`.
   */
  work?: unknown;
}

/**
 * One attempt at an effect: its lease token and when it started. Ask again
 * with the same attempt after a claim's answer was lost, and the plane
 * answers this attempt's own claim rather than "processing".
 */
export class Attempt {
  readonly token: string = crypto.randomUUID();
  /** Monotonic ms (clock.ts), never the wall clock: every deadline of the effect counts from here. */
  readonly startedAt: number = monotonicNow();
}

/** What beginning an effect found. */
export type Begun =
  /** The claim is ours: run the effect, then settle. */
  | { kind: "held"; held: Held }
  /** The effect already happened: this is its answer. */
  | { kind: "replayed"; answer: Answer }
  /** Another worker holds a live claim. */
  | { kind: "in_flight"; leaseExpiresAt: string }
  /** The key was used with another request. */
  | { kind: "conflict" };

/** Begins effects on a plane. */
export class EffectDriver {
  readonly plane: IdempotencyPlane;
  readonly log: Logger;

  /** Events go to `log`; by default the ones that need an operator's eye go to the console as JSON. */
  constructor(plane: IdempotencyPlane, options: { log?: Logger } = {}) {
    this.plane = plane;
    this.log = options.log ?? consoleLogger("warn");
  }

  /** Claims the effect's key as `attempt` (a fresh one by default). */
  async begin(effect: EffectSpec, attempt: Attempt = new Attempt(), deadlineMs?: number): Promise<Begun> {
    const outcome = await this.plane.claim({
      organizationId: effect.organizationId,
      scope: effect.scope,
      key: effect.key,
      requestHash: effect.requestHash,
      leaseMs: effect.timing.leaseMs,
      leaseToken: attempt.token,
      work: effect.work,
    }, deadlineMs === undefined ? {} : { deadlineMs });
    this.log({
      event: "idempotency.claim",
      scope: effect.scope,
      key: effect.key,
      outcome: outcome.outcome,
      replayed: outcome.outcome === "completed",
    });
    switch (outcome.outcome) {
      case "claimed":
      case "reclaimed": {
        const first = outcome.outcome === "claimed" ? { attempt: 1 } : {};
        return { kind: "held", held: new Held(this, outcome.claim, attempt, effect.timing, first) };
      }
      case "completed":
        return { kind: "replayed", answer: outcome.answer };
      case "processing":
        return { kind: "in_flight", leaseExpiresAt: outcome.leaseExpiresAt };
      case "conflict":
        return { kind: "conflict" };
    }
  }

  /**
   * `begin`, asked again as the same attempt until `untilMs` (monotonic ms) while
   * the answer is lost (the claim may have been made): a repeat answers this
   * attempt's own claim, so a lost answer never leaves a claim nobody holds
   * until its lease passes.
   */
  async beginUntil(effect: EffectSpec, attempt: Attempt, untilMs: number): Promise<Begun> {
    let backoff = FIRST_ENDING_BACKOFF_MS;
    for (;;) {
      const remaining = untilMs - monotonicNow();
      if (remaining <= 0) {
        throw new PlaneError("deadline", "the claim's answer did not come before the asking window closed", {
          fn: "idempotency_claim",
          inFlight: true,
        });
      }
      try {
        return await this.begin(effect, attempt, remaining);
      } catch (error) {
        if (!(error instanceof PlaneError) || !error.mayHaveWritten || monotonicNow() + backoff >= untilMs) throw error;
        this.log({
          event: "idempotency.claim_unknown",
          level: "info",
          scope: effect.scope,
          key: effect.key,
          error: error.message,
          backoff_ms: backoff,
        });
        await sleep(backoff);
        backoff = Math.min(backoff * 2, MAX_ENDING_BACKOFF_MS);
      }
    }
  }
}
