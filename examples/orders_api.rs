//! An orders API made idempotent by the `Idempotency-Key` layer, on the
//! embedded local stack (a throwaway database behind the in-process
//! PostgREST-compatible server).
//!
//! ```sh
//! cargo run --release --features local --example orders_api       # PORT=0 picks a free port
//! curl -si localhost:8080/orders -H 'idempotency-key: k1' -H 'content-type: application/json' -d '{"sku":"A","qty":1}'
//! ```
//!
//! `POST /orders` takes a JSON body and answers 201 with a new order id;
//! `?delay_ms=N` makes the handler take N ms, to try concurrency by hand. The
//! tenant is the `x-organization-id` header's UUID, or a demo organization.
//! The first line on stdout is `listening on http://HOST:PORT`.

use std::time::Duration;

use axum::extract::Query;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use idempotency_plane::callers::idempotency_key::IdempotencyKeyLayer;
use idempotency_plane::local::{LocalStack, LocalStackConfig};
use serde_json::{json, Value};
use uuid::Uuid;

/// The organization of requests that do not name one.
const DEMO_ORGANIZATION: Uuid = Uuid::from_u128(0x0000_0000_0000_4000_8000_0000_0000_0001);

/// The longest `?delay_ms` honoured: the layer cuts a handler off at 30 s.
const MAX_DELAY_MS: u64 = 25_000;

#[derive(serde::Deserialize)]
struct Options {
    delay_ms: Option<u64>,
}

async fn create_order(Query(options): Query<Options>, Json(order): Json<Value>) -> impl IntoResponse {
    if let Some(ms) = options.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms.min(MAX_DELAY_MS))).await;
    }
    let id = Uuid::new_v4();
    let mut headers = HeaderMap::new();
    if let Ok(location) = format!("/orders/{id}").parse() {
        headers.insert("location", location);
    }
    (StatusCode::CREATED, headers, Json(json!({"id": id, "status": "created", "order": order})))
}

fn tenant(parts: &axum::http::request::Parts) -> Option<Uuid> {
    match parts.headers.get("x-organization-id") {
        None => Some(DEMO_ORGANIZATION),
        Some(value) => value.to_str().ok()?.parse().ok(),
    }
}

/// The caller a request's key belongs to: here the `x-user-id` header, or
/// one demo user. A real API names the authenticated user or API key, so
/// two callers of one tenant never share a key (and never each other's
/// answer).
fn caller(parts: &axum::http::request::Parts) -> Option<String> {
    match parts.headers.get("x-user-id") {
        None => Some("demo-user".to_owned()),
        Some(value) => value.to_str().ok().map(str::to_owned),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,postrust_server::build=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse().map_err(|_| format!("PORT={port:?} is not a port number"))?,
        Err(_) => 8080,
    };
    let stack = LocalStack::start(LocalStackConfig::default()).await?;
    let layer = IdempotencyKeyLayer::new(stack.service()?, tenant).principal(caller);
    let app = Router::new().route("/orders", post(create_order)).route_layer(layer);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    eprintln!("the plane's PostgREST-compatible server: {} (Ctrl-C stops both)", stack.url());
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    stack.stop().await?;
    Ok(served?)
}
