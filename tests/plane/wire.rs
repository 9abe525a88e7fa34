//! The client, repository and service against PostgREST's exact answers,
//! replayed with wiremock. The `§` marks name the subject in PostgREST's own
//! documentation (https://docs.postgrest.org: §1 functions as RPC, §2 their
//! response shapes, §3 pagination, `db-max-rows` and `Content-Range`, §4
//! errors, §5 transactions, §6 authentication) that pins the answer.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat, RetryConfig, TransportKind};
use idempotency_plane::repo::{CompletionArgs, IdempotencyRepository};
use idempotency_plane::{
    ClaimOutcome, Completion, Ending, Error, IdempotencyService, PostgrestRepository, RequestHash,
};
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{body_partial_json, header, method, path, query_param};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

const KEY: &str = "service-key";
const EXPIRED: &str = "/rpc/idempotency_expired";
const SCOPE: &str = "tool.email.send";
const LEASE: Duration = Duration::from_secs(60);

/// The columns a sweeper reads with `?select=id,retain_until`.
#[derive(Debug, Deserialize)]
struct Expired {
    id: Uuid,
    #[allow(dead_code)]
    retain_until: DateTime<Utc>,
}

/// Retries that finish in milliseconds: 2 retries, so 3 requests at most.
fn fast_retry() -> RetryConfig {
    RetryConfig {
        max_retries: 2,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        max_elapsed: Duration::from_secs(30),
    }
}

fn config(server: &MockServer) -> ClientConfig {
    ClientConfig::new(&server.uri(), KEY).expect("a valid config").with_retry(fast_retry())
}

fn client(config: ClientConfig) -> PostgrestClient {
    PostgrestClient::new(config).expect("a client")
}

fn repository(server: &MockServer) -> PostgrestRepository {
    PostgrestRepository::new(client(config(server)))
}

fn service(server: &MockServer) -> IdempotencyService<PostgrestRepository> {
    IdempotencyService::new(repository(server))
}

fn hash() -> RequestHash {
    RequestHash::of_json(&json!({"to": "a@example.com"}))
}

/// `n` rows of `idempotency_expired` trimmed to `id,retain_until`.
fn expired_rows(n: usize) -> Value {
    Value::Array((0..n).map(|_| json!({"id": Uuid::new_v4(), "retain_until": "2026-01-01T00:00:00Z"})).collect())
}

/// One row of `agent.idempotency_keys` plus `lease_live`, as the claim
/// functions answer it.
fn record(id: Uuid, lease_token: Uuid, status: &str) -> Value {
    json!({
        "id": id,
        "organization_id": Uuid::new_v4(),
        "scope": SCOPE,
        "key": "run-1:step-1",
        "request_hash": hash().as_str(),
        "status": status,
        "lease_token": lease_token,
        "resource_type": null,
        "resource_id": null,
        "response": null,
        "claimed_at": "2026-01-01T00:00:00Z",
        "lease_expires_at": "2026-01-01T00:01:00Z",
        "retain_until": "2026-01-31T00:00:00Z",
        "lease_live": status == "processing",
    })
}

/// PostgREST's error body (§4): `{code, message, details, hint}`.
fn error_body(code: &str, message: &str) -> Value {
    json!({"code": code, "message": message, "details": null, "hint": null})
}

/// A counted answer of `idempotency_expired` (§3).
fn counted(status: u16, content_range: &str, body: Value) -> ResponseTemplate {
    ResponseTemplate::new(status).insert_header("content-range", content_range).set_body_json(body)
}

async fn mount_expired(server: &MockServer, response: ResponseTemplate) {
    Mock::given(method("POST")).and(path(EXPIRED)).respond_with(response).expect(1).mount(server).await;
}

async fn read_expired(server: &MockServer, bound: u64) -> Result<Vec<Expired>, ClientError> {
    client(config(server))
        .rpc_bounded("idempotency_expired", &json!({"p_limit": bound}), bound, Some("id,retain_until"), Repeat::Safe)
        .await
}

async fn requests(server: &MockServer) -> Vec<Request> {
    server.received_requests().await.expect("request recording is on")
}

fn header_of<'a>(request: &'a Request, name: &str) -> Option<&'a str> {
    request.headers.get(name).map(|v| v.to_str().expect("an ASCII header"))
}

/// Mounts `status` + `body` on `/rpc/idempotency_get`, expected exactly once
/// (none of these is retried), and reads through the repository.
async fn repository_get_error(status: u16, body: Value) -> Error {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(ResponseTemplate::new(status).set_body_json(body))
        .expect(1)
        .mount(&server)
        .await;
    let err =
        repository(&server).get(Uuid::new_v4(), SCOPE, "run-1:step-1").await.expect_err("an error answer is an error");
    server.verify().await;
    err
}

fn api_error(err: &Error) -> &ClientError {
    match err {
        Error::Store(inner @ ClientError::Api { .. }) => inner,
        other => panic!("expected Error::Store(ClientError::Api), got {other:?}"),
    }
}

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

// ---------------------------------------------------------------------------
// Error bodies to typed errors
// ---------------------------------------------------------------------------

#[tokio::test]
async fn an_unknown_function_signature_is_api_404_pgrst202() {
    // §1 "Unknown or missing arguments → 404 PGRST202" (body verbatim from RpcSpec).
    // Arrange / Act
    let err = repository_get_error(
        404,
        json!({"code":"PGRST202",
               "message":"Could not find the function agent.idempotency_get(p_key, p_organization_id, p_scope) in the schema cache",
               "details":"Searched for the function agent.idempotency_get with parameters p_key, p_organization_id, p_scope, but no matches were found in the schema cache.",
               "hint":null}),
    )
    .await;
    // Assert
    let api = api_error(&err);
    assert_eq!(api.status(), Some(404));
    assert_eq!(api.code(), Some("PGRST202"));
    assert!(!err.is_transient());
}

#[tokio::test]
async fn a_schema_that_is_not_exposed_is_api_406_pgrst106() {
    // §1 schema selection: a profile not in db-schemas → 406 PGRST106.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .and(header("content-profile", "unknown"))
        .respond_with(ResponseTemplate::new(406).set_body_json(json!({
            "code": "PGRST106",
            "message": "Invalid schema: unknown",
            "details": null,
            "hint": "Only the following schemas are exposed: agent"
        })))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server).with_schema("unknown"));
    // Act
    let err = client.rpc::<Vec<Value>>("idempotency_get", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert_eq!(err.status(), Some(406));
    assert_eq!(err.code(), Some("PGRST106"));
    match &err {
        ClientError::Api { error, .. } => {
            assert_eq!(error.hint.as_deref(), Some("Only the following schemas are exposed: agent"))
        }
        other => panic!("expected Api, got {other:?}"),
    }
    server.verify().await;
}

#[tokio::test]
async fn insufficient_privilege_as_the_anonymous_role_is_api_401_42501() {
    // §4 SQLSTATE table / §6: 42501 is 401 (+ WWW-Authenticate) for db-anon-role.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(
            ResponseTemplate::new(401)
                .insert_header("www-authenticate", "Bearer")
                .set_body_json(error_body("42501", "permission denied for function idempotency_get")),
        )
        .expect(1)
        .mount(&server)
        .await;
    // Act
    let err = repository(&server).get(Uuid::new_v4(), SCOPE, "run-1:step-1").await.unwrap_err();
    // Assert
    let api = api_error(&err);
    assert_eq!(api.status(), Some(401));
    assert_eq!(api.code(), Some("42501"));
    server.verify().await;
}

#[tokio::test]
async fn insufficient_privilege_as_another_role_is_api_403_42501() {
    // §4 SQLSTATE table / §6: 42501 is 403 for any role but db-anon-role.
    // Arrange / Act
    let err = repository_get_error(403, error_body("42501", "permission denied for function idempotency_get")).await;
    // Assert
    let api = api_error(&err);
    assert_eq!(api.status(), Some(403));
    assert_eq!(api.code(), Some("42501"));
    assert!(!err.is_transient());
}

#[tokio::test]
async fn a_unique_violation_is_api_409_23505() {
    // §4 SQLSTATE table: 23505 unique_violation → 409.
    // Arrange / Act
    let err = repository_get_error(
        409,
        json!({"code": "23505",
               "message": "duplicate key value violates unique constraint \"idempotency_keys_pkey\"",
               "details": "Key (organization_id, scope, key) already exists.",
               "hint": null}),
    )
    .await;
    // Assert
    let api = api_error(&err);
    assert_eq!(api.status(), Some(409));
    assert_eq!(api.code(), Some("23505"));
    match api {
        ClientError::Api { error, .. } => {
            assert_eq!(error.details, Some(json!("Key (organization_id, scope, key) already exists.")))
        }
        other => panic!("expected Api, got {other:?}"),
    }
}

#[tokio::test]
async fn a_plain_raise_exception_is_api_400_p0001() {
    // §4 SQLSTATE table: P0001 (plain RAISE EXCEPTION) → 400 (RpcSpec:608-612).
    // Arrange / Act
    let err = repository_get_error(400, error_body("P0001", "something went wrong")).await;
    // Assert
    let api = api_error(&err);
    assert_eq!(api.status(), Some(400));
    assert_eq!(api.code(), Some("P0001"));
}

#[tokio::test]
async fn an_invalid_parameter_value_is_api_400_22023() {
    // §4 SQLSTATE table: 22023 other than "role does not exist" → 400.
    // Arrange / Act
    let err = repository_get_error(400, error_body("22023", "p_key must be between 1 and 255 characters")).await;
    // Assert
    let api = api_error(&err);
    assert_eq!(api.status(), Some(400));
    assert_eq!(api.code(), Some("22023"));
    match api {
        ClientError::Api { error, .. } => {
            assert_eq!(error.message, "p_key must be between 1 and 255 characters")
        }
        other => panic!("expected Api, got {other:?}"),
    }
}

#[tokio::test]
async fn a_minimal_verbosity_error_body_still_maps_to_api() {
    // §4: with client-error-verbosity=minimal only `code` and `message` are sent.
    // Arrange / Act
    let err = repository_get_error(400, json!({"code": "22023", "message": "bad argument"})).await;
    // Assert
    let api = api_error(&err);
    assert_eq!(api.code(), Some("22023"));
    match api {
        ClientError::Api { error, .. } => {
            assert_eq!(error.details, None);
            assert_eq!(error.hint, None);
        }
        other => panic!("expected Api, got {other:?}"),
    }
}

#[tokio::test]
async fn a_claim_refused_with_insufficient_privilege_is_a_store_error_of_the_service() {
    // §4 SQLSTATE table / §6: 42501 → 403 for a non-anonymous role; not transient (§4).
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .and(body_partial_json(json!({"p_scope": SCOPE, "p_key": "run-1:step-1"})))
        .respond_with(
            ResponseTemplate::new(403)
                .set_body_json(error_body("42501", "permission denied for function idempotency_claim")),
        )
        .expect(1)
        .mount(&server)
        .await;
    let service = service(&server);
    // Act
    let result = service.claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &hash(), LEASE).await;
    // Assert
    match result {
        Err(Error::Store(ClientError::Api { status, error, .. })) => {
            assert_eq!(status, 403);
            assert_eq!(error.code, "42501");
        }
        other => panic!("expected Err(Error::Store(Api 403)), got {other:?}"),
    }
    server.verify().await;
}

#[tokio::test]
async fn a_claim_refused_as_the_anonymous_role_is_a_store_error_with_401() {
    // §6: an anon-key call that lacks EXECUTE gets 42501 as 401.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(
            ResponseTemplate::new(401)
                .insert_header("www-authenticate", "Bearer")
                .set_body_json(error_body("42501", "permission denied for function idempotency_claim")),
        )
        .expect(1)
        .mount(&server)
        .await;
    // Act
    let result = service(&server).claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &hash(), LEASE).await;
    // Assert
    match result {
        Err(Error::Store(ClientError::Api { status, error, .. })) => {
            assert_eq!(status, 401);
            assert_eq!(error.code, "42501");
        }
        other => panic!("expected Err(Error::Store(Api 401)), got {other:?}"),
    }
    server.verify().await;
}

// ---------------------------------------------------------------------------
// Retries
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
        .expect(u64::from(fast_retry().max_retries) + 1)
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
// Bodies that are not PostgREST's, and transport failures
// ---------------------------------------------------------------------------

#[tokio::test]
async fn an_html_gateway_error_is_an_http_error() {
    // §6: gateway-generated errors (5xx from the proxy) do not have the PostgREST body shape.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(
            ResponseTemplate::new(502).set_body_raw("<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html"),
        )
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server).with_retry(RetryConfig::disabled()));
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    match &err {
        ClientError::Http { status, body_excerpt, .. } => {
            assert_eq!(*status, 502);
            assert!(body_excerpt.contains("Bad Gateway"), "{body_excerpt}");
        }
        other => panic!("expected Http, got {other:?}"),
    }
    assert_eq!(err.code(), None);
    server.verify().await;
}

#[tokio::test]
async fn a_gateway_json_without_postgrest_shape_is_an_http_error() {
    // §6: Supabase's gateway answers a missing apikey with its own JSON, not `{code, message}`.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_release"))
        .respond_with(ResponseTemplate::new(401).set_body_json(json!({
            "message": "No API key found in request",
            "hint": "No `apikey` request header or url param was found."
        })))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::Http { status: 401, .. }), "{err:?}");
    server.verify().await;
}

#[tokio::test]
async fn malformed_json_in_a_200_body_is_a_decode_error() {
    // §2: a success body is JSON (`Content-Type: application/json`); anything else is undecodable.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(ResponseTemplate::new(200).set_body_raw("[{\"id\": ", "application/json"))
        .expect(1)
        .mount(&server)
        .await;
    let client = client(config(&server));
    // Act
    let err = client.rpc::<Vec<Value>>("idempotency_get", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert!(matches!(err, ClientError::Decode { function: "idempotency_get", .. }), "{err:?}");
    server.verify().await;
}

#[tokio::test]
async fn rows_of_the_wrong_shape_are_a_store_decode_error_of_the_repository() {
    // §2: `RETURNS SETOF tbl` answers an array of row objects; missing columns mean
    // a mismatched SQL surface.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([{"id": Uuid::new_v4(), "status": "processing"}])))
        .expect(1)
        .mount(&server)
        .await;
    // Act
    let err = repository(&server).get(Uuid::new_v4(), SCOPE, "run-1:step-1").await.unwrap_err();
    // Assert
    assert!(matches!(err, Error::Store(ClientError::Decode { .. })), "{err:?}");
    server.verify().await;
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_transport_error_after_retries() {
    // §4 "Transient conditions": a request that never reached the server never ran;
    // retried for any call, then reported as a connect failure.
    // Arrange
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        listener.local_addr().unwrap().port()
    };
    let config = ClientConfig::new(&format!("http://127.0.0.1:{port}"), KEY).unwrap().with_retry(fast_retry());
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
    let started = Instant::now();
    // Act
    let err = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert!(started.elapsed() < Duration::from_secs(4), "the timeout fired");
    assert!(matches!(err, ClientError::Transport { kind: TransportKind::Timeout, .. }), "{err:?}");
    assert!(!err.is_retryable(false));
    assert!(err.is_retryable(true));
}

// ---------------------------------------------------------------------------
// Absent optional arguments
// ---------------------------------------------------------------------------

#[tokio::test]
async fn the_repository_omits_absent_optional_arguments_instead_of_sending_null() {
    // §1: only supplied keys are passed, so omitted defaulted params take the SQL default;
    // postrust-server binds a JSON null as '', PostgREST as SQL NULL.
    // Arrange
    let server = MockServer::start().await;
    let (claim_id, token) = (Uuid::new_v4(), Uuid::new_v4());
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_complete"))
        .and(body_partial_json(json!({
            "p_claim_id": claim_id,
            "p_lease_token": token,
            "p_response": {"message_id": "m-1"}
        })))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([record(claim_id, token, "completed")])))
        .expect(1)
        .mount(&server)
        .await;
    let response = json!({"message_id": "m-1"});
    // Act
    let completed = repository(&server)
        .complete(claim_id, token, CompletionArgs { response: Some(&response), ..CompletionArgs::default() })
        .await
        .expect("a completion");
    // Assert
    assert_eq!(completed.map(|r| r.id), Some(claim_id));
    let sent = requests(&server).await;
    assert_eq!(sent.len(), 1);
    let body: Value = sent[0].body_json().unwrap();
    let mut keys: Vec<&str> = body.as_object().expect("a JSON object").keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["p_claim_id", "p_lease_token", "p_response"]);
    server.verify().await;
}

#[tokio::test]
async fn the_service_completes_a_resource_only_claim_without_a_response_key() {
    // §1: only supplied keys are passed; absent values are omitted, never sent as null.
    // Arrange
    let server = MockServer::start().await;
    let (claim_id, org) = (Uuid::new_v4(), Uuid::new_v4());
    // The store answers the row asked for, holding the token the service minted.
    let answer = move |request: &Request, status: &str| {
        let body: Value = request.body_json().expect("a JSON body");
        let token: Uuid = serde_json::from_value(body["p_lease_token"].clone()).expect("a token");
        let mut row = record(claim_id, token, status);
        row["organization_id"] = json!(org);
        row["outcome"] = json!("claimed"); // what the one-call claim adds
        ResponseTemplate::new(200).set_body_json(json!([row]))
    };
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(move |request: &Request| answer(request, "processing"))
        .expect(1)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_complete"))
        .and(body_partial_json(json!({
            "p_claim_id": claim_id,
            "p_resource_type": "nylas.message",
            "p_resource_id": "m-1"
        })))
        .respond_with(move |request: &Request| answer(request, "completed"))
        .expect(1)
        .mount(&server)
        .await;
    let service = service(&server);
    let ClaimOutcome::Claimed(claim) =
        service.claim(org, SCOPE, "run-1:step-1", &hash(), LEASE).await.expect("a claim")
    else {
        panic!("try_claim answered a row, so the key is ours");
    };
    // Act
    let ending = service.complete(&claim, Completion::resource("nylas.message", "m-1")).await.expect("a completion");
    // Assert
    assert_eq!(ending, Ending::Recorded);
    let complete = requests(&server)
        .await
        .into_iter()
        .find(|r| r.url.path() == "/rpc/idempotency_complete")
        .expect("complete was called");
    let body: Value = complete.body_json().unwrap();
    let object = body.as_object().expect("a JSON object");
    assert!(!object.contains_key("p_response"), "{body}");
    assert_eq!(object.len(), 4, "{body}");
    server.verify().await;
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

/// A server that reads each request and closes the connection without an
/// answer; counts the connections it accepted.
async fn hang_up_server() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            let mut buffer = [0u8; 4096];
            let _ = socket.read(&mut buffer).await;
            drop(socket);
        }
    });
    (format!("http://{address}"), accepted)
}

#[tokio::test]
async fn a_connection_dropped_after_sending_is_retried_only_when_safe_to_repeat() {
    // §4 [inference]: a connection lost mid-request can leave the commit outcome unknown.
    for (repeat, expected_connections) in [(Repeat::Unsafe, 1usize), (Repeat::Safe, 3)] {
        // Arrange
        let (url, accepted) = hang_up_server().await;
        let config =
            ClientConfig::new(&url, KEY).expect("config").with_retry(fast_retry()).with_pool_max_idle_per_host(0);
        // Act
        let err = client(config).rpc::<Value>("idempotency_get", &json!({}), repeat).await.unwrap_err();
        // Assert
        assert!(matches!(err, ClientError::Transport { kind: TransportKind::Interrupted, .. }), "{repeat:?}: {err:?}");
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), expected_connections, "{repeat:?}");
    }
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

#[tokio::test]
async fn a_row_for_another_tenant_key_or_token_is_never_acted_on() {
    // The store must answer the row asked for; anything else is a deployment
    // to distrust, never a replay or an ownership to act on.
    let server = MockServer::start().await;
    let mut stored = record(Uuid::new_v4(), Uuid::new_v4(), "completed");
    stored["response"] = json!({"secret": "of another tenant"});
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([stored])))
        .mount(&server)
        .await;
    // The claim answers "claimed" with a row of another tenant, holding
    // someone else's token.
    let mut foreign = record(Uuid::new_v4(), Uuid::new_v4(), "processing");
    foreign["outcome"] = json!("claimed");
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_claim"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!([foreign])))
        .mount(&server)
        .await;
    let service = service(&server);
    let read = service.read(Uuid::new_v4(), SCOPE, "run-1:step-1", &hash()).await;
    assert!(matches!(read, Err(Error::Inconsistent(_))), "{read:?}");
    let claimed = service.claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &hash(), LEASE).await;
    assert!(matches!(claimed, Err(Error::Inconsistent(_))), "{claimed:?}");
}

/// A claim that answers the caller's own row, under its own token, but
/// with a lease already passed: what a store that stamped the lease before
/// a lock wait would answer.
struct LapsedClaim;

impl wiremock::Respond for LapsedClaim {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let args: Value = serde_json::from_slice(&request.body).expect("JSON arguments");
        let token: Uuid = serde_json::from_value(args["p_lease_token"].clone()).expect("a lease token");
        let mut row = record(Uuid::new_v4(), token, "processing");
        for (column, argument) in [("organization_id", "p_organization_id"), ("scope", "p_scope"), ("key", "p_key")] {
            row[column] = args[argument].clone();
        }
        row["lease_live"] = json!(false);
        row["outcome"] = json!("claimed");
        ResponseTemplate::new(200).set_body_json(json!([row]))
    }
}

#[tokio::test]
async fn a_claim_answered_with_a_lease_already_passed_is_not_handed_out() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST")).and(path("/rpc/idempotency_claim")).respond_with(LapsedClaim).mount(&server).await;
    // Act
    let outcome = service(&server).claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &hash(), LEASE).await;
    // Assert: not Claimed, and transient, so the caller's retry reclaims it.
    match outcome {
        Err(error @ Error::LeaseLapsed { .. }) => assert!(error.is_transient()),
        other => panic!("expected LeaseLapsed, got {other:?}"),
    }
}

#[tokio::test]
async fn a_response_body_above_the_configured_limit_is_refused_without_reading_it_whole() {
    // Arrange: 2 MiB of rows, with and without a Content-Length.
    let server = MockServer::start().await;
    let huge = format!("[{}]", vec!["\"x\""; 700_000].join(","));
    Mock::given(method("POST"))
        .and(path("/rpc/idempotency_get"))
        .respond_with(ResponseTemplate::new(200).set_body_raw(huge.clone(), "application/json"))
        .mount(&server)
        .await;
    let client = client(config(&server).with_max_response_bytes(1024 * 1024).expect("a limit"));
    let args = json!({"p_organization_id": Uuid::new_v4(), "p_scope": SCOPE, "p_key": "k"});
    // Act
    let result = client.rpc::<Value>("idempotency_get", &args, Repeat::Safe).await;
    // Assert
    assert!(
        matches!(result, Err(ClientError::ResponseTooLarge { function: "idempotency_get", limit: 1_048_576 })),
        "{result:?}"
    );
    assert!(matches!(
        ClientConfig::new("http://x", KEY).unwrap().with_max_response_bytes(10),
        Err(ClientError::Config(_))
    ));
}
