// The Idempotency-Key header's rules (a bare or RFC 8941 quoted key of
// visible ASCII, at most 255 characters; the Rust layer's key.rs), the
// plane's key made of it (scoped by the caller), and the request target the
// fingerprint takes.

import { sha256Hex } from "./hash.ts";
import { type Problem, problem } from "./problem.ts";

/** The request header the key is read from. */
export const IDEMPOTENCY_KEY = "idempotency-key";

/** Longest key accepted, in characters (Stripe's limit). */
export const MAX_IDEMPOTENCY_KEY_CHARS = 255;

/** Separates a caller's hash from the key in the plane's key (no Idempotency-Key can hold it). */
const CALLER_SEPARATOR = "\u00a7";

/**
 * The key, if the request has one: a bare value (as Stripe takes it) or an
 * RFC 8941 string (`"…"`, as the IETF draft writes it). Fetch joins two
 * `Idempotency-Key` fields with `, `: two quoted keys are refused as the
 * Rust layer refuses them, two bare ones read as one key holding `, `.
 */
export function idempotencyKey(headers: Headers): { key: string } | { problem: Problem } | undefined {
  const malformed = (detail: string) => ({ problem: problem("malformed-key", detail) });
  const value = headers.get(IDEMPOTENCY_KEY);
  if (value === null) return undefined;
  if (!/^[\t\x20-\x7e]*$/.test(value)) return malformed("the key holds characters other than visible ASCII");
  const text = value.trim();
  let key = text;
  if (text.length >= 2 && text.startsWith('"') && text.endsWith('"')) {
    key = text.slice(1, -1);
    if (/["\\]/.test(key)) return malformed("a quoted key holds a quote or a backslash");
  }
  if (key === "") return malformed("the key is empty");
  if (!/^[\x20-\x7e]*$/.test(key)) return malformed("the key holds characters other than visible ASCII");
  if (key.length > MAX_IDEMPOTENCY_KEY_CHARS) {
    return malformed(`the key is ${key.length} characters; at most ${MAX_IDEMPOTENCY_KEY_CHARS}`);
  }
  return { key };
}

/** The plane's key: the request's own, or, scoped by a caller, the SHA-256 of the caller, `§`, and the key. */
export async function planeKey(key: string, principal: string | undefined): Promise<string> {
  return principal === undefined ? key : `${await sha256Hex(principal)}${CALLER_SEPARATOR}${key}`;
}

/** The request's target as sent: its path and query, from the URL the runtime was given. */
export function targetOf(req: Request): string {
  const url = req.url;
  const authority = url.indexOf("//");
  const path = authority < 0 ? -1 : url.indexOf("/", authority + 2);
  if (path < 0) return "/";
  const hash = url.indexOf("#", path);
  return hash < 0 ? url.slice(path) : url.slice(path, hash);
}
