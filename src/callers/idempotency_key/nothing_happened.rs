//! The one way a handler tells the layer that its answer made no effect,
//! so its claim may be released and the client's retry may run it again.

use std::convert::Infallible;

use axum::response::{IntoResponseParts, ResponseParts};

/// Marks a handler's answer as made before any effect: a refusal of its
/// own (a downstream that was unavailable before anything was written, a
/// rate limit of its own), so its claim is released and a retry with the
/// same key runs the handler again.
///
/// Without it, whatever a handler that started answers is kept for its key
/// and replayed, a 500 included, as Stripe's API does: once a handler ran,
/// only it knows whether something took effect, and a retry that ran it
/// again could make the effect twice. A success (2xx) is kept even when
/// marked, because a success was given on the strength of the claim.
///
/// Return it beside the answer:
///
/// ```
/// use axum::http::StatusCode;
/// use axum::response::IntoResponse;
/// use idempotency_plane::callers::idempotency_key::NothingHappened;
///
/// async fn create_order() -> axum::response::Response {
///     // The payment provider refused before charging: nothing happened.
///     (StatusCode::SERVICE_UNAVAILABLE, NothingHappened, "payments are unavailable; retry").into_response()
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NothingHappened;

impl IntoResponseParts for NothingHappened {
    type Error = Infallible;

    fn into_response_parts(self, mut parts: ResponseParts) -> Result<ResponseParts, Self::Error> {
        parts.extensions_mut().insert(self);
        Ok(parts)
    }
}
