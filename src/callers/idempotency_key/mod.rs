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
//! | first with this key | the handler runs; its answer is journaled and returned |
//! | the handler answered 5xx or 429, panicked (in `call` or in its future) or timed out | the claim is released: a retry runs the handler again |
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
//! A replay carries the status, the body and the kept headers
//! (`Content-Type`, `Location` and those named with
//! [`keep_header`](IdempotencyKeyLayer::keep_header)); a header that
//! carries credentials ([`CREDENTIAL_HEADERS`]: `Set-Cookie`,
//! `Authorization`, …) is refused by `keep_header` and never replayed, even
//! from a journal that holds one.
//!
//! Every answer of the layer's own is RFC 9457 problem details, of one of
//! the types [ProblemType] lists: `missing-key`, `malformed-key`,
//! `no-tenant`, `no-principal`, `body-too-large`, `body-unreadable`,
//! `key-reused`, `in-flight`, `handler-failed`, `handler-timeout`,
//! `answer-incomplete`, `answer-not-kept`, `unreadable-answer`,
//! `not-configured`, `unavailable`.
//!
//! Apply it to a router's routes (`Router::route_layer`, or `Router::layer`,
//! which axum runs after routing), so the scope names the matched route
//! (`/orders/{id}`); wrapped around a whole router it sees no route and
//! answers 500.

mod fingerprint;
mod problem;
mod stored;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::MatchedPath;
use axum::http::request::Parts;
use axum::http::{HeaderName, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use sha2::{Digest, Sha256};
use tower_layer::Layer;
use tower_service::Service;
use tracing::{field, Instrument};
use uuid::Uuid;

pub use problem::{Problem, ProblemType};
use stored::StoredResponse;
pub use stored::CREDENTIAL_HEADERS;

use crate::error::{Error, InvalidInput};
use crate::repo::IdempotencyRepository;
use crate::service::{
    stored_size, Answer, Begun, Cut, Effect, EffectDriver, IdempotencyService, Refused, Settle, Settled, Timing,
};

/// The request header the key is read from.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Longest key accepted, in characters (Stripe's limit).
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;

/// Separates a caller's hash from the key in the plane's key. No
/// `Idempotency-Key` can hold it (they are visible ASCII), so a key scoped
/// by a caller never equals a key shared across callers.
const CALLER_SEPARATOR: char = '\u{a7}';

/// What a handler's answer above the journal's limit becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OversizeResponse {
    /// The first caller gets the whole answer; the journal keeps its status
    /// and headers, and a repeat gets them with an empty body and
    /// `Idempotent-Body-Omitted: <bytes>`.
    #[default]
    OmitBody,
    /// The first caller gets a 500 problem instead, and so does every repeat:
    /// for an API whose clients cannot act on an answer without its body.
    Refuse,
}

/// A layer setting refused when it is made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A header that carries credentials ([`CREDENTIAL_HEADERS`]) cannot be
    /// kept: the journaled answer is replayed to whoever repeats the key.
    #[error("the {name} header carries credentials and is never journaled: a replay would hand it to another caller")]
    CredentialHeader {
        /// The header refused.
        name: HeaderName,
    },
}

/// Resolves the tenant (the plane's organization) of a request, for example
/// from its verified auth token. `None` answers 401.
pub type TenantOf = dyn Fn(&Parts) -> Option<Uuid> + Send + Sync;

/// Resolves the caller of a request within its tenant (a user id, an API
/// client id, the subject of its verified token). `None` answers 401.
pub type PrincipalOf = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Whose keys a key is among.
#[derive(Clone)]
enum Callers {
    /// Neither chosen: every keyed request is refused as not configured.
    Unchosen,
    /// Each caller's keys are its own.
    Each(Arc<PrincipalOf>),
    /// Every caller of a tenant shares its keys.
    Shared,
}

impl std::fmt::Debug for Callers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Callers::Unchosen => "Unchosen",
            Callers::Each(_) => "Each",
            Callers::Shared => "Shared",
        })
    }
}

/// The layer; see the [module documentation](self) for what it answers.
pub struct IdempotencyKeyLayer<R> {
    config: Config<R>,
}

impl<R> std::fmt::Debug for IdempotencyKeyLayer<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.config.fmt(f)
    }
}

impl<R> std::fmt::Debug for Config<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKeyLayer")
            .field("methods", &self.methods)
            .field("required", &self.required)
            .field("callers", &self.callers)
            .field("body_limit", &self.body_limit)
            .field("response_body_limit", &self.response_body_limit)
            .field("handler_timeout", &self.handler_timeout)
            .field("journal_deadline", &self.journal_deadline)
            .field("lease_margin", &self.lease_margin)
            .field("counted_headers", &self.counted_headers)
            .field("kept_headers", &self.kept_headers)
            .field("oversize", &self.oversize)
            .field("fail_open", &self.fail_open)
            .finish_non_exhaustive()
    }
}

impl<R> Clone for IdempotencyKeyLayer<R> {
    fn clone(&self) -> Self {
        IdempotencyKeyLayer { config: self.config.clone() }
    }
}

struct Config<R> {
    service: Arc<IdempotencyService<R>>,
    tenant: Arc<TenantOf>,
    callers: Callers,
    methods: Vec<Method>,
    required: bool,
    body_limit: usize,
    response_body_limit: usize,
    handler_timeout: Duration,
    journal_deadline: Duration,
    lease_margin: Duration,
    counted_headers: Vec<HeaderName>,
    kept_headers: Vec<HeaderName>,
    oversize: OversizeResponse,
    fail_open: bool,
    in_flight_retry_after: u64,
    unavailable_retry_after: u64,
}

impl<R> Clone for Config<R> {
    fn clone(&self) -> Self {
        Config {
            service: self.service.clone(),
            tenant: self.tenant.clone(),
            callers: self.callers.clone(),
            methods: self.methods.clone(),
            required: self.required,
            body_limit: self.body_limit,
            response_body_limit: self.response_body_limit,
            handler_timeout: self.handler_timeout,
            journal_deadline: self.journal_deadline,
            lease_margin: self.lease_margin,
            counted_headers: self.counted_headers.clone(),
            kept_headers: self.kept_headers.clone(),
            oversize: self.oversize,
            fail_open: self.fail_open,
            in_flight_retry_after: self.in_flight_retry_after,
            unavailable_retry_after: self.unavailable_retry_after,
        }
    }
}

impl<R> Config<R> {
    /// The handler's timeout, the journal's deadline and the margin: the
    /// lease is their sum. Checked when they are set.
    fn timing(&self) -> Result<Timing, InvalidInput> {
        Timing::new(self.handler_timeout, self.journal_deadline, self.lease_margin)
    }
}

/// The lease of a handler timeout, journal deadline and margin, refused
/// when a part that must take time is zero or the whole is outside what
/// the plane accepts (1 s to 24 h).
fn validate_lease(handler_timeout: Duration, journal_deadline: Duration, margin: Duration) -> Result<(), InvalidInput> {
    Timing::new(handler_timeout, journal_deadline, margin).map(|_| ())
}

impl<R: IdempotencyRepository + 'static> IdempotencyKeyLayer<R> {
    /// A layer over `service`, with `tenant` naming each request's
    /// organization. Defaults: POST and PATCH, key required, request bodies
    /// up to 1 MiB, answers buffered up to 8 MiB, handler timeout 30 s,
    /// journal deadline 10 s (lease: 30 s + 10 s + a 5 s margin),
    /// `Content-Type` and `Location` kept with the journaled answer, fail
    /// closed.
    ///
    /// Say whose keys a key is among before serving: per caller
    /// ([`principal`](Self::principal)) or shared by a tenant's callers
    /// ([`shared_across_callers`](Self::shared_across_callers)); until one
    /// is chosen every keyed request is answered 500 `not-configured`.
    pub fn new(
        service: IdempotencyService<R>,
        tenant: impl Fn(&Parts) -> Option<Uuid> + Send + Sync + 'static,
    ) -> Self {
        IdempotencyKeyLayer {
            config: Config {
                service: Arc::new(service),
                tenant: Arc::new(tenant),
                callers: Callers::Unchosen,
                methods: vec![Method::POST, Method::PATCH],
                required: true,
                body_limit: 1024 * 1024,
                response_body_limit: 8 * 1024 * 1024,
                handler_timeout: Duration::from_secs(30),
                journal_deadline: Duration::from_secs(10),
                lease_margin: Duration::from_secs(5),
                counted_headers: Vec::new(),
                kept_headers: vec![HeaderName::from_static("content-type"), HeaderName::from_static("location")],
                oversize: OversizeResponse::OmitBody,
                fail_open: false,
                in_flight_retry_after: 1,
                unavailable_retry_after: 5,
            },
        }
    }

    fn edit(mut self, change: impl FnOnce(&mut Config<R>)) -> Self {
        change(&mut self.config);
        self
    }

    /// Each caller's keys are its own: `principal` names the caller of a
    /// request within its tenant (a user or API client id, the subject of
    /// a verified token), and the plane's key is scoped by its SHA-256. A
    /// request it names no caller for is answered 401 `no-principal`.
    /// Replaces [`shared_across_callers`](Self::shared_across_callers).
    pub fn principal(self, principal: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        let principal: Arc<PrincipalOf> = Arc::new(principal);
        self.edit(|c| c.callers = Callers::Each(principal))
    }

    /// Every caller of a tenant shares its keys: a key one caller used
    /// answers another caller of the tenant with the first answer. For an
    /// API whose tenant is one caller (a service account), or whose callers
    /// coordinate their keys. Replaces [`principal`](Self::principal).
    pub fn shared_across_callers(self) -> Self {
        self.edit(|c| c.callers = Callers::Shared)
    }

    /// The methods that take a key (others pass straight through).
    pub fn methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.edit(|c| c.methods = methods)
    }

    /// Requests without a key pass straight through, unprotected, instead
    /// of being answered 400.
    pub fn optional(self) -> Self {
        self.edit(|c| c.required = false)
    }

    /// The largest request body buffered, in bytes; a larger one is 413.
    pub fn body_limit(self, bytes: usize) -> Self {
        self.edit(|c| c.body_limit = bytes)
    }

    /// The largest handler answer buffered for the journal, in bytes. A
    /// larger one cannot be returned whole either (it was read to the
    /// limit): the caller gets 502 and the journal keeps its status and
    /// headers.
    pub fn response_body_limit(self, bytes: usize) -> Self {
        self.edit(|c| c.response_body_limit = bytes)
    }

    /// How long the handler may run, counted from before its claim, before
    /// it is cancelled and its claim released (504). The lease is this,
    /// plus the [journal deadline](Self::journal_deadline), plus `margin`,
    /// so a live handler's claim is never taken over, nor one whose answer
    /// is being journaled. Refused when the timeout is zero or the lease is
    /// outside what the plane accepts (1 s to 24 h).
    pub fn handler_timeout(self, timeout: Duration, margin: Duration) -> Result<Self, InvalidInput> {
        validate_lease(timeout, self.config.journal_deadline, margin)?;
        Ok(self.edit(|c| {
            c.handler_timeout = timeout;
            c.lease_margin = margin;
        }))
    }

    /// How long writing the handler's answer to the journal may take after
    /// the handler's own timeout has passed (default 10 s). The write is
    /// cut off then, and retried until then when it fails transiently; it
    /// is part of the lease, so another request cannot take the key over
    /// while the answer is still being written. Refused when it is zero or
    /// the lease is outside what the plane accepts (1 s to 24 h).
    pub fn journal_deadline(self, deadline: Duration) -> Result<Self, InvalidInput> {
        validate_lease(self.config.handler_timeout, deadline, self.config.lease_margin)?;
        Ok(self.edit(|c| c.journal_deadline = deadline))
    }

    /// A header that is part of the fingerprint (a currency, an API version).
    pub fn count_header(self, name: HeaderName) -> Self {
        self.edit(|c| c.counted_headers.push(name))
    }

    /// A header of the handler's answer that is journaled and replayed
    /// (besides `Content-Type` and `Location`). A header that carries
    /// credentials ([`CREDENTIAL_HEADERS`]: `Set-Cookie`, `Authorization`,
    /// …) is refused: a replay would hand one caller's to another.
    pub fn keep_header(self, name: HeaderName) -> Result<Self, ConfigError> {
        if stored::is_credential(name.as_str()) {
            return Err(ConfigError::CredentialHeader { name });
        }
        Ok(self.edit(|c| c.kept_headers.push(name)))
    }

    /// What an answer above the journal's response limit becomes.
    pub fn on_oversize(self, oversize: OversizeResponse) -> Self {
        self.edit(|c| c.oversize = oversize)
    }

    /// When the plane cannot be reached at all (the connection was not
    /// made, or PostgREST answered that it could not reach its database),
    /// run the handler unprotected (logged at error level for every
    /// request) instead of answering 503. Any other failure of a claim is
    /// still 503: the plane may have made the claim, and another request
    /// may hold the key.
    pub fn fail_open(self) -> Self {
        self.edit(|c| c.fail_open = true)
    }
}

impl<S, R> Layer<S> for IdempotencyKeyLayer<R> {
    type Service = IdempotencyKey<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKey { inner, config: Arc::new(self.config.clone()) }
    }
}

/// The service [`IdempotencyKeyLayer`] wraps a handler in.
pub struct IdempotencyKey<S, R> {
    inner: S,
    config: Arc<Config<R>>,
}

impl<S, R> std::fmt::Debug for IdempotencyKey<S, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKey").field("config", &self.config).finish_non_exhaustive()
    }
}

impl<S: Clone, R> Clone for IdempotencyKey<S, R> {
    fn clone(&self) -> Self {
        IdempotencyKey { inner: self.inner.clone(), config: self.config.clone() }
    }
}

impl<S, R> Service<Request<Body>> for IdempotencyKey<S, R>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: IdempotencyRepository + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was made ready serves this request.
        let fresh = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, fresh);
        let config = self.config.clone();
        // A task of its own: a client that hangs up must not cancel a claim
        // half-way (an effect made and never journaled would run again once
        // the lease passed).
        let lifecycle = tokio::spawn(handle(config, ready, request).in_current_span());
        Box::pin(async move {
            match lifecycle.await {
                Ok(answer) => answer,
                Err(failed) => {
                    tracing::error!(%failed, "the Idempotency-Key task failed");
                    Ok(handler_failed().into_response())
                }
            }
        })
    }
}

fn handler_failed() -> Problem {
    Problem::new(ProblemType::HandlerFailed, "the request failed before it finished; retry with the same key")
}

fn not_configured(detail: &str) -> Response<Body> {
    Problem::new(ProblemType::NotConfigured, detail).into_response()
}

/// The plane's key: the request's own, or, scoped by a caller, the
/// SHA-256 of the caller's principal, `§`, and the request's key.
fn plane_key(key: &str, principal: Option<&str>) -> String {
    match principal {
        None => key.to_owned(),
        Some(principal) => {
            format!("{}{CALLER_SEPARATOR}{key}", hex::encode(Sha256::digest(principal.as_bytes())))
        }
    }
}

async fn handle<S, R>(config: Arc<Config<R>>, mut inner: S, request: Request<Body>) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Future: Send,
    R: IdempotencyRepository + 'static,
{
    if !config.methods.contains(request.method()) {
        return inner.call(request).await;
    }
    let key = match idempotency_key(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !config.required => return inner.call(request).await,
        Ok(None) => {
            return Ok(Problem::new(
                ProblemType::MissingKey,
                format!("{} requests to this API carry an Idempotency-Key header", request.method()),
            )
            .into_response())
        }
        Err(problem) => return Ok(problem.into_response()),
    };
    let (parts, body) = request.into_parts();
    let Some(organization_id) = (config.tenant)(&parts) else {
        return Ok(Problem::new(ProblemType::NoTenant, "the request does not name the tenant its key belongs to")
            .into_response());
    };
    let principal = match &config.callers {
        Callers::Shared => None,
        Callers::Each(principal) => match principal(&parts) {
            Some(principal) => Some(principal),
            None => {
                return Ok(Problem::new(
                    ProblemType::NoPrincipal,
                    "the request does not name the caller its key belongs to",
                )
                .into_response())
            }
        },
        Callers::Unchosen => {
            tracing::error!(
                "the Idempotency-Key layer does not know whose keys a key is among: \
                 configure it with .principal(...) or .shared_across_callers()"
            );
            return Ok(not_configured("the server has not said whether its idempotency keys are per caller"));
        }
    };
    let body = match buffer(body, config.body_limit).await {
        Ok(body) => body,
        Err(problem) => return Ok(problem.into_response()),
    };
    // The scope names the matched route (`/orders/{id}`), never each path:
    // scopes, and the metrics labelled by them, stay a bounded set.
    let Some(route) = parts.extensions.get::<MatchedPath>().map(|path| path.as_str().to_owned()) else {
        tracing::error!(
            "the Idempotency-Key layer sees no matched route: apply it with Router::route_layer or Router::layer"
        );
        return Ok(not_configured("the server applies its idempotency layer where it cannot see the route"));
    };
    let scope = fingerprint::scope(&parts.method, &route);
    // The fingerprint takes the request's own path and query: two resources
    // of one route are two requests.
    let target = parts.uri.path_and_query().map_or_else(|| parts.uri.path(), |target| target.as_str());
    let hash = fingerprint::fingerprint(&parts.method, target, &parts.headers, &body, &config.counted_headers);
    let plane_key = plane_key(&key, principal.as_deref());
    let span = tracing::info_span!(
        "http.idempotency_key",
        %organization_id, scope, key, per_caller = principal.is_some(),
        outcome = field::Empty, replayed = field::Empty, ending = field::Empty
    );
    async move {
        // The driver counts the handler's time and the journal's from before
        // the claim, whose lease the database stamps later: both are cut
        // before the lease can pass, however long the claim took.
        let timing = match config.timing() {
            Ok(timing) => timing,
            Err(refused) => return Ok(not_configured(&refused.to_string())),
        };
        let driver = EffectDriver::shared(config.service.clone());
        let effect = Effect { organization_id, scope: &scope, key: &plane_key, request_hash: &hash, timing };
        let held = match driver.begin(&effect).await {
            Ok(Begun::Held(held)) => held,
            Ok(Begun::Replayed(answer)) => {
                tracing::Span::current().record("outcome", "replayed").record("replayed", true);
                let replay = serde_json::from_value::<StoredResponse>(answer.output).ok().and_then(|s| s.replay());
                return Ok(replay.unwrap_or_else(|| {
                    tracing::error!("the journaled answer is not one this layer wrote");
                    Problem::new(
                        ProblemType::UnreadableAnswer,
                        "this key completed, but its journaled answer is not an HTTP answer",
                    )
                    .into_response()
                }));
            }
            Ok(Begun::InFlight { .. }) => {
                tracing::Span::current().record("outcome", "in_flight");
                return Ok(Problem::new(
                    ProblemType::InFlight,
                    "the first request with this Idempotency-Key has not finished; retry later",
                )
                .retry_after(config.in_flight_retry_after)
                .into_response());
            }
            Ok(Begun::Conflict) => {
                tracing::Span::current().record("outcome", "key_reused");
                return Ok(Problem::new(
                    ProblemType::KeyReused,
                    "this key was used for a request with another method, path, query, content type, body or headers",
                )
                .into_response());
            }
            Err(error) => return unavailable(&config, error, &mut inner, Request::from_parts(parts, Body::from(body))).await,
        };
        tracing::Span::current().record("outcome", "claimed");

        // `call` itself may panic, before any future exists: caught like a
        // panic of the future (which the driver catches), so the claim is
        // released either way.
        let request = Request::from_parts(parts, Body::from(body));
        let ran = async {
            match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request))) {
                Ok(future) => Ok(future.await),
                Err(panic) => Err(panic),
            }
        };
        // A failed, panicked or timed-out handler gave no answer to anyone:
        // released, like any failed request, so the client's retry runs it
        // (see the module docs for what that assumes of the handler).
        let response = match held.run(ran).await {
            Ok(Ok(Ok(response))) => response,
            Ok(Ok(Err(error))) => {
                release(held).await;
                return Err(error);
            }
            Ok(Err(_)) | Err(Cut::Panicked) => {
                tracing::error!("the handler panicked; its claim is released");
                release(held).await;
                return Ok(handler_failed().into_response());
            }
            Err(Cut::TimedOut) => {
                tracing::warn!(timeout_ms = config.handler_timeout.as_millis() as u64, "the handler timed out; its claim is released");
                release(held).await;
                return Ok(Problem::new(
                    ProblemType::HandlerTimeout,
                    "the request was cut off before it finished; retry with the same key",
                )
                .into_response());
            }
        };
        let status = response.status();
        if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
            // Retryable: not the answer to this key, so the next try runs again.
            release(held).await;
            return Ok(response);
        }
        let (parts, body) = response.into_parts();
        let buffered = tokio::time::timeout_at(held.effect_deadline(), buffer(body, config.response_body_limit)).await;
        let (answer, stored, body_bytes) = match buffered {
            Ok(Ok(bytes)) => {
                let stored = StoredResponse::of(status, &parts.headers, &config.kept_headers, &bytes);
                let stored = fit(&config, stored, bytes.len() as u64);
                let body_bytes = bytes.len() as u64;
                let answer = match stored.refused() {
                    Some(refusal) => refusal,
                    None => Response::from_parts(parts, Body::from(bytes)),
                };
                (answer, stored, body_bytes)
            }
            Ok(Err(_)) | Err(_) => {
                // The handler ran (its effect is made) but its answer could
                // not be read whole, in size or in time: keep what is known.
                let stored = StoredResponse::of(status, &parts.headers, &config.kept_headers, &Bytes::new())
                    .without_body(config.response_body_limit as u64);
                let problem = Problem::new(
                    ProblemType::AnswerIncomplete,
                    "the request ran, but its answer was too large or too slow to return",
                );
                (problem.into_response(), stored, config.response_body_limit as u64)
            }
        };
        let settled = journal(held, stored, body_bytes).await;
        tracing::Span::current().record("ending", settled.as_str());
        if let Settled::LeftToLease(why) = &settled {
            tracing::error!(reason = %why, "the answer could not be journaled; the claim frees itself when its lease passes");
        }
        Ok(answer)
    }
    .instrument(span)
    .await
}

/// Releases a claim whose handler gave no answer; the span records how.
async fn release<R: IdempotencyRepository>(held: crate::service::Held<R>) {
    let settled = held.settle(Settle::Release).await;
    tracing::Span::current().record("ending", settled.as_str());
}

/// Journals `stored` through the driver (within the journal's deadline,
/// retried on transient failures). An answer the store refuses (above the
/// scope's own limit, which may be lower than this service's) is journaled
/// again without its body, so that a repeat replays instead of running the
/// handler again.
async fn journal<R: IdempotencyRepository>(
    held: crate::service::Held<R>,
    stored: StoredResponse,
    body_bytes: u64,
) -> Settled {
    let as_answer = |stored: &StoredResponse| serde_json::to_value(stored).map(Answer::success);
    let answer = match as_answer(&stored) {
        Ok(answer) => answer,
        Err(error) => {
            tracing::error!(%error, "the answer does not serialize");
            return held.settle(Settle::Unknown("the answer does not serialize")).await;
        }
    };
    match held.journal_exact(answer).await {
        Ok(settled) => settled,
        Err(Refused { held, error }) => {
            tracing::warn!(%error, "the store refused the answer; journaling it without its body");
            match as_answer(&stored.without_body(body_bytes)) {
                Ok(answer) => held.settle(Settle::Journal(answer)).await,
                Err(_) => held.settle(Settle::Unknown("the answer does not serialize")).await,
            }
        }
    }
}

/// The key, if the request has one: a bare value (as Stripe takes it) or an
/// RFC 8941 string (`"…"`, as the IETF draft writes it).
fn idempotency_key(headers: &axum::http::HeaderMap) -> Result<Option<String>, Problem> {
    let malformed = |detail: &str| Problem::new(ProblemType::MalformedKey, detail);
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(malformed("the request carries more than one Idempotency-Key"));
    }
    let text = value.to_str().map_err(|_| malformed("the key holds characters other than visible ASCII"))?.trim();
    let key = match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) if inner.contains(['"', '\\']) => {
            return Err(malformed("a quoted key holds a quote or a backslash"))
        }
        Some(inner) => inner,
        None => text,
    };
    if key.is_empty() {
        return Err(malformed("the key is empty"));
    }
    if !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(malformed("the key holds characters other than visible ASCII"));
    }
    let chars = key.len();
    if chars > MAX_IDEMPOTENCY_KEY_CHARS {
        return Err(malformed(&format!("the key is {chars} characters; at most {MAX_IDEMPOTENCY_KEY_CHARS}")));
    }
    Ok(Some(key.to_owned()))
}

/// Reads a body up to `limit` bytes: 413 above it, 400 when it breaks off.
async fn buffer(body: Body, limit: usize) -> Result<Bytes, Problem> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(Problem::new(ProblemType::BodyTooLarge, format!("request bodies are buffered up to {limit} bytes")))
        }
        Err(error) => Err(Problem::new(ProblemType::BodyUnreadable, format!("the body broke off: {error}"))),
    }
}

/// Applies the oversize policy to an answer whose body is `body_bytes`
/// long, when it is above the scope's response limit: the journal keeps its
/// status and headers only, or a refusal that the caller gets as well.
fn fit<R: IdempotencyRepository>(config: &Config<R>, stored: StoredResponse, body_bytes: u64) -> StoredResponse {
    let size = serde_json::to_value(&stored).map_or(u64::MAX, |value| stored_size(&Answer::success(value)));
    if size <= config.service.response_limit() {
        return stored;
    }
    match config.oversize {
        OversizeResponse::OmitBody => stored.without_body(body_bytes),
        OversizeResponse::Refuse => StoredResponse::refusal(&Problem::new(
            ProblemType::AnswerNotKept,
            "the request ran, but its answer is larger than this API keeps for repeats",
        )),
    }
}

/// The claim failed: 503, or with `fail_open`, when the plane was never
/// reached, the handler runs unprotected. A misconfiguration (no policy for
/// the scope) is 500 either way.
async fn unavailable<S, R>(
    config: &Config<R>,
    error: Error,
    inner: &mut S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<Body>>,
{
    if let Error::UnknownScope { .. } | Error::Invalid(_) = error {
        tracing::error!(%error, "the idempotency scope is not usable; add a policy row for it (http.* covers every route)");
        return Ok(not_configured("the server has no idempotency policy for this route"));
    }
    // Only a plane that was never reached may be bypassed: after any other
    // failure (an answer lost or too late, a lock timeout, a 5xx) the plane
    // may have made the claim, and then it holds this key for someone.
    let never_reached = error.never_reached_the_plane();
    if config.fail_open && never_reached {
        tracing::error!(%error, "the idempotency plane is unreachable; FAIL-OPEN: running the request without protection");
        return inner.call(request).await;
    }
    if config.fail_open {
        tracing::warn!(%error, "the claim failed, but the plane may have made it; not failing open, answering 503");
    } else {
        tracing::warn!(%error, "the claim failed; answering 503");
    }
    Ok(Problem::new(
        ProblemType::Unavailable,
        "the request was not run, because its key cannot be checked now; retry with the same key",
    )
    .retry_after(config.unavailable_retry_after)
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    fn with_key(value: &'static [u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        headers
    }

    fn layer() -> IdempotencyKeyLayer<crate::repo::MemoryRepository> {
        IdempotencyKeyLayer::new(IdempotencyService::new(crate::repo::MemoryRepository::new()), |_| None)
    }

    #[test]
    fn credential_headers_are_refused_at_build_time_and_others_kept() {
        let named = [
            axum::http::header::SET_COOKIE,
            HeaderName::from_static("set-cookie2"),
            axum::http::header::AUTHORIZATION,
            axum::http::header::PROXY_AUTHORIZATION,
            axum::http::header::PROXY_AUTHENTICATE,
            axum::http::header::WWW_AUTHENTICATE,
            axum::http::header::COOKIE,
        ];
        let every = CREDENTIAL_HEADERS.iter().map(|name| HeaderName::from_static(name));
        for name in named.into_iter().chain(every) {
            match layer().keep_header(name.clone()) {
                Err(ConfigError::CredentialHeader { name: refused }) => assert_eq!(refused, name),
                Ok(_) => panic!("{name} was accepted"),
            }
        }
        let kept = layer().keep_header(HeaderName::from_static("x-request-cost")).expect("an ordinary header");
        assert!(kept.config.kept_headers.iter().any(|name| name == "x-request-cost"));
        let refused = layer().keep_header(axum::http::header::SET_COOKIE).unwrap_err();
        assert!(refused.to_string().contains("set-cookie"), "{refused}");
    }

    #[test]
    fn the_lease_covers_the_handler_the_journal_and_the_margin_and_each_setting_is_validated() {
        let defaults = layer();
        assert_eq!(defaults.config.timing().unwrap().lease(), Duration::from_secs(45));
        let set = layer()
            .handler_timeout(Duration::from_secs(2), Duration::from_secs(1))
            .unwrap()
            .journal_deadline(Duration::from_secs(3))
            .unwrap();
        assert_eq!(set.config.timing().unwrap().lease(), Duration::from_secs(6));
        assert!(matches!(layer().journal_deadline(Duration::ZERO), Err(InvalidInput::ZeroDuration { .. })));
        assert!(matches!(
            layer().handler_timeout(Duration::ZERO, Duration::from_secs(1)),
            Err(InvalidInput::ZeroDuration { .. })
        ));
        // Each is validated with the others: the whole lease stays within 24 h.
        let day = crate::service::MAX_LEASE;
        assert!(matches!(layer().journal_deadline(day), Err(InvalidInput::LeaseTooLong { .. })));
        let long_handler = layer().handler_timeout(day - Duration::from_secs(5), Duration::ZERO).unwrap_err();
        assert!(matches!(long_handler, InvalidInput::LeaseTooLong { .. }), "the default journal deadline counts");
        let short = layer().journal_deadline(Duration::from_millis(100)).unwrap();
        assert!(short.handler_timeout(day - Duration::from_secs(1), Duration::from_millis(900)).is_ok());
    }

    #[test]
    fn a_callers_key_is_its_own_and_never_a_shared_one() {
        assert_eq!(plane_key("k-1", None), "k-1");
        let alice = plane_key("k-1", Some("alice"));
        assert_ne!(alice, plane_key("k-1", Some("bob")));
        assert_ne!(alice, plane_key("k-2", Some("alice")));
        assert!(alice.ends_with("\u{a7}k-1") && !alice.contains("alice"), "{alice}");
        // No Idempotency-Key (visible ASCII) can spell a caller's key.
        assert!(!alice.is_ascii());
        let longest = plane_key(&"k".repeat(MAX_IDEMPOTENCY_KEY_CHARS), Some(&"p".repeat(10_000)));
        assert!(crate::service::validate_key(&longest).is_ok(), "within the plane's key limit");
    }

    #[test]
    fn keys_bare_or_quoted_are_read_and_bad_ones_refused() {
        assert_eq!(idempotency_key(&HeaderMap::new()), Ok(None));
        assert_eq!(idempotency_key(&with_key(b"abc-1")), Ok(Some("abc-1".into())));
        assert_eq!(idempotency_key(&with_key(b"\"8e03978e-40d5\"")), Ok(Some("8e03978e-40d5".into())));
        for bad in [&b""[..], b"\"\"", b"   ", b"\"a\"b\"", b"caf\xc3\xa9"] {
            let refused = idempotency_key(&with_key(bad)).unwrap_err();
            assert_eq!((refused.status, refused.slug), (StatusCode::BAD_REQUEST, "malformed-key"), "{bad:?}");
        }
        let long = "k".repeat(MAX_IDEMPOTENCY_KEY_CHARS + 1);
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&long).unwrap());
        assert!(idempotency_key(&headers).is_err());
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&long[1..]).unwrap());
        assert!(idempotency_key(&headers).is_ok());
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("two"));
        assert!(idempotency_key(&headers).is_err(), "two keys");
    }
}
