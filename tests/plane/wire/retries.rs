//! Retries against PostgREST's exact answers (wiremock, §4): which answers
//! and transport failures are retried, for which calls. What never ran
//! (schema cache 503, pool timeout 504, serialization failure, a refused
//! connection) is retried for any call; what may have run (a lost
//! connection, a timeout) only for a call safe to repeat; what repeats
//! deterministically (a 400, a statement timeout) never.

use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, ClientError, Repeat, RetryConfig, TransportKind};
use serde_json::{json, Value};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::transport::{fast_retry, FaultServer, RefusedPort, KEY};
use crate::wire::{client, config, error_body, requests, RETRY_WITHIN};

// ---------------------------------------------------------------------------
// Retries by status
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_schema_cache_503_is_retried_and_the_call_then_succeeds() {
    // §4 "Transient conditions": 503 PGRST002 + `Retry-After: 0`; the request never ran,
    // so even a call unsafe to repeat is retried.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(
            ResponseTemplate::new(503)
                .insert_header("retry-after", "0")
                .set_body_json(error_body("PGRST002", "Could not query the database for the schema cache. Retrying.")),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(true)))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let released: bool =
        client.rpc("idempotency_release", &json!({}), Repeat::Unsafe).await.expect("the retry succeeds");
    // Assert
    assert!(released);
    assert_eq!(requests(&server).await.len(), 2);
    server.verify().await;
}

#[tokio::test]
async fn a_503_that_never_clears_gives_up_after_max_retries_plus_one_requests() {
    // §4 "Transient conditions": every 503 carries `Retry-After: 0`; use our own backoff.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(
            ResponseTemplate::new(503)
                .insert_header("retry-after", "0")
                .set_body_json(error_body("PGRST002", "schema cache not loaded")),
        )
        .expect(u64::from(fast_retry(RETRY_WITHIN).max_retries) + 1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert_eq!(err.status(), Some(503));
    assert_eq!(err.code(), Some("PGRST002"));
    assert_eq!(err.retry_after(), Some(Duration::ZERO));
    assert_eq!(requests(&server).await.len(), 3);
    server.verify().await;
}

#[tokio::test]
async fn a_400_is_never_retried_even_for_a_call_safe_to_repeat() {
    // §4 "Not transient: other 4xx".
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(400).set_body_json(error_body("22023", "p_claim_id is required")))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert_eq!(err.status(), Some(400));
    assert_eq!(err.code(), Some("22023"));
    assert_eq!(requests(&server).await.len(), 1);
    server.verify().await;
}

#[tokio::test]
async fn a_serialization_failure_500_is_retried_even_for_a_call_unsafe_to_repeat() {
    // §4 "Transient conditions": 500 40001 was rolled back, safe to retry; v16+ does not
    // retry it internally.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(
            ResponseTemplate::new(500)
                .set_body_json(error_body("40001", "could not serialize access due to concurrent update")),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(false)))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let released: bool =
        client.rpc("idempotency_release", &json!({}), Repeat::Unsafe).await.expect("the retry succeeds");
    // Assert
    assert!(!released);
    assert_eq!(requests(&server).await.len(), 2);
    server.verify().await;
}

#[tokio::test]
async fn a_statement_timeout_500_is_not_retried() {
    // §4 "Transient conditions": 500 57014 repeats deterministically for a slow query.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(
            ResponseTemplate::new(500)
                .set_body_json(error_body("57014", "canceling statement due to statement timeout")),
        )
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert_eq!(err.status(), Some(500));
    assert_eq!(err.code(), Some("57014"));
    server.verify().await;
}

// ---------------------------------------------------------------------------
// Transport failures
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_refused_connection_is_a_connect_transport_error_after_retries() {
    // §4 "Transient conditions": a request that never reached the server never ran;
    // retried for any call, then reported as a connect failure.
    // Arrange: a port that refuses for as long as `refused` lives (a port
    // bound and freed could be taken by another test's server meanwhile).
    let refused = RefusedPort::new();
    let config = ClientConfig::new(&refused.url(), KEY).unwrap().with_retry(fast_retry(RETRY_WITHIN));
    let client = client(config);
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Unsafe).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::Transport { kind: TransportKind::Connect, .. }), "{err:?}");
    assert!(err.is_retryable(false));
}

#[tokio::test]
async fn an_answer_slower_than_the_request_timeout_is_a_timeout_transport_error() {
    // §4 "Transient conditions" [inference]: a request that may have run leaves the commit
    // outcome unknown, so a timeout is its own kind.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(true)).set_delay(Duration::from_secs(5)))
        .expect(1)
        .mount(&server)
        .await;
    let config = config(&server).with_request_timeout(Duration::from_millis(200)).with_retry(RetryConfig::disabled());
    let client = client(config);
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert: a timeout, not the answer that comes after 5 s.
    assert!(matches!(err, ClientError::Transport { kind: TransportKind::Timeout, .. }), "{err:?}");
    assert!(!err.is_retryable(false));
    assert!(err.is_retryable(true));
}

// ---------------------------------------------------------------------------
// Retries that depend on whether the call is safe to repeat
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_pool_timeout_504_is_retried_even_for_a_call_unsafe_to_repeat() {
    // §4 "Transient conditions": 504 PGRST003, the pool was saturated and the request never ran.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(
            ResponseTemplate::new(504)
                .set_body_json(error_body("PGRST003", "Timed out acquiring connection from connection pool.")),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!(true)))
        .expect(1)
        .mount(&server)
        .await;
    // Act
    let released: bool = client(config(&server))
        .rpc("idempotency_release", &json!({}), Repeat::Unsafe)
        .await
        .expect("the retry succeeds");
    // Assert
    assert!(released);
    server.verify().await;
}

#[tokio::test]
async fn a_connection_lost_503_is_retried_only_for_a_call_safe_to_repeat() {
    // §4 "Transient conditions" [inference]: PGRST001 can leave the commit outcome unknown.
    for (repeat, expected_requests) in [(Repeat::Unsafe, 1usize), (Repeat::Safe, 3)] {
        // Arrange
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/rpc/idempotency_release"))
            .respond_with(
                ResponseTemplate::new(503)
                    .insert_header("retry-after", "0")
                    .set_body_json(error_body("PGRST001", "Database client error")),
            )
            .mount(&server)
            .await;
        // Act
        let err = client(config(&server)).rpc::<bool>("idempotency_release", &json!({}), repeat).await.unwrap_err();
        // Assert
        assert_eq!(err.code(), Some("PGRST001"), "{repeat:?}");
        assert_eq!(requests(&server).await.len(), expected_requests, "{repeat:?}");
    }
}

#[tokio::test]
async fn a_timed_out_call_is_sent_again_only_when_it_is_safe_to_repeat() {
    // §4 [inference]: a request that timed out may have run.
    for (repeat, succeeds, expected_requests) in [(Repeat::Safe, true, 2usize), (Repeat::Unsafe, false, 1)] {
        // Arrange: the first answer is too slow, the next one is prompt.
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/rpc/idempotency_get"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!([])).set_delay(Duration::from_secs(3)))
            .up_to_n_times(1)
            .with_priority(1)
            .mount(&server)
            .await;
        Mock::given(method("POST"))
            .and(path("/rpc/idempotency_get"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!([])))
            .mount(&server)
            .await;
        let client = client(config(&server).with_request_timeout(Duration::from_millis(300)));
        // Act
        let result = client.rpc::<Value>("idempotency_get", &json!({}), repeat).await;
        // Assert
        assert_eq!(result.is_ok(), succeeds, "{repeat:?}: {result:?}");
        if let Err(err) = result {
            assert!(matches!(err, ClientError::Transport { kind: TransportKind::Timeout, .. }), "{err:?}");
        }
        assert_eq!(requests(&server).await.len(), expected_requests, "{repeat:?}");
    }
}

#[tokio::test]
async fn a_connection_dropped_after_sending_is_retried_only_when_safe_to_repeat() {
    // §4 [inference]: a connection lost mid-request can leave the commit outcome unknown.
    for (repeat, expected_connections) in [(Repeat::Unsafe, 1usize), (Repeat::Safe, 3)] {
        // Arrange: a server that reads each request and closes the
        // connection without an answer.
        let server = FaultServer::hanging_up().await;
        let config = ClientConfig::new(server.url(), KEY)
            .expect("config")
            .with_retry(fast_retry(RETRY_WITHIN))
            .with_pool_max_idle_per_host(0);
        // Act
        let err = client(config).rpc::<Value>("idempotency_get", &json!({}), repeat).await.unwrap_err();
        // Assert
        assert!(matches!(err, ClientError::Transport { kind: TransportKind::Interrupted, .. }), "{repeat:?}: {err:?}");
        assert_eq!(server.connections(), expected_connections, "{repeat:?}");
    }
}
