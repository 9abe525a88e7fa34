//! The webhook gate mounted as an axum route (feature `axum`).
//!
//! `POST /callbacks/{provider}/{job_id}`: the body is read first, up to the
//! gate's [body limit](WebhookGate::with_body_limit) (256 KiB by default,
//! what the `webhook.*` scope always stores): a Content-Length above it is
//! refused 413 unread, a body that passes it while streaming is refused 413
//! as soon as it does ([`read_bounded_body`]), before the signature is
//! checked or anything else is done. The caller's verifier then checks the
//! request's signature (401 when it fails), before any lookup or claim, so a
//! forged body can never take a delivery id. The delivery id
//! comes from the `webhook-id` header (Standard Webhooks) or
//! `x-delivery-id`; the body's `job_id`, when it is JSON and names one (a
//! string or a number), must match the path. Every ACK is 200 with
//! `{"ack": …, "drop_reason": …}`; a delivery to process again later is 503;
//! a request without a delivery id is 400.

use std::future::Future;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{json, Value};

use super::webhook::{Ack, ProcessingError, ProviderCallback, ProviderJob, RetryReason, WebhookGate};
use crate::repo::{IdempotencyRepository, ProviderJobRepository};

/// The headers a delivery id is read from, in order.
pub const DELIVERY_ID_HEADERS: [&str; 2] = ["webhook-id", "x-delivery-id"];

struct Route<R, J, V, P> {
    gate: WebhookGate<R, J>,
    verify: V,
    process: P,
}

/// A router serving provider callbacks through `gate`.
///
/// `verify(provider, headers, body)` authenticates the request with the
/// provider's signature scheme and runs before anything else; `process`
/// handles a delivery the gate lets through, with the job it belongs to and
/// the body.
pub fn provider_callback_router<R, J, V, P, Fut>(gate: WebhookGate<R, J>, verify: V, process: P) -> Router
where
    R: IdempotencyRepository + 'static,
    J: ProviderJobRepository + 'static,
    V: Fn(&str, &HeaderMap, &Bytes) -> bool + Send + Sync + 'static,
    P: Fn(ProviderJob, Bytes) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
{
    let route = Arc::new(Route { gate, verify, process });
    Router::new().route("/callbacks/{provider}/{job_id}", post(callback::<R, J, V, P, Fut>)).with_state(route)
}

async fn callback<R, J, V, P, Fut>(
    State(route): State<Arc<Route<R, J, V, P>>>,
    Path((provider, job_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response
where
    R: IdempotencyRepository + 'static,
    J: ProviderJobRepository + 'static,
    V: Fn(&str, &HeaderMap, &Bytes) -> bool + Send + Sync + 'static,
    P: Fn(ProviderJob, Bytes) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
{
    let body = match read_bounded_body(&headers, body, route.gate.body_limit()).await {
        Ok(body) => body,
        Err(refused) => {
            tracing::warn!(provider, job_id, %refused, "callback refused before its signature was checked");
            return refused.into_response();
        }
    };
    if !(route.verify)(&provider, &headers, &body) {
        tracing::warn!(provider, job_id, "callback refused: its signature did not verify");
        return refusal(StatusCode::UNAUTHORIZED, "signature did not verify");
    }
    let Some(delivery_id) = DELIVERY_ID_HEADERS
        .iter()
        .find_map(|name| headers.get(*name).and_then(|v| v.to_str().ok()))
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
    else {
        tracing::warn!(provider, job_id, "callback refused: no delivery id to dedupe on");
        return refusal(StatusCode::BAD_REQUEST, "no webhook-id or x-delivery-id header");
    };
    let body_job_id = serde_json::from_slice::<Value>(&body).ok().and_then(|v| match v.get("job_id") {
        Some(Value::String(id)) => Some(id.clone()),
        Some(Value::Number(id)) => Some(id.to_string()),
        _ => None,
    });
    let callback = ProviderCallback {
        provider: &provider,
        path_job_id: &job_id,
        body_job_id: body_job_id.as_deref(),
        delivery_id: &delivery_id,
        body: &body,
    };
    let process = {
        let (route, body) = (route.clone(), body.clone());
        move |job| (route.process)(job, body.clone())
    };
    let ack = route.gate.handle_provider_callback(callback, process).await;
    ack_response(&ack)
}

/// Why a webhook route refused a request's body before anything else
/// looked at it ([`read_bounded_body`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BodyRefusal {
    /// Above the limit: by its Content-Length (not a byte read), or once it
    /// passed the limit while streaming (nothing more read). 413.
    #[error("the body is larger than this endpoint reads ({limit} bytes)")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body broke off while it was read. 400.
    #[error("the body could not be read")]
    Unreadable,
}

impl BodyRefusal {
    /// The reason as the answer names it, as the TypeScript
    /// `webhookHandler` does: `body_too_large` or `body_unreadable`.
    pub fn as_str(&self) -> &'static str {
        match self {
            BodyRefusal::TooLarge { .. } => "body_too_large",
            BodyRefusal::Unreadable => "body_unreadable",
        }
    }

    /// The HTTP status: 413 or 400.
    pub fn status(&self) -> StatusCode {
        match self {
            BodyRefusal::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyRefusal::Unreadable => StatusCode::BAD_REQUEST,
        }
    }
}

impl IntoResponse for BodyRefusal {
    /// `{"ack": "rejected", "reason": …, "error": …}` with its status, as
    /// the TypeScript `webhookHandler` answers it.
    fn into_response(self) -> Response {
        let answer = json!({"ack": "rejected", "reason": self.as_str(), "error": self.to_string()});
        (self.status(), Json(answer)).into_response()
    }
}

/// Reads a webhook request's body up to `limit` bytes, before anything
/// else looks at the request: a `Content-Length` above the limit is refused
/// unread, and a body that passes the limit while streaming is refused as
/// soon as it does. Give it the gate's [`body_limit`](WebhookGate::body_limit),
/// so that every body read can be stored with its claim.
pub async fn read_bounded_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, BodyRefusal> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok());
    if declared.is_some_and(|declared| declared > limit as u64) {
        return Err(BodyRefusal::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => Err(BodyRefusal::TooLarge { limit }),
        Err(_) => Err(BodyRefusal::Unreadable),
    }
}

fn refusal(status: StatusCode, reason: &str) -> Response {
    (status, Json(json!({ "error": reason }))).into_response()
}

/// The HTTP answer for `ack`: 200 with the ACK and its drop reason, or 503.
pub fn ack_response(ack: &Ack) -> Response {
    let status = StatusCode::from_u16(ack.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let body = match ack {
        Ack::Processed => json!({"ack": "processed"}),
        Ack::Failed { error } => json!({"ack": "failed", "error": error}),
        Ack::Accepted => json!({"ack": "accepted"}),
        Ack::Dropped(reason) => json!({"ack": "dropped", "drop_reason": reason.as_str()}),
        Ack::Retry(RetryReason::DeliveryTooLarge) => json!({"ack": "retry", "reason": "delivery_too_large"}),
        Ack::Retry(_) => json!({"ack": "retry"}),
    };
    (status, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use futures_util::StreamExt;

    use super::*;

    /// A body of `chunks` pieces of `chunk` bytes with no length it
    /// declares, pulled only when read, counting the bytes it gave.
    fn streamed(chunks: usize, chunk: usize, pulled: &Arc<AtomicUsize>) -> Body {
        let pulled = pulled.clone();
        Body::from_stream(futures_util::stream::iter(0..chunks).map(move |_| {
            pulled.fetch_add(chunk, Ordering::SeqCst);
            Ok::<_, std::io::Error>(Bytes::from(vec![b'a'; chunk]))
        }))
    }

    fn declaring(length: u64) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(axum::http::header::CONTENT_LENGTH, length.into());
        headers
    }

    #[tokio::test]
    async fn a_body_at_the_limit_is_read_whole_and_one_above_it_is_refused_having_read_about_the_limit() {
        let (limit, chunk) = (64 * 1024, 4 * 1024);
        let pulled = Arc::new(AtomicUsize::new(0));
        let whole = read_bounded_body(&HeaderMap::new(), streamed(16, chunk, &pulled), limit).await;
        assert_eq!(whole.map(|body| body.len()), Ok(limit));

        // 400 MiB on offer, no Content-Length: refused once past the limit.
        let pulled = Arc::new(AtomicUsize::new(0));
        let refused = read_bounded_body(&HeaderMap::new(), streamed(100 * 1024, chunk, &pulled), limit).await;
        assert_eq!(refused, Err(BodyRefusal::TooLarge { limit }));
        assert!(pulled.load(Ordering::SeqCst) <= limit + chunk, "stopped at once: {pulled:?}");
    }

    #[tokio::test]
    async fn a_declared_length_above_the_limit_is_refused_unread_and_a_broken_body_is_unreadable() {
        let pulled = Arc::new(AtomicUsize::new(0));
        let refused = read_bounded_body(&declaring(1025), streamed(1, 1025, &pulled), 1024).await;
        assert_eq!(refused, Err(BodyRefusal::TooLarge { limit: 1024 }));
        assert_eq!(pulled.load(Ordering::SeqCst), 0, "not a byte read");
        let at_limit = read_bounded_body(&declaring(1024), streamed(1, 1024, &pulled), 1024).await;
        assert_eq!(at_limit.map(|body| body.len()), Ok(1024));

        let broken = Body::from_stream(futures_util::stream::iter([
            Ok(Bytes::from_static(b"{\"id\":")),
            Err(std::io::Error::other("connection reset")),
        ]));
        assert_eq!(read_bounded_body(&HeaderMap::new(), broken, 1024).await, Err(BodyRefusal::Unreadable));
    }

    #[tokio::test]
    async fn a_refusal_answers_as_the_typescript_handler_does() {
        let response = BodyRefusal::TooLarge { limit: 262_144 }.into_response();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            answer,
            json!({
                "ack": "rejected",
                "reason": "body_too_large",
                "error": "the body is larger than this endpoint reads (262144 bytes)",
            })
        );
        assert_eq!(BodyRefusal::Unreadable.into_response().status(), StatusCode::BAD_REQUEST);
    }
}
