// The request hash: lowercase hex SHA-256 of the RFC 8785 (JSON
// Canonicalization Scheme) form of the request's JSON — the same bytes the
// Rust crate's `RequestHash::of_json` hashes, checked against the shared
// vectors in tests/vectors/request_hash.json.

import { PlaneError } from "./errors.ts";

const HASH = /^[0-9a-f]{64}$/;

/** Whether `value` is a request hash the plane accepts: 64 lowercase hex digits. */
export function isRequestHash(value: unknown): value is string {
  return typeof value === "string" && HASH.test(value);
}

/**
 * The RFC 8785 canonical form of `value`: object members sorted by their
 * names' UTF-16 code units, no whitespace, numbers as ECMAScript prints them,
 * strings as JSON.stringify escapes them. Refuses what has no JSON form (a
 * non-finite number, a bigint, a function, a lone surrogate) with an
 * `invalid_input` error. Members whose value is `undefined` are left out, and
 * `toJSON` is honoured, as JSON.stringify does.
 */
export function canonicalize(value: unknown): string {
  const out: string[] = [];
  write(value, out, 0);
  return out.join("");
}

/** Lowercase hex SHA-256 of `canonicalize(value)`. */
export async function requestHash(value: unknown): Promise<string> {
  return await sha256Hex(canonicalize(value));
}

/** Lowercase hex SHA-256 of `text` as UTF-8. */
export async function sha256Hex(text: string): Promise<string> {
  return await sha256HexOfBytes(new TextEncoder().encode(text));
}

/** Lowercase hex SHA-256 of `bytes`. */
export async function sha256HexOfBytes(bytes: Uint8Array): Promise<string> {
  const digest = await crypto.subtle.digest("SHA-256", bytes as Uint8Array<ArrayBuffer>);
  return Array.from(new Uint8Array(digest), (byte) => byte.toString(16).padStart(2, "0")).join("");
}

const MAX_DEPTH = 1000;

function write(value: unknown, out: string[], depth: number): void {
  if (depth > MAX_DEPTH) throw unhashable("nests deeper than 1000 levels");
  if (value !== null && typeof value === "object" && typeof (value as { toJSON?: unknown }).toJSON === "function") {
    value = (value as { toJSON: () => unknown }).toJSON();
  }
  switch (typeof value) {
    case "string":
      out.push(string(value));
      return;
    case "number":
      if (!Number.isFinite(value)) throw unhashable(`holds the number ${value}, which JSON cannot`);
      out.push(JSON.stringify(value));
      return;
    case "boolean":
      out.push(value ? "true" : "false");
      return;
    case "object": {
      if (value === null) {
        out.push("null");
        return;
      }
      if (Array.isArray(value)) {
        out.push("[");
        value.forEach((item, index) => {
          if (index > 0) out.push(",");
          // As JSON.stringify: a hole or an undefined item is null.
          write(item === undefined ? null : item, out, depth + 1);
        });
        out.push("]");
        return;
      }
      const record = value as Record<string, unknown>;
      const names = Object.keys(record).filter((name) => record[name] !== undefined).sort();
      out.push("{");
      names.forEach((name, index) => {
        if (index > 0) out.push(",");
        out.push(string(name), ":");
        write(record[name], out, depth + 1);
      });
      out.push("}");
      return;
    }
    default:
      throw unhashable(`holds a ${typeof value}, which JSON cannot`);
  }
}

function string(text: string): string {
  if (!text.isWellFormed()) throw unhashable("holds a lone UTF-16 surrogate, which RFC 8785 refuses");
  return JSON.stringify(text);
}

function unhashable(why: string): PlaneError {
  return PlaneError.invalid("unhashable_request", `the request cannot be hashed: it ${why}`);
}
