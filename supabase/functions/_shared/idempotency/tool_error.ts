// Why a guarded tool call did not produce an answer: one error type an
// orchestrator's step lets through, so the orchestrator runs the step again
// (`retryable`) or stops retrying it.

import { PlaneError } from "./errors.ts";
import type { Settled } from "./held.ts";

/** Why a guarded call did not answer. */
export type ToolErrorKind =
  /**
   * Another worker holds a live lease on this call: the effect may be in
   * flight. Never a result: the step runs again, after `retryAfter`.
   */
  | "in_flight"
  /** The key already answers for a call with different arguments. */
  | "conflict"
  /** The tool threw `NothingHappened`: it made no effect, its claim was released, and the next attempt runs it. */
  | "retryable_failure"
  /** The tool did not return within its timeout: its effect is unknown, and its claim is left to its lease. */
  | "timed_out"
  /** The tool threw (anything but `NothingHappened`): its effect is unknown, and its claim is left to its lease. */
  | "threw"
  /**
   * The tool answered, but its answer could not be journaled before the
   * journal's deadline: the claim is left to its lease, and the step runs
   * again after it, reaching the vendor with the same vendor key (or asking
   * the reconciler).
   */
  | "not_journaled"
  /** The reconciler could not tell whether an earlier attempt's effect happened: the claim is kept until its lease passes. */
  | "reconcile_failed"
  /**
   * The call's lease, taken after its checkpoint, would still hold at the
   * orchestrator's last attempt: a worker stopped while holding it would fail
   * the whole Run.
   */
  | "lease_outlasts_retries"
  /** The checkpoint threw (`cause`): no key was taken, so running the step again is safe. */
  | "checkpoint_failed"
  /**
   * A tool or guard setting was refused (`toolSpec`, `ToolGuard`), or a call
   * key `toolKey` or `toolCallKey` did not build (a model's tool-call id): a
   * bug, never retried.
   */
  | "bad_configuration"
  /** The plane failed (`cause` is the `PlaneError`): retryable when it is transient. */
  | "plane";

/** Why a guarded call did not answer. Let it through the step: `retryable` says whether a retry can succeed. */
export class ToolError extends Error {
  override readonly name = "ToolError";
  readonly kind: ToolErrorKind;
  /** The tool's scope, once known. */
  readonly scope?: string;
  /** The call's key, once known. */
  readonly key?: string;
  /**
   * For `in_flight` met at a claim: when the other worker's lease passes, by
   * the database clock (ISO 8601). Absent when this worker's own claim was
   * taken over or could not be confirmed.
   */
  readonly leaseExpiresAt?: string;
  /** How the claim ended, for the kinds that held one. */
  readonly settled?: Settled;

  constructor(
    kind: ToolErrorKind,
    message: string,
    details: { scope?: string; key?: string; leaseExpiresAt?: string; settled?: Settled; cause?: unknown } = {},
  ) {
    super(message, details.cause === undefined ? undefined : { cause: details.cause });
    this.kind = kind;
    this.scope = details.scope;
    this.key = details.key;
    this.leaseExpiresAt = details.leaseExpiresAt;
    this.settled = details.settled;
  }

  /**
   * True when running the step again later may succeed: a call in flight
   * elsewhere, a released or unknown effect (its lease will pass), a
   * transient plane failure. False for a conflict or a configuration error:
   * tell the orchestrator not to retry (Inngest's `NonRetriableError`,
   * Trigger.dev's `AbortTaskRunError`).
   */
  get retryable(): boolean {
    switch (this.kind) {
      case "in_flight":
      case "checkpoint_failed":
      case "retryable_failure":
      case "timed_out":
      case "threw":
      case "not_journaled":
      case "reconcile_failed":
        return true;
      case "plane":
        return this.cause instanceof PlaneError && this.cause.isTransient;
    }
    return false;
  }

  /**
   * For `in_flight` met at a claim: the soonest a retry can find the call
   * ended or reclaimable (the other lease's end); undefined otherwise. Give it to the orchestrator
   * (Inngest's `RetryAfterError`) so the retry does not meet the same lease.
   */
  get retryAfter(): Date | undefined {
    return this.leaseExpiresAt === undefined ? undefined : new Date(this.leaseExpiresAt);
  }
}
