//! Every answer the layer gives itself: RFC 9457 problem details
//! (`application/problem+json`, with `type`, `title`, `status`, `detail`),
//! of the types in one catalogue, [`ProblemType`].

use axum::body::Body;
use axum::http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

/// Where the problem types are listed: the README's "Idempotency-Key problems"
/// section, which links to what each means.
const TYPE_BASE: &str = "https://github.com/idempotency-plane/idempotency-plane#idempotency-key-problems";

/// The catalogue: every problem type the layer answers, each with its
/// slug (the `type` URI's fragment), status and title.
///
/// | slug | status | when |
/// |---|---|---|
/// | `missing-key` | 400 | no `Idempotency-Key` where one is required |
/// | `malformed-key` | 400 | an empty, repeated, non-ASCII or over-long key |
/// | `no-tenant` | 401 | the tenant function named no tenant |
/// | `no-principal` | 401 | the principal function named no caller |
/// | `body-too-large` | 413 | a request body above the limit |
/// | `body-unreadable` | 400 | the request body broke off |
/// | `key-reused` | 422 | the key was used for another request |
/// | `in-flight` | 409 | a request with the key has not finished (`Retry-After`) |
/// | `handler-failed` | 500 | the handler panicked after it started (kept for its key and replayed), or a request the layer passed through failed |
/// | `handler-timeout` | 504 | the handler overran its timeout (kept for its key and replayed) |
/// | `answer-incomplete` | 502 | the handler's answer outgrew the buffer or the timeout, and could not be journaled either |
/// | `answer-not-kept` | 500 | an answer above the journal's limit, refused for all (`OversizeResponse::Refuse`) |
/// | `unreadable-answer` | 500 | the journaled answer is not one this layer wrote |
/// | `not-configured` | 500 | no policy for the scope, no matched route, or no caller scoping chosen |
/// | `unavailable` | 503 | the plane could not answer the claim (`Retry-After`) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemType {
    /// `missing-key`, 400.
    MissingKey,
    /// `malformed-key`, 400.
    MalformedKey,
    /// `no-tenant`, 401.
    NoTenant,
    /// `no-principal`, 401.
    NoPrincipal,
    /// `body-too-large`, 413.
    BodyTooLarge,
    /// `body-unreadable`, 400.
    BodyUnreadable,
    /// `key-reused`, 422.
    KeyReused,
    /// `in-flight`, 409.
    InFlight,
    /// `handler-failed`, 500.
    HandlerFailed,
    /// `handler-timeout`, 504.
    HandlerTimeout,
    /// `answer-incomplete`, 502.
    AnswerIncomplete,
    /// `answer-not-kept`, 500.
    AnswerNotKept,
    /// `unreadable-answer`, 500.
    UnreadableAnswer,
    /// `not-configured`, 500.
    NotConfigured,
    /// `unavailable`, 503.
    Unavailable,
}

impl ProblemType {
    /// Every type, in the catalogue's order.
    pub const ALL: [ProblemType; 15] = [
        ProblemType::MissingKey,
        ProblemType::MalformedKey,
        ProblemType::NoTenant,
        ProblemType::NoPrincipal,
        ProblemType::BodyTooLarge,
        ProblemType::BodyUnreadable,
        ProblemType::KeyReused,
        ProblemType::InFlight,
        ProblemType::HandlerFailed,
        ProblemType::HandlerTimeout,
        ProblemType::AnswerIncomplete,
        ProblemType::AnswerNotKept,
        ProblemType::UnreadableAnswer,
        ProblemType::NotConfigured,
        ProblemType::Unavailable,
    ];

    /// The stable slug, the `type` URI's fragment.
    pub fn slug(self) -> &'static str {
        match self {
            ProblemType::MissingKey => "missing-key",
            ProblemType::MalformedKey => "malformed-key",
            ProblemType::NoTenant => "no-tenant",
            ProblemType::NoPrincipal => "no-principal",
            ProblemType::BodyTooLarge => "body-too-large",
            ProblemType::BodyUnreadable => "body-unreadable",
            ProblemType::KeyReused => "key-reused",
            ProblemType::InFlight => "in-flight",
            ProblemType::HandlerFailed => "handler-failed",
            ProblemType::HandlerTimeout => "handler-timeout",
            ProblemType::AnswerIncomplete => "answer-incomplete",
            ProblemType::AnswerNotKept => "answer-not-kept",
            ProblemType::UnreadableAnswer => "unreadable-answer",
            ProblemType::NotConfigured => "not-configured",
            ProblemType::Unavailable => "unavailable",
        }
    }

    /// The HTTP status every answer of this type has.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemType::MissingKey | ProblemType::MalformedKey | ProblemType::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            ProblemType::NoTenant | ProblemType::NoPrincipal => StatusCode::UNAUTHORIZED,
            ProblemType::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemType::InFlight => StatusCode::CONFLICT,
            ProblemType::HandlerFailed
            | ProblemType::AnswerNotKept
            | ProblemType::UnreadableAnswer
            | ProblemType::NotConfigured => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemType::HandlerTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProblemType::AnswerIncomplete => StatusCode::BAD_GATEWAY,
            ProblemType::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A short, stable summary of the type.
    pub fn title(self) -> &'static str {
        match self {
            ProblemType::MissingKey => "Idempotency-Key is required",
            ProblemType::MalformedKey => "Idempotency-Key is malformed",
            ProblemType::NoTenant => "No tenant for this request",
            ProblemType::NoPrincipal => "No caller for this request",
            ProblemType::BodyTooLarge => "The request body is too large",
            ProblemType::BodyUnreadable => "The request body could not be read",
            ProblemType::KeyReused => "Idempotency-Key reused for a different request",
            ProblemType::InFlight => "A request with this key is in flight",
            ProblemType::HandlerFailed => "The request failed",
            ProblemType::HandlerTimeout => "The request took too long",
            ProblemType::AnswerIncomplete => "The answer could not be read whole",
            ProblemType::AnswerNotKept => "The answer is too large to keep",
            ProblemType::UnreadableAnswer => "The first answer cannot be replayed",
            ProblemType::NotConfigured => "Idempotency is not configured for this route",
            ProblemType::Unavailable => "Idempotency is unavailable",
        }
    }
}

/// A problem the layer answers instead of the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable slug, the `type` URI's fragment: one of [`ProblemType`]'s
    /// (`missing-key`, `key-reused`, …).
    pub slug: &'static str,
    /// A short, stable summary of the problem type.
    pub title: &'static str,
    /// What happened to this request.
    pub detail: String,
    /// Seconds after which a retry may succeed (`Retry-After`).
    pub retry_after: Option<u64>,
}

impl Problem {
    pub(crate) fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Problem {
            status: kind.status(),
            slug: kind.slug(),
            title: kind.title(),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// `handler-failed` for a request the layer did not get to protect (it
    /// passed through, or the layer's own task failed): no key advice, as
    /// the request may have carried none.
    pub(crate) fn handler_failed() -> Self {
        Problem::new(ProblemType::HandlerFailed, "the request failed; whether it took effect is unknown")
    }

    /// A keyed handler that started and then panicked (`handler-failed`) or
    /// overran its timeout (`handler-timeout`): it may have taken effect, so
    /// this problem is kept for the key and every retry with it gets it again.
    pub(crate) fn started_and_failed(kind: ProblemType) -> Self {
        let what = match kind {
            ProblemType::HandlerTimeout => "was cut off at its timeout",
            _ => "failed",
        };
        Problem::new(
            kind,
            format!(
                "the request {what} after it started, and may have taken effect; this Idempotency-Key now \
                 answers this to every retry: check what took effect before sending the request again \
                 with a new key"
            ),
        )
    }

    /// `not-configured`: the server cannot protect this route, for the
    /// reason `detail` gives.
    pub(crate) fn not_configured(detail: &str) -> Self {
        Problem::new(ProblemType::NotConfigured, detail)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The part of a doc comment between `start` and the next blank doc line.
    fn section<'a>(text: &'a str, start: &str) -> &'a str {
        let from = text.find(start).unwrap_or_else(|| panic!("no {start:?}"));
        let rest = &text[from..];
        rest.find("\n//!\n").or_else(|| rest.find("\n///\n")).map_or(rest, |end| &rest[..end])
    }

    #[test]
    fn the_catalogue_names_every_type_once_with_its_status() {
        let mut slugs: Vec<&str> = ProblemType::ALL.iter().map(|kind| kind.slug()).collect();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), ProblemType::ALL.len(), "slugs are unique");
        let catalogue = section(include_str!("problem.rs"), "/// | slug | status | when |");
        for kind in ProblemType::ALL {
            let row = format!("/// | `{}` | {} |", kind.slug(), kind.status().as_u16());
            assert!(catalogue.contains(&row), "the catalogue's table lacks {row:?}");
            assert!(kind.status().is_client_error() || kind.status().is_server_error());
        }
        // And names no slug that is not one: a header, a rule, a row each.
        let rows = catalogue.lines().take_while(|line| line.starts_with("/// |")).count();
        assert_eq!(rows, ProblemType::ALL.len() + 2, "{catalogue}");
    }

    #[test]
    fn a_problem_is_rfc_9457_json_with_its_types_status_and_title() {
        let problem = Problem::new(ProblemType::InFlight, "later").retry_after(1);
        let response = problem.clone().into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let body: serde_json::Value = serde_json::from_str(&problem.body()).unwrap();
        assert_eq!(body["type"], format!("{TYPE_BASE}-in-flight"));
        assert_eq!((body["status"].as_u64(), body["title"].as_str()), (Some(409), Some(ProblemType::InFlight.title())));
    }
}
