//! The client, repository and service against PostgREST's exact answers,
//! replayed with wiremock. The `§` marks name the subject in PostgREST's own
//! documentation (https://docs.postgrest.org: §1 functions as RPC, §2 their
//! response shapes, §3 pagination, `db-max-rows` and `Content-Range`, §4
//! errors, §5 transactions, §6 authentication, §7 reading bounded batches
//! through a function: §7.2 truncation is silent but for `Content-Range`,
//! §7.3 a batch loop must not stop on a short page) that pins the answer.
//!
//! The submodules hold the tests, by subject; this one what they share.
//! Runs under default features.

mod claims;
mod deadlines;
mod errors;
mod keys;
mod ranges;
mod retries;

use std::time::Duration;

use chrono::{DateTime, Utc};
use idempotency_plane::postgrest::{ClientConfig, ClientError, PostgrestClient, Repeat};
use idempotency_plane::{IdempotencyService, PostgrestRepository, RequestHash};
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, ResponseTemplate};

use crate::support::transport::{fast_retry, KEY};

pub const EXPIRED: &str = "/rpc/idempotency_expired";
pub const SCOPE: &str = "tool.email.send";

/// What `fast_retry` is given here: no retry starts after 30 s.
pub const RETRY_WITHIN: Duration = Duration::from_secs(30);

/// The columns a sweeper reads with `?select=id,retain_until`.
#[derive(Debug, Deserialize)]
pub struct Expired {
    pub id: Uuid,
    #[allow(dead_code)]
    retain_until: DateTime<Utc>,
}

pub fn config(server: &MockServer) -> ClientConfig {
    ClientConfig::new(&server.uri(), KEY).expect("a valid config").with_retry(fast_retry(RETRY_WITHIN))
}

pub fn client(config: ClientConfig) -> PostgrestClient {
    PostgrestClient::new(config).expect("a client")
}

pub fn repository(server: &MockServer) -> PostgrestRepository {
    PostgrestRepository::new(client(config(server)))
}

pub fn service(server: &MockServer) -> IdempotencyService<PostgrestRepository> {
    IdempotencyService::new(repository(server))
}

/// The hash of the one request the wire tests claim for.
pub fn email_hash() -> RequestHash {
    RequestHash::of_json(&json!({"to": "a@example.com"}))
}

/// `n` rows of `idempotency_expired` trimmed to `id,retain_until`.
pub fn expired_rows(n: usize) -> Value {
    Value::Array((0..n).map(|_| json!({"id": Uuid::new_v4(), "retain_until": "2026-01-01T00:00:00Z"})).collect())
}

/// PostgREST's error body (§4): `{code, message, details, hint}`.
pub fn error_body(code: &str, message: &str) -> Value {
    json!({"code": code, "message": message, "details": null, "hint": null})
}

/// A counted answer of `idempotency_expired` (§3).
pub fn counted(status: u16, content_range: &str, body: Value) -> ResponseTemplate {
    ResponseTemplate::new(status).insert_header("content-range", content_range).set_body_json(body)
}

pub async fn mount_expired(server: &MockServer, response: ResponseTemplate) {
    Mock::given(method("POST")).and(path(EXPIRED)).respond_with(response).expect(1).mount(server).await;
}

pub async fn read_expired(server: &MockServer, bound: u64) -> Result<Vec<Expired>, ClientError> {
    client(config(server))
        .rpc_bounded("idempotency_expired", &json!({"p_limit": bound}), bound, Some("id,retain_until"), Repeat::Safe)
        .await
}

pub async fn requests(server: &MockServer) -> Vec<Request> {
    server.received_requests().await.expect("request recording is on")
}

pub fn header_of<'a>(request: &'a Request, name: &str) -> Option<&'a str> {
    request.headers.get(name).map(|v| v.to_str().expect("an ASCII header"))
}
