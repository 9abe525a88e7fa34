//! Endings that hold when the plane is slow, lossy or gone: an unreachable
//! plane is 503 unless told to fail open, a claim answered too late never
//! fails open, and journal writes that are slow, cut or lost still leave
//! the handler run once and its answer replayed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idempotency_plane::callers::idempotency_key::IdempotencyKeyLayer;
use idempotency_plane::local::LocalStack;
use idempotency_plane::{ClientConfig, IdempotencyService, PostgrestClient, PostgrestRepository, RetryConfig};
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::proxy::RpcProxy;

use super::{assert_problem, bind, body, create_order, keyed, serve, Api, Orders};

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
