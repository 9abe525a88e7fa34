//! Servers that answer garbage, replayed with wiremock: bodies that
//! are not JSON or not of the right shape are decode errors sent once, two
//! rows for one key are an inconsistent store, error answers that are not
//! PostgREST's are HTTP errors with a bounded excerpt, absurd Content-Range
//! headers fail a sweep pass and delete nothing, and absurd headers neither
//! matter to a plain read nor stretch the backoff.

use std::time::Duration;

use idempotency_plane::postgrest::ClientError;
use idempotency_plane::repo::IdempotencyRepository;
use idempotency_plane::sweeper::Sweeper;
use idempotency_plane::{Error, IdempotencyService, RequestHash};
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::hostile::{client_for, repository_for, RETRY_WITHIN, SCOPE};
use crate::support::transport::{claim_row, fast_retry};

/// A claim row of `SCOPE` under fresh ids, for the hash of `{}`.
fn record(status: &str) -> Value {
    claim_row(Uuid::new_v4(), Uuid::new_v4(), SCOPE, &RequestHash::of_json(&json!({})), status)
}

/// `record("processing")` with `field` replaced, or removed for `None`.
fn record_with(field: &str, value: Option<Value>) -> Value {
    let mut row = record("processing");
    let object = row.as_object_mut().expect("an object");
    match value {
        Some(value) => object.insert(field.to_owned(), value),
        None => object.remove(field),
    };
    row
}

/// A server answering `function` with `response`, expected exactly `times` times.
async fn answering(function: &str, response: ResponseTemplate, times: u64) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(format!("/rpc/{function}")))
        .respond_with(response)
        .expect(times)
        .mount(&server)
        .await;
    server
}

fn raw_body(bytes: impl Into<Vec<u8>>) -> ResponseTemplate {
    ResponseTemplate::new(200).set_body_raw(bytes.into(), "application/json")
}

fn assert_decode(result: Result<impl std::fmt::Debug, Error>, function: &str, what: &str) {
    match result {
        Err(Error::Store(ClientError::Decode { function: f, .. })) if f == function => {}
        other => panic!("{what}: expected Store(Decode {{ function: {function} }}), got {other:?}"),
    }
}

#[tokio::test]
async fn non_json_success_bodies_are_decode_errors_of_the_repository() {
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("an empty body", Vec::new()),
        ("plain text", b"OK".to_vec()),
        ("html", b"<html><body>hello</body></html>".to_vec()),
        ("truncated JSON", b"[{\"id\": ".to_vec()),
        ("JSON followed by garbage", b"[] []".to_vec()),
        ("non-UTF-8 bytes", b"[\"\xff\xfe\"]".to_vec()),
        ("a NUL byte", b"[\x00]".to_vec()),
        ("100,000 nested arrays", "[".repeat(100_000).into_bytes()),
        ("a lone surrogate escape in a key", b"[{\"\\ud800\": 1}]".to_vec()),
    ];
    for (what, body) in bodies {
        // Arrange
        let server = answering("idempotency_get", raw_body(body), 1).await;
        // Act
        let result = repository_for(&server.uri(), fast_retry(RETRY_WITHIN)).get(Uuid::new_v4(), SCOPE, "k").await;
        // Assert: decoding failures are never retried.
        assert_decode(result, "idempotency_get", what);
        server.verify().await;
    }
}

#[tokio::test]
async fn success_bodies_of_the_wrong_shape_are_decode_errors_of_the_repository() {
    let shapes: Vec<(&str, Value)> = vec![
        ("an object instead of an array", record("processing")),
        ("an array of numbers", json!([1, 2, 3])),
        ("an array of arrays", json!([[record("processing")]])),
        ("null", Value::Null),
        ("a boolean", json!(true)),
        ("a string", json!("[]")),
        ("a row missing its id", json!([record_with("id", None)])),
        ("a row missing lease_live", json!([record_with("lease_live", None)])),
        ("status \"done\"", json!([record_with("status", Some(json!("done")))])),
        ("status in capitals", json!([record_with("status", Some(json!("COMPLETED")))])),
        ("lease_live as a string", json!([record_with("lease_live", Some(json!("yes")))])),
        ("an id that is no uuid", json!([record_with("id", Some(json!("nope")))])),
        ("a timestamp that is no timestamp", json!([record_with("claimed_at", Some(json!("yesterday")))])),
        ("a numeric request hash", json!([record_with("request_hash", Some(json!(5)))])),
        ("a null key", json!([record_with("key", Some(Value::Null))])),
        ("a numeric lease token", json!([record_with("lease_token", Some(json!(1)))])),
    ];
    for (what, body) in shapes {
        // Arrange
        let server = answering("idempotency_get", ResponseTemplate::new(200).set_body_json(body), 1).await;
        // Act
        let result = repository_for(&server.uri(), fast_retry(RETRY_WITHIN)).get(Uuid::new_v4(), SCOPE, "k").await;
        // Assert
        assert_decode(result, "idempotency_get", what);
        server.verify().await;
    }
}

#[tokio::test]
async fn two_rows_for_one_key_are_an_inconsistent_store() {
    // Arrange
    let body = json!([record("processing"), record("completed")]);
    let server = answering("idempotency_get", ResponseTemplate::new(200).set_body_json(body), 1).await;
    // Act
    let result = repository_for(&server.uri(), fast_retry(RETRY_WITHIN)).get(Uuid::new_v4(), SCOPE, "k").await;
    // Assert
    assert!(matches!(result, Err(Error::Inconsistent(_))), "{result:?}");
    server.verify().await;
}

#[tokio::test]
async fn a_release_answered_with_anything_but_a_boolean_is_a_decode_error() {
    for body in [json!("true"), json!(1), json!([true]), Value::Null, json!({"released": true})] {
        // Arrange
        let server = answering("idempotency_release", ResponseTemplate::new(200).set_body_json(&body), 1).await;
        // Act
        let result = repository_for(&server.uri(), fast_retry(RETRY_WITHIN))
            .release(Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4())
            .await;
        // Assert
        assert_decode(result, "idempotency_release", &body.to_string());
        server.verify().await;
    }
}

#[tokio::test]
async fn a_claim_and_a_read_answered_with_garbage_are_store_decode_errors_of_the_service_sent_once() {
    let hash = RequestHash::of_json(&json!({"to": "a@example.com"}));
    for (function, body) in [
        ("idempotency_claim", json!({"not": "rows"})),
        ("idempotency_claim", json!([record_with("status", Some(json!("done")))])),
        ("idempotency_get", json!([1])),
    ] {
        // Arrange
        let server = answering(function, ResponseTemplate::new(200).set_body_json(&body), 1).await;
        let service = IdempotencyService::new(repository_for(&server.uri(), fast_retry(RETRY_WITHIN)));
        // Act
        // Assert
        if function == "idempotency_get" {
            assert_decode(service.read(Uuid::new_v4(), SCOPE, "run-1", &hash).await, function, &body.to_string());
        } else {
            let claimed = service.claim(Uuid::new_v4(), SCOPE, "run-1", &hash, Duration::from_secs(60)).await;
            assert_decode(claimed, function, &body.to_string());
        }
        server.verify().await;
    }
}

#[tokio::test]
async fn error_answers_that_are_not_postgrest_errors_are_http_errors_with_a_bounded_lossy_excerpt() {
    let long_multibyte = format!("x{}", "é".repeat(5_000)); // byte 256 falls inside an 'é'
    let cases: Vec<(u16, Vec<u8>)> = vec![
        (500, b"\xff\xfe\x00garbage".to_vec()),
        (400, br#"{"code": 5, "message": null}"#.to_vec()),
        (400, br#"{"code": "22023"}"#.to_vec()),
        (418, long_multibyte.clone().into_bytes()),
        (404, Vec::new()),
    ];
    for (status, body) in cases {
        // Arrange
        let server =
            answering("idempotency_get", ResponseTemplate::new(status).set_body_raw(body.clone(), "text/plain"), 1)
                .await;
        // Act
        let result = repository_for(&server.uri(), fast_retry(RETRY_WITHIN)).get(Uuid::new_v4(), SCOPE, "k").await;
        // Assert
        match result {
            Err(Error::Store(ClientError::Http { status: s, body_excerpt, .. })) => {
                assert_eq!(s, status);
                let expected = String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned();
                assert_eq!(body_excerpt, expected);
                assert!(body_excerpt.chars().count() <= 256, "{}", body_excerpt.len());
            }
            other => panic!("{status}: expected Store(Http), got {other:?}"),
        }
        server.verify().await;
    }
}

/// What a sweep pass must fail with.
#[derive(Debug)]
enum Refusal {
    /// `ClientError::ContentRange` with this reason.
    ContentRange(&'static str),
    /// `ClientError::Truncated { received: 0, total: u64::MAX }`.
    TruncatedToNothing,
    /// `ClientError::Decode`: the header and the body disagree.
    Decode,
}

#[tokio::test]
async fn absurd_content_ranges_fail_a_sweep_pass_with_typed_errors_and_delete_nothing() {
    let one_row = || json!([{"id": Uuid::new_v4(), "retain_until": "2026-01-01T00:00:00Z"}]);
    let cases: Vec<(Vec<u8>, Value, Refusal)> = vec![
        (
            b"0-18446744073709551615/*".to_vec(),
            one_row(),
            Refusal::ContentRange("the server did not count the rows, so truncation cannot be ruled out"),
        ),
        (
            b"0-18446744073709551615/18446744073709551615".to_vec(),
            one_row(),
            Refusal::ContentRange("range ends past the total"),
        ),
        (b"*/18446744073709551615".to_vec(), json!([]), Refusal::TruncatedToNothing),
        (b"0-18446744073709551614/18446744073709551615".to_vec(), one_row(), Refusal::Decode),
        (
            format!("0-{}/*", "9".repeat(10 * 1024)).into_bytes(),
            one_row(),
            Refusal::ContentRange("upper bound is not a number"),
        ),
        (b"0-0/\xc3\x28".to_vec(), one_row(), Refusal::ContentRange("not visible ASCII")),
        (b"-1-0/1".to_vec(), one_row(), Refusal::ContentRange("lower bound is not a number")),
    ];
    for (content_range, body, refusal) in cases {
        // Arrange
        let shown = String::from_utf8_lossy(&content_range).into_owned();
        let server = MockServer::start().await;
        Mock::given(method("POST"))
            .and(path("/rpc/idempotency_expired"))
            .respond_with(
                ResponseTemplate::new(200).insert_header("content-range", content_range.as_slice()).set_body_json(body),
            )
            .expect(1)
            .mount(&server)
            .await;
        Mock::given(method("POST"))
            .and(path("/rpc/idempotency_retire_expired"))
            .respond_with(ResponseTemplate::new(200).set_body_json(json!(1)))
            .expect(0)
            .mount(&server)
            .await;
        let sweeper = Sweeper::new(client_for(&server.uri(), fast_retry(RETRY_WITHIN)), 10).expect("a sweeper");
        // Act
        let result = sweeper.pass().await;
        // Assert
        match (&refusal, &result) {
            (
                Refusal::ContentRange(reason),
                Err(Error::Store(ClientError::ContentRange { function: "idempotency_expired", source })),
            ) => {
                assert_eq!(source.reason, *reason, "{shown}");
                assert_eq!(source.value, shown);
            }
            (Refusal::TruncatedToNothing, Err(Error::Store(ClientError::Truncated { received: 0, total, .. })))
                if *total == u64::MAX => {}
            (Refusal::Decode, Err(Error::Store(ClientError::Decode { function: "idempotency_expired", .. }))) => {}
            _ => panic!("{shown}: expected {refusal:?}, got {result:?}"),
        }
        server.verify().await;
    }
}

#[tokio::test]
async fn the_repository_ignores_absurd_headers_it_does_not_need() {
    // Arrange: a valid row under headers no PostgREST sends.
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("content-range", "0-18446744073709551615/*")
                .insert_header("x-padding", "p".repeat(10 * 1024).as_str())
                .insert_header("x-binary", b"\xff\xfe\x80".as_slice())
                .insert_header("retry-after", "18446744073709551616")
                .set_body_json(json!([record("completed")])),
        )
        .expect(1)
        .mount(&server)
        .await;
    // Act
    let row = repository_for(&server.uri(), fast_retry(RETRY_WITHIN)).get(Uuid::new_v4(), SCOPE, "k").await;
    // Assert
    let row = row.expect("the headers do not matter to a plain read").expect("one row");
    assert_eq!(row.key, "run-1:step-1");
    server.verify().await;
}

#[tokio::test]
async fn an_absurd_retry_after_is_read_or_ignored_and_never_stretches_the_backoff() {
    let cases: [(&[u8], Option<Duration>); 6] = [
        (b"18446744073709551615", Some(Duration::from_secs(u64::MAX))),
        (b"18446744073709551616", None),
        (b"-1", None),
        (b"1e3", None),
        (b"Wed, 21 Oct 2015 07:28:00 GMT", None),
        (b"\xff\xfe", None),
    ];
    for (retry_after, expected) in cases {
        // Arrange: 503 PGRST002 never ran, so it is retried (2 retries, backoff ≤ 5 ms).
        let server = answering(
            "idempotency_get",
            ResponseTemplate::new(503)
                .insert_header("retry-after", retry_after)
                .set_body_json(json!({"code": "PGRST002", "message": "schema cache", "details": null, "hint": null})),
            3,
        )
        .await;
        // Act: a backoff stretched by the header would outlast the bound.
        let result = tokio::time::timeout(
            Duration::from_secs(30),
            repository_for(&server.uri(), fast_retry(RETRY_WITHIN)).get(Uuid::new_v4(), SCOPE, "k"),
        )
        .await
        .unwrap_or_else(|_| panic!("Retry-After {:?} stretched the backoff", String::from_utf8_lossy(retry_after)));
        // Assert
        match result {
            Err(Error::Store(error @ ClientError::Api { status: 503, .. })) => {
                assert_eq!(error.retry_after(), expected, "{}", String::from_utf8_lossy(retry_after))
            }
            other => panic!("expected Store(Api 503), got {other:?}"),
        }
        server.verify().await;
    }
}
