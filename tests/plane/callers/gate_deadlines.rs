//! The webhook gate answers within its deadline (default 2.5 s, inside
//! Slack's 3 s ACK window), and never gives up a claim it holds: a claim
//! that does not answer in time is a 503 and, if it was made, is carried to
//! its journal after the answer; processing that outlasts the deadline is
//! accepted (200) and finished after the answer; a completion that does not
//! answer in time is still an ACK (the processing happened). A deadline
//! longer than the work changes nothing.
//!
//! Slow planes are wiremock servers in front of the PostgREST repository;
//! processing runs on the in-memory repository. Upper bounds only, generous
//! ones: the deadline plus 1.5 s.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_plane::callers::webhook::{
    Ack, Delivery, DropReason, ProcessingError, ProviderJobs, RetryReason, WebhookGate, DEFAULT_GATE_DEADLINE,
};
use idempotency_plane::{IdempotencyService, MemoryRepository, PostgrestRepository, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::support::transport::claim_row;
use crate::wire::{client, config, requests};

/// How late after its deadline a gate call may answer, on a slow machine.
const MARGIN: Duration = Duration::from_millis(1500);

const DEADLINE: Duration = Duration::from_millis(600);

fn delivery(organization_id: Uuid, delivery_id: &str) -> Delivery<'_> {
    Delivery { organization_id, scope: "webhook.nylas", delivery_id, body: b"{\"event\":\"message.created\"}" }
}

fn memory_gate() -> WebhookGate<MemoryRepository, MemoryRepository> {
    WebhookGate::new(IdempotencyService::new(MemoryRepository::new()), ProviderJobs::new(MemoryRepository::new()))
}

fn wire_gate(server: &MockServer) -> WebhookGate<PostgrestRepository, PostgrestRepository> {
    let client = client(config(server));
    WebhookGate::new(
        IdempotencyService::new(PostgrestRepository::new(client.clone())),
        ProviderJobs::new(PostgrestRepository::new(client)),
    )
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

/// The row a completion of `request`'s claim answers.
fn completed_row(request: &Request) -> Value {
    let body: Value = request.body_json().expect("a JSON body");
    let token: Uuid = serde_json::from_value(body["p_lease_token"].clone()).unwrap_or_else(|_| Uuid::new_v4());
    let hash = RequestHash::of_bytes(b"{\"event\":\"message.created\"}");
    let mut row = claim_row(Uuid::new_v4(), token, "webhook.nylas", &hash, "completed");
    row["id"] = body["p_claim_id"].clone();
    row["response"] = body["p_response"].clone();
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
async fn a_claim_the_deadline_cut_is_never_released_it_is_carried_when_it_lands() {
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
        .and(path("/rpc/idempotency_complete"))
        .respond_with(|request: &Request| ResponseTemplate::new(200).set_body_json(json!([completed_row(request)])))
        .expect(1)
        .mount(&server)
        .await;
    let gate = wire_gate(&server).with_deadline(DEADLINE);
    let processed = Arc::new(AtomicUsize::new(0));
    let counter = processed.clone();
    // Act
    let ack = gate
        .handle(delivery(Uuid::new_v4(), "d-cut-claim"), move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<Value, ProcessingError>(json!("stored")) }
        })
        .await;
    // Assert: 503 now, and the claim that landed late is processed and
    // journaled: a redelivery meeting it (ACKed as a duplicate) loses nothing.
    assert_eq!(ack, Ack::Retry(RetryReason::PlaneUnavailable));
    let journaled = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if requests(&server).await.iter().any(|r| r.url.path() == "/rpc/idempotency_complete") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(journaled.is_ok(), "the late claim was never carried to its journal");
    assert_eq!(processed.load(Ordering::SeqCst), 1);
    let paths: Vec<String> = requests(&server).await.iter().map(|r| r.url.path().to_owned()).collect();
    assert!(!paths.iter().any(|p| p == "/rpc/idempotency_release"), "never released: {paths:?}");
    server.verify().await;
}

#[tokio::test]
async fn processing_that_outlasts_the_deadline_is_accepted_and_finished_after_the_answer() {
    // Arrange
    let gate = memory_gate().with_deadline(DEADLINE);
    let org = Uuid::new_v4();
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let slow = move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            tokio::time::sleep(DEADLINE * 2).await;
            Ok::<Value, ProcessingError>(json!("stored"))
        }
    };
    // Act
    let started = Instant::now();
    let first = gate.handle(delivery(org, "d-slow"), slow).await;
    let took = started.elapsed();
    let meanwhile = gate.handle(delivery(org, "d-slow"), || async { panic!("processed once") }).await;
    tokio::time::sleep(DEADLINE * 3).await;
    let after = gate.handle(delivery(org, "d-slow"), || async { panic!("processed once") }).await;
    // Assert
    assert_eq!(first, Ack::Accepted);
    assert_eq!(first.status(), 200, "no 5xx for slow but successful processing");
    assert!(took < DEADLINE + MARGIN, "answered after {took:?} for a {DEADLINE:?} deadline");
    assert_eq!(meanwhile, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(after, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "processed once, not restarted");
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
    let processed = Arc::new(AtomicUsize::new(0));
    let counter = processed.clone();
    // Act
    let started = Instant::now();
    let ack = gate
        .handle(delivery(Uuid::new_v4(), "d-slow-complete"), move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok::<Value, ProcessingError>(json!("stored")) }
        })
        .await;
    let took = started.elapsed();
    // Assert
    assert_eq!(ack, Ack::Accepted, "the processing happened: the vendor must not redeliver");
    assert_eq!(ack.status(), 200);
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
