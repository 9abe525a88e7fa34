// The answer a first request got, as the journal keeps it: status, kept
// headers and the body (text when it is UTF-8 without U+0000, base64
// otherwise) — the Rust layer's StoredResponse
// (`callers::idempotency_key`) member for member, so an answer
// journaled by either layer replays through the other byte for byte:
//
//   {"status": 201, "headers": [["content-type", "application/json"], …],
//    "body_text": "…" | "body_base64": "…" | "body_omitted": <bytes>,
//    "refused": true (only when set)}
//
// journaled as the output of a success answer (`{"ok": true, "output": …}`).

import credentials from "./credential_headers.json" with { type: "json" };
import { type Problem, problemBody } from "./problem.ts";
import { latin1Bytes } from "./fingerprint.ts";

/**
 * Headers that carry one caller's credentials or session, in lowercase:
 * never journaled, never replayed (a replay answers whoever repeats the
 * key), and refused as `keepHeaders`.
 */
export const CREDENTIAL_HEADERS: readonly string[] = Object.freeze([...credentials.headers]);

/** Whether `name` (any case) is one of CREDENTIAL_HEADERS. */
export function isCredential(name: string): boolean {
  return CREDENTIAL_HEADERS.includes(name.toLowerCase());
}

/** A stored HTTP answer, in the journal's (and the Rust layer's) member names. */
export interface StoredResponse {
  status: number;
  /** Kept headers, lowercase names, in the order of the kept names. */
  headers: [string, string][];
  body_text?: string;
  body_base64?: string;
  /** Set instead of a body above the store's limit: the body's size in bytes. */
  body_omitted?: number;
  /** The layer answered a problem in place of the handler's answer. */
  refused?: true;
}

/** Visible ASCII and tab: what Rust's `HeaderValue::to_str` reads. */
const VISIBLE = /^[\t\x20-\x7e]*$/;
const TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

/**
 * What to keep of an answer: its status, the `keep` headers it carries
 * (values that are not visible ASCII are dropped, and so is any credential
 * header), and its body.
 */
export function storedOf(status: number, headers: Headers, keep: readonly string[], body: Uint8Array): StoredResponse {
  const kept: [string, string][] = [];
  for (const name of keep.map((name) => name.toLowerCase())) {
    if (isCredential(name)) continue;
    const value = headers.get(name);
    if (value !== null && VISIBLE.test(value)) kept.push([name, value]);
  }
  const stored: StoredResponse = { status, headers: kept };
  const text = utf8(body);
  if (text !== undefined && !text.includes("\0")) stored.body_text = text;
  else stored.body_base64 = base64(body);
  return stored;
}

/** A problem the layer answers in place of the handler's answer, kept so that every repeat gets it too. */
export function refusal(p: Problem): StoredResponse {
  return {
    status: p.status,
    headers: [["content-type", "application/problem+json"]],
    body_text: problemBody(p),
    refused: true,
  };
}

/** The same answer without its body, for a body the store cannot keep. */
export function withoutBody(stored: StoredResponse, size: number): StoredResponse {
  const { body_text: _text, body_base64: _base64, ...rest } = stored;
  return { ...rest, body_omitted: size };
}

/** The answer the first caller gets instead of the handler's, when the journal keeps a refusal. */
export function refusedResponse(stored: StoredResponse): Response | undefined {
  if (stored.refused !== true) return undefined;
  const response = replay(stored);
  response?.headers.delete("idempotent-replayed");
  return response;
}

/** Statuses whose response has no body (Fetch refuses one). */
const NULL_BODY = new Set([101, 103, 204, 205, 304]);

/**
 * The replay of what the journal holds: the stored status, headers and
 * body, and `Idempotent-Replayed: true` (and `Idempotent-Body-Omitted:
 * <bytes>` for a body that was not kept). Undefined when it is not a
 * well-formed answer, as in the Rust layer (a header or base64 that does not
 * decode, both bodies, a member of the wrong type), and for a status the
 * Fetch API cannot answer (outside 200–599 but 101; the Rust layer replays
 * 100–999). A credential header is left out, even from a journal that holds
 * one.
 */
export function replay(output: unknown): Response | undefined {
  const stored = readStored(output);
  if (stored === undefined) return undefined;
  let body: Uint8Array;
  if (stored.body_text !== undefined && stored.body_base64 !== undefined) return undefined;
  if (stored.body_text !== undefined) body = new TextEncoder().encode(stored.body_text);
  else if (stored.body_base64 !== undefined) {
    const decoded = unbase64(stored.body_base64);
    if (decoded === undefined) return undefined;
    body = decoded;
  } else body = new Uint8Array(0);
  if (!(stored.status === 101 || (stored.status >= 200 && stored.status <= 599))) return undefined;
  const headers = new Headers();
  for (const [name, value] of stored.headers) {
    if (isCredential(name)) continue;
    if (!TOKEN.test(name) || !/^[\t\x20-\x7e\x80-\uffff]*$/.test(value)) return undefined;
    // Rust's HeaderValue takes the UTF-8 bytes of a value; Fetch takes one character per byte.
    headers.append(name, String.fromCharCode(...new TextEncoder().encode(value)));
  }
  if (stored.body_omitted !== undefined) headers.set("idempotent-body-omitted", String(stored.body_omitted));
  headers.set("idempotent-replayed", "true");
  return new Response(NULL_BODY.has(stored.status) ? null : body as Uint8Array<ArrayBuffer>, {
    status: stored.status,
    headers,
  });
}

/** Reads a stored answer as serde reads the Rust StoredResponse: unknown members ignored, null is absent. */
function readStored(output: unknown): StoredResponse | undefined {
  if (output === null || typeof output !== "object" || Array.isArray(output)) return undefined;
  const o = output as Record<string, unknown>;
  const status = o.status;
  if (typeof status !== "number" || !Number.isInteger(status) || status < 0 || status > 65535) return undefined;
  if (!Array.isArray(o.headers)) return undefined;
  const headers: [string, string][] = [];
  for (const pair of o.headers) {
    if (!Array.isArray(pair) || pair.length !== 2 || typeof pair[0] !== "string" || typeof pair[1] !== "string") {
      return undefined;
    }
    headers.push([pair[0], pair[1]]);
  }
  const stored: StoredResponse = { status, headers };
  for (const field of ["body_text", "body_base64"] as const) {
    const value = o[field];
    if (value === undefined || value === null) continue;
    if (typeof value !== "string") return undefined;
    stored[field] = value;
  }
  const omitted = o.body_omitted;
  if (omitted !== undefined && omitted !== null) {
    if (typeof omitted !== "number" || !Number.isSafeInteger(omitted) || omitted < 0) return undefined;
    stored.body_omitted = omitted;
  }
  if (o.refused !== undefined) {
    if (typeof o.refused !== "boolean") return undefined;
    if (o.refused) stored.refused = true;
  }
  return stored;
}

function utf8(bytes: Uint8Array): string | undefined {
  try {
    // ignoreBOM: a leading BOM is part of the body, kept as it came.
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(bytes);
  } catch {
    return undefined;
  }
}

/** Standard base64 with padding (Rust's `general_purpose::STANDARD`). */
export function base64(bytes: Uint8Array): string {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

const ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/** Strict standard base64: canonical padding, no whitespace, no stray trailing bits (as the base64 crate). */
export function unbase64(text: string): Uint8Array | undefined {
  if (!/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/.test(text)) return undefined;
  if (text.endsWith("==") && (ALPHABET.indexOf(text[text.length - 3]) & 0x0f) !== 0) return undefined;
  if (!text.endsWith("==") && text.endsWith("=") && (ALPHABET.indexOf(text[text.length - 2]) & 0x03) !== 0) {
    return undefined;
  }
  return latin1Bytes(atob(text));
}
