//! The webhook gate answers within its deadline (default 2.5 s, inside
//! Slack's 3 s ACK window): a claim that does not answer in time is a 503,
//! processing that overruns it is released and a 503, a completion that does
//! not answer in time is still an ACK (the processing happened). A deadline
//! longer than the work changes nothing.
//!
//! Slow planes are wiremock servers in front of the PostgREST repository;
//! processing runs on the in-memory repository. Upper bounds only, generous
//! ones: the deadline plus 1.5 s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency_plane::callers::webhook::{
    Ack, Delivery, ProcessingError, ProviderJobs, RetryReason, WebhookGate, DEFAULT_GATE_DEADLINE,
};
use idempotency_plane::{IdempotencyService, MemoryRepository, PostgrestRepository, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::support::claim_row;
use crate::wire::{client, config, requests};

/// How late after its deadline a gate call may answer, on a slow machine.
const MARGIN: Duration = Duration::from_millis(1500);

const DEADLINE: Duration = Duration::from_millis(600);

fn delivery(organization_id: Uuid, delivery_id: &str) -> Delivery<'_> {
    Delivery { organization_id, scope: "webhook.nylas", delivery_id, body: b"{\"event\":\"message.created\"}" }
}

fn memory_gate() -> WebhookGate<MemoryRepository, MemoryRepository> {
    WebhookGate::new(IdempotencyService::new(MemoryRepository::new()), ProviderJobs::over(MemoryRepository::new()))
}

fn wire_gate(server: &MockServer) -> WebhookGate<PostgrestRepository> {
    let client = client(config(server));
    WebhookGate::new(IdempotencyService::new(PostgrestRepository::new(client.clone())), ProviderJobs::new(client))
}

/// The claim row the one-call claim answers to `request`: the key is the caller's.
fn claimed_row(request: &Request, status: &str) -> Value {
    let body: Value = request.body_json().expect("a JSON body");
    let token: Uuid = serde_json::from_value(body["p_lease_token"].clone()).unwrap_or_else(|_| Uuid::new_v4());
    let hash = RequestHash::of_bytes(b"{\"event\":\"message.created\"}");
    let mut row = claim_row(Uuid::new_v4(), token, "webhook.nylas", &hash, status);
    row["organization_id"] = body["p_organization_id"].clone();
    row["key"] = body["p_key"].clone();
    row["outcome"] = json!("claimed");
    row
}

#[test]
fn the_default_deadline_fits_a_three_second_ack_window() {
    let gate = memory_gate();
    assert_eq!(gate.deadline(), Some(DEFAULT_GATE_DEADLINE));
    assert!(DEFAULT_GATE_DEADLINE < Duration::from_secs(3));
    assert_eq!(memory_gate().with_deadline(Duration::from_secs(10)).deadline(), Some(Duration::from_secs(10)));
    assert_eq!(gate.without_deadline().deadline(), None);
}

#[tokio::test]
async fn a_claim_that_does_not_answer_in_time_is_a_503_and_nothing_is_processed() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(|request: &Request| {
            ResponseTemplate::new(200)
                .set_body_json(json!([claimed_row(request, "processing")]))
                .set_delay(Duration::from_secs(30))
        })
        .mount(&server)
        .await;
    let gate = wire_gate(&server).with_deadline(DEADLINE);
    // Act
    let started = Instant::now();
    let ack = gate.handle(delivery(Uuid::new_v4(), "d-slow-claim"), || async { panic!("never claimed") }).await;
    let took = started.elapsed();
    // Assert
    assert_eq!(ack, Ack::Retry(RetryReason::PlaneUnavailable));
    assert_eq!(ack.status(), 503);
    assert!(took < DEADLINE + MARGIN, "answered after {took:?} for a {DEADLINE:?} deadline");
}

#[tokio::test]
async fn a_claim_the_deadline_cut_is_released_once_it_answers_so_the_redelivery_is_processed() {
    // Arrange: the claim answers after the deadline, and it was made.
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(|request: &Request| {
            ResponseTemplate::new(200)
                .set_body_json(json!([claimed_row(request, "processing")]))
                .set_delay(DEADLINE * 2)
        })
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(true)))
        .expect(1)
        .mount(&server)
        .await;
    let gate = wire_gate(&server).with_deadline(DEADLINE);
    // Act
    let ack = gate.handle(delivery(Uuid::new_v4(), "d-cut-claim"), || async { panic!("never processed") }).await;
    // Assert: 503 now; the claim that landed late is released, so nothing
    // holds the delivery id against the vendor's redelivery.
    assert_eq!(ack, Ack::Retry(RetryReason::PlaneUnavailable));
    let released = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if requests(&server).await.iter().any(|r| r.url.path() == "/rpc/idempotency_release") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(released.is_ok(), "the late claim was never released");
    server.verify().await;
}

#[tokio::test]
async fn processing_that_overruns_the_deadline_is_released_and_the_redelivery_processed() {
    // Arrange
    let gate = memory_gate().with_deadline(DEADLINE);
    let org = Uuid::new_v4();
    // Act
    let started = Instant::now();
    let overran = gate
        .handle(delivery(org, "d-overrun"), || async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok::<Value, ProcessingError>(json!("late"))
        })
        .await;
    let took = started.elapsed();
    let redelivered =
        gate.handle(delivery(org, "d-overrun"), || async { Ok::<Value, ProcessingError>(json!("stored")) }).await;
    // Assert
    assert_eq!(overran, Ack::Retry(RetryReason::ProcessingAborted));
    assert!(took < DEADLINE + MARGIN, "answered after {took:?} for a {DEADLINE:?} deadline");
    assert_eq!(redelivered, Ack::Processed, "released, so the redelivery is processed, not dropped");
}

#[tokio::test]
async fn a_completion_that_does_not_answer_in_time_still_acks_what_was_processed() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(|request: &Request| {
            ResponseTemplate::new(200).set_body_json(json!([claimed_row(request, "processing")]))
        })
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_complete"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([])).set_delay(Duration::from_secs(30)))
        .mount(&server)
        .await;
    let gate = wire_gate(&server).with_deadline(DEADLINE);
    let processed = AtomicUsize::new(0);
    // Act
    let started = Instant::now();
    let ack = gate
        .handle(delivery(Uuid::new_v4(), "d-slow-complete"), || async {
            processed.fetch_add(1, Ordering::SeqCst);
            Ok::<Value, ProcessingError>(json!("stored"))
        })
        .await;
    let took = started.elapsed();
    // Assert
    assert_eq!(ack, Ack::Processed, "the processing happened: the vendor must not redeliver");
    assert_eq!(processed.load(Ordering::SeqCst), 1);
    assert!(took < DEADLINE + MARGIN, "answered after {took:?} for a {DEADLINE:?} deadline");
    let paths: Vec<String> = requests(&server).await.iter().map(|r| r.url.path().to_owned()).collect();
    assert!(paths.iter().any(|p| p == "/rpc/idempotency_complete"), "the completion was sent: {paths:?}");
}

#[tokio::test]
async fn a_deadline_longer_than_the_work_changes_nothing() {
    // Arrange
    let gate = memory_gate().with_deadline(Duration::from_secs(20));
    let org = Uuid::new_v4();
    let slow_but_in_time = || async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok::<Value, ProcessingError>(json!("stored"))
    };
    // Act
    let first = gate.handle(delivery(org, "d-in-time"), slow_but_in_time).await;
    let again = gate.handle(delivery(org, "d-in-time"), || async { panic!("processed once") }).await;
    // Assert
    assert_eq!(first, Ack::Processed);
    assert_eq!(again.status(), 200, "a duplicate is ACKed: {again:?}");
}
