//! Servers that answer what wiremock cannot send, from a raw TCP server:
//! a body cut short of its Content-Length is an interrupted
//! transport error (a claim is sent again, a release is not), garbage status
//! lines and heads are transport errors and never panics, an unknown status
//! is an HTTP error, and an endless chunked body stops at the response limit.

use std::time::Duration;

use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, RetryConfig, TransportKind};
use idempotency_plane::repo::IdempotencyRepository;
use idempotency_plane::{Error, IdempotencyService, PostgrestRepository, RequestHash};
use serde_json::json;
use uuid::Uuid;

use crate::hostile::{repository_for, RETRY_WITHIN, SCOPE};
use crate::support::transport::{fast_retry, FaultServer, KEY};

fn assert_transport(result: Result<impl std::fmt::Debug, Error>, function: &str, kind: TransportKind, what: &str) {
    match result {
        Err(Error::Store(ClientError::Transport { function: f, kind: k, .. })) if f == function && k == kind => {}
        other => panic!("{what}: expected Store(Transport {{ {function}, {kind:?} }}), got {other:?}"),
    }
}

const TRUNCATED: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n[{\"id\": \"";

#[tokio::test]
async fn a_body_cut_short_of_its_content_length_is_an_interrupted_transport_error() {
    // Arrange
    let server = FaultServer::answering(TRUNCATED).await;
    // Act
    let result = repository_for(server.url(), RetryConfig::disabled()).get(Uuid::new_v4(), SCOPE, "k").await;
    // Assert
    assert_transport(result, "idempotency_get", TransportKind::Interrupted, "truncated body");
    assert_eq!(server.connections(), 1);
}

#[tokio::test]
async fn a_claim_cut_short_is_sent_again_but_a_release_cut_short_is_not() {
    // Arrange
    let hash = RequestHash::of_json(&json!({"to": "a@example.com"}));
    let claim_server = FaultServer::answering(TRUNCATED).await;
    let release_server = FaultServer::answering(TRUNCATED).await;
    let service = IdempotencyService::new(repository_for(claim_server.url(), fast_retry(RETRY_WITHIN)));
    // Act
    let claimed = service.claim(Uuid::new_v4(), SCOPE, "run-1", &hash, Duration::from_secs(60)).await;
    let released = repository_for(release_server.url(), fast_retry(RETRY_WITHIN))
        .release(Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4())
        .await;
    // Assert: a claim is safe to repeat (3 attempts); a release that may have happened is not.
    assert_transport(claimed, "idempotency_claim", TransportKind::Interrupted, "claim");
    assert_eq!(claim_server.connections(), 3);
    assert_transport(released, "idempotency_release", TransportKind::Interrupted, "release");
    assert_eq!(release_server.connections(), 1);
}

#[tokio::test]
async fn garbage_status_lines_and_heads_are_transport_errors_never_panics() {
    let huge_header = format!("HTTP/1.1 200 OK\r\nX-Huge: {}\r\nContent-Length: 2\r\n\r\n[]", "h".repeat(600 * 1024));
    let many_headers = format!(
        "HTTP/1.1 200 OK\r\n{}Content-Length: 2\r\n\r\n[]",
        (0..200).map(|i| format!("X-{i}: v\r\n")).collect::<String>()
    );
    let answers: Vec<(&str, Vec<u8>)> = vec![
        ("a garbage status line", b"HTTP/1.1 garbage\r\n\r\n".to_vec()),
        ("no status line at all", b"GARBAGE\r\n\r\n[]".to_vec()),
        ("a bare body", b"[]".to_vec()),
        ("binary noise", b"\x00\xff\xfe\x01\r\n\r\n".to_vec()),
        ("a four-digit status", b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n[]".to_vec()),
        ("a status below 100", b"HTTP/1.1 099 Low\r\nContent-Length: 2\r\n\r\n[]".to_vec()),
        ("HTTP/2.0 in an HTTP/1 head", b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\n[]".to_vec()),
        ("a non-numeric Content-Length", b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n[]".to_vec()),
        ("a non-UTF-8 header name", b"HTTP/1.1 200 OK\r\nX-\xff: v\r\nContent-Length: 2\r\n\r\n[]".to_vec()),
        (
            "a malformed chunk size",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n[]\r\n0\r\n\r\n".to_vec(),
        ),
        ("a 600 kB header", huge_header.into_bytes()),
        ("200 headers", many_headers.into_bytes()),
    ];
    for (what, answer) in answers {
        // Arrange
        let server = FaultServer::answering(answer).await;
        // Act
        let result = repository_for(server.url(), RetryConfig::disabled()).get(Uuid::new_v4(), SCOPE, "k").await;
        // Assert
        assert_transport(result, "idempotency_get", TransportKind::Interrupted, what);
    }
}

#[tokio::test]
async fn an_unknown_three_digit_status_is_an_http_error() {
    // Arrange
    let server = FaultServer::answering(b"HTTP/1.1 999 Odd\r\nContent-Length: 4\r\n\r\nodd!".as_slice()).await;
    // Act
    let result = repository_for(server.url(), RetryConfig::disabled()).get(Uuid::new_v4(), SCOPE, "k").await;
    // Assert
    match result {
        Err(Error::Store(ClientError::Http { status: 999, body_excerpt, .. })) => assert_eq!(body_excerpt, "odd!"),
        other => panic!("expected Store(Http 999), got {other:?}"),
    }
}

#[tokio::test]
async fn an_endless_chunked_body_stops_at_the_response_limit() {
    // Arrange: a chunked answer (no Content-Length) of 2 MiB.
    let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, "x".repeat(64 * 1024));
    let mut answer =
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..32 {
        answer.extend_from_slice(chunk.as_bytes());
    }
    answer.extend_from_slice(b"0\r\n\r\n");
    let server = FaultServer::answering(answer).await;
    let config = ClientConfig::new(server.url(), KEY)
        .expect("config")
        .with_retry(RetryConfig::disabled())
        .with_max_response_bytes(1024 * 1024)
        .expect("a limit");
    // Act
    let result =
        PostgrestRepository::new(PostgrestClient::new(config).expect("client")).get(Uuid::new_v4(), SCOPE, "k").await;
    // Assert
    assert!(
        matches!(result, Err(Error::Store(ClientError::ResponseTooLarge { function: "idempotency_get", .. }))),
        "{result:?}"
    );
}
