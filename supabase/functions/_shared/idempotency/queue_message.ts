// What a queue consumer reads, gives each message's effect and answers for
// a drain: the types both of its paths share (queue.ts through
// pgmq_public, queue_plane.ts through the plane's own queue functions).

import type { Claim } from "./plane.ts";

/** One message as `pgmq_public.read` answers it. */
export interface QueueMessage {
  readonly msgId: number;
  /** How often it was read, this read included. */
  readonly readCount: number;
  readonly enqueuedAt: string;
  /** The message as the producer sent it. */
  readonly message: unknown;
}

/** What the effect of one message is given. */
export interface MessageContext {
  /**
   * The message as read; undefined for work re-driven from the plane (its
   * worker stopped, or an operator sent its failure back after a fix),
   * whose message was archived or is still hidden.
   */
  message?: QueueMessage;
  /** The claim: `claim.key` is the message's idempotency key. */
  claim: Claim;
  /** The tenant's key for this message, to send downstream as `Idempotency-Key`. */
  vendorKey: string;
  /**
   * Aborted when the effect's timeout passes, and with a heartbeat timing
   * when a beat finds the claim taken over or none could confirm the lease in
   * time (the plane unreachable): the message is then left, nothing of its
   * effect journaled, whatever `process` answers later.
   */
  signal: AbortSignal;
  /** For re-driven work: which attempt this is (2 for its first re-drive). */
  attempt?: number;
}

/** What one drain did. */
export interface Drained {
  /** Messages read. */
  read: number;
  /** Effects this worker ran (whatever their ending), re-driven ones included. */
  ran: number;
  /** Messages whose effect had ended before (a redelivery or a duplicate): not run again. */
  replayed: number;
  /** Effects this worker ran that did not end journaled as a success (failed, released, left to the lease). */
  failed: number;
  /** Messages archived: their answer is journaled, or they were sent to the dead-letter queue. */
  archived: number;
  /** Messages (or re-driven work) sent to the dead-letter queue. */
  dead_lettered: number;
  /** Messages left in the queue: they come back once their visibility passes. */
  left: number;
  /**
   * Effects run again from the plane without a message: their worker
   * stopped, or an operator sent their failure back after a fix (always 0
   * on the `data_api` path).
   */
  redriven: number;
}
