//! What the layer refuses before any handler runs: a missing or malformed
//! key, a request without a tenant, a layer not told whose keys they are or
//! unable to see the matched route, a body above the limit; and an answer
//! above the journal's limit.

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idempotency_plane::callers::idempotency_key::{IdempotencyKeyLayer, OversizeResponse};

use crate::support::harness::*;

use super::{api, assert_problem, body, create_order, keyed, serve, shared, tenant, Orders, TENANT};

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
async fn bodies_above_the_limit_are_413_and_answers_above_the_journal_limit_are_kept_without_their_body() {
    let stack = stack().await;
    let small_journal = service(&stack).with_response_limit(1024);
    let api = serve(keyed(small_journal).body_limit(4096)).await;
    let (status, headers, problem) =
        body(api.post(Some("huge"), &[], &format!("\"{}\"", "x".repeat(5000))).send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(api.runs(), 0);
    // A 2 KiB request echoed back: the first caller gets what every repeat
    // will, the status and headers and how much body was left out (and the
    // handler's headers a replay leaves out on purpose).
    let big = format!("\"{}\"", "y".repeat(2048));
    let first = api.post(Some("echo"), &[], &big).send().await.unwrap();
    let again = api.post(Some("echo"), &[], &big).send().await.unwrap();
    assert_eq!((first.status(), again.status()), (StatusCode::CREATED, StatusCode::CREATED));
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert!(first.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        (first.headers().get("x-not-kept"), again.headers().get("x-not-kept")),
        (Some(&"1".parse().unwrap()), None)
    );
    let omitted = again.headers()["idempotent-body-omitted"].to_str().unwrap().parse::<u64>().unwrap();
    assert!(omitted > 2048);
    assert_eq!(first.headers()["idempotent-body-omitted"], again.headers()["idempotent-body-omitted"]);
    assert_eq!(first.headers()["location"], again.headers()["location"]);
    assert!(again.headers()["location"].to_str().unwrap().starts_with("/orders/"));
    assert_eq!((first.text().await.unwrap(), again.text().await.unwrap()), (String::new(), String::new()));
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
async fn a_request_without_a_tenant_is_401_and_writes_nothing() {
    let stack = stack().await;
    let api = api(&stack).await;
    let request = api.http.post(format!("{}/orders", api.url)).header("idempotency-key", "k").body("{}");
    let (status, headers, problem) = body(request.send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::UNAUTHORIZED, "no-tenant");
    assert_eq!((api.runs(), count_rows(&stack).await), (0, 0));
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
