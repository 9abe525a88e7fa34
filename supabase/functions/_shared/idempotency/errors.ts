// The plane's errors: one class callers can `instanceof`, with a `kind` to
// switch on and the plane's own codes. Outcomes such as a conflict or a claim
// in flight are values (see plane.ts), never errors.

import policy from "./rpc_policy.json" with { type: "json" };

/** The plane's documented SQLSTATEs and PostgREST codes. */
export const codes = {
  /** The scope has no row in agent.idempotency_scopes (add one by migration). */
  UNKNOWN_SCOPE: "IDEM1",
  /** The answer is above the scope's max_response_bytes; the row stays processing. */
  RESPONSE_TOO_LARGE: "IDEM2",
  /** The answer nests deeper than 64 levels; the row stays processing. */
  RESPONSE_TOO_DEEP: "IDEM3",
  /** A fenced write found the claim's lease token moved on. */
  FENCE_LOST: "IDEM4",
  /** The work a claim carries is above the scope's max_request_bytes; nothing was written. */
  REQUEST_TOO_LARGE: "IDEM5",
  /** The work a claim carries nests deeper than 64 levels; nothing was written. */
  REQUEST_TOO_DEEP: "IDEM6",
  /** An argument the plane refuses (NULL, malformed key, scope or hash). */
  INVALID_PARAMETER_VALUE: "22023",
  /** The role may not call the function. */
  INSUFFICIENT_PRIVILEGE: "42501",
  /** A lock the call waited for was not granted in time; nothing was written. */
  LOCK_NOT_AVAILABLE: "55P03",
  /** PostgREST could not reach the database. */
  PGRST000: "PGRST000",
  /** PostgREST's pool had no connection in time. */
  PGRST001: "PGRST001",
  /** PostgREST's schema cache is loading. */
  PGRST002: "PGRST002",
  /** PostgREST timed out waiting for a connection. */
  PGRST003: "PGRST003",
  /** The schema is not exposed (Content-Profile names one PostgREST does not serve). */
  PGRST106: "PGRST106",
  /** No such function (often: the call went to `public`, not `agent`). */
  PGRST202: "PGRST202",
  /** The JWT was refused. */
  PGRST301: "PGRST301",
} as const;

/** What went wrong, for a `switch`. */
export type PlaneErrorKind =
  /** The caller's input; nothing was sent. See `reason`. */
  | "invalid_input"
  /** The scope has no policy row (IDEM1). */
  | "unknown_scope"
  /** The server answered an error: see `status` and `code`. */
  | "api"
  /** No answer: refused, reset, or timed out. See `transport`. */
  | "transport"
  /** The operation's deadline passed (every attempt and retry together). */
  | "deadline"
  /** The server answered something that is not what the plane answers. */
  | "decode"
  /** The answer contradicts the question (another row, another token). */
  | "inconsistent"
  /**
   * A lease that passed, or may have: a claim answered with a lease already
   * passed, or an effect stopped because its claim was taken over or no
   * heartbeat confirmed its lease in time.
   */
  | "lease_lapsed"
  /** A bounded answer arrived with fewer rows than the server produced (its row cap is lower than `maxRows`). */
  | "truncated";

/** Why a call got no answer. `connect`: it never left (retried for every call). */
export type TransportFailure = "connect" | "timeout" | "interrupted";

/** Why input was refused before any request. */
export type InvalidReason =
  | "empty_key"
  | "key_too_long"
  | "key_has_nul"
  | "empty_scope"
  | "scope_too_long"
  | "malformed_scope"
  | "malformed_hash"
  | "lease_too_short"
  | "lease_too_long"
  | "zero_duration"
  /** A `Timing` margin under `MIN_MARGIN_MS`: a journal leaving in time could land after the lease. */
  | "margin_below_floor"
  | "empty_completion"
  | "response_too_large"
  | "reserved_response_shape"
  | "unstorable_response"
  | "empty_resource"
  | "resource_too_long"
  | "resource_has_nul"
  | "malformed_organization"
  /** A `TenantRouter` has no plane for the organization (no assignment, no default). */
  | "unrouted_organization"
  | "unhashable_request"
  | "lease_outlasts_retries"
  /** A bounded call asked for more rows than the server's row cap (`maxRows`). */
  | "bound_above_cap"
  | "bad_configuration";

interface PlaneErrorFields {
  fn?: string;
  status?: number;
  code?: string;
  details?: string | null;
  hint?: string | null;
  retryAfterMs?: number;
  transport?: TransportFailure;
  reason?: InvalidReason;
  inFlight?: boolean;
  lastError?: PlaneError;
  cause?: unknown;
}

/** Every failure of the plane's client. */
export class PlaneError extends Error {
  override readonly name = "PlaneError";
  readonly kind: PlaneErrorKind;
  /** The SQL function called, when a call was made. */
  readonly fn?: string;
  /** The HTTP status, for `api`. */
  readonly status?: number;
  /** PostgREST's or PostgreSQL's code (`IDEM2`, `22023`, `PGRST202`, …), for `api`. */
  readonly code?: string;
  readonly details?: string | null;
  readonly hint?: string | null;
  /** The server's Retry-After, in milliseconds. */
  readonly retryAfterMs?: number;
  /** For `transport`. */
  readonly transport?: TransportFailure;
  /** For `invalid_input`. */
  readonly reason?: InvalidReason;
  /** For `deadline`: a request was still in flight when it was cut (it may have run). */
  readonly inFlight?: boolean;
  /** For `deadline`: the last failure before it. */
  readonly lastError?: PlaneError;

  constructor(kind: PlaneErrorKind, message: string, fields: PlaneErrorFields = {}) {
    super(message, fields.cause === undefined ? undefined : { cause: fields.cause });
    this.kind = kind;
    this.fn = fields.fn;
    this.status = fields.status;
    this.code = fields.code;
    this.details = fields.details;
    this.hint = fields.hint;
    this.retryAfterMs = fields.retryAfterMs;
    this.transport = fields.transport;
    this.reason = fields.reason;
    this.inFlight = fields.inFlight;
    this.lastError = fields.lastError;
  }

  /** Input refused before any request: nothing was sent. */
  static invalid(reason: InvalidReason, message: string): PlaneError {
    return new PlaneError("invalid_input", message, { reason });
  }

  /**
   * Whether the client retries this failure of a call, given whether the
   * call is safe to repeat after a lost answer (rpc_policy.json). The rules
   * are the Rust client's:
   *
   * | failure | any call | repeat-safe call |
   * |---|---|---|
   * | connection refused / not made | yes | yes |
   * | 503 PGRST000/PGRST002, 504 PGRST003 (never ran) | yes | yes |
   * | 40001 / 40P01 (rolled back) | yes | yes |
   * | other 503, a gateway's 502/503/504, a timeout, a reset | no | yes |
   * | 500 PGRST500 (the server lost its database connection) | no | yes |
   * | the deadline cut a request in flight | no | yes |
   * | a lock timeout (55P03), anything else | no | no |
   */
  isRetryable(repeatSafe: boolean): boolean {
    switch (this.kind) {
      case "deadline":
        if (this.inFlight) return repeatSafe;
        return this.lastError?.isRetryable(repeatSafe) ?? false;
      case "transport":
        return this.transport === "connect" || repeatSafe;
      case "api": {
        const status = this.status ?? 0;
        const code = this.code ?? "";
        if (neverRan(status, code)) return true;
        if (policy.rolled_back.includes(code)) return true;
        if (code === codes.LOCK_NOT_AVAILABLE) return false;
        if (status === 503 || connectionLost(status, code)) return repeatSafe;
        if (code === "" && status >= 502 && status <= 504) return repeatSafe;
        return false;
      }
      default:
        return false;
    }
  }

  /**
   * Whether the plane may be fine on a later try: what an ending retries
   * within its own deadline (a lock timeout included, and a lease that had
   * lapsed before the answer came).
   */
  get isTransient(): boolean {
    return this.kind === "lease_lapsed" || this.code === codes.LOCK_NOT_AVAILABLE || this.isRetryable(true);
  }

  /**
   * Whether the store refused the answer itself (IDEM2, IDEM3, a data or
   * check error): journal a stand-in instead, never retry it as is.
   */
  get isUnstorableAnswer(): boolean {
    if (this.kind === "invalid_input") {
      return [
        "empty_completion",
        "response_too_large",
        "reserved_response_shape",
        "unstorable_response",
        "empty_resource",
        "resource_too_long",
        "resource_has_nul",
      ].includes(this.reason ?? "");
    }
    if (this.kind !== "api") return false;
    const code = this.code ?? "";
    return code === codes.RESPONSE_TOO_LARGE || code === codes.RESPONSE_TOO_DEEP ||
      ["22", "23", "54"].some((cls) => code.startsWith(cls));
  }

  /**
   * Whether the call certainly never reached the plane's database, so nothing
   * it asked for can have been done: the only failure after which a caller
   * may act as if the plane did not exist (the middleware's `failOpen`).
   */
  get neverReachedThePlane(): boolean {
    switch (this.kind) {
      case "transport":
        return this.transport === "connect";
      case "api":
        return neverRan(this.status ?? 0, this.code ?? "");
      case "deadline":
        return !this.inFlight && (this.lastError?.neverReachedThePlane ?? false);
      default:
        return false;
    }
  }

  /**
   * Whether a claim that failed this way may still have been made: anything
   * but a refusal of the input. After one, ask again with the same lease
   * token: a repeat answers the caller's own row.
   */
  get mayHaveWritten(): boolean {
    if (this.kind === "invalid_input" || this.kind === "unknown_scope") return false;
    if (this.kind === "api") return (this.status ?? 0) < 400 || (this.status ?? 0) > 499;
    return true;
  }
}

/** The server lost its database connection, before the call or during it. */
function connectionLost(status: number, code: string): boolean {
  return policy.connection_lost.some((entry) => entry.status === status && entry.code === code);
}

function neverRan(status: number, code: string): boolean {
  return policy.never_ran.some((entry) => entry.status === status && entry.code === code);
}
