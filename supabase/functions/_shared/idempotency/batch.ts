// Batches of effects: many claims in one round trip, each item then run and
// ended exactly as a single effect is (held.ts), as the Rust crate's batch
// driver does.
//
// `beginMany` claims a whole batch in one call; `settleMany` writes the
// endings of many held claims in one call per kind (journals, releases).
// Whenever a batch call fails, each of its items falls back to its own
// `Held.settle`, with every rule a single ending has (retries within the
// deadline, a stand-in for an answer the store refuses, a release whose
// answer was lost checked against the row): one item never fails the
// others. `driveMany` puts the three together and reports each item's
// ending, the failures listed as a queue wants them (the shape of AWS
// Powertools' `batchItemFailures`).

import { type Answer, answerFromStored, replayable, store } from "./answer.ts";
import { sleep } from "./client.ts";
import { monotonicNow } from "./clock.ts";
import { Attempt, type Begun, type EffectDriver } from "./driver.ts";
import { PlaneError } from "./errors.ts";
import { FIRST_ENDING_BACKOFF_MS, Held, MAX_ENDING_BACKOFF_MS, type Settle, type Settled } from "./held.ts";
import type { Claim } from "./plane.ts";
import type { Timing } from "./timing.ts";

/** One effect of a batch: the key it is claimed under and what it carries. */
export interface BatchItem {
  key: string;
  requestHash: string;
  /** The work the claim carries, for a re-drive (see `IdempotencyPlane.claim`). */
  work?: unknown;
}

/** A batch of effects: one organization, one scope, one timing. */
export interface BatchSpec {
  organizationId: string;
  scope: string;
  timing: Timing;
  /** At most the plane's `maxRows`. */
  items: readonly BatchItem[];
}

/** How one item of a batch ended. */
export type ItemEnding =
  /** An earlier attempt's answer, replayed: the effect is done. */
  | { kind: "replayed"; answer: Answer }
  /** Another worker holds a live lease: the effect may be in flight. */
  | { kind: "in_flight"; leaseExpiresAt: string }
  /** The key answers for another request: this item never runs. */
  | { kind: "conflict" }
  /** This worker held the claim, ran the effect and ended it so (`answer` once journaled). */
  | { kind: "ran"; settled: Settled; answer?: Answer };

/** Each item's ending, in input order, and the failures a queue must deliver again. */
export interface BatchReport {
  items: ItemEnding[];
  /**
   * The indices of the items that are not done (see `isDone`): never the
   * whole batch failed for one item. Map them to your message ids for
   * Powertools' `{ batchItemFailures: [{ itemIdentifier }] }`.
   */
  failures: number[];
}

/** True when the item's effect is done and its answer journaled (by this worker or an earlier one). */
export function isDone(item: ItemEnding): boolean {
  return item.kind === "replayed" || (item.kind === "ran" && item.settled.ending === "journaled");
}

/** The ending's name, as logged: `replayed`, `in_flight`, `conflict`, or how a run was settled. */
export function endingName(item: ItemEnding): string {
  return item.kind === "ran" ? item.settled.ending : item.kind;
}

/**
 * Claims every item of `batch` in one round trip and answers, per item in
 * input order, what `driver.begin` would: held (run it, then settle it),
 * replayed, in flight, or a conflict. Each held claim's deadlines count
 * from now. A failure whose outcome is unknown (a lost answer) is asked
 * again with the same lease tokens, with backoff, until the effects'
 * timeout: claims the first try made are then answered as this batch's own.
 */
export async function beginMany(driver: EffectDriver, batch: BatchSpec): Promise<Begun[]> {
  const attempts = batch.items.map(() => new Attempt());
  const startedAt = attempts.length > 0 ? attempts[0].startedAt : monotonicNow();
  const untilMs = startedAt + batch.timing.effectMs;
  const request = {
    organizationId: batch.organizationId,
    scope: batch.scope,
    leaseMs: batch.timing.leaseMs,
    items: batch.items.map((item, index) => ({ ...item, leaseToken: attempts[index].token })),
  };
  let backoff = FIRST_ENDING_BACKOFF_MS;
  for (;;) {
    const remaining = untilMs - monotonicNow();
    if (remaining <= 0) {
      throw new PlaneError("deadline", "the batch's claims did not come back before the effects' timeout", {
        fn: "idempotency_claim_many",
        inFlight: true,
      });
    }
    try {
      const outcomes = await driver.plane.claimMany(request, { deadlineMs: remaining });
      driver.log({
        event: "idempotency.claim_many",
        level: "info",
        scope: batch.scope,
        items: outcomes.length,
        claimed: outcomes.filter((o) => o.outcome === "claimed" || o.outcome === "reclaimed").length,
        replayed: outcomes.filter((o) => o.outcome === "completed").length,
      });
      return outcomes.map((outcome, index): Begun => {
        switch (outcome.outcome) {
          case "claimed":
          case "reclaimed": {
            const first = outcome.outcome === "claimed" ? { attempt: 1 } : {};
            return { kind: "held", held: new Held(driver, outcome.claim, attempts[index], batch.timing, first) };
          }
          case "completed":
            return { kind: "replayed", answer: outcome.answer };
          case "processing":
            return { kind: "in_flight", leaseExpiresAt: outcome.leaseExpiresAt };
          case "conflict":
            return { kind: "conflict" };
        }
      });
    } catch (error) {
      if (!(error instanceof PlaneError) || !error.mayHaveWritten || monotonicNow() + backoff >= untilMs) throw error;
      driver.log({
        event: "idempotency.claim_many_unknown",
        level: "info",
        scope: batch.scope,
        error: error.message,
        backoff_ms: backoff,
      });
      await sleep(backoff);
      backoff = Math.min(backoff * 2, MAX_ENDING_BACKOFF_MS);
    }
  }
}

/**
 * Ends every held claim as its `settle` says, answering each one's
 * `Settled` in input order. The journals go in one round trip and the
 * releases in another (claims of one organization); an item settled
 * `{ unknown }` writes nothing. When a batch call fails, each of its items
 * is settled on its own by `Held.settle` and its rules.
 */
export async function settleMany(
  driver: EffectDriver,
  endings: readonly { held: Held; settle: Settle }[],
): Promise<Settled[]> {
  const organizationId = endings[0]?.held.claim.organizationId;
  if (endings.length < 2 || endings.some(({ held }) => held.claim.organizationId !== organizationId)) {
    return await Promise.all(endings.map(({ held, settle }) => held.settle(settle)));
  }
  const settled: Settled[] = new Array(endings.length);
  const journals: { index: number; held: Held; answer: Answer }[] = [];
  const releases: { index: number; held: Held }[] = [];
  endings.forEach(({ held, settle }, index) => {
    if (settle === "release") releases.push({ index, held });
    else if ("journal" in settle) journals.push({ index, held, answer: replayable(settle.journal) });
    else {
      const left: Settled = { ending: "left_to_lease", why: `the effect's outcome is unknown: ${settle.unknown}` };
      held.settledBy(left);
      settled[index] = left;
    }
  });
  const [journaled, released] = await Promise.all([journalMany(driver, journals), releaseMany(driver, releases)]);
  for (const { index, ending } of [...journaled, ...released]) settled[index] = ending;
  return settled;
}

/**
 * Claims `batch`, runs each held item's `effect` (at most `concurrency` at
 * once, each cut at its timeout, or by its heartbeat, as `Held.run` cuts it:
 * a cut or a throw leaves the outcome unknown, whatever the effect answers
 * later), and settles them all: each item ends journaled, released or left
 * to its lease exactly as a single effect does.
 * `effect` gets the item's index, its claim (whose key is the vendor's
 * idempotency key) and the abort signal, and answers how to end it. Throws
 * only when the batch could not be claimed at all.
 */
export async function driveMany(
  driver: EffectDriver,
  batch: BatchSpec,
  effect: (index: number, claim: Claim, signal: AbortSignal) => Promise<Settle> | Settle,
  options: { concurrency?: number } = {},
): Promise<BatchReport> {
  const begun = await beginMany(driver, batch);
  const items: (ItemEnding | undefined)[] = begun.map((b) => {
    switch (b.kind) {
      case "held":
        return undefined;
      case "replayed":
        return { kind: "replayed", answer: b.answer };
      case "in_flight":
        return { kind: "in_flight", leaseExpiresAt: b.leaseExpiresAt };
      case "conflict":
        return { kind: "conflict" };
    }
  });
  const held = begun.flatMap((b, index) => b.kind === "held" ? [{ index, held: b.held }] : []);
  const ran: { index: number; held: Held; settle: Settle }[] = [];
  let next = 0;
  const worker = async () => {
    while (next < held.length) {
      const { index, held: claim } = held[next++];
      const outcome = await claim.run((signal) => effect(index, claim.claim, signal));
      const settle: Settle = "value" in outcome
        ? outcome.value
        : { unknown: outcome.cut === "threw" ? `the effect threw: ${String(outcome.error)}` : outcome.cut };
      ran.push({ index, held: claim, settle });
    }
  };
  const workers = Math.max(1, Math.min(options.concurrency ?? 16, held.length));
  await Promise.all(Array.from({ length: workers }, worker));
  const settled = await settleMany(driver, ran);
  ran.forEach(({ index, held }, position) => {
    items[index] = { kind: "ran", settled: settled[position], answer: held.journaled };
  });
  const endings = items.map((item): ItemEnding =>
    item ?? { kind: "ran", settled: { ending: "left_to_lease", why: "the batch lost track of this item" } }
  );
  return { items: endings, failures: endings.flatMap((item, index) => isDone(item) ? [] : [index]) };
}

/** The journals, in one round trip, or each on its own when that call fails. */
async function journalMany(
  driver: EffectDriver,
  journals: readonly { index: number; held: Held; answer: Answer }[],
): Promise<{ index: number; ending: Settled }[]> {
  if (journals.length === 0) return [];
  const plane = driver.plane;
  const stored = await Promise.all(journals.map(({ answer }) => store(answer, plane.responseLimitBytes, false)));
  const remaining = Math.min(...journals.map(({ held }) => held.endingDeadline)) - monotonicNow();
  let endings: Awaited<ReturnType<typeof plane.completeMany>> | undefined;
  if (remaining > 0) {
    try {
      endings = await plane.completeMany(
        journals.map(({ held }, position) => ({
          claim: held.claim,
          completion: { response: stored[position].response, resource: stored[position].resource },
        })),
        { deadlineMs: remaining },
      );
    } catch (error) {
      if (!(error instanceof PlaneError)) throw error;
      driver.log({
        event: "idempotency.journal_many_failed",
        level: "info",
        items: journals.length,
        error: error.message,
      });
    }
  }
  if (endings === undefined) {
    return await Promise.all(
      journals.map(async ({ index, held, answer }) => ({ index, ending: await held.settle({ journal: answer }) })),
    );
  }
  return journals.map(({ index, held }, position) => {
    const ending: Settled = endings[position] === "recorded"
      ? (stored[position].standIn
        ? { ending: "journaled", standIn: stored[position].standIn.reason }
        : { ending: "journaled" })
      : { ending: "lease_moved_on" };
    held.settledBy(ending, answerFromStored(stored[position].response, stored[position].resource));
    return { index, ending };
  });
}

/**
 * The releases, in one round trip, or each on its own when that call fails
 * (checked against the row when the batch may have landed, as a single
 * release whose answer was lost is).
 */
async function releaseMany(
  driver: EffectDriver,
  releases: readonly { index: number; held: Held }[],
): Promise<{ index: number; ending: Settled }[]> {
  if (releases.length === 0) return [];
  const plane = driver.plane;
  const remaining = Math.min(...releases.map(({ held }) => held.endingDeadline)) - monotonicNow();
  let mayHaveLanded = false;
  if (remaining > 0) {
    try {
      const endings = await plane.releaseMany(releases.map(({ held }) => held.claim), { deadlineMs: remaining });
      return releases.map(({ index, held }, position) => {
        const ending: Settled = endings[position] === "recorded"
          ? { ending: "released" }
          : { ending: "lease_moved_on" };
        held.settledBy(ending);
        return { index, ending };
      });
    } catch (error) {
      if (!(error instanceof PlaneError)) throw error;
      mayHaveLanded = error.mayHaveWritten;
    }
  }
  return await Promise.all(
    releases.map(async ({ index, held }) => ({
      index,
      ending: await held.settle("release", { releaseMayHaveLanded: mayHaveLanded }),
    })),
  );
}
