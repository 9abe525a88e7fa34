//! The `Idempotency-Key` layer on the real stack, through real HTTP: an axum
//! API bound on loopback, called with reqwest.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency_plane::callers::idempotency_key::{IdempotencyKeyLayer, OversizeResponse};
use idempotency_plane::local::LocalStack;
use idempotency_plane::{ClientConfig, IdempotencyService, PostgrestClient, PostgrestRepository, RetryConfig};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::proxy::RpcProxy;

/// The API under test: `POST /orders` creates an order with a fresh id.
/// Headers make the handler slow (`x-delay-ms`), wait for a permit
/// (`x-hold`), panic (`x-panic`), or answer a given status (`x-status`);
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

async fn create_order(State(orders): State<Orders>, flags: HeaderMap, body: String) -> impl IntoResponse {
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
    (status, headers, Json(json!({"id": id, "received": body})))
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

#[tokio::test]
async fn a_repeat_after_completion_replays_status_headers_and_body_and_the_handler_runs_once() {
    let stack = stack().await;
    let api = api(&stack).await;
    let first = api.post(Some("order-1"), &[], r#"{"sku":"A","qty":2}"#).send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let location = first.headers()["location"].clone();
    let first = first.text().await.unwrap();
    // The same JSON with its keys in another order and other spacing.
    let again = api.post(Some("order-1"), &[], r#"{ "qty": 2, "sku": "A" }"#).send().await.unwrap();
    assert_eq!(again.status(), 201);
    let headers = again.headers().clone();
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["location"], location);
    assert_eq!(headers["content-type"], "application/json");
    assert!(headers.get("x-not-kept").is_none(), "only the kept headers are replayed");
    assert_eq!(again.text().await.unwrap(), first, "the body, byte for byte");
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn two_resources_of_one_route_under_one_key_are_two_requests() {
    let stack = stack().await;
    let orders = Orders::default();
    let app = Router::new()
        .route("/accounts/{id}/transfers", post(create_order))
        .route_layer(shared(service(&stack)))
        .with_state(orders.clone());
    let url = bind(app).await;
    let http = reqwest::Client::new();
    let transfer = |account: u32| {
        http.post(format!("{url}/accounts/{account}/transfers"))
            .header("idempotency-key", "t-1")
            .header("x-tenant", TENANT)
            .header("content-type", "application/json")
            .body(r#"{"amount":10}"#)
    };
    assert_eq!(transfer(1).send().await.unwrap().status(), 201);
    // Account 2 under the same key is not account 1's transfer replayed.
    let (status, headers, problem) = body(transfer(2).send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(orders.runs.load(Ordering::SeqCst), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_layer_that_cannot_see_the_matched_route_refuses_rather_than_scope_every_path() {
    let stack = stack().await;
    let orders = Orders::default();
    // Around the whole router, the layer runs before routing: no matched
    // route to scope by.
    use tower_layer::Layer;
    let router = Router::new().route("/orders", post(create_order)).with_state(orders.clone());
    let app = shared(service(&stack)).layer(router);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move {
        axum::serve(listener, axum::ServiceExt::<axum::extract::Request>::into_make_service(app)).await
    });
    let request = reqwest::Client::new()
        .post(format!("{url}/orders"))
        .header("idempotency-key", "k")
        .header("x-tenant", TENANT)
        .body("{}");
    let (status, headers, problem) = body(request.send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::INTERNAL_SERVER_ERROR, "not-configured");
    assert_eq!((orders.runs.load(Ordering::SeqCst), count_rows(&stack).await), (0, 0));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn keys_are_required_well_formed_and_bounded_and_other_methods_pass() {
    let stack = stack().await;
    let api = api(&stack).await;
    let (status, headers, problem) = body(api.post(None, &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::BAD_REQUEST, "missing-key");
    let long = "k".repeat(256);
    for bad in ["", "   ", "\"\"", long.as_str()] {
        let (status, headers, problem) = body(api.post(Some(bad), &[], "{}").send().await.unwrap()).await;
        assert_problem(status, &headers, &problem, StatusCode::BAD_REQUEST, "malformed-key");
    }
    assert_eq!(api.runs(), 0, "no refused request ran");
    assert_eq!(count_rows(&stack).await, 0, "and nothing was written");
    // A GET is not this layer's: it is not even routed through it.
    assert_eq!(api.http.get(format!("{}/health", api.url)).send().await.unwrap().status(), 200);
    // A quoted key, as the IETF draft writes it, is the same key bare.
    let quoted = api.post(Some("\"order-q\""), &[], "{}").send().await.unwrap();
    assert_eq!(quoted.status(), 201);
    let bare = api.post(Some("order-q"), &[], "{}").send().await.unwrap();
    assert_eq!(bare.headers()["idempotent-replayed"], "true");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn optional_mode_passes_keyless_requests_through() {
    let stack = stack().await;
    let api = serve(keyed(service(&stack)).optional()).await;
    assert_eq!(api.post(None, &[], "{}").send().await.unwrap().status(), 201);
    assert_eq!(api.post(None, &[], "{}").send().await.unwrap().status(), 201);
    assert_eq!(api.runs(), 2, "unprotected, as configured");
    assert_eq!(count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_same_key_with_another_request_is_422_and_an_empty_body_is_a_request_of_its_own() {
    let stack = stack().await;
    let api = api(&stack).await;
    assert_eq!(api.post(Some("k-empty"), &[], "").send().await.unwrap().status(), 201);
    assert_eq!(api.post(Some("k-empty"), &[], "").send().await.unwrap().headers()["idempotent-replayed"], "true");
    let (status, headers, problem) = body(api.post(Some("k-empty"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(api.runs(), 1);
    // Another tenant's key of the same name is another key.
    let other = api.post_as(&Uuid::new_v4().to_string(), Some("k-empty"), &[], "{}").send().await.unwrap();
    assert_eq!(other.status(), 201);
    assert_eq!(api.runs(), 2);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn twenty_concurrent_requests_with_one_key_run_the_handler_once() {
    let stack = stack().await;
    let api = Arc::new(api(&stack).await);
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let api = api.clone();
            tokio::spawn(async move {
                body(api.post(Some("burst"), &[("x-delay-ms", "300")], r#"{"sku":"B"}"#).send().await.unwrap()).await
            })
        })
        .collect();
    let mut ids = HashSet::new();
    let mut in_flight = 0;
    for request in requests {
        let (status, headers, answer) = request.await.unwrap();
        match status {
            StatusCode::CREATED => {
                ids.insert(answer["id"].as_str().unwrap().to_owned());
            }
            StatusCode::CONFLICT => {
                assert_problem(status, &headers, &answer, StatusCode::CONFLICT, "in-flight");
                assert_eq!(headers["retry-after"], "1");
                in_flight += 1;
            }
            other => panic!("unexpected {other}: {answer}"),
        }
    }
    assert_eq!(api.runs(), 1, "the handler ran once");
    assert_eq!(ids.len(), 1, "every 201 is the one order");
    assert!(in_flight > 0, "some arrived while it ran");
    // Once done, every repeat is the replay.
    let (status, headers, answer) = body(api.post(Some("burst"), &[], r#"{"sku":"B"}"#).send().await.unwrap()).await;
    assert_eq!((status, &headers["idempotent-replayed"]), (StatusCode::CREATED, &"true".parse().unwrap()));
    assert!(ids.contains(answer["id"].as_str().unwrap()));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn retryable_answers_panics_and_timeouts_release_and_other_answers_are_final() {
    let stack = stack().await;
    let layer = keyed(service(&stack))
        .handler_timeout(Duration::from_millis(500), Duration::from_secs(5))
        .expect("a lease the plane accepts");
    let api = serve(layer).await;
    // 503 and 429 are not answers: released, and the retry runs.
    for status in [503, 429] {
        let key = format!("retryable-{status}");
        let status_text = status.to_string();
        assert_eq!(
            api.post(Some(&key), &[("x-status", status_text.as_str())], "{}").send().await.unwrap().status(),
            status
        );
        assert_eq!(api.post(Some(&key), &[], "{}").send().await.unwrap().status(), 201, "retried");
    }
    // A panic: 500 problem, released, and the retry runs.
    let (status, headers, problem) =
        body(api.post(Some("panics"), &[("x-panic", "1")], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::INTERNAL_SERVER_ERROR, "handler-failed");
    assert_eq!(api.post(Some("panics"), &[], "{}").send().await.unwrap().status(), 201);
    // Past the handler timeout: 504 problem, released, and the retry runs.
    let (status, headers, problem) =
        body(api.post(Some("slow"), &[("x-delay-ms", "3000")], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::GATEWAY_TIMEOUT, "handler-timeout");
    assert_eq!(api.post(Some("slow"), &[], "{}").send().await.unwrap().status(), 201);
    // A 400 is the answer: kept and replayed, the handler not run again.
    let runs = api.runs();
    assert_eq!(api.post(Some("bad"), &[("x-status", "400")], "{}").send().await.unwrap().status(), 400);
    let again = api.post(Some("bad"), &[], "{}").send().await.unwrap();
    assert_eq!((again.status().as_u16(), &again.headers()["idempotent-replayed"]), (400, &"true".parse().unwrap()));
    assert_eq!(api.runs(), runs + 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_lease_that_passes_mid_handler_is_reclaimed_and_the_late_completion_is_fenced_off() {
    let stack = stack().await;
    let api = Arc::new(api(&stack).await);
    // A: claims and holds in its handler.
    let first = {
        let api = api.clone();
        tokio::spawn(
            async move { body(api.post(Some("stalls"), &[("x-hold", "1")], "{}").send().await.unwrap()).await },
        )
    };
    eventually("A's handler runs", || api.runs() == 1).await;
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    pass_lease(&stack, id).await;
    // B: the lease passed, so it reclaims and runs to completion.
    let (status, _, b) = body(api.post(Some("stalls"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(api.runs(), 2);
    // A finishes late: its completion is fenced off; it still answers its own order.
    api.orders.gate.add_permits(1);
    let (status, _, a) = within(WAIT, "A finishes", first).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_ne!(a["id"], b["id"]);
    // What the key answers from now on is B's.
    let (_, headers, replay) = body(api.post(Some("stalls"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay["id"], b["id"], "the late completion did not overwrite B's");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn bodies_above_the_limit_are_413_and_answers_above_the_journal_limit_are_kept_without_their_body() {
    let stack = stack().await;
    let small_journal = service(&stack).with_response_limit(1024);
    let api = serve(keyed(small_journal).body_limit(4096)).await;
    let (status, headers, problem) =
        body(api.post(Some("huge"), &[], &format!("\"{}\"", "x".repeat(5000))).send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(api.runs(), 0);
    // A 2 KiB request echoed back: the first caller gets it all, a repeat
    // the status and headers, and how much body was left out.
    let big = format!("\"{}\"", "y".repeat(2048));
    let (status, _, first) = body(api.post(Some("echo"), &[], &big).send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(first["received"].as_str().unwrap().len() > 2048);
    let again = api.post(Some("echo"), &[], &big).send().await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(again.headers()["idempotent-body-omitted"].to_str().unwrap().parse::<u64>().unwrap() > 2048);
    assert_eq!(again.headers()["location"], format!("/orders/{}", first["id"].as_str().unwrap()));
    assert!(again.text().await.unwrap().is_empty());
    assert_eq!(api.runs(), 1);

    // Refusing instead: the first caller and every repeat get the same 500 problem.
    let refusing = serve(keyed(service(&stack).with_response_limit(1024)).on_oversize(OversizeResponse::Refuse)).await;
    let (status, headers, problem) = body(refusing.post(Some("echo-r"), &[], &big).send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::INTERNAL_SERVER_ERROR, "answer-not-kept");
    let (status, headers, again) = body(refusing.post(Some("echo-r"), &[], &big).send().await.unwrap()).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!((status, again), (StatusCode::INTERNAL_SERVER_ERROR, problem));
    assert_eq!(refusing.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_plane_is_503_with_retry_after_unless_told_to_fail_open() {
    let gone = crate::support::transport::RefusedPort::new();
    let config = idempotency_plane::ClientConfig::new(&gone.url(), "key").unwrap().with_retry(RetryConfig::disabled());
    let unreachable = || {
        IdempotencyService::new(PostgrestRepository::new(
            idempotency_plane::PostgrestClient::new(config.clone()).unwrap(),
        ))
    };
    let closed = serve(keyed(unreachable())).await;
    let (status, headers, problem) = body(closed.post(Some("k"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::SERVICE_UNAVAILABLE, "unavailable");
    assert_eq!(headers["retry-after"], "5");
    assert_eq!(closed.runs(), 0, "fail closed: not run");
    let open = serve(keyed(unreachable()).fail_open()).await;
    assert_eq!(open.post(Some("k"), &[], "{}").send().await.unwrap().status(), 201);
    assert_eq!(open.runs(), 1, "fail open: run, unprotected");
}

#[tokio::test]
async fn a_request_without_a_tenant_is_401_and_writes_nothing() {
    let stack = stack().await;
    let api = api(&stack).await;
    let request = api.http.post(format!("{}/orders", api.url)).header("idempotency-key", "k").body("{}");
    let (status, headers, problem) = body(request.send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNAUTHORIZED, "no-tenant");
    assert_eq!((api.runs(), count_rows(&stack).await), (0, 0));
    stack.stop().await.unwrap();
}

// ---------------------------------------------------------------------------
// Endings that hold
// ---------------------------------------------------------------------------

/// Polls `sql` (one boolean) on the stack's database until it answers true.
async fn until_db(stack: &LocalStack, what: &str, sql: &'static str) {
    let polled = tokio::time::timeout(WAIT, async {
        loop {
            let done: Option<bool> = sqlx::query_scalar(sql).fetch_optional(stack.db()).await.expect("poll");
            if done == Some(true) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    if polled.await.is_err() {
        panic!("{what}: did not happen within {WAIT:?}");
    }
}

/// A layer over the stack reached through `proxy`, with its own client: one replica.
fn through(proxy: &RpcProxy, stack: &LocalStack, config: impl FnOnce(ClientConfig) -> ClientConfig) -> Service {
    let client = PostgrestClient::new(config(proxy.client_config(stack.service_key()))).expect("a client");
    IdempotencyService::new(PostgrestRepository::new(client))
}

/// Serves the orders API behind `layer`, counting runs in `orders` (shared by replicas).
async fn serve_orders(layer: IdempotencyKeyLayer<PostgrestRepository>, orders: Orders) -> Api {
    let app = Router::new().route("/orders", post(create_order)).route_layer(layer).with_state(orders.clone());
    let url = bind(app).await;
    Api { url, orders, http: reqwest::Client::new() }
}

#[tokio::test]
async fn a_slow_journal_write_keeps_the_key_from_a_second_replica_and_the_handler_runs_once() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    let orders = Orders::default();
    // Two replicas of one API, each with its own client of the plane; the
    // handler may take 1 s, with a 1 s margin.
    let replica = || async {
        let layer = keyed(through(&proxy, &stack, |c| c))
            .handler_timeout(Duration::from_secs(1), Duration::from_secs(1))
            .expect("a lease the plane accepts");
        serve_orders(layer, orders.clone()).await
    };
    let (a, b) = (Arc::new(replica().await), replica().await);
    // Writing the answer is slow: the plane sees it 5 s after it was sent.
    proxy.delay_request("idempotency_complete", Duration::from_secs(5));
    let first = {
        let a = a.clone();
        tokio::spawn(async move { body(a.post(Some("slow-journal"), &[], "{}").send().await.unwrap()).await })
    };
    eventually("A journals its answer", || proxy.requests("idempotency_complete") == 1).await;
    // Handler timeout + margin has passed since the claim, by the database's clock.
    until_db(
        &stack,
        "A's handler timeout and margin passed",
        "select now() > claimed_at + interval '2200 milliseconds' from agent.idempotency_keys",
    )
    .await;
    let (status, headers, problem) = body(b.post(Some("slow-journal"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::CONFLICT, "in-flight");
    let (status, _, answer) = within(WAIT, "A finishes", first).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, replay) = body(b.post(Some("slow-journal"), &[], "{}").send().await.unwrap()).await;
    assert_eq!((status, &headers["idempotent-replayed"]), (StatusCode::CREATED, &"true".parse().unwrap()));
    assert_eq!(replay, answer, "B replays A's answer");
    assert_eq!(orders.runs.load(Ordering::SeqCst), 1, "the handler ran once");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_journal_write_that_never_reached_the_plane_is_retried_and_the_repeat_replays() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    // The client does not retry itself: the layer does, within its journal deadline.
    let service = through(&proxy, &stack, |c| c.with_retry(RetryConfig::disabled()));
    let api = serve(keyed(service)).await;
    proxy.drop_next_unsent("idempotency_complete", 1);
    let (status, _, first) = body(api.post(Some("journal-retry"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(proxy.requests("idempotency_complete"), 2, "the lost write was sent again");
    let (_, headers, replay) = body(api.post(Some("journal-retry"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay, first);
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_claim_the_plane_made_but_answered_too_late_does_not_fail_open() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    let service = through(&proxy, &stack, |c| {
        c.with_retry(RetryConfig::disabled()).with_deadline(Duration::from_millis(800)).expect("a deadline")
    });
    let layer = keyed(service)
        .handler_timeout(Duration::from_secs(1), Duration::from_secs(1))
        .expect("a lease the plane accepts")
        .fail_open();
    let api = serve(layer).await;
    // The database makes the claim; its answer comes after the client's deadline.
    proxy.delay("idempotency_claim", Duration::from_secs(2));
    let (status, headers, problem) = body(api.post(Some("late-claim"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::SERVICE_UNAVAILABLE, "unavailable");
    assert_eq!(api.runs(), 0, "not run while a claim nobody heard of holds the key");
    assert_eq!(count_rows(&stack).await, 1, "the plane made the claim");
    proxy.clear();
    // That claim holds the key for its lease; then it is reclaimed and runs once.
    let (status, headers, problem) = body(api.post(Some("late-claim"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::CONFLICT, "in-flight");
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    pass_lease(&stack, id).await;
    let (status, _, first) = body(api.post(Some("late-claim"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, headers, replay) = body(api.post(Some("late-claim"), &[], "{}").send().await.unwrap()).await;
    assert_eq!((&headers["idempotent-replayed"], replay), (&"true".parse().unwrap(), first));
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

impl Api {
    fn post_typed(&self, content_type: &str, key: &str, body: &str) -> reqwest::RequestBuilder {
        self.post(Some(key), &[], body).header("content-type", content_type)
    }
}

/// Sends `first` then `second` under one fresh key: the first runs, the second is 422.
async fn second_is_key_reused(api: &Api, key: &str, first: (&str, &str), second: (&str, &str)) {
    let runs = api.runs();
    let (status, _, answer) = body(api.post_typed(first.0, key, first.1).send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED, "{first:?}: {answer}");
    let (status, headers, problem) = body(api.post_typed(second.0, key, second.1).send().await.unwrap()).await;
    assert!(headers.get("idempotent-replayed").is_none(), "{second:?} got {first:?}'s answer: {problem}");
    assert_problem(status, &headers, &problem, StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(api.runs(), runs + 1);
}

#[tokio::test]
async fn json_numbers_one_double_cannot_tell_apart_are_two_requests() {
    let stack = stack().await;
    let api = api(&stack).await;
    let json = "application/json";
    let pairs = [
        // Floats, written with a fraction or an exponent, beyond a double's precision.
        (r#"{"amount":9007199254740993.0}"#, r#"{"amount":9007199254740992.0}"#),
        (r#"{"amount":9007199254740993e0}"#, r#"{"amount":9007199254740992e0}"#),
        (r#"{"rate":0.1000000000000000000001}"#, r#"{"rate":0.1}"#),
        (r#"{"rate":1e-400}"#, r#"{"rate":0}"#),
        (r#"{"n":-0}"#, r#"{"n":0}"#),
    ];
    for (i, (first, second)) in pairs.into_iter().enumerate() {
        second_is_key_reused(&api, &format!("number-{i}"), (json, first), (json, second)).await;
    }
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn duplicate_json_members_are_not_their_last_one() {
    let stack = stack().await;
    let api = api(&stack).await;
    let json = "application/json";
    second_is_key_reused(&api, "dup-1", (json, r#"{"a":1,"a":2}"#), (json, r#"{"a":2}"#)).await;
    second_is_key_reused(&api, "dup-2", (json, r#"{"a":2}"#), (json, r#"{"a":1,"a":2}"#)).await;
    // An escape spells the same name.
    second_is_key_reused(&api, "dup-3", (json, r#"{"a":1,"\u0061":2}"#), (json, r#"{"a":2}"#)).await;
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_same_bytes_under_another_content_type_are_another_request() {
    let stack = stack().await;
    let api = api(&stack).await;
    let body = r#"{"sku":"A"}"#;
    second_is_key_reused(&api, "ct-1", ("application/json", body), ("application/vnd.orders+json", body)).await;
    second_is_key_reused(&api, "ct-2", ("text/plain", body), ("application/octet-stream", body)).await;
    second_is_key_reused(&api, "ct-3", ("application/json", body), ("text/plain", body)).await;
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn two_callers_of_one_tenant_sharing_a_key_never_get_each_others_answer() {
    let stack = stack().await;
    let api = serve(keyed(service(&stack))).await;
    let as_user = |user: &'static str| api.post(Some("shared-name"), &[("x-user", user)], r#"{"sku":"A"}"#);
    let (status, _, alice) = body(as_user("alice").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    // Bob, same tenant, same key, same body: his own request, not alice's answer.
    let (status, headers, bob) = body(as_user("bob").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none(), "bob got alice's answer: {bob}");
    assert_ne!(alice["id"], bob["id"]);
    assert_eq!(api.runs(), 2, "bob's handler ran");
    // Each replays their own.
    for (user, first) in [("alice", &alice), ("bob", &bob)] {
        let (_, headers, replay) = body(as_user(user).send().await.unwrap()).await;
        assert_eq!((&headers["idempotent-replayed"], &replay), (&"true".parse().unwrap(), first), "{user}");
    }
    assert_eq!(api.runs(), 2);
    // No caller where keys are per caller: 401, nothing run or written.
    let anonymous = api
        .http
        .post(format!("{}/orders", api.url))
        .header("idempotency-key", "shared-name")
        .header("x-tenant", TENANT)
        .header("content-type", "application/json")
        .body(r#"{"sku":"A"}"#);
    let (status, headers, problem) = body(anonymous.send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNAUTHORIZED, "no-principal");
    assert_eq!((api.runs(), count_rows(&stack).await), (2, 2));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn keys_shared_across_callers_answer_every_caller_of_the_tenant_alike() {
    let stack = stack().await;
    let api = serve(shared(service(&stack))).await;
    let (_, _, alice) = body(api.post(Some("team-key"), &[("x-user", "alice")], "{}").send().await.unwrap()).await;
    let (_, headers, bob) = body(api.post(Some("team-key"), &[("x-user", "bob")], "{}").send().await.unwrap()).await;
    assert_eq!((&headers["idempotent-replayed"], bob), (&"true".parse().unwrap(), alice), "as configured");
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_layer_not_told_whose_keys_they_are_refuses_keyed_requests_as_not_configured() {
    let stack = stack().await;
    let api = serve(IdempotencyKeyLayer::new(service(&stack), tenant)).await;
    let (status, headers, problem) = body(api.post(Some("k"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::INTERNAL_SERVER_ERROR, "not-configured");
    assert_eq!((api.runs(), count_rows(&stack).await), (0, 0));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_journal_write_slower_than_its_deadline_is_cut_and_the_caller_still_gets_its_answer() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    let layer = keyed(through(&proxy, &stack, |c| c))
        .handler_timeout(Duration::from_secs(1), Duration::from_secs(1))
        .expect("a lease the plane accepts")
        .journal_deadline(Duration::from_secs(1))
        .expect("a journal deadline the plane accepts");
    let api = serve(layer).await;
    proxy.delay_request("idempotency_complete", Duration::from_secs(6));
    let started = std::time::Instant::now();
    let (status, _, _) = body(api.post(Some("journal-cut"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED, "the handler's answer, journaled or not");
    // Cut 1 s after the handler's own 1 s timeout, not 6 s later.
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    assert_eq!(api.runs(), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_route_longer_than_a_scope_is_protected() {
    let stack = stack().await;
    let orders = Orders::default();
    let long = format!("/v1/{}{{id}}/items", "a-very-long-segment-name/".repeat(8));
    let longer = format!("/v1/{}{{id}}/other", "a-very-long-segment-name/".repeat(8));
    let app = Router::new()
        .route(&long, post(create_order))
        .route(&longer, post(create_order))
        .route_layer(shared(service(&stack)))
        .with_state(orders.clone());
    let url = bind(app).await;
    let http = reqwest::Client::new();
    let send = |route: &str| {
        http.post(format!("{url}{}", route.replace("{id}", "7")))
            .header("idempotency-key", "long-1")
            .header("x-tenant", TENANT)
            .header("content-type", "application/json")
            .body("{}")
            .send()
    };
    let (status, _, first) = body(send(&long).await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let (_, headers, replay) = body(send(&long).await.unwrap()).await;
    assert_eq!((&headers["idempotent-replayed"], replay), (&"true".parse().unwrap(), first));
    // Another long route with the same beginning is another scope, not a 422.
    assert_eq!(send(&longer).await.unwrap().status(), StatusCode::CREATED);
    let scopes: Vec<String> = sqlx::query_scalar("select scope from agent.idempotency_keys order by scope")
        .fetch_all(stack.db())
        .await
        .unwrap();
    assert_eq!(scopes.len(), 2);
    assert_ne!(scopes[0], scopes[1]);
    assert!(scopes.iter().all(|s| s.len() <= 128 && s.starts_with("http.post.v1.a-very-long")), "{scopes:?}");
    assert_eq!(orders.runs.load(Ordering::SeqCst), 2);
    stack.stop().await.unwrap();
}

/// A service whose `call` itself panics on `x-panic-sync`, before any
/// future exists; else answers 201 and counts.
#[derive(Clone, Default)]
struct PanicsInCall {
    runs: Arc<AtomicUsize>,
}

impl tower_service::Service<axum::extract::Request> for PanicsInCall {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: axum::extract::Request) -> Self::Future {
        if request.headers().contains_key("x-panic-sync") {
            panic!("call panicked before making a future");
        }
        self.runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok((StatusCode::CREATED, "made").into_response()))
    }
}

#[tokio::test]
async fn a_panic_in_the_services_call_itself_releases_the_claim() {
    let stack = stack().await;
    let service = PanicsInCall::default();
    // The layer wraps the service itself (axum's own routes call theirs
    // only when polled), and the router still names the matched route.
    use tower_layer::Layer;
    let layer = shared(crate::support::harness::service(&stack));
    let app = Router::new().route_service("/orders", layer.layer(service.clone()));
    let api = Api { url: bind(app).await, orders: Orders::default(), http: reqwest::Client::new() };
    let (status, headers, problem) =
        body(api.post(Some("sync-panic"), &[("x-panic-sync", "1")], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::INTERNAL_SERVER_ERROR, "handler-failed");
    let retry = api.post(Some("sync-panic"), &[], "{}").send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED, "released: the retry runs");
    assert_eq!(service.runs.load(Ordering::SeqCst), 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_replay_never_carries_a_credential_header_even_when_one_was_journaled() {
    let stack = stack().await;
    let api = api(&stack).await;
    assert_eq!(api.post(Some("cookie"), &[], "{}").send().await.unwrap().status(), 201);
    // A journal written by an older layer that kept them.
    sqlx::query(
        "update agent.idempotency_keys
            set response = jsonb_set(response, '{output,headers}', response->'output'->'headers'
                || '[[\"set-cookie\",\"session=alice\"],[\"authorization\",\"Bearer alice\"],[\"www-authenticate\",\"Basic\"]]'::jsonb)",
    )
    .execute(stack.db())
    .await
    .unwrap();
    let replay = api.post(Some("cookie"), &[], "{}").send().await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    for name in ["set-cookie", "authorization", "www-authenticate"] {
        assert!(replay.headers().get(name).is_none(), "{name} replayed");
    }
    assert!(replay.headers().get("location").is_some(), "the kept headers still are");
    stack.stop().await.unwrap();
}
