//! When and how the client retries, in one place: the rules (which failure
//! is retried, for which call; which is transient; which never reached the
//! plane), the policy ([`RetryConfig`]: bounded, jittered exponential
//! backoff), and the loop that applies both within an operation's deadline.
//! The shared table `rpc_policy.json` (see `rpc_policy`) says which
//! function is safe to repeat; its tests pin these rules and defaults to it.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::codes;
use super::error::{ClientError, TransportKind};

/// Whether a call may be sent again after its response was lost.
///
/// Every function of the plane is designed so that it may (a repeat with the
/// same lease token answers the same row). A call that is not, is retried only
/// when the server proves it never ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeat {
    /// Repeating the call after a lost response has no further effect.
    Safe,
    /// Repeating the call could repeat an effect.
    Unsafe,
}

/// How the client retries a failure [`ClientError::is_retryable`] allows.
///
/// Within the operation's deadline
/// ([`ClientConfig::with_deadline`](super::ClientConfig::with_deadline)),
/// which bounds every attempt and backoff together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryConfig {
    /// Retries after the first attempt. `0` disables retries. Default 4.
    pub max_retries: u32,
    /// First backoff. Default 50 ms.
    pub initial_backoff: Duration,
    /// Ceiling for one backoff, and for a server's `Retry-After`. Default 2 s.
    pub max_backoff: Duration,
    /// No retry starts once this much time has passed since the first
    /// attempt. Default 20 s.
    pub max_elapsed: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_retries: 4,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            max_elapsed: Duration::from_secs(20),
        }
    }
}

impl RetryConfig {
    /// No retries at all.
    pub fn disabled() -> Self {
        RetryConfig { max_retries: 0, ..RetryConfig::default() }
    }

    /// The wait before retry number `retry` (1-based): uniform between half
    /// and all of an exponential ceiling, never below the server's
    /// `Retry-After` in seconds (capped at `max_backoff`). PostgREST sends
    /// `Retry-After: 0` on every 503, which therefore leaves our own backoff
    /// in charge; an HTTP-date `Retry-After` is not read.
    pub(crate) fn backoff(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let exponent = retry.saturating_sub(1).min(16);
        let ceiling = self.initial_backoff.saturating_mul(1u32 << exponent).min(self.max_backoff);
        let jittered = ceiling.mul_f64(0.5 + 0.5 * rand::random::<f64>());
        let floor = retry_after.unwrap_or(Duration::ZERO).min(self.max_backoff);
        jittered.max(floor)
    }
}

/// Whether PostgREST answered that the call never reached the database:
/// 503 `PGRST000` (no connection) or `PGRST002` (no schema cache), 504
/// `PGRST003` (no pool connection in time).
fn never_ran(status: u16, code: &str) -> bool {
    matches!((status, code), (503, codes::PGRST000) | (503, codes::PGRST002) | (504, codes::PGRST003))
}

/// Whether the server said it lost its database connection, before the call
/// or during it: postrust-server's 500 `PGRST500` (PostgREST answers 503).
fn connection_lost(status: u16, code: &str) -> bool {
    matches!((status, code), (500, codes::PGRST500))
}

impl ClientError {
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
    /// | 500 `PGRST500` (the server lost its database connection) | no | yes |
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
                let never_ran = never_ran(*status, &error.code);
                let rolled_back =
                    matches!(error.code.as_str(), codes::SERIALIZATION_FAILURE | codes::DEADLOCK_DETECTED);
                let may_have_run = *status == 503 || connection_lost(*status, &error.code);
                never_ran || rolled_back || (may_have_run && repeat_safe)
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
            ClientError::Api { status, error, .. } => never_ran(*status, &error.code),
            ClientError::DeadlineExceeded { in_flight: false, last_error: Some(last), .. } => {
                last.never_reached_the_plane()
            }
            _ => false,
        }
    }
}

/// Runs `attempt` until it answers, retrying a failure
/// [`ClientError::is_retryable`] allows for `repeat`, as `retry` says,
/// within `deadline`: an attempt still in flight at the deadline is cut,
/// and no retry starts that could not finish before it (the failed
/// attempt's duration, plus the backoff, is the estimate).
pub(super) async fn with_retries<T, F: Future<Output = Result<T, ClientError>>>(
    function: &'static str,
    retry: &RetryConfig,
    deadline: Duration,
    repeat: Repeat,
    mut attempt: impl FnMut() -> F,
) -> Result<T, ClientError> {
    let started = Instant::now();
    let deadline_at = started + deadline;
    let mut retries = 0u32;
    let mut last_error: Option<ClientError> = None;
    loop {
        let attempt_started = Instant::now();
        let error = match tokio::time::timeout_at(deadline_at, attempt()).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(error)) => error,
            Err(_cut) => {
                return Err(ClientError::DeadlineExceeded {
                    function,
                    deadline,
                    elapsed: started.elapsed(),
                    attempts: retries + 1,
                    in_flight: true,
                    last_error: last_error.map(Box::new),
                })
            }
        };
        let may_retry = error.is_retryable(repeat == Repeat::Safe)
            && retries < retry.max_retries
            && started.elapsed() < retry.max_elapsed;
        if !may_retry {
            return Err(error);
        }
        let wait = retry.backoff(retries + 1, error.retry_after());
        let estimate = attempt_started.elapsed();
        if Instant::now() + wait + estimate >= deadline_at {
            tracing::info!(
                function,
                attempts = retries + 1,
                deadline_ms = deadline.as_millis() as u64,
                error = %error,
                "not retrying PostgREST call: a retry could not finish before the deadline"
            );
            return Err(ClientError::DeadlineExceeded {
                function,
                deadline,
                elapsed: started.elapsed(),
                attempts: retries + 1,
                in_flight: false,
                last_error: Some(Box::new(error)),
            });
        }
        retries += 1;
        tracing::info!(
            function,
            retry = retries,
            max_retries = retry.max_retries,
            wait_ms = wait.as_millis() as u64,
            error = %error,
            "retrying PostgREST call"
        );
        last_error = Some(error);
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgrest::PostgrestError;

    #[test]
    fn backoff_grows_is_capped_and_respects_retry_after() {
        let config = RetryConfig::default();
        for retry in 1..=10 {
            let wait = config.backoff(retry, None);
            assert!(wait <= config.max_backoff, "retry {retry}: {wait:?}");
            let ceiling = config.initial_backoff * (1 << (retry - 1).min(16));
            assert!(wait >= ceiling.min(config.max_backoff) / 2, "retry {retry}: {wait:?}");
        }
        // Retry-After: 0 leaves our own backoff in charge.
        assert!(config.backoff(1, Some(Duration::ZERO)) >= config.initial_backoff / 2);
        // A larger Retry-After is honoured, up to the ceiling.
        assert_eq!(config.backoff(1, Some(Duration::from_secs(1))), Duration::from_secs(1));
        assert_eq!(config.backoff(1, Some(Duration::from_secs(60))), config.max_backoff);
    }

    fn api(status: u16, code: &str) -> ClientError {
        ClientError::answered("f", status, code)
    }

    #[test]
    fn retry_table_matches_the_documented_one() {
        let cases = [
            (api(503, codes::PGRST000), true, true),
            (api(503, codes::PGRST002), true, true),
            (api(504, codes::PGRST003), true, true),
            (api(503, codes::PGRST001), false, true),
            (api(503, "57P01"), false, true),
            (api(500, codes::PGRST500), false, true),
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
                ClientError::LockTimeout { function: "f", error: PostgrestError::of_code(codes::LOCK_NOT_AVAILABLE) },
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
}
