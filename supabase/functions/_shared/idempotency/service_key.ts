// The service key: which variable it is read from, what kind it is by its
// shape, and the headers it travels in. The Rust crate reads the same
// variables in the same order and sends the same headers; both are checked
// against tests/vectors/service_key_env.json.

import { PlaneError } from "./errors.ts";

/**
 * The variables `IdempotencyPlane.fromEnv` reads the service key from, the
 * first set winning: this client's own `IDEM_SERVICE_KEY`; what hosted Edge
 * Functions receive today, `SUPABASE_SECRET_KEYS`, a JSON map of secret keys
 * by name (its `default` entry, or the one `IDEM_SECRET_KEY_NAME` names); one
 * secret key set by hand, `SUPABASE_SECRET_KEY`; and the legacy
 * `service_role` JWT, `SUPABASE_SERVICE_ROLE_KEY`, which Supabase is retiring.
 */
export const SERVICE_KEY_VARIABLES = [
  "IDEM_SERVICE_KEY",
  "SUPABASE_SECRET_KEYS",
  "SUPABASE_SECRET_KEY",
  "SUPABASE_SERVICE_ROLE_KEY",
] as const;

/** The variable naming the entry of `SUPABASE_SECRET_KEYS` to use. */
export const SECRET_KEY_NAME_VARIABLE = "IDEM_SECRET_KEY_NAME";

/** The entry of `SUPABASE_SECRET_KEYS` used unless `IDEM_SECRET_KEY_NAME` names another. */
export const DEFAULT_SECRET_KEY_NAME = "default";

/** What a key is, by its shape alone (nothing is decoded or verified). */
export type KeyKind = "secret" | "publishable" | "jwt" | "other";

/** The kind of `key`: `sb_secret_…`, `sb_publishable_…`, a three-part JWT, or other. */
export function keyKind(key: string): KeyKind {
  if (key.startsWith("sb_secret_")) return "secret";
  if (key.startsWith("sb_publishable_")) return "publishable";
  return /^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$/.test(key) ? "jwt" : "other";
}

/** A service key read from the environment, and where it came from. */
export interface ChosenKey {
  variable: (typeof SERVICE_KEY_VARIABLES)[number];
  key: string;
  kind: KeyKind;
}

/**
 * The service key from the first set of `SERVICE_KEY_VARIABLES` (an empty
 * value counts as unset), or `undefined` when none is set. Throws
 * `bad_configuration`, never showing a key, for a publishable key anywhere,
 * a `SUPABASE_SECRET_KEYS` that is not a JSON object of strings or lacks the
 * entry looked for, and a key of another kind than its variable promises. A
 * `SUPABASE_SECRET_KEYS` holding no key (`{}`) counts as unset, unless
 * `IDEM_SECRET_KEY_NAME` asks for one.
 */
export function serviceKeyFromEnv(env: (name: string) => string | undefined): ChosenKey | undefined {
  const set = (name: string) => {
    const value = env(name);
    return value === undefined || value === "" ? undefined : value;
  };
  for (const variable of SERVICE_KEY_VARIABLES) {
    let key = set(variable);
    if (key === undefined) continue;
    if (variable === "SUPABASE_SECRET_KEYS") {
      const keys = secretKeys(key);
      const named = set(SECRET_KEY_NAME_VARIABLE);
      // A project without secret keys (`{}`) counts as unset, unless a name asks for one.
      if (Object.keys(keys).length === 0 && named === undefined) continue;
      key = entryOf(keys, named ?? DEFAULT_SECRET_KEY_NAME);
    }
    return checked(variable, key);
  }
  return undefined;
}

/** `key` from `variable`, refused when its kind is not what the variable promises. */
function checked(variable: (typeof SERVICE_KEY_VARIABLES)[number], key: string): ChosenKey {
  const kind = keyKind(key);
  if (kind === "publishable") {
    throw PlaneError.invalid(
      "bad_configuration",
      `${variable} holds a publishable key (sb_publishable_…), which reaches only the anon role; ` +
        "the plane needs a secret key (sb_secret_…, as in SUPABASE_SECRET_KEYS) or the legacy service_role key",
    );
  }
  const expected: KeyKind[] = variable === "SUPABASE_SECRET_KEYS" || variable === "SUPABASE_SECRET_KEY"
    ? ["secret"]
    : variable === "SUPABASE_SERVICE_ROLE_KEY"
    ? ["jwt", "secret"]
    : ["secret", "jwt", "other"];
  if (!expected.includes(kind)) {
    throw PlaneError.invalid(
      "bad_configuration",
      `${variable} should hold a ${describe(expected[0])}, but holds a ${describe(kind)}`,
    );
  }
  return { variable, key, kind };
}

/**
 * Every service key the environment holds, whichever `serviceKeyFromEnv`
 * would choose: `IDEM_SERVICE_KEY`, each entry of `SUPABASE_SECRET_KEYS`,
 * `SUPABASE_SECRET_KEY` and `SUPABASE_SERVICE_ROLE_KEY`, publishable keys
 * and malformed maps left out. What a route may be called with.
 */
export function serviceKeysInEnv(env: (name: string) => string | undefined): string[] {
  const keys: string[] = [];
  for (const variable of SERVICE_KEY_VARIABLES) {
    const value = env(variable);
    if (!value) continue;
    if (variable === "SUPABASE_SECRET_KEYS") {
      try {
        keys.push(...Object.values(secretKeys(value)));
      } catch {
        // A malformed map is refused where the plane is configured; no key of it here.
      }
    } else keys.push(value);
  }
  return [...new Set(keys)].filter((key) => key !== "" && keyKind(key) !== "publishable");
}

/** A `SUPABASE_SECRET_KEYS` value read: a JSON object of names to keys, or refused. */
function secretKeys(value: string): Record<string, string> {
  let keys: unknown;
  try {
    keys = JSON.parse(value);
  } catch {
    keys = undefined;
  }
  if (
    typeof keys !== "object" || keys === null || Array.isArray(keys) ||
    !Object.values(keys).every((key) => typeof key === "string")
  ) {
    throw PlaneError.invalid(
      "bad_configuration",
      'SUPABASE_SECRET_KEYS is not a JSON object of key names to keys (as Supabase sets it: {"default": "sb_secret_…"})',
    );
  }
  return keys as Record<string, string>;
}

/** The entry `name` of a `SUPABASE_SECRET_KEYS` map. */
function entryOf(entries: Record<string, string>, name: string): string {
  const key = Object.hasOwn(entries, name) ? entries[name] : "";
  if (!key) {
    const names = Object.keys(entries).sort();
    throw PlaneError.invalid(
      "bad_configuration",
      `SUPABASE_SECRET_KEYS has no key named ${JSON.stringify(name)} (it names ${
        names.length ? names.join(", ") : "none"
      }); ` +
        `set ${SECRET_KEY_NAME_VARIABLE} to one of them`,
    );
  }
  return key;
}

function describe(kind: KeyKind): string {
  switch (kind) {
    case "secret":
      return "secret key (sb_secret_…)";
    case "publishable":
      return "publishable key (sb_publishable_…)";
    case "jwt":
      return "JWT";
    case "other":
      return "key of no known shape";
  }
}

/**
 * The headers `key` travels in. An `sb_` key is not a JWT: it goes in
 * `apikey` alone, as Supabase documents its gateway wants it (the gateway
 * swaps it for a short-lived token of its role). A JWT goes in
 * `Authorization: Bearer`, and in `apikey` too, which Supabase's gateway
 * reads and PostgREST ignores.
 */
export function authHeaders(key: string): Record<string, string> {
  const kind = keyKind(key);
  return kind === "secret" || kind === "publishable"
    ? { "apikey": key }
    : { "Authorization": `Bearer ${key}`, "apikey": key };
}
