//! Every answer the layer gives itself: RFC 9457 problem details
//! (`application/problem+json`, with `type`, `title`, `status`, `detail`).

use axum::body::Body;
use axum::http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

/// Where the problem types are described (the README's table).
const TYPE_BASE: &str = "https://github.com/idempotency-plane/idempotency-plane#idempotency-key-problems";

/// A problem the layer answers instead of the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable slug, the `type` URI's fragment: `missing-key`, `conflict`, ….
    pub slug: &'static str,
    /// A short, stable summary of the problem type.
    pub title: &'static str,
    /// What happened to this request.
    pub detail: String,
    /// Seconds after which a retry may succeed (`Retry-After`).
    pub retry_after: Option<u64>,
}

impl Problem {
    pub(crate) fn new(status: StatusCode, slug: &'static str, title: &'static str, detail: impl Into<String>) -> Self {
        Problem { status, slug, title, detail: detail.into(), retry_after: None }
    }

    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// The `type` member: an absolute URI naming the problem type.
    pub fn type_uri(&self) -> String {
        format!("{TYPE_BASE}-{}", self.slug)
    }

    /// The JSON body: `type`, `title`, `status`, `detail`.
    pub fn body(&self) -> String {
        json!({
            "type": self.type_uri(),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        })
        .to_string()
    }

    /// The response: status, `Content-Type: application/problem+json`,
    /// `Retry-After` when set, and the JSON body.
    pub fn into_response(self) -> Response<Body> {
        let mut response = Response::new(Body::from(self.body()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}
