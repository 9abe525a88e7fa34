//! Bounded reads against PostgREST's exact answers (wiremock, §3 and §7):
//! the Content-Range cases of a read (complete, empty, cut short with 206,
//! uncounted, missing, malformed, overflowing, past its total, disagreeing
//! with the body or the bound), and what a bounded read sends (count,
//! profiles, credentials, select, a bound never above `db-max-rows`).

use idempotency_plane::postgrest::{ClientError, Repeat};
use serde_json::{json, Value};
use wiremock::matchers::{body_partial_json, header, method, path, query_param};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::wire::{
    client, config, counted, expired_rows, header_of, mount_expired, read_expired, requests, Expired, EXPIRED,
};

// ---------------------------------------------------------------------------
// Content-Range on a bounded read
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_counted_read_of_every_row_succeeds_with_all_rows() {
    // §3 matrix, count=exact, 0 < N < M: `0-(N-1)/N`, 200.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-4/5", expired_rows(5))).await;
    // Act
    let rows = read_expired(&server, 10).await.expect("a complete read");
    // Assert
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|row| !row.id.is_nil()));
}

#[tokio::test]
async fn a_counted_empty_read_succeeds_with_no_rows() {
    // §3 matrix, count=exact, N = 0: `*/0`, 200, `[]`.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "*/0", json!([]))).await;
    // Act
    let rows = read_expired(&server, 10).await.expect("an empty read");
    // Assert
    assert!(rows.is_empty());
}

#[tokio::test]
async fn a_read_the_server_cut_short_with_206_is_truncated() {
    // §3 matrix, count=exact, N > M: `0-(M-1)/N`, 206; §7.2 truncation is silent otherwise.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(206, "0-2/7", expired_rows(3))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::Truncated { received: 3, total: 7, .. }), "{err:?}");
}

#[tokio::test]
async fn a_read_the_server_did_not_count_is_a_content_range_error() {
    // §3: without a count the total is `*` (`0-(N-1)/*`, 200), and §7.2: then
    // "exactly M rows" and "truncated to M" look identical.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-2/*", expired_rows(3))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::ContentRange { .. }), "{err:?}");
}

#[tokio::test]
async fn a_read_without_content_range_is_a_content_range_error() {
    // §3 "Other success headers on RPC": Content-Range is always sent, so its
    // absence means something other than PostgREST answered.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, ResponseTemplate::new(200).set_body_json(expired_rows(3))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::ContentRange { .. }), "{err:?}");
}

#[tokio::test]
async fn a_content_range_with_a_unit_prefix_is_a_content_range_error() {
    // §3: PostgREST writes `{lower}-{upper}/{total}` with no unit; `Range-Unit` is never emitted.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "bytes 0-1/2", expired_rows(2))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    match err {
        ClientError::ContentRange { source, .. } => assert_eq!(source.value, "bytes 0-1/2"),
        other => panic!("expected ContentRange, got {other:?}"),
    }
}

#[tokio::test]
async fn a_content_range_with_non_ascii_bytes_is_a_content_range_error_not_a_panic() {
    // §3: the header is plain ASCII digits, `-`, `/` and `*`; anything else is not PostgREST's.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(
        &server,
        ResponseTemplate::new(200)
            .insert_header("content-range", b"0-1/\xff\xfe".as_slice())
            .set_body_json(expired_rows(2)),
    )
    .await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    match err {
        ClientError::ContentRange { source, .. } => assert_eq!(source.reason, "not visible ASCII"),
        other => panic!("expected ContentRange, got {other:?}"),
    }
}

#[tokio::test]
async fn a_content_range_with_an_overflowing_bound_is_a_content_range_error_not_a_panic() {
    // §3: bounds are row offsets; one past u64 is not a PostgREST value.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-99999999999999999999/5", expired_rows(2))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::ContentRange { .. }), "{err:?}");
}

#[tokio::test]
async fn a_content_range_that_ends_past_its_total_is_a_content_range_error() {
    // §3 header rule: `upper = lower + rows_returned - 1` and `rows_returned <= total`,
    // so PostgREST never writes an upper bound at or past the total.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-9/5", expired_rows(10))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    match err {
        ClientError::ContentRange { source, .. } => assert_eq!(source.value, "0-9/5"),
        other => panic!("expected ContentRange, got {other:?}"),
    }
}

#[tokio::test]
async fn a_content_range_that_disagrees_with_the_body_is_a_decode_error() {
    // §7.3: rows actually returned = `upper - lower + 1` from Content-Range;
    // a body holding another number of rows is not what the server counted.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-2/3", expired_rows(2))).await;
    // Act
    let err = read_expired(&server, 10).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::Decode { .. }), "{err:?}");
}

#[tokio::test]
async fn a_bounded_read_answering_more_rows_than_its_bound_is_refused() {
    // §7: the bound is the function's own argument; a function that ignores it
    // must not make a caller act on more rows than it allowed.
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-4/5", expired_rows(5))).await;
    let err = read_expired(&server, 3).await.unwrap_err();
    assert!(matches!(err, ClientError::Decode { .. }), "{err:?}");
}

// ---------------------------------------------------------------------------
// What a bounded read sends
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_bounded_read_sends_count_profiles_credentials_and_select() {
    // §3 `Prefer: count=exact`; §1 schema selection (Content-Profile on POST,
    // Accept-Profile on GET); §6 Supabase `apikey` + `Authorization: Bearer`;
    // §2 `select=` on table-like results.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path(EXPIRED))
        .and(header("prefer", "count=exact"))
        .and(header("content-profile", "agent"))
        .and(header("accept-profile", "agent"))
        .and(header("authorization", "Bearer service-key"))
        .and(header("apikey", "anon-key"))
        .and(query_param("select", "id,retain_until"))
        .and(body_partial_json(json!({"p_limit": 10})))
        .respond_with(counted(200, "0-1/2", expired_rows(2)))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server).with_apikey("anon-key"));
    // Act
    let rows: Vec<Expired> = client
        .rpc_bounded("idempotency_expired", &json!({"p_limit": 10}), 10, Some("id,retain_until"), Repeat::Safe)
        .await
        .expect("a complete read");
    // Assert
    assert_eq!(rows.len(), 2);
    let sent = requests(&server).await;
    assert_eq!(sent.len(), 1);
    let request = &sent[0];
    assert_eq!(header_of(request, "prefer"), Some("count=exact"));
    assert_eq!(header_of(request, "content-profile"), Some("agent"));
    assert_eq!(header_of(request, "accept-profile"), Some("agent"));
    assert_eq!(header_of(request, "authorization"), Some("Bearer service-key"));
    assert_eq!(header_of(request, "apikey"), Some("anon-key"));
    let select: Vec<_> =
        request.url.query_pairs().filter(|(k, _)| k == "select").map(|(_, v)| v.into_owned()).collect();
    assert_eq!(select, ["id,retain_until"]);
    assert_eq!(request.body_json::<Value>().unwrap(), json!({"p_limit": 10}));
}

#[tokio::test]
async fn a_read_without_apikey_configured_sends_no_apikey_and_no_select_when_none_given() {
    // §6: `apikey` is Supabase's gateway header, not PostgREST's; §2 `select=` is optional.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-0/1", expired_rows(1))).await;
    let client = client(config(&server));
    // Act
    let rows: Vec<Expired> = client
        .rpc_bounded("idempotency_expired", &json!({"p_limit": 5}), 5, None, Repeat::Safe)
        .await
        .expect("a complete read");
    // Assert
    assert_eq!(rows.len(), 1);
    let sent = requests(&server).await;
    assert_eq!(sent.len(), 1);
    assert_eq!(header_of(&sent[0], "apikey"), None);
    assert_eq!(header_of(&sent[0], "authorization"), Some("Bearer service-key"));
    assert_eq!(sent[0].url.query(), None);
}

#[tokio::test]
async fn a_bound_above_max_rows_is_refused_without_any_request() {
    // §3: db-max-rows clamps silently, so a bound above it must never be sent.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(counted(200, "0-0/1", expired_rows(1))).expect(0).mount(&server).await;
    let client = client(config(&server).with_max_rows(10).unwrap());
    // Act
    let result: Result<Vec<Expired>, _> =
        client.rpc_bounded("idempotency_expired", &json!({"p_limit": 11}), 11, None, Repeat::Safe).await;
    // Assert
    let err = result.unwrap_err();
    assert!(matches!(err, ClientError::BoundAboveCap { bound: 11, cap: 10 }), "{err:?}");
    assert!(requests(&server).await.is_empty());
    server.verify().await;
}

#[tokio::test]
async fn a_bound_equal_to_max_rows_is_sent() {
    // §3 matrix, N = M with count=exact: `0-(M-1)/M`, 200; the cap itself is allowed.
    // Arrange
    let server = MockServer::start().await;
    mount_expired(&server, counted(200, "0-2/3", expired_rows(3))).await;
    let client = client(config(&server).with_max_rows(3).unwrap());
    // Act
    let rows: Vec<Expired> = client
        .rpc_bounded("idempotency_expired", &json!({"p_limit": 3}), 3, None, Repeat::Safe)
        .await
        .expect("a read at the cap");
    // Assert
    assert_eq!(rows.len(), 3);
    server.verify().await;
}
