// A claim this worker holds (Held), and its three endings. An effect has
// exactly three, and the rules for each live here:
//
// - journal: success or business failure, stored so that a replay is
//   indistinguishable from the first answer whatever its size or bytes (see
//   answer.ts). A database refusal of the answer falls back to a reference to
//   the effect's resource (a summary when it names none), keeping `ok`, the
//   error and the resource.
// - release: only when the caller knows no effect happened *and* no success
//   can have been answered to anyone on the strength of this claim. The next
//   attempt runs the effect.
// - unknown: the outcome is unknown (a timeout, a throw, a lost vendor
//   answer, an effect stopped because no heartbeat confirmed its lease).
//   Nothing is written; the claim is left to its lease, the next attempt
//   after it reclaims, and the vendor key or a reconciler decides.
//
// With a heartbeat, the lease this worker can count on ends when the
// request that last confirmed it (the claim, or a beat the database
// answered) was sent, plus the lease it asked for, on this worker's
// monotonic clock. When that end less a stop margin (a third of the
// heartbeat lease, or the timing's margin when less) arrives with no beat
// answered since, the effect's signal is aborted (`lease_unconfirmed`): a
// worker cut off from the plane stops before another can take its key over.
//
// The journal and the release are retried on transient failures until the
// ending's deadline (timing.ts); none starts after it.

import { type Answer, answerFromStored, replayable, store, storedSize } from "./answer.ts";
import { sleep } from "./client.ts";
import { monotonicNow } from "./clock.ts";
import { PlaneError } from "./errors.ts";
import { type CallOptions, type Claim, type IdempotencyPlane, MIN_LEASE_MS } from "./plane.ts";
import type { Logger } from "./log.ts";
import type { Timing } from "./timing.ts";
import { errorKind, METRICS } from "./telemetry.ts";

/** The first wait before an ending (or a lost claim's answer) is asked again. */
export const FIRST_ENDING_BACKOFF_MS = 50;
/** The longest wait between two tries of an ending; each wait doubles up to it. */
export const MAX_ENDING_BACKOFF_MS = 1_000;
/**
 * What the journal's deadline keeps for the journal itself when a caller
 * waits on an effect that overran its timeout (`Held.lateDeadline`): a
 * healthy plane journals in well under 100 ms, and 2 s holds the client's
 * whole retry ladder (four retries backing off 50 to 400 ms) with the
 * ending's own retries beside it. Half the journal's deadline when that is
 * less, so a short deadline keeps the half it always had.
 */
export const LATE_JOURNAL_RESERVE_MS = 2_000;

/** How to end a held claim. */
export type Settle =
  | { journal: Answer }
  | "release"
  /** The outcome is unknown: leave the claim to its lease. Say why. */
  | { unknown: string };

/** How it ended. */
export type Settled =
  /** The answer is in the journal (as given, or with `standIn` saying why a stand-in went instead). */
  | { ending: "journaled"; standIn?: string }
  | { ending: "released" }
  /** Our lease passed and another worker took the key: nothing written. */
  | { ending: "lease_moved_on" }
  /** Nothing written: the next attempt after the lease reclaims. */
  | { ending: "left_to_lease"; why: string; error?: PlaneError };

/** Why `Held.run` did not return the effect's value. */
export type Cut =
  | { cut: "timed_out" }
  | { cut: "threw"; error: unknown }
  /**
   * A heartbeat found the claim taken over (its lease had passed and another
   * worker holds it now): the effect's signal was aborted. The new holder's
   * ending is the one that counts.
   */
  | { cut: "fence_lost" }
  /**
   * With a heartbeat, no beat confirmed the lease before its confirmed end
   * less the stop margin (the plane could not be reached): the effect's
   * signal was aborted there, before the lease can pass and another worker
   * take the key over. What the effect did is unknown; leave the claim to
   * its lease, and never journal a value it gives later.
   */
  | { cut: "lease_unconfirmed" }
  /**
   * The effect never started: its deadline had passed when it was to start
   * (a claim answered late), or, with a heartbeat, the lease could not be
   * confirmed (every beat failed) before it. Leave the claim to its lease.
   */
  | { cut: "not_started" };

/**
 * One heartbeat of a claim whose lease is kept by another call than the
 * plane's `extend`: asks for `leaseMs` more and answers the lease's new end,
 * or null when the claim is no longer this worker's, as `extend` does. A
 * queue claim's beat (`agent.idempotency_queue_extend`) also keeps its
 * messages hidden as long, in the same call.
 */
export type Beat = (leaseMs: number, call: CallOptions) => Promise<string | null>;

/** A held claim's heartbeat: its lease, the whole lease's end, and the stop margin. */
interface Heartbeat {
  /** The lease each beat asks for. */
  readonly leaseMs: number;
  /** Monotonic ms: no beat asks past this (the end the whole lease would have had). */
  readonly leaseEnd: number;
  /** How long before the confirmed lease end an unconfirmed effect is stopped. */
  readonly stopMarginMs: number;
}

/** What an effect's signal is aborted with when no heartbeat confirmed its lease in time. */
function leaseUnconfirmed(): PlaneError {
  return new PlaneError(
    "lease_lapsed",
    "the lease could not be confirmed: the plane did not answer a heartbeat before the lease could pass",
  );
}

/** A claim this worker holds: run its effect, then settle it exactly once. */
export class Held {
  readonly claim: Claim;
  /** Monotonic ms (clock.ts): the effect is cut here. */
  readonly effectDeadline: number;
  /** Monotonic ms: no ending starts after this; the lease lasts a margin longer. */
  readonly endingDeadline: number;
  /**
   * Monotonic ms: the last moment to wait (`late`) for an effect that
   * overran its timeout, so that what it ends with, or the problem kept
   * while it still runs, is journaled before `endingDeadline`: the ending
   * deadline less `LATE_JOURNAL_RESERVE_MS` (or less half the journal's
   * deadline, when that is less).
   */
  readonly lateDeadline: number;
  readonly #driver: { readonly plane: IdempotencyPlane; readonly log: Logger };
  readonly #heartbeat?: Heartbeat;
  /** What a heartbeat calls, when not the plane's `extend`. */
  readonly #extendBy?: Beat;
  #beat?: ReturnType<typeof setTimeout>;
  /**
   * When the request that last confirmed the lease was sent (monotonic ms):
   * the claim (the attempt's start), or a beat the database answered.
   */
  #confirmedAt = 0;
  /**
   * The lease end that request confirmed (monotonic ms): when it was sent
   * plus the lease it asked for. The database's end is at least that late
   * (it started counting once the request arrived), so this clock can only
   * stop an effect early, never keep it past the lease.
   */
  #confirmedEnd = 0;
  #lost = false;
  #onLost?: () => void;
  #settled = false;
  #running?: Promise<{ value: unknown } | { cut: "threw"; error: unknown }>;
  #journaled?: Answer;
  /** Monotonic ms: when the effect's clock started (the claim was asked for). */
  readonly #startedAt: number;
  /** Which time the work is run, when known (1 for a fresh claim, a re-drive's attempt). */
  readonly #attempt?: number;

  /**
   * Once the claim ended journaled: the answer as every replay of the key
   * will give it (an error cut to its first bytes, an output above the limit
   * by reference, members in the order the store keeps them). Answer the
   * first caller with this, so the first answer equals its replays.
   */
  get journaled(): Answer | undefined {
    return this.#journaled;
  }

  /**
   * Made by `EffectDriver.begin` (driver.ts) for the claim it made: `driver`
   * is the plane the claim ends on and where its events go (an EffectDriver),
   * and the effect's clock started at `attempt.startedAt` (monotonic ms).
   * `options.beat`, when given, is what each heartbeat calls instead of the
   * plane's `extend` (a queue claim's, which keeps its messages hidden too);
   * every other rule of the heartbeat is the same. `options.attempt`, when
   * known, is which time the work runs (a re-drive's `attempt`), shown on
   * the effect's span.
   */
  constructor(
    driver: { readonly plane: IdempotencyPlane; readonly log: Logger },
    claim: Claim,
    attempt: { readonly startedAt: number },
    timing: Timing,
    options: { beat?: Beat; attempt?: number } = {},
  ) {
    this.#driver = driver;
    this.claim = claim;
    this.#extendBy = options.beat;
    this.#startedAt = attempt.startedAt;
    this.#attempt = options.attempt;
    this.effectDeadline = attempt.startedAt + timing.effectMs;
    this.endingDeadline = this.effectDeadline + timing.journalMs;
    this.lateDeadline = this.endingDeadline - Math.min(timing.journalMs / 2, LATE_JOURNAL_RESERVE_MS);
    if (timing.heartbeatMs !== undefined) {
      this.#heartbeat = {
        leaseMs: timing.heartbeatMs,
        leaseEnd: this.endingDeadline + timing.marginMs,
        stopMarginMs: Math.min(timing.marginMs, timing.heartbeatMs / 3),
      };
      // The claim asked for the heartbeat lease, and was sent after this.
      this.#confirmedAt = attempt.startedAt;
      this.#confirmedEnd = attempt.startedAt + timing.heartbeatMs;
      this.#scheduleBeat(attempt.startedAt);
    }
  }

  /** Whether a heartbeat found the claim taken over: start nothing more under it. */
  get fenceLost(): boolean {
    return this.#lost;
  }

  /**
   * The next heartbeat, a third of the lease after `from` (monotonic ms):
   * none from the ending's deadline on, or once the claim is settled or lost.
   */
  #scheduleBeat(from: number): void {
    const heartbeat = this.#heartbeat;
    if (!heartbeat || this.#lost) return;
    const at = from + heartbeat.leaseMs / 3;
    if (at >= this.endingDeadline) return;
    this.#beat = setTimeout(() => void this.#beatOnce(), Math.max(0, at - monotonicNow()));
  }

  async #beatOnce(): Promise<void> {
    const heartbeat = this.#heartbeat;
    if (!heartbeat) return;
    const now = monotonicNow();
    const beat = await this.#extend(heartbeat, now);
    if (this.#beat === undefined) return; // settled meanwhile
    if (beat === "lost") {
      this.#markLost();
      this.#onLost?.();
    } else if (beat === "extended") {
      this.#scheduleBeat(now);
    } else {
      // Tried again a second from now.
      this.#scheduleBeat(monotonicNow() + 1_000 - heartbeat.leaseMs / 3);
    }
  }

  /**
   * Before an effect starts: with a heartbeat, the lease must have been
   * confirmed by the database within the last third of it. When beats kept
   * failing (or the event loop was held), the lease may have passed and
   * another worker taken the claim over; so a beat is made first, tried
   * again a second later while it fails, until the effect's deadline. The
   * cut that stops the effect from starting, or undefined to start it.
   */
  async #confirm(): Promise<Cut | undefined> {
    const heartbeat = this.#heartbeat;
    if (!heartbeat) return undefined;
    for (;;) {
      if (this.#lost) return { cut: "fence_lost" };
      const now = monotonicNow();
      if (now >= this.effectDeadline) return { cut: "not_started" };
      if (now < this.#confirmedAt + heartbeat.leaseMs / 3) return undefined;
      const beat = await this.#extend(heartbeat, now);
      if (beat === "lost") {
        this.#markLost();
        return { cut: "fence_lost" };
      }
      if (beat === "failed") {
        const wait = Math.min(1_000, Math.max(0, this.effectDeadline - monotonicNow()));
        await new Promise((resolve) => setTimeout(resolve, wait));
      }
    }
  }

  /**
   * One extension of the lease, sent at `now` (monotonic ms): never past
   * the whole lease's end, never below what the store accepts. Once the
   * database answers it, the lease is confirmed until `now` plus the lease
   * asked.
   */
  async #extend(heartbeat: Heartbeat, now: number): Promise<"extended" | "lost" | "failed"> {
    const ask = Math.max(MIN_LEASE_MS, Math.min(heartbeat.leaseMs, heartbeat.leaseEnd - now));
    try {
      const call = { deadlineMs: heartbeat.leaseMs / 3 };
      const end = this.#extendBy
        ? await this.#extendBy(ask, call)
        : await this.#driver.plane.extend(this.claim, ask, call);
      if (end === null) return "lost";
      this.#confirmedAt = Math.max(this.#confirmedAt, now);
      this.#confirmedEnd = Math.max(this.#confirmedEnd, now + ask);
      return "extended";
    } catch (error) {
      this.#driver.log({
        event: "idempotency.heartbeat_failed",
        level: "warn",
        scope: this.claim.scope,
        key: this.claim.key,
        error: error instanceof Error ? error.message : String(error),
      });
      return "failed";
    }
  }

  /** An extension answered that the fence moved on: start nothing more. */
  #markLost(): void {
    this.#lost = true;
    this.#driver.plane.telemetry.count(METRICS.heartbeatsFenced);
    this.#driver.log({
      event: "idempotency.fence_lost",
      level: "warn",
      scope: this.claim.scope,
      key: this.claim.key,
      claim_id: this.claim.id,
    });
  }

  /**
   * With a heartbeat, calls `stop` once the confirmed lease end less the
   * stop margin (the heartbeat lease's third, or the timing's margin when
   * less) arrives with no beat answered that moved it: the lease may pass
   * soon after, and another worker take the key over. Answers what ends the
   * watch. Without a heartbeat, nothing to watch: the effect's own deadline
   * ends it inside the lease.
   */
  #watchLease(stop: () => void): () => void {
    const heartbeat = this.#heartbeat;
    if (!heartbeat) return () => {};
    let timer: ReturnType<typeof setTimeout> | undefined;
    const check = () => {
      const wait = this.#confirmedEnd - heartbeat.stopMarginMs - monotonicNow();
      if (wait > 0) {
        timer = setTimeout(check, wait);
        return;
      }
      timer = undefined;
      this.#driver.plane.telemetry.count(METRICS.leasesUnconfirmed);
      this.#driver.log({
        event: "idempotency.lease_unconfirmed",
        level: "warn",
        scope: this.claim.scope,
        key: this.claim.key,
        claim_id: this.claim.id,
        unconfirmed_for_ms: Math.round(monotonicNow() - this.#confirmedAt),
      });
      stop();
    };
    check();
    return () => clearTimeout(timer);
  }

  #stopHeartbeat(): void {
    clearTimeout(this.#beat);
    this.#beat = undefined;
  }

  /**
   * Runs the effect, cut at its deadline: `signal` aborts then, and a value
   * that comes later is ignored. A throw is caught and reported. A deadline
   * already past never starts the effect; with a heartbeat, neither does a
   * lease the database has not confirmed within the last third of it (a
   * beat is made first): a claim taken over meanwhile answers `fence_lost`,
   * and beats that keep failing until the deadline `not_started`. While it
   * runs, a beat that finds the claim taken over cuts it (`fence_lost`), and
   * so does the confirmed lease end less the stop margin arriving with no
   * beat answered (`lease_unconfirmed`).
   */
  async run<T>(effect: (signal: AbortSignal) => Promise<T> | T): Promise<{ value: T } | Cut> {
    const claim = this.claim;
    // Work handed out again (a reclaim, a re-drive, a redelivery) is linked
    // to the trace that first claimed it: a link, never a parent.
    return await this.#driver.plane.telemetry.span("idempotency.effect", {
      kind: "internal",
      scope: claim.scope,
      key: claim.key,
      attributes: {
        "idempotency.outcome": claim.reclaimed ? "reclaimed" : "claimed",
        "idempotency.reclaimed": claim.reclaimed,
        "idempotency.replayed": false,
        "idempotency.attempt": this.#attempt,
      },
      links: [claim.traceparent],
    }, async (span) => {
      const ran = await this.#run(effect);
      if ("cut" in ran) {
        span.set({ "idempotency.cut": ran.cut });
        span.fail(ran.cut === "threw" ? errorKind(ran.error) : ran.cut);
      }
      return ran;
    });
  }

  async #run<T>(effect: (signal: AbortSignal) => Promise<T> | T): Promise<{ value: T } | Cut> {
    // `late` waits on this run's effect only: one that never starts leaves
    // nothing to wait for, not an earlier run's ending (a reconciler's).
    this.#running = undefined;
    const confirmed = await this.#confirm();
    if (confirmed) return confirmed;
    const remaining = this.effectDeadline - monotonicNow();
    // A claim answered after the effect's deadline (or a second run of one
    // claim that comes too late) never starts: nothing ran, so nothing may
    // be journaled as if it had timed out.
    if (remaining <= 0) return { cut: "not_started" };
    if (this.#lost) return { cut: "fence_lost" };
    const controller = new AbortController();
    let timer: ReturnType<typeof setTimeout> | undefined;
    let unwatch = () => {};
    let unconfirmed = false;
    const cut = new Promise<Cut>((resolve) => {
      timer = setTimeout(() => {
        controller.abort(new PlaneError("deadline", "the effect did not return within its timeout"));
        resolve({ cut: "timed_out" });
      }, remaining);
      this.#onLost = () => {
        controller.abort(new PlaneError("inconsistent", "the claim was taken over by another worker"));
        resolve({ cut: "fence_lost" });
      };
      unwatch = this.#watchLease(() => {
        unconfirmed = true;
        controller.abort(leaseUnconfirmed());
        resolve({ cut: "lease_unconfirmed" });
      });
    });
    const ran = (async (): Promise<{ value: T } | { cut: "threw"; error: unknown }> => {
      try {
        return { value: await effect(controller.signal) };
      } catch (error) {
        return { cut: "threw", error };
      }
    })();
    this.#running = ran;
    try {
      const ended = await Promise.race([ran, cut]);
      // A value that came in the same turn as the stop is not trusted either.
      return unconfirmed ? { cut: "lease_unconfirmed" } : ended;
    } finally {
      clearTimeout(timer);
      unwatch();
      this.#onLost = undefined;
    }
  }

  /**
   * After `run` timed out: the effect's own ending if it comes by `untilMs`
   * (monotonic ms; `lateDeadline` leaves its journal time to land),
   * undefined while it still runs. JavaScript cannot stop a
   * promise (the effect's `signal` only asks it to stop), so a caller waits
   * here before it releases the claim or leaves it to its lease: a claim
   * given up while its effect still runs could let a retry run it twice.
   * With a heartbeat, the wait ends `lease_unconfirmed` as `run` is cut:
   * then leave the claim to its lease, journaling nothing of the effect's.
   */
  async late(
    untilMs: number,
  ): Promise<{ value: unknown } | { cut: "threw"; error: unknown } | { cut: "lease_unconfirmed" } | undefined> {
    const running = this.#running;
    if (!running) return undefined;
    let timer: ReturnType<typeof setTimeout> | undefined;
    let unwatch = () => {};
    let unconfirmed = false;
    const wait = new Promise<undefined>((resolve) => {
      timer = setTimeout(() => resolve(undefined), Math.max(0, untilMs - monotonicNow()));
      unwatch = this.#watchLease(() => {
        unconfirmed = true;
        resolve(undefined);
      });
    });
    try {
      const ended = await Promise.race([running, wait]);
      return unconfirmed ? { cut: "lease_unconfirmed" } : ended;
    } finally {
      clearTimeout(timer);
      unwatch();
    }
  }

  /**
   * Ends the claim in exactly one of the three ways. Settling twice is
   * refused. `releaseMayHaveLanded`: an earlier release of this claim (a
   * batch's) may have landed, so a release that deletes nothing is checked
   * against the row, as after a lost answer.
   */
  async settle(settle: Settle, options: { releaseMayHaveLanded?: boolean } = {}): Promise<Settled> {
    this.#claimSettlement();
    const claim = this.claim;
    return await this.#driver.plane.telemetry.span(
      "idempotency.settle",
      { kind: "internal", scope: claim.scope, key: claim.key },
      async (span) => {
        const settled = await this.#settle(settle, options);
        span.set({ "idempotency.ending": settled.ending });
        return settled;
      },
    );
  }

  async #settle(settle: Settle, options: { releaseMayHaveLanded?: boolean }): Promise<Settled> {
    let settled: Settled;
    try {
      if (settle === "release") settled = await this.#release(options.releaseMayHaveLanded ?? false);
      else if ("journal" in settle) settled = await this.#journal(settle.journal, false) as Settled;
      else settled = { ending: "left_to_lease", why: `the effect's outcome is unknown: ${settle.unknown}` };
    } finally {
      this.#stopHeartbeat();
    }
    this.#record(settled);
    return settled;
  }

  /**
   * Journals `answer` exactly as given, or gives it back: a refusal (too
   * large for the store, or refused by the database) answers the error and
   * the claim is still held, to settle another way.
   */
  async journalExact(given: Answer): Promise<Settled | { refused: PlaneError }> {
    const answer = replayable(given);
    const size = await storedSize(answer);
    if (size > this.#driver.plane.responseLimitBytes) {
      return {
        refused: PlaneError.invalid(
          "response_too_large",
          `the answer is ${size} bytes, above the ${this.#driver.plane.responseLimitBytes}-byte store limit`,
        ),
      };
    }
    this.#claimSettlement();
    const journaled = await this.#journal(answer, true);
    if ("refused" in journaled) {
      this.#settled = false;
      return journaled;
    }
    this.#stopHeartbeat();
    this.#record(journaled);
    return journaled;
  }

  /**
   * Records an ending a batch wrote for this claim (batch.ts), as `settle`
   * records its own: the claim is settled, and `journaled` is the answer
   * every replay will give.
   */
  settledBy(settled: Settled, journaled?: Answer): void {
    this.#claimSettlement();
    this.#stopHeartbeat();
    if (settled.ending === "journaled") this.#journaled = journaled;
    this.#record(settled);
  }

  #claimSettlement(): void {
    if (this.#settled) throw PlaneError.invalid("bad_configuration", "this claim was already settled");
    this.#settled = true;
  }

  async #journal(given: Answer, exact: boolean): Promise<Settled | { refused: PlaneError }> {
    const answer = replayable(given);
    const plane = this.#driver.plane;
    let refused = false;
    let backoff = FIRST_ENDING_BACKOFF_MS;
    for (;;) {
      const remaining = this.endingDeadline - monotonicNow();
      if (remaining <= 0) return { ending: "left_to_lease", why: "the journal did not land before its deadline" };
      const stored = await store(answer, plane.responseLimitBytes, refused);
      let error: PlaneError;
      try {
        const ending = await plane.complete(this.claim, { response: stored.response, resource: stored.resource }, {
          deadlineMs: remaining,
        });
        if (ending === "lease_moved_on") return { ending: "lease_moved_on" };
        this.#journaled = answerFromStored(stored.response, stored.resource);
        return stored.standIn ? { ending: "journaled", standIn: stored.standIn.reason } : { ending: "journaled" };
      } catch (caught) {
        if (!(caught instanceof PlaneError)) throw caught;
        error = caught;
      }
      if (error.kind === "deadline" && monotonicNow() >= this.endingDeadline) {
        return { ending: "left_to_lease", why: "the journal did not land before its deadline", error };
      }
      if (error.isUnstorableAnswer && exact) return { refused: error };
      if (error.isUnstorableAnswer && !refused) {
        this.#driver.log({
          event: "idempotency.answer_refused",
          level: "warn",
          scope: this.claim.scope,
          key: this.claim.key,
          error: error.message,
        });
        refused = true;
        continue;
      }
      if (!await this.#waitToRetry(error, backoff)) {
        return { ending: "left_to_lease", why: `the journal failed: ${error.message}`, error };
      }
      backoff = Math.min(backoff * 2, MAX_ENDING_BACKOFF_MS);
    }
  }

  /**
   * Deletes the claim, retrying transient failures within the deadline. A
   * release whose answer was lost may have landed, and then a retry finds
   * nothing to delete and answers as a moved-on fence would: after such a
   * failure, a retry that deletes nothing is checked against the row (none
   * left: released; a row: another worker holds or answered the key).
   */
  async #release(mayHaveLanded: boolean): Promise<Settled> {
    const plane = this.#driver.plane;
    let backoff = FIRST_ENDING_BACKOFF_MS;
    for (;;) {
      const remaining = this.endingDeadline - monotonicNow();
      if (remaining <= 0) return { ending: "left_to_lease", why: "the release did not land before its deadline" };
      let error: PlaneError;
      try {
        const ending = await plane.release(this.claim, { deadlineMs: remaining });
        if (ending === "recorded") return { ending: "released" };
        return mayHaveLanded ? await this.#releasedOrMovedOn() : { ending: "lease_moved_on" };
      } catch (caught) {
        if (!(caught instanceof PlaneError)) throw caught;
        error = caught;
      }
      mayHaveLanded ||= error.mayHaveWritten;
      if (!await this.#waitToRetry(error, backoff)) {
        return { ending: "left_to_lease", why: `the release failed: ${error.message}`, error };
      }
      backoff = Math.min(backoff * 2, MAX_ENDING_BACKOFF_MS);
    }
  }

  /**
   * After a release whose answer was lost, a retry deleted nothing: asks the
   * row (retrying transient failures within the deadline) whether the first
   * one landed.
   */
  async #releasedOrMovedOn(): Promise<Settled> {
    let backoff = FIRST_ENDING_BACKOFF_MS;
    for (;;) {
      const remaining = this.endingDeadline - monotonicNow();
      if (remaining <= 0) return { ending: "left_to_lease", why: "the release did not land before its deadline" };
      let error: PlaneError;
      try {
        const held = await this.#driver.plane.rowExists(this.claim, { deadlineMs: remaining });
        return held ? { ending: "lease_moved_on" } : { ending: "released" };
      } catch (caught) {
        if (!(caught instanceof PlaneError)) throw caught;
        error = caught;
      }
      if (!await this.#waitToRetry(error, backoff)) {
        return { ending: "left_to_lease", why: `the release's outcome is unknown: ${error.message}`, error };
      }
      backoff = Math.min(backoff * 2, MAX_ENDING_BACKOFF_MS);
    }
  }

  async #waitToRetry(error: PlaneError, backoff: number): Promise<boolean> {
    if (!error.isTransient || monotonicNow() + backoff >= this.endingDeadline) return false;
    this.#driver.log({
      event: "idempotency.ending_retry",
      level: "info",
      scope: this.claim.scope,
      key: this.claim.key,
      error: error.message,
      backoff_ms: backoff,
    });
    await sleep(backoff);
    return true;
  }

  #record(settled: Settled): void {
    const telemetry = this.#driver.plane.telemetry;
    const labels = { scope: this.claim.scope, ending: settled.ending };
    telemetry.count(METRICS.effectEndings, labels);
    telemetry.record(METRICS.effectDuration, (monotonicNow() - this.#startedAt) / 1000, labels);
    const unhappy = settled.ending === "left_to_lease" || settled.ending === "lease_moved_on";
    this.#driver.log({
      event: "idempotency.settle",
      level: unhappy ? "warn" : "info",
      scope: this.claim.scope,
      key: this.claim.key,
      claim_id: this.claim.id,
      ending: settled.ending,
      ...(settled.ending === "journaled" && settled.standIn ? { stand_in: settled.standIn } : {}),
      ...(settled.ending === "left_to_lease" ? { why: settled.why } : {}),
    });
  }
}
