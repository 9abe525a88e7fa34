//! Errors of the PostgREST client: what PostgREST said, or why we could not
//! find out.

use std::time::Duration;

use serde::Deserialize;

use super::config::KeyKind;
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

/// Error codes this crate reacts to, named so callers need no string literals.
pub mod codes {
    /// 503: PostgREST cannot connect to the database. The request never ran.
    pub const PGRST000: &str = "PGRST000";
    /// 503: database client error, e.g. the connection dropped mid-request.
    pub const PGRST001: &str = "PGRST001";
    /// 503: the schema cache is not loaded yet. The request never ran.
    pub const PGRST002: &str = "PGRST002";
    /// 504: timed out waiting for a pool connection. The request never ran.
    pub const PGRST003: &str = "PGRST003";
    /// 406: the requested schema is not exposed (`db-schemas`).
    pub const PGRST106: &str = "PGRST106";
    /// 404: no function with these argument names.
    pub const PGRST202: &str = "PGRST202";
    /// 300: ambiguous overload.
    pub const PGRST203: &str = "PGRST203";
    /// 401: JWT malformed or badly signed.
    pub const PGRST301: &str = "PGRST301";
    /// 401: JWT claims invalid, e.g. expired.
    pub const PGRST303: &str = "PGRST303";
    /// SQLSTATE insufficient_privilege: 401 as the anonymous role, 403 otherwise.
    pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
    /// SQLSTATE unique_violation (409).
    pub const UNIQUE_VIOLATION: &str = "23505";
    /// SQLSTATE check_violation (400).
    pub const CHECK_VIOLATION: &str = "23514";
    /// SQLSTATE invalid_parameter_value (400): what the plane's functions raise
    /// for bad arguments.
    pub const INVALID_PARAMETER_VALUE: &str = "22023";
    /// SQLSTATE raise_exception (400), a plain `RAISE EXCEPTION`.
    pub const RAISE_EXCEPTION: &str = "P0001";
    /// SQLSTATE serialization_failure (500): rolled back, safe to retry.
    pub const SERIALIZATION_FAILURE: &str = "40001";
    /// SQLSTATE deadlock_detected (500): rolled back, safe to retry.
    pub const DEADLOCK_DETECTED: &str = "40P01";
    /// The plane's own (400): the scope has no row in
    /// `agent.idempotency_scopes`, so it has no retention. Nothing written.
    pub const UNKNOWN_SCOPE: &str = "IDEM1";
    /// The plane's own (400): the response is above its scope's
    /// `max_response_bytes`. Nothing written; the claim stays processing.
    pub const RESPONSE_TOO_LARGE: &str = "IDEM2";
    /// The plane's own (400): the response nests arrays and objects deeper
    /// than 64 levels, more than every client reads back. Nothing written;
    /// the claim stays processing.
    pub const RESPONSE_TOO_DEEP: &str = "IDEM3";
    /// The plane's own (400): a fenced Run admission whose claim is not
    /// held by its lease token (completed, released, another
    /// organization's, or its lease passed). No Run admitted.
    pub const FENCE_LOST: &str = "IDEM4";
    /// SQLSTATE lock_not_available (500): the call waited longer than the
    /// plane's `lock_timeout` for a row another transaction holds; rolled
    /// back, nothing written.
    pub const LOCK_NOT_AVAILABLE: &str = "55P03";
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

/// Why a service key was refused before any request. Never carries the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// A URL is set but none of the service key variables is.
    #[error("a PostgREST URL is set but no service key: set one of {variables}")]
    Missing {
        /// The variables looked at, in order of precedence.
        variables: String,
    },
    /// A publishable key where a service key is needed: it reaches only
    /// the `anon` role, which may not execute the plane's functions.
    #[error(
        "{variable} holds a publishable key (sb_publishable_…), which reaches only the anon role; \
         the plane needs a secret key (sb_secret_…, in SUPABASE_SECRET_KEY) or the legacy service_role key"
    )]
    Publishable {
        /// Where the key came from: a variable's name, or `the service key`.
        variable: &'static str,
    },
    /// A variable holding a key of another kind than its name promises.
    #[error("{variable} should hold a {}, but holds a {}", expected.describe(), found.describe())]
    WrongKind {
        /// The variable.
        variable: &'static str,
        /// The kind it should hold.
        expected: KeyKind,
        /// The kind it holds.
        found: KeyKind,
    },
    /// An `sb_` service key with a different `apikey`: Supabase's gateway
    /// accepts an `sb_` key in `Authorization` only when it equals the
    /// `apikey`, so every request would be refused.
    #[error(
        "the apikey (IDEM_APIKEY) differs from the sb_ service key sent as Authorization: Bearer; \
         Supabase's gateway refuses that: leave IDEM_APIKEY unset, or set it to the same key"
    )]
    ApikeyDiffers,
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

    /// Whether running the same call again later may succeed: what
    /// [`is_retryable`](Self::is_retryable) allows for a call that is safe to
    /// repeat, and a lock timeout (the lock will be released).
    pub fn is_transient(&self) -> bool {
        matches!(self, ClientError::LockTimeout { .. }) || self.is_retryable(true)
    }

    /// Whether the client itself retries, given whether the call is safe to repeat
    /// after a lost response. The single place this crate decides it:
    ///
    /// | failure | any call | repeat-safe call |
    /// |---|---|---|
    /// | connection refused / not made | yes | yes |
    /// | 503 `PGRST000`/`PGRST002`, 504 `PGRST003` (never ran) | yes | yes |
    /// | other 503 (`PGRST001`, `08*`, `53*`, `57P01`) | no | yes |
    /// | 500 `40001` / `40P01` (rolled back) | yes | yes |
    /// | timeout, connection reset after sending | no | yes |
    /// | 500 `55P03`, a lock timeout ([`ClientError::LockTimeout`]) | no | no |
    /// | 503/504 without a PostgREST body (a gateway) | no | yes |
    /// | the deadline cut a request in flight ([`ClientError::DeadlineExceeded`]) | no | yes |
    /// | the deadline left no time for a retry | as its last failure | as its last failure |
    /// | anything else | no | no |
    ///
    /// (The client never retries past a deadline; the rows for it say what
    /// a caller with more time may do.)
    pub fn is_retryable(&self, repeat_safe: bool) -> bool {
        match self {
            ClientError::DeadlineExceeded { in_flight: true, .. } => repeat_safe,
            ClientError::DeadlineExceeded { last_error, .. } => {
                last_error.as_ref().is_some_and(|last| last.is_retryable(repeat_safe))
            }
            ClientError::Transport { kind, .. } => match kind {
                TransportKind::Connect => true,
                TransportKind::Timeout | TransportKind::Interrupted => repeat_safe,
                TransportKind::Other => false,
            },
            ClientError::Api { status, error, .. } => {
                let never_ran = matches!(
                    (status, error.code.as_str()),
                    (503, codes::PGRST000) | (503, codes::PGRST002) | (504, codes::PGRST003)
                );
                let rolled_back =
                    matches!(error.code.as_str(), codes::SERIALIZATION_FAILURE | codes::DEADLOCK_DETECTED);
                never_ran || rolled_back || (*status == 503 && repeat_safe)
            }
            ClientError::Http { status, .. } => repeat_safe && matches!(status, 502..=504),
            _ => false,
        }
    }

    /// Whether the call certainly never reached the plane's database, so
    /// nothing it asked for can have been done: the only failure after
    /// which a caller may act as if the plane did not exist (an
    /// `Idempotency-Key` layer's `fail_open`).
    ///
    /// | failure | never reached the plane |
    /// |---|---|
    /// | connection refused / not made | yes |
    /// | 503 `PGRST000`/`PGRST002`, 504 `PGRST003` (PostgREST never reached the database) | yes |
    /// | the deadline left no time for a retry, and the last failure is one of these | yes |
    /// | the deadline cut a request in flight | no: it may have run |
    /// | a timeout, a connection reset after sending | no |
    /// | any other 5xx, a gateway's 502/503/504 without PostgREST's body | no |
    /// | anything else (an answer, a refusal, a lock timeout) | no |
    pub fn never_reached_the_plane(&self) -> bool {
        match self {
            ClientError::Transport { kind: TransportKind::Connect, .. } => true,
            ClientError::Api { status, error, .. } => matches!(
                (status, error.code.as_str()),
                (503, codes::PGRST000) | (503, codes::PGRST002) | (504, codes::PGRST003)
            ),
            ClientError::DeadlineExceeded { in_flight: false, last_error: Some(last), .. } => {
                last.never_reached_the_plane()
            }
            _ => false,
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
mod tests {
    use super::*;

    fn api(status: u16, code: &str) -> ClientError {
        ClientError::Api {
            function: "f",
            status,
            error: Box::new(PostgrestError { code: code.into(), message: String::new(), details: None, hint: None }),
            retry_after: None,
        }
    }

    #[test]
    fn retry_table_matches_the_documented_one() {
        let cases = [
            (api(503, codes::PGRST000), true, true),
            (api(503, codes::PGRST002), true, true),
            (api(504, codes::PGRST003), true, true),
            (api(503, codes::PGRST001), false, true),
            (api(503, "57P01"), false, true),
            (api(500, codes::SERIALIZATION_FAILURE), true, true),
            (api(500, codes::DEADLOCK_DETECTED), true, true),
            (api(500, "57014"), false, false),
            (api(400, codes::INVALID_PARAMETER_VALUE), false, false),
            (api(404, codes::PGRST202), false, false),
            (api(409, codes::UNIQUE_VIOLATION), false, false),
            (api(401, codes::INSUFFICIENT_PRIVILEGE), false, false),
        ];
        for (error, any_call, repeat_safe) in cases {
            assert_eq!(error.is_retryable(false), any_call, "{error}");
            assert_eq!(error.is_retryable(true), repeat_safe, "{error}");
        }
        let gateway =
            ClientError::Http { function: "f", status: 502, body_excerpt: "<html>".into(), retry_after: None };
        assert!(!gateway.is_retryable(false));
        assert!(gateway.is_retryable(true));
        let refused = ClientError::BoundAboveCap { bound: 2, cap: 1 };
        assert!(!refused.is_retryable(true));
    }

    fn deadline(in_flight: bool, last_error: Option<ClientError>) -> ClientError {
        ClientError::DeadlineExceeded {
            function: "f",
            deadline: Duration::from_secs(1),
            elapsed: Duration::from_secs(1),
            attempts: 2,
            in_flight,
            last_error: last_error.map(Box::new),
        }
    }

    #[test]
    fn a_deadline_is_an_unknown_outcome_when_it_cut_a_request_else_its_last_failure() {
        // Cut in flight: like a timeout, it may have run.
        let cut = deadline(true, Some(api(503, codes::PGRST002)));
        assert!(!cut.is_retryable(false));
        assert!(cut.is_retryable(true));
        assert!(cut.is_transient());
        // Not retried for lack of time: as the failure that would have been retried.
        let never_ran = deadline(false, Some(api(503, codes::PGRST002)));
        assert!(never_ran.is_retryable(false));
        let may_have_run = deadline(false, Some(api(503, codes::PGRST001)));
        assert!(!may_have_run.is_retryable(false));
        assert!(may_have_run.is_retryable(true) && may_have_run.is_transient());
        assert!(cut.to_string().contains("outcome is unknown"), "{cut}");
        let source = std::error::Error::source(&never_ran).map(ToString::to_string);
        assert!(source.is_some_and(|s| s.contains("PGRST002")), "the last failure is the source");
    }

    /// A transport failure of `kind` (the kind is what is judged; the
    /// source is any reqwest error).
    fn transport(kind: TransportKind) -> ClientError {
        let source = match reqwest::Client::new().get("not a url").build() {
            Err(source) => source,
            Ok(_) => unreachable!("a URL without a scheme does not build"),
        };
        ClientError::Transport { function: "f", kind, source }
    }

    #[test]
    fn only_a_call_that_never_reached_the_database_counts_as_never_reaching_the_plane() {
        let cases = [
            (api(503, codes::PGRST000), true),
            (api(503, codes::PGRST002), true),
            (api(504, codes::PGRST003), true),
            // PostgREST reached the database, or says nothing of it.
            (api(503, codes::PGRST001), false),
            (api(503, "57P01"), false),
            (api(504, codes::PGRST000), false),
            (api(500, codes::SERIALIZATION_FAILURE), false),
            (api(500, "57014"), false),
            (api(400, codes::INVALID_PARAMETER_VALUE), false),
            (api(401, codes::INSUFFICIENT_PRIVILEGE), false),
            // A gateway's page: the request may have gone on.
            (ClientError::Http { function: "f", status: 502, body_excerpt: "<html>".into(), retry_after: None }, false),
            (ClientError::Http { function: "f", status: 503, body_excerpt: "<html>".into(), retry_after: None }, false),
            (ClientError::Http { function: "f", status: 504, body_excerpt: "<html>".into(), retry_after: None }, false),
            (
                ClientError::LockTimeout {
                    function: "f",
                    error: Box::new(PostgrestError {
                        code: codes::LOCK_NOT_AVAILABLE.into(),
                        message: String::new(),
                        details: None,
                        hint: None,
                    }),
                },
                false,
            ),
            (ClientError::Decode { function: "f", reason: String::new() }, false),
            // The deadline: cut in flight, it may have run; not retried for
            // lack of time, as its last failure.
            (deadline(true, None), false),
            (deadline(true, Some(api(503, codes::PGRST002))), false),
            (deadline(false, Some(api(503, codes::PGRST002))), true),
            (deadline(false, Some(api(504, codes::PGRST003))), true),
            (deadline(false, Some(api(503, codes::PGRST001))), false),
            (deadline(false, None), false),
            (transport(TransportKind::Connect), true),
            (deadline(false, Some(transport(TransportKind::Connect))), true),
            (deadline(true, Some(transport(TransportKind::Connect))), false),
            (transport(TransportKind::Timeout), false),
            (transport(TransportKind::Interrupted), false),
            (transport(TransportKind::Other), false),
        ];
        for (error, never_reached) in cases {
            assert_eq!(error.never_reached_the_plane(), never_reached, "{error}");
        }
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
