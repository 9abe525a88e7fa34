// `Idempotency-Key` for any Fetch-style HTTP handler (a Supabase Edge
// Function, `Deno.serve`, Hono's `app.fetch`), after the IETF draft "The
// Idempotency-Key HTTP Header Field" and the way Stripe's API behaves — the
// Rust layer (src/callers/idempotency_key) ported to the letter: the same
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
// | first with this key | the handler runs; its answer is journaled and returned |
// | the handler answered 5xx or 429, threw, or timed out | the claim is released: a retry runs the handler again |
// | the handler timed out and still runs half the journal's deadline later | left to its lease: a retry meanwhile is 409 |
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
//
// Endings. Every claim ends through the driver (driver.ts): the answer is
// journaled exactly (`Held.journalExact`) or, when the store refuses it (an
// answer above a scope's own, lower limit), without its body. The one
// exception to the driver's rule — release only when no effect happened —
// is the Rust layer's, and documented there and here: a claim whose
// handler threw, timed out or answered 5xx/429 is RELEASED, as any retry of
// a failed HTTP request assumes (the handler made no effect it cannot
// repeat; one that passes an effect on dedupes it downstream with the same
// key, as `vendorKey` does).
//
// Timing. The handler is cut at its timeout (30 s), counted from before its
// claim: its Request's `signal` aborts then and a later answer is ignored.
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

import { Timing } from "./timing.ts";
import type { Held, Settled } from "./held.ts";
import { Attempt, EffectDriver, type EffectSpec } from "./driver.ts";
import { PlaneError } from "./errors.ts";
import { storedSize, success } from "./answer.ts";
import { checkOrganization, type IdempotencyPlane } from "./plane.ts";
import { consoleLogger, type Logger } from "./log.ts";
import { sha256Hex } from "./hash.ts";
import { fingerprint, scopeOf } from "./fingerprint.ts";
import { type Problem, problem, problemResponse } from "./problem.ts";
import {
  isCredential,
  refusal,
  refusedResponse,
  replay,
  storedOf,
  type StoredResponse,
  withoutBody,
} from "./stored_response.ts";

export { CREDENTIAL_HEADERS } from "./stored_response.ts";

/** The request header the key is read from. */
export const IDEMPOTENCY_KEY = "idempotency-key";

/** Longest key accepted, in characters (Stripe's limit). */
export const MAX_IDEMPOTENCY_KEY_CHARS = 255;

/** Separates a caller's hash from the key in the plane's key (no Idempotency-Key can hold it). */
const CALLER_SEPARATOR = "\u00a7";

const DEFAULT_BODY_LIMIT_BYTES = 1024 * 1024;
const DEFAULT_RESPONSE_BODY_LIMIT_BYTES = 8 * 1024 * 1024;
const DEFAULT_HANDLER_TIMEOUT_MS = 30_000;
const DEFAULT_HTTP_JOURNAL_DEADLINE_MS = 10_000;
const DEFAULT_HTTP_MARGIN_MS = 5_000;
const IN_FLIGHT_RETRY_AFTER_S = 1;
const UNAVAILABLE_RETRY_AFTER_S = 5;

/** A Fetch-style handler. */
export type Handler = (req: Request) => Promise<Response> | Response;

/** A value of the request, or a function of it (sync or async). */
type OfRequest<T> = (req: Request) => T | undefined | Promise<T | undefined>;

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
  /** The largest answer buffered for the journal (default 8 MiB); a larger one is 502, journaled without its body. */
  responseBodyLimitBytes?: number;
  /** How long the handler may run, from before its claim (default 30 s); then 504 and released. */
  handlerTimeoutMs?: number;
  /** How long journaling may take after the handler's timeout (default 10 s). */
  journalDeadlineMs?: number;
  /** What the lease keeps beyond both (default 5 s). */
  marginMs?: number;
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

interface Config {
  plane: IdempotencyPlane;
  driver: EffectDriver;
  timing: Timing;
  organizationId: string | OfRequest<string>;
  callers: { kind: "unchosen" } | { kind: "each"; principal: OfRequest<string> } | { kind: "shared" };
  route: string | ((req: Request) => string | undefined);
  methods: readonly string[];
  optional: boolean;
  bodyLimit: number;
  responseBodyLimit: number;
  counted: readonly string[];
  kept: readonly string[];
  oversize: "omit_body" | "refuse";
  failOpen: boolean;
  log: Logger;
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
    timing: new Timing(
      options.handlerTimeoutMs ?? DEFAULT_HANDLER_TIMEOUT_MS,
      options.journalDeadlineMs ?? DEFAULT_HTTP_JOURNAL_DEADLINE_MS,
      options.marginMs ?? DEFAULT_HTTP_MARGIN_MS,
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

function handlerFailed(): Problem {
  return problem("handler-failed", "the request failed before it finished; retry with the same key");
}

function notConfigured(detail: string): Response {
  return problemResponse(problem("not-configured", detail));
}

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

type Read = { bytes: Uint8Array } | { tooLarge: true } | { broke: unknown } | { late: true };

/** Reads `body` up to `limit` bytes, and until `deadline` (epoch ms) when given. */
async function readBody(body: ReadableStream<Uint8Array> | null, limit: number, deadline?: number): Promise<Read> {
  if (body === null) return { bytes: new Uint8Array(0) };
  const reader = body.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = deadline === undefined ? undefined : new Promise<{ late: true }>((resolve) => {
    timer = setTimeout(() => resolve({ late: true }), Math.max(0, deadline - Date.now()));
  });
  try {
    for (;;) {
      const next = reader.read().then((chunk) => ({ chunk }), (broke: unknown) => ({ broke }));
      const got = await (late ? Promise.race([next, late]) : next);
      if ("late" in got) {
        reader.cancel().catch(() => {});
        return got;
      }
      if ("broke" in got) return { broke: got.broke };
      if (got.chunk.done) break;
      size += got.chunk.value.length;
      if (size > limit) {
        reader.cancel().catch(() => {});
        return { tooLarge: true };
      }
      chunks.push(got.chunk.value);
    }
  } finally {
    clearTimeout(timer);
  }
  const bytes = new Uint8Array(size);
  let at = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, at);
    at += chunk.length;
  }
  return { bytes };
}

/** The request again, with its buffered body (and a signal of its own, when given). */
function rebuilt(req: Request, body: Uint8Array, signal?: AbortSignal): Request {
  const init: RequestInit = { body: req.method === "GET" || req.method === "HEAD" ? null : body as BodyInit };
  if (signal) init.signal = signal;
  return new Request(req, init);
}

async function handle(config: Config, handler: Handler, req: Request): Promise<Response> {
  if (!config.methods.includes(req.method)) return await handler(req);
  const read = idempotencyKey(req.headers);
  if (read === undefined) {
    if (config.optional) return await handler(req);
    return problemResponse(
      problem("missing-key", `${req.method} requests to this API carry an Idempotency-Key header`),
    );
  }
  if ("problem" in read) return problemResponse(read.problem);
  const key = read.key;

  const named = typeof config.organizationId === "string" ? config.organizationId : await config.organizationId(req);
  if (named === undefined) {
    return problemResponse(problem("no-tenant", "the request does not name the tenant its key belongs to"));
  }
  let organizationId: string;
  try {
    organizationId = checkOrganization(named);
  } catch {
    config.log({ event: "idempotency.http_not_configured", level: "error", why: "the tenant is not a UUID" });
    return notConfigured("the server names a tenant that is not a UUID");
  }
  let principal: string | undefined;
  switch (config.callers.kind) {
    case "shared":
      break;
    case "each":
      principal = await config.callers.principal(req);
      if (principal === undefined) {
        return problemResponse(problem("no-principal", "the request does not name the caller its key belongs to"));
      }
      break;
    case "unchosen":
      config.log({
        event: "idempotency.http_not_configured",
        level: "error",
        why: "the Idempotency-Key middleware does not know whose keys a key is among: " +
          "give it principal: (req) => … or sharedAcrossCallers: true",
      });
      return notConfigured("the server has not said whether its idempotency keys are per caller");
  }

  const body = await readBody(req.body, config.bodyLimit);
  if ("tooLarge" in body) {
    return problemResponse(problem("body-too-large", `request bodies are buffered up to ${config.bodyLimit} bytes`));
  }
  if ("broke" in body) return problemResponse(problem("body-unreadable", `the body broke off: ${body.broke}`));
  if (!("bytes" in body)) throw new Error("unreachable: a request body is read without a deadline");
  const bytes = body.bytes;

  const route = typeof config.route === "string" ? config.route : config.route(req);
  if (route === undefined) {
    config.log({ event: "idempotency.http_not_configured", level: "error", why: "no route for the request" });
    return notConfigured("the server applies its idempotency layer where it cannot see the route");
  }
  const scope = await scopeOf(req.method, route);
  const requestHash = await fingerprint(req.method, targetOf(req), req.headers, bytes, config.counted);
  const spec: EffectSpec = {
    organizationId,
    scope,
    key: await planeKey(key, principal),
    requestHash,
    timing: config.timing,
  };
  const event = { scope, key, per_caller: principal !== undefined };

  let held: Held;
  try {
    const begun = await config.driver.begin(spec, new Attempt());
    switch (begun.kind) {
      case "replayed": {
        config.log({ event: "idempotency.http", ...event, outcome: "replayed", replayed: true });
        const replayed = replay(begun.answer.output);
        if (replayed) return replayed;
        config.log({ event: "idempotency.http_unreadable", level: "error", ...event });
        return problemResponse(
          problem("unreadable-answer", "this key completed, but its journaled answer is not an HTTP answer"),
        );
      }
      case "in_flight":
        config.log({ event: "idempotency.http", ...event, outcome: "in_flight" });
        return problemResponse(
          problem(
            "in-flight",
            "the first request with this Idempotency-Key has not finished; retry later",
            IN_FLIGHT_RETRY_AFTER_S,
          ),
        );
      case "conflict":
        config.log({ event: "idempotency.http", ...event, outcome: "key_reused" });
        return problemResponse(
          problem(
            "key-reused",
            "this key was used for a request with another method, path, query, content type, body or headers",
          ),
        );
      case "held":
        held = begun.held;
    }
  } catch (error) {
    return await unavailable(config, error, handler, rebuilt(req, bytes), event);
  }

  // A handler that threw or timed out gave no answer to anyone: released,
  // like any failed request, so the client's retry runs it (the documented
  // exception to the driver's rule; see the module comment).
  const ran = await held.run(async (signal) => await handler(rebuilt(req, bytes, signal)));
  if (!("value" in ran)) {
    if (ran.cut === "timed_out") {
      config.log({
        event: "idempotency.http_timeout",
        level: "warn",
        ...event,
        timeout_ms: config.timing.effectMs,
        why: "the handler timed out",
      });
      // JavaScript cannot stop the handler (its signal only asks it to): a
      // claim released while it still runs would let the client's retry run
      // it a second time beside it. Wait for it through half the journal's
      // deadline; one still running then is left to its lease.
      const late = await held.late(held.effectDeadline + config.timing.journalMs / 2);
      if (late === undefined) {
        const settled = await held.settle({ unknown: "the handler timed out and is still running" });
        config.log({ event: "idempotency.http_left_to_lease", level: "warn", ...event, ending: settled.ending });
      } else {
        await release(config, held, event);
      }
      return problemResponse(
        problem("handler-timeout", "the request was cut off before it finished; retry with the same key"),
      );
    }
    config.log({
      event: "idempotency.http_handler_failed",
      level: "error",
      ...event,
      error: String(ran.error),
      why: "the handler threw; its claim is released",
    });
    await release(config, held, event);
    return problemResponse(handlerFailed());
  }
  const response = ran.value;
  if (!(response instanceof Response)) {
    config.log({ event: "idempotency.http_handler_failed", level: "error", ...event, why: "not a Response" });
    await release(config, held, event);
    return problemResponse(handlerFailed());
  }
  if (response.status >= 500 || response.status === 429) {
    // Retryable: not the answer to this key, so the next try runs again.
    await release(config, held, event);
    return response;
  }

  const answerBody = await readBody(response.body, config.responseBodyLimit, held.effectDeadline);
  let answer: Response;
  let stored: StoredResponse;
  let bodyBytes: number;
  if ("bytes" in answerBody) {
    bodyBytes = answerBody.bytes.length;
    stored = await fit(config, storedOf(response.status, response.headers, config.kept, answerBody.bytes), bodyBytes);
    answer = refusedResponse(stored) ??
      new Response(NULL_BODY.has(response.status) ? null : answerBody.bytes as Uint8Array<ArrayBuffer>, {
        status: response.status,
        statusText: response.statusText,
        headers: response.headers,
      });
  } else {
    // The handler ran (its effect is made) but its answer could not be read
    // whole, in size or in time: keep what is known.
    bodyBytes = config.responseBodyLimit;
    stored = withoutBody(storedOf(response.status, response.headers, config.kept, new Uint8Array(0)), bodyBytes);
    answer = problemResponse(
      problem("answer-incomplete", "the request ran, but its answer was too large or too slow to return"),
    );
  }
  const settled = await journal(config, held, stored, bodyBytes);
  config.log({
    event: "idempotency.http",
    level: settled.ending === "journaled" ? "info" : settled.ending === "left_to_lease" ? "error" : "warn",
    ...event,
    outcome: "claimed",
    ending: settled.ending,
    ...(settled.ending === "left_to_lease"
      ? { why: `the answer could not be journaled; the claim frees itself when its lease passes: ${settled.why}` }
      : {}),
  });
  return answer;
}

const NULL_BODY = new Set([101, 103, 204, 205, 304]);

/** Releases a claim whose handler gave no answer (the layer's documented exception). */
async function release(config: Config, held: Held, event: Record<string, unknown>): Promise<void> {
  const settled = await held.settle("release");
  config.log({ event: "idempotency.http", ...event, outcome: "claimed", ending: settled.ending });
}

/**
 * Journals `stored` through the driver (within the journal's deadline,
 * retried on transient failures). An answer the store refuses (above the
 * scope's own limit, which may be lower than the plane's) is journaled again
 * without its body, so that a repeat replays instead of running the handler
 * again.
 */
async function journal(config: Config, held: Held, stored: StoredResponse, bodyBytes: number): Promise<Settled> {
  const exact = await held.journalExact(success(stored));
  if (!("refused" in exact)) return exact;
  config.log({
    event: "idempotency.http_answer_refused",
    level: "warn",
    scope: held.claim.scope,
    error: exact.refused.message,
    why: "the store refused the answer; journaling it without its body",
  });
  return await held.settle({ journal: success(withoutBody(stored, bodyBytes)) });
}

/**
 * The oversize policy for an answer whose body is `bodyBytes` long, when its
 * stored form is above the plane's response limit: the journal keeps its
 * status and headers only, or a refusal the caller gets as well.
 */
async function fit(config: Config, stored: StoredResponse, bodyBytes: number): Promise<StoredResponse> {
  if (await storedSize(success(stored)) <= config.plane.responseLimitBytes) return stored;
  if (config.oversize === "omit_body") return withoutBody(stored, bodyBytes);
  return refusal(
    problem("answer-not-kept", "the request ran, but its answer is larger than this API keeps for repeats"),
  );
}

/**
 * The claim failed: 503, or with `failOpen`, when the plane was never
 * reached, the handler runs unprotected. A misconfiguration (no policy for
 * the scope, input the plane refuses) is 500 either way.
 */
async function unavailable(
  config: Config,
  error: unknown,
  handler: Handler,
  req: Request,
  event: Record<string, unknown>,
): Promise<Response> {
  const message = error instanceof Error ? error.message : String(error);
  if (error instanceof PlaneError && (error.kind === "unknown_scope" || error.kind === "invalid_input")) {
    config.log({
      event: "idempotency.http_not_configured",
      level: "error",
      ...event,
      error: message,
      why: "the idempotency scope is not usable; add a policy row for it (http.* covers every route)",
    });
    return notConfigured("the server has no idempotency policy for this route");
  }
  // Only a plane that was never reached may be bypassed: after any other
  // failure (an answer lost or too late, a lock timeout, a 5xx) the plane
  // may have made the claim, and then it holds this key for someone.
  const neverReached = error instanceof PlaneError && error.neverReachedThePlane;
  if (config.failOpen && neverReached) {
    config.log({
      event: "idempotency.fail_open",
      level: "error",
      ...event,
      error: message,
      why: "the idempotency plane is unreachable; FAIL-OPEN: running the request without protection",
    });
    return await handler(req);
  }
  config.log({
    event: "idempotency.http_unavailable",
    level: "warn",
    ...event,
    error: message,
    why: config.failOpen
      ? "the claim failed, but the plane may have made it; not failing open, answering 503"
      : "the claim failed; answering 503",
  });
  return problemResponse(
    problem(
      "unavailable",
      "the request was not run, because its key cannot be checked now; retry with the same key",
      UNAVAILABLE_RETRY_AFTER_S,
    ),
  );
}
