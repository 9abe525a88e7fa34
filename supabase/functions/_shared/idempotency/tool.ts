// The tool guard: one tool call inside a durable orchestrator's step
// (Inngest, Trigger.dev, an AI SDK tool the agent loop replays), the Rust
// client's `ToolGuard` for TypeScript.
//
// The journal is read before the policy checkpoint and claimed after it, so a
// call a person has not yet allowed takes no key. Everything that is not an
// answer is raised as a `ToolError` (tool_error.ts), never returned: an
// orchestrator memoizes what a step returns, so a step that returned "in
// flight" would be done for good while the effect may never happen. The
// claim is ended by what the tool did, in run_effect.ts, as `idempotent()`
// ends its own.

import { type Answer, replayable } from "./answer.ts";
import { PlaneError } from "./errors.ts";
import { requestHash } from "./hash.ts";
import type { Held, Settled } from "./held.ts";
import type { IdempotencyPlane } from "./plane.ts";
import type { Logger } from "./log.ts";
import { Attempt, EffectDriver } from "./driver.ts";
import { monotonicNow } from "./clock.ts";
import { type EffectContext, runAndEnd } from "./run_effect.ts";
import { DEFAULT_JOURNAL_DEADLINE_MS, type RetryHorizon, Timing, withHeartbeat } from "./timing.ts";
import { ToolError } from "./tool_error.ts";
import { isToolKey, type ToolKey } from "./tool_key.ts";
import { vendorKey } from "./vendor_key.ts";

/** The longest a tool call may run: the orchestrator's step budget. */
export const STEP_BUDGET_MS = 120_000;

/**
 * Added to a tool's timeout (and the journal's deadline) to make its lease,
 * so the lease outlives the call it guards but passes well before an
 * orchestrator's last retry.
 */
export const DEFAULT_TOOL_LEASE_MARGIN_MS = 15_000;

/** The margins and journal deadlines a `ToolGuard` accepts: 1 s to 5 min. */
export const LEASE_MARGIN_RANGE_MS = { min: 1_000, max: 300_000 } as const;

/**
 * What a tool is handed while it holds the claim: pass `vendorKey` to the
 * vendor (as `Idempotency-Key`) and `signal` to fetch; `claim.reclaimed` says
 * an earlier attempt's worker was stopped holding it, so the vendor may
 * already have seen this call.
 */
export type ToolCall = EffectContext;

/**
 * Asks the vendor whether an earlier attempt's effect happened, for a tool
 * whose vendor takes no idempotency key: the answer it made when it did,
 * `undefined` (or `null`) when it did not; it throws when the vendor cannot
 * tell right now. Cut at the tool's timeout.
 */
export type Reconciler = (call: ToolCall, args: unknown) => Promise<Answer | undefined | null>;

/**
 * How a repeat of a tool call is made safe after a worker was stopped
 * mid-call. Postgres cannot commit atomically with a vendor's API: a worker
 * can reach the vendor and be stopped before it journals the answer, and the
 * next attempt then reclaims the call. Either the vendor recognizes the
 * repeat (`"vendor_key"`: it dedupes on `ToolCall.vendorKey`), or the guard
 * asks it first (`{ reconcile }`: an effect it finds is journaled as the
 * call's answer and the vendor is not called again). There is no third choice.
 */
export type RepeatSafety = "vendor_key" | { reconcile: Reconciler };

/** A tool's scope, timeout and repeat safety, checked once by `toolSpec`. */
export interface ToolSpec {
  readonly scope: string;
  readonly timeoutMs: number;
  readonly repeat: RepeatSafety;
}

/**
 * A tool under `scope` (`tool.<name>`, a scope the plane retains for 30
 * days) whose calls finish within `timeoutMs` (above 0, at most
 * `STEP_BUDGET_MS`), made safe to repeat by `repeat`. Throws a `ToolError` of
 * kind `bad_configuration` otherwise.
 */
export function toolSpec(scope: string, timeoutMs: number, repeat: RepeatSafety): ToolSpec {
  if (typeof scope !== "string" || !scope.startsWith("tool.") || scope === "tool.") {
    throw new ToolError("bad_configuration", `${JSON.stringify(scope)} is not a tool scope (tool.<name>)`);
  }
  if (!(timeoutMs > 0) || timeoutMs > STEP_BUDGET_MS) {
    throw new ToolError(
      "bad_configuration",
      `a tool timeout must be above 0 and at most the ${STEP_BUDGET_MS} ms step budget, got ${timeoutMs}`,
      { scope },
    );
  }
  if (repeat !== "vendor_key" && typeof repeat?.reconcile !== "function") {
    throw new ToolError("bad_configuration", 'repeat safety is "vendor_key" or { reconcile }', { scope });
  }
  return Object.freeze({ scope, timeoutMs, repeat });
}

/** The policy checkpoint's decision, made between the read and the claim: `"hold"` takes no key. */
export type Checkpoint = "allow" | "hold";

/** How a guarded call ended (everything else is a `ToolError`). */
export type ToolRun =
  /**
   * The tool ran in this attempt: its answer as the journal keeps it, which
   * is exactly what every replay answers.
   */
  | { status: "executed"; answer: Answer }
  /** An earlier attempt ran it: its journaled answer. */
  | { status: "replayed"; answer: Answer }
  /**
   * An earlier attempt reached the vendor and was stopped before journaling;
   * the reconciler found the effect, now the call's journaled answer. The
   * vendor was not called again.
   */
  | { status: "reconciled"; answer: Answer }
  /** The checkpoint held the call: nothing ran and no key was taken. */
  | { status: "held" };

/** A `ToolGuard`'s settings. */
export interface ToolGuardOptions {
  /** When the orchestrator makes its last attempt of a step: every call's lease must pass before it. */
  horizon: RetryHorizon;
  /** Added to the timeout and journal deadline to make the lease; 1 s to 5 min, default 15 s. */
  leaseMarginMs?: number;
  /** How long journaling an answer may take, retries included; 1 s to 5 min, default 10 s. */
  journalDeadlineMs?: number;
  /**
   * Claims each call for this short lease (at least 3 s) kept alive by a
   * heartbeat every third of it, never past the whole lease's end: a worker
   * stopped mid-call frees the key after this long. The retry horizon is then
   * checked against it, so a long tool fits a short horizon. A tool whose
   * claim a beat finds taken over, or whose lease no beat could confirm in
   * time (the plane unreachable: it is stopped before the lease can pass),
   * has its signal aborted and raises `in_flight`, its claim left to its lease.
   */
  heartbeatLeaseMs?: number;
  /** Where `tool.call` events go (scope, key, outcome, replayed). */
  log?: Logger;
}

/** One call for `ToolGuard.run`. */
export interface ToolInvocation {
  organizationId: string;
  spec: ToolSpec;
  /**
   * From `toolKey` or `toolCallKey` (the Run and the orchestrator step):
   * never the model's tool-call id, which a replayed agent segment mints
   * anew. Anything else, a cast string included, is refused by `run` as a
   * `bad_configuration` before the plane is asked.
   */
  key: ToolKey;
  /** The call's arguments, hashed (RFC 8785) as its request: other arguments under the key are a conflict. */
  arguments: unknown;
  /** The policy checkpoint (an approval): runs only when the journal has no answer. Default: allow. */
  checkpoint?: () => Promise<Checkpoint> | Checkpoint;
  /**
   * The tool: answers `success(...)` or `failure(...)` (a business failure,
   * journaled and replayed), throws `NothingHappened` for a failure that made
   * no effect (vendor 429/5xx: released, raised as `retryable_failure`).
   */
  tool: (call: ToolCall) => Promise<Answer> | Answer;
}

/** Guards tool calls with the idempotency plane. */
export class ToolGuard {
  readonly #driver: EffectDriver;
  readonly #horizon: RetryHorizon;
  readonly #marginMs: number;
  readonly #journalMs: number;
  readonly #heartbeatMs?: number;

  /** Throws a `ToolError` of kind `bad_configuration` for a margin, deadline or heartbeat lease out of range. */
  constructor(plane: IdempotencyPlane, options: ToolGuardOptions) {
    this.#driver = new EffectDriver(plane, options.log === undefined ? {} : { log: options.log });
    this.#horizon = options.horizon;
    this.#marginMs = inRange("lease margin", options.leaseMarginMs ?? DEFAULT_TOOL_LEASE_MARGIN_MS);
    this.#journalMs = inRange("journal deadline", options.journalDeadlineMs ?? DEFAULT_JOURNAL_DEADLINE_MS);
    this.#heartbeatMs = options.heartbeatLeaseMs;
    configuration(() => this.#timing(1_000));
  }

  /** The lease a call of `spec` is claimed for: timeout + journal deadline + margin, or the heartbeat lease when shorter. */
  leaseFor(spec: ToolSpec): number {
    return this.#timing(spec.timeoutMs).leaseMs;
  }

  /**
   * Throws `lease_outlasts_retries` when a call of `spec` claimed `spentMs`
   * into its step (after its checkpoint) would still hold its lease at the
   * orchestrator's last attempt. Check every spec where it is defined; `run`
   * checks it too, with its checkpoint's time counted.
   */
  check(spec: ToolSpec, spentMs = 0): void {
    const leaseMs = configuration(() => this.leaseFor(spec));
    if (spentMs + leaseMs >= this.#horizon.untilLastMs) {
      throw new ToolError(
        "lease_outlasts_retries",
        `tool ${spec.scope}: its lease (${leaseMs} ms), claimed ${Math.round(spentMs)} ms into the step, ` +
          `does not pass before the orchestrator's last attempt, ${this.#horizon.untilLastMs} ms after the first`,
        { scope: spec.scope },
      );
    }
  }

  /**
   * Runs one tool call at most once.
   *
   * 1. Reads the journal: a stored answer is replayed, a live claim raises
   *    `in_flight`, other arguments under the key raise `conflict`. The
   *    checkpoint is not consulted for any of these.
   * 2. Runs the checkpoint; `"hold"` answers `held` without taking the key.
   *    Its time counts against the retry horizon (`lease_outlasts_retries`).
   * 3. Claims the key. A reclaimed call of a `{ reconcile }` tool asks its
   *    reconciler first (`reconciled`). Then runs the tool with the vendor
   *    key and journals its answer, or releases on `NothingHappened`.
   *
   * The tool (and a reconciler) is cut off at the spec's timeout and the
   * journal at its deadline, both before the lease passes, so no other worker
   * can reclaim the call while this one still runs or journals it. Every
   * other ending is a thrown `ToolError`; let it through the step.
   */
  async run(call: ToolInvocation): Promise<ToolRun> {
    const { spec, key } = call;
    const outcome = (name: string, replayed?: boolean) =>
      this.#driver.log({ event: "tool.call", scope: spec.scope, key, outcome: name, replayed });
    try {
      refuseForeignKey(spec, key);
      this.check(spec);
      const startedAt = monotonicNow();
      const hash = await requestHash(call.arguments ?? null);
      const read = await this.#driver.plane.read({
        organizationId: call.organizationId,
        scope: spec.scope,
        key,
        requestHash: hash,
      });
      switch (read.outcome) {
        case "completed":
          outcome("replayed", true);
          return { status: "replayed", answer: read.answer };
        case "processing":
          throw inFlight(spec, key, read.leaseExpiresAt);
        case "conflict":
          throw conflict(spec, key);
        case "absent":
          break;
      }
      if ((await checkpoint(call)) === "hold") {
        outcome("held");
        return { status: "held" };
      }
      this.check(spec, monotonicNow() - startedAt);
      const timing = this.#timing(spec.timeoutMs);
      const attempt = new Attempt();
      const begun = await this.#driver.beginUntil(
        { organizationId: call.organizationId, scope: spec.scope, key, requestHash: hash, timing },
        attempt,
        attempt.startedAt + spec.timeoutMs / 2,
      );
      switch (begun.kind) {
        case "replayed":
          outcome("replayed", true);
          return { status: "replayed", answer: begun.answer };
        case "in_flight":
          throw inFlight(spec, key, begun.leaseExpiresAt);
        case "conflict":
          throw conflict(spec, key);
        case "held":
          break;
      }
      const reconciled = await reconcile(begun.held, spec, call.arguments);
      if (reconciled) {
        outcome(reconciled.settled.ending === "journaled" ? "reconciled" : reconciled.settled.ending, false);
        return { status: "reconciled", answer: reconciled.answer };
      }
      const executed = await execute(begun.held, spec, call.tool);
      outcome(executed.settled.ending === "journaled" ? "completed" : executed.settled.ending, false);
      return { status: "executed", answer: executed.answer };
    } catch (error) {
      if (!(error instanceof ToolError) && !(error instanceof PlaneError)) throw error;
      const raised = error instanceof ToolError
        ? error
        : new ToolError("plane", `tool call ${spec.scope}/${key}: ${error.message}`, {
          scope: spec.scope,
          key,
          cause: error,
        });
      this.#driver.log({
        event: "tool.call",
        level: raised.retryable ? "info" : "warn",
        scope: spec.scope,
        key,
        outcome: raised.kind,
        ending: raised.settled?.ending,
        retryable: raised.retryable,
        error: raised.message,
      });
      throw raised;
    }
  }

  #timing(timeoutMs: number): Timing {
    return withHeartbeat(new Timing(timeoutMs, this.#journalMs, this.#marginMs), this.#heartbeatMs);
  }
}

/**
 * Refuses a key `toolKey` or `toolCallKey` did not build (a model's tool-call
 * id, say, passed from JavaScript or through a cast): keyed by it, a
 * replayed agent segment, whose model mints a new id, would repeat the effect.
 */
function refuseForeignKey(spec: ToolSpec, key: unknown): void {
  if (isToolKey(key)) return;
  throw new ToolError(
    "bad_configuration",
    `tool call ${spec.scope}: its key ${JSON.stringify(key)} was not built by toolKey or toolCallKey; ` +
      "key a call by its Run and orchestrator step, never by the model's tool-call id",
    { scope: spec.scope },
  );
}

/** The call's checkpoint (allow when it has none); one that throws is raised as `checkpoint_failed`. */
async function checkpoint(call: ToolInvocation): Promise<Checkpoint> {
  if (!call.checkpoint) return "allow";
  try {
    return await call.checkpoint();
  } catch (error) {
    throw new ToolError(
      "checkpoint_failed",
      `tool call ${call.spec.scope}/${call.key}: the checkpoint threw: ${messageOf(error)}`,
      { scope: call.spec.scope, key: call.key, cause: error },
    );
  }
}

/**
 * For a reclaimed call of a `{ reconcile }` tool (every other call goes
 * straight on, answering undefined): asks the reconciler whether the earlier
 * attempt made its effect. One found is journaled as the call's answer; none
 * found goes on to run the tool. A reconciler that cannot tell, or is cut
 * off, leaves the claim to its lease (releasing it would let the next
 * attempt run without asking).
 */
async function reconcile(
  held: Held,
  spec: ToolSpec,
  args: unknown,
): Promise<{ answer: Answer; settled: Settled } | undefined> {
  if (!held.claim.reclaimed || spec.repeat === "vendor_key") return undefined;
  const reconciler = spec.repeat.reconcile;
  const vendor = await vendorKey(held.claim.organizationId, held.claim.scope, held.claim.key);
  const asked = await held.run((signal) => reconciler({ claim: held.claim, signal, vendorKey: vendor }, args));
  const { scope, key } = held.claim;
  if ("cut" in asked && asked.cut !== "threw") {
    const settled = await held.settle({ unknown: "the reconciler did not answer" });
    throw cutOff(asked.cut, spec, key, settled);
  }
  if ("cut" in asked) {
    const settled = await held.settle({ unknown: "the reconciler could not tell" });
    throw new ToolError(
      "reconcile_failed",
      `tool call ${scope}/${key}: could not reconcile an earlier attempt: ${messageOf(asked.error)}`,
      { scope, key, settled, cause: asked.error },
    );
  }
  const found = asked.value;
  if (found === undefined || found === null) return undefined;
  if (typeof found !== "object" || typeof found.ok !== "boolean") {
    const settled = await held.settle({ unknown: "the reconciler answered something that is not an Answer" });
    throw new ToolError("bad_configuration", "a reconciler answers an Answer, or undefined when it found none", {
      scope,
      key,
      settled,
    });
  }
  const answer = replayable(found);
  const settled = await held.settle({ journal: answer });
  return { answer: journaledOrRaise(held, answer, settled, spec), settled };
}

/** Runs the tool under the claim and ends the claim by what it did (run_effect.ts). */
async function execute(
  held: Held,
  spec: ToolSpec,
  tool: ToolInvocation["tool"],
): Promise<{ answer: Answer; settled: Settled }> {
  const ended = await runAndEnd(held, tool);
  const key = held.claim.key;
  if (ended.status === "ran") {
    return { answer: journaledOrRaise(held, ended.answer, ended.settled, spec), settled: ended.settled };
  }
  const details = { scope: spec.scope, key, settled: ended.settled, cause: ended.error };
  switch (ended.why) {
    case "nothing_happened":
      throw new ToolError(
        "retryable_failure",
        `tool call ${spec.scope}/${key} made no effect (${
          messageOf(ended.error)
        }); its claim is ${ended.settled.ending}`,
        details,
      );
    case "threw":
      throw new ToolError(
        "threw",
        `tool call ${spec.scope}/${key} threw (${
          messageOf(ended.error)
        }); its effect is unknown, and its claim is left to its lease`,
        details,
      );
    case "not_an_answer":
      throw new ToolError("bad_configuration", `tool ${spec.scope}: ${messageOf(ended.error)}`, details);
    case "timed_out":
    case "fence_lost":
    case "lease_unconfirmed":
    case "not_started":
      throw cutOff(ended.why, spec, key, ended.settled);
  }
}

/**
 * The answer as the journal keeps it, which is what every replay gives. One
 * that could not be journaled raises `not_journaled`, so the step runs again
 * after the lease (with the same vendor key). When the lease moved on,
 * another worker's ending counts and nothing of ours was stored: the answer
 * as it is.
 */
function journaledOrRaise(held: Held, answer: Answer, settled: Settled, spec: ToolSpec): Answer {
  if (settled.ending === "journaled") return held.journaled ?? answer;
  if (settled.ending === "left_to_lease") {
    const key = held.claim.key;
    throw new ToolError(
      "not_journaled",
      `tool call ${spec.scope}/${key} ran, but its answer was not journaled: ${settled.why}`,
      { scope: spec.scope, key, settled, cause: settled.error },
    );
  }
  return answer;
}

/**
 * A tool or reconciler cut off at the timeout (its effect unknown), or a
 * claim lost to another worker, whose lease no heartbeat confirmed in time
 * (the tool was stopped), or never confirmed (all told as in flight, so the
 * orchestrator retries and the retry meets the claim or takes it over).
 */
function cutOff(
  cut: "timed_out" | "fence_lost" | "lease_unconfirmed" | "not_started",
  spec: ToolSpec,
  key: string,
  settled: Settled,
): ToolError {
  if (cut === "timed_out") {
    return new ToolError(
      "timed_out",
      `tool call ${spec.scope}/${key} did not return within ${spec.timeoutMs} ms; its claim is left to its lease`,
      { scope: spec.scope, key, settled },
    );
  }
  const why = cut === "fence_lost"
    ? "was taken over by another worker"
    : cut === "lease_unconfirmed"
    ? "could not be confirmed (the plane did not answer a heartbeat), so the call was stopped and left to its lease"
    : "could not be confirmed before the deadline";
  return new ToolError("in_flight", `tool call ${spec.scope}/${key}: its claim ${why}`, {
    scope: spec.scope,
    key,
    settled,
  });
}

function inFlight(spec: ToolSpec, key: string, leaseExpiresAt: string): ToolError {
  return new ToolError("in_flight", `tool call ${spec.scope}/${key} is in flight elsewhere until ${leaseExpiresAt}`, {
    scope: spec.scope,
    key,
    leaseExpiresAt,
  });
}

function conflict(spec: ToolSpec, key: string): ToolError {
  return new ToolError("conflict", `tool call ${spec.scope}/${key} was made before with different arguments`, {
    scope: spec.scope,
    key,
  });
}

function inRange(what: string, ms: number): number {
  if (!(ms >= LEASE_MARGIN_RANGE_MS.min && ms <= LEASE_MARGIN_RANGE_MS.max)) {
    throw new ToolError("bad_configuration", `the ${what} must be between 1 s and 5 min, got ${ms} ms`);
  }
  return ms;
}

/** Runs `make`, turning a `PlaneError` it throws (a refused timing) into a `bad_configuration` ToolError. */
function configuration<T>(make: () => T): T {
  try {
    return make();
  } catch (error) {
    if (error instanceof PlaneError) throw new ToolError("bad_configuration", error.message, { cause: error });
    throw error;
  }
}

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
