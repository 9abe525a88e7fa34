// Every answer the Idempotency-Key middleware (http.ts) gives itself: RFC
// 9457 problem details (`application/problem+json`, with `type`, `title`,
// `status`, `detail`), of the types in one catalogue — the Rust layer's
// (`callers::idempotency_key::ProblemType`), slug for slug, status for status
// and title for title, so a client cannot tell the two apart.

/** Where the problem types are listed: the README's "Idempotency-Key problems" section, which links to what each means. */
export const PROBLEM_TYPE_BASE = "https://github.com/idempotency-plane/idempotency-plane#idempotency-key-problems";

/**
 * The catalogue: every problem type the middleware answers.
 *
 * | slug | status | when |
 * |---|---|---|
 * | `missing-key` | 400 | no `Idempotency-Key` where one is required |
 * | `malformed-key` | 400 | an empty, quoted-wrong, non-ASCII or over-long key |
 * | `no-tenant` | 401 | the organization function named no tenant |
 * | `no-principal` | 401 | the principal function named no caller |
 * | `body-too-large` | 413 | a request body above the limit |
 * | `body-unreadable` | 400 | the request body broke off |
 * | `key-reused` | 422 | the key was used for another request |
 * | `in-flight` | 409 | a request with the key has not finished (`Retry-After`) |
 * | `handler-failed` | 500 | the handler threw after it started (kept for its key and replayed), threw `NothingHappened` without a response (released), or a request the middleware passed through failed |
 * | `handler-timeout` | 504 | the handler overran its timeout (kept for its key and replayed) |
 * | `answer-incomplete` | 502 | the handler's answer outgrew the buffer or the timeout, and could not be journaled either |
 * | `answer-not-kept` | 500 | an answer above the journal's limit, refused for all (`onOversize: "refuse"`) |
 * | `unreadable-answer` | 500 | the journaled answer is not one this layer wrote |
 * | `not-configured` | 500 | no policy for the scope, no route, or no caller scoping chosen |
 * | `unavailable` | 503 | the plane could not answer the claim, or confirm its lease while the handler ran (`Retry-After`) |
 */
export const PROBLEM_TYPES = {
  "missing-key": { status: 400, title: "Idempotency-Key is required" },
  "malformed-key": { status: 400, title: "Idempotency-Key is malformed" },
  "no-tenant": { status: 401, title: "No tenant for this request" },
  "no-principal": { status: 401, title: "No caller for this request" },
  "body-too-large": { status: 413, title: "The request body is too large" },
  "body-unreadable": { status: 400, title: "The request body could not be read" },
  "key-reused": { status: 422, title: "Idempotency-Key reused for a different request" },
  "in-flight": { status: 409, title: "A request with this key is in flight" },
  "handler-failed": { status: 500, title: "The request failed" },
  "handler-timeout": { status: 504, title: "The request took too long" },
  "answer-incomplete": { status: 502, title: "The answer could not be read whole" },
  "answer-not-kept": { status: 500, title: "The answer is too large to keep" },
  "unreadable-answer": { status: 500, title: "The first answer cannot be replayed" },
  "not-configured": { status: 500, title: "Idempotency is not configured for this route" },
  "unavailable": { status: 503, title: "Idempotency is unavailable" },
} as const;

/** One of the catalogue's slugs. */
export type ProblemSlug = keyof typeof PROBLEM_TYPES;

/** A problem the middleware answers instead of the handler. */
export interface Problem {
  slug: ProblemSlug;
  status: number;
  title: string;
  /** What happened to this request. */
  detail: string;
  /** Seconds after which a retry may succeed (`Retry-After`). */
  retryAfter?: number;
}

/** The problem of type `slug`, with its catalogue status and title. */
export function problem(slug: ProblemSlug, detail: string, retryAfter?: number): Problem {
  const { status, title } = PROBLEM_TYPES[slug];
  return retryAfter === undefined ? { slug, status, title, detail } : { slug, status, title, detail, retryAfter };
}

/** The `type` member: an absolute URI naming the problem type. */
export function problemTypeUri(slug: ProblemSlug): string {
  return `${PROBLEM_TYPE_BASE}-${slug}`;
}

/**
 * The JSON body: `detail`, `status`, `title`, `type`, in that order — the
 * bytes serde_json writes for the Rust layer's problems (its maps are sorted).
 */
export function problemBody(p: Problem): string {
  return JSON.stringify({ detail: p.detail, status: p.status, title: p.title, type: problemTypeUri(p.slug) });
}

/** The response: status, `Content-Type: application/problem+json`, `Retry-After` when set, the body. */
export function problemResponse(p: Problem): Response {
  const headers = new Headers({ "content-type": "application/problem+json" });
  if (p.retryAfter !== undefined) headers.set("retry-after", String(p.retryAfter));
  return new Response(problemBody(p), { status: p.status, headers });
}
