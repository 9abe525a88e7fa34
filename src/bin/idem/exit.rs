//! The exit codes, one place: scripts and schedulers branch on them.

use std::process::ExitCode;

/// The command did what it was asked, and nothing is waiting.
pub(crate) fn ok() -> ExitCode {
    ExitCode::SUCCESS
}

/// An error (printed with its causes), a failed `doctor` check, a failed
/// `demo` check.
pub(crate) fn failure() -> ExitCode {
    ExitCode::from(1)
}

/// The command line was wrong: nothing was attempted.
pub(crate) fn usage() -> ExitCode {
    ExitCode::from(2)
}

/// `sweep`'s last read filled its bound (expired claims are waiting), or
/// `redrive`'s last pass did (orphans may be waiting).
pub(crate) fn backlog() -> ExitCode {
    ExitCode::from(3)
}

/// A usage or configuration error found before any request: printed, then
/// exit code 2 (nothing was attempted).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub(crate) struct Usage(pub(crate) crate::BoxError);

/// `error` as a usage error.
pub(crate) fn usage_error(error: impl Into<crate::BoxError>) -> crate::BoxError {
    Box::new(Usage(error.into()))
}

/// `error` as the binary's error: input the library refused before any
/// request (an empty or oversized scope or key, a lease out of range) is a
/// usage error, exit 2; anything else, exit 1.
pub(crate) fn refused_input(error: idempotency_plane::Error) -> crate::BoxError {
    match error {
        idempotency_plane::Error::Invalid(_) => usage_error(error),
        other => other.into(),
    }
}
