// The plane's key of a tool call, built from the Run and the orchestrator
// step that makes it: the same keys the Rust client's `ToolKey` builds.
//
// There is deliberately no way to build one from the model's tool-call id: a
// restarted agent segment makes the model mint a new one, so that key would
// miss the earlier claim and repeat the effect.

import { PlaneError } from "./errors.ts";

/**
 * The key of the call made by step `stepId` of Run `runId`: `run:<run>:step:<step>`.
 * The step id is the orchestrator's (Inngest's `step.run` id, a Trigger.dev
 * task's idempotency key), which a replay recomputes; never the model's
 * tool-call id. A UUID run id is written in lowercase, as the Rust client
 * writes it; the Rust client takes only UUIDs, so a run id of another form
 * (an Inngest ULID) keys calls made from TypeScript alone. A `:` or `%` in
 * either id is percent-encoded, so distinct
 * `(run, step)` and `(run, step, index)` never share a key; ids without
 * either (UUIDs, ULIDs, slugs) are used as given.
 */
export function toolKey(runId: string, stepId: string): string {
  return `run:${escape(runIdOf(runId))}:step:${escape(stepId)}`;
}

/**
 * The key of the `callIndex`-th distinct call a step makes, for a step that
 * fans out to several calls: the call's position in the step's plan, which a
 * replay recomputes. The same call proposed twice must keep one index, so the
 * duplicate meets the live claim.
 */
export function toolCallKey(runId: string, stepId: string, callIndex: number): string {
  if (!Number.isInteger(callIndex) || callIndex < 0 || callIndex > 0xffff_ffff) {
    throw PlaneError.invalid("bad_configuration", `a call index is a whole number from 0 to 2^32-1, got ${callIndex}`);
  }
  return `${toolKey(runId, stepId)}:call:${callIndex}`;
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/**
 * The run id as the key holds it: a UUID in lowercase, as the Rust client
 * writes one (so both clients meet the same claim); any other id (Inngest's
 * ULIDs) as given.
 */
function runIdOf(runId: string): string {
  if (typeof runId !== "string" || runId === "") {
    throw PlaneError.invalid("empty_key", "the run id of a tool key is empty");
  }
  return UUID.test(runId) ? runId.toLowerCase() : runId;
}

/** `%` and `:` percent-encoded: injective, and the identity on ids without them. */
function escape(id: string): string {
  return id.replaceAll("%", "%25").replaceAll(":", "%3A");
}
