// The one road from claim to journal that every TypeScript caller takes —
// `idempotent()`, the webhook gate and the Idempotency-Key middleware are
// front doors over it, as the Rust crate's callers are over its EffectDriver.
//
// An effect has exactly three endings, and the rules for each live here:
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
//   answer). Nothing is written; the claim is left to its lease, the next
//   attempt after it reclaims, and the vendor key or a reconciler decides.
//
// The lease is the effect's timeout plus the journal's deadline plus a
// margin. Both deadlines count from before the claim; the journal (or
// release) is retried within its deadline on transient failures, so a slow
// journal lands while the key is still ours, and once the deadline passes no
// other write starts (each is fenced by the lease token besides).

import { type Answer, replayable, store, storedSize } from "./answer.ts";
import { sleep } from "./client.ts";
import { PlaneError } from "./errors.ts";
import { requestHash as hashOf, sha256HexOfBytes } from "./hash.ts";
import { checkLease, type Claim, type IdempotencyPlane } from "./plane.ts";
import { consoleLogger, type Logger } from "./log.ts";

/** How long the journal may take, retries included, unless told otherwise. */
export const DEFAULT_JOURNAL_DEADLINE_MS = 10_000;
/** What the lease keeps beyond the effect's timeout and the journal's deadline. */
export const DEFAULT_MARGIN_MS = 5_000;

const FIRST_ENDING_BACKOFF_MS = 50;
const MAX_ENDING_BACKOFF_MS = 1_000;

/** The effect's timeout, the journal's deadline and the margin; the lease is their sum. */
export class Timing {
  readonly effectMs: number;
  readonly journalMs: number;
  readonly marginMs: number;

  constructor(effectMs: number, journalMs = DEFAULT_JOURNAL_DEADLINE_MS, marginMs = DEFAULT_MARGIN_MS) {
    for (const [what, value] of [["effect timeout", effectMs], ["journal deadline", journalMs]] as const) {
      if (!(value > 0) || !Number.isFinite(value)) {
        throw PlaneError.invalid("zero_duration", `the ${what} must be above zero, got ${value}`);
      }
    }
    if (!(marginMs >= 0) || !Number.isFinite(marginMs)) {
      throw PlaneError.invalid("zero_duration", `the margin must not be negative, got ${marginMs}`);
    }
    this.effectMs = effectMs;
    this.journalMs = journalMs;
    this.marginMs = marginMs;
    checkLease(this.leaseMs);
  }

  /** effect + journal + margin. */
  get leaseMs(): number {
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

/** One effect: who, which key, which request, and its timing. */
export interface EffectSpec {
  organizationId: string;
  scope: string;
  key: string;
  requestHash: string;
  timing: Timing;
}

/**
 * One attempt at an effect: its lease token and when it started. Ask again
 * with the same attempt after a claim's answer was lost, and the plane
 * answers this attempt's own claim rather than "processing".
 */
export class Attempt {
  readonly token: string = crypto.randomUUID();
  readonly startedAt: number = Date.now();
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
  | { cut: "threw"; error: unknown };

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
      case "reclaimed":
        return { kind: "held", held: new Held(this, outcome.claim, attempt, effect.timing) };
      case "completed":
        return { kind: "replayed", answer: outcome.answer };
      case "processing":
        return { kind: "in_flight", leaseExpiresAt: outcome.leaseExpiresAt };
      case "conflict":
        return { kind: "conflict" };
    }
  }

  /**
   * `begin`, asked again as the same attempt until `untilMs` (epoch ms) while
   * the answer is lost (the claim may have been made): a repeat answers this
   * attempt's own claim, so a lost answer never leaves a claim nobody holds
   * until its lease passes.
   */
  async beginUntil(effect: EffectSpec, attempt: Attempt, untilMs: number): Promise<Begun> {
    let backoff = FIRST_ENDING_BACKOFF_MS;
    for (;;) {
      const remaining = untilMs - Date.now();
      if (remaining <= 0) {
        throw new PlaneError("deadline", "the claim's answer did not come before the asking window closed", {
          fn: "idempotency_claim",
          inFlight: true,
        });
      }
      try {
        return await this.begin(effect, attempt, remaining);
      } catch (error) {
        if (!(error instanceof PlaneError) || !error.mayHaveWritten || Date.now() + backoff >= untilMs) throw error;
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

/** A claim this worker holds: run its effect, then settle it exactly once. */
export class Held {
  readonly claim: Claim;
  /** Epoch ms: the effect is cut here. */
  readonly effectDeadline: number;
  /** Epoch ms: no ending starts after this; the lease lasts a margin longer. */
  readonly endingDeadline: number;
  readonly #driver: EffectDriver;
  #settled = false;
  #running?: Promise<{ value: unknown } | { cut: "threw"; error: unknown }>;

  constructor(driver: EffectDriver, claim: Claim, attempt: Attempt, timing: Timing) {
    this.#driver = driver;
    this.claim = claim;
    this.effectDeadline = attempt.startedAt + timing.effectMs;
    this.endingDeadline = this.effectDeadline + timing.journalMs;
  }

  /**
   * Runs the effect, cut at its deadline: `signal` aborts then, and a value
   * that comes later is ignored. A throw is caught and reported. A deadline
   * already past never starts the effect.
   */
  async run<T>(effect: (signal: AbortSignal) => Promise<T> | T): Promise<{ value: T } | Cut> {
    const remaining = this.effectDeadline - Date.now();
    if (remaining <= 0) return { cut: "timed_out" };
    const controller = new AbortController();
    let timer: ReturnType<typeof setTimeout> | undefined;
    const cut = new Promise<Cut>((resolve) => {
      timer = setTimeout(() => {
        controller.abort(new PlaneError("deadline", "the effect did not return within its timeout"));
        resolve({ cut: "timed_out" });
      }, remaining);
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
      return await Promise.race([ran, cut]);
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * After `run` timed out: the effect's own ending if it comes by `untilMs`
   * (epoch ms), undefined while it still runs. JavaScript cannot stop a
   * promise (the effect's `signal` only asks it to stop), so a caller waits
   * here before it releases the claim or leaves it to its lease: a claim
   * given up while its effect still runs could let a retry run it twice.
   */
  async late(untilMs: number): Promise<{ value: unknown } | { cut: "threw"; error: unknown } | undefined> {
    const running = this.#running;
    if (!running) return undefined;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const wait = new Promise<undefined>((
      resolve,
    ) => (timer = setTimeout(() => resolve(undefined), Math.max(0, untilMs - Date.now()))));
    try {
      return await Promise.race([running, wait]);
    } finally {
      clearTimeout(timer);
    }
  }

  /** Ends the claim in exactly one of the three ways. Settling twice is refused. */
  async settle(settle: Settle): Promise<Settled> {
    this.#claimSettlement();
    let settled: Settled;
    if (settle === "release") settled = await this.#release();
    else if ("journal" in settle) settled = await this.#journal(settle.journal, false) as Settled;
    else settled = { ending: "left_to_lease", why: `the effect's outcome is unknown: ${settle.unknown}` };
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
    this.#record(journaled);
    return journaled;
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
      const remaining = this.endingDeadline - Date.now();
      if (remaining <= 0) return { ending: "left_to_lease", why: "the journal did not land before its deadline" };
      const stored = await store(answer, plane.responseLimitBytes, refused);
      let error: PlaneError;
      try {
        const ending = await plane.complete(this.claim, { response: stored.response, resource: stored.resource }, {
          deadlineMs: remaining,
        });
        if (ending === "lease_moved_on") return { ending: "lease_moved_on" };
        return stored.standIn ? { ending: "journaled", standIn: stored.standIn.reason } : { ending: "journaled" };
      } catch (caught) {
        if (!(caught instanceof PlaneError)) throw caught;
        error = caught;
      }
      if (error.kind === "deadline" && Date.now() >= this.endingDeadline) {
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

  async #release(): Promise<Settled> {
    const plane = this.#driver.plane;
    let backoff = FIRST_ENDING_BACKOFF_MS;
    for (;;) {
      const remaining = this.endingDeadline - Date.now();
      if (remaining <= 0) return { ending: "left_to_lease", why: "the release did not land before its deadline" };
      let error: PlaneError;
      try {
        const ending = await plane.release(this.claim, { deadlineMs: remaining });
        return ending === "recorded" ? { ending: "released" } : { ending: "lease_moved_on" };
      } catch (caught) {
        if (!(caught instanceof PlaneError)) throw caught;
        error = caught;
      }
      if (!await this.#waitToRetry(error, backoff)) {
        return { ending: "left_to_lease", why: `the release failed: ${error.message}`, error };
      }
      backoff = Math.min(backoff * 2, MAX_ENDING_BACKOFF_MS);
    }
  }

  async #waitToRetry(error: PlaneError, backoff: number): Promise<boolean> {
    if (!error.isTransient || Date.now() + backoff >= this.endingDeadline) return false;
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

/**
 * Thrown by an effect that knows it did nothing (it failed before reaching
 * its vendor, or the vendor refused it outright): the claim is released and
 * the next attempt runs the effect. Any other throw leaves the claim to its
 * lease, since the effect may have happened.
 */
export class NothingHappened extends Error {
  override readonly name = "NothingHappened";
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
  log?: Logger;
}

/**
 * Runs `effect` at most once for this key and request, the way AWS
 * Powertools' `makeIdempotent` does for Lambda, with the plane's guarantees:
 * claim, run (cut at its timeout), and journal its answer (business
 * failures included, oversized ones by reference); release when it throws
 * `NothingHappened`; leave the claim to its lease when it throws anything
 * else or times out; replay the journaled answer to duplicates.
 */
export async function idempotent(
  effect: (context: EffectContext) => Promise<Answer> | Answer,
  options: IdempotentOptions,
): Promise<IdempotentResult> {
  const journalMs = options.journalDeadlineMs ?? DEFAULT_JOURNAL_DEADLINE_MS;
  const marginMs = options.marginMs ?? DEFAULT_MARGIN_MS;
  const timeoutMs = options.timeoutMs ?? (options.leaseMs === undefined ? NaN : options.leaseMs - journalMs - marginMs);
  if (
    options.timeoutMs !== undefined && options.leaseMs !== undefined &&
    options.leaseMs !== timeoutMs + journalMs + marginMs
  ) {
    throw PlaneError.invalid("bad_configuration", "give timeoutMs or leaseMs, not two that disagree");
  }
  const timing = new Timing(timeoutMs, journalMs, marginMs);
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
  let ended: { value: unknown } | { cut: "threw"; error: unknown } | undefined = "value" in ran || ran.cut === "threw"
    ? ran
    : undefined;
  if (!ended) {
    // Timed out: an effect that ignores its signal may still be running. Wait
    // for it through half the journal's deadline (the other half journals):
    // a value that comes then is the effect's answer; an effect still running
    // is left to its lease, never released.
    ended = await held.late(held.effectDeadline + timing.journalMs / 2);
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
    // The first answer as the journal holds it, so a replay equals it.
    const answer = replayable(ended.value);
    return { status: "ran", answer, settled: await held.settle({ journal: answer }) };
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
