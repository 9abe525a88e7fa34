// The HTTP client: calls `POST <PostgREST>/rpc/<function>` on schema `agent`
// and turns every answer into a value or a typed PlaneError. It retries what
// the shared retry-safety table (rpc_policy.json, read by the Rust crate too)
// allows, with jittered backoff, within one deadline per operation.

import policy from "./rpc_policy.json" with { type: "json" };
import { monotonicNow } from "./clock.ts";
import { PlaneError, type TransportFailure } from "./errors.ts";
import { authHeaders, keyKind } from "./service_key.ts";
import { globalTelemetry, METRICS, Telemetry, type TelemetryApi } from "./telemetry.ts";

/** How the client retries what `PlaneError.isRetryable` allows. */
export interface RetryConfig {
  /** Retries after the first attempt; 0 disables them. */
  maxRetries: number;
  initialBackoffMs: number;
  /** Ceiling of one backoff, and of a server's Retry-After. */
  maxBackoffMs: number;
  /** No retry starts once this much time passed since the first attempt. */
  maxElapsedMs: number;
}

/** The defaults every client of the plane shares (rpc_policy.json). */
export const DEFAULT_RETRY: Readonly<RetryConfig> = Object.freeze({
  maxRetries: policy.retry.max_retries,
  initialBackoffMs: policy.retry.initial_backoff_ms,
  maxBackoffMs: policy.retry.max_backoff_ms,
  maxElapsedMs: policy.retry.max_elapsed_ms,
});

/** One operation's deadline: every attempt, backoff and retry together. */
export const DEFAULT_DEADLINE_MS: number = policy.deadline_ms;

/** The schema the plane's functions live in. */
export const PLANE_SCHEMA = "agent";

const functions: Record<string, string> = policy.functions;

/** Whether `fn` may be sent again after its answer was lost (rpc_policy.json); unlisted: no. */
export function repeatSafe(fn: string): boolean {
  return functions[fn] === "safe";
}

/** What one attempt got back, before decoding. */
export interface Sent {
  status: number;
  /** The parsed JSON body of a success. */
  data?: unknown;
  /** PostgREST's error body (`{code, message, details, hint}`), when it sent one. */
  error?: { code?: string; message?: string; details?: string | null; hint?: string | null };
  retryAfterMs?: number;
}

/** How an attempt reaches the server. `signal` aborts it at the deadline. */
export interface Transport {
  send(fn: string, args: Record<string, unknown>, signal: AbortSignal): Promise<Sent>;
}

/** The shape of a supabase-js client this module uses: `.schema(name).rpc(fn, args)`. */
export interface SupabaseLike {
  schema(name: string): {
    rpc(fn: string, args?: Record<string, unknown>): {
      abortSignal(signal: AbortSignal): PromiseLike<SupabaseAnswer>;
    };
  };
}

interface SupabaseAnswer {
  data: unknown;
  error: { code?: string; message?: string; details?: string | null; hint?: string | null } | null;
  status: number;
}

/** Options of a client over a URL and key. */
export interface ConnectOptions {
  /** PostgREST's root (`http://host:3000`) or Supabase's `https://<ref>.supabase.co/rest/v1`. */
  url: string;
  /** The service key: a `service_role` JWT or an `sb_secret_…` key. Never logged. */
  key: string;
  /** Another fetch (tests, proxies). Default: the global one. */
  fetch?: typeof fetch;
  /** Default `agent`. */
  schema?: string;
  /**
   * Hosts that may be reached over plain `http://` besides loopback
   * (`localhost`, `127.0.0.0/8`, `[::1]`), named exactly: for a PostgREST on a
   * private network (`kong` under `supabase functions serve`, say). Any
   * other `http://` URL is refused: the service key travels in every request.
   * `fromEnv` reads them from `IDEM_ALLOW_PLAIN_HTTP` (comma-separated).
   */
  allowPlainHttpTo?: readonly string[];
}

/** Options every client takes. */
export interface ClientOptions {
  retry?: Partial<RetryConfig>;
  /** One operation's deadline. Default 25 s (rpc_policy.json). */
  deadlineMs?: number;
  /**
   * The OpenTelemetry API spans and metrics go through: the
   * `@opentelemetry/api` module (`import * as api from
   * "@opentelemetry/api"`), for an application whose copy of the API
   * registers nothing globally; `false` for none. Default: the API an SDK
   * (or Deno's built-in OpenTelemetry, `OTEL_DENO=true`) registered
   * globally, when one did; nothing otherwise.
   */
  telemetry?: TelemetryApi | false;
}

/** A fetch-based transport: no dependency, Web APIs only. */
export class FetchTransport implements Transport {
  readonly #base: string;
  readonly #headers: Record<string, string>;
  readonly #fetch: typeof fetch;
  readonly #readJson: (text: string) => unknown;

  /**
   * Over `options`. `readJson` reads a success's body (default
   * `JSON.parse`): the queues' transport keeps what JSON.parse cannot read
   * faithfully (see `Queues.connect`).
   */
  constructor(options: ConnectOptions, readJson: (text: string) => unknown = JSON.parse) {
    this.#readJson = readJson;
    let base: URL;
    try {
      base = new URL(options.url);
    } catch {
      const shown = options.url.includes("@") ? "(a URL with credentials)" : JSON.stringify(options.url);
      throw PlaneError.invalid("bad_configuration", `the plane's URL ${shown} is not a URL`);
    }
    checkPlaneUrl(base, options.allowPlainHttpTo ?? []);
    if (!options.key || /[\r\n]/.test(options.key)) {
      throw PlaneError.invalid("bad_configuration", "the service key is empty or cannot be a header");
    }
    if (keyKind(options.key) === "publishable") {
      throw PlaneError.invalid(
        "bad_configuration",
        "the service key is a publishable key (sb_publishable_…), which reaches only the anon role",
      );
    }
    const schema = options.schema ?? PLANE_SCHEMA;
    this.#base = base.href.replace(/\/+$/, "");
    this.#headers = {
      ...authHeaders(options.key),
      "Content-Type": "application/json",
      "Accept": "application/json",
      "Content-Profile": schema,
      "Accept-Profile": schema,
    };
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  async send(fn: string, args: Record<string, unknown>, signal: AbortSignal): Promise<Sent> {
    let response: Response;
    try {
      response = await this.#fetch(`${this.#base}/rpc/${fn}`, {
        method: "POST",
        headers: this.#headers,
        body: JSON.stringify(args),
        signal,
        redirect: "manual",
      });
    } catch (cause) {
      throw transportError(fn, cause, signal);
    }
    let text: string;
    try {
      text = await response.text();
    } catch (cause) {
      throw transportError(fn, cause, signal);
    }
    const retryAfterMs = retryAfter(response.headers.get("retry-after"));
    if (response.status >= 200 && response.status < 300) {
      try {
        return { status: response.status, data: text === "" ? null : this.#readJson(text) };
      } catch {
        throw new PlaneError("decode", `${fn} answered ${response.status} with a body that is not JSON`, {
          fn,
          status: response.status,
        });
      }
    }
    return { status: response.status, error: parseErrorBody(text), retryAfterMs };
  }
}

/** A transport over a supabase-js client (its own fetch, auth and headers). */
export class SupabaseTransport implements Transport {
  readonly #client: SupabaseLike;
  readonly #schema: string;

  /**
   * Over `client`. Its URL, when it shows one (supabase-js keeps it as
   * `supabaseUrl`), is held to the same rule as a `{ url, key }` plane's
   * (`checkPlaneUrl`): plain `http://` to loopback or to a host in
   * `allowPlainHttpTo` only.
   */
  constructor(client: SupabaseLike, schema = PLANE_SCHEMA, allowPlainHttpTo: readonly string[] = []) {
    const shown = (client as { supabaseUrl?: unknown }).supabaseUrl;
    if (typeof shown === "string" || shown instanceof URL) {
      let url: URL;
      try {
        url = new URL(shown);
      } catch {
        throw PlaneError.invalid("bad_configuration", "the supabase-js client's URL is not a URL");
      }
      checkPlaneUrl(url, allowPlainHttpTo);
    }
    this.#client = client;
    this.#schema = schema;
  }

  async send(fn: string, args: Record<string, unknown>, signal: AbortSignal): Promise<Sent> {
    let answer: SupabaseAnswer;
    try {
      answer = await this.#client.schema(this.#schema).rpc(fn, args).abortSignal(signal);
    } catch (cause) {
      throw transportError(fn, cause, signal);
    }
    // postgrest-js answers a failed fetch as status 0 with the fetch's
    // message, rather than throwing: the request may or may not have left.
    if (!answer.status) {
      // Its details carry the cause (ECONNREFUSED on Node), which tells a
      // refused connection from one that may have sent the call.
      const why = [answer.error?.message, answer.error?.details].filter(Boolean).join(": ");
      throw transportError(fn, new Error(why || "no answer"), signal);
    }
    if (answer.error) return { status: answer.status, error: answer.error };
    return { status: answer.status, data: answer.data };
  }
}

/** The client: calls the plane's functions with retries and a deadline. */
export class PlaneClient {
  readonly #transport: Transport;
  readonly retry: Readonly<RetryConfig>;
  readonly deadlineMs: number;
  /** Where this client's spans and metrics go (see `ClientOptions.telemetry`). */
  readonly telemetry: Telemetry;
  #requests = 0;

  constructor(transport: Transport, options: ClientOptions = {}) {
    this.#transport = transport;
    this.telemetry = options.telemetry === undefined ? globalTelemetry : new Telemetry(options.telemetry);
    this.retry = Object.freeze({ ...DEFAULT_RETRY, ...options.retry });
    this.deadlineMs = options.deadlineMs ?? DEFAULT_DEADLINE_MS;
    if (!(this.deadlineMs > 0)) throw PlaneError.invalid("bad_configuration", "the deadline must be above zero");
  }

  /** HTTP requests sent, retries included. */
  get requestsSent(): number {
    return this.#requests;
  }

  /**
   * Calls `fn` with named arguments and answers its decoded JSON. Retries
   * what the shared table and `PlaneError.isRetryable` allow; stops at the
   * deadline with a `deadline` error, and never starts a retry that could
   * not finish before it. The deadline is measured on a monotonic clock, so
   * a wall-clock step neither stretches nor cuts it.
   */
  async rpc(fn: string, args: Record<string, unknown>, options: { deadlineMs?: number } = {}): Promise<unknown> {
    const started = monotonicNow();
    try {
      return await this.#rpc(fn, args, options);
    } catch (error) {
      this.telemetry.count(METRICS.rpcErrors, {
        function: fn,
        kind: error instanceof PlaneError ? error.kind : "unexpected",
      });
      throw error;
    } finally {
      this.telemetry.record(METRICS.rpcDuration, (monotonicNow() - started) / 1000, { function: fn });
    }
  }

  async #rpc(fn: string, args: Record<string, unknown>, options: { deadlineMs?: number }): Promise<unknown> {
    const safe = repeatSafe(fn);
    const deadlineMs = options.deadlineMs ?? this.deadlineMs;
    const started = monotonicNow();
    const deadline = started + deadlineMs;
    let retries = 0;
    let last: PlaneError | undefined;
    for (;;) {
      const remaining = deadline - monotonicNow();
      if (remaining <= 0) {
        throw cutAt(fn, deadlineMs, retries + 1, false, last);
      }
      const attemptStarted = monotonicNow();
      const controller = new AbortController();
      const timer = setTimeout(() => controller.abort(new DeadlineReached()), remaining);
      let error: PlaneError;
      try {
        this.#requests += 1;
        const sent = await this.#transport.send(fn, args, controller.signal);
        if (sent.status >= 200 && sent.status < 300) return sent.data;
        error = apiError(fn, sent);
      } catch (cause) {
        if (controller.signal.aborted && controller.signal.reason instanceof DeadlineReached) {
          throw cutAt(fn, deadlineMs, retries + 1, true, last);
        }
        error = cause instanceof PlaneError ? cause : transportError(fn, cause, controller.signal);
      } finally {
        clearTimeout(timer);
      }
      last = error;
      const elapsed = monotonicNow() - started;
      if (!error.isRetryable(safe) || retries >= this.retry.maxRetries || elapsed >= this.retry.maxElapsedMs) {
        throw error;
      }
      const wait = backoff(this.retry, retries + 1, error.retryAfterMs);
      // The failed attempt's duration, plus the backoff, estimates what a
      // retry needs: one that could not finish before the deadline is not
      // started (and the error says what the last attempt found).
      const estimate = monotonicNow() - attemptStarted;
      if (monotonicNow() + wait + estimate >= deadline) throw cutAt(fn, deadlineMs, retries + 1, false, error);
      await sleep(wait);
      retries += 1;
    }
  }
}

class DeadlineReached extends Error {}

/** Uniform between half and all of an exponential ceiling, never below Retry-After (capped). */
function backoff(retry: RetryConfig, n: number, retryAfterMs?: number): number {
  const ceiling = Math.min(retry.initialBackoffMs * 2 ** Math.min(n - 1, 16), retry.maxBackoffMs);
  const jittered = ceiling * (0.5 + 0.5 * Math.random());
  return Math.max(jittered, Math.min(retryAfterMs ?? 0, retry.maxBackoffMs));
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, Math.max(0, ms)));
}

function cutAt(fn: string, deadlineMs: number, attempts: number, inFlight: boolean, last?: PlaneError): PlaneError {
  const what = inFlight ? "a request was still in flight" : "no retry could finish before it";
  return new PlaneError(
    "deadline",
    `${fn}: the ${deadlineMs} ms deadline passed after ${attempts} attempt(s); ${what}`,
    {
      fn,
      inFlight,
      lastError: last,
    },
  );
}

function apiError(fn: string, sent: Sent): PlaneError {
  const body = sent.error ?? {};
  const code = typeof body.code === "string" ? body.code : "";
  const message = typeof body.message === "string" ? body.message : `HTTP ${sent.status}`;
  const kind = code === "IDEM1" ? "unknown_scope" : "api";
  return new PlaneError(kind, `${fn} failed (HTTP ${sent.status}${code ? ` ${code}` : ""}): ${message}`, {
    fn,
    status: sent.status,
    code,
    details: body.details ?? null,
    hint: body.hint ?? null,
    retryAfterMs: sent.retryAfterMs,
  });
}

function parseErrorBody(text: string): Sent["error"] {
  try {
    const body = JSON.parse(text);
    if (body && typeof body === "object" && !Array.isArray(body)) return body;
  } catch {
    // A gateway's HTML or an empty body: no PostgREST code.
  }
  return { message: text.slice(0, 200) };
}

function retryAfter(value: string | null): number | undefined {
  if (value === null || !/^\d+$/.test(value.trim())) return undefined;
  return Number(value.trim()) * 1000;
}

/** A failed fetch, classified: refused connections never left. */
/**
 * Refuses a plane URL the service key must not be sent to: not http(s),
 * carrying credentials (fetch refuses them, and its errors would print
 * them), or plain `http://` to a host that is neither loopback nor named in
 * `allowPlainHttpTo`. Messages never carry a password.
 */
export function checkPlaneUrl(url: URL, allowPlainHttpTo: readonly string[]): void {
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw PlaneError.invalid("bad_configuration", `the plane's URL must be http(s), got ${url.protocol}`);
  }
  if (url.username !== "" || url.password !== "") {
    const shown = new URL(url.href);
    shown.username = "";
    shown.password = "";
    throw PlaneError.invalid(
      "bad_configuration",
      `the plane's URL ${shown.href} carries credentials (user:password@): the service key is the only one the plane takes; remove them`,
    );
  }
  if (url.protocol === "http:" && !plainHttpAllowed(url.hostname, allowPlainHttpTo)) {
    throw PlaneError.invalid(
      "bad_configuration",
      `the plane's URL ${url.href}: plain http:// to ${url.hostname} would send the service key unencrypted; ` +
        `use https://, or name the host to allow it (allowPlainHttpTo: ["${url.hostname}"], or ` +
        `IDEM_ALLOW_PLAIN_HTTP=${url.hostname}); loopback hosts are always allowed`,
    );
  }
}

/** Loopback (`localhost`, `127.0.0.0/8`, `[::1]`), or a host named in `allowed`. */
function plainHttpAllowed(hostname: string, allowed: readonly string[]): boolean {
  const host = hostname.toLowerCase();
  const loopback = host === "localhost" || host === "[::1]" || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host);
  return loopback || allowed.some((name) => name !== "" && name.toLowerCase() === host);
}

function transportError(fn: string, cause: unknown, signal: AbortSignal): PlaneError {
  const text = describe(cause);
  let transport: TransportFailure = "interrupted";
  if (/ECONNREFUSED|Connection refused|ConnectionRefused|connection refused/i.test(text)) transport = "connect";
  else if (signal.aborted || /timed? ?out|TimeoutError|AbortError/i.test(text)) transport = "timeout";
  return new PlaneError("transport", `${fn}: no answer (${transport}): ${text}`, { fn, transport, cause });
}

function describe(cause: unknown): string {
  const parts: string[] = [];
  let current: unknown = cause;
  for (let depth = 0; current !== undefined && current !== null && depth < 4; depth++) {
    if (current instanceof Error) {
      parts.push(`${current.name}: ${current.message}`);
      const code = (current as { code?: unknown }).code;
      if (typeof code === "string") parts.push(code);
      current = current.cause;
    } else {
      parts.push(String(current));
      break;
    }
  }
  return parts.join(" <- ");
}
