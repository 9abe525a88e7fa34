// The plane's four operations — claim, complete, release, read — over the SQL
// surface, with the spec's semantics. Every decision (who holds a key, whether
// a lease is live, retention, size limits) is the database's, made in one SQL
// statement by its own clock; this module checks input, mints lease tokens and
// reads the answers, exactly as the Rust crate's `IdempotencyService` does.

import {
  type ClientOptions,
  type ConnectOptions,
  FetchTransport,
  PlaneClient,
  type SupabaseLike,
  SupabaseTransport,
} from "./client.ts";
import { PlaneError } from "./errors.ts";
import { SERVICE_KEY_VARIABLES, serviceKeyFromEnv } from "./service_key.ts";
import { isRequestHash } from "./hash.ts";
import {
  type Answer,
  answerFromStored,
  jsonSize,
  referenceTo,
  resourceProblem,
  type ResourceRef,
  responseRefOf,
  unstorable,
} from "./answer.ts";
import { METRICS, type SpanScope, type Telemetry } from "./telemetry.ts";

/** Longest key the table accepts, in characters. */
export const MAX_KEY_CHARS = 512;
/** Longest scope, in characters (`a-z 0-9 . _ -`). */
export const MAX_SCOPE_CHARS = 128;
/** Shortest lease the store accepts. */
export const MIN_LEASE_MS = 1_000;
/** Longest lease the store accepts. */
export const MAX_LEASE_MS = 24 * 60 * 60 * 1_000;
/** The store limit a scope's policy sets unless told otherwise (65536 bytes). */
export const DEFAULT_RESPONSE_LIMIT_BYTES = 64 * 1024;

/**
 * The row cap bounded calls are held to unless told otherwise: PostgREST's
 * `db-max-rows` as Supabase sets it by default (`api.max_rows`, 1000).
 */
export const DEFAULT_MAX_ROWS = 1000;

/** A claim this caller holds: the fence every ending is checked against. */
export interface Claim {
  readonly id: string;
  readonly organizationId: string;
  readonly scope: string;
  readonly key: string;
  /** The caller's own secret: proves the claim is still theirs. */
  readonly leaseToken: string;
  /** By the database clock. */
  readonly leaseExpiresAt: string;
  /** Taken over from a worker whose lease had passed. */
  readonly reclaimed: boolean;
  /**
   * The W3C traceparent of the worker that first claimed the key with its
   * work, when it sent one (it does while an OpenTelemetry API is present):
   * the span that runs work handed out again links to it.
   */
  readonly traceparent?: string;
}

/** What a claim decided: exactly one of five endings. */
export type ClaimOutcome =
  /** The key is ours: run the effect, then complete or release. */
  | { outcome: "claimed"; claim: Claim }
  /** The key is ours, taken over from a worker whose lease passed: the effect may have run. */
  | { outcome: "reclaimed"; claim: Claim }
  /** The effect already happened: return this answer, do not run it. */
  | { outcome: "completed"; answer: Answer }
  /** Another worker holds a live lease: answer "in progress", retry later. */
  | { outcome: "processing"; leaseExpiresAt: string }
  /** The key was used with another request: refuse. */
  | { outcome: "conflict" };

/** What a re-drive took over: work handed to this caller, or a dead letter it journaled. */
export type Redriven =
  /**
   * The work is this caller's now: run `request`, then complete or release
   * `claim` (whose `traceparent` is the trace that first claimed it).
   */
  | { outcome: "redriven"; claim: Claim; request: unknown; attempt: number }
  /** The work had been handed out `max_attempts` times: journaled as a failure, replayed to every later claim. */
  | {
    outcome: "dead_lettered";
    id: string;
    organizationId: string;
    scope: string;
    key: string;
    attempts: number;
    answer: Answer;
  };

/** What the journal holds for a key, read without writing. */
export type ReadOutcome =
  /** No answer: no row, or a processing row whose lease has passed. */
  | { outcome: "absent" }
  | { outcome: "completed"; answer: Answer }
  | { outcome: "processing"; leaseExpiresAt: string }
  | { outcome: "conflict" };

/** How an ending landed. */
export type Ending =
  /** Written under our fence. */
  | "recorded"
  /** The fence moved on (our lease passed and someone reclaimed, or the row is gone): nothing written. */
  | "lease_moved_on";

/** What a completion stores: a response, a resource, or both. */
export interface Completion {
  response?: unknown;
  resource?: ResourceRef;
}

/** Options of one call. */
export interface CallOptions {
  /** This call's deadline instead of the client's (every attempt and retry together). */
  deadlineMs?: number;
}

/** Options of a plane. */
export interface PlaneOptions extends ClientOptions {
  /** The scope policies' store limit this client journals within. Default 65536 bytes. */
  responseLimitBytes?: number;
  /** The server's row cap (`db-max-rows`, Supabase `api.max_rows`); a larger bound is refused. Default 1000. */
  maxRows?: number;
  /**
   * For a supabase-js client: hosts its URL may name over plain `http://`
   * besides loopback (a `{ url, key }` source names them itself).
   */
  allowPlainHttpTo?: readonly string[];
}

/** What `IdempotencyPlane.connect` takes: a supabase-js client, or a URL and key. */
export type PlaneSource = SupabaseLike | ConnectOptions;

/** The idempotency plane, over one PostgREST (or Supabase) project. */
export class IdempotencyPlane {
  readonly client: PlaneClient;
  readonly responseLimitBytes: number;
  readonly maxRows: number;

  constructor(client: PlaneClient, options: { responseLimitBytes?: number; maxRows?: number } = {}) {
    this.client = client;
    this.responseLimitBytes = options.responseLimitBytes ?? DEFAULT_RESPONSE_LIMIT_BYTES;
    const maxRows = options.maxRows ?? DEFAULT_MAX_ROWS;
    if (!Number.isInteger(maxRows) || maxRows < 1 || maxRows > 100_000) {
      throw PlaneError.invalid("bad_configuration", `maxRows must be an integer from 1 to 100000, got ${maxRows}`);
    }
    this.maxRows = maxRows;
  }

  /** Where this plane's spans and metrics go (its client's; see `ClientOptions.telemetry`). */
  get telemetry(): Telemetry {
    return this.client.telemetry;
  }

  /**
   * A plane over a supabase-js client (`createClient(SUPABASE_URL, key)`;
   * the plane calls `.schema('agent')` itself) or over `{ url, key }`, where
   * `url` is PostgREST's root or Supabase's `…/rest/v1`.
   */
  static connect(source: PlaneSource, options: PlaneOptions = {}): IdempotencyPlane {
    const transport = "schema" in source && typeof source.schema === "function"
      ? new SupabaseTransport(source as SupabaseLike, undefined, options.allowPlainHttpTo)
      : new FetchTransport(source as ConnectOptions);
    return new IdempotencyPlane(new PlaneClient(transport, options), options);
  }

  /**
   * A plane from the environment a deployed Edge Function has: `SUPABASE_URL`
   * (`/rest/v1` is added) and the first key set of `IDEM_SERVICE_KEY`,
   * `SUPABASE_SECRET_KEYS` (its `default` entry, or the one
   * `IDEM_SECRET_KEY_NAME` names), `SUPABASE_SECRET_KEY`,
   * `SUPABASE_SERVICE_ROLE_KEY` (`serviceKeyFromEnv`). `IDEM_POSTGREST_URL`,
   * when set, is used as the PostgREST root instead. Plain `http://` reaches
   * loopback only, and the hosts `IDEM_ALLOW_PLAIN_HTTP` names
   * (comma-separated): under `supabase functions serve`, whose
   * `SUPABASE_URL` is `http://kong:8000`, set `IDEM_ALLOW_PLAIN_HTTP=kong`.
   * `IDEM_MAX_ROWS` is the server's row cap (default 1000).
   */
  static fromEnv(env: (name: string) => string | undefined, options: PlaneOptions = {}): IdempotencyPlane {
    const rest = env("IDEM_POSTGREST_URL");
    const project = env("SUPABASE_URL");
    const url = rest || (project ? `${project.replace(/\/+$/, "")}/rest/v1` : "");
    const key = serviceKeyFromEnv(env)?.key;
    const allowPlainHttpTo = (env("IDEM_ALLOW_PLAIN_HTTP") ?? "").split(",").map((host) => host.trim())
      .filter((host) => host !== "");
    if (!url) throw PlaneError.invalid("bad_configuration", "set SUPABASE_URL (or IDEM_POSTGREST_URL)");
    if (!key) {
      throw PlaneError.invalid(
        "bad_configuration",
        `set one of ${SERVICE_KEY_VARIABLES.join(" / ")}: the plane takes the service role only`,
      );
    }
    const rows = env("IDEM_MAX_ROWS");
    const maxRows = options.maxRows ?? (rows ? Number(rows) : undefined);
    return IdempotencyPlane.connect({ url, key, allowPlainHttpTo }, { ...options, maxRows });
  }

  /**
   * Claims `key` in `scope` for this request, by the database's decision in
   * one statement. `leaseToken` defaults to a fresh one; pass the same token
   * again after an answer was lost (a timeout, a reset, a 503): the repeat
   * answers this caller's own row (`claimed`, or `completed` once it
   * completed) rather than `processing`. The client already does so for the
   * retries it makes itself.
   *
   * `work`, when given, is the work the claim carries (any JSON value): stored
   * by the same statement, so that if this worker dies another can `redrive`
   * it. At most the scope's `max_request_bytes` as compact JSON (refused with
   * code `IDEM5` above it, `IDEM6` deeper than 64 levels; nothing written).
   * No claim, replay or read ever answers it.
   */
  async claim(request: {
    organizationId: string;
    scope: string;
    key: string;
    requestHash: string;
    leaseMs: number;
    leaseToken?: string;
    work?: unknown;
  }, call: CallOptions = {}): Promise<ClaimOutcome> {
    request = { ...request, organizationId: checkOrganization(request.organizationId) };
    checkScope(request.scope);
    checkKey(request.key);
    checkHash(request.requestHash);
    checkLease(request.leaseMs);
    if (request.leaseToken !== undefined && !UUID.test(request.leaseToken)) {
      throw PlaneError.invalid("bad_configuration", "a lease token must be a UUID (one this client minted)");
    }
    const leaseToken = request.leaseToken?.toLowerCase() ?? crypto.randomUUID();
    const carries = request.work !== undefined && request.work !== null;
    return await this.telemetry.span("idempotency.claim", { scope: request.scope, key: request.key }, async (span) => {
      // The claim's trace goes with its work, for whoever is handed the work again.
      const traceparent = carries ? span.traceparent : undefined;
      const data = await this.client.rpc("idempotency_claim", {
        p_organization_id: request.organizationId,
        p_scope: request.scope,
        p_key: request.key,
        p_request_hash: request.requestHash,
        p_lease_token: leaseToken,
        p_lease_ms: Math.ceil(request.leaseMs),
        // Omitted when absent, never sent as null (see `complete`).
        ...(carries ? { p_request: request.work } : {}),
        ...(traceparent === undefined ? {} : { p_traceparent: traceparent }),
      }, call);
      const outcome = outcomeOf("idempotency_claim", oneRow("idempotency_claim", data), request, leaseToken);
      this.#claimed(span, request.scope, outcome);
      return outcome;
    });
  }

  /** Records what a claim answered on its span and in `idempotency_outcomes_total`. */
  #claimed(span: SpanScope | undefined, scope: string, outcome: ClaimOutcome): void {
    const shown = outcomeName(outcome.outcome);
    span?.set({
      "idempotency.outcome": shown,
      "idempotency.replayed": outcome.outcome === "completed",
      "idempotency.reclaimed": outcome.outcome === "reclaimed",
      "idempotency.attempt": outcome.outcome === "claimed" ? 1 : undefined,
    });
    this.telemetry.count(METRICS.outcomes, { operation: "claim", scope, outcome: metricOutcome(outcome.outcome) });
    if (outcome.outcome === "processing") this.telemetry.count(METRICS.waits, { operation: "claim", scope });
  }

  /** Records an ending on its span and in `idempotency_endings_total`. */
  #ended(span: SpanScope | undefined, operation: string, scope: string, ending: Ending): void {
    span?.set({ "idempotency.ending": ending });
    this.telemetry.count(METRICS.endings, { operation, scope, ending });
  }

  /**
   * Journals the effect's answer under the claim's fence. A response above
   * the store limit is stored by reference to `resource` (refused without
   * one). Safe to repeat with the same claim after a lost answer.
   */
  async complete(claim: Claim, completion: Completion, call: CallOptions = {}): Promise<Ending> {
    return await this.telemetry.span(
      "idempotency.complete",
      { scope: claim.scope, key: claim.key },
      async (span) => {
        const ending = await this.#complete(claim, completion, call);
        this.#ended(span, "complete", claim.scope, ending);
        return ending;
      },
    );
  }

  async #complete(claim: Claim, completion: Completion, call: CallOptions): Promise<Ending> {
    const stored = await this.#stored(completion);
    // The organization addresses the claim with its id: on a claim table
    // partitioned by organization the database goes straight to it.
    const args: Record<string, unknown> = {
      p_claim_id: claim.id,
      p_lease_token: claim.leaseToken,
      p_organization_id: claim.organizationId,
    };
    // Absent values are left out, never sent as null (PostgREST-compatible
    // servers differ on null; every one reads a missing argument as its DEFAULT).
    if (stored.resource) {
      args.p_resource_type = stored.resource.resourceType;
      args.p_resource_id = stored.resource.resourceId;
    }
    if (stored.response !== undefined) args.p_response = stored.response;
    const data = await this.client.rpc("idempotency_complete", args, call);
    const rows = rowsOf("idempotency_complete", data);
    return rows.length === 0 ? "lease_moved_on" : completedEnding("idempotency_complete", rows[0], claim);
  }

  /**
   * What a completion stores, checked as the plane would check it: a
   * response above the store limit by reference to its resource (refused
   * without one).
   */
  async #stored(completion: Completion): Promise<{ response?: unknown; resource?: ResourceRef }> {
    const response = completion.response === null ? undefined : completion.response;
    if (response === undefined && completion.resource === undefined) {
      throw PlaneError.invalid("empty_completion", "a completion must carry a response or a resource");
    }
    if (completion.resource) {
      const problem = resourceProblem(completion.resource);
      if (problem) {
        throw PlaneError.invalid(
          completion.resource.resourceType && completion.resource.resourceId ? "resource_too_long" : "empty_resource",
          problem,
        );
      }
    }
    let stored = response;
    if (response !== undefined) {
      if (responseRefOf(response)) {
        throw PlaneError.invalid(
          "reserved_response_shape",
          'a response may not be an object whose only key is "$response_ref"',
        );
      }
      const problem = unstorable(response, 0, Number.MAX_SAFE_INTEGER);
      if (problem) {
        throw PlaneError.invalid(
          "unstorable_response",
          `the response cannot be stored (${problem.reason}): PostgreSQL cannot hold U+0000 or a lone UTF-16 surrogate, and a replay cannot read back more than 64 levels of nesting`,
        );
      }
      const size = jsonSize(response);
      if (size > this.responseLimitBytes) {
        if (!completion.resource) {
          throw PlaneError.invalid(
            "response_too_large",
            `the response is ${size} bytes, above the ${this.responseLimitBytes}-byte store limit, and names no resource to point at`,
          );
        }
        stored = await referenceTo(response, completion.resource);
      }
    }
    return { response: stored, resource: completion.resource };
  }

  /**
   * Gives the claim back: the row is removed and the next attempt runs the
   * effect. Only when no effect happened and no success was answered on the
   * strength of this claim. Not safe to repeat after a lost answer (a repeat
   * answers `lease_moved_on`), so the client retries it only when the server
   * proves it never ran.
   */
  async release(claim: Claim, call: CallOptions = {}): Promise<Ending> {
    return await this.telemetry.span("idempotency.release", { scope: claim.scope, key: claim.key }, async (span) => {
      const data = await this.client.rpc("idempotency_release", {
        p_claim_id: claim.id,
        p_lease_token: claim.leaseToken,
        p_organization_id: claim.organizationId,
      }, call);
      if (typeof data !== "boolean") throw new PlaneError("decode", "idempotency_release answered a non-boolean");
      const ending: Ending = data ? "recorded" : "lease_moved_on";
      this.#ended(span, "release", claim.scope, ending);
      return ending;
    });
  }

  /**
   * Claims a batch in one round trip: every item of one organization and
   * scope, one lease length. Answers, per item in input order, what `claim`
   * would answer for it, the items' claims made one after another: a key
   * repeated in the batch is decided once (its first occurrence claims it,
   * each later one finds it `processing`, `completed` or a `conflict`), so
   * no two items ever hold one claim. Each item gets a fresh lease token
   * unless it brings one (pass the same tokens again after a lost answer:
   * each item then answers its own claim). At most `maxRows` items (refused
   * before any request above it); a malformed item anywhere refuses the
   * whole batch, naming it, and nothing is written. Safe to repeat.
   */
  async claimMany(request: {
    organizationId: string;
    scope: string;
    leaseMs: number;
    items: readonly { key: string; requestHash: string; leaseToken?: string; work?: unknown }[];
  }, call: CallOptions = {}): Promise<ClaimOutcome[]> {
    const organizationId = checkOrganization(request.organizationId);
    checkScope(request.scope);
    checkLease(request.leaseMs);
    this.#checkBatch(request.items.length);
    if (request.items.length === 0) return [];
    const items = request.items.map((item, index) => {
      try {
        checkKey(item.key);
        checkHash(item.requestHash);
      } catch (error) {
        if (error instanceof PlaneError) throw new PlaneError(error.kind, `items[${index}]: ${error.message}`, error);
        throw error;
      }
      if (item.leaseToken !== undefined && !UUID.test(item.leaseToken)) {
        throw PlaneError.invalid("bad_configuration", `items[${index}]: a lease token must be a UUID`);
      }
      return { ...item, leaseToken: item.leaseToken?.toLowerCase() ?? crypto.randomUUID() };
    });
    const start = { scope: request.scope, attributes: { "idempotency.items": items.length } };
    return await this.telemetry.span("idempotency.claim_many", start, async (span) => {
      const traceparent = span.traceparent;
      const data = await this.client.rpc("idempotency_claim_many", {
        p_organization_id: organizationId,
        p_scope: request.scope,
        p_lease_ms: Math.ceil(request.leaseMs),
        p_row_cap: this.maxRows,
        p_items: items.map((item) => {
          const carries = item.work !== undefined && item.work !== null;
          return {
            key: item.key,
            request_hash: item.requestHash,
            lease_token: item.leaseToken,
            ...(carries ? { request: item.work } : {}),
            ...(carries && traceparent !== undefined ? { traceparent } : {}),
          };
        }),
      }, call);
      const rows = batchRows("idempotency_claim_many", data, items.length);
      const outcomes = rows.map((row, index) =>
        outcomeOf(
          "idempotency_claim_many",
          row,
          { organizationId, scope: request.scope, key: items[index].key, requestHash: items[index].requestHash },
          items[index].leaseToken,
        )
      );
      for (const outcome of outcomes) this.#claimed(undefined, request.scope, outcome);
      span.set({
        "idempotency.claimed": outcomes.filter((o) => o.outcome === "claimed" || o.outcome === "reclaimed").length,
        "idempotency.replayed": outcomes.some((o) => o.outcome === "completed"),
      });
      return outcomes;
    });
  }

  /**
   * Journals a batch of answers in one round trip, each under its own
   * claim's fence, all of one organization: per item in input order,
   * `recorded` or `lease_moved_on`, as `complete` would. A completion this
   * client or the plane refuses (too large, unstorable) refuses the whole
   * batch and nothing is written: end that item on its own. Safe to repeat.
   */
  async completeMany(
    items: readonly { claim: Claim; completion: Completion }[],
    call: CallOptions = {},
  ): Promise<Ending[]> {
    this.#checkBatch(items.length);
    if (items.length === 0) return [];
    const organizationId = sameOrganization(items.map((item) => item.claim));
    const start = { scope: items[0].claim.scope, attributes: { "idempotency.items": items.length } };
    return await this.telemetry.span("idempotency.complete_many", start, async () => {
      const endings = await this.#completeMany(items, organizationId, call);
      endings.forEach((ending, index) => this.#ended(undefined, "complete", items[index].claim.scope, ending));
      return endings;
    });
  }

  async #completeMany(
    items: readonly { claim: Claim; completion: Completion }[],
    organizationId: string,
    call: CallOptions,
  ): Promise<Ending[]> {
    const stored = await Promise.all(items.map((item) => this.#stored(item.completion)));
    const data = await this.client.rpc("idempotency_complete_many", {
      p_organization_id: organizationId,
      p_row_cap: this.maxRows,
      p_items: items.map((item, index) => ({
        claim_id: item.claim.id,
        lease_token: item.claim.leaseToken,
        ...(stored[index].resource
          ? {
            resource_type: stored[index].resource?.resourceType,
            resource_id: stored[index].resource?.resourceId,
          }
          : {}),
        ...(stored[index].response === undefined ? {} : { response: stored[index].response }),
      })),
    }, call);
    const rows = batchRows("idempotency_complete_many", data, items.length);
    return rows.map((row, index) =>
      row.completed === true
        ? completedEnding("idempotency_complete_many", row, items[index].claim)
        : row.completed === false
        ? "lease_moved_on"
        : (() => {
          throw new PlaneError("decode", "idempotency_complete_many answered a row without `completed`");
        })()
    );
  }

  /**
   * Gives a batch of claims back in one round trip, all of one
   * organization: per item in input order, `recorded` or `lease_moved_on`,
   * as `release` would. Not safe to repeat after a lost answer, as a single
   * release is not.
   */
  async releaseMany(claims: readonly Claim[], call: CallOptions = {}): Promise<Ending[]> {
    this.#checkBatch(claims.length);
    if (claims.length === 0) return [];
    const organizationId = sameOrganization(claims);
    const start = { scope: claims[0].scope, attributes: { "idempotency.items": claims.length } };
    return await this.telemetry.span("idempotency.release_many", start, async () => {
      const data = await this.client.rpc("idempotency_release_many", {
        p_organization_id: organizationId,
        p_row_cap: this.maxRows,
        p_items: claims.map((claim) => ({ claim_id: claim.id, lease_token: claim.leaseToken })),
      }, call);
      return batchRows("idempotency_release_many", data, claims.length).map((row, index) => {
        if (typeof row.released !== "boolean") {
          throw new PlaneError("decode", "idempotency_release_many answered a row without `released`");
        }
        const ending: Ending = row.released ? "recorded" : "lease_moved_on";
        this.#ended(undefined, "release", claims[index].scope, ending);
        return ending;
      });
    });
  }

  /** Refuses a batch above the server's row cap, before any request. */
  #checkBatch(count: number): void {
    if (count > this.maxRows) {
      throw PlaneError.invalid(
        "bound_above_cap",
        `a batch holds at most ${this.maxRows} items (the server's row cap), not ${count}`,
      );
    }
  }

  /**
   * The heartbeat: moves `claim`'s lease to `leaseMs` from now (database
   * clock) while this caller still holds it, answering the lease's new end;
   * `null` when the fence moved on (completed, released, taken over): stop
   * the effect, someone else owns it. Safe to repeat after a lost answer.
   */
  async extend(claim: Claim, leaseMs: number, call: CallOptions = {}): Promise<string | null> {
    checkLease(leaseMs);
    return await this.telemetry.span("idempotency.extend", { scope: claim.scope, key: claim.key }, async (span) => {
      const data = await this.client.rpc("idempotency_extend", {
        p_claim_id: claim.id,
        p_lease_token: claim.leaseToken,
        p_lease_ms: Math.ceil(leaseMs),
        p_organization_id: claim.organizationId,
      }, call);
      if (data !== null && typeof data !== "string") {
        throw new PlaneError("decode", "idempotency_extend answered neither a time nor null");
      }
      span.set({ "idempotency.extended": data !== null });
      return data;
    });
  }

  /**
   * Takes over, in one call, up to `limit` orphans of `scope` (or a family,
   * `webhook.*`): claims still processing whose lease passed and that carry
   * their work; of one organization when `organizationId` is given.
   * Concurrent callers split them. Each is this caller's now, under a fresh
   * lease token of `leaseMs`, with its work and attempt number; one whose
   * work was handed out the scope's `max_attempts` times comes back
   * journaled as a dead letter instead. `limit` above `maxRows` is refused
   * before any request, and an answer the server cut short is an error.
   * The call carries one fresh lease token per claim it may take over, so
   * the client repeats it after a lost answer and gets the same claims, at
   * the same attempt: nothing taken over is left held by nobody.
   */
  async redrive(
    request: { scope: string; limit: number; leaseMs: number; organizationId?: string },
    call: CallOptions = {},
  ): Promise<Redriven[]> {
    const family = request.scope.endsWith(".*");
    checkScope(family ? request.scope.slice(0, -2) : request.scope);
    checkLease(request.leaseMs);
    if (!Number.isInteger(request.limit) || request.limit < 1 || request.limit > this.maxRows) {
      throw PlaneError.invalid(
        "bound_above_cap",
        `a re-drive takes 1 to ${this.maxRows} claims (the server's row cap), not ${request.limit}`,
      );
    }
    const organizationId = request.organizationId === undefined ? undefined : checkOrganization(request.organizationId);
    const start = { scope: request.scope, attributes: { "idempotency.limit": request.limit } };
    return await this.telemetry.span("idempotency.redrive", start, async (span) => {
      const taken = await this.#redrive(request, organizationId, call);
      for (const work of taken) {
        const scope = work.outcome === "redriven" ? work.claim.scope : work.scope;
        this.telemetry.count(METRICS.redrives, { scope, outcome: work.outcome });
      }
      span.set({
        "idempotency.redriven": taken.filter((work) => work.outcome === "redriven").length,
        "idempotency.dead_lettered": taken.filter((work) => work.outcome === "dead_lettered").length,
      });
      return taken;
    });
  }

  async #redrive(
    request: { scope: string; limit: number; leaseMs: number },
    organizationId: string | undefined,
    call: CallOptions,
  ): Promise<Redriven[]> {
    const tokens = Array.from({ length: request.limit }, () => crypto.randomUUID());
    const data = await this.client.rpc("idempotency_redrive", {
      p_scope: request.scope,
      p_lease_tokens: tokens,
      p_lease_ms: Math.ceil(request.leaseMs),
      p_row_cap: this.maxRows,
      ...(organizationId === undefined ? {} : { p_organization_id: organizationId }),
    }, call);
    if (!Array.isArray(data) || data.some((row) => row === null || typeof row !== "object")) {
      throw new PlaneError("decode", "idempotency_redrive answered something other than a set of rows");
    }
    const rows = data as Row[];
    if (rows.length > request.limit) {
      throw inconsistent(`idempotency_redrive answered ${rows.length} rows for a limit of ${request.limit}`);
    }
    // Every row says how many the call took over: fewer arrived when a row
    // cap cut the answer.
    const cut = rows.find((row) => row.taken !== rows.length);
    if (cut !== undefined) {
      throw new PlaneError(
        "truncated",
        `idempotency_redrive took over ${cut.taken} claims but ${rows.length} arrived: the server's row cap ` +
          `is lower than maxRows (${this.maxRows}) and the plane's: set both to the server's (idem doctor says which); ` +
          `the claims not received are re-driven again when their lease passes`,
        { fn: "idempotency_redrive" },
      );
    }
    return rows.map((row) => redriven(row, organizationId));
  }

  /**
   * Whether any row holds `claim`'s key (its own, or another worker's),
   * without writing anything: how a release whose answer was lost learns
   * whether it landed.
   */
  async rowExists(claim: Claim, call: CallOptions = {}): Promise<boolean> {
    const data = await this.client.rpc("idempotency_get", {
      p_organization_id: claim.organizationId,
      p_scope: claim.scope,
      p_key: claim.key,
    }, call);
    return rowsOf("idempotency_get", data).length > 0;
  }

  /** What the journal holds for this request, without writing anything. */
  async read(
    request: { organizationId: string; scope: string; key: string; requestHash: string },
    call: CallOptions = {},
  ): Promise<ReadOutcome> {
    request = { ...request, organizationId: checkOrganization(request.organizationId) };
    checkScope(request.scope);
    checkKey(request.key);
    checkHash(request.requestHash);
    return await this.telemetry.span("idempotency.read", { scope: request.scope, key: request.key }, async (span) => {
      const outcome = await this.#read(request, call);
      const shown = outcome.outcome === "completed" ? "replayed" : outcome.outcome;
      span.set({ "idempotency.outcome": shown, "idempotency.replayed": outcome.outcome === "completed" });
      this.telemetry.count(METRICS.outcomes, { operation: "read", scope: request.scope, outcome: outcome.outcome });
      if (shown === "processing") this.telemetry.count(METRICS.waits, { operation: "read", scope: request.scope });
      return outcome;
    });
  }

  async #read(
    request: { organizationId: string; scope: string; key: string; requestHash: string },
    call: CallOptions,
  ): Promise<ReadOutcome> {
    const data = await this.client.rpc("idempotency_get", {
      p_organization_id: request.organizationId,
      p_scope: request.scope,
      p_key: request.key,
    }, call);
    const rows = rowsOf("idempotency_get", data);
    if (rows.length === 0) return { outcome: "absent" };
    const row = rows[0];
    if (row.organization_id !== request.organizationId || row.scope !== request.scope || row.key !== request.key) {
      throw inconsistent("idempotency_get answered another row");
    }
    if (row.request_hash !== request.requestHash) return { outcome: "conflict" };
    if (row.status === "completed") return { outcome: "completed", answer: storedAnswer(row) };
    if (row.lease_live === true) {
      return { outcome: "processing", leaseExpiresAt: text(row.lease_expires_at, "lease_expires_at") };
    }
    return { outcome: "absent" };
  }
}

type Row = Record<string, unknown>;

function rowsOf(fn: string, data: unknown): Row[] {
  if (!Array.isArray(data) || data.some((row) => row === null || typeof row !== "object")) {
    throw new PlaneError("decode", `${fn} answered something other than a set of rows`, { fn });
  }
  if (data.length > 1) throw inconsistent(`${fn} answered ${data.length} rows, at most 1 expected`);
  return data as Row[];
}

function oneRow(fn: string, data: unknown): Row {
  const rows = rowsOf(fn, data);
  if (rows.length !== 1) throw inconsistent(`${fn} answered no row, exactly 1 expected`);
  return rows[0];
}

function text(value: unknown, field: string): string {
  if (typeof value !== "string") throw new PlaneError("decode", `the row's ${field} is not a string`);
  return value;
}

function storedAnswer(row: Row): Answer {
  const resource = typeof row.resource_type === "string" && typeof row.resource_id === "string"
    ? { resourceType: row.resource_type, resourceId: row.resource_id }
    : undefined;
  return answerFromStored(row.response, resource);
}

function redriven(row: Row, organizationId: string | undefined): Redriven {
  const id = text(row.id, "id");
  const organization = text(row.organization_id, "organization_id");
  if (organizationId !== undefined && organization !== organizationId) {
    throw inconsistent("idempotency_redrive answered another organization's claim");
  }
  const [scope, key] = [text(row.scope, "scope"), text(row.key, "key")];
  if (typeof row.attempt !== "number") throw new PlaneError("decode", "the row's attempt is not a number");
  if (row.status === "completed") {
    return {
      outcome: "dead_lettered",
      id,
      organizationId: organization,
      scope,
      key,
      attempts: row.attempt,
      answer: answerFromStored(row.response, undefined),
    };
  }
  if (row.status !== "processing" || row.request === null || row.request === undefined) {
    throw inconsistent("idempotency_redrive handed out a claim without its work");
  }
  const claim: Claim = Object.freeze({
    id,
    organizationId: organization,
    scope,
    key,
    leaseToken: text(row.lease_token, "lease_token"),
    leaseExpiresAt: text(row.lease_expires_at, "lease_expires_at"),
    reclaimed: true,
    ...traceparentOf(row),
  });
  return { outcome: "redriven", claim, request: row.request, attempt: row.attempt };
}

/** A row's traceparent, as a Claim holds it: absent when the row has none. */
function traceparentOf(row: Row): { traceparent?: string } {
  return typeof row.traceparent === "string" && row.traceparent !== "" ? { traceparent: row.traceparent } : {};
}

/** A claim's outcome as spans show it: `replayed` for an answer journaled before. */
export function outcomeName(outcome: ClaimOutcome["outcome"]): string {
  return outcome === "completed" ? "replayed" : outcome;
}

/**
 * A claim's outcome as `idempotency_outcomes_total` counts it, with the Rust
 * crate's values: the plane's outcome (`completed` for a replay), a
 * takeover counted as `claimed` (its span says `reclaimed`).
 */
export function metricOutcome(outcome: string): string {
  return outcome === "reclaimed" ? "claimed" : outcome;
}

/** What `row`, the plane's answer to a claim of `request` under `leaseToken`, decided. */
function outcomeOf(
  fn: string,
  row: Row,
  request: { organizationId: string; scope: string; key: string; requestHash: string },
  leaseToken: string,
): ClaimOutcome {
  if (row.organization_id !== request.organizationId || row.scope !== request.scope || row.key !== request.key) {
    throw inconsistent(`${fn} answered another row`);
  }
  switch (row.outcome) {
    case "claimed":
    case "reclaimed": {
      if (row.request_hash !== request.requestHash || row.lease_token !== leaseToken || row.status !== "processing") {
        throw inconsistent(`${fn} answered a claim that is not under this call's hash and token`);
      }
      if (row.lease_live !== true) {
        throw new PlaneError(
          "lease_lapsed",
          `the store answered a claim whose lease had passed at ${row.lease_expires_at}`,
        );
      }
      const claim: Claim = Object.freeze({
        id: text(row.id, "id"),
        organizationId: request.organizationId,
        scope: request.scope,
        key: request.key,
        leaseToken,
        leaseExpiresAt: text(row.lease_expires_at, "lease_expires_at"),
        reclaimed: row.outcome === "reclaimed",
        ...traceparentOf(row),
      });
      return { outcome: row.outcome, claim };
    }
    case "completed":
      if (row.request_hash !== request.requestHash) throw inconsistent("a completed row under another hash");
      return { outcome: "completed", answer: storedAnswer(row) };
    case "processing":
      if (row.request_hash !== request.requestHash) throw inconsistent("a processing row under another hash");
      return { outcome: "processing", leaseExpiresAt: text(row.lease_expires_at, "lease_expires_at") };
    case "conflict":
      if (row.request_hash === request.requestHash) throw inconsistent("a conflict under this call's own hash");
      return { outcome: "conflict" };
    default:
      throw new PlaneError("decode", `${fn} answered an unknown outcome ${JSON.stringify(row.outcome)}`);
  }
}

/** A completion's answer row, checked to be `claim`'s, completed under its token. */
function completedEnding(fn: string, row: Row, claim: Claim): Ending {
  if (row.id !== claim.id || row.lease_token !== claim.leaseToken || row.status !== "completed") {
    throw inconsistent(`${fn}: completing claim ${claim.id} answered another row or state`);
  }
  return "recorded";
}

/**
 * A batch's answer: exactly `count` rows, numbered 0 to `count - 1` in
 * order. Fewer is a server's row cap cutting the answer (`truncated`).
 */
function batchRows(fn: string, data: unknown, count: number): Row[] {
  if (!Array.isArray(data) || data.some((row) => row === null || typeof row !== "object")) {
    throw new PlaneError("decode", `${fn} answered something other than a set of rows`, { fn });
  }
  if (data.length < count) {
    throw new PlaneError(
      "truncated",
      `${fn} answered ${data.length} rows for a batch of ${count}: the server's row cap is lower than maxRows`,
      { fn },
    );
  }
  if (data.length > count) throw inconsistent(`${fn} answered ${data.length} rows for a batch of ${count}`);
  const rows = data as Row[];
  const misplaced = rows.findIndex((row, index) => row.item !== index);
  if (misplaced >= 0) throw inconsistent(`${fn} answered item ${rows[misplaced].item} in place ${misplaced}`);
  return rows;
}

/** The one organization every claim of a batch belongs to. */
function sameOrganization(claims: readonly Claim[]): string {
  const organizationId = claims[0].organizationId;
  if (claims.some((claim) => claim.organizationId !== organizationId)) {
    throw PlaneError.invalid("bad_configuration", "a batch ends the claims of one organization");
  }
  return organizationId;
}

function inconsistent(message: string): PlaneError {
  return new PlaneError("inconsistent", `the store answered inconsistently: ${message}`);
}

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** The organization id as the database prints it (lowercase); refuses what is not a UUID. */
export function checkOrganization(organizationId: string): string {
  if (typeof organizationId !== "string" || !UUID.test(organizationId)) {
    throw PlaneError.invalid("malformed_organization", "the organization id must be a UUID");
  }
  return organizationId.toLowerCase();
}

export function checkScope(scope: string): void {
  if (!scope) throw PlaneError.invalid("empty_scope", "the scope is empty");
  if ([...scope].length > MAX_SCOPE_CHARS) {
    throw PlaneError.invalid("scope_too_long", `the scope has more than ${MAX_SCOPE_CHARS} characters`);
  }
  if (!/^[a-z0-9._-]+$/.test(scope)) {
    throw PlaneError.invalid(
      "malformed_scope",
      `the scope ${JSON.stringify(scope)} may hold only a-z, 0-9, '.', '_' and '-'`,
    );
  }
}

export function checkKey(key: string): void {
  if (!key) throw PlaneError.invalid("empty_key", "the idempotency key is empty");
  const chars = [...key].length;
  if (chars > MAX_KEY_CHARS) {
    throw PlaneError.invalid(
      "key_too_long",
      `the idempotency key has ${chars} characters, at most ${MAX_KEY_CHARS} are accepted`,
    );
  }
  if (key.includes("\0")) throw PlaneError.invalid("key_has_nul", "the idempotency key holds a NUL character");
}

function checkHash(hash: string): void {
  if (!isRequestHash(hash)) {
    throw PlaneError.invalid(
      "malformed_hash",
      `the request hash ${JSON.stringify(hash)} is not a lowercase hex SHA-256`,
    );
  }
}

export function checkLease(leaseMs: number): void {
  if (!(leaseMs >= MIN_LEASE_MS)) {
    throw PlaneError.invalid(
      "lease_too_short",
      `the lease ${leaseMs} ms is shorter than the ${MIN_LEASE_MS} ms the store accepts`,
    );
  }
  if (leaseMs > MAX_LEASE_MS) {
    throw PlaneError.invalid(
      "lease_too_long",
      `the lease ${leaseMs} ms is longer than the ${MAX_LEASE_MS} ms the store accepts`,
    );
  }
}
