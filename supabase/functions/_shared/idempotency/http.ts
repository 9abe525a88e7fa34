// `Idempotency-Key` for any Fetch-style HTTP handler (a Supabase Edge
// Function, `Deno.serve`, Hono's `app.fetch`), after the IETF draft "The
// Idempotency-Key HTTP Header Field" and the way Stripe's API behaves — the
// Rust layer (`callers::idempotency_key`) ported to the letter: the same
// answers and problem types, the same scope names, the same fingerprint and
// the same journaled form, so an answer journaled by one layer replays
// through the other.
//
//   const orders = withIdempotencyKey(createOrder, {
//     plane: IdempotencyPlane.fromEnv((name) => Deno.env.get(name)),
//     organizationId: (req) => tenantOf(req),
//     principal: (req) => callerOf(req),       // or sharedAcrossCallers: true
//     route: "/orders",
//   });
//   Deno.serve(orders);
//
// For the configured methods (POST and PATCH by default) a request carrying
// `Idempotency-Key` is claimed in the plane under the scope
// `http.<method>.<route>`, the caller's tenant, and the caller: the key is
// scoped by the `principal` the application names for each request (its
// SHA-256 is part of the plane's key), so two callers of one tenant who pick
// the same key never get each other's answer, unless keys are
// `sharedAcrossCallers`. The claim carries a fingerprint of the method, the
// target (path and query), the `Content-Type`, the body and the counted
// headers (fingerprint.ts).
//
// | request | answer |
// |---|---|
// | first with this key | the handler runs; its answer is journaled, and the caller gets exactly what a replay will say |
// | the handler answered anything, a 5xx or 429 included | journaled and replayed: the handler started, so only it knows what took effect |
// | the handler threw (or timed out, then threw) | a 500 `handler-failed` (504 `handler-timeout`) problem, journaled and replayed |
// | the handler threw `NothingHappened` | the claim is released, the response it carries answered: a retry runs the handler again |
// | the handler timed out and answered while the journal's deadline has more than 2 s left | that answer, journaled and returned |
// | the handler timed out and still runs when the journal's deadline has 2 s left | a 504 `handler-timeout` problem, journaled and replayed (it may still take effect; no retry runs it again) |
// | repeat after completion | the journaled status, headers and body, `Idempotent-Replayed: true` |
// | repeat while the first is in flight, its answer still being journaled included | 409, `Retry-After: 1` |
// | same key, different fingerprint | 422 |
// | no key where one is required | 400 (or passed through, `optional`) |
// | empty, malformed, or longer than 255 characters | 400 |
// | no tenant, or no caller where keys are per caller | 401 |
// | body above the limit | 413 |
// | no policy for the scope, no route, or neither `principal` nor `sharedAcrossCallers` | 500 |
// | the plane never reached (`PlaneError.neverReachedThePlane`) | 503, `Retry-After: 5` (or run unprotected, `failOpen`) |
// | any other failure of the claim: the plane may hold the key | 503, `Retry-After: 5`, whether or not it fails open |
// | with heartbeats, a beat found the key taken over while the handler ran | its signal aborted; 409, `Retry-After: 1`, nothing journaled |
// | with heartbeats, no beat confirmed the lease in time (the plane not reached) | its signal aborted before the lease can pass; 503, `Retry-After: 5`, nothing journaled (left to its lease) |
//
// Endings. Every claim ends through the driver (held.ts): the answer is
// journaled exactly (`Held.journalExact`) or, when the store refuses it (an
// answer above a scope's own, lower limit), without its body. As Stripe's
// API does, once a handler started its result is kept for the key, a 500
// included: only the handler knows whether it took effect, and a retry that
// ran it again could make the effect twice. It releases the claim only by
// throwing `NothingHappened` (a refusal of its own before any effect: a
// downstream that was unavailable, a rate limit); a request refused before
// the handler ran (400, 401, 409, 413, 422) keeps nothing.
//
// Timing. The handler is cut at its timeout (30 s), counted from before its
// claim: its Request's `signal` aborts then; an answer that comes until
// the journal's deadline has 2 s left (half of it, under 4 s) is kept, a
// later one is ignored (the 504 problem is the key's answer by then).
// The journal is cut a journal deadline (10 s) later and retried within it;
// the lease is their sum plus a margin (5 s), so no other instance takes a
// key over while the request holding it still runs or journals. The
// handler's Request signal follows the timeout only, not the client: a
// client that hangs up does not cut a claimed request half-way, as the Rust
// layer runs each request as a task of its own.
//
// A replay carries the status, the body and the kept headers
// (`Content-Type`, `Location` and those named in `keepHeaders`); a header
// that carries credentials (CREDENTIAL_HEADERS) is refused as a kept header
// and never replayed, even from a journal that holds one.
//
// This file holds the options and `withIdempotencyKey`; the header's rules
// are in key.ts, the settings every request is served with in config.ts, and
// the request's way through the middleware, step by step, in
// request_flow.ts.

import { PlaneError } from "./errors.ts";
import type { IdempotencyPlane } from "./plane.ts";
import { consoleLogger, type Logger } from "./log.ts";
import { problemResponse } from "./problem.ts";
import { isCredential } from "./stored_response.ts";
import { Timing, withHeartbeat } from "./timing.ts";
import { EffectDriver } from "./driver.ts";
import type { Config, Handler, OfRequest } from "./config.ts";
import { handle, handlerFailed } from "./request_flow.ts";

export { CREDENTIAL_HEADERS } from "./stored_response.ts";
export { IDEMPOTENCY_KEY, idempotencyKey, MAX_IDEMPOTENCY_KEY_CHARS, planeKey, targetOf } from "./key.ts";
export type { Handler } from "./config.ts";

const DEFAULT_BODY_LIMIT_BYTES = 1024 * 1024;
const DEFAULT_RESPONSE_BODY_LIMIT_BYTES = 8 * 1024 * 1024;
const DEFAULT_HANDLER_TIMEOUT_MS = 30_000;
const DEFAULT_HTTP_JOURNAL_DEADLINE_MS = 10_000;
const DEFAULT_HTTP_MARGIN_MS = 5_000;

/** Options of `withIdempotencyKey`. */
export interface IdempotencyKeyOptions {
  plane: IdempotencyPlane;
  /**
   * The tenant (the plane's organization, a UUID), or a function naming it
   * for each request, for example from its verified JWT. Undefined answers
   * 401 `no-tenant`; a value that is not a UUID is a server error (500).
   */
  organizationId: string | OfRequest<string>;
  /**
   * Each caller's keys are its own: names the caller of a request within its
   * tenant (a user or API client id, the `sub` of a verified token); the
   * plane's key is scoped by its SHA-256. Undefined answers 401
   * `no-principal`. Give this or `sharedAcrossCallers`; with neither, every
   * keyed request is answered 500 `not-configured`.
   */
  principal?: OfRequest<string>;
  /** Every caller of a tenant shares its keys (a tenant that is one service account). */
  sharedAcrossCallers?: true;
  /**
   * The route the handler serves, as a template (`/orders`, `/orders/{id}`):
   * the scope names it, never each path, so scopes stay a bounded set. A
   * function may name it per request; undefined answers 500.
   */
  route: string | ((req: Request) => string | undefined);
  /** The methods that take a key (others pass straight through). Default POST and PATCH. */
  methods?: readonly string[];
  /** Requests without a key pass through unprotected instead of 400. */
  optional?: boolean;
  /** The largest request body buffered, in bytes (default 1 MiB); a larger one is 413. */
  bodyLimitBytes?: number;
  /** The largest answer buffered for the journal (default 8 MiB); a larger one is journaled without its body, and answered so. */
  responseBodyLimitBytes?: number;
  /** How long the handler may run, from before its claim (default 30 s); then a 504 problem, kept for the key. */
  handlerTimeoutMs?: number;
  /** How long journaling may take after the handler's timeout (default 10 s). */
  journalDeadlineMs?: number;
  /** What the lease keeps beyond both (default 5 s). */
  marginMs?: number;
  /**
   * Claims for this short lease (at least 3 s) instead of the whole one, and
   * keeps it alive with a heartbeat every third of it while the handler runs
   * and its answer is journaled: a worker stopped mid-handler frees its key
   * after this long, a slow live one keeps it. A heartbeat that finds the key
   * taken over aborts the handler's signal, answered 409 `in-flight`; no beat
   * confirming the lease in time (the plane not reached) aborts it before the
   * lease can pass, answered 503 `unavailable`. Either way nothing of the
   * handler's is journaled.
   */
  heartbeatLeaseMs?: number;
  /** Request headers that are part of the fingerprint (a currency, an API version). */
  countHeaders?: readonly string[];
  /** Answer headers journaled and replayed besides `Content-Type` and `Location`; credential headers are refused. */
  keepHeaders?: readonly string[];
  /**
   * An answer above the journal's limit: `omit_body` (default) journals its
   * status and headers and a repeat gets them with an empty body and
   * `Idempotent-Body-Omitted: <bytes>`; `refuse` answers 500 `answer-not-kept`
   * to the first caller and every repeat.
   */
  onOversize?: "omit_body" | "refuse";
  /**
   * When the plane was certainly never reached (`PlaneError.neverReachedThePlane`:
   * the connection was not made, or PostgREST's own 503 PGRST000/PGRST002,
   * 504 PGRST003), run the handler unprotected, logged at error level,
   * instead of 503. Any other failure of a claim is still 503.
   */
  failOpen?: boolean;
  /** Where events go. Default: warnings and errors on the console. */
  log?: Logger;
}

/**
 * `handler` behind `Idempotency-Key` (see the module comment for what it
 * answers). Refuses, when it is made, a timing the plane cannot lease, a
 * credential header to keep, and both `principal` and `sharedAcrossCallers`.
 */
export function withIdempotencyKey(
  handler: Handler,
  options: IdempotencyKeyOptions,
): (req: Request) => Promise<Response> {
  const config = configure(options);
  return async (req: Request) => {
    try {
      return await handle(config, handler, req);
    } catch (error) {
      // A throw of the application's tenant or principal function, or a bug:
      // any claim was settled before it got here.
      config.log({ event: "idempotency.http_failed", level: "error", error: String(error) });
      return problemResponse(handlerFailed());
    }
  };
}

/**
 * The options checked, with their defaults filled in: what every request is
 * served with. Throws `bad_configuration` (or the Timing's own refusal)
 * for a setting that cannot work.
 */
function configure(options: IdempotencyKeyOptions): Config {
  const bad = (message: string) => PlaneError.invalid("bad_configuration", message);
  if (options.principal !== undefined && options.sharedAcrossCallers) {
    throw bad("give principal or sharedAcrossCallers, not both");
  }
  const kept = ["content-type", "location"];
  for (const name of options.keepHeaders ?? []) {
    if (isCredential(name)) {
      throw bad(
        `the ${name.toLowerCase()} header carries credentials and is never journaled: a replay would hand it to another caller`,
      );
    }
    kept.push(name.toLowerCase());
  }
  for (
    const [what, value] of [
      ["bodyLimitBytes", options.bodyLimitBytes],
      ["responseBodyLimitBytes", options.responseBodyLimitBytes],
    ] as const
  ) {
    if (value !== undefined && !(Number.isSafeInteger(value) && value >= 0)) throw bad(`${what} must be a byte count`);
  }
  const log = options.log ?? consoleLogger("warn");
  return {
    plane: options.plane,
    driver: new EffectDriver(options.plane, { log }),
    timing: withHeartbeat(
      new Timing(
        options.handlerTimeoutMs ?? DEFAULT_HANDLER_TIMEOUT_MS,
        options.journalDeadlineMs ?? DEFAULT_HTTP_JOURNAL_DEADLINE_MS,
        options.marginMs ?? DEFAULT_HTTP_MARGIN_MS,
      ),
      options.heartbeatLeaseMs,
    ),
    organizationId: options.organizationId,
    callers: options.principal !== undefined
      ? { kind: "each", principal: options.principal }
      : options.sharedAcrossCallers
      ? { kind: "shared" }
      : { kind: "unchosen" },
    route: options.route,
    methods: options.methods ?? ["POST", "PATCH"],
    optional: options.optional ?? false,
    bodyLimit: options.bodyLimitBytes ?? DEFAULT_BODY_LIMIT_BYTES,
    responseBodyLimit: options.responseBodyLimitBytes ?? DEFAULT_RESPONSE_BODY_LIMIT_BYTES,
    counted: (options.countHeaders ?? []).map((name) => name.toLowerCase()),
    kept,
    oversize: options.onOversize ?? "omit_body",
    failOpen: options.failOpen ?? false,
    log,
  };
}
