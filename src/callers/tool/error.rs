//! Why a guarded call did not produce an answer.

use std::time::Duration;

use crate::error::Error;
use crate::service::LeftToLease;

/// Why a guarded call did not produce an answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ToolError {
    /// Another worker holds a live lease on this call: the effect may be in
    /// flight. Raise it so the orchestrator runs the step again later; never
    /// report it as a result.
    #[error("tool call {scope}/{key} is in flight elsewhere until {lease_expires_at}")]
    ClaimInFlight {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// When that lease passes.
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },
    /// The key already answers for a call with different arguments.
    #[error("tool call {scope}/{key} was made before with different arguments")]
    Conflict {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
    },
    /// The scope is not a tool scope.
    #[error("{scope:?} is not a tool scope (tool.<name>)")]
    NotAToolScope {
        /// The scope given.
        scope: String,
    },
    /// The tool's timeout is zero or above the step budget.
    #[error("tool timeout {timeout:?} must be above zero and at most the {budget:?} step budget")]
    TimeoutOutOfRange {
        /// The timeout given.
        timeout: Duration,
        /// The step budget.
        budget: Duration,
    },
    /// The tool did not return within its timeout. Its effect is unknown, so
    /// the claim is neither completed nor released: it becomes reclaimable
    /// when its lease (timeout + journal deadline + margin) passes, and the
    /// retry reaches the vendor with the same idempotency key.
    #[error("tool call {scope}/{key} did not return within {timeout:?}")]
    TimedOut {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// The tool's timeout.
        timeout: Duration,
    },
    /// The plane did not confirm the call's lease in time (its heartbeats
    /// went unanswered: a partition, an outage), so the tool was told to
    /// stop ([`ToolCall::stop`](super::ToolCall::stop)) and dropped before
    /// another worker could take the call over. Its effect is unknown: the
    /// claim is left to its lease, and the retry reaches the vendor with the
    /// same idempotency key.
    #[error("tool call {scope}/{key} was stopped: the plane did not confirm its lease in time")]
    LeaseUnconfirmed {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
    },
    /// The tool panicked. Its effect is unknown, so the claim is left to its
    /// lease, like a timeout's.
    #[error("tool call {scope}/{key} panicked")]
    Panicked {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
    },
    /// The tool ran, but its answer could not be journaled before the
    /// journal's deadline. The claim is left to its lease: the step runs
    /// again after it, reaching the vendor with the same idempotency key
    /// (or asking the reconciler).
    #[error("tool call {scope}/{key} ran, but its answer was not journaled: {reason}")]
    NotJournaled {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// Why.
        #[source]
        reason: Box<LeftToLease>,
    },
    /// The lease margin is outside [`LEASE_MARGIN_RANGE`](super::LEASE_MARGIN_RANGE).
    #[error("lease margin {0:?} must be between 1 s and 5 min")]
    MarginOutOfRange(Duration),
    /// The journal deadline is outside [`LEASE_MARGIN_RANGE`](super::LEASE_MARGIN_RANGE).
    #[error("journal deadline {0:?} must be between 1 s and 5 min")]
    JournalDeadlineOutOfRange(Duration),
    /// The call's lease (timeout + journal deadline + margin), taken after
    /// the checkpoint's time, would still hold when the orchestrator makes
    /// its last attempt, so a worker that died holding the claim would fail
    /// the whole Run.
    #[error("tool {scope}: its lease {lease:?}, claimed {spent:?} into the step, does not pass before the orchestrator's last attempt, {horizon:?} after the first")]
    LeaseOutlastsRetries {
        /// The scope.
        scope: String,
        /// The lease a call would be claimed for.
        lease: Duration,
        /// Time the step spent before the claim (its checkpoint).
        spent: Duration,
        /// The time until the orchestrator's last attempt.
        horizon: Duration,
    },
    /// The reconciler could not tell whether an earlier attempt's effect
    /// happened. The claim is kept (releasing it would let the next attempt
    /// run without asking); it is reconciled again once its lease passes.
    #[error("tool call {scope}/{key}: could not reconcile an earlier attempt: {reason}")]
    ReconcileFailed {
        /// The scope.
        scope: String,
        /// The key.
        key: String,
        /// What the reconciler reported.
        reason: String,
    },
    /// The plane failed (invalid input, store unreachable, …).
    #[error(transparent)]
    Plane(#[from] Error),
}

impl ToolError {
    /// True when running the step again later may succeed: a call in flight
    /// elsewhere, a timed-out call (its lease will pass), a transient store
    /// failure. False for a conflict or a configuration error.
    pub fn is_retryable(&self) -> bool {
        match self {
            ToolError::ClaimInFlight { .. }
            | ToolError::TimedOut { .. }
            | ToolError::LeaseUnconfirmed { .. }
            | ToolError::Panicked { .. }
            | ToolError::NotJournaled { .. }
            | ToolError::ReconcileFailed { .. } => true,
            ToolError::Plane(error) => error.is_transient(),
            _ => false,
        }
    }
}
