// An Edge Function's own scheduled routes (a re-drive, a queue drain): who
// may call them, checked in constant time, and the re-drive route itself,
// with its body and limit checks, so no function hand-writes them.

import { serviceKeysInEnv } from "./service_key.ts";

/**
 * The variable holding a route's own secret: what a pg_cron job sends
 * (kept in Vault), so the service key never sits in pg_net's request queue,
 * which any database role can read. At least 32 characters.
 */
export const ROUTE_SECRET_VARIABLE = "IDEM_ROUTE_SECRET";

/** The shortest route secret accepted. */
export const MIN_ROUTE_SECRET_CHARS = 32;

/**
 * Who may call a function's scheduled routes, from its environment: the
 * route secret (`IDEM_ROUTE_SECRET`) when set, and every service key the
 * environment holds (`serviceKeysInEnv`: each entry of
 * `SUPABASE_SECRET_KEYS`, the legacy `SUPABASE_SERVICE_ROLE_KEY`, …), so an
 * operator's `idem redrive --to` is let in whichever of them it sends.
 * Throws when the route secret is set but shorter than 32 characters. Never
 * empty strings.
 */
export function routeCredentials(
  env: (name: string) => string | undefined,
): string[] {
  const credentials: string[] = [];
  const secret = env(ROUTE_SECRET_VARIABLE);
  if (secret !== undefined && secret !== "") {
    if (secret.length < MIN_ROUTE_SECRET_CHARS) {
      throw new Error(
        `${ROUTE_SECRET_VARIABLE} must be at least ${MIN_ROUTE_SECRET_CHARS} characters (a random secret)`,
      );
    }
    credentials.push(secret);
  }
  credentials.push(...serviceKeysInEnv(env));
  return credentials;
}

/**
 * Whether `request` carries one of `credentials`, as `Authorization: Bearer
 * <credential>` or as `apikey: <credential>` (where an `sb_` key travels),
 * compared in time that does not depend on where a guess differs.
 */
export function callerAuthorized(
  request: Request,
  credentials: readonly string[],
): boolean {
  const bearer = /^Bearer +(.+)$/i.exec(
    request.headers.get("authorization") ?? "",
  )?.[1]?.trim();
  const offered = [bearer, request.headers.get("apikey") ?? undefined].filter((
    value,
  ) => value !== undefined);
  let matched = false;
  for (const credential of credentials) {
    if (credential === "") continue;
    for (const value of offered) {
      matched = sameText(value as string, credential) || matched;
    }
  }
  return matched;
}

/** Compares two strings in time that does not depend on where they differ. */
export function sameText(a: string, b: string): boolean {
  const [x, y] = [new TextEncoder().encode(a), new TextEncoder().encode(b)];
  let differ = x.length ^ y.length;
  for (let i = 0; i < Math.max(x.length, y.length); i++) {
    differ |= (x[i] ?? 0) ^ (y[i] ?? 0);
  }
  return differ === 0;
}

/** What one re-drive pass did, as the route answers it. */
export interface RedriveCounts {
  redriven: number;
  journaled: number;
  deadLettered: number;
  left: number;
}

/** Options of `redriveRoute`. */
export interface RedriveRouteOptions {
  /** Who may call (`routeCredentials(env)`); an empty list refuses everyone. */
  credentials: readonly string[];
  /** The scope this route re-drives; a body naming another is refused. */
  scope: string;
  /** The largest `limit` accepted: the plane's row cap (`plane.maxRows`). */
  maxLimit: number;
  /** The `limit` of a body that names none. Default 50. */
  defaultLimit?: number;
  /** One pass over at most `limit` orphans of `scope` (e.g. `gate.redrive(...)`). */
  redrive: (limit: number) => Promise<RedriveCounts>;
}

/** The largest body the route reads: `{"limit": N, "scope": "…"}` is far smaller. */
const MAX_BODY_BYTES = 4096;

/**
 * `POST` handler of a re-drive route. Answers 401 without a credential of
 * `credentials`, 405 for another method, 413 for a body above 4 KiB, 400 for
 * a body that is not a JSON object, a `limit` that is not an integer from 1
 * to `maxLimit`, or a `scope` other than the route's; else runs one pass and
 * answers `{"redriven", "journaled", "dead_lettered", "left"}`, as
 * `idem redrive --to` reads it (the pg_cron recipe records its HTTP status).
 */
export function redriveRoute(
  options: RedriveRouteOptions,
): (request: Request) => Promise<Response> {
  // The default never above the cap: a plane with a small row cap still serves the route.
  const defaultLimit = Math.min(options.defaultLimit ?? 50, options.maxLimit);
  if (!Number.isInteger(options.maxLimit) || options.maxLimit < 1) {
    throw new Error("maxLimit must be a positive integer");
  }
  if (
    !Number.isInteger(defaultLimit) || defaultLimit < 1 ||
    defaultLimit > options.maxLimit
  ) {
    throw new Error(
      `defaultLimit must be an integer from 1 to ${options.maxLimit}`,
    );
  }
  const refused = (status: number, error: string, headers: HeadersInit = {}) =>
    Response.json({ error }, { status, headers });
  return async (request) => {
    if (request.method !== "POST") {
      return refused(405, "POST only", { allow: "POST" });
    }
    if (!callerAuthorized(request, options.credentials)) {
      await request.body?.cancel();
      return refused(
        401,
        "this route takes the route secret or the service key (Authorization: Bearer, or apikey)",
        {
          "www-authenticate": "Bearer",
        },
      );
    }
    const body = await boundedText(request, MAX_BODY_BYTES);
    if (body === undefined) {
      return refused(413, `the body is larger than ${MAX_BODY_BYTES} bytes`);
    }
    let ask: unknown = {};
    try {
      ask = body.trim() ? JSON.parse(body) : {};
    } catch {
      return refused(400, 'the body must be JSON: {"limit": N}');
    }
    if (typeof ask !== "object" || ask === null || Array.isArray(ask)) {
      return refused(400, 'the body must be a JSON object: {"limit": N}');
    }
    const { limit = defaultLimit, scope } = ask as {
      limit?: unknown;
      scope?: unknown;
    };
    if (
      typeof limit !== "number" || !Number.isInteger(limit) || limit < 1 ||
      limit > options.maxLimit
    ) {
      return refused(
        400,
        `limit must be an integer from 1 to ${options.maxLimit}`,
      );
    }
    if (scope !== undefined && scope !== options.scope) {
      return refused(400, `this route re-drives ${options.scope} only`);
    }
    const report = await options.redrive(limit);
    return Response.json({
      redriven: report.redriven,
      journaled: report.journaled,
      dead_lettered: report.deadLettered,
      left: report.left,
    });
  };
}

/** The request's body as text, or `undefined` once it passes `limit` bytes (the rest is not read). */
async function boundedText(
  request: Request,
  limit: number,
): Promise<string | undefined> {
  const declared = Number(request.headers.get("content-length") ?? "");
  if (Number.isFinite(declared) && declared > limit) {
    await request.body?.cancel();
    return undefined;
  }
  if (!request.body) return "";
  const reader = request.body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.byteLength;
    if (size > limit) {
      await reader.cancel();
      return undefined;
    }
    chunks.push(value);
  }
  const bytes = new Uint8Array(size);
  let at = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, at);
    at += chunk.byteLength;
  }
  return new TextDecoder().decode(bytes);
}
