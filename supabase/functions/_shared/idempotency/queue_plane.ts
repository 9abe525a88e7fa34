// A queue drained through the plane's own queue functions, as the Rust
// consumer drains it (src/callers/queue/in_plane.rs):
//
// - `agent.idempotency_queue_take` reads a batch from pgmq and claims every
//   message under its idempotency key in one transaction (one round trip);
//   what it can end there it ends: a message no client can read, a
//   conflict, a replay and a message read too often are dead-lettered or
//   archived by the SQL itself, and a key twice in the batch is a `copy`
//   that ends with its first message. Slots the queue did not fill take
//   over the scope's work whose worker stopped, or that an operator sent
//   back after a fix (`redriven`, with its payload and no message).
// - the claimed, reclaimed and re-driven effects run (at most `concurrency`
//   at once), each cut at its timeout and, with heartbeats, kept alive by
//   `agent.idempotency_queue_extend`, which extends the claim and hides its
//   messages as long, so a long effect's message never comes back while it
//   runs;
// - `agent.idempotency_queue_settle` journals every ending and archives
//   exactly the messages whose ending it journaled, in one transaction (one
//   round trip): a message is archived if and only if its answer is
//   journaled, and a failure is dead-lettered once per command. An effect
//   whose outcome is unknown (a throw, a timeout, a cut heartbeat) is not
//   sent: its claim is left to its lease and its messages come back. A
//   settle that fails leaves every message.

import { type Answer, answerFromStored, replayable, store, type StoredAnswer } from "./answer.ts";
import { monotonicNow } from "./clock.ts";
import type { EffectDriver } from "./driver.ts";
import { PlaneError } from "./errors.ts";
import { type Beat, Held, type Settle, type Settled } from "./held.ts";
import { type CallOptions, type Claim, type IdempotencyPlane, metricOutcome } from "./plane.ts";
import { METRICS } from "./telemetry.ts";
import type { Drained, MessageContext, QueueMessage } from "./queue_message.ts";
import type { Timing } from "./timing.ts";
import { vendorKey } from "./vendor_key.ts";

/** What a take did with one message, or with one claim it re-drove. */
export type TakeOutcome =
  /** Claimed afresh: run it under the answered lease token. */
  | "claimed"
  /** Taken over from a worker whose lease passed: run it again. */
  | "reclaimed"
  /** No message: the scope's work whose worker stopped, or sent back after a fix, taken over: run its payload. */
  | "redriven"
  /** Its answer was journaled before (or now: read too often): archived, never run again. */
  | "completed"
  /** A later message of the batch under an earlier one's key and payload: it ends with that message (`copyOf`). */
  | "copy"
  /** Held by another worker: left in the queue, to come back. */
  | "processing"
  /** Its key answers for another payload: dead-lettered and archived. */
  | "conflict"
  /** No client could read or hash it (`reason` says why): dead-lettered alone and archived. */
  | "malformed";

const OUTCOMES: readonly TakeOutcome[] = [
  "claimed",
  "reclaimed",
  "redriven",
  "completed",
  "copy",
  "processing",
  "conflict",
  "malformed",
];

/** One row of a take's answer: messages in message order, then the claims it re-drove. */
export interface TakenItem {
  /** The message's id; undefined for a re-driven claim. */
  msgId?: number;
  readCount?: number;
  enqueuedAt?: string;
  /** The message, for one to run (claimed or reclaimed). */
  message?: unknown;
  organizationId?: string;
  key?: string;
  outcome: TakeOutcome;
  /** For a copy: the message it ends with. */
  copyOf?: number;
  /** The claim's id. */
  id?: string;
  /** The fence of a claim this take holds. */
  leaseToken?: string;
  leaseExpiresAt?: string;
  /** A re-driven claim's attempt: 2 for its first re-drive. */
  attempt?: number;
  /** A re-driven claim's payload (the work its claim keeps). */
  payload?: unknown;
  /** A replayed answer, as stored. */
  response?: unknown;
  /** Whether the take archived the message. */
  archived: boolean;
  /** Whether the take sent it (or, for a re-driven claim, its work) to the dead-letter queue. */
  deadLettered: boolean;
  /** Why a message is malformed. */
  reason?: string;
  /**
   * For a claim to run: the W3C traceparent of the worker that first
   * claimed its key (a take's, or a claim's that carried work), when one
   * was sent; the span that runs a reclaimed or re-driven claim links to it.
   */
  traceparent?: string;
}

/** One take: up to one message per lease token, read from `queue` and claimed in `scope`. */
export interface QueueTake {
  queue: string;
  deadLetterQueue: string;
  /** The organization of a message that names none. */
  organizationId: string;
  /** The organizations whose messages the take accepts; `organizationId` alone by default. */
  organizations?: readonly string[];
  scope: string;
  /** Each claim's lease; a message is hidden for it and a second more. */
  leaseMs: number;
  /** One fresh token per message (or re-driven claim) the take may hold: their number is the batch's size. */
  leaseTokens: readonly string[];
  /** Reads after which a claimed message is journaled as the failure `dead_lettered` instead of run. */
  maxReads: number;
}

/** One claim of a settle or a heartbeat, with its messages (none for a re-driven claim). */
export interface QueueClaim {
  organizationId: string;
  claimId: string;
  leaseToken: string;
  /** Its message and the message's copies; empty for a re-driven claim. */
  msgIds: readonly number[];
}

/** How a settle ends one claim: journal an answer as stored (`store`), release it, or leave it to its lease. */
export type QueueEnding = { journal: StoredAnswer } | "release" | "leave";

/** What a settle did with one claim. */
export interface QueueSettled {
  /** Whether its ending was journaled (by this call or, after a lost answer, by the one it repeats). */
  journaled: boolean;
  /** How many of its messages were archived. */
  archived: number;
  /** Whether this call sent its failure to the dead-letter queue. */
  deadLettered: boolean;
}

type Row = Record<string, unknown>;

/**
 * `agent.idempotency_queue_take`: reads and claims a batch in one
 * transaction. Not repeated after a lost answer (what it took waits for its
 * lease, as a stopped worker's would). An answer with fewer rows than the
 * take made (a server's row cap below the plane's) is a `truncated` error.
 */
export async function queueTake(
  plane: IdempotencyPlane,
  take: QueueTake,
  call: CallOptions = {},
): Promise<TakenItem[]> {
  const count = take.leaseTokens.length;
  if (count < 1 || count > plane.maxRows) {
    throw PlaneError.invalid("bound_above_cap", `a take holds 1 to ${plane.maxRows} lease tokens, not ${count}`);
  }
  const start = { scope: take.scope, attributes: { "idempotency.queue": take.queue, "idempotency.limit": count } };
  return await plane.telemetry.span("idempotency.queue_take", start, async (span) => {
    const items = await takeCall(plane, take, span.traceparent, call);
    for (const item of items) {
      if (item.outcome === "copy" || item.outcome === "malformed") continue;
      const outcome = metricOutcome(item.outcome);
      if (outcome === "redriven") plane.telemetry.count(METRICS.redrives, { scope: take.scope, outcome });
      else plane.telemetry.count(METRICS.outcomes, { operation: "claim", scope: take.scope, outcome });
      if (outcome === "processing") plane.telemetry.count(METRICS.waits, { operation: "claim", scope: take.scope });
    }
    span.set({
      "idempotency.messages": items.filter((item) => item.msgId !== undefined).length,
      "idempotency.claimed": items.filter((item) => item.outcome === "claimed" || item.outcome === "reclaimed").length,
      "idempotency.redriven": items.filter((item) => item.outcome === "redriven").length,
    });
    return items;
  });
}

/** The take's call itself; `traceparent` (the take's span's) goes with every claim it makes. */
async function takeCall(
  plane: IdempotencyPlane,
  take: QueueTake,
  traceparent: string | undefined,
  call: CallOptions,
): Promise<TakenItem[]> {
  const count = take.leaseTokens.length;
  const fn = "idempotency_queue_take";
  const data = await plane.client.rpc(fn, {
    p_queue: take.queue,
    p_dead_letter_queue: take.deadLetterQueue,
    p_organization_id: take.organizationId,
    p_lease_ms: Math.ceil(take.leaseMs),
    p_lease_tokens: take.leaseTokens,
    p_max_reads: take.maxReads,
    p_scope: take.scope,
    ...(take.organizations === undefined ? {} : { p_organizations: take.organizations }),
    p_row_cap: plane.maxRows,
    ...(traceparent === undefined ? {} : { p_traceparent: traceparent }),
  }, call);
  const rows = rowsOf(fn, data);
  if (rows.length > count) throw inconsistent(`${fn} answered ${rows.length} rows for ${count} lease tokens`);
  // Every row says how many the take made: fewer arrived when a row cap cut the answer.
  const cut = rows.find((row) => row.taken !== rows.length);
  if (cut !== undefined) {
    if (typeof cut.taken === "number" && cut.taken > rows.length) {
      throw new PlaneError(
        "truncated",
        `${fn} took ${cut.taken} messages and claims but ${rows.length} rows arrived: the server's row cap is ` +
          `lower than maxRows (${plane.maxRows}); what was not received comes back when its lease passes`,
        { fn },
      );
    }
    throw inconsistent(`${fn} answered ${rows.length} rows, one of which counts ${String(cut.taken)}`);
  }
  const tokens = new Set(take.leaseTokens.map((token) => token.toLowerCase()));
  return rows.map((row): TakenItem => {
    const outcome = row.outcome as TakeOutcome;
    if (!OUTCOMES.includes(outcome)) {
      throw new PlaneError("decode", `${fn} answered an unknown outcome ${JSON.stringify(row.outcome)}`, { fn });
    }
    const item: TakenItem = {
      outcome,
      archived: row.archived === true,
      deadLettered: row.dead_lettered === true,
    };
    const number = (field: string) => optional(row[field], "number", fn, field) as number | undefined;
    const text = (field: string) => optional(row[field], "string", fn, field) as string | undefined;
    item.msgId = number("msg_id");
    item.readCount = number("read_ct");
    item.enqueuedAt = text("enqueued_at");
    if (row.message !== null && row.message !== undefined) item.message = row.message;
    item.organizationId = text("organization_id");
    item.key = text("key");
    item.copyOf = number("copy_of");
    item.id = text("id");
    item.leaseToken = text("lease_token");
    item.leaseExpiresAt = text("lease_expires_at");
    item.attempt = number("attempt");
    if (outcome === "redriven") item.payload = row.payload ?? null;
    if (row.response !== null && row.response !== undefined) item.response = row.response;
    item.reason = text("reason");
    const traceparent = text("traceparent");
    if (traceparent !== undefined && traceparent !== "") item.traceparent = traceparent;
    if (outcome === "claimed" || outcome === "reclaimed" || outcome === "redriven") {
      for (const [field, value] of [["id", item.id], ["key", item.key], ["organization_id", item.organizationId]]) {
        if (value === undefined) throw inconsistent(`${fn} answered a claim to run without its ${field}`);
      }
      if (item.leaseToken === undefined || !tokens.has(item.leaseToken.toLowerCase())) {
        throw inconsistent(`${fn} answered a claim to run under a lease token this call did not send`);
      }
      if (item.leaseExpiresAt === undefined) throw inconsistent(`${fn} answered a claim to run without its lease end`);
      if (outcome === "redriven" ? item.msgId !== undefined : item.msgId === undefined) {
        throw inconsistent(
          `${fn} answered a ${outcome} claim ${outcome === "redriven" ? "with" : "without"} a message`,
        );
      }
      if (outcome !== "redriven" && (item.message === null || typeof item.message !== "object")) {
        throw inconsistent(`${fn} answered a message to run without its body`);
      }
    }
    if (outcome === "copy" && item.copyOf === undefined) throw inconsistent(`${fn} answered a copy of no message`);
    return item;
  });
}

/**
 * `agent.idempotency_queue_settle`: journals each claim's ending and
 * archives exactly the messages whose ending it journaled, in one
 * transaction; answered per claim, in input order. Safe to repeat after a
 * lost answer (the client does).
 */
export async function queueSettle(
  plane: IdempotencyPlane,
  queue: string,
  deadLetterQueue: string,
  items: readonly { claim: QueueClaim; ending: QueueEnding }[],
  call: CallOptions = {},
): Promise<QueueSettled[]> {
  if (items.length === 0) return [];
  checkBatch(plane, items.length);
  const start = { attributes: { "idempotency.queue": queue, "idempotency.items": items.length } };
  return await plane.telemetry.span(
    "idempotency.queue_settle",
    start,
    () => settleCall(plane, queue, deadLetterQueue, items, call),
  );
}

/** The settle's call itself. */
async function settleCall(
  plane: IdempotencyPlane,
  queue: string,
  deadLetterQueue: string,
  items: readonly { claim: QueueClaim; ending: QueueEnding }[],
  call: CallOptions,
): Promise<QueueSettled[]> {
  const fn = "idempotency_queue_settle";
  const data = await plane.client.rpc(fn, {
    p_queue: queue,
    p_dead_letter_queue: deadLetterQueue,
    p_items: items.map(({ claim, ending }) => {
      const item: Record<string, unknown> = { ...claimArg(claim) };
      if (ending === "release" || ending === "leave") {
        item.ending = ending;
      } else {
        item.ending = "journal";
        // Absent values are left out, never sent as null.
        item.response = ending.journal.response;
        if (ending.journal.resource) {
          item.resource_type = ending.journal.resource.resourceType;
          item.resource_id = ending.journal.resource.resourceId;
        }
      }
      return item;
    }),
    p_row_cap: plane.maxRows,
  }, call);
  return itemRows(fn, data, items.length).map((row) => {
    if (typeof row.journaled !== "boolean" || typeof row.archived !== "number") {
      throw new PlaneError("decode", `${fn} answered a row without journaled and archived`, { fn });
    }
    return { journaled: row.journaled, archived: row.archived, deadLettered: row.dead_lettered === true };
  });
}

/**
 * `agent.idempotency_queue_extend`: extends each claim's lease by `leaseMs`
 * and hides its messages as long (the lease and a second more), in one
 * transaction: each claim's new lease end, or null for one that is no
 * longer this caller's. Safe to repeat after a lost answer.
 */
export async function queueExtend(
  plane: IdempotencyPlane,
  queue: string,
  leaseMs: number,
  claims: readonly QueueClaim[],
  call: CallOptions = {},
): Promise<(string | null)[]> {
  if (claims.length === 0) return [];
  checkBatch(plane, claims.length);
  const fn = "idempotency_queue_extend";
  const start = { attributes: { "idempotency.queue": queue, "idempotency.items": claims.length } };
  return await plane.telemetry.span("idempotency.queue_extend", start, async () => {
    const data = await plane.client.rpc(fn, {
      p_queue: queue,
      p_lease_ms: Math.ceil(leaseMs),
      p_items: claims.map(claimArg),
      p_row_cap: plane.maxRows,
    }, call);
    return itemRows(fn, data, claims.length).map((row) => {
      const end = row.lease_expires_at;
      if (end !== null && typeof end !== "string") {
        throw new PlaneError("decode", `${fn} answered a lease end that is neither a time nor null`, { fn });
      }
      return end;
    });
  });
}

/** What `drainInPlane` needs of its consumer. */
export interface PlaneDrain {
  driver: EffectDriver;
  queue: string;
  deadLetterQueue: string;
  organizationId: string;
  organizations?: readonly string[];
  scope: string;
  timing: Timing;
  maxReads: number;
  batchSize: number;
  concurrency: number;
}

/** A claim this drain holds: its message (none for re-driven work), its message and copies, its payload. */
interface Run {
  item: TakenItem;
  message?: QueueMessage;
  msgIds: number[];
  payload: unknown;
  held: Held;
}

/**
 * One drain through the plane's queue functions: a take, the effects, a
 * settle (see the top of this file). Throws only when the take fails: then
 * nothing ran, and what the take may have claimed waits for its lease.
 */
export async function drainInPlane(
  drain: PlaneDrain,
  process: (payload: unknown, context: MessageContext) => Promise<Settle> | Settle,
): Promise<Drained> {
  const { driver, queue, deadLetterQueue, scope, timing } = drain;
  const plane = driver.plane;
  // Every deadline of the batch counts from before the take.
  const started = monotonicNow();
  const items = await queueTake(plane, {
    queue,
    deadLetterQueue,
    organizationId: drain.organizationId,
    organizations: drain.organizations,
    scope,
    leaseMs: timing.leaseMs,
    leaseTokens: Array.from({ length: drain.batchSize }, () => crypto.randomUUID()),
    maxReads: drain.maxReads,
  });
  const drained: Drained = {
    read: items.filter((item) => item.msgId !== undefined).length,
    ran: 0,
    replayed: 0,
    failed: 0,
    archived: 0,
    dead_lettered: 0,
    left: 0,
    redriven: 0,
  };
  const byMessage = new Map(items.flatMap((item) => item.msgId === undefined ? [] : [[item.msgId, item]]));
  const runs: Run[] = [];
  for (const item of items) {
    drained.archived += Number(item.archived);
    drained.dead_lettered += Number(item.deadLettered);
    switch (item.outcome) {
      case "claimed":
      case "reclaimed":
      case "redriven":
        runs.push(hold(drain, item, items, started));
        break;
      case "completed":
        if (item.msgId !== undefined) drained.replayed++;
        break;
      case "copy":
        // A copy of a replayed message was archived with it; one of a
        // message to run ends with it, below.
        if (item.archived && byMessage.get(item.copyOf ?? -1)?.outcome === "completed") drained.replayed++;
        break;
      case "processing":
        drained.left++;
        break;
      case "malformed":
        driver.log({
          event: "queue.dead_lettered",
          level: "warn",
          queue,
          msg_id: item.msgId,
          drop_reason: "malformed_message",
          reason: item.reason,
        });
        break;
      case "conflict":
        driver.log({ event: "queue.dead_lettered", level: "warn", queue, msg_id: item.msgId, drop_reason: "conflict" });
        break;
    }
  }

  // The effects, at most `concurrency` at once, each cut as `Held.run` cuts it.
  const settles: Settle[] = new Array(runs.length);
  let next = 0;
  const worker = async () => {
    while (next < runs.length) {
      const index = next++;
      const run = runs[index];
      const claim = run.held.claim;
      const key = await vendorKey(claim.organizationId, claim.scope, claim.key);
      const outcome = await run.held.run((signal) =>
        process(run.payload, {
          message: run.message,
          claim,
          vendorKey: key,
          signal,
          ...(run.item.outcome === "redriven" ? { attempt: run.item.attempt } : {}),
        })
      );
      settles[index] = "value" in outcome
        ? settleOf(outcome.value)
        : { unknown: outcome.cut === "threw" ? `the effect threw: ${String(outcome.error)}` : outcome.cut };
    }
  };
  await Promise.all(Array.from({ length: Math.max(1, Math.min(drain.concurrency, runs.length)) }, worker));

  // An unknown outcome is left to its lease as it stands, and its messages
  // to their visibility: its heartbeat stops now, and nothing is sent.
  const endings: (Settled | undefined)[] = settles.map((settle, index) => {
    if (settle === "release" || !("unknown" in settle)) return undefined;
    const left: Settled = { ending: "left_to_lease", why: `the effect's outcome is unknown: ${settle.unknown}` };
    runs[index].held.settledBy(left);
    return left;
  });
  // One settle for every other ending, each answer stored as a batch
  // journal stores it.
  const answers: (Answer | undefined)[] = settles.map((settle) =>
    settle !== "release" && "journal" in settle ? replayable(settle.journal) : undefined
  );
  const stored = await Promise.all(
    answers.map((answer) => answer === undefined ? undefined : store(answer, plane.responseLimitBytes, false)),
  );
  const sent: { index: number; claim: QueueClaim; ending: QueueEnding }[] = [];
  runs.forEach((run, index) => {
    const answer = stored[index];
    if (settles[index] === "release") sent.push({ index, claim: queueClaim(run), ending: "release" });
    else if (answer) sent.push({ index, claim: queueClaim(run), ending: { journal: answer } });
  });
  const settledAt: (QueueSettled | undefined)[] = new Array(runs.length);
  let failure = "";
  if (sent.length > 0) {
    const remaining = Math.min(...sent.map(({ index }) => runs[index].held.endingDeadline)) - monotonicNow();
    try {
      if (remaining <= 0) throw new PlaneError("deadline", "the endings' deadline passed before the settle was sent");
      const answered = await queueSettle(plane, queue, deadLetterQueue, sent, { deadlineMs: remaining });
      sent.forEach(({ index }, position) => settledAt[index] = answered[position]);
    } catch (error) {
      if (!(error instanceof PlaneError)) throw error;
      // Nothing is known to have ended: every message comes back, and finds
      // its claim journaled (replayed) or passed (run again, under the same
      // vendor key).
      failure = error.message;
      driver.log({ event: "queue.settle_failed", level: "warn", queue, items: sent.length, error: error.message });
    }
  }

  runs.forEach((run, index) => {
    drained.ran++;
    if (run.item.outcome === "redriven") drained.redriven++;
    const settled = settledAt[index];
    let ending = endings[index];
    if (ending === undefined) {
      const standIn = stored[index]?.standIn;
      ending = settled === undefined
        ? { ending: "left_to_lease", why: `the settle failed: ${failure}` }
        : settles[index] === "release"
        // The settle answers no more for a release than that it journaled
        // nothing: released, or the claim had moved on.
        ? { ending: "released" }
        : !settled.journaled
        ? { ending: "lease_moved_on" }
        : standIn
        ? { ending: "journaled", standIn: standIn.reason }
        : { ending: "journaled" };
      const answer = stored[index];
      run.held.settledBy(
        ending,
        ending.ending === "journaled" && answer ? answerFromStored(answer.response, answer.resource) : undefined,
      );
    }
    if (ending.ending === "journaled" && settled) {
      drained.archived += settled.archived;
      drained.dead_lettered += Number(settled.deadLettered);
      drained.replayed += Math.max(0, run.msgIds.length - 1);
      if (!answers[index]?.ok) drained.failed++;
      if (settled.deadLettered) {
        driver.log({
          event: "queue.dead_lettered",
          level: "warn",
          queue,
          msg_id: run.msgIds[0],
          key: run.held.claim.key,
          drop_reason: answers[index]?.error ?? "failed",
        });
      }
    } else {
      drained.failed++;
      drained.left += run.msgIds.length;
    }
  });
  driver.log({ event: "queue.drain", level: "info", queue, scope, path: "plane", ...drained });
  return drained;
}

/** The claim `item` holds, kept alive (with a heartbeat timing) by the queue's heartbeat. */
function hold(drain: PlaneDrain, item: TakenItem, items: readonly TakenItem[], started: number): Run {
  const claim: Claim = Object.freeze({
    id: item.id as string,
    organizationId: item.organizationId as string,
    scope: drain.scope,
    key: item.key as string,
    leaseToken: (item.leaseToken as string).toLowerCase(),
    leaseExpiresAt: item.leaseExpiresAt as string,
    reclaimed: item.outcome !== "claimed",
    ...(item.traceparent === undefined ? {} : { traceparent: item.traceparent }),
  });
  const msgIds = item.msgId === undefined ? [] : [
    item.msgId,
    ...items.flatMap((copy) =>
      copy.outcome === "copy" && copy.copyOf === item.msgId && !copy.archived && copy.msgId !== undefined
        ? [copy.msgId]
        : []
    ),
  ];
  const body = item.message as Record<string, unknown> | undefined;
  const payload = item.outcome === "redriven" ? item.payload ?? null : body?.payload ?? null;
  const message: QueueMessage | undefined = item.msgId === undefined ? undefined : {
    msgId: item.msgId,
    readCount: item.readCount ?? 0,
    enqueuedAt: item.enqueuedAt ?? "",
    message: item.message,
  };
  const beat: Beat = async (leaseMs, call) => {
    const [end] = await queueExtend(drain.driver.plane, drain.queue, leaseMs, [
      { organizationId: claim.organizationId, claimId: claim.id, leaseToken: claim.leaseToken, msgIds },
    ], call);
    return end;
  };
  const attempt = item.outcome === "redriven" ? item.attempt : item.outcome === "claimed" ? 1 : undefined;
  const held = new Held(drain.driver, claim, { startedAt: started }, drain.timing, { beat, attempt });
  return { item, message, msgIds, payload, held };
}

/** What `process` answered, when it is a `Settle`; anything else leaves the outcome unknown. */
function settleOf(value: unknown): Settle {
  if (value === "release") return value;
  if (value !== null && typeof value === "object") {
    const settle = value as { journal?: { ok?: unknown }; unknown?: unknown };
    if (typeof settle.journal === "object" && settle.journal !== null && typeof settle.journal.ok === "boolean") {
      return value as Settle;
    }
    if (typeof settle.unknown === "string") return value as Settle;
  }
  return { unknown: "process answered something that is not a Settle" };
}

function queueClaim(run: Run): QueueClaim {
  const claim = run.held.claim;
  return { organizationId: claim.organizationId, claimId: claim.id, leaseToken: claim.leaseToken, msgIds: run.msgIds };
}

function claimArg(claim: QueueClaim): Record<string, unknown> {
  return {
    organization_id: claim.organizationId,
    claim_id: claim.claimId,
    lease_token: claim.leaseToken,
    msg_ids: claim.msgIds,
  };
}

function checkBatch(plane: IdempotencyPlane, count: number): void {
  if (count > plane.maxRows) {
    throw PlaneError.invalid(
      "bound_above_cap",
      `a batch holds at most ${plane.maxRows} items (the server's row cap), not ${count}`,
    );
  }
}

function rowsOf(fn: string, data: unknown): Row[] {
  if (!Array.isArray(data) || data.some((row) => row === null || typeof row !== "object" || Array.isArray(row))) {
    throw new PlaneError("decode", `${fn} answered something other than a set of rows`, { fn });
  }
  return data as Row[];
}

/** Exactly `count` rows, numbered 0 to `count - 1` in order; fewer is a row cap cutting the answer. */
function itemRows(fn: string, data: unknown, count: number): Row[] {
  const rows = rowsOf(fn, data);
  if (rows.length < count) {
    throw new PlaneError(
      "truncated",
      `${fn} answered ${rows.length} rows for ${count} items: the server's row cap is lower than maxRows`,
      { fn },
    );
  }
  if (rows.length > count) throw inconsistent(`${fn} answered ${rows.length} rows for ${count} items`);
  const misplaced = rows.findIndex((row, index) => row.item !== index);
  if (misplaced >= 0) throw inconsistent(`${fn} answered item ${String(rows[misplaced].item)} in place ${misplaced}`);
  return rows;
}

function optional(value: unknown, type: "number" | "string", fn: string, field: string): unknown {
  if (value === null || value === undefined) return undefined;
  const matches = type === "number" ? typeof value === "number" : typeof value === "string";
  if (!matches) throw new PlaneError("decode", `${fn} answered a ${field} that is not a ${type}`, { fn });
  return value;
}

function inconsistent(message: string): PlaneError {
  return new PlaneError("inconsistent", `the store answered inconsistently: ${message}`);
}
