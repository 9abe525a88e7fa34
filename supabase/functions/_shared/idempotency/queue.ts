// Supabase Queues (pgmq) consumed effectively once.
//
// pgmq delivers at least once: a message whose visibility timeout passes
// before it is archived comes back to the next reader, and a producer's retry
// is a second message. So each message is claimed in the plane under the
// producer's idempotency key before its effect runs: a redelivery or a
// duplicate finds the claim held (left alone) or its answer journaled
// (archived without running again). A batch of messages costs one read, one
// claim round trip, the effects, one journal round trip, and one archive per
// message that ended; a message is archived only once its effect's answer is
// journaled.
//
// Queues are reached as Supabase serves them: the `pgmq_public` functions of
// its Data API (https://supabase.com/docs/guides/queues/api), with the
// service role.

import { type Answer, failure as failed } from "./answer.ts";
import { type BatchReport, driveMany, isDone } from "./batch.ts";
import { FetchTransport, PlaneClient, type SupabaseLike, SupabaseTransport } from "./client.ts";
import type { EffectDriver } from "./driver.ts";
import { PlaneError } from "./errors.ts";
import { requestHash } from "./hash.ts";
import type { Settle } from "./held.ts";
import { vendorKey } from "./vendor_key.ts";
import { type Claim, MAX_KEY_CHARS, type PlaneSource } from "./plane.ts";
import type { Timing } from "./timing.ts";

/** The schema Supabase's Data API serves the queue functions from. */
export const QUEUES_SCHEMA = "pgmq_public";

/** One message as `pgmq_public.read` answers it. */
export interface QueueMessage {
  readonly msgId: number;
  /** How often it was read, this read included. */
  readonly readCount: number;
  readonly enqueuedAt: string;
  /** The message as the producer sent it. */
  readonly message: unknown;
}

/** Supabase Queues through its Data API: `pgmq_public.read`, `send`, `archive`, `delete`. */
export class Queues {
  readonly client: PlaneClient;

  constructor(client: PlaneClient) {
    this.client = client;
  }

  /** Queues over a supabase-js client or `{ url, key }`, as `IdempotencyPlane.connect` takes them. */
  static connect(source: PlaneSource): Queues {
    const transport = "schema" in source && typeof source.schema === "function"
      ? new SupabaseTransport(source as SupabaseLike, QUEUES_SCHEMA)
      : new FetchTransport({ ...(source as { url: string; key: string }), schema: QUEUES_SCHEMA });
    return new Queues(new PlaneClient(transport));
  }

  /**
   * Up to `n` messages of `queue`, each invisible to other readers for
   * `visibilitySeconds`. Not repeated after a lost answer: the messages it
   * read come back when their visibility passes.
   */
  async read(queue: string, visibilitySeconds: number, n: number): Promise<QueueMessage[]> {
    const data = await this.client.rpc("read", { queue_name: queue, sleep_seconds: visibilitySeconds, n });
    if (!Array.isArray(data)) throw new PlaneError("decode", "pgmq_public.read answered something other than rows");
    return data.map((row) => {
      if (
        row === null || typeof row !== "object" || typeof row.msg_id !== "number" || typeof row.read_ct !== "number"
      ) {
        throw new PlaneError("decode", "pgmq_public.read answered a row without msg_id and read_ct");
      }
      return { msgId: row.msg_id, readCount: row.read_ct, enqueuedAt: String(row.enqueued_at), message: row.message };
    });
  }

  /** Moves message `msgId` of `queue` to its archive; false when it is not in the queue. */
  async archive(queue: string, msgId: number): Promise<boolean> {
    return await this.#boolean("archive", { queue_name: queue, message_id: msgId });
  }

  /** Deletes message `msgId` of `queue`; false when it is not in the queue. */
  async delete(queue: string, msgId: number): Promise<boolean> {
    return await this.#boolean("delete", { queue_name: queue, message_id: msgId });
  }

  /** Sends `message` to `queue`; answers its id. pgmq keeps every send: a repeat is a second message. */
  async send(queue: string, message: unknown, delaySeconds = 0): Promise<number> {
    const data = await this.client.rpc("send", { queue_name: queue, message, sleep_seconds: delaySeconds });
    const id = Array.isArray(data) ? data[0] : data;
    if (typeof id !== "number") throw new PlaneError("decode", "pgmq_public.send answered no message id");
    return id;
  }

  async #boolean(fn: string, args: Record<string, unknown>): Promise<boolean> {
    const data = await this.client.rpc(fn, args);
    if (typeof data !== "boolean") throw new PlaneError("decode", `pgmq_public.${fn} answered a non-boolean`);
    return data;
  }
}

/** How a consumer drains its queue. */
export interface ConsumerOptions {
  /** The pgmq queue. */
  queue: string;
  /** The tenant every message of this queue belongs to. */
  organizationId: string;
  /**
   * Each effect's timeout, its journal's deadline and the lease they make;
   * `timing.withHeartbeats(leaseMs)` claims a short lease kept alive by
   * heartbeats while the effects run (see `MessageContext.signal`).
   */
  timing: Timing;
  /** The plane scope the messages are claimed in. Default `queue.<queue>`. */
  scope?: string;
  /**
   * Where a message goes whose effect failed for good (a journaled failure),
   * whose key answers for another payload, that no key can be read from, or
   * that was read more than `maxReads` times: sent there with its failure,
   * then archived. Required: without it such a message would have nowhere
   * to go but the archive, where nobody looks.
   */
  deadLetterQueue: string;
  /** Reads after which a message that never ended is dead-lettered. Default 5. */
  maxReads?: number;
  /** Messages per read, at most the plane's row cap. Default 10. */
  batchSize?: number;
  /** Effects run at once. Default 10. */
  concurrency?: number;
}

/** What the effect of one message is given. */
export interface MessageContext {
  message: QueueMessage;
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
}

/** What one drain did. */
export interface Drained {
  /** Messages read. */
  read: number;
  /** Messages whose effect this worker ran (whatever its ending). */
  ran: number;
  /** Messages whose effect had ended before (a redelivery or a duplicate): not run again. */
  replayed: number;
  /** Messages this worker ran that did not end journaled as a success (failed, released, left to the lease). */
  failed: number;
  /** Messages archived: their effect's answer is journaled. */
  archived: number;
  /** Messages sent to the dead-letter queue. */
  dead_lettered: number;
  /** Messages left in the queue: they come back once their visibility passes. */
  left: number;
}

/** The idempotency key of a message and its payload: `{ idempotency_key, payload }`. */
function keyAndPayload(message: QueueMessage): { key: string; payload: unknown; fromProducer: boolean } | undefined {
  const body = message.message;
  if (body === null || typeof body !== "object" || Array.isArray(body)) return undefined;
  const { idempotency_key: key, payload } = body as { idempotency_key?: unknown; payload?: unknown };
  if (typeof key === "string" && key !== "" && [...key].length <= MAX_KEY_CHARS && !key.includes("\0")) {
    return { key, payload: payload ?? null, fromProducer: true };
  }
  if (key !== undefined && key !== null) return undefined;
  // No key from the producer: the message id, which a producer's retry does
  // not share. Redeliveries are still caught, duplicates sent twice are not.
  return { key: `msg-${message.msgId}`, payload: payload ?? null, fromProducer: false };
}

/**
 * A Supabase Queues consumer whose effects happen once per idempotency key,
 * however often pgmq delivers a message and however often the producer sent
 * it. See `drain`.
 */
export class QueueConsumer {
  readonly driver: EffectDriver;
  readonly queues: Queues;
  readonly options: Required<ConsumerOptions>;

  constructor(driver: EffectDriver, queues: Queues, options: ConsumerOptions) {
    this.driver = driver;
    this.queues = queues;
    const batchSize = options.batchSize ?? 10;
    if (!Number.isInteger(batchSize) || batchSize < 1 || batchSize > driver.plane.maxRows) {
      throw PlaneError.invalid("bound_above_cap", `batchSize must be from 1 to ${driver.plane.maxRows}`);
    }
    this.options = {
      scope: `queue.${options.queue}`,
      maxReads: 5,
      concurrency: 10,
      ...options,
      batchSize,
    };
  }

  /**
   * Drains one batch: reads up to `batchSize` messages, hidden for the
   * claim's whole lease; claims them in one round trip under each message's
   * idempotency key; runs `process` for the messages this worker now holds
   * (not for one read more than `maxReads` times: that one is journaled as
   * a failure instead); journals their endings in one round trip; then
   * archives exactly the messages whose answer is journaled (a success, or
   * a replay of one), and sends to the dead-letter queue, then archives,
   * those whose journaled answer is a failure or whose key answers for
   * another payload. Every other message is left: it comes back when its
   * visibility passes, and finds its claim held (left alone) or taken over.
   *
   * `process` answers how its effect ended (`{ journal: success(…) }`,
   * `{ journal: failure(…) }`, `"release"` when nothing happened, or
   * `{ unknown }`); a throw or a timeout leaves the outcome unknown.
   */
  async drain(process: (payload: unknown, context: MessageContext) => Promise<Settle> | Settle): Promise<Drained> {
    const { queue, organizationId, scope, timing, maxReads, batchSize, concurrency } = this.options;
    const visibility = Math.ceil(timing.leaseMs / 1000) + 1;
    const messages = await this.queues.read(queue, visibility, batchSize);
    const drained: Drained = {
      read: messages.length,
      ran: 0,
      replayed: 0,
      failed: 0,
      archived: 0,
      dead_lettered: 0,
      left: 0,
    };
    if (messages.length === 0) return drained;

    const parsed = messages.map(keyAndPayload);
    const endings: Promise<void>[] = [];
    // A message no key can be read from never runs: dead-lettered as it is.
    parsed.forEach((item, index) => {
      if (!item) endings.push(this.#deadLetter(messages[index], failed("malformed_message", null), drained));
    });
    const batch = parsed.flatMap((item, index) => item ? [{ ...item, message: messages[index] }] : []);
    if (batch.length === 0) {
      await Promise.all(endings);
      return drained;
    }
    const items = await Promise.all(
      batch.map(async (item) => ({ key: item.key, requestHash: await requestHash(item.payload) })),
    );
    let report: BatchReport;
    try {
      report = await driveMany(
        this.driver,
        { organizationId, scope, timing, items },
        async (index, claim, signal): Promise<Settle> => {
          const { message, payload } = batch[index];
          if (message.readCount > maxReads) {
            return { journal: failed("dead_lettered", { reads: message.readCount, max_reads: maxReads }) };
          }
          const key = await vendorKey(claim.organizationId, claim.scope, claim.key);
          return await process(payload, { message, claim, vendorKey: key, signal });
        },
        { concurrency },
      );
    } catch (error) {
      await Promise.all(endings);
      throw error;
    }
    report.items.forEach((item, index) => {
      const message = batch[index].message;
      if (item.kind === "ran") {
        drained.ran++;
        if (!(isDone(item) && item.answer?.ok)) drained.failed++;
      }
      if (item.kind === "replayed") drained.replayed++;
      const answer: Answer | undefined = isDone(item) && (item.kind === "ran" || item.kind === "replayed")
        ? item.answer
        : undefined;
      if (answer?.ok) endings.push(this.#archive(message, drained));
      else if (answer) endings.push(this.#deadLetter(message, answer, drained));
      else if (item.kind === "conflict") {
        endings.push(this.#deadLetter(message, failed("conflict", { key: batch[index].key }), drained));
      } else drained.left++;
    });
    await Promise.all(endings);
    this.driver.log({
      event: "queue.drain",
      level: "info",
      queue,
      scope,
      ...drained,
    });
    return drained;
  }

  /** Archives `message`; one that fails to archive is left, and comes back to replay its answer. */
  async #archive(message: QueueMessage, drained: Drained): Promise<void> {
    try {
      // False: no longer in the queue (another consumer archived it).
      if (await this.queues.archive(this.options.queue, message.msgId)) drained.archived++;
    } catch (error) {
      drained.left++;
      this.driver.log({
        event: "queue.archive_failed",
        level: "warn",
        queue: this.options.queue,
        msg_id: message.msgId,
        error: error instanceof Error ? error.message : String(error),
      });
    }
  }

  /**
   * Sends `message` with its failure to the dead-letter queue, then archives
   * it. A worker stopped between the two sends it again on the message's
   * next delivery: a dead-letter queue may hold a message twice, under the
   * same idempotency key.
   */
  async #deadLetter(message: QueueMessage, answer: Answer, drained: Drained): Promise<void> {
    try {
      await this.queues.send(this.options.deadLetterQueue, {
        ...(typeof message.message === "object" && message.message !== null ? message.message : {}),
        dead_letter: {
          queue: this.options.queue,
          msg_id: message.msgId,
          reads: message.readCount,
          message: message.message,
          failure: { ok: answer.ok, error: answer.error ?? null, output: answer.output },
        },
      });
    } catch (error) {
      drained.left++;
      this.driver.log({
        event: "queue.dead_letter_failed",
        level: "warn",
        queue: this.options.queue,
        msg_id: message.msgId,
        error: error instanceof Error ? error.message : String(error),
      });
      return;
    }
    drained.dead_lettered++;
    this.driver.log({
      event: "queue.dead_lettered",
      level: "warn",
      queue: this.options.queue,
      msg_id: message.msgId,
      drop_reason: answer.error ?? "failed",
    });
    await this.#archive(message, drained);
  }
}
