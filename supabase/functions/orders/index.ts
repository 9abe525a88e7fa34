// An orders API made idempotent by the Idempotency-Key middleware, as a
// Supabase Edge Function — the HTTP contract of the Rust example
// (examples/orders_api.rs), answer for answer:
//
//   POST /orders            a JSON body; 201 with a new order id, `Location: /orders/<id>`
//   ?delay_ms=N             the handler takes N ms (at most 25 000), to try concurrency by hand
//   Idempotency-Key: k      required: 400 without it or when malformed; a repeat replays the
//                           first answer with `Idempotent-Replayed: true`; 409 (`Retry-After`)
//                           while the first is in flight; 422 for the key with another body
//   x-organization-id       the tenant's UUID (401 when it is not one), or a demo organization
//   x-user-id               the caller whose keys these are (401 when not visible ASCII), or a demo user
//
// Every answer of the middleware's own is application/problem+json (RFC 9457).
//
// The plane comes from the environment, as a deployed Edge Function has it:
// SUPABASE_URL and SUPABASE_SECRET_KEYS (beside the legacy SUPABASE_SERVICE_ROLE_KEY) are set
// by Supabase; IDEM_POSTGREST_URL and IDEM_SERVICE_KEY (what `idem up
// --env-file` writes), when set, are used first. Deployed, callers pin it to
// the database's region (`x-region`; docs/deploying.md), since each claim and
// journal is a round trip to the database. Locally:
//
//   idem up --env-file plane.env &
//   set -a; . ./plane.env; set +a
//   cd supabase/functions && PORT=8080 deno run --allow-net --allow-env orders/index.ts
//   curl -si localhost:8080/orders -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"sku":"A","qty":1}'
//
// Paths. On Supabase (hosted, and `supabase functions serve`) the function is
// called at /functions/v1/orders and the gateway hands it the path without
// the /functions/v1 prefix: the request it sees is /orders (as Supabase's
// routing guide shows, whose handlers match `/<function-name>`). Served by
// itself (`deno run`), it sees the path the client sent. It answers both
// /orders and /functions/v1/orders, and fingerprints the second as the first,
// so a request means one thing whichever way it came.
//
// A real API takes the tenant and the caller from the verified JWT
// (Supabase verifies it before the function runs unless deployed with
// --no-verify-jwt), never from headers a client can set; the headers here
// are the Rust example's, for trying it by hand.

import { IdempotencyPlane } from "../_shared/idempotency/mod.ts";
import { withIdempotencyKey } from "../_shared/idempotency/http.ts";

/** The organization of requests that do not name one (the Rust example's). */
const DEMO_ORGANIZATION = "00000000-0000-4000-8000-000000000001";

/** The longest `?delay_ms` honoured: the middleware cuts a handler off at 30 s. */
const MAX_DELAY_MS = 25_000;

/** Where Supabase's gateway serves functions. */
const FUNCTIONS_PREFIX = "/functions/v1";

const VISIBLE = /^[\t\x20-\x7e]*$/;

/** The tenant: the `x-organization-id` header's UUID (in any form Rust's `Uuid::parse_str` reads), or the demo one. */
function tenant(req: Request): string | undefined {
  const value = req.headers.get("x-organization-id");
  if (value === null) return DEMO_ORGANIZATION;
  if (!VISIBLE.test(value)) return undefined;
  const hex = "[0-9a-fA-F]";
  const hyphenated = `(${hex}{8})-(${hex}{4})-(${hex}{4})-(${hex}{4})-(${hex}{12})`;
  const form = new RegExp(`^(?:${hyphenated}|\\{${hyphenated}\\}|urn:uuid:${hyphenated}|(${hex}{32}))$`).exec(value);
  if (!form) return undefined;
  const digits = (form.slice(1, 16).join("") || form[16]).toLowerCase();
  return `${digits.slice(0, 8)}-${digits.slice(8, 12)}-${digits.slice(12, 16)}-${digits.slice(16, 20)}-${
    digits.slice(20)
  }`;
}

/**
 * The caller a request's key belongs to: the `x-user-id` header, or one demo
 * user. A real API names the authenticated user or API key, so two callers of
 * one tenant never share a key (and never each other's answer).
 */
function caller(req: Request): string | undefined {
  const value = req.headers.get("x-user-id");
  if (value === null) return "demo-user";
  return VISIBLE.test(value) ? value : undefined;
}

function text(status: number, body: string): Response {
  return new Response(body, { status, headers: { "content-type": "text/plain; charset=utf-8" } });
}

/** `?delay_ms` as axum's `Query<Option<u64>>` reads it, with its rejections' words. */
function delayOf(query: string): { ms?: number } | { rejected: string } {
  let ms: number | undefined;
  for (const pair of query.split("&")) {
    if (pair === "") continue;
    const at = pair.indexOf("=");
    const name = decodeForm(at < 0 ? pair : pair.slice(0, at));
    if (name !== "delay_ms") continue;
    if (ms !== undefined) return { rejected: "duplicate field `delay_ms`" };
    const value = decodeForm(at < 0 ? "" : pair.slice(at + 1));
    const digits = value.startsWith("+") ? value.slice(1) : value;
    if (value === "") return { rejected: "delay_ms: cannot parse integer from empty string" };
    if (!/^[0-9]+$/.test(digits)) return { rejected: "delay_ms: invalid digit found in string" };
    if (BigInt(digits) > 2n ** 64n - 1n) return { rejected: "delay_ms: number too large to fit in target type" };
    ms = Number(digits);
  }
  return { ms };
}

/** application/x-www-form-urlencoded decoding: `+` is a space, bad UTF-8 is U+FFFD. */
function decodeForm(text: string): string {
  const bytes: number[] = [];
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === "+") bytes.push(0x20);
    else if (c === "%" && /^[0-9a-fA-F]{2}$/.test(text.slice(i + 1, i + 3))) {
      bytes.push(parseInt(text.slice(i + 1, i + 3), 16));
      i += 2;
    } else bytes.push(...new TextEncoder().encode(c));
  }
  return new TextDecoder().decode(new Uint8Array(bytes));
}

/** Whether the content type is JSON as axum's `Json` takes it: application/json, or a `+json` suffix. */
function jsonContentType(headers: Headers): boolean {
  const value = headers.get("content-type");
  if (value === null || !VISIBLE.test(value)) return false;
  const mime = /^([!#$&^_.+\-0-9a-z]+)\/([!#$&^_.+\-0-9a-z]+)$/.exec(value.split(";")[0].trim().toLowerCase());
  if (!mime || mime[1] !== "application") return false;
  const plus = mime[2].indexOf("+");
  return (plus < 0 ? mime[2] : mime[2].slice(0, plus)) === "json" || (plus >= 0 && mime[2].slice(plus + 1) === "json");
}

/**
 * The order as the Rust example writes it back (serde_json with
 * arbitrary_precision): members sorted by code point, the last of a repeated
 * name kept, numbers as spelled but with `e` and a signed exponent.
 */
function echo(text: string): string {
  let at = 0;
  const space = () => {
    while (at < text.length && " \t\n\r".includes(text[at])) at++;
  };
  const string = (): string => {
    const start = at++;
    while (text[at] !== '"') at += text[at] === "\\" ? 2 : 1;
    at++;
    return JSON.parse(text.slice(start, at));
  };
  const value = (): string => {
    space();
    const c = text[at];
    if (c === "{") {
      at++;
      const members = new Map<string, string>();
      space();
      while (text[at] !== "}") {
        const name = string();
        space();
        at++; // :
        members.set(name, value());
        space();
        if (text[at] === ",") at++;
        space();
      }
      at++;
      const names = [...members.keys()].sort(byCodePoint);
      return `{${names.map((name) => `${JSON.stringify(name)}:${members.get(name)}`).join(",")}}`;
    }
    if (c === "[") {
      at++;
      const items: string[] = [];
      space();
      while (text[at] !== "]") {
        items.push(value());
        space();
        if (text[at] === ",") at++;
        space();
      }
      at++;
      return `[${items.join(",")}]`;
    }
    if (c === '"') return JSON.stringify(string());
    const start = at;
    while (at < text.length && /[0-9a-zA-Z+\-.]/.test(text[at])) at++;
    const token = text.slice(start, at);
    return /^-?[0-9]/.test(token) ? token.replace(/[eE]([0-9])/, "e+$1").replace(/E/, "e") : token;
  };
  return value();
}

function byCodePoint(a: string, b: string): number {
  const x = [...a];
  const y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i].codePointAt(0)! - y[i].codePointAt(0)!;
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

/** Why serde_json would not read `text` when JSON.parse does: a lone surrogate, or 128 levels of nesting. */
function serdeRefuses(text: string, value: unknown): string | undefined {
  let depth = 0;
  let inString = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      if (c === "\\") i++;
      else if (c === '"') inString = false;
    } else if (c === '"') inString = true;
    else if (c === "{" || c === "[") {
      if (++depth >= 128) return `recursion limit exceeded at column ${i + 1}`;
    } else if (c === "}" || c === "]") depth--;
  }
  return wellFormed(value) ? undefined : "a lone surrogate in a hex escape";
}

function wellFormed(value: unknown): boolean {
  if (typeof value === "string") return value.isWellFormed();
  if (Array.isArray(value)) return value.every(wellFormed);
  if (value === null || typeof value !== "object") return true;
  return Object.entries(value).every(([name, inner]) => name.isWellFormed() && wellFormed(inner));
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      reject(signal.reason);
    }, { once: true });
  });
}

/** The handler: the middleware hands it the request with its body buffered and a signal cut at its timeout. */
async function createOrder(req: Request): Promise<Response> {
  const url = new URL(req.url);
  const delay = delayOf(url.search.slice(1));
  if ("rejected" in delay) return text(400, `Failed to deserialize query string: ${delay.rejected}`);
  if (!jsonContentType(req.headers)) return text(415, "Expected request with `Content-Type: application/json`");
  let body: string;
  let order: unknown;
  try {
    body = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(await req.arrayBuffer());
    order = JSON.parse(body);
  } catch (error) {
    return text(400, `Failed to parse the request body as JSON: ${error instanceof Error ? error.message : error}`);
  }
  const refused = serdeRefuses(body, order);
  if (refused) return text(400, `Failed to parse the request body as JSON: ${refused}`);
  if (delay.ms !== undefined) await sleep(Math.min(delay.ms, MAX_DELAY_MS), req.signal);
  const id = crypto.randomUUID();
  return new Response(`{"id":${JSON.stringify(id)},"order":${echo(body)},"status":"created"}`, {
    status: 201,
    headers: { "content-type": "application/json", "location": `/orders/${id}` },
  });
}

const orders = withIdempotencyKey(createOrder, {
  plane: IdempotencyPlane.fromEnv((name) => Deno.env.get(name)),
  organizationId: tenant,
  principal: caller,
  route: "/orders",
});

/** The target as sent, from the URL the runtime was given: its path, and its query with the `?`. */
function split(req: Request): { path: string; rest: string; origin: string } {
  const url = req.url;
  const start = url.indexOf("/", url.indexOf("//") + 2);
  const target = start < 0 ? "/" : url.slice(start);
  const query = target.search(/[?#]/);
  return {
    origin: start < 0 ? url : url.slice(0, start),
    path: query < 0 ? target : target.slice(0, query),
    rest: query < 0 ? "" : target.slice(query),
  };
}

/** The routes: POST /orders (and /functions/v1/orders); 405 with `Allow: POST` for other methods; 404 elsewhere. */
export function serve(req: Request): Promise<Response> | Response {
  const { path, rest, origin } = split(req);
  if (path !== "/orders" && path !== `${FUNCTIONS_PREFIX}/orders`) return new Response(null, { status: 404 });
  if (req.method !== "POST") return new Response(null, { status: 405, headers: { allow: "POST" } });
  if (path === "/orders") return orders(req);
  // Built from parts: `new Request(url, req)` would read req.signal (see body.ts).
  return orders(
    new Request(`${origin}/orders${rest}`, {
      method: req.method,
      headers: req.headers,
      body: req.body,
    }),
  );
}

if (import.meta.main) {
  Deno.serve({
    port: Number(Deno.env.get("PORT") ?? 8000),
    hostname: Deno.env.get("HOST") ?? "127.0.0.1",
    onListen({ hostname, port }) {
      // The first line on stdout, with the port bound (PORT=0 picks a free one).
      console.log(`listening on http://${hostname.includes(":") ? `[${hostname}]` : hostname}:${port}`);
    },
  }, serve);
}
