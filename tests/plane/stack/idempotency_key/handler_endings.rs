//! How a handler's ending decides its claim: once a handler started, its
//! answer is kept for the key and replayed, a 5xx, a panic (in the handler
//! or in the service's `call` itself) and a timeout included, unless the
//! handler marks a failure `NothingHappened`; and a lease that passes
//! mid-handler is reclaimed with the late completion fenced off.

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
async fn a_handler_that_started_is_answered_the_same_to_every_retry_unless_it_says_nothing_happened() {
    let stack = stack().await;
    let layer = keyed(service(&stack))
        .handler_timeout(Duration::from_millis(500), Duration::from_secs(5))
        .expect("a lease the plane accepts");
    let api = serve(layer).await;
    // 503 and 429 marked NothingHappened: released, and the retry runs.
    for status in [503, 429] {
        let key = format!("nothing-happened-{status}");
        let status_text = status.to_string();
        let flags = [("x-status", status_text.as_str()), ("x-nothing-happened", "1")];
        assert_eq!(api.post(Some(&key), &flags, "{}").send().await.unwrap().status(), status);
        assert_eq!(api.post(Some(&key), &[], "{}").send().await.unwrap().status(), 201, "retried");
    }
    // Unmarked 500, 503 and 429: the handler started, so its answer is kept
    // and every retry gets it, byte for byte, without running it again.
    for status in [500, 503, 429] {
        let key = format!("kept-{status}");
        let status_text = status.to_string();
        let runs = api.runs();
        let (first_status, _, first) =
            body(api.post(Some(&key), &[("x-status", status_text.as_str())], "{}").send().await.unwrap()).await;
        let (again_status, headers, again) = body(api.post(Some(&key), &[], "{}").send().await.unwrap()).await;
        assert_eq!((first_status.as_u16(), again_status.as_u16()), (status, status), "{status}");
        assert_eq!((headers["idempotent-replayed"].to_str().unwrap(), &again), ("true", &first), "{status}");
        assert_eq!(api.runs(), runs + 1, "{status}: the handler ran once");
    }
    // A panic after the handler started: a 500 problem, kept, and the retry
    // gets the same problem (telling it not to expect otherwise) without a run.
    let runs = api.runs();
    let (status, headers, problem) =
        body(api.post(Some("panics"), &[("x-panic", "1")], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::INTERNAL_SERVER_ERROR, "handler-failed");
    assert!(headers.get("idempotent-replayed").is_none());
    assert!(problem["detail"].as_str().unwrap().contains("new key"), "{problem}");
    let (status, headers, again) = body(api.post(Some("panics"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(
        (status, &headers["idempotent-replayed"], &again),
        (StatusCode::INTERNAL_SERVER_ERROR, &"true".parse().unwrap(), &problem)
    );
    assert_eq!(api.runs(), runs + 1, "the panicked handler was not run again");
    // Past the handler timeout: a 504 problem, kept and replayed the same way.
    let (status, headers, problem) =
        body(api.post(Some("slow"), &[("x-delay-ms", "3000")], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::GATEWAY_TIMEOUT, "handler-timeout");
    let (status, _, again) = body(api.post(Some("slow"), &[], "{}").send().await.unwrap()).await;
    assert_eq!((status, &again), (StatusCode::GATEWAY_TIMEOUT, &problem));
    assert_eq!(api.runs(), runs + 2, "the cut handler was not run again");
    // A success marked NothingHappened is kept all the same: it was given.
    let (status, _, created) =
        body(api.post(Some("marked-success"), &[("x-nothing-happened", "1")], "{}").send().await.unwrap()).await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, headers, again) = body(api.post(Some("marked-success"), &[], "{}").send().await.unwrap()).await;
    assert_eq!((&headers["idempotent-replayed"], &again), (&"true".parse().unwrap(), &created));
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
async fn with_heartbeats_a_slow_handler_keeps_its_short_lease_and_a_taken_key_stops_it() {
    let stack = stack().await;
    let layer = keyed(service(&stack)).heartbeats(Duration::from_secs(3)).unwrap();
    assert!(keyed(service(&stack)).heartbeats(Duration::from_secs(2)).is_err(), "below the 3 s floor");
    let api = Arc::new(serve(layer).await);
    // A handler running 6.5 s: past its 3 s lease, a retry finds it in flight.
    let slow = {
        let api = api.clone();
        tokio::spawn(async move {
            body(api.post(Some("renders"), &[("x-delay-ms", "6500")], "{}").send().await.unwrap()).await
        })
    };
    eventually("the handler runs", || api.runs() == 1).await;
    let (lease_ms,): (f64,) = sqlx::query_as(
        "select (extract(epoch from lease_expires_at - claimed_at) * 1000)::float8 from agent.idempotency_keys",
    )
    .fetch_one(stack.db())
    .await
    .unwrap();
    // The 3 s heartbeat lease (a beat may have moved it a little since),
    // not the whole 45 s.
    assert!((3000.0..10_000.0).contains(&lease_ms), "claimed for the heartbeat lease: {lease_ms} ms");
    tokio::time::sleep(Duration::from_millis(3_800)).await;
    let (status, headers, problem) = body(api.post(Some("renders"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::CONFLICT, "in-flight");
    let (status, _, first) = within(WAIT, "the slow handler ends", slow).await.unwrap();
    assert_eq!((status, api.runs()), (StatusCode::CREATED, 1), "ran once: {first}");

    // A handler whose key is taken over while it runs (its lease made to
    // pass, another worker reclaims): the next beat stops it, and it is
    // answered as a repeat in flight, never journaled over the new holder.
    let held = {
        let api = api.clone();
        tokio::spawn(async move { body(api.post(Some("taken"), &[("x-hold", "1")], "{}").send().await.unwrap()).await })
    };
    eventually("the held handler runs", || api.runs() == 2).await;
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys where status = 'processing'")
        .fetch_one(stack.db())
        .await
        .unwrap();
    pass_lease(&stack, id).await;
    sqlx::query("update agent.idempotency_keys set lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute' where id = $1")
        .bind(id)
        .execute(stack.db())
        .await
        .unwrap();
    let (status, headers, problem) = within(WAIT, "the held handler is stopped", held).await.unwrap();
    assert_problem(status, &headers, &problem, StatusCode::CONFLICT, "in-flight");
    let status: String = sqlx::query_scalar("select status from agent.idempotency_keys where id = $1")
        .bind(id)
        .fetch_one(stack.db())
        .await
        .unwrap();
    assert_eq!(status, "processing", "the new holder's claim is untouched");
    api.orders.gate.add_permits(1);
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
async fn a_panic_in_the_services_call_itself_is_kept_for_the_key() {
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
    let (status, headers, again) = body(api.post(Some("sync-panic"), &[], "{}").send().await.unwrap()).await;
    assert_eq!(
        (status, &headers["idempotent-replayed"], &again),
        (StatusCode::INTERNAL_SERVER_ERROR, &"true".parse().unwrap(), &problem)
    );
    assert_eq!(service.runs.load(Ordering::SeqCst), 0, "kept: the retry does not call the service again");
    stack.stop().await.unwrap();
}

/// A service whose future fails with an error of its own (not a response),
/// after it started; counts its runs.
#[derive(Clone, Default)]
struct FailsWithAnError {
    runs: Arc<AtomicUsize>,
}

impl tower_service::Service<axum::extract::Request> for FailsWithAnError {
    type Response = axum::response::Response;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: axum::extract::Request) -> Self::Future {
        self.runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Err(std::io::Error::other("the downstream connection broke half-way")))
    }
}

#[tokio::test]
async fn a_service_that_fails_with_an_error_of_its_own_leaves_its_claim_to_its_lease() {
    let stack = stack().await;
    let service = FailsWithAnError::default();
    use tower_layer::Layer;
    let layer = shared(crate::support::harness::service(&stack));
    // The error goes on to the caller's error handler; the layer writes nothing.
    let handled =
        axum::error_handling::HandleError::new(layer.layer(service.clone()), |error: std::io::Error| async move {
            (StatusCode::BAD_GATEWAY, error.to_string())
        });
    let app = Router::new().route_service("/orders", handled);
    let api = Api { url: bind(app).await, orders: Orders::default(), http: reqwest::Client::new() };
    let first = api.post(Some("errs"), &[], "{}").send().await.unwrap();
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    // Left to its lease: still processing, so a retry meanwhile is in flight
    // and the service is not called again.
    let status: String =
        sqlx::query_scalar("select status from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    assert_eq!(status, "processing", "neither released nor journaled");
    let (status, headers, problem) = body(api.post(Some("errs"), &[], "{}").send().await.unwrap()).await;
    assert_problem(status, &headers, &problem, StatusCode::CONFLICT, "in-flight");
    assert_eq!(service.runs.load(Ordering::SeqCst), 1);
    stack.stop().await.unwrap();
}
