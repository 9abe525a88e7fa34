//! Errors of the PostgREST client: what PostgREST said, or why we could not
//! find out.

use std::time::Duration;

use serde::Deserialize;

use super::codes;
use super::key::KeyError;
use super::range::ContentRangeError;

/// The error body PostgREST sends: `{code, message, details, hint}`.
///
/// `code` is a SQLSTATE for database errors (`23505`, `P0001`), a
/// `PGRSTnnn` code for PostgREST's own, see [`codes`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PostgrestError {
    /// SQLSTATE or `PGRSTnnn`.
    pub code: String,
    /// Human-readable message.
    pub message: String,
    /// Not always a string (PGRST201 sends an array), so kept as JSON.
    #[serde(default)]
    pub details: Option<serde_json::Value>,
    /// A hint, when the server has one.
    #[serde(default)]
    pub hint: Option<String>,
}

/// What went wrong with a transport-level failure, and so whether a retry can
/// repeat an effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// The connection was never made: the request never left. Always safe to retry.
    Connect,
    /// No answer in time: the request may have run. Retried only when the call
    /// is safe to repeat.
    Timeout,
    /// The connection failed after the request was sent (reset, closed).
    /// Retried only when the call is safe to repeat.
    Interrupted,
    /// Anything else (building the request, a redirect loop). Never retried.
    Other,
}

/// Everything the PostgREST client can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The configuration cannot work (bad URL, key with characters a header cannot hold).
    #[error("invalid client configuration: {0}")]
    Config(String),

    /// The service key cannot work where it would be sent (a publishable
    /// key, a key of the wrong kind for its variable, a missing key).
    #[error("invalid service key: {0}")]
    Key(#[from] KeyError),

    /// The operation's deadline ([`ClientConfig::with_deadline`]) came
    /// before an answer: a request still in flight was cut, or a retry
    /// that could not have finished in time was not started. An unknown
    /// outcome when a request was cut in flight, as with a timeout.
    ///
    /// [`ClientConfig::with_deadline`]: super::ClientConfig::with_deadline
    #[error(
        "{function}: no answer within the {deadline:?} deadline ({attempts} attempt(s) in {elapsed:?}{})",
        if *in_flight { "; the last was cut in flight, its outcome is unknown" } else { "; no retry could finish in time" }
    )]
    DeadlineExceeded {
        /// The function called.
        function: &'static str,
        /// The configured deadline.
        deadline: Duration,
        /// How long the call took.
        elapsed: Duration,
        /// Requests sent, the cut one included.
        attempts: u32,
        /// True when a request was cut in flight: it may have run.
        in_flight: bool,
        /// The failure of the last attempt that completed, if any.
        #[source]
        last_error: Option<Box<ClientError>>,
    },

    /// PostgREST answered with its error body.
    #[error("{function}: PostgREST answered {status} {}: {}", error.code, error.message)]
    Api {
        /// The function called.
        function: &'static str,
        /// The HTTP status.
        status: u16,
        /// The body, as PostgREST sent it (boxed: it is the large, rare case).
        error: Box<PostgrestError>,
        /// `Retry-After` in seconds, when sent (PostgREST sends `0` on every 503).
        retry_after: Option<Duration>,
    },

    /// A non-success status whose body is not PostgREST's error shape, e.g. a
    /// gateway's HTML page.
    #[error("{function}: the server answered {status} with a body that is not a PostgREST error: {body_excerpt:?}")]
    Http {
        /// The function called.
        function: &'static str,
        /// The HTTP status.
        status: u16,
        /// The first bytes of the body, for the log.
        body_excerpt: String,
        /// `Retry-After` in seconds, when sent.
        retry_after: Option<Duration>,
    },

    /// The request did not complete at the transport level.
    #[error("{function}: transport failure ({kind:?})")]
    Transport {
        /// The function called.
        function: &'static str,
        /// What failed, which decides retries.
        kind: TransportKind,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },

    /// A success answer whose body is not what the function returns.
    #[error("{function}: could not decode the answer: {reason}")]
    Decode {
        /// The function called.
        function: &'static str,
        /// What did not match.
        reason: String,
    },

    /// The call waited longer than the plane's `lock_timeout` (5 s) for a
    /// row another transaction holds, and was rolled back: nothing was
    /// written. Transient, but not retried by the client, which would only
    /// queue up behind the same lock: the caller retries later (see
    /// [`is_transient`](Self::is_transient)).
    #[error("{function}: gave up waiting for a row lock another transaction holds ({}): {}", codes::LOCK_NOT_AVAILABLE, error.message)]
    LockTimeout {
        /// The function called.
        function: &'static str,
        /// The body, as PostgREST sent it.
        error: Box<PostgrestError>,
    },

    /// The response body was longer than the configured
    /// `max_response_bytes`; it was not read to the end.
    #[error("{function}: the response is longer than the {limit}-byte limit")]
    ResponseTooLarge {
        /// The function called.
        function: &'static str,
        /// The limit, in bytes.
        limit: usize,
    },

    /// A bounded read whose `Content-Range` is missing or malformed.
    #[error("{function}: unusable Content-Range")]
    ContentRange {
        /// The function called.
        function: &'static str,
        /// The parse failure, with the raw value.
        #[source]
        source: ContentRangeError,
    },

    /// The server cut a bounded read short: its real row cap is lower than
    /// the one this client was configured with. Never a silent short page.
    #[error(
        "{function}: the server truncated the read to {received} of {total} rows; \
         its row cap (db-max-rows) is lower than the configured max_rows"
    )]
    Truncated {
        /// The function called.
        function: &'static str,
        /// Rows that arrived.
        received: u64,
        /// Rows the server counted.
        total: u64,
    },

    /// A bounded read asked for more rows than the server's cap, refused
    /// before any request was sent. PostgREST would clamp it silently.
    #[error(
        "bound {bound} is above the server's row cap {cap} (PostgREST db-max-rows, \
         PGRST_DB_MAX_ROWS, Supabase api.max_rows); refused rather than clamped"
    )]
    BoundAboveCap {
        /// The bound asked for.
        bound: u64,
        /// The configured cap.
        cap: u64,
    },
}

impl ClientError {
    /// A stable snake_case name of the variant, for metrics labels and
    /// structured logs: a small fixed set, whatever the message says.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Config(_) => "config",
            ClientError::Api { .. } => "api",
            ClientError::Http { .. } => "http",
            ClientError::Transport { kind: TransportKind::Timeout, .. } => "timeout",
            ClientError::Transport { kind: TransportKind::Connect, .. } => "connect",
            ClientError::Transport { .. } => "transport",
            ClientError::Decode { .. } => "decode",
            ClientError::LockTimeout { .. } => "lock_timeout",
            ClientError::ResponseTooLarge { .. } => "response_too_large",
            ClientError::ContentRange { .. } => "content_range",
            ClientError::Truncated { .. } => "truncated",
            ClientError::BoundAboveCap { .. } => "bound_above_cap",
            ClientError::Key(_) => "key",
            ClientError::DeadlineExceeded { .. } => "deadline_exceeded",
        }
    }

    /// The PostgREST or SQLSTATE code, when the server sent one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { error, .. } | ClientError::LockTimeout { error, .. } => Some(&error.code),
            _ => None,
        }
    }

    /// The HTTP status, when the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } | ClientError::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The server's `Retry-After`, when it sent one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ClientError::Api { retry_after, .. } | ClientError::Http { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// One line saying why a key was refused, for a 401 (or a 403 for the
    /// key's role) from Supabase's API gateway or from PostgREST; `None`
    /// for any other failure. For an operator's tool such as `idem doctor`.
    ///
    /// Supabase's gateway answers with its own body, `{"message", "hint"}`
    /// and no `code` ([`ClientError::Http`]): "No API key found in request"
    /// (no `apikey` header), "Invalid API key" (a key this project does not
    /// know), "Legacy API keys are disabled", "Forbidden use of secret API
    /// key in browser". PostgREST answers with its own
    /// ([`ClientError::Api`]): `42501` when the key's role may not execute
    /// the function, `PGRST301` for a token that is not a valid JWT (an
    /// `sb_` key no gateway exchanged), `PGRST303` for expired claims.
    pub fn auth_hint(&self) -> Option<&'static str> {
        match self {
            ClientError::Http { status: 401, body_excerpt, .. } => {
                let body = body_excerpt.to_ascii_lowercase();
                if body.contains("no api key found") {
                    Some(
                        "no apikey sent: Supabase's gateway needs one; use SUPABASE_URL, or IDEM_POSTGREST_URL \
                         at https://<ref>.supabase.co/rest/v1, or set IDEM_APIKEY",
                    )
                } else if body.contains("legacy api keys are disabled") {
                    Some(
                        "the project has disabled its legacy JWT keys (anon, service_role): \
                         use a secret key, SUPABASE_SECRET_KEY=sb_secret_…",
                    )
                } else if body.contains("secret api key in browser") {
                    Some("Supabase's gateway took the request for a browser's and refused the secret key in it")
                } else if body.contains("invalid api key") {
                    Some(
                        "Supabase's gateway does not know this apikey: another project's key, \
                         a deleted secret key, a disabled legacy key, or a mistyped one",
                    )
                } else {
                    None
                }
            }
            ClientError::Api { status: 401 | 403, error, .. } => match error.code.as_str() {
                codes::INSUFFICIENT_PRIVILEGE => Some(
                    "the key's role may not execute the plane's functions: a publishable or anon key \
                     (or a user's token) where a secret key (sb_secret_…) or the service_role key is needed",
                ),
                codes::PGRST301 if error.message.to_ascii_lowercase().contains("parts") => Some(
                    "PostgREST got a key that is not a JWT (an sb_ key no gateway exchanged): send it through \
                     Supabase's gateway, with its apikey, or give plain PostgREST a JWT",
                ),
                codes::PGRST301 => Some("PostgREST refused the JWT: signed with another secret, or malformed"),
                codes::PGRST303 => Some("PostgREST refused the JWT's claims: expired, or for another audience"),
                _ => None,
            },
            _ => None,
        }
    }
}

#[cfg(test)]
impl PostgrestError {
    /// A body of `code` alone, as a test's server sends it.
    pub(crate) fn of_code(code: &str) -> Box<Self> {
        Box::new(PostgrestError { code: code.into(), message: String::new(), details: None, hint: None })
    }
}

#[cfg(test)]
impl ClientError {
    /// `function`'s answer `status` with PostgREST's error body of `code` alone.
    pub(crate) fn answered(function: &'static str, status: u16, code: &str) -> Self {
        ClientError::Api { function, status, error: PostgrestError::of_code(code), retry_after: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(status: u16, code: &str) -> ClientError {
        ClientError::answered("f", status, code)
    }

    fn gateway(body: serde_json::Value) -> ClientError {
        ClientError::Http { function: "f", status: 401, body_excerpt: body.to_string(), retry_after: None }
    }

    #[test]
    fn a_401_from_supabases_gateway_or_postgrest_is_explained_in_one_line() {
        let hint = |error: ClientError| error.auth_hint().unwrap_or("");
        let missing = gateway(serde_json::json!({
            "message": "No API key found in request",
            "hint": "No `apikey` request header or url param was found."
        }));
        assert!(hint(missing).starts_with("no apikey sent"));
        let invalid = gateway(serde_json::json!({
            "message": "Invalid API key",
            "hint": "Double check your Supabase `anon` or `service_role` API key."
        }));
        assert!(hint(invalid).contains("does not know this apikey"));
        let legacy = gateway(serde_json::json!({"message": "Legacy API keys are disabled"}));
        assert!(hint(legacy).contains("SUPABASE_SECRET_KEY"));
        let browser = gateway(serde_json::json!({"message": "Forbidden use of secret API key in browser"}));
        assert!(hint(browser).contains("browser"));
        assert!(hint(api(401, codes::INSUFFICIENT_PRIVILEGE)).contains("publishable or anon key"));
        assert!(hint(api(403, codes::INSUFFICIENT_PRIVILEGE)).contains("secret key"));
        let not_a_jwt = ClientError::Api {
            function: "f",
            status: 401,
            error: Box::new(PostgrestError {
                code: codes::PGRST301.into(),
                message: "Expected 3 parts in JWT; got 1".into(),
                details: None,
                hint: None,
            }),
            retry_after: None,
        };
        assert!(hint(not_a_jwt).contains("not a JWT"));
        assert!(hint(api(401, codes::PGRST303)).contains("expired"));
        // Nothing to say about anything else.
        assert_eq!(gateway(serde_json::json!({"message": "Something else"})).auth_hint(), None);
        assert_eq!(api(503, codes::PGRST002).auth_hint(), None);
        assert_eq!(api(400, codes::INVALID_PARAMETER_VALUE).auth_hint(), None);
        let html = ClientError::Http { function: "f", status: 502, body_excerpt: "<html>".into(), retry_after: None };
        assert_eq!(html.auth_hint(), None);
    }
}
