//! A webhook receiver whose events outlive its worker, as a Rust process:
//! the same contract as the example Edge Function
//! (`supabase/functions/webhooks/index.ts`), so one vendor, one downstream
//! service and one re-drive schedule serve either.
//!
//! - `POST /`: a delivery whose body is within the gate's body limit
//!   (`IDEM_WEBHOOK_BODY_LIMIT_BYTES`, default 262 144 bytes, what the
//!   `webhook.*` scope always stores: 413 before anything else otherwise,
//!   the signature unchecked), signed as Standard Webhooks signs it
//!   (headers `webhook-id`, `webhook-timestamp`, `webhook-signature`,
//!   checked with the `standardwebhooks` crate before anything else is done
//!   with it: 401 and never claimed otherwise), claimed with its body under
//!   its `webhook-id`, answered
//!   within the gate's deadline, and processed once: the body is forwarded
//!   to `PROCESS_URL` (POST, the tenant's vendor key as `Idempotency-Key`),
//!   done when that answers 2xx.
//! - `POST /redrive` with the route secret `IDEM_ROUTE_SECRET` (what the
//!   pg_cron recipe sends) or a service key of the environment (what `idem
//!   redrive --to` sends), as `Authorization: Bearer` or `apikey`: re-drives
//!   the orphans of its scope (up to the body's `{"limit": N}`, default 50)
//!   through the same processing, and answers `{"redriven", "journaled",
//!   "dead_lettered", "left"}`; without a credential, 401.
//!
//! ```sh
//! idem up --env-file plane.env &   # IDEM_POSTGREST_URL, IDEM_SERVICE_KEY
//! set -a; . ./plane.env; set +a
//! WEBHOOK_SECRET=whsec_… PROCESS_URL=http://127.0.0.1:9000/ PORT=0 \
//!   cargo run --example webhook_gate --features axum
//! ```
//!
//! Also `ORGANIZATION_ID` (the tenant of these deliveries),
//! `HEARTBEAT_LEASE_MS` (default 10 000) and `IDEM_WEBHOOK_BODY_LIMIT_BYTES`
//! (default 262 144; `idem doctor` checks the scope stores it). The first line on stdout is
//! `listening on http://HOST:PORT`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency_plane::callers::http::read_bounded_body;
use idempotency_plane::callers::route::{caller_authorized, route_credentials_from_env};
use idempotency_plane::callers::tool::vendor_key;
use idempotency_plane::callers::webhook::{
    Ack, Delivery, ProcessingError, ProviderJobs, Redelivery, RetryReason, WebhookGate, WEBHOOK_BODY_LIMIT_VAR,
};
use idempotency_plane::{ClientConfig, IdempotencyService, PostgrestClient, PostgrestRepository};
use serde_json::{json, Value};
use standardwebhooks::Webhook;
use uuid::Uuid;

/// The scope of these deliveries: under `webhook.*`, as the Edge Function's.
const SCOPE: &str = "webhook.standard";

/// The tenant when `ORGANIZATION_ID` is not set.
const DEMO_ORGANIZATION: Uuid = Uuid::from_u128(0x0000_0000_0000_4000_8000_0000_0000_0001);

/// The most orphans one `POST /redrive` takes over by default.
const REDRIVE_BATCH: u64 = 50;

type Gate = WebhookGate<PostgrestRepository, PostgrestRepository>;

struct Receiver {
    gate: Gate,
    verifier: Webhook,
    organization_id: Uuid,
    process_url: String,
    http: reqwest::Client,
    /// Who may call `POST /redrive`: the route secret and the service keys.
    credentials: Vec<String>,
    max_rows: u64,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn required(name: &str) -> Result<String, BoxError> {
    std::env::var(name).ok().filter(|v| !v.is_empty()).ok_or_else(|| format!("set {name}").into())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let config = ClientConfig::from_env()?.ok_or("set IDEM_POSTGREST_URL and IDEM_SERVICE_KEY (idem up --env-file)")?;
    let max_rows = u64::from(config.max_rows());
    let client = PostgrestClient::new(config)?;
    let heartbeat = match std::env::var("HEARTBEAT_LEASE_MS") {
        Ok(ms) => Duration::from_millis(ms.parse()?),
        Err(_) => Duration::from_secs(10),
    };
    let gate = WebhookGate::new(
        IdempotencyService::new(PostgrestRepository::new(client.clone())),
        ProviderJobs::new(PostgrestRepository::new(client)),
    )
    .with_heartbeats(heartbeat)?;
    let gate = match std::env::var(WEBHOOK_BODY_LIMIT_VAR) {
        Ok(bytes) => gate.with_body_limit(bytes.parse()?),
        Err(_) => gate,
    };
    let organization_id = match std::env::var("ORGANIZATION_ID") {
        Ok(id) => id.parse()?,
        Err(_) => DEMO_ORGANIZATION,
    };
    let receiver = Arc::new(Receiver {
        gate,
        verifier: Webhook::new(&required("WEBHOOK_SECRET")?)?,
        organization_id,
        process_url: required("PROCESS_URL")?,
        http: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?,
        credentials: route_credentials_from_env()?,
        max_rows,
    });
    let app = Router::new().route("/", post(deliveries)).route("/redrive", post(redrive)).with_state(receiver);
    let port: u16 = std::env::var("PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(8082);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// Forwards `body` to the downstream service under the event's vendor key;
/// done when it answers 2xx, tried again (retryable) otherwise.
async fn forward(
    http: reqwest::Client,
    url: String,
    organization_id: Uuid,
    delivery_id: String,
    body: Vec<u8>,
) -> Result<Value, ProcessingError> {
    let key = vendor_key(organization_id, SCOPE, &delivery_id);
    let sent = http.post(url).header("idempotency-key", key).body(body).send().await;
    match sent {
        Ok(answer) if answer.status().is_success() => Ok(json!({"forwarded": answer.status().as_u16()})),
        Ok(answer) => Err(ProcessingError::retryable(format!("downstream answered {}", answer.status()))),
        Err(error) => Err(ProcessingError::retryable(format!("downstream unreachable: {error}"))),
    }
}

async fn deliveries(State(receiver): State<Arc<Receiver>>, headers: HeaderMap, body: Body) -> Response {
    // What the plane could not store is refused first, unread past the limit.
    let body = match read_bounded_body(&headers, body, receiver.gate.body_limit()).await {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    if receiver.verifier.verify(&body, &headers).is_err() {
        return (StatusCode::UNAUTHORIZED, Json(json!({"error": "signature_invalid"}))).into_response();
    }
    let Some(delivery_id) = headers.get("webhook-id").and_then(|id| id.to_str().ok()).map(str::to_owned) else {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "no_event_id"}))).into_response();
    };
    let delivery =
        Delivery { organization_id: receiver.organization_id, scope: SCOPE, delivery_id: &delivery_id, body: &body };
    let (http, url, org, id, bytes) = (
        receiver.http.clone(),
        receiver.process_url.clone(),
        receiver.organization_id,
        delivery_id.clone(),
        body.to_vec(),
    );
    let ack = receiver
        .gate
        .handle(delivery, move || forward(http.clone(), url.clone(), org, id.clone(), bytes.clone()))
        .await;
    let status = StatusCode::from_u16(ack.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let answer = match &ack {
        Ack::Processed => json!({"ack": "processed"}),
        Ack::Failed { error } => json!({"ack": "failed", "error": error}),
        Ack::Accepted => json!({"ack": "accepted"}),
        Ack::Dropped(reason) => json!({"ack": "dropped", "drop_reason": reason.as_str()}),
        Ack::Retry(RetryReason::DeliveryTooLarge) => json!({"ack": "retry", "reason": "delivery_too_large"}),
        Ack::Retry(_) => json!({"ack": "retry"}),
    };
    (status, Json(answer)).into_response()
}

async fn redrive(State(receiver): State<Arc<Receiver>>, headers: HeaderMap, body: Bytes) -> Response {
    if !caller_authorized(&headers, &receiver.credentials) {
        let refusal = json!({"error": "POST /redrive takes the route secret or a service key"});
        return (StatusCode::UNAUTHORIZED, Json(refusal)).into_response();
    }
    let ask: Value = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(ask) => ask,
            Err(_) => {
                return (StatusCode::BAD_REQUEST, Json(json!({"error": "the body must be JSON"}))).into_response()
            }
        }
    };
    let limit = match ask.get("limit") {
        None => REDRIVE_BATCH,
        Some(limit) => match limit.as_u64().filter(|n| (1..=receiver.max_rows).contains(n)) {
            Some(limit) => limit,
            None => {
                let refusal = json!({"error": format!("limit must be an integer from 1 to {}", receiver.max_rows)});
                return (StatusCode::BAD_REQUEST, Json(refusal)).into_response();
            }
        },
    };
    if ask.get("scope").is_some_and(|scope| scope != SCOPE) {
        let refusal = json!({"error": format!("this route re-drives {SCOPE} only")});
        return (StatusCode::BAD_REQUEST, Json(refusal)).into_response();
    }
    let (http, url) = (receiver.http.clone(), receiver.process_url.clone());
    let process =
        |event: Redelivery| forward(http.clone(), url.clone(), event.organization_id, event.delivery_id, event.body);
    match receiver.gate.redrive_of(Some(receiver.organization_id), SCOPE, limit, process).await {
        Ok(report) => Json(json!({
            "redriven": report.redriven,
            "journaled": report.journaled,
            "dead_lettered": report.dead_lettered,
            "left": report.left,
        }))
        .into_response(),
        Err(error) => {
            tracing::error!(%error, "re-drive failed");
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "the plane could not re-drive"}))).into_response()
        }
    }
}
