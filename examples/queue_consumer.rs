//! A Supabase Queues consumer whose effects happen once, as a Rust process:
//! the same contract as the example Edge Function
//! (`supabase/functions/queue-consumer/index.ts`), so one queue, one
//! downstream service and one schedule serve either, and the kill test
//! (`supabase/functions/tests/queue_kill_test.ts`) drives both at once.
//!
//! - `POST /` with the route secret `IDEM_ROUTE_SECRET` or a service key of
//!   the environment, as `Authorization: Bearer` or `apikey`: drains one batch (up to
//!   `BATCH` messages, default 10) of the queue `QUEUE_NAME` and answers the
//!   counts `{"read", "ran", "replayed", "failed", "archived",
//!   "dead_lettered", "left", "redriven"}`; without a credential, 401 (another
//!   method, 405; another path, 404).
//!
//! A message is JSON `{"idempotency_key": "…", "payload": …}`. Processing
//! forwards `payload` to `PROCESS_URL` (POST, the tenant's vendor key as
//! `Idempotency-Key`), done when that answers 2xx; a 4xx other than 408, 409
//! and 429 is a failure for good (journaled, and dead-lettered to
//! `DEAD_LETTER_QUEUE`, default `QUEUE_NAME_dlq`); anything else leaves the
//! message to come back.
//!
//! ```sh
//! idem up --with-pgmq --queue orders --queue orders_dlq --env-file plane.env &
//! set -a; . ./plane.env; set +a
//! QUEUE_NAME=orders PROCESS_URL=http://127.0.0.1:9000/ PORT=0 \
//!   cargo run --example queue_consumer --features axum
//! ```
//!
//! Also `ORGANIZATION_ID` (the tenant of the queue's messages), `MAX_READS`
//! (default 5), `QUEUE_PATH` (`auto`, `plane` or `data_api`) and the timing,
//! `EFFECT_TIMEOUT_MS`, `JOURNAL_DEADLINE_MS` (10 000 each) and
//! `LEASE_MARGIN_MS` (5 000). The first line on stdout is
//! `listening on http://HOST:PORT`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotency_plane::callers::queue::{ConsumerOptions, QueueConsumer, QueuePath, Queues};
use idempotency_plane::callers::route::{caller_authorized, route_credentials_from_env};
use idempotency_plane::service::{Answer, EffectDriver, Settle, Timing};
use idempotency_plane::{ClientConfig, IdempotencyService, PostgrestClient, PostgrestRepository};
use serde_json::{json, Value};
use uuid::Uuid;

/// The tenant when `ORGANIZATION_ID` is not set.
const DEMO_ORGANIZATION: Uuid = Uuid::from_u128(0x0000_0000_0000_4000_8000_0000_0000_0001);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Consumer {
    drainer: QueueConsumer<PostgrestRepository>,
    process_url: String,
    http: reqwest::Client,
    /// Who may call: the route secret and the service key.
    credentials: Vec<String>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn required(name: &str) -> Result<String, BoxError> {
    var(name).ok_or_else(|| format!("set {name}").into())
}

fn whole(name: &str, default: u64) -> Result<u64, BoxError> {
    match var(name) {
        Some(text) => text.parse().map_err(|_| format!("{name} must be a whole number, got {text:?}").into()),
        None => Ok(default),
    }
}

impl Consumer {
    /// Forwards one message's payload downstream: done on 2xx.
    async fn forward(&self, payload: Value, vendor_key: String) -> Settle {
        let answer =
            self.http.post(&self.process_url).header("idempotency-key", vendor_key).json(&payload).send().await;
        let status = match answer {
            Ok(answer) => answer.status(),
            Err(_) => return Settle::Unknown("PROCESS_URL unreachable"),
        };
        if status.is_success() {
            return Settle::Journal(Answer::success(json!({"forwarded": status.as_u16()})));
        }
        if status.is_server_error() || [408, 409, 429].contains(&status.as_u16()) {
            return Settle::Unknown("PROCESS_URL answered a status worth trying again");
        }
        Settle::Journal(Answer::failure("process_failed", json!({"status": status.as_u16()})))
    }
}

async fn drain(State(consumer): State<Arc<Consumer>>, headers: HeaderMap) -> Response {
    if !caller_authorized(&headers, &consumer.credentials) {
        let refused = json!({"error": "POST / takes the route secret or the service key"});
        return (StatusCode::UNAUTHORIZED, Json(refused)).into_response();
    }
    let drained =
        consumer.drainer.drain(|payload, context| consumer.forward(payload, context.vendor_key.clone())).await;
    match drained {
        Ok(drained) => Json(drained).into_response(),
        Err(error) => {
            tracing::error!(%error, "the drain failed");
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "the drain failed; try again"}))).into_response()
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let config = ClientConfig::from_env()?.ok_or("set SUPABASE_URL (or IDEM_POSTGREST_URL) and the service key")?;
    let queue = required("QUEUE_NAME")?;
    let organization_id = match var("ORGANIZATION_ID") {
        Some(id) => id.parse().map_err(|_| format!("ORGANIZATION_ID {id:?} is not a UUID"))?,
        None => DEMO_ORGANIZATION,
    };
    let timing = Timing::new(
        Duration::from_millis(whole("EFFECT_TIMEOUT_MS", 10_000)?),
        Duration::from_millis(whole("JOURNAL_DEADLINE_MS", 10_000)?),
        Duration::from_millis(whole("LEASE_MARGIN_MS", 5_000)?),
    )?;
    let dead_letters = var("DEAD_LETTER_QUEUE").unwrap_or_else(|| format!("{queue}_dlq"));
    let mut options = ConsumerOptions::new(&queue, dead_letters, organization_id, timing);
    options.batch_size = u32::try_from(whole("BATCH", 10)?)?;
    if options.batch_size == 0 {
        return Err("BATCH must be at least 1".into());
    }
    options.max_reads = i32::try_from(whole("MAX_READS", 5)?)?;
    options.path = match var("QUEUE_PATH").as_deref() {
        None | Some("auto") => QueuePath::Auto,
        Some("plane") => QueuePath::Plane,
        Some("data_api") => QueuePath::DataApi,
        Some(other) => return Err(format!("QUEUE_PATH must be auto, plane or data_api, got {other:?}").into()),
    };
    let credentials = route_credentials_from_env()?;
    let queues = Queues::new(config.clone())?;
    let repo = PostgrestRepository::new(PostgrestClient::new(config)?);
    let drainer = QueueConsumer::new(EffectDriver::new(IdempotencyService::new(repo)), queues, options)?;
    let consumer = Arc::new(Consumer {
        drainer,
        process_url: required("PROCESS_URL")?,
        http: reqwest::Client::builder().timeout(timing.effect()).build()?,
        credentials,
    });

    let app = Router::new().route("/", post(drain)).with_state(consumer);
    let host = var("HOST").unwrap_or_else(|| "127.0.0.1".to_owned());
    let listener = tokio::net::TcpListener::bind((host.as_str(), u16::try_from(whole("PORT", 8000)?)?)).await?;
    let address = listener.local_addr()?;
    println!("listening on http://{address}");
    axum::serve(listener, app).await?;
    Ok(())
}
