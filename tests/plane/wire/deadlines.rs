//! The deadline of one operation (wiremock): a slow server is cut at the
//! deadline, a retry that could not finish before it is not started, and
//! either way the call ends with `ClientError::DeadlineExceeded` soon after
//! the deadline. A deadline longer than the work changes nothing.
//!
//! Upper bounds only, and generous ones (the deadline plus 1.5 s): a loaded
//! machine may be slow, never early.

use std::time::{Duration, Instant};

use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat, RetryConfig};
use serde_json::json;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::transport::KEY;
use crate::wire::{error_body, requests};

/// How late after its deadline a call may end, on a slow machine.
const MARGIN: Duration = Duration::from_millis(1500);

const RELEASE: &str = "/rpc/idempotency_release";

/// Many quick retries, so the deadline, not the retry budget, ends the call.
fn patient_retry() -> RetryConfig {
    RetryConfig {
        max_retries: 50,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(50),
        max_elapsed: Duration::from_secs(60),
    }
}

fn client(server: &MockServer, deadline: Duration) -> PostgrestClient {
    let config = ClientConfig::new(&server.uri(), KEY)
        .expect("a valid config")
        .with_retry(patient_retry())
        .with_deadline(deadline)
        .expect("a deadline above zero");
    PostgrestClient::new(config).expect("a client")
}

fn schema_cache_503() -> ResponseTemplate {
    ResponseTemplate::new(503)
        .insert_header("retry-after", "0")
        .set_body_json(error_body("PGRST002", "Could not query the database for the schema cache. Retrying."))
}

#[tokio::test]
async fn a_server_slower_than_the_deadline_is_cut_at_the_deadline() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(RELEASE))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(true)).set_delay(Duration::from_secs(30)))
        .mount(&server)
        .await;
    let deadline = Duration::from_millis(500);
    let client = client(&server, deadline);
    // Act
    let started = Instant::now();
    let error = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    let took = started.elapsed();
    // Assert
    assert!(took < deadline + MARGIN, "ended {took:?} after it started, for a {deadline:?} deadline");
    match &error {
        ClientError::DeadlineExceeded { function, deadline: told, attempts, in_flight, last_error, .. } => {
            assert_eq!(*function, "idempotency_release");
            assert_eq!(*told, deadline);
            assert_eq!(*attempts, 1);
            assert!(*in_flight, "the request was cut in flight");
            assert!(last_error.is_none());
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    // An unknown outcome, like a timeout: only a call safe to repeat may be sent again.
    assert!(error.is_retryable(true) && !error.is_retryable(false));
    assert!(error.is_transient());
    assert_eq!(requests(&server).await.len(), 1);
}

#[tokio::test]
async fn a_503_sequence_retries_until_no_retry_could_finish_before_the_deadline() {
    // Each 503 takes 300 ms to arrive; retries follow until the next would overrun the deadline.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(RELEASE))
        .respond_with(schema_cache_503().set_delay(Duration::from_millis(300)))
        .mount(&server)
        .await;
    let deadline = Duration::from_secs(3);
    let client = client(&server, deadline);
    // Act
    let started = Instant::now();
    let error = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Unsafe).await.unwrap_err();
    let took = started.elapsed();
    // Assert
    assert!(took < deadline + MARGIN, "ended {took:?} after it started, for a {deadline:?} deadline");
    let sent = requests(&server).await.len();
    assert!(sent >= 2, "the 503 was retried: {sent} requests");
    match &error {
        ClientError::DeadlineExceeded { attempts, last_error, .. } => {
            assert_eq!(*attempts as usize, sent);
            let last = last_error.as_deref().expect("an attempt completed before the deadline");
            assert_eq!((last.status(), last.code()), (Some(503), Some("PGRST002")));
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    assert!(error.is_transient());
}

#[tokio::test]
async fn no_retry_starts_when_its_backoff_alone_passes_the_deadline() {
    // `Retry-After: 1` asks for a second's wait; 500 ms remain, so nothing is sent again.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(RELEASE))
        .respond_with(schema_cache_503().insert_header("retry-after", "1"))
        .expect(1)
        .mount(&server)
        .await;
    let config = ClientConfig::new(&server.uri(), KEY)
        .expect("a valid config")
        .with_retry(RetryConfig { max_backoff: Duration::from_secs(2), ..patient_retry() })
        .with_deadline(Duration::from_millis(500))
        .expect("a deadline above zero");
    let client = PostgrestClient::new(config).expect("a client");
    // Act
    let error = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Unsafe).await.unwrap_err();
    // Assert
    match &error {
        ClientError::DeadlineExceeded { attempts: 1, in_flight: false, last_error: Some(last), .. } => {
            assert_eq!(last.code(), Some("PGRST002"));
        }
        other => panic!("expected DeadlineExceeded after one attempt, got {other:?}"),
    }
    // The request never ran (PGRST002), so even a call unsafe to repeat may be sent again later.
    assert!(error.is_retryable(false));
    server.verify().await;
}

#[tokio::test]
async fn a_deadline_longer_than_the_work_changes_nothing() {
    // Arrange: one slow 503, then a slow success.
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(RELEASE))
        .respond_with(schema_cache_503().set_delay(Duration::from_millis(100)))
        .up_to_n_times(1)
        .with_priority(1)
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path(RELEASE))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(true)).set_delay(Duration::from_millis(200)))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(&server, Duration::from_secs(20));
    // Act
    let released: bool =
        client.rpc("idempotency_release", &json!({}), Repeat::Unsafe).await.expect("the retry succeeds in time");
    // Assert
    assert!(released);
    assert_eq!(requests(&server).await.len(), 2);
    server.verify().await;
}

#[tokio::test]
async fn a_refusal_within_the_deadline_is_returned_as_it_is() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(RELEASE))
        .respond_with(ResponseTemplate::new(400).set_body_json(error_body("22023", "p_claim_id is required")))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(&server, Duration::from_secs(5));
    // Act
    let error = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert_eq!((error.status(), error.code()), (Some(400), Some("22023")), "{error:?}");
    server.verify().await;
}
