//! The `Idempotency-Key` layer on the real stack, through real HTTP: an axum
//! API bound on loopback, called with reqwest.
//!
//! By what each group shows: `replay` (what a repeat answers, and to whom),
//! `conflict` (what is another request under one key), `refusals` (what is
//! refused before a handler runs), `handler_endings` (how a handler's ending
//! decides its claim) and `plane_faults` (endings that hold when the plane
//! is slow, lossy or gone). Here: the orders API they all serve, and the
//! layers, requests and problem checks they share.

mod conflict;
mod handler_endings;
mod plane_faults;
mod refusals;
mod replay;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency_plane::callers::idempotency_key::{IdempotencyKeyLayer, NothingHappened};
use idempotency_plane::local::LocalStack;
use idempotency_plane::PostgrestRepository;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::support::harness::*;

/// The API under test: `POST /orders` creates an order with a fresh id.
/// Headers make the handler slow (`x-delay-ms`), wait for a permit
/// (`x-hold`), panic (`x-panic`), or answer a given status (`x-status`),
/// marked as having made no effect (`x-nothing-happened`);
/// headers are not part of a request's identity unless counted.
#[derive(Clone)]
struct Orders {
    runs: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

impl Default for Orders {
    fn default() -> Self {
        Orders { runs: Arc::default(), gate: Arc::new(Semaphore::new(0)) }
    }
}

fn flag(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

async fn create_order(State(orders): State<Orders>, flags: HeaderMap, body: String) -> axum::response::Response {
    orders.runs.fetch_add(1, Ordering::SeqCst);
    if let Some(ms) = flag(&flags, "x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if flag(&flags, "x-hold").is_some() {
        orders.gate.acquire().await.expect("gate").forget();
    }
    if flag(&flags, "x-panic").is_some() {
        panic!("the handler failed half-way");
    }
    let status = StatusCode::from_u16(flag(&flags, "x-status").map_or(201, |s| s as u16)).expect("status");
    let id = Uuid::new_v4();
    let mut headers = HeaderMap::new();
    headers.insert("location", format!("/orders/{id}").parse().expect("header"));
    headers.insert("x-not-kept", "1".parse().expect("header"));
    let answer = Json(json!({"id": id, "received": body}));
    match flag(&flags, "x-nothing-happened") {
        Some(_) => (status, NothingHappened, headers, answer).into_response(),
        None => (status, headers, answer).into_response(),
    }
}

struct Api {
    url: String,
    orders: Orders,
    http: reqwest::Client,
}

impl Api {
    fn post(&self, key: Option<&str>, flags: &[(&str, &str)], body: &str) -> reqwest::RequestBuilder {
        self.post_as(TENANT, key, flags, body)
    }

    fn post_as(&self, tenant: &str, key: Option<&str>, flags: &[(&str, &str)], body: &str) -> reqwest::RequestBuilder {
        let mut request = self
            .http
            .post(format!("{}/orders", self.url))
            .header("content-type", "application/json")
            .header("x-tenant", tenant)
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        if !flags.iter().any(|(name, _)| *name == "x-user") {
            request = request.header("x-user", "user-1");
        }
        for (name, value) in flags {
            request = request.header(*name, *value);
        }
        request
    }

    fn runs(&self) -> usize {
        self.orders.runs.load(Ordering::SeqCst)
    }
}

const TENANT: &str = "6f1c1e5e-0000-4000-8000-000000000001";

fn tenant(parts: &axum::http::request::Parts) -> Option<Uuid> {
    parts.headers.get("x-tenant")?.to_str().ok()?.parse().ok()
}

/// The caller: the `x-user` header.
fn user(parts: &axum::http::request::Parts) -> Option<String> {
    parts.headers.get("x-user")?.to_str().ok().map(str::to_owned)
}

/// The layer over `service`, each caller's keys its own.
fn keyed(service: Service) -> IdempotencyKeyLayer<PostgrestRepository> {
    IdempotencyKeyLayer::new(service, tenant).principal(user)
}

/// The layer over `service`, keys shared by a tenant's callers.
fn shared(service: Service) -> IdempotencyKeyLayer<PostgrestRepository> {
    IdempotencyKeyLayer::new(service, tenant).shared_across_callers()
}

/// Serves the orders API behind `layer` on an ephemeral loopback port.
async fn serve(layer: IdempotencyKeyLayer<PostgrestRepository>) -> Api {
    let orders = Orders::default();
    let app = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer)
        .route("/health", get(|| async { "ok" }))
        .with_state(orders.clone());
    let url = bind(app).await;
    Api { url, orders, http: reqwest::Client::new() }
}

/// Serves `app` on an ephemeral loopback port it holds from the start; answers its URL.
async fn bind(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

async fn api(stack: &LocalStack) -> Api {
    serve(keyed(service(stack))).await
}

async fn body(response: reqwest::Response) -> (StatusCode, HeaderMap, Value) {
    let status = StatusCode::from_u16(response.status().as_u16()).expect("status");
    let headers = response.headers().clone();
    let text = response.text().await.expect("body");
    (status, headers, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// A problem answer: its status, `type` slug and the RFC 9457 members.
fn assert_problem(status: StatusCode, headers: &HeaderMap, body: &Value, expected: StatusCode, slug: &str) {
    assert_eq!(status, expected, "{body}");
    assert_eq!(headers["content-type"], "application/problem+json");
    assert!(body["type"].as_str().is_some_and(|t| t.ends_with(slug)), "{body}");
    assert!(body["title"].is_string() && body["detail"].is_string(), "{body}");
    assert_eq!(body["status"], expected.as_u16());
}
