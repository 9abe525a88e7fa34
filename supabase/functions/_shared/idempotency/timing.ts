// An effect's timing: its timeout, the journal's deadline and a margin, and
// the lease that is their sum.
//
// Both deadlines count from before the claim; the journal (or release) is
// retried within its deadline on transient failures (held.ts), so a slow
// journal lands while the key is still ours, and once the deadline passes no
// other write starts (each is fenced by the lease token besides). The margin
// is what the lease keeps beyond both, never under MIN_MARGIN_MS.

import { PlaneError } from "./errors.ts";
import { checkLease } from "./plane.ts";

/** How long the journal may take, retries included, unless told otherwise. */
export const DEFAULT_JOURNAL_DEADLINE_MS = 10_000;
/** What the lease keeps beyond the effect's timeout and the journal's deadline. */
export const DEFAULT_MARGIN_MS = 5_000;
/**
 * The least margin a `Timing` accepts. The journal's last attempt may leave
 * just before its deadline; the margin is that request's flight to the
 * database (PostgREST, a TLS gateway, a region away, the row lock). With
 * less, a completion that left in time can land after the lease, be fenced
 * off by a reclaim, and the effect runs a second time. A claim's round trip
 * is milliseconds locally and tens to a few hundred to a hosted project in
 * another region: one second covers it with room. The same floor as the
 * Rust client's `MIN_LEASE_MARGIN`.
 */
export const MIN_MARGIN_MS = 1_000;

/**
 * The shortest lease `Timing.withHeartbeats` accepts: a beat every third of
 * it (one second) leaves room for a slow round trip. The Rust client's
 * `MIN_HEARTBEAT_LEASE`.
 */
export const MIN_HEARTBEAT_LEASE_MS = 3_000;

/**
 * The effect's timeout, the journal's deadline and the margin; the lease is
 * their sum. With heartbeats (`withHeartbeats`) the claim is made for a short
 * lease instead, which the holder extends while the claim is held, never past
 * the end the sum would have had: a worker that is stopped is recovered after
 * the short lease, a live one keeps its claim as long as its deadlines allow.
 */
export class Timing {
  readonly effectMs: number;
  readonly journalMs: number;
  readonly marginMs: number;
  /** The heartbeat lease, when the claim is kept alive by heartbeats. */
  readonly heartbeatMs?: number;

  constructor(effectMs: number, journalMs = DEFAULT_JOURNAL_DEADLINE_MS, marginMs = DEFAULT_MARGIN_MS) {
    for (const [what, value] of [["effect timeout", effectMs], ["journal deadline", journalMs]] as const) {
      if (!(value > 0) || !Number.isFinite(value)) {
        throw PlaneError.invalid("zero_duration", `the ${what} must be above zero, got ${value}`);
      }
    }
    if (!(marginMs >= MIN_MARGIN_MS) || !Number.isFinite(marginMs)) {
      throw PlaneError.invalid(
        "margin_below_floor",
        `the lease margin must be at least ${MIN_MARGIN_MS} ms (the journal's last attempt must land inside the lease), got ${marginMs}`,
      );
    }
    this.effectMs = effectMs;
    this.journalMs = journalMs;
    this.marginMs = marginMs;
    checkLease(this.leaseMs);
  }

  /**
   * This timing, claiming for `leaseMs` (at least `MIN_HEARTBEAT_LEASE_MS`)
   * kept alive by a heartbeat every third of it (see `Held`). A lease at or
   * above the whole one needs no heartbeat and is the whole one.
   */
  withHeartbeats(leaseMs: number): Timing {
    if (!(leaseMs >= MIN_HEARTBEAT_LEASE_MS)) {
      throw PlaneError.invalid(
        "lease_too_short",
        `a heartbeat lease must be at least ${MIN_HEARTBEAT_LEASE_MS} ms, got ${leaseMs}`,
      );
    }
    checkLease(leaseMs);
    const beating = new Timing(this.effectMs, this.journalMs, this.marginMs);
    if (leaseMs < this.wholeLeaseMs) (beating as { heartbeatMs?: number }).heartbeatMs = leaseMs;
    return beating;
  }

  /** The lease a claim is made for: the heartbeat lease, else effect + journal + margin. */
  get leaseMs(): number {
    return this.heartbeatMs ?? this.wholeLeaseMs;
  }

  /** effect + journal + margin: the latest a held claim's lease ever ends. */
  get wholeLeaseMs(): number {
    return this.effectMs + this.journalMs + this.marginMs;
  }

  /**
   * Refuses a lease that outlives the caller's retry horizon: a retry after
   * the horizon would find the claim still held by a worker that is gone.
   */
  check(horizonMs: number, spentMs = 0): void {
    if (this.leaseMs + spentMs >= horizonMs) {
      throw PlaneError.invalid(
        "lease_outlasts_retries",
        `the lease (${this.leaseMs} ms) plus the ${spentMs} ms spent before the claim outlasts the ${horizonMs} ms retry horizon`,
      );
    }
  }
}

/** `timing` kept alive by heartbeats on a `heartbeatLeaseMs` lease, when one is given. */
export function withHeartbeat(timing: Timing, heartbeatLeaseMs: number | undefined): Timing {
  return heartbeatLeaseMs === undefined ? timing : timing.withHeartbeats(heartbeatLeaseMs);
}

/**
 * How long after its first attempt a caller's retrier (an orchestrator, a
 * scheduler, a webhook vendor) makes its last one. A claim's lease must pass
 * before then: a worker stopped while holding the claim otherwise blocks every
 * attempt left, and the work fails on a worker that died seconds after it
 * started. The Rust client's `RetryHorizon`.
 */
export class RetryHorizon {
  /** From the first attempt to the last, in ms. */
  readonly untilLastMs: number;

  private constructor(untilLastMs: number) {
    if (!(untilLastMs >= 0) || !Number.isFinite(untilLastMs)) {
      throw PlaneError.invalid(
        "bad_configuration",
        `a retry horizon must be a finite number of ms, got ${untilLastMs}`,
      );
    }
    this.untilLastMs = untilLastMs;
  }

  /** The last attempt starts at least `ms` after the first one. */
  static untilLastAttempt(ms: number): RetryHorizon {
    return new RetryHorizon(ms);
  }

  /**
   * A retrier that retries a failed step `retries` times, waiting `initialMs`
   * before the first retry and doubling the wait up to `maxDelayMs`. Counts the
   * least it waits: jitter only adds.
   */
  static exponential(retries: number, initialMs: number, maxDelayMs: number): RetryHorizon {
    if (!Number.isInteger(retries) || retries < 0 || !(initialMs >= 0) || !(maxDelayMs >= 0)) {
      throw PlaneError.invalid(
        "bad_configuration",
        `exponential(${retries}, ${initialMs}, ${maxDelayMs}): retries must be a whole number and both delays at least 0`,
      );
    }
    let delay = Math.min(initialMs, maxDelayMs);
    let total = 0;
    for (let retry = 0; retry < retries; retry++) {
      total += delay;
      delay = Math.min(delay * 2, maxDelayMs);
    }
    return new RetryHorizon(total);
  }
}
