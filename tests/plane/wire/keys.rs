//! The headers each kind of key travels in (wiremock, §6 authentication):
//! a legacy JWT goes in `apikey` and `Authorization: Bearer` unchanged when
//! talking to Supabase's gateway, as supabase-js sends it; a secret key,
//! which is not a JWT, in `apikey` alone, as Supabase documents its gateway
//! wants it; plain PostgREST gets a JWT in `Authorization` alone. The configuration
//! is read with `ClientConfig::from_vars`, never from the process
//! environment, so these tests cannot race on it.

use idempotency_plane::postgrest::{ClientConfig, ClientError, Gateway, KeyError, KeyKind, PostgrestClient, Repeat};
use serde_json::json;
use wiremock::matchers::{header, method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::transport::fast_retry;
use crate::wire::{header_of, requests, RETRY_WITHIN};

/// A legacy `service_role`-shaped JWT (signed by nobody: the mock does not check).
const LEGACY_JWT: &str = "eyJhbGciOiJIUzI1NiJ9.eyJyb2xlIjoic2VydmljZV9yb2xlIn0.bGVnYWN5LXNpZ25hdHVyZQ";
const SECRET: &str = "sb_secret_wire0123456789";

/// `ClientConfig::from_vars` over exactly these variables.
fn from_vars(vars: &[(&'static str, String)]) -> Result<Option<ClientConfig>, ClientError> {
    ClientConfig::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()))
}

fn client_of(config: ClientConfig) -> PostgrestClient {
    PostgrestClient::new(config.with_retry(fast_retry(RETRY_WITHIN))).expect("a client")
}

/// Mounts `POST <rpc>` answering `true` only to a request carrying exactly
/// `authorization` and, when given, `apikey`.
async fn mount_release(server: &MockServer, rpc: &str, authorization: &str, apikey: Option<&str>) {
    let mock = Mock::given(method("POST")).and(path(rpc)).and(header("authorization", authorization));
    mount(server, mock, apikey).await;
}

/// Mounts `POST <rpc>` answering `true` only to a request carrying `apikey`
/// (whatever else it carries: the test reads the headers sent).
async fn mount_apikey_release(server: &MockServer, rpc: &str, apikey: &str) {
    mount(server, Mock::given(method("POST")).and(path(rpc)), Some(apikey)).await;
}

async fn mount(server: &MockServer, mock: wiremock::MockBuilder, apikey: Option<&str>) {
    let mock = match apikey {
        Some(apikey) => mock.and(header("apikey", apikey)),
        None => mock,
    };
    mock.respond_with(ResponseTemplate::new(200).set_body_json(json!(true))).expect(1).mount(server).await;
}

async fn release(client: &PostgrestClient) -> bool {
    client.rpc("idempotency_release", &json!({}), Repeat::Unsafe).await.expect("the headers matched")
}

#[tokio::test]
async fn a_legacy_jwt_with_supabase_url_goes_in_apikey_and_authorization() {
    // §6: Supabase's gateway wants `apikey`; PostgREST reads the JWT in `Authorization`.
    // Arrange
    let server = MockServer::start().await;
    let bearer = format!("Bearer {LEGACY_JWT}");
    mount_release(&server, "/rest/v1/rpc/idempotency_release", &bearer, Some(LEGACY_JWT)).await;
    let config = from_vars(&[("SUPABASE_URL", server.uri()), ("SUPABASE_SERVICE_ROLE_KEY", LEGACY_JWT.into())])
        .expect("valid")
        .expect("a URL is set");
    // Act
    let released = release(&client_of(config)).await;
    // Assert
    assert!(released);
    let sent = requests(&server).await;
    assert_eq!(header_of(&sent[0], "apikey"), Some(LEGACY_JWT));
    assert_eq!(header_of(&sent[0], "authorization"), Some(bearer.as_str()));
    server.verify().await;
}

#[tokio::test]
async fn a_secret_key_with_supabase_url_goes_unchanged_in_apikey_alone() {
    // An sb_ key is not a JWT: Supabase's gateway reads it from `apikey`, and
    // swaps it for a token of its role.
    // Arrange
    let server = MockServer::start().await;
    mount_apikey_release(&server, "/rest/v1/rpc/idempotency_release", SECRET).await;
    let config = from_vars(&[("SUPABASE_URL", server.uri()), ("SUPABASE_SECRET_KEY", SECRET.into())])
        .expect("valid")
        .expect("a URL is set");
    assert_eq!(config.key_kind(), KeyKind::Secret);
    // Act
    let released = release(&client_of(config)).await;
    // Assert
    assert!(released);
    let sent = requests(&server).await;
    assert_eq!(header_of(&sent[0], "apikey"), Some(SECRET));
    assert_eq!(header_of(&sent[0], "authorization"), None, "no sb_ key as a bearer token");
    server.verify().await;
}

#[tokio::test]
async fn a_key_for_a_hosted_project_url_goes_in_both_headers() {
    // IDEM_POSTGREST_URL=https://<ref>.supabase.co/rest/v1 cannot be reached from a test: the
    // host is classified as Supabase's gateway (unit-tested in the config), and that gateway's
    // headers are pinned here on a local server told it is one.
    // Arrange
    let hosted = from_vars(&[
        ("IDEM_POSTGREST_URL", "https://abcdefgh.supabase.co/rest/v1".into()),
        ("IDEM_SERVICE_KEY", LEGACY_JWT.into()),
    ])
    .expect("valid")
    .expect("a URL is set");
    assert_eq!(hosted.gateway(), Gateway::Supabase);
    assert!(hosted.sends_apikey());
    let server = MockServer::start().await;
    let bearer = format!("Bearer {LEGACY_JWT}");
    mount_release(&server, "/rest/v1/rpc/idempotency_release", &bearer, Some(LEGACY_JWT)).await;
    let config = ClientConfig::new(&format!("{}/rest/v1", server.uri()), LEGACY_JWT)
        .expect("valid")
        .with_gateway(Gateway::Supabase);
    // Act
    let released = release(&client_of(config)).await;
    // Assert
    assert!(released);
    server.verify().await;
}

#[tokio::test]
async fn a_secret_key_goes_in_apikey_alone_whatever_the_url() {
    // A custom domain in front of Supabase: only its gateway understands an sb_secret_ key.
    // Arrange
    let server = MockServer::start().await;
    mount_apikey_release(&server, "/rest/v1/rpc/idempotency_release", SECRET).await;
    let config = from_vars(&[
        ("IDEM_POSTGREST_URL", format!("{}/rest/v1", server.uri())),
        ("SUPABASE_SECRET_KEY", SECRET.into()),
    ])
    .expect("valid")
    .expect("a URL is set");
    assert_eq!(config.gateway(), Gateway::Plain);
    // Act
    let released = release(&client_of(config)).await;
    // Assert
    assert!(released);
    assert_eq!(header_of(&requests(&server).await[0], "authorization"), None);
    server.verify().await;
}

#[tokio::test]
async fn plain_postgrest_with_idem_service_key_gets_authorization_alone() {
    // §6: PostgREST itself reads only `Authorization: Bearer <JWT>`.
    // Arrange
    let server = MockServer::start().await;
    let bearer = format!("Bearer {LEGACY_JWT}");
    mount_release(&server, "/rpc/idempotency_release", &bearer, None).await;
    let config = from_vars(&[("IDEM_POSTGREST_URL", server.uri()), ("IDEM_SERVICE_KEY", LEGACY_JWT.into())])
        .expect("valid")
        .expect("a URL is set");
    // Act
    let released = release(&client_of(config)).await;
    // Assert
    assert!(released);
    let sent = requests(&server).await;
    assert_eq!(header_of(&sent[0], "apikey"), None, "no apikey for plain PostgREST");
    assert_eq!(header_of(&sent[0], "authorization"), Some(bearer.as_str()));
    server.verify().await;
}

#[tokio::test]
async fn a_publishable_key_is_refused_before_any_request() {
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).expect(0).mount(&server).await;
    // Act
    let refused =
        from_vars(&[("SUPABASE_URL", server.uri()), ("SUPABASE_SECRET_KEY", "sb_publishable_wire0123".into())])
            .unwrap_err();
    // Assert
    assert!(
        matches!(refused, ClientError::Key(KeyError::Publishable { variable: "SUPABASE_SECRET_KEY" })),
        "{refused:?}"
    );
    server.verify().await;
}

#[tokio::test]
async fn a_gateway_401_for_a_missing_apikey_says_so_in_one_line() {
    // Supabase's gateway answers `{message, hint}`, not PostgREST's `{code, message}`.
    // Arrange
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(401).set_body_json(json!({
            "message": "No API key found in request",
            "hint": "No `apikey` request header or url param was found."
        })))
        .expect(1)
        .mount(&server)
        .await;
    let client = client_of(ClientConfig::new(&server.uri(), LEGACY_JWT).expect("valid"));
    // Act
    let error = client.rpc::<bool>("idempotency_release", &json!({}), Repeat::Safe).await.unwrap_err();
    // Assert
    assert!(matches!(error, ClientError::Http { status: 401, .. }), "{error:?}");
    assert!(error.auth_hint().is_some_and(|hint| hint.starts_with("no apikey sent")), "{:?}", error.auth_hint());
    server.verify().await;
}
