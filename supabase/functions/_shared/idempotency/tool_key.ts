// The plane's key of a tool call, built from the Run and the orchestrator
// step that makes it: the same keys the Rust client's `ToolKey` builds.
//
// There is deliberately no way to build one from the model's tool-call id: a
// restarted agent segment makes the model mint a new one, so that key would
// miss the earlier claim and repeat the effect. As in Rust, where `ToolKey`
// has no constructor but `for_step` and `for_step_call`, the guard takes a
// `ToolKey`, which only `toolKey` and `toolCallKey` make: a plain string (a
// model's `call_…` or `toolu_…` id) is refused by the type checker, and, for
// JavaScript callers and casts, by `ToolGuard.run` at run time
// (`isToolKey`: only a key these two functions would build passes).

import { PlaneError } from "./errors.ts";

declare const toolKeyBrand: unique symbol;

/**
 * The key of one tool call: a string `toolKey` or `toolCallKey` built from
 * the Run and the orchestrator step, never a model's tool-call id. The brand
 * exists for the type checker only; `isToolKey` checks a string at run time.
 */
export type ToolKey = string & { readonly [toolKeyBrand]: "ToolKey" };

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
export function toolKey(runId: string, stepId: string): ToolKey {
  return `run:${escape(runIdOf(runId))}:step:${escape(stepId)}` as ToolKey;
}

/**
 * The key of the `callIndex`-th distinct call a step makes, for a step that
 * fans out to several calls: the call's position in the step's plan, which a
 * replay recomputes. The same call proposed twice must keep one index, so the
 * duplicate meets the live claim.
 */
export function toolCallKey(runId: string, stepId: string, callIndex: number): ToolKey {
  if (!Number.isInteger(callIndex) || callIndex < 0 || callIndex > 0xffff_ffff) {
    throw PlaneError.invalid("bad_configuration", `a call index is a whole number from 0 to 2^32-1, got ${callIndex}`);
  }
  return `${toolKey(runId, stepId)}:call:${callIndex}` as ToolKey;
}

/** A key's parts: `run:<run>:step:<step>`, then `:call:<index>` for a step's n-th call. */
const TOOL_KEY_SHAPE = /^run:([^:]+):step:([^:]*)(?::call:([0-9]+))?$/;

/**
 * Whether `key` is one that `toolKey` or `toolCallKey` builds: read back into
 * its run, step and index, and built again, to the same string. A model's
 * tool-call id (`call_…`, `toolu_…`) never is, nor a key with a `:` or `%`
 * the builders would have escaped, or a UUID run id in uppercase.
 */
export function isToolKey(key: unknown): key is ToolKey {
  if (typeof key !== "string") return false;
  const parts = TOOL_KEY_SHAPE.exec(key);
  if (parts === null) return false;
  const [, runId, stepId, callIndex] = parts;
  try {
    const built = callIndex === undefined
      ? toolKey(unescape(runId), unescape(stepId))
      : toolCallKey(unescape(runId), unescape(stepId), Number(callIndex));
    return built === key;
  } catch {
    return false;
  }
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

/** `escape` undone (what it never writes is left as it is, so building again tells). */
function unescape(id: string): string {
  return id.replace(/%(25|3A)/g, (_, code: string) => (code === "25" ? "%" : ":"));
}
