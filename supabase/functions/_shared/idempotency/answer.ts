// The answer an effect gives, and the one stored form every client journals
// it in — byte for byte the Rust crate's, so a replay through either client
// is indistinguishable from the first answer whatever its size or bytes.
//
// The stored form is an envelope, `{"ok": bool, "error": …, "output": …}`,
// with the effect's resource in the row's own resource columns. PostgreSQL
// cannot hold U+0000 in jsonb, and a reader cannot read back JSON nested
// deeper than its recursion limit, so a field holding either (or shaped like
// one of the stand-ins below) is stored as its compact JSON text,
// `{"$json": "<text>"}`, and read back as the original. Above the store
// limit the output goes by reference: `{"$response_ref": {...}}` to the
// effect's resource (with the original's size and SHA-256), or, for an
// effect that names no resource, an `{"$elided": {...}}` summary. `ok` is
// always kept, and so is the error up to MAX_STORED_ERROR_BYTES.

import { sha256Hex } from "./hash.ts";

/** The deepest nesting of arrays and objects a stored response may have. */
export const MAX_RESPONSE_DEPTH = 64;

/** The longest error kept whole when the answer is above the store limit, in bytes. */
export const MAX_STORED_ERROR_BYTES = 1024;

/** The error kept when even a shortened one does not fit, in bytes. */
const LAST_RESORT_ERROR_BYTES = 64;

/** The longest resource type and id the table accepts, in characters. */
export const MAX_RESOURCE_TYPE_CHARS = 128;
export const MAX_RESOURCE_ID_CHARS = 512;

const JSON_TEXT_KEY = "$json";
const RESPONSE_REF_KEY = "$response_ref";
const ELIDED_KEY = "$elided";
const MARKERS = [JSON_TEXT_KEY, RESPONSE_REF_KEY, ELIDED_KEY];

/** The resource an effect made, stored in the row beside its answer. */
export interface ResourceRef {
  resourceType: string;
  resourceId: string;
}

/** Where an output too large to store went: its resource, and its size and digest. */
export interface ResponseRef {
  resource_type: string;
  resource_id: string;
  /** The output's size in bytes, as compact JSON. */
  size: number;
  /** Lowercase hex SHA-256 of that compact JSON. */
  sha256: string;
}

/** A summary stored in place of an output the store cannot hold. */
export interface Elided {
  /** `nul`, `too_deep`, `too_large` or `refused`. */
  reason: string;
  size?: number;
  sha256?: string;
}

/**
 * What an effect answered: success or a business failure (an answer
 * repeating the effect would give again), with its output and the resource
 * it made. Journaled so that a replay equals it.
 */
export interface Answer {
  ok: boolean;
  /** A machine-readable failure (`not_found`, `card_declined`, …). */
  error?: string;
  output: unknown;
  resource?: ResourceRef;
}

/** A success with `output`. */
export function success(output: unknown, resource?: ResourceRef): Answer {
  return resource ? { ok: true, output, resource } : { ok: true, output };
}

/** A business failure: journaled, and replayed as the same failure. */
export function failure(error: string, output: unknown = null, resource?: ResourceRef): Answer {
  return resource ? { ok: false, error, output, resource } : { ok: false, error, output };
}

/**
 * `answer` as its JSON form: what the journal holds and every replay
 * returns, so the first answer can be made equal to them. A Date becomes
 * its string, `undefined` members go, NaN becomes null, as JSON.stringify
 * does; an output with no JSON form at all (a bigint, a cycle, a throwing
 * toJSON) becomes an `{"$elided": {"reason": "refused"}}` summary, and a
 * non-string error its String().
 */
export function replayable(answer: Answer): Answer {
  let output: unknown;
  try {
    const text = JSON.stringify(answer.output ?? null);
    output = text === undefined ? null : JSON.parse(text);
  } catch {
    output = { [ELIDED_KEY]: { reason: "refused" } };
  }
  const normal: Answer = { ok: answer.ok === true, output };
  if (answer.error !== undefined && answer.error !== null) normal.error = String(answer.error);
  if (answer.resource) normal.resource = answer.resource;
  return normal;
}

/** Why the store cannot hold a value as given. */
export type Unstorable =
  | { reason: "nul" }
  /**
   * A string or key holds a lone UTF-16 surrogate (a string cut inside an
   * emoji with `.slice`, say): JSON can carry it only as an escape that
   * PostgreSQL's `jsonb` refuses.
   */
  | { reason: "lone_surrogate" }
  | { reason: "too_deep" }
  | { reason: "too_large"; size: number; limit: number }
  | { reason: "refused" };

/** Size of `value` as compact JSON, in UTF-8 bytes. */
export function jsonSize(value: unknown): number {
  return utf8Length(JSON.stringify(value) ?? "null");
}

function utf8Length(text: string): number {
  return new TextEncoder().encode(text).length;
}

/**
 * The first reason `value`, nested `enclosing` levels deep in the stored
 * answer, cannot be stored within `limit` bytes; undefined when it can.
 * Walks without recursion, so any depth is safe to check.
 */
export function unstorable(value: unknown, enclosing: number, limit: number): Unstorable | undefined {
  const pending: Array<[unknown, number]> = [[value, enclosing]];
  while (pending.length > 0) {
    const [item, depth] = pending.pop()!;
    if (typeof item === "string") {
      if (item.includes("\0")) return { reason: "nul" };
      if (!item.isWellFormed()) return { reason: "lone_surrogate" };
    } else if (Array.isArray(item)) {
      if (depth + 1 > MAX_RESPONSE_DEPTH) return { reason: "too_deep" };
      for (const inner of item) pending.push([inner, depth + 1]);
    } else if (item !== null && typeof item === "object") {
      if (depth + 1 > MAX_RESPONSE_DEPTH) return { reason: "too_deep" };
      for (const [name, inner] of Object.entries(item)) {
        if (name.includes("\0")) return { reason: "nul" };
        if (!name.isWellFormed()) return { reason: "lone_surrogate" };
        pending.push([inner, depth + 1]);
      }
    }
  }
  const size = jsonSize(value);
  return size > limit ? { reason: "too_large", size, limit } : undefined;
}

/** The value of `object`'s only member, when that member is `key`. */
function single(value: unknown, key: string): unknown {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return undefined;
  const names = Object.keys(value);
  return names.length === 1 && names[0] === key ? (value as Record<string, unknown>)[key] : undefined;
}

/** Reads a stored `{"$response_ref": …}` back; undefined for any other value. */
export function responseRefOf(value: unknown): ResponseRef | undefined {
  const inner = single(value, RESPONSE_REF_KEY) as Record<string, unknown> | undefined;
  if (!inner || typeof inner !== "object") return undefined;
  const names = Object.keys(inner).sort().join(",");
  if (names !== "resource_id,resource_type,sha256,size") return undefined;
  if (typeof inner.resource_type !== "string" || typeof inner.resource_id !== "string") return undefined;
  if (typeof inner.size !== "number" || typeof inner.sha256 !== "string") return undefined;
  return inner as unknown as ResponseRef;
}

/** Reads a stored `{"$elided": …}` back; undefined for any other value. */
export function elidedOf(value: unknown): Elided | undefined {
  const inner = single(value, ELIDED_KEY) as Record<string, unknown> | undefined;
  if (!inner || typeof inner !== "object" || typeof inner.reason !== "string") return undefined;
  if (Object.keys(inner).some((name) => !["reason", "size", "sha256"].includes(name))) return undefined;
  return inner as unknown as Elided;
}

/** `value` as the store can hold it and read back as itself. */
function storable(value: unknown, enclosing: number): unknown {
  const looksLikeMarker = MARKERS.some((key) => single(value, key) !== undefined);
  if (unstorable(value, enclosing, Number.MAX_SAFE_INTEGER) === undefined && !looksLikeMarker) return value;
  return { [JSON_TEXT_KEY]: JSON.stringify(value) };
}

/** A stored field read back: its text parsed when stored as text. */
function decode(stored: unknown): unknown {
  const text = single(stored, JSON_TEXT_KEY);
  if (typeof text === "string") {
    try {
      return JSON.parse(text);
    } catch {
      return stored;
    }
  }
  return stored;
}

/** Whether a stored response is an envelope this module (or the Rust crate) stored. */
function isEnvelope(value: unknown): value is Record<string, unknown> {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return false;
  const members = value as Record<string, unknown>;
  return typeof members.ok === "boolean" &&
    Object.keys(members).every((key) => ["ok", "error", "output", "error_elided"].includes(key));
}

/** Encodes keys to compare them by their UTF-8 bytes, as `jsonb` orders them. */
const KEY_ENCODER = new TextEncoder();

/**
 * `value` with every object's members in the order PostgreSQL's `jsonb`
 * keeps them: shorter keys first, then by their UTF-8 bytes. (JavaScript
 * still puts integer-like keys first.) Servers hand a stored answer back in
 * different orders (PostgREST in `jsonb`'s, others sorted), so every
 * answer read back is put in this one order, and the first answer too: the
 * two are then equal byte for byte as JSON, whichever server answered. A
 * field kept as its JSON text (`{"$json": "…"}`) is a string here, so its
 * own order (the effect's) stays.
 */
export function inJsonbOrder(value: unknown): unknown {
  if (Array.isArray(value)) return value.map(inJsonbOrder);
  if (value === null || typeof value !== "object") return value;
  const keys = Object.keys(value).map((key) => ({ key, bytes: KEY_ENCODER.encode(key) }));
  keys.sort((a, b) => {
    if (a.bytes.length !== b.bytes.length) return a.bytes.length - b.bytes.length;
    for (let i = 0; i < a.bytes.length; i++) {
      if (a.bytes[i] !== b.bytes[i]) return a.bytes[i] - b.bytes[i];
    }
    return 0;
  });
  // Own data properties, never the `__proto__` setter: a member of that
  // name is data like any other.
  return Object.fromEntries(keys.map(({ key }) => [key, inJsonbOrder((value as Record<string, unknown>)[key])]));
}

/**
 * Reads a stored answer back, its members in one order (`inJsonbOrder`). A
 * response another client stored in another shape replays as a success
 * whose output is that response.
 */
export function answerFromStored(stored: unknown, resource?: ResourceRef): Answer {
  const response = inJsonbOrder(stored);
  let answer: Answer;
  if (response === undefined || response === null) {
    answer = { ok: true, output: null };
  } else if (isEnvelope(response)) {
    answer = { ok: response.ok as boolean, output: "output" in response ? decode(response.output) : null };
    if ("error" in response) {
      const error = decode(response.error);
      answer.error = typeof error === "string" ? error : JSON.stringify(error);
    }
  } else {
    answer = { ok: true, output: response };
  }
  if (resource) answer.resource = resource;
  return answer;
}

/** How an answer is stored: the response column, the resource kept, and why a stand-in was stored. */
export interface StoredAnswer {
  response: Record<string, unknown>;
  resource?: ResourceRef;
  standIn?: Unstorable;
}

/** Why a resource cannot be stored; undefined when it can. */
export function resourceProblem(resource: ResourceRef): string | undefined {
  if (!resource.resourceType || !resource.resourceId) return "a resource needs a non-empty type and id";
  for (
    const [field, value, max] of [
      ["type", resource.resourceType, MAX_RESOURCE_TYPE_CHARS],
      ["id", resource.resourceId, MAX_RESOURCE_ID_CHARS],
    ] as const
  ) {
    if ([...value].length > max) return `the resource ${field} is longer than ${max} characters`;
    if (value.includes("\0")) return `the resource ${field} holds a NUL character`;
    if (!value.isWellFormed()) return `the resource ${field} holds a lone UTF-16 surrogate`;
  }
  return undefined;
}

/**
 * The stored form of `answer` within `limit` bytes of compact JSON. With
 * `refused`, the database refused the full form once already: the output
 * goes by reference (or summary) whatever its size.
 */
export async function store(answer: Answer, limit: number, refused: boolean): Promise<StoredAnswer> {
  const resource = answer.resource && resourceProblem(answer.resource) === undefined ? answer.resource : undefined;
  let standIn: Unstorable | undefined;
  const stored: Record<string, unknown> = { ok: answer.ok };
  if (answer.error !== undefined) stored.error = storable(answer.error, 1);
  stored.output = storable(answer.output ?? null, 1);
  // A long error is what makes the answer too large: keep its start first,
  // so the output stays whole when that is enough.
  if (answer.error !== undefined) {
    const size = jsonSize(stored);
    if ((refused || size > limit) && await shortenError(stored, answer.error)) {
      standIn = { reason: "too_large", size, limit };
    }
  }
  let reason: Unstorable | undefined;
  if (refused) {
    reason = { reason: "refused" };
  } else {
    const size = jsonSize(stored);
    if (size > limit) reason = { reason: "too_large", size, limit };
  }
  if (reason) {
    standIn = reason;
    // A refused answer with a resource goes by reference, like a large one.
    const form: Unstorable = reason.reason === "refused" && resource
      ? { reason: "too_large", size: jsonSize(answer.output ?? null), limit }
      : reason;
    stored.output = await standInFor(answer.output ?? null, form, resource);
  }
  // Still above a small limit: the error keeps only its first bytes, so `ok`
  // and the reference always fit.
  if (answer.error !== undefined && jsonSize(stored) > limit) {
    stored.error = prefix(answer.error, LAST_RESORT_ERROR_BYTES).replaceAll("\0", "\uFFFD").toWellFormed();
    delete stored.error_elided;
    standIn ??= { reason: "too_large", size: jsonSize(stored), limit };
  }
  return resource ? { response: stored, resource, standIn } : { response: stored, standIn };
}

/** The size of `answer`'s stored form before any stand-in, as compact JSON. */
export async function storedSize(answer: Answer): Promise<number> {
  return jsonSize((await store(answer, Number.MAX_SAFE_INTEGER, false)).response);
}

/** `{"$response_ref": …}` to `resource`, with `original`'s size and SHA-256 as compact JSON. */
export async function referenceTo(original: unknown, resource: ResourceRef): Promise<{ $response_ref: ResponseRef }> {
  const { size, sha256 } = await digest(original);
  return {
    [RESPONSE_REF_KEY]: { resource_type: resource.resourceType, resource_id: resource.resourceId, size, sha256 },
  };
}

/** What journals in place of `original`: a reference when only size is the problem and there is a resource. */
async function standInFor(original: unknown, reason: Unstorable, resource?: ResourceRef): Promise<unknown> {
  if (reason.reason === "too_large" && resource) return await referenceTo(original, resource);
  return { [ELIDED_KEY]: await elide(original, reason) };
}

async function elide(original: unknown, reason: Unstorable): Promise<Elided> {
  if (reason.reason === "too_deep") return { reason: "too_deep" };
  const { size, sha256 } = await digest(original);
  return { reason: reason.reason, size, sha256 };
}

async function digest(value: unknown): Promise<{ size: number; sha256: string }> {
  const text = JSON.stringify(value) ?? "null";
  return { size: utf8Length(text), sha256: await sha256Hex(text) };
}

/** Keeps the first MAX_STORED_ERROR_BYTES of `error` and a summary of the whole; false when it fits whole. */
async function shortenError(stored: Record<string, unknown>, error: string): Promise<boolean> {
  if (utf8Length(error) <= MAX_STORED_ERROR_BYTES && !error.includes("\0") && error.isWellFormed()) return false;
  stored.error = prefix(error, MAX_STORED_ERROR_BYTES).replaceAll("\0", "\uFFFD").toWellFormed();
  stored.error_elided = { [ELIDED_KEY]: await elide(error, { reason: "too_large", size: 0, limit: 0 }) };
  return true;
}

/** The first `max` UTF-8 bytes of `text`, at a character boundary. */
function prefix(text: string, max: number): string {
  let bytes = 0;
  let end = 0;
  for (const char of text) {
    const length = utf8Length(char);
    if (bytes + length > max) break;
    bytes += length;
    end += char.length;
  }
  return text.slice(0, end);
}
