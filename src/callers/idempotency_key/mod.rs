//! `Idempotency-Key` for any HTTP API: a tower layer over the plane
//! (feature `axum`), after the IETF draft "The Idempotency-Key HTTP Header
//! Field" and the way Stripe's API behaves.
//!
//! For the configured methods (POST and PATCH by default) a request carrying
//! `Idempotency-Key` is claimed in the plane under the scope
//! `http.<method>.<route>`, the caller's tenant, and the caller: the key is
//! scoped by the [`principal`](IdempotencyKeyLayer::principal) the
//! application names for each request (a user, an API client; its SHA-256
//! is part of the plane's key), so two callers of one tenant who pick the
//! same key never get each other's answer, unless the layer is told that
//! keys are [`shared_across_callers`](IdempotencyKeyLayer::shared_across_callers).
//! A route too long for the plane's 128-character scopes keeps its first
//! 95 and ends in a hash of the route. The claim carries a fingerprint of
//! the method, the target (path and query), the `Content-Type`, the body
//! and the configured headers; the body counts by its RFC 8785 value when
//! it is JSON that form holds without loss (no repeated member, every
//! number exactly the decimal the form writes), else by its bytes:
//!
//! | request | answer |
//! |---|---|
//! | first with this key | the handler runs; its answer is journaled, and the caller gets exactly what a replay will say |
//! | the handler answered anything, a 5xx or 429 included | journaled and replayed: the handler started, so only it knows what took effect |
//! | the handler panicked (in `call` or in its future) or timed out | a 500 `handler-failed` or 504 `handler-timeout` problem, journaled and replayed |
//! | the handler answered a failure marked [`NothingHappened`] | the claim is released: a retry runs the handler again |
//! | the service answered an error of its own | the error; the claim is left to its lease |
//! | repeat after completion | the journaled status, headers and body, `Idempotent-Replayed: true` |
//! | repeat while the first is in flight, its answer still being journaled included | 409, `Retry-After` |
//! | same key, different fingerprint | 422 |
//! | no key where one is required | 400 (or passed through, [`optional`](IdempotencyKeyLayer::optional)) |
//! | empty, malformed, repeated or longer than 255 characters | 400 |
//! | no tenant, or no caller where keys are per caller | 401 |
//! | body above the limit | 413 |
//! | no policy for the scope, no matched route, or neither `principal` nor `shared_across_callers` chosen | 500 |
//! | the plane never reached (connection not made; PostgREST's own 503 `PGRST000`/`PGRST002`, 504 `PGRST003`) | 503, `Retry-After` (or run unprotected, [`fail_open`](IdempotencyKeyLayer::fail_open)) |
//! | any other failure of the claim (an answer lost or too late, a 5xx, a lock timeout): the plane may hold the key | 503, `Retry-After`, whether or not it fails open |
//!
//! The handler is cut off at its [timeout](IdempotencyKeyLayer::handler_timeout),
//! counted from before its claim. Writing its answer to the journal is cut
//! off a [journal deadline](IdempotencyKeyLayer::journal_deadline) after
//! that, and retried within it when it fails transiently; the lease is
//! the handler timeout, plus the journal deadline, plus a margin, so no
//! other replica takes a key over while the request holding it still runs
//! or journals. A journal write still failing at its deadline leaves the
//! claim to its lease (the caller gets its answer all the same); one the
//! store refuses (an answer above a scope's own, lower limit) is written
//! again without its body.
//!
//! As Stripe's API does, once a handler started its result is kept for the
//! key, a 500 included: only the handler knows whether it took effect, and
//! a retry that ran it again could make the effect twice. A request refused
//! before the handler ran (400, 401, 409, 413, 422) keeps nothing.
//!
//! A replay carries the status, the body and the kept headers
//! (`Content-Type`, `Location` and those named with
//! [`keep_header`](IdempotencyKeyLayer::keep_header)); a header that
//! carries credentials ([`CREDENTIAL_HEADERS`]: `Set-Cookie`,
//! `Authorization`, …) is refused by `keep_header` and never replayed, even
//! from a journal that holds one. The first caller gets exactly what a
//! replay will say (a body above the journal's limit omitted, too), without
//! `Idempotent-Replayed`, and with the handler's headers a replay leaves out
//! on purpose.
//!
//! Every answer of the layer's own is RFC 9457 problem details, of one of
//! the types [`ProblemType`] catalogues (each with its slug, status and
//! when it is answered).
//!
//! Apply it to a router's routes (`Router::route_layer`, or `Router::layer`,
//! which axum runs after routing), so the scope names the matched route
//! (`/orders/{id}`); wrapped around a whole router it sees no route and
//! answers 500.
//!
//! The layer is laid out as tower middleware is: [`IdempotencyKeyLayer`]
//! and its builder (`layer`), the settings it shares with every request
//! (`config`), the [`IdempotencyKey`] service (`service`),
//! the handling of one request, step by step (`future`), the
//! `Idempotency-Key` header's rules (`key`), the fingerprint and scope of a
//! request (`fingerprint`), the journaled answer (`stored`) and the problem
//! catalogue (`problem`).

mod config;
mod fingerprint;
mod future;
mod key;
mod layer;
mod nothing_happened;
mod problem;
mod service;
mod stored;

pub use config::{OversizeResponse, PrincipalOf, TenantOf};
pub use key::{IDEMPOTENCY_KEY, MAX_IDEMPOTENCY_KEY_CHARS};
pub use layer::{ConfigError, IdempotencyKeyLayer};
pub use nothing_happened::NothingHappened;
pub use problem::{Problem, ProblemType};
pub use service::IdempotencyKey;
pub use stored::{BODY_HEADERS, CREDENTIAL_HEADERS};
