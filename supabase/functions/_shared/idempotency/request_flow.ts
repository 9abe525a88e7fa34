// One request through the Idempotency-Key middleware, step by step (the Rust
// layer's future.rs): read the key, name the tenant and the caller
// (`callerOf`), buffer the body (`buffer`), find the scope (`routeScope`)
// and the fingerprint (all in `keyedRequest`); `claim` the key and `decide`
// (replay, in flight, key reused, or run); run the handler under the claim
// (`runHandler`, `cutOff` when it times out); keep its answer in the journal
// (`keepAnswer`). `handle` takes a request through them; what each answer
// means is in http.ts.

import { storedSize, success } from "./answer.ts";
import { PlaneError } from "./errors.ts";
import { NothingHappened } from "./run_effect.ts";
import bodyHeaders from "./body_headers.json" with { type: "json" };
import { checkOrganization } from "./plane.ts";
import { fingerprint, scopeOf } from "./fingerprint.ts";
import { type Problem, problem, problemResponse } from "./problem.ts";
import { refusal, replay, storedOf, type StoredResponse, withoutBody } from "./stored_response.ts";
import type { Held, Settled } from "./held.ts";
import { Attempt, type Begun, type EffectSpec } from "./driver.ts";
import { idempotencyKey, planeKey, targetOf } from "./key.ts";
import { readBody, rebuilt } from "./body.ts";
import type { Config, Handler } from "./config.ts";

const IN_FLIGHT_RETRY_AFTER_S = 1;
const UNAVAILABLE_RETRY_AFTER_S = 5;

/** Statuses whose answer carries no body. */
const NULL_BODY = new Set([101, 103, 204, 205, 304]);

/**
 * Where a step of the flow leads: on to the next step, with what it found;
 * past the middleware (the handler serves the request unprotected); or to
 * an answer the middleware gives itself.
 */
type Step<T> = { next: T } | { passThrough: true } | { answer: Response };

/** A request the middleware protects: the request, its body, and what the plane is asked under its key. */
interface Keyed {
  /** The request as it came; its body is `bytes` now. */
  req: Request;
  bytes: Uint8Array;
  spec: EffectSpec;
  /** What every event about this request carries: scope, the client's key, per_caller. */
  event: Record<string, unknown>;
}

/** How running the handler under the claim ended. */
type Ran =
  /** The handler answered: its answer is still to be kept. */
  | { answered: Response }
  /** The request ends here, its claim settled: this is what the caller gets. */
  | { ended: Response };

/**
 * Serves one request: a request the middleware does not protect goes
 * straight to `handler`; a keyed one is claimed, run at most once, and
 * journaled. What throws here (the application's tenant or principal
 * function, a pass-through handler) is answered by `withIdempotencyKey`.
 */
export async function handle(config: Config, handler: Handler, req: Request): Promise<Response> {
  const step = await keyedRequest(config, req);
  if ("passThrough" in step) return await handler(req);
  if ("answer" in step) return step.answer;
  return await protect(config, handler, step.next);
}

/**
 * 500 handler-failed for a request the middleware did not get to protect
 * (it passed through, or the middleware itself failed): no key advice, as
 * the request may have carried none.
 */
export function handlerFailed(): Problem {
  return problem("handler-failed", "the request failed; whether it took effect is unknown");
}

/**
 * A keyed handler that started and then threw (`handler-failed`) or was cut
 * at its timeout (`handler-timeout`): it may have taken effect, so this
 * problem is kept for the key and every retry with it gets it again.
 */
function startedAndFailed(slug: "handler-failed" | "handler-timeout"): Problem {
  const what = slug === "handler-timeout" ? "was cut off at its timeout" : "failed";
  return problem(
    slug,
    `the request ${what} after it started, and may have taken effect; this Idempotency-Key now answers ` +
      "this to every retry: check what took effect before sending the request again with a new key",
  );
}

function notConfigured(detail: string): Response {
  return problemResponse(problem("not-configured", detail));
}

/**
 * The request's key, tenant and caller, body, scope and fingerprint, in
 * that order: the first that is missing or refused answers the request (a
 * request of another method, or an optional key left out, passes through).
 */
async function keyedRequest(config: Config, req: Request): Promise<Step<Keyed>> {
  if (!config.methods.includes(req.method)) return { passThrough: true };
  const read = idempotencyKey(req.headers);
  if (read === undefined) {
    if (config.optional) return { passThrough: true };
    return {
      answer: problemResponse(
        problem("missing-key", `${req.method} requests to this API carry an Idempotency-Key header`),
      ),
    };
  }
  if ("problem" in read) return { answer: problemResponse(read.problem) };
  const key = read.key;
  const caller = await callerOf(config, req);
  if (caller instanceof Response) return { answer: caller };
  const bytes = await buffer(config, req);
  if (bytes instanceof Response) return { answer: bytes };
  const scope = await routeScope(config, req);
  if (scope instanceof Response) return { answer: scope };
  const requestHash = await fingerprint(req.method, targetOf(req), req.headers, bytes, config.counted);
  const spec: EffectSpec = {
    organizationId: caller.organizationId,
    scope,
    key: await planeKey(key, caller.principal),
    requestHash,
    timing: config.timing,
  };
  return { next: { req, bytes, spec, event: { scope, key, per_caller: caller.principal !== undefined } } };
}

/**
 * The request's tenant, and its caller when keys are per caller: 401 when
 * either is not named, 500 when the tenant is not a UUID or the middleware
 * was not told whose keys a key is among.
 */
async function callerOf(
  config: Config,
  req: Request,
): Promise<{ organizationId: string; principal: string | undefined } | Response> {
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
  switch (config.callers.kind) {
    case "shared":
      return { organizationId, principal: undefined };
    case "each": {
      const principal = await config.callers.principal(req);
      if (principal === undefined) {
        return problemResponse(problem("no-principal", "the request does not name the caller its key belongs to"));
      }
      return { organizationId, principal };
    }
    case "unchosen":
      config.log({
        event: "idempotency.http_not_configured",
        level: "error",
        why: "the Idempotency-Key middleware does not know whose keys a key is among: " +
          "give it principal: (req) => … or sharedAcrossCallers: true",
      });
      return notConfigured("the server has not said whether its idempotency keys are per caller");
  }
}

/** The request's body, read whole up to the body limit: 413 above it, 400 when it breaks off. */
async function buffer(config: Config, req: Request): Promise<Uint8Array | Response> {
  const body = await readBody(req.body, config.bodyLimit);
  if ("tooLarge" in body) {
    return problemResponse(problem("body-too-large", `request bodies are buffered up to ${config.bodyLimit} bytes`));
  }
  if ("broke" in body) return problemResponse(problem("body-unreadable", `the body broke off: ${body.broke}`));
  if (!("bytes" in body)) throw new Error("unreachable: a request body is read without a deadline");
  return body.bytes;
}

/**
 * The scope of the route the handler serves (a template such as
 * `/orders/{id}`), never of each path, so scopes stay a bounded set: 500
 * when the request has no route.
 */
async function routeScope(config: Config, req: Request): Promise<string | Response> {
  const route = typeof config.route === "string" ? config.route : config.route(req);
  if (route === undefined) {
    config.log({ event: "idempotency.http_not_configured", level: "error", why: "no route for the request" });
    return notConfigured("the server applies its idempotency layer where it cannot see the route");
  }
  return await scopeOf(req.method, route);
}

/**
 * Claims the key, runs the handler under the claim, and keeps its answer;
 * a claim that fails answers 503 (or, failing open, runs the handler
 * unprotected).
 */
async function protect(config: Config, handler: Handler, keyed: Keyed): Promise<Response> {
  let held: Held;
  try {
    const decided = await claim(config, keyed);
    if (decided instanceof Response) return decided;
    held = decided;
  } catch (error) {
    return await unavailable(config, error, handler, rebuilt(keyed.req, keyed.bytes), keyed.event);
  }
  const ran = await runHandler(config, held, handler, keyed);
  if ("ended" in ran) return ran.ended;
  return await keepAnswer(config, held, ran.answered, keyed.event);
}

/** Claims the plane's key through the effect driver and decides by its answer; throws when the claim failed. */
async function claim(config: Config, keyed: Keyed): Promise<Held | Response> {
  return decide(config, await config.driver.begin(keyed.spec, new Attempt()), keyed.event);
}

/**
 * What the claim's answer leads to: the key is ours to run (the claim), or
 * the middleware answers with the journaled answer (replayed), 409 in
 * flight, or 422 key reused.
 */
function decide(config: Config, begun: Begun, event: Record<string, unknown>): Held | Response {
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
      return begun.held;
  }
}

/**
 * Runs the handler under `held`, cut at its timeout. Once it started, only
 * the handler knows whether it took effect: whatever it ends with is kept
 * for the key (a throw as a `handler-failed` problem), unless it throws
 * `NothingHappened`, which releases the claim. One that timed out ends as
 * `cutOff` says.
 */
async function runHandler(config: Config, held: Held, handler: Handler, keyed: Keyed): Promise<Ran> {
  const ran = await held.run(async (signal) => await handler(rebuilt(keyed.req, keyed.bytes, signal)));
  if ("value" in ran) return await answered(config, held, ran.value, keyed.event, "handler-failed");
  if (ran.cut === "timed_out") return { ended: await cutOff(config, held, keyed.event) };
  if (ran.cut === "fence_lost") {
    // Another worker holds the key now; its answer is the one every repeat gets.
    await held.settle({ unknown: "the claim was taken over by another worker" });
    config.log({ event: "idempotency.http", ...keyed.event, outcome: "taken_over" });
    return {
      ended: problemResponse(
        problem("in-flight", "another worker holds this Idempotency-Key now; retry later", IN_FLIGHT_RETRY_AFTER_S),
      ),
    };
  }
  if (ran.cut === "lease_unconfirmed") return { ended: await leaseUnconfirmed(config, held, keyed.event) };
  if (ran.cut === "not_started") {
    // Nothing ran, but the plane did not confirm the lease: the key is left
    // to it, and the caller retries as after an outage.
    await held.settle({ unknown: "the lease could not be confirmed; the handler never started" });
    config.log({ event: "idempotency.http", ...keyed.event, outcome: "not_started" });
    return {
      ended: problemResponse(
        problem(
          "unavailable",
          "the idempotency plane did not confirm this key's lease; retry later",
          UNAVAILABLE_RETRY_AFTER_S,
        ),
      ),
    };
  }
  return { ended: await failed(config, held, ran.error, keyed.event, "handler-failed") };
}

/**
 * No heartbeat confirmed the lease before it could pass (the plane is not
 * reached): the handler's signal was aborted, and whatever it did is left to
 * the lease, nothing journaled: another worker may hold the key once it
 * passes. 503, so the caller retries with the same key later, and meets
 * that worker's answer or reclaims the key.
 */
async function leaseUnconfirmed(config: Config, held: Held, event: Record<string, unknown>): Promise<Response> {
  const settled = await held.settle({
    unknown: "the lease could not be confirmed (no heartbeat answered); the handler was stopped",
  });
  config.log({
    event: "idempotency.http",
    level: "warn",
    ...event,
    outcome: "lease_unconfirmed",
    ending: settled.ending,
  });
  return problemResponse(
    problem(
      "unavailable",
      "the idempotency plane did not confirm this key's lease, so the request was stopped and may have taken " +
        "effect; retry later with the same key",
      UNAVAILABLE_RETRY_AFTER_S,
    ),
  );
}

/** What the handler returned: its answer, or, when it is not a Response, a failure kept as `slug`. */
async function answered(
  config: Config,
  held: Held,
  value: unknown,
  event: Record<string, unknown>,
  slug: "handler-failed" | "handler-timeout",
): Promise<Ran> {
  if (value instanceof Response) return { answered: value };
  return {
    ended: await failed(config, held, new Error("the handler answered something other than a Response"), event, slug),
  };
}

/**
 * The handler threw after it started. `NothingHappened` releases the claim
 * and answers the response it carries (or a `handler-failed` problem that
 * says a retry runs it again); any other throw keeps the `slug` problem for
 * the key, so a retry does not run a handler that may have taken effect.
 */
async function failed(
  config: Config,
  held: Held,
  error: unknown,
  event: Record<string, unknown>,
  slug: "handler-failed" | "handler-timeout",
): Promise<Response> {
  if (error instanceof NothingHappened && error.response?.ok) {
    // A success was given on the strength of the claim: kept all the same.
    config.log({
      event: "idempotency.http_nothing_happened",
      level: "warn",
      ...event,
      why: "a success marked NothingHappened is kept: a success was given on the strength of its claim",
    });
    return await keepAnswer(config, held, error.response, event);
  }
  if (error instanceof NothingHappened) {
    config.log({ event: "idempotency.http_nothing_happened", level: "info", ...event, why: error.message });
    await release(config, held, event);
    return error.response ??
      problemResponse(problem("handler-failed", "the request failed before it took effect; retry with the same key"));
  }
  config.log({
    event: "idempotency.http_handler_failed",
    level: "error",
    ...event,
    error: String(error),
    why: "the handler failed after it started; its problem is kept for the key",
  });
  return await keepProblem(config, held, startedAndFailed(slug), event);
}

/**
 * The handler timed out: JavaScript cannot stop it (its signal only asks it
 * to), so wait for it while what it ends with can still be journaled inside
 * the lease: until `held.lateDeadline`, which leaves the journal the last
 * 2 s of its deadline (half of it, when the deadline is under 4 s). One that
 * ended by then ends as it ended (its late answer, a 2xx included, kept and
 * answered; a throw kept as a `handler-timeout` problem; `NothingHappened`
 * released). One still running may yet take effect: its `handler-timeout`
 * problem is kept for the key, as the Rust layer keeps it, so no retry ever
 * runs it a second time (neither beside it nor after its lease). Nothing is
 * released while it may act: a retry meanwhile is 409. With heartbeats, a
 * lease no beat confirmed in time ends the wait as `leaseUnconfirmed` does,
 * nothing journaled.
 *
 * The trade-off: the longer the wait, the more late answers are kept (with
 * the 10 s journal deadline, those that come up to 8 s after the timeout,
 * where waiting half the deadline kept 5 s), but the less time the journal
 * has to ride out a plane that is slow or failing just then (2 s rather
 * than 5 s). A journal that does not land leaves the claim to its lease,
 * and a retry after the lease runs the handler again: a plane that fails
 * for 2 to 5 s right then now meets that, where the shorter wait rode it
 * out. The reserve still holds the client's whole retry ladder. The first
 * caller waits as long for its answer.
 */
async function cutOff(config: Config, held: Held, event: Record<string, unknown>): Promise<Response> {
  config.log({
    event: "idempotency.http_timeout",
    level: "warn",
    ...event,
    timeout_ms: config.timing.effectMs,
    why: "the handler timed out",
  });
  const waitedUntil = held.lateDeadline;
  const late = await held.late(waitedUntil);
  if (late !== undefined && "cut" in late && late.cut === "lease_unconfirmed") {
    return await leaseUnconfirmed(config, held, event);
  }
  if (late === undefined) {
    config.log({
      event: "idempotency.http_handler_failed",
      level: "error",
      ...event,
      why: "the handler timed out and is still running; its problem is kept for the key",
    });
    return await keepProblem(config, held, startedAndFailed("handler-timeout"), event);
  }
  if ("value" in late) {
    const ran = await answered(config, held, late.value, event, "handler-timeout");
    return "ended" in ran ? ran.ended : await keepAnswer(config, held, ran.answered, event, waitedUntil);
  }
  return await failed(config, held, late.error, event, "handler-timeout");
}

/** Keeps `kept`, a problem the handler's failure is answered with, as the key's answer, and answers it. */
async function keepProblem(
  config: Config,
  held: Held,
  kept: Problem,
  event: Record<string, unknown>,
): Promise<Response> {
  const { settled, stored } = await journal(config, held, refusal(kept), 0);
  logKept(config, settled, event);
  return settled.ending === "journaled" ? firstAnswer(stored, new Headers()) : problemResponse(kept);
}

/** Logs how keeping an answer ended. */
function logKept(config: Config, settled: Settled, event: Record<string, unknown>): void {
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
}

/**
 * Headers that describe a body's bytes (`body_headers.json`, shared with the
 * Rust layer): never added to an answer whose body is not the handler's own
 * bytes (omitted), and the length ones never copied at all (the runtime sets
 * them for the body it sends).
 */
const BODY_HEADERS = new Set<string>(bodyHeaders.headers);

/**
 * What the first caller gets once `stored` is journaled: exactly what a
 * replay will say (status, kept headers, the body or its omission), less
 * `Idempotent-Replayed`; and the handler's own `headers` a replay leaves out
 * on purpose (credentials, headers not kept), unless the journal keeps a
 * refusal answered in the handler's place. A journaled answer no replay
 * could read is answered as a replay answers it.
 */
function firstAnswer(stored: StoredResponse, headers: Headers): Response {
  const response = replay(stored);
  if (response === undefined) {
    return problemResponse(
      problem("unreadable-answer", "this key completed, but its journaled answer is not an HTTP answer"),
    );
  }
  response.headers.delete("idempotent-replayed");
  if (stored.refused !== true) {
    const replayed = new Set(response.headers.keys());
    const bodyOmitted = stored.body_omitted !== undefined;
    for (const [name, value] of headers) {
      const describesBody = BODY_HEADERS.has(name);
      const copied = !describesBody ||
        (!bodyOmitted && name !== "content-length" && name !== "transfer-encoding");
      if (copied && !replayed.has(name)) response.headers.append(name, value);
    }
  }
  return response;
}

/**
 * Keeps the handler's answer as the key's, whatever its status (a 500
 * included: the handler started), and returns what the caller gets: what
 * every replay will say. An answer that cannot be read whole, in size or by
 * `readUntil` (the handler's timeout, or the end of the wait for a late
 * one), is kept without its body.
 */
async function keepAnswer(
  config: Config,
  held: Held,
  response: Response,
  event: Record<string, unknown>,
  readUntil = held.effectDeadline,
): Promise<Response> {
  const answerBody = await readBody(response.body, config.responseBodyLimit, readUntil);
  let answer: Response;
  let stored: StoredResponse;
  let bodyBytes: number;
  if ("bytes" in answerBody) {
    bodyBytes = answerBody.bytes.length;
    stored = await fit(config, storedOf(response.status, response.headers, config.kept, answerBody.bytes), bodyBytes);
    answer = new Response(NULL_BODY.has(response.status) ? null : answerBody.bytes as Uint8Array<ArrayBuffer>, {
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
  const journaled = await journal(config, held, stored, bodyBytes);
  logKept(config, journaled.settled, event);
  // Not journaled (the lease moved on, or the journal failed): the handler's
  // own answer, as nothing replays it.
  if (journaled.settled.ending !== "journaled") return answer;
  return firstAnswer(journaled.stored, response.headers);
}

/** Releases a claim whose handler threw `NothingHappened`. */
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
async function journal(
  config: Config,
  held: Held,
  stored: StoredResponse,
  bodyBytes: number,
): Promise<{ settled: Settled; stored: StoredResponse }> {
  const exact = await held.journalExact(success(stored));
  if (!("refused" in exact)) return { settled: exact, stored };
  config.log({
    event: "idempotency.http_answer_refused",
    level: "warn",
    scope: held.claim.scope,
    error: exact.refused.message,
    why: "the store refused the answer; journaling it without its body",
  });
  const bodiless = withoutBody(stored, bodyBytes);
  return { settled: await held.settle({ journal: success(bodiless) }), stored: bodiless };
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
