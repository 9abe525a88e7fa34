//! One request through the layer, as the task [`IdempotencyKey`] spawns
//! runs it, step by step: [read the key](keyed_request), [name the
//! caller](caller), [buffer the body](buffer), [find the scope](route_scope)
//! and the fingerprint; [claim] the key and [decide] (replay,
//! in flight, key reused, or run); [run the handler](run_inner) under the
//! claim; [keep its answer](keep_answer) in the journal.
//!
//! [`IdempotencyKey`]: super::IdempotencyKey

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::MatchedPath;
use axum::http::request::Parts;
use axum::http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;
use tracing::{field, Instrument};
use uuid::Uuid;

use super::config::{Callers, Config, OversizeResponse};
use super::fingerprint;
use super::key;
use super::problem::{Problem, ProblemType};
use super::stored::{StoredResponse, BODY_HEADERS};
use crate::error::Error;
use crate::repo::IdempotencyRepository;
use crate::service::{
    stored_size, Answer, Begun, Cut, Effect, EffectDriver, Held, Refused, RequestHash, Settle, Settled,
};

/// Where a step of the flow leads when it does not lead to the next one.
enum Step<T> {
    /// On to the next step, with what this one found.
    Next(T),
    /// The request is not the layer's to protect: the handler serves it.
    PassThrough(Request<Body>),
    /// The layer answers the request itself.
    Answer(Response<Body>),
}

/// A request the layer protects: the client's key, and what the plane is
/// asked under it.
struct Keyed {
    parts: Parts,
    body: Bytes,
    organization_id: Uuid,
    /// Whether the plane's key is scoped by a caller.
    per_caller: bool,
    scope: String,
    /// The key as the plane keeps it ([`key::plane_key`]).
    plane_key: String,
    hash: RequestHash,
}

impl Keyed {
    /// The span a protected request runs in, from its claim to its journal.
    fn span(&self) -> tracing::Span {
        tracing::info_span!(
            "http.idempotency_key",
            organization_id = %self.organization_id, idempotency.scope = self.scope.as_str(),
            idempotency.key_hash = %crate::telemetry::key_hash(&self.plane_key),
            per_caller = self.per_caller,
            outcome = field::Empty, replayed = field::Empty, ending = field::Empty
        )
    }

    /// The request again, for the handler.
    fn into_request(self) -> Request<Body> {
        Request::from_parts(self.parts, Body::from(self.body))
    }
}

/// What the plane's answer to the claim leads to.
enum Decision<R> {
    /// The key is ours: run the handler under the claim.
    Run(Held<R>),
    /// The layer answers: a replay, in flight, the key reused, not
    /// configured.
    Answer(Response<Body>),
}

/// How running the handler under the claim ended.
enum Ran<R, E> {
    /// The handler answered: its answer is still to be kept.
    Answered(Held<R>, Response<Body>),
    /// The handler started, then panicked or overran its timeout: it may
    /// have taken effect, so this problem is its answer, kept like one.
    Failed(Held<R>, Problem),
    /// The service failed with an error of its own after it started: the
    /// caller gets the error, and the claim is left to its lease.
    Errored(E),
    /// A heartbeat found the claim taken over, and the handler was stopped
    /// (the key is another worker's now, whose answer every repeat gets:
    /// answered as a repeat in flight would be); or it could not confirm
    /// the lease, and the handler never started (answered 503). Nothing is
    /// journaled.
    TakenOver(Problem),
}

/// Serves one request: a request the layer does not protect goes straight
/// to `inner`; a keyed one is claimed, run at most once, and journaled.
pub(super) async fn handle<S, R>(
    config: Arc<Config<R>>,
    mut inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Future: Send,
    R: IdempotencyRepository + 'static,
{
    let keyed = match keyed_request(&config, request).await {
        Step::Next(keyed) => keyed,
        Step::PassThrough(request) => return inner.call(request).await,
        Step::Answer(response) => return Ok(response),
    };
    let span = keyed.span();
    protect(&config, inner, keyed).instrument(span).await
}

/// The request's key, caller, body, scope and fingerprint, in that order:
/// the first that is missing or refused answers the request (a request of
/// another method, or an optional key left out, passes through).
async fn keyed_request<R>(config: &Config<R>, request: Request<Body>) -> Step<Keyed> {
    if !config.methods.contains(request.method()) {
        return Step::PassThrough(request);
    }
    let key = match key::read(request.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !config.required => return Step::PassThrough(request),
        Ok(None) => {
            let detail = format!("{} requests to this API carry an Idempotency-Key header", request.method());
            return Step::Answer(Problem::new(ProblemType::MissingKey, detail).into_response());
        }
        Err(problem) => return Step::Answer(problem.into_response()),
    };
    let (parts, body) = request.into_parts();
    let (organization_id, principal) = match caller(config, &parts) {
        Ok(caller) => caller,
        Err(problem) => return Step::Answer(problem.into_response()),
    };
    let body = match buffer(body, config.body_limit).await {
        Ok(body) => body,
        Err(problem) => return Step::Answer(problem.into_response()),
    };
    let scope = match route_scope(&parts) {
        Ok(scope) => scope,
        Err(problem) => return Step::Answer(problem.into_response()),
    };
    // The fingerprint takes the request's own path and query: two resources
    // of one route are two requests.
    let target = parts.uri.path_and_query().map_or_else(|| parts.uri.path(), |target| target.as_str());
    let hash = fingerprint::fingerprint(&parts.method, target, &parts.headers, &body, &config.counted_headers);
    let plane_key = key::plane_key(&key, principal.as_deref());
    Step::Next(Keyed { parts, body, organization_id, per_caller: principal.is_some(), scope, plane_key, hash })
}

/// The request's tenant, and its caller when keys are per caller: 401 when
/// either is not named, 500 when the layer was not told whose keys a key
/// is among.
fn caller<R>(config: &Config<R>, parts: &Parts) -> Result<(Uuid, Option<String>), Problem> {
    let Some(organization_id) = (config.tenant)(parts) else {
        return Err(Problem::new(ProblemType::NoTenant, "the request does not name the tenant its key belongs to"));
    };
    let principal = match &config.callers {
        Callers::Shared => None,
        Callers::Each(principal) => match principal(parts) {
            Some(principal) => Some(principal),
            None => {
                return Err(Problem::new(
                    ProblemType::NoPrincipal,
                    "the request does not name the caller its key belongs to",
                ))
            }
        },
        Callers::Unchosen => {
            tracing::error!(
                "the Idempotency-Key layer does not know whose keys a key is among: \
                 configure it with .principal(...) or .shared_across_callers()"
            );
            return Err(Problem::not_configured("the server has not said whether its idempotency keys are per caller"));
        }
    };
    Ok((organization_id, principal))
}

/// The scope of the matched route (`/orders/{id}`), never of each path:
/// scopes, and the metrics labelled by them, stay a bounded set. 500 when
/// the layer sees no matched route.
fn route_scope(parts: &Parts) -> Result<String, Problem> {
    let Some(route) = parts.extensions.get::<MatchedPath>() else {
        tracing::error!(
            "the Idempotency-Key layer sees no matched route: apply it with Router::route_layer or Router::layer"
        );
        return Err(Problem::not_configured("the server applies its idempotency layer where it cannot see the route"));
    };
    Ok(fingerprint::scope(&parts.method, route.as_str()))
}

/// Claims the key, runs the handler under the claim, and keeps its answer;
/// a claim that fails answers 503 (or, failing open, runs the handler
/// unprotected).
async fn protect<S, R>(config: &Config<R>, mut inner: S, keyed: Keyed) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Future: Send,
    R: IdempotencyRepository + 'static,
{
    let held = match claim(config, &keyed).await {
        Ok(Decision::Run(held)) => held,
        Ok(Decision::Answer(response)) => return Ok(response),
        Err(error) => return unavailable(config, error, &mut inner, keyed.into_request()).await,
    };
    tracing::Span::current().record("outcome", "claimed");
    match run_inner(config, held, inner, keyed.into_request()).await {
        Ran::Answered(held, response) => Ok(keep_answer(config, held, response).await),
        Ran::Failed(held, problem) => Ok(keep_problem(held, problem).await),
        Ran::Errored(error) => Err(error),
        Ran::TakenOver(problem) => Ok(problem.into_response()),
    }
}

/// Claims the plane's key through the effect driver and [decides](decide)
/// by its answer; `Err` when the claim failed.
async fn claim<R: IdempotencyRepository + 'static>(config: &Config<R>, keyed: &Keyed) -> Result<Decision<R>, Error> {
    // The driver counts the handler's time and the journal's from before
    // the claim, whose lease the database stamps later: both are cut
    // before the lease can pass, however long the claim took.
    let timing = match config.timing() {
        Ok(timing) => timing,
        Err(refused) => return Ok(Decision::Answer(Problem::not_configured(&refused.to_string()).into_response())),
    };
    let driver = EffectDriver::shared(config.service.clone());
    let effect = Effect {
        organization_id: keyed.organization_id,
        scope: &keyed.scope,
        key: &keyed.plane_key,
        request_hash: &keyed.hash,
        timing,
        request: None,
    };
    Ok(decide(config, driver.begin(&effect).await?))
}

/// What the claim's answer leads to: the key is ours to run, or the layer
/// answers with the journaled answer (replayed), 409 in flight, or 422 key
/// reused.
fn decide<R>(config: &Config<R>, begun: Begun<R>) -> Decision<R> {
    let span = tracing::Span::current();
    let problem = match begun {
        Begun::Held(held) => return Decision::Run(held),
        Begun::Replayed(answer) => {
            span.record("outcome", "replayed").record("replayed", true);
            let replay = serde_json::from_value::<StoredResponse>(answer.output).ok().and_then(|s| s.replay());
            return Decision::Answer(replay.unwrap_or_else(|| {
                tracing::error!("the journaled answer is not one this layer wrote");
                unreadable_answer()
            }));
        }
        Begun::InFlight { .. } => {
            span.record("outcome", "in_flight");
            Problem::new(
                ProblemType::InFlight,
                "the first request with this Idempotency-Key has not finished; retry later",
            )
            .retry_after(config.in_flight_retry_after)
        }
        Begun::Conflict => {
            span.record("outcome", "key_reused");
            Problem::new(
                ProblemType::KeyReused,
                "this key was used for a request with another method, path, query, content type, body or headers",
            )
        }
    };
    Decision::Answer(problem.into_response())
}

/// Runs the handler under `held`, cut off at its timeout. Once it started,
/// only the handler knows whether it took effect: a panic or a timeout is
/// its answer (a problem, kept for the key like any answer), and an error
/// of the service leaves the claim to its lease. None releases the claim,
/// so a retry never runs a handler that may have taken effect a second time.
async fn run_inner<S, R>(config: &Config<R>, held: Held<R>, mut inner: S, request: Request<Body>) -> Ran<R, S::Error>
where
    S: Service<Request<Body>, Response = Response<Body>> + Send,
    S::Future: Send,
    R: IdempotencyRepository + 'static,
{
    // `call` itself may panic, before any future exists: caught like a
    // panic of the future (which the driver catches).
    let ran = async {
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request))) {
            Ok(future) => Ok(future.await),
            Err(panic) => Err(panic),
        }
    };
    match held.run(ran).await {
        Ok(Ok(Ok(response))) => Ran::Answered(held, response),
        Ok(Ok(Err(error))) => {
            let settled = held.settle(Settle::Unknown("the service failed after the handler started")).await;
            tracing::Span::current().record("ending", settled.as_str());
            Ran::Errored(error)
        }
        Ok(Err(_)) | Err(Cut::Panicked) => {
            tracing::error!("the handler panicked after it started; its problem is kept for the key");
            Ran::Failed(held, Problem::started_and_failed(ProblemType::HandlerFailed))
        }
        Err(Cut::TimedOut) => {
            tracing::warn!(
                timeout_ms = config.handler_timeout.as_millis() as u64,
                "the handler timed out after it started; its problem is kept for the key"
            );
            Ran::Failed(held, Problem::started_and_failed(ProblemType::HandlerTimeout))
        }
        Err(cut @ (Cut::NotStarted | Cut::LeaseUnconfirmed)) => {
            // The plane did not confirm the lease: the handler never started,
            // or was stopped (its request's HandlerStop fired) and dropped
            // before another worker could take the key over. The key is left
            // to its lease, and the caller retries as after an outage.
            let why = match cut {
                Cut::NotStarted => "the lease could not be confirmed; the handler never started",
                _ => "the lease could not be confirmed; the handler was stopped",
            };
            let settled = held.settle(Settle::Unknown(why)).await;
            tracing::Span::current().record("ending", settled.as_str());
            Ran::TakenOver(
                Problem::new(
                    ProblemType::Unavailable,
                    "the idempotency plane did not confirm this key's lease; retry later",
                )
                .retry_after(config.unavailable_retry_after),
            )
        }
        Err(Cut::FenceLost) => {
            let settled = held.settle(Settle::Unknown("the claim was taken over by another worker")).await;
            tracing::Span::current().record("ending", settled.as_str());
            Ran::TakenOver(
                Problem::new(ProblemType::InFlight, "another worker holds this Idempotency-Key now; retry later")
                    .retry_after(config.in_flight_retry_after),
            )
        }
    }
}

/// Keeps the problem of a handler that failed after it started as the
/// key's answer, and answers it: the first caller and every repeat get it.
async fn keep_problem<R: IdempotencyRepository>(held: Held<R>, problem: Problem) -> Response<Body> {
    let stored = StoredResponse::refusal(&problem);
    let settled = journal(held, stored, 0).await;
    record_kept(&settled);
    first_answer(&settled, &HeaderMap::new()).unwrap_or_else(|| problem.into_response())
}

/// Keeps the handler's answer as the key's, whatever its status (a 500
/// included: the handler started), and returns what the caller gets: what
/// every replay will say. Only an answer the handler marked
/// [`NothingHappened`](super::NothingHappened), and that is not a success,
/// releases the claim instead. An answer that cannot be read whole is kept
/// without its body.
async fn keep_answer<R: IdempotencyRepository>(
    config: &Config<R>,
    held: Held<R>,
    response: Response<Body>,
) -> Response<Body> {
    let status = response.status();
    if response.extensions().get::<super::NothingHappened>().is_some() {
        if !status.is_success() {
            // The handler says no effect was made, and no success was given.
            release(held).await;
            return response;
        }
        tracing::warn!(%status, "a success marked NothingHappened is kept: a success was given on the strength of its claim");
    }
    let (parts, body) = response.into_parts();
    let buffered = tokio::time::timeout_at(held.effect_deadline(), buffer(body, config.response_body_limit)).await;
    let (answer, stored, body_bytes) = match buffered {
        Ok(Ok(bytes)) => {
            let stored = StoredResponse::of(status, &parts.headers, &config.kept_headers, &bytes);
            let stored = fit(config, stored, bytes.len() as u64);
            let body_bytes = bytes.len() as u64;
            let answer = match stored.refused() {
                Some(refusal) => refusal,
                None => Response::from_parts(parts.clone(), Body::from(bytes)),
            };
            (answer, stored, body_bytes)
        }
        Ok(Err(_)) | Err(_) => {
            // The handler ran (its effect is made) but its answer could not be
            // read whole, in size or in time: keep what is known.
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
    record_kept(&settled);
    // Not journaled (the lease moved on, or the journal failed): the
    // handler's own answer, as nothing replays it.
    first_answer(&settled, &parts.headers).unwrap_or(answer)
}

/// Records how keeping an answer ended on the span (and logs an answer the
/// journal did not take).
fn record_kept(settled: &Settled) {
    tracing::Span::current().record("ending", settled.as_str());
    if let Settled::LeftToLease(why) = settled {
        tracing::error!(reason = %why, "the answer could not be journaled; the claim frees itself when its lease passes");
    }
}

/// What the first caller gets once an answer is journaled: exactly what a
/// replay will say (status, kept headers, the body or its omission), less
/// `Idempotent-Replayed`; and the handler's own `headers` a replay leaves
/// out on purpose (credentials, headers not kept) unless the journal keeps
/// a refusal the layer answered in the handler's place. A journaled answer
/// no replay could read is answered as a replay answers it. `None` when
/// nothing was journaled.
fn first_answer(settled: &Settled, headers: &HeaderMap) -> Option<Response<Body>> {
    let journaled = settled.journaled()?;
    let stored = serde_json::from_value::<StoredResponse>(journaled.output.clone()).ok();
    let Some((stored, mut response)) = stored.and_then(|stored| stored.replay().map(|response| (stored, response)))
    else {
        tracing::error!("the journaled answer is not one this layer can replay");
        return Some(unreadable_answer());
    };
    response.headers_mut().remove("idempotent-replayed");
    if !stored.refused {
        let replayed: Vec<_> = response.headers().keys().cloned().collect();
        let body_omitted = stored.body_omitted.is_some();
        for (name, value) in headers {
            let describes_body = BODY_HEADERS.contains(&name.as_str());
            let copied = !describes_body || (!body_omitted && name != "content-length" && name != "transfer-encoding");
            if copied && !replayed.contains(name) {
                response.headers_mut().append(name.clone(), value.clone());
            }
        }
    }
    Some(response)
}

/// 500 `unreadable-answer`: the key completed, but its journaled answer is
/// not an HTTP answer this layer wrote.
fn unreadable_answer() -> Response<Body> {
    Problem::new(ProblemType::UnreadableAnswer, "this key completed, but its journaled answer is not an HTTP answer")
        .into_response()
}

/// Releases a claim whose handler said nothing happened; the span records how.
async fn release<R: IdempotencyRepository>(held: Held<R>) {
    let settled = held.settle(Settle::Release).await;
    tracing::Span::current().record("ending", settled.as_str());
}

/// Journals `stored` through the driver (within the journal's deadline,
/// retried on transient failures). An answer the store refuses (above the
/// scope's own limit, which may be lower than this service's) is journaled
/// again without its body, so that a repeat replays instead of running the
/// handler again.
async fn journal<R: IdempotencyRepository>(held: Held<R>, stored: StoredResponse, body_bytes: u64) -> Settled {
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
/// the scope, no plane for the tenant) is 500 either way.
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
        return Ok(Problem::not_configured("the server has no idempotency policy for this route").into_response());
    }
    if let Error::UnroutedOrganization { .. } = error {
        tracing::error!(%error, "the tenant router has no plane for this organization; assign it (or name a default plane)");
        return Ok(Problem::not_configured("the server has no idempotency plane for this tenant").into_response());
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
