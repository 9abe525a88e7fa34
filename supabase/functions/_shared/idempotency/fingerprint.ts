// What makes two HTTP requests "the same request" for the Idempotency-Key
// middleware, and the scope a route's keys live in — a port of the Rust
// layer's fingerprint (`callers::idempotency_key`), to the same hash for
// the same request, so a key used through one layer is the same request
// through the other.

import { requestHash, sha256Hex, sha256HexOfBytes } from "./hash.ts";
import { MAX_SCOPE_CHARS } from "./plane.ts";

/** Hex digits of the route's hash a long scope ends with (128 bits). */
const SCOPE_HASH_HEX = 32;

/**
 * The deepest nesting serde_json reads (its recursion limit is 128: the
 * 128th open bracket fails); a deeper JSON body counts by its bytes, as in
 * the Rust layer, where it does not parse.
 */
const MAX_JSON_NESTING = 127;

/**
 * The scope of `method` on `route`: `http.<method>.<route>`, with the
 * route's segments as dot-separated names (`POST /orders/{id}/items` is
 * `http.post.orders.id.items`; `/` is `root`). Characters a scope cannot
 * hold become `_`. A scope longer than the plane's 128 characters keeps its
 * first 95 and ends in `.` and 32 hex digits of the SHA-256 of the method
 * and route as written, so every route has a scope of its own.
 */
export async function scopeOf(method: string, route: string): Promise<string> {
  const segments = route
    .split("/")
    .filter((segment) => segment !== "")
    .map((segment) => [...segment].filter((c) => !"{}:*".includes(c)).map(scopeChar).join(""))
    .filter((segment) => segment !== "");
  const path = segments.length === 0 ? "root" : segments.join(".");
  const scope = `http.${[...method].map(scopeChar).join("")}.${path}`;
  // Every character is ASCII: its length is its bytes.
  if (scope.length <= MAX_SCOPE_CHARS) return scope;
  const digest = await sha256Hex(`${method} ${route}`);
  return `${scope.slice(0, MAX_SCOPE_CHARS - 1 - SCOPE_HASH_HEX)}.${digest.slice(0, SCOPE_HASH_HEX)}`;
}

/** Rust's `char::to_ascii_lowercase`, then `a-z 0-9 _ -` or `_`. */
function scopeChar(c: string): string {
  const lower = /^[A-Z]$/.test(c) ? c.toLowerCase() : c;
  return /^[a-z0-9_-]$/.test(lower) ? lower : "_";
}

/**
 * The request's fingerprint: its method, its target (path and query as
 * sent), its `Content-Type`, its body and the `counted` headers, hashed
 * with RFC 8785 and SHA-256.
 *
 * The body counts by its bytes (their SHA-256), an empty body included,
 * unless it is JSON (`application/json` or `application/…+json`) whose
 * value RFC 8785's canonical form holds without loss: then by that value,
 * so key order, whitespace and number spellings of one value do not matter.
 * Lossless means: the bytes are what serde_json reads (UTF-8, nesting below
 * 128, no lone surrogate), no object repeats a member name, and every number
 * is exactly the decimal the canonical form writes for it (`9007199254740993`,
 * `0.1000000000000000000001`, `1e-400` or `-0` count the body by bytes).
 *
 * Headers reach a Fetch handler with repeated fields joined by `, `: a
 * request with two `Content-Type` (or two of a counted header) fields is
 * counted as one joined value here and as two in the Rust layer.
 */
export async function fingerprint(
  method: string,
  target: string,
  headers: Headers,
  body: Uint8Array,
  counted: readonly string[] = [],
): Promise<string> {
  const value = isJson(headers) ? losslessJson(body) : undefined;
  const bodyForm = value !== undefined ? { json: value.value } : { sha256: await sha256HexOfBytes(body) };
  const countedValues: Record<string, string[]> = {};
  for (const name of counted) countedValues[name.toLowerCase()] = values(headers, name);
  return await requestHash({
    method,
    target,
    content_type: values(headers, "content-type"),
    body: bodyForm,
    headers: countedValues,
  });
}

/** Every value of `name`, as text (bytes that are not UTF-8 become U+FFFD, as `from_utf8_lossy`). */
function values(headers: Headers, name: string): string[] {
  const value = headers.get(name);
  return value === null ? [] : [new TextDecoder("utf-8", { ignoreBOM: true }).decode(latin1Bytes(value))];
}

/** A header value's bytes: Fetch gives each byte as one character (U+0000 to U+00FF). */
export function latin1Bytes(value: string): Uint8Array {
  const bytes = new Uint8Array(value.length);
  for (let i = 0; i < value.length; i++) bytes[i] = value.charCodeAt(i) & 0xff;
  return bytes;
}

/** Whether the request declares JSON: `application/json` or `application/*+json`, parameters aside. */
export function isJson(headers: Headers): boolean {
  const value = headers.get("content-type");
  if (value === null || !/^[\t\x20-\x7e]*$/.test(value)) return false;
  const mime = value.split(";")[0].trim().toLowerCase();
  return mime === "application/json" || (mime.startsWith("application/") && mime.endsWith("+json"));
}

/**
 * The value of `body` when it is JSON whose canonical form loses nothing of
 * it (wrapped, since `null` is a value); undefined otherwise.
 */
export function losslessJson(body: Uint8Array): { value: unknown } | undefined {
  let text: string;
  try {
    text = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(body);
  } catch {
    return undefined;
  }
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (!lossless(text)) return undefined;
  // A lone surrogate (serde_json refuses one, RFC 8785 cannot write one).
  if (!text.isWellFormed() || !wellFormed(value)) return undefined;
  return { value };
}

/** Whether every string and member name in `value` is well-formed UTF-16. */
function wellFormed(value: unknown): boolean {
  const pending: unknown[] = [value];
  while (pending.length > 0) {
    const item = pending.pop();
    if (typeof item === "string") {
      if (!item.isWellFormed()) return false;
    } else if (Array.isArray(item)) {
      pending.push(...item);
    } else if (item !== null && typeof item === "object") {
      for (const [name, inner] of Object.entries(item)) {
        if (!name.isWellFormed()) return false;
        pending.push(inner);
      }
    }
  }
  return true;
}

/**
 * Whether well-formed JSON `text` nests below serde_json's limit, repeats
 * no member name in any object, and holds only numbers the canonical form
 * writes exactly.
 */
function lossless(text: string): boolean {
  type Frame = { names: Set<string>; nameNext: boolean } | "array";
  const frames: Frame[] = [];
  let at = 0;
  while (at < text.length) {
    const c = text[at];
    if (c === "{" || c === "[") {
      frames.push(c === "{" ? { names: new Set(), nameNext: true } : "array");
      if (frames.length > MAX_JSON_NESTING) return false;
    } else if (c === "}" || c === "]") {
      frames.pop();
    } else if (c === ",") {
      const top = frames[frames.length - 1];
      if (top !== undefined && top !== "array") top.nameNext = true;
    } else if (c === '"') {
      const end = stringEnd(text, at);
      if (end === undefined) return false;
      const top = frames[frames.length - 1];
      if (top !== undefined && top !== "array" && top.nameNext) {
        let name: string;
        try {
          name = JSON.parse(text.slice(at, end));
        } catch {
          return false;
        }
        if (top.names.has(name)) return false;
        top.names.add(name);
        top.nameNext = false;
      }
      at = end;
      continue;
    } else if (c === "-" || (c >= "0" && c <= "9")) {
      let end = at;
      while (end < text.length && /[0-9+\-.eE]/.test(text[end])) end++;
      if (!exactNumber(text.slice(at, end))) return false;
      at = end;
      continue;
    }
    // Whitespace, `:`, and the letters of true, false and null.
    at++;
  }
  return true;
}

/** The index just past the string starting at `start` (its opening quote). */
function stringEnd(text: string, start: number): number | undefined {
  let at = start + 1;
  while (at < text.length) {
    if (text[at] === "\\") at += 2;
    else if (text[at] === '"') return at + 1;
    else at++;
  }
  return undefined;
}

/**
 * Whether the JSON number `source` is exactly the decimal RFC 8785 writes
 * for the double it denotes (ECMAScript's `Number.prototype.toString`);
 * `-0` is not (it is written `0`).
 */
export function exactNumber(source: string): boolean {
  const double = Number(source);
  if (!Number.isFinite(double) || Object.is(double, -0)) return false;
  if (!/^-?[0-9]/.test(source)) return false;
  const a = decimal(source);
  const b = decimal(String(double));
  return a !== undefined && b !== undefined && a.negative === b.negative && a.digits === b.digits &&
    a.power === b.power;
}

const I64_MIN = -(2n ** 63n);
const I64_MAX = 2n ** 63n - 1n;

function i64(value: bigint): bigint | undefined {
  return value < I64_MIN || value > I64_MAX ? undefined : value;
}

/**
 * A decimal number's value as (negative, significant digits without leading
 * or trailing zeros, power of ten of the last digit); zero has no digits and
 * power 0. Undefined where Rust's i64 arithmetic would overflow.
 */
export function decimal(text: string): { negative: boolean; digits: string; power: bigint } | undefined {
  const negative = text.startsWith("-");
  const unsigned = negative ? text.slice(1) : text;
  const e = unsigned.search(/[eE]/);
  let mantissa = unsigned;
  let exponent = 0n;
  if (e >= 0) {
    mantissa = unsigned.slice(0, e);
    const written = unsigned.slice(e + 1);
    if (!/^[+-]?[0-9]+$/.test(written)) return undefined;
    const parsed = i64(BigInt(written.replace(/^\+/, "")));
    if (parsed === undefined) return undefined;
    exponent = parsed;
  }
  const dot = mantissa.indexOf(".");
  const whole = dot < 0 ? mantissa : mantissa.slice(0, dot);
  const fraction = dot < 0 ? "" : mantissa.slice(dot + 1);
  if (whole === "" || !/^[0-9]*$/.test(whole + fraction)) return undefined;
  const significant = (whole + fraction).replace(/^0+/, "");
  const trimmed = significant.replace(/0+$/, "");
  if (trimmed === "") return { negative, digits: "", power: 0n };
  const trailing = BigInt(significant.length - trimmed.length);
  const shifted = i64(exponent - BigInt(fraction.length));
  if (shifted === undefined) return undefined;
  const power = i64(shifted + trailing);
  if (power === undefined) return undefined;
  return { negative, digits: trimmed, power };
}
