//! An echo API behind the `Idempotency-Key` layer, on a deployed plane (the
//! one `IDEM_POSTGREST_URL` and `IDEM_SERVICE_KEY` name, as `idem up
//! --env-file` writes them), where the orders example runs its own.
//!
//! - `POST /answers` with `Idempotency-Key`, `x-organization-id` (the
//!   tenant's UUID) and `x-user-id` (the caller whose keys these are), and a
//!   JSON body `{"status": 201, "headers": [["location", "/x"]],
//!   "body_base64": "…"}`: answers that status, those headers and those
//!   bytes, with one more `x-answer` header, a fresh UUID each time the
//!   handler runs. The layer keeps `Content-Type`, `Location` and `x-answer`
//!   with the journaled answer, so a replay tells itself from a second run.
//!
//! The TypeScript middleware set up alike (`withIdempotencyKey` with
//! `route: "/answers"` and `keepHeaders: ["x-answer"]`) meets the same
//! claims: `supabase/functions/tests/cross_client_test.ts` checks that
//! either replays an answer the other journaled, byte for byte.
//!
//! ```sh
//! idem up --env-file plane.env &
//! set -a; . ./plane.env; set +a
//! PORT=0 cargo run --example echo_api --features axum
//! ```
//!
//! The first line on stdout is `listening on http://HOST:PORT`.

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use base64::Engine;
use idempotency_plane::callers::idempotency_key::IdempotencyKeyLayer;
use idempotency_plane::{ClientConfig, IdempotencyService, PostgrestClient, PostgrestRepository};
use uuid::Uuid;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The answer a request asks for.
#[derive(serde::Deserialize)]
struct Asked {
    status: u16,
    #[serde(default)]
    headers: Vec<(String, String)>,
    #[serde(default)]
    body_base64: String,
}

async fn answer(body: Bytes) -> Response {
    let asked: Asked = match serde_json::from_slice(&body) {
        Ok(asked) => asked,
        Err(error) => return (StatusCode::BAD_REQUEST, format!("not an answer to echo: {error}")).into_response(),
    };
    let built = (|| -> Result<Response, BoxError> {
        let bytes = base64::engine::general_purpose::STANDARD.decode(&asked.body_base64)?;
        let mut response = Response::new(axum::body::Body::from(bytes));
        *response.status_mut() = StatusCode::from_u16(asked.status)?;
        let headers: &mut HeaderMap = response.headers_mut();
        for (name, value) in &asked.headers {
            headers.append(HeaderName::try_from(name.as_str())?, HeaderValue::try_from(value.as_str())?);
        }
        headers.append("x-answer", HeaderValue::try_from(Uuid::new_v4().to_string())?);
        Ok(response)
    })();
    built.unwrap_or_else(|error| (StatusCode::BAD_REQUEST, format!("not an answer to echo: {error}")).into_response())
}

fn header<T: std::str::FromStr>(parts: &axum::http::request::Parts, name: &str) -> Option<T> {
    parts.headers.get(name)?.to_str().ok()?.parse().ok()
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let config = ClientConfig::from_env()?.ok_or("set IDEM_POSTGREST_URL and IDEM_SERVICE_KEY (idem up --env-file)")?;
    let service = IdempotencyService::new(PostgrestRepository::new(PostgrestClient::new(config)?));
    let layer = IdempotencyKeyLayer::new(service, |parts| header::<Uuid>(parts, "x-organization-id"))
        .principal(|parts| header::<String>(parts, "x-user-id"))
        .keep_header(HeaderName::from_static("x-answer"))?;
    let app = Router::new().route("/answers", post(answer)).route_layer(layer);
    let port: u16 = std::env::var("PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(8083);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
