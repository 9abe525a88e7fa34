//! The per-function retry-safety table, the operation deadline and the
//! retry defaults, read from the one data file every client of the plane
//! reads (`supabase/functions/_shared/idempotency/rpc_policy.json`, beside
//! the TypeScript client), so the Rust and TypeScript clients cannot drift.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::Deserialize;

use super::retry::Repeat;

/// The file, embedded at build time.
const POLICY_JSON: &str = include_str!("../../supabase/functions/_shared/idempotency/rpc_policy.json");

/// The parsed file. Its `*_about` members are prose for its readers. The
/// Rust client's deadline, retry defaults and retry rules are constants and
/// code of their own (`DEFAULT_DEADLINE`, and in `retry`
/// `RetryConfig::default` and `ClientError::is_retryable`); this module's
/// tests pin them to the file.
#[derive(Debug, Deserialize)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct RpcPolicy {
    pub(crate) deadline_ms: u64,
    pub(crate) retry: RetryDefaults,
    functions: BTreeMap<String, Repeatable>,
    pub(crate) never_ran: Vec<NeverRan>,
    pub(crate) connection_lost: Vec<NeverRan>,
    pub(crate) rolled_back: Vec<String>,
}

/// The retry defaults, in milliseconds.
#[derive(Debug, Deserialize)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct RetryDefaults {
    pub(crate) max_retries: u32,
    pub(crate) initial_backoff_ms: u64,
    pub(crate) max_backoff_ms: u64,
    pub(crate) max_elapsed_ms: u64,
}

/// An answer by status and code: one that proves the call never reached the
/// database (`never_ran`), or one that says the connection to it was lost
/// (`connection_lost`).
#[derive(Debug, Deserialize)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct NeverRan {
    pub(crate) status: u16,
    pub(crate) code: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Repeatable {
    Safe,
    Unsafe,
}

/// The table. The file is part of the build and checked by this module's
/// tests, so a malformed one cannot ship; were it unreadable anyway, every
/// function would count as unsafe to repeat (the cautious reading).
pub(crate) fn policy() -> Option<&'static RpcPolicy> {
    static POLICY: OnceLock<Option<RpcPolicy>> = OnceLock::new();
    POLICY.get_or_init(|| serde_json::from_str(POLICY_JSON).ok()).as_ref()
}

/// The functions the table lists; `None` if the file did not parse.
#[cfg(test)]
pub(crate) fn functions() -> Option<impl Iterator<Item = &'static str>> {
    Some(policy()?.functions.keys().map(String::as_str))
}

impl Repeat {
    /// Whether `function` may be sent again after its answer was lost, as
    /// the shared table says; a function it does not list is
    /// [`Repeat::Unsafe`].
    pub fn of(function: &str) -> Repeat {
        match policy().and_then(|policy| policy.functions.get(function)) {
            Some(Repeatable::Safe) => Repeat::Safe,
            Some(Repeatable::Unsafe) | None => Repeat::Unsafe,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::postgrest::{ClientError, RetryConfig, DEFAULT_DEADLINE};

    fn table() -> &'static RpcPolicy {
        policy().expect("rpc_policy.json parses")
    }

    #[test]
    fn release_alone_is_unsafe_and_an_unlisted_function_too() {
        assert_eq!(Repeat::of("idempotency_release"), Repeat::Unsafe);
        assert_eq!(Repeat::of("idempotency_claim"), Repeat::Safe);
        assert_eq!(Repeat::of("not_a_function"), Repeat::Unsafe);
    }

    #[test]
    fn the_defaults_are_the_files() {
        let table = table();
        assert_eq!(DEFAULT_DEADLINE, Duration::from_millis(table.deadline_ms));
        let retry = RetryConfig::default();
        assert_eq!(retry.max_retries, table.retry.max_retries);
        assert_eq!(retry.initial_backoff, Duration::from_millis(table.retry.initial_backoff_ms));
        assert_eq!(retry.max_backoff, Duration::from_millis(table.retry.max_backoff_ms));
        assert_eq!(retry.max_elapsed, Duration::from_millis(table.retry.max_elapsed_ms));
    }

    fn answered(status: u16, code: &str) -> ClientError {
        ClientError::answered("idempotency_release", status, code)
    }

    #[test]
    fn what_the_file_says_never_ran_or_rolled_back_is_retried_even_when_unsafe() {
        let table = table();
        for never in &table.never_ran {
            let error = answered(never.status, &never.code);
            assert!(error.is_retryable(false) && error.never_reached_the_plane(), "{error}");
        }
        for code in &table.rolled_back {
            assert!(answered(500, code).is_retryable(false), "{code}");
        }
        // A lost connection may have run the call: retried only when that is
        // safe, and transient either way.
        for lost in &table.connection_lost {
            let error = answered(lost.status, &lost.code);
            assert!(!error.is_retryable(false) && error.is_retryable(true) && error.is_transient(), "{error}");
            assert!(!error.never_reached_the_plane(), "{error}");
        }
        // And nothing else is, for a call that is not safe to repeat.
        assert!(!answered(503, "PGRST001").is_retryable(false));
        assert!(!answered(500, "55P03").is_retryable(false));
    }
}
