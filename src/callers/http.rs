//! The webhook gate mounted as an axum route (feature `axum`).
//!
//! `POST /callbacks/{provider}/{job_id}`: the caller's verifier checks the
//! request's signature first (401 when it fails), before any lookup or
//! claim, so a forged body can never take a delivery id. The delivery id
//! comes from the `webhook-id` header (Standard Webhooks) or
//! `x-delivery-id`; the body's `job_id`, when it is JSON and names one (a
//! string or a number), must match the path. Every ACK is 200 with
//! `{"ack": …, "drop_reason": …}`; a delivery to process again later is 503;
//! a request without a delivery id is 400.

use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
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
    body: Bytes,
) -> Response
where
    R: IdempotencyRepository + 'static,
    J: ProviderJobRepository + 'static,
    V: Fn(&str, &HeaderMap, &Bytes) -> bool + Send + Sync + 'static,
    P: Fn(ProviderJob, Bytes) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
{
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

fn refusal(status: StatusCode, reason: &str) -> Response {
    (status, Json(json!({ "error": reason }))).into_response()
}

/// The HTTP answer for `ack`: 200 with the ACK and its drop reason, or 503.
pub fn ack_response(ack: &Ack) -> Response {
    let status = StatusCode::from_u16(ack.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let body = match ack {
        Ack::Processed => json!({"ack": "processed"}),
        Ack::Accepted => json!({"ack": "accepted"}),
        Ack::Dropped(reason) => json!({"ack": "dropped", "drop_reason": reason.as_str()}),
        Ack::Retry(RetryReason::DeliveryTooLarge) => json!({"ack": "retry", "reason": "delivery_too_large"}),
        Ack::Retry(_) => json!({"ack": "retry"}),
    };
    (status, Json(body)).into_response()
}
