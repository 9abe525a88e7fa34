//! What an API call failed with, and the status it is answered with: the
//! plane's refusals of bad input are the request's fault (4xx), anything
//! else the transport's or the plane's (502).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use idempotency_plane::postgrest::codes;
use idempotency_plane::ClientError;

/// What an API call failed with: answered as `{"error": …}`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// The request was malformed; nothing was done.
    #[error("{0}")]
    BadRequest(String),
    /// No re-drive route was named for the scope.
    #[error(
        "no re-drive route for scope {0}: start the console with --route {0}=URL (or a family's, e.g. webhook.*=URL)"
    )]
    NoRoute(String),
    /// The plane refused the call's input: an argument it does not take
    /// (22023, answered 400) or a scope it does not know (IDEM1, 404).
    /// Nothing was done. `message` is the plane's, which never holds a key.
    #[error("the plane refused it: {message}")]
    Refused { status: StatusCode, message: String },
    /// The plane could not be reached, or failed the call.
    #[error("the plane: {0}")]
    Plane(ClientError),
    /// The plane failed the call (as the library reports it).
    #[error("the plane: {0}")]
    Library(idempotency_plane::Error),
    /// The re-drive route refused or failed.
    #[error("the re-drive route: {0}")]
    Route(ClientError),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            // Input the library refused before any request.
            ApiError::BadRequest(_) | ApiError::Library(idempotency_plane::Error::Invalid(_)) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::NoRoute(_) => StatusCode::NOT_FOUND,
            ApiError::Refused { status, .. } => *status,
            ApiError::Plane(_) | ApiError::Library(_) | ApiError::Route(_) => StatusCode::BAD_GATEWAY,
        };
        if status == StatusCode::BAD_GATEWAY {
            tracing::warn!(error = %self, "console: a call failed");
        } else if matches!(self, ApiError::Refused { .. }) {
            tracing::info!(error = %self, status = status.as_u16(), "console: the plane refused a request");
        }
        (status, Json(json!({ "error": self.to_string() }))).into_response()
    }
}

impl From<ClientError> for ApiError {
    /// The plane's refusals of bad input are the request's fault (4xx);
    /// everything else, the transport's or the plane's (502).
    fn from(error: ClientError) -> Self {
        match refusal(&error) {
            Some((status, message)) => ApiError::Refused { status, message },
            None => ApiError::Plane(error),
        }
    }
}

impl From<idempotency_plane::Error> for ApiError {
    fn from(error: idempotency_plane::Error) -> Self {
        match error {
            idempotency_plane::Error::Store(store) => ApiError::from(store),
            idempotency_plane::Error::UnknownScope { .. } => {
                ApiError::Refused { status: StatusCode::NOT_FOUND, message: error.to_string() }
            }
            other => ApiError::Library(other),
        }
    }
}

/// The status and the plane's message (with its hint) when the plane
/// refused the input: 22023 (invalid parameter value) is 400, IDEM1
/// (unknown scope) 404.
fn refusal(error: &ClientError) -> Option<(StatusCode, String)> {
    let ClientError::Api { error: body, .. } = error else { return None };
    let status = match body.code.as_str() {
        codes::INVALID_PARAMETER_VALUE => StatusCode::BAD_REQUEST,
        codes::UNKNOWN_SCOPE => StatusCode::NOT_FOUND,
        _ => return None,
    };
    let message = match body.hint.as_deref().filter(|hint| !hint.is_empty()) {
        Some(hint) => format!("{} ({hint})", body.message),
        None => body.message.clone(),
    };
    Some((status, message))
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::BadRequest(rejection.body_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: &str, hint: Option<&str>) -> ClientError {
        ClientError::Api {
            function: "idempotency_processing",
            status: 400,
            error: Box::new(idempotency_plane::postgrest::PostgrestError {
                code: code.to_owned(),
                message: format!("refused ({code})"),
                details: None,
                hint: hint.map(str::to_owned),
            }),
            retry_after: None,
        }
    }

    #[test]
    fn the_planes_refusals_of_bad_input_are_4xx_and_its_failures_502() {
        let status = |error: ApiError| error.into_response().status();
        let bad = ApiError::from(api_error(codes::INVALID_PARAMETER_VALUE, Some("start later")));
        assert_eq!(bad.to_string(), "the plane refused it: refused (22023) (start later)");
        assert_eq!(status(bad), StatusCode::BAD_REQUEST);
        assert_eq!(status(ApiError::from(api_error(codes::UNKNOWN_SCOPE, None))), StatusCode::NOT_FOUND);
        let unknown = idempotency_plane::Error::UnknownScope { scope: "webhook.nowhere".into() };
        assert_eq!(status(ApiError::from(unknown)), StatusCode::NOT_FOUND);
        let store = idempotency_plane::Error::Store(api_error(codes::INVALID_PARAMETER_VALUE, None));
        assert_eq!(status(ApiError::from(store)), StatusCode::BAD_REQUEST);
        for code in [codes::PGRST000, codes::LOCK_NOT_AVAILABLE, codes::INSUFFICIENT_PRIVILEGE, "XX000"] {
            assert_eq!(status(ApiError::from(api_error(code, None))), StatusCode::BAD_GATEWAY, "{code}");
        }
    }
}
