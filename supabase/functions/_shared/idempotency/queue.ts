// Supabase Queues (pgmq) consumed effectively once.
//
// pgmq delivers at least once: a message whose visibility timeout passes
// before it is archived comes back to the next reader, and a producer's retry
// is a second message. So each message is claimed in the plane under the
// producer's idempotency key before its effect runs: a redelivery or a
// duplicate finds the claim held (left alone) or its answer journaled
// (archived without running again); a message is archived only once its
// effect's answer is journaled.
//
// Two paths, chosen by `ConsumerOptions.path` (by default the first drain
// finds out which the plane serves):
//
// - the plane's own queue functions (queue_plane.ts): a batch is read and
//   claimed in one transaction, and settled (journaled, archived,
//   dead-lettered) in another: two round trips plus the effects; a failed
//   command is one dead letter; failures can be sent back after a fix
//   (`idem redrive --failed`) and run again from the plane;
// - Supabase's `pgmq_public` functions of its Data API
//   (https://supabase.com/docs/guides/queues/api), with the service role,
//   for a plane without them: one read, one claim round trip, the effects,
//   one journal round trip, and one archive per message that ended.
//
// On both, a message no client can read or hash (not an object, a key that
// is not a string, a number beyond every double) is dead-lettered alone, at
// once, with its text; the rest of its batch runs.

import { type Answer, failure as failed } from "./answer.ts";
import { type BatchReport, driveMany, isDone } from "./batch.ts";
import { FetchTransport, PlaneClient, type SupabaseLike, SupabaseTransport } from "./client.ts";
import type { EffectDriver } from "./driver.ts";
import { codes, PlaneError } from "./errors.ts";
import { requestHash } from "./hash.ts";
import type { Settle } from "./held.ts";
import { vendorKey } from "./vendor_key.ts";
import { checkOrganization, MAX_KEY_CHARS, type PlaneSource } from "./plane.ts";
import { drainInPlane, type PlaneDrain } from "./queue_plane.ts";
import type { Drained, MessageContext, QueueMessage } from "./queue_message.ts";
export type { Drained, MessageContext, QueueMessage } from "./queue_message.ts";
import type { Timing } from "./timing.ts";

/** The schema Supabase's Data API serves the queue functions from. */
export const QUEUES_SCHEMA = "pgmq_public";

/** `JSON.rawJSON` and `JSON.isRawJSON`, where the runtime has them (Deno, Node.js 21+, browsers). */
const RAW_JSON = JSON as unknown as {
  rawJSON?: (text: string) => unknown;
  isRawJSON?: (value: unknown) => boolean;
};

/**
 * Reads a body as JSON.parse does, except a number beyond every double
 * (`1e400`, which JSON.parse reads as Infinity): kept as its source text
 * (`JSON.rawJSON`), where the runtime can, so that a message no client can
 * read goes to the dead-letter queue as it was sent. Elsewhere it stays
 * Infinity; either way such a message is malformed (see `readMessage`).
 */
function readKeepingNumbers(text: string): unknown {
  const raw = RAW_JSON.rawJSON;
  if (!raw) return JSON.parse(text);
  return JSON.parse(
    text,
    (_key: string, value: unknown, context?: { source?: string }) =>
      typeof value === "number" && !Number.isFinite(value) && typeof context?.source === "string"
        ? raw(context.source)
        : value,
  );
}

/** Supabase Queues through its Data API: `pgmq_public.read`, `send`, `archive`, `delete`. */
export class Queues {
  readonly client: PlaneClient;

  constructor(client: PlaneClient) {
    this.client = client;
  }

  /**
   * Queues over a supabase-js client or `{ url, key }`, as `IdempotencyPlane.connect` takes them.
   * Over `{ url, key }`, a number in a message that no double can hold is
   * read as its source text (see `QueueConsumer`), where the runtime can.
   */
  static connect(source: PlaneSource): Queues {
    const transport = "schema" in source && typeof source.schema === "function"
      ? new SupabaseTransport(source as SupabaseLike, QUEUES_SCHEMA)
      : new FetchTransport({ ...(source as { url: string; key: string }), schema: QUEUES_SCHEMA }, readKeepingNumbers);
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

/**
 * Which functions a consumer drains its queue through.
 *
 * - `plane`: the plane's own queue functions (`agent.idempotency_queue_take`,
 *   `_settle`, `_extend`): a batch is read and claimed in one transaction
 *   and settled in another, two round trips plus the effects; a message is
 *   archived if and only if its ending is journaled; a failed command is one
 *   dead letter; failures sent back after a fix (`idem redrive --failed`)
 *   run again on a later drain. They need the privileges
 *   `agent.idempotency_queue_privileges` lists.
 * - `data_api`: Supabase's `pgmq_public` functions, for a plane without its
 *   queue functions.
 * - `auto` (the default): `plane` when the plane has the functions, else
 *   `data_api`, decided by the first drain (PostgREST's PGRST202 for the
 *   take: no such function).
 */
export type QueuePath = "auto" | "plane" | "data_api";

/** How a consumer drains its queue. */
export interface ConsumerOptions {
  /** The pgmq queue. */
  queue: string;
  /**
   * The tenant of the queue's messages: every message's, or, with
   * `organizations`, that of a message that names no `organization_id`.
   */
  organizationId: string;
  /**
   * For a queue shared by tenants: the organizations whose messages this
   * consumer takes. A message may name its own (`organization_id`, a UUID)
   * and is claimed under it; one naming an organization not among these is
   * dead-lettered as malformed. Default: `organizationId` alone.
   */
  organizations?: readonly string[];
  /**
   * Each effect's timeout, its journal's deadline and the lease they make;
   * `timing.withHeartbeats(leaseMs)` claims a short lease kept alive by
   * heartbeats while the effects run (see `MessageContext.signal`), which
   * on the plane's path also keep each message hidden as long.
   */
  timing: Timing;
  /** The plane scope the messages are claimed in. Default `queue.<queue>`. */
  scope?: string;
  /**
   * Where a message goes whose effect failed for good (a journaled failure),
   * whose key answers for another payload, that no client can read, or
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
  /** Which functions drain the queue. Default `auto`. */
  path?: QueuePath;
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** A message this consumer can run: its organization, key, payload and the payload's hash. */
interface Readable {
  organizationId: string;
  key: string;
  payload: unknown;
  requestHash: string;
}

/**
 * What a message holds, as the plane's take reads it: `{ idempotency_key,
 * payload, organization_id? }`. No key from the producer: the message id,
 * which a producer's retry does not share (redeliveries are still caught,
 * duplicates sent twice are not). A message no client can read or hash
 * answers why (`reason`): it is dead-lettered alone.
 */
async function readMessage(
  message: QueueMessage,
  organizationId: string,
  accepted: ReadonlySet<string>,
): Promise<Readable | { reason: string }> {
  const body = message.message;
  if (body === null || typeof body !== "object" || Array.isArray(body) || RAW_JSON.isRawJSON?.(body)) {
    return { reason: "the message is not a JSON object" };
  }
  if (holdsUnreadableNumber(body)) {
    return { reason: "the message holds a number beyond every IEEE 754 double, which a client reads as infinity" };
  }
  const fields = body as { idempotency_key?: unknown; payload?: unknown; organization_id?: unknown };
  let key: string;
  if (typeof fields.idempotency_key === "string") {
    key = fields.idempotency_key;
    const chars = [...key].length;
    if (chars < 1 || chars > MAX_KEY_CHARS) {
      return { reason: `idempotency_key must have 1 to ${MAX_KEY_CHARS} characters` };
    }
    if (!key.isWellFormed()) return { reason: "idempotency_key holds a lone UTF-16 surrogate" };
    if (key.includes("\0")) return { reason: "idempotency_key holds a NUL character" };
  } else if (fields.idempotency_key === undefined || fields.idempotency_key === null) {
    key = `msg-${message.msgId}`;
  } else {
    return { reason: "idempotency_key is not a string" };
  }
  let organization = organizationId;
  if (fields.organization_id !== undefined && fields.organization_id !== null) {
    if (typeof fields.organization_id !== "string" || !UUID.test(fields.organization_id)) {
      return { reason: "organization_id is not a UUID" };
    }
    organization = fields.organization_id.toLowerCase();
    if (!accepted.has(organization)) {
      return { reason: `organization_id ${organization} is not one this consumer accepts` };
    }
  }
  const payload = fields.payload ?? null;
  try {
    return { organizationId: organization, key, payload, requestHash: await requestHash(payload) };
  } catch (error) {
    return { reason: `the payload cannot be hashed: ${error instanceof Error ? error.message : String(error)}` };
  }
}

/** Whether `value` holds a number no double can hold (read as Infinity, or kept as its source text). */
function holdsUnreadableNumber(value: unknown): boolean {
  const pending: unknown[] = [value];
  while (pending.length > 0) {
    const item = pending.pop();
    if (typeof item === "number") {
      if (!Number.isFinite(item)) return true;
    } else if (item !== null && typeof item === "object") {
      if (RAW_JSON.isRawJSON?.(item)) return true;
      pending.push(...(Array.isArray(item) ? item : Object.values(item)));
    }
  }
  return false;
}

/** The options a consumer runs with: every default filled in. */
export type ResolvedConsumerOptions = Required<Omit<ConsumerOptions, "organizations">> & {
  organizations?: readonly string[];
};

/**
 * A Supabase Queues consumer whose effects happen once per idempotency key,
 * however often pgmq delivers a message and however often the producer sent
 * it. See `drain`.
 */
export class QueueConsumer {
  readonly driver: EffectDriver;
  readonly queues: Queues;
  readonly options: ResolvedConsumerOptions;
  /** Under path `auto`: whether the plane has its queue functions, once a drain found out. */
  #inPlane?: boolean;

  constructor(driver: EffectDriver, queues: Queues, options: ConsumerOptions) {
    this.driver = driver;
    this.queues = queues;
    const batchSize = options.batchSize ?? 10;
    if (!Number.isInteger(batchSize) || batchSize < 1 || batchSize > driver.plane.maxRows) {
      throw PlaneError.invalid("bound_above_cap", `batchSize must be from 1 to ${driver.plane.maxRows}`);
    }
    const organizationId = checkOrganization(options.organizationId);
    const organizations = options.organizations?.map(checkOrganization);
    if (organizations && !organizations.includes(organizationId)) {
      throw PlaneError.invalid(
        "bad_configuration",
        "organizationId (the organization of a message that names none) must be among organizations",
      );
    }
    const path = options.path ?? "auto";
    if (!["auto", "plane", "data_api"].includes(path)) {
      throw PlaneError.invalid("bad_configuration", `path must be auto, plane or data_api, not ${String(path)}`);
    }
    this.options = {
      scope: `queue.${options.queue}`,
      maxReads: 5,
      concurrency: 10,
      ...options,
      organizationId,
      organizations,
      batchSize,
      path,
    };
  }

  /**
   * Drains one batch. On the plane's path (queue_plane.ts): one take reads
   * up to `batchSize` messages, hidden for the claim's lease and a second,
   * and claims each under its idempotency key, in one transaction; it
   * dead-letters what no client can read and conflicts, archives replays,
   * journals a message read more than `maxReads` times as a failure, and
   * fills the slots the queue left with work re-driven from the plane. Then
   * `process` runs for every claim this worker holds, and one settle
   * journals their endings and archives exactly the messages whose ending it
   * journaled (a key twice in the batch with the same payload ends once,
   * both messages archived), sending a failure to the dead-letter queue
   * once per command.
   *
   * On the Data API's path: reads the batch; dead-letters at once, alone,
   * each message it cannot read or hash; claims the rest in one round trip
   * per organization; runs `process` for the messages this worker now holds
   * (not for one read more than `maxReads` times: that one is journaled as
   * a failure instead); journals their endings in one round trip; then
   * archives exactly the messages whose answer is journaled (a success, or
   * a replay of one), and sends to the dead-letter queue, then archives,
   * those whose journaled answer is a failure or whose key answers for
   * another payload.
   *
   * Every other message is left: it comes back when its visibility passes,
   * and finds its claim held (left alone), journaled (archived) or taken
   * over. `process` answers how its effect ended (`{ journal: success(…) }`,
   * `{ journal: failure(…) }`, `"release"` when nothing happened, or
   * `{ unknown }`); a throw or a timeout leaves the outcome unknown. Throws
   * only when the batch could not be read or claimed at all.
   */
  async drain(process: (payload: unknown, context: MessageContext) => Promise<Settle> | Settle): Promise<Drained> {
    const path = this.options.path;
    if (path === "data_api" || (path === "auto" && this.#inPlane === false)) {
      return await this.#drainThroughDataApi(process);
    }
    if (path === "plane" || this.#inPlane === true) return await drainInPlane(this.#planeDrain(), process);
    let drained: Drained;
    try {
      drained = await drainInPlane(this.#planeDrain(), process);
    } catch (error) {
      if (error instanceof PlaneError && error.code === codes.PGRST202 && error.fn === "idempotency_queue_take") {
        this.driver.log({
          event: "queue.data_api",
          level: "info",
          queue: this.options.queue,
          why: "the plane has no queue functions (PGRST202); draining through pgmq_public",
        });
        this.#inPlane = false;
        return await this.#drainThroughDataApi(process);
      }
      throw error;
    }
    this.#inPlane = true;
    return drained;
  }

  #planeDrain(): PlaneDrain {
    const { queue, deadLetterQueue, organizationId, organizations, scope, timing, maxReads, batchSize, concurrency } =
      this.options;
    return {
      driver: this.driver,
      queue,
      deadLetterQueue,
      organizationId,
      organizations,
      scope,
      timing,
      maxReads,
      batchSize,
      concurrency,
    };
  }

  /** `drain` through Supabase's `pgmq_public`. */
  async #drainThroughDataApi(
    process: (payload: unknown, context: MessageContext) => Promise<Settle> | Settle,
  ): Promise<Drained> {
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
      redriven: 0,
    };
    if (messages.length === 0) return drained;

    const accepted = new Set(this.options.organizations ?? [organizationId]);
    const read = await Promise.all(messages.map((message) => readMessage(message, organizationId, accepted)));
    const endings: Promise<void>[] = [];
    // A message no client can read or hash never runs: dead-lettered alone, at once.
    read.forEach((item, index) => {
      if ("reason" in item) endings.push(this.#deadLetterMalformed(messages[index], item.reason, drained));
    });
    // One batch per organization, claimed in one round trip each.
    const groups = new Map<string, { message: QueueMessage; item: Readable }[]>();
    read.forEach((item, index) => {
      if ("reason" in item) return;
      const group = groups.get(item.organizationId) ?? [];
      group.push({ message: messages[index], item });
      groups.set(item.organizationId, group);
    });
    const share = Math.max(1, Math.floor(concurrency / Math.max(1, groups.size)));
    const reports = await Promise.allSettled(
      [...groups].map(([organization, batch]) =>
        driveMany(
          this.driver,
          {
            organizationId: organization,
            scope,
            timing,
            items: batch.map(({ item }) => ({ key: item.key, requestHash: item.requestHash })),
          },
          async (index, claim, signal): Promise<Settle> => {
            const { message, item } = batch[index];
            if (message.readCount > maxReads) {
              return { journal: failed("dead_lettered", { reads: message.readCount, max_reads: maxReads }) };
            }
            const key = await vendorKey(claim.organizationId, claim.scope, claim.key);
            return await process(item.payload, { message, claim, vendorKey: key, signal });
          },
          { concurrency: share },
        )
      ),
    );
    const batches = [...groups.values()];
    let failure: unknown;
    reports.forEach((outcome, group) => {
      if (outcome.status === "rejected") {
        // Nothing of this organization's batch was claimed for sure: its
        // messages come back when their visibility passes.
        failure ??= outcome.reason;
        drained.left += batches[group].length;
        return;
      }
      this.#ended(outcome.value, batches[group], drained, endings);
    });
    await Promise.all(endings);
    if (failure !== undefined) throw failure;
    this.driver.log({ event: "queue.drain", level: "info", queue, scope, path: "data_api", ...drained });
    return drained;
  }

  /** Archives or dead-letters each message of `batch` as its ending in `report` says. */
  #ended(
    report: BatchReport,
    batch: readonly { message: QueueMessage; item: Readable }[],
    drained: Drained,
    endings: Promise<void>[],
  ): void {
    report.items.forEach((item, index) => {
      const { message, item: { key } } = batch[index];
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
        endings.push(this.#deadLetter(message, failed("conflict", { key }), drained));
      } else drained.left++;
    });
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
   * next delivery: on this path a dead-letter queue may hold a message
   * twice, under the same idempotency key.
   */
  async #deadLetter(message: QueueMessage, answer: Answer, drained: Drained): Promise<void> {
    await this.#sendDeadLetter(message, answer.error ?? "failed", {
      ...(typeof message.message === "object" && message.message !== null ? message.message : {}),
      dead_letter: {
        queue: this.options.queue,
        msg_id: message.msgId,
        reads: message.readCount,
        message: message.message,
        failure: { ok: answer.ok, error: answer.error ?? null, output: answer.output },
      },
    }, drained);
  }

  /**
   * Sends a message no client can read to the dead-letter queue as its text
   * (`dead_letter.message_text`), as the plane's take does, so the
   * dead-letter queue stays readable by every client; then archives it.
   */
  async #deadLetterMalformed(message: QueueMessage, reason: string, drained: Drained): Promise<void> {
    await this.#sendDeadLetter(message, "malformed_message", {
      dead_letter: {
        queue: this.options.queue,
        msg_id: message.msgId,
        reads: message.readCount,
        message_text: JSON.stringify(message.message) ?? "null",
        failure: { ok: false, error: "malformed_message", output: { reason } },
      },
    }, drained);
  }

  async #sendDeadLetter(message: QueueMessage, why: string, letter: unknown, drained: Drained): Promise<void> {
    try {
      await this.queues.send(this.options.deadLetterQueue, letter);
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
      drop_reason: why,
    });
    await this.#archive(message, drained);
  }
}
