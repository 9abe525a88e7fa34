//! The OTLP exporters' HTTP client: the crate's own reqwest (rustls), so
//! the export brings no second HTTP or TLS stack, run on a runtime of its
//! own (one thread): the SDK exports from threads of its own, outside any
//! runtime, and a flush must not wait on the caller's runtime (which may be
//! the very thread that asked for it).

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use opentelemetry_http::{HttpClient, HttpError, ResponseBodyTooLarge};

use super::OtelError;

/// The largest collector answer read: what the SDK's own clients read.
const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// One client for both exporters (traces and metrics), sharing the runtime.
#[derive(Debug, Clone)]
pub(super) struct ExportClient {
    client: reqwest::Client,
    runtime: Arc<ExportRuntime>,
}

/// The export's runtime; stopped without blocking when the last exporter
/// holding it is dropped, wherever that happens.
#[derive(Debug)]
struct ExportRuntime(Option<tokio::runtime::Runtime>);

impl Drop for ExportRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl ExportClient {
    /// A client whose every request is cut at `timeout`.
    pub(super) fn new(timeout: Duration) -> Result<Self, OtelError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-export")
            .enable_all()
            .build()
            .map_err(OtelError::Runtime)?;
        let client = reqwest::Client::builder().timeout(timeout).build().map_err(OtelError::Client)?;
        Ok(ExportClient { client, runtime: Arc::new(ExportRuntime(Some(runtime))) })
    }
}

#[async_trait::async_trait]
impl HttpClient for ExportClient {
    async fn send_bytes(&self, request: http::Request<Bytes>) -> Result<http::Response<Bytes>, HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let runtime = self.runtime.0.as_ref().ok_or("the OTLP export's runtime has stopped")?;
        runtime.spawn(send(self.client.clone(), request)).await?
    }
}

/// Sends `request` and reads the whole answer (at most [`MAX_RESPONSE_BYTES`]).
async fn send(client: reqwest::Client, request: reqwest::Request) -> Result<http::Response<Bytes>, HttpError> {
    let mut response = client.execute(request).await?;
    let status = response.status();
    let headers = std::mem::take(response.headers_mut());
    let mut body = BytesMut::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > MAX_RESPONSE_BYTES {
            return Err(Box::new(ResponseBodyTooLarge::new()));
        }
        body.extend_from_slice(&chunk);
    }
    let mut answer = http::Response::builder().status(status).body(body.freeze())?;
    *answer.headers_mut() = headers;
    Ok(answer)
}
