//! How a handler's ending decides its claim: retryable answers, panics
//! (in the handler or in the service's `call` itself) and timeouts release
//! it, other answers are final, and a lease that passes mid-handler is
//! reclaimed with the late completion fenced off.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Router;
use uuid::Uuid;

use crate::support::harness::*;

use super::{api, assert_problem, bind, body, keyed, serve, shared, Api, Orders};

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
