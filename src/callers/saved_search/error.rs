//! Why a start did not produce a Run, and the leases a starter refuses.

use std::time::Duration;

use super::source::SnapshotError;
use crate::error::Error;
use crate::service::LeaseOutlastsRetries;

/// Why a start did not produce a Run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SavedSearchError {
    /// Another worker is preparing this start right now. Retryable: try
    /// again later; once its lease passes, the next caller reclaims it.
    #[error("saved search start {key} is being prepared elsewhere until {lease_expires_at}")]
    InProgress {
        /// The start key.
        key: String,
        /// When that preparation's lease passes.
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },
    /// The start key was used for a different saved search.
    #[error("saved search start {key} was used for a different request")]
    Conflict {
        /// The start key.
        key: String,
    },
    /// The source failed; the claim was released.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The stored answer is not a snapshot this module wrote, or the Run it
    /// references does not match it.
    #[error("saved search start {key}: the stored answer is not a snapshot: {reason}")]
    StoredAnswer {
        /// The start key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The snapshot was frozen but could not be journaled before the
    /// journal's deadline; no Run started. The claim is left to its lease:
    /// the next start after it freezes again.
    #[error("saved search start {key}: the snapshot was not journaled ({ending}); no Run started")]
    NotJournaled {
        /// The start key.
        key: String,
        /// How the journal ended.
        ending: &'static str,
    },
    /// The plane failed.
    #[error(transparent)]
    Plane(#[from] Error),
}

impl SavedSearchError {
    /// True for the endings a caller should retry later.
    pub fn is_retryable(&self) -> bool {
        match self {
            SavedSearchError::InProgress { .. }
            | SavedSearchError::Snapshot(_)
            | SavedSearchError::NotJournaled { .. } => true,
            SavedSearchError::Plane(error) => error.is_transient(),
            _ => false,
        }
    }
}

/// A lease a saved-search start refuses to run with, found when it is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StartConfigError {
    /// The lease is outside [`MIN_PREPARATION_LEASE`](super::MIN_PREPARATION_LEASE)
    /// to the plane's [`MAX_LEASE`](crate::service::MAX_LEASE).
    #[error("saved search lease {lease:?} is outside {min:?} to {max:?}")]
    LeaseOutOfRange {
        /// The lease asked for.
        lease: Duration,
        /// The shortest the plane accepts.
        min: Duration,
        /// The longest the plane accepts.
        max: Duration,
    },
    /// The lease would still hold when the scheduler makes its last retry,
    /// so a worker that died mid-preparation would answer every retry
    /// "in progress" and the trigger would start no Run. The same refusal
    /// as the tool guard's and the webhook gate's.
    #[error("saved search start: {0}")]
    LeaseOutlastsRetries(#[from] LeaseOutlastsRetries),
}
