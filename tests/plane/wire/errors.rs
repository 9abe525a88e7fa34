//! Error answers against PostgREST's exact bodies (wiremock, §4 and §6):
//! PostgREST's error bodies become typed `Api` errors with their status,
//! code, details and hint; what is not PostgREST's (a gateway's HTML or
//! JSON) is an `Http` error; success bodies that do not decode, or exceed the
//! response limit, are refused.

use idempotency_plane::postgrest::{ClientConfig, ClientError, Repeat, RetryConfig};
use idempotency_plane::repo::IdempotencyRepository;
use idempotency_plane::Error;
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{body_partial_json, header, method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::transport::KEY;
use crate::support::LEASE;
use crate::wire::{client, config, email_hash, error_body, repository, service, SCOPE};

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
    let result = service.claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &email_hash(), LEASE).await;
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
    let result = service(&server).claim(Uuid::new_v4(), SCOPE, "run-1:step-1", &email_hash(), LEASE).await;
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
// Bodies that are not PostgREST's
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
        ClientConfig::new("http://localhost", KEY).unwrap().with_max_response_bytes(10),
        Err(ClientError::Config(_))
    ));
}
