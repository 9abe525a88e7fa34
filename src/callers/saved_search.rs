//! Saved-search start: the one surface claim before Run admission.
//!
//! A saved search must freeze its brief and baseline from mutable product
//! tables before the Run request can be built. That preparation is claimed
//! under `surface.saved_search.start`, and the frozen snapshot is the claim's
//! response, together with the Run key derived from the claim's identity
//! (organization, scope, key). The claim never records admission, dispatch or
//! Run status: the Run is admitted through `agent.runs` with that key, so a
//! replay finds the same Run — also after the 24-hour snapshot claim is gone,
//! for the Run's whole 396-day retention.

use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::Instrument;
use uuid::Uuid;

use super::runs::{AdmittedRun, RunAdmission};
use crate::error::Error;
use crate::repo::{IdempotencyRepository, PostgrestRepository, RunRepository};
use crate::service::{ClaimOutcome, Completion, Ending, IdempotencyService, RequestHash, DAY};

/// The scope of saved-search input preparation.
pub const SAVED_SEARCH_START_SCOPE: &str = "surface.saved_search.start";

/// Retention of the saved-search snapshot: the database's policy for the
/// scope (seeded by the migrations), 24 hours.
pub const SAVED_SEARCH_START_RETENTION: Duration = DAY;

/// The spec's lease for input preparation.
pub const SAVED_SEARCH_LEASE: Duration = Duration::from_secs(30);

/// Where the mutable product data comes from: the brief and the baseline a
/// saved search starts from, read now and frozen.
pub trait SnapshotSource: Send + Sync {
    /// Reads and freezes the saved search's input. Called at most once per
    /// start key while the claim is held. The snapshot is stored in the
    /// claim, so it must fit the store limit (64 KiB by default); a bulkier
    /// baseline belongs in storage of its own, referenced from the snapshot.
    /// A snapshot above the limit fails the start with
    /// [`InvalidInput::ResponseTooLarge`](crate::InvalidInput::ResponseTooLarge)
    /// and releases the claim.
    fn freeze(
        &self,
        organization_id: Uuid,
        saved_search_id: &str,
    ) -> impl Future<Output = Result<Value, SnapshotError>> + Send;
}

/// The source could not freeze the input. Nothing was stored; the claim is
/// released so a later start tries again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("freezing the saved search input failed: {0}")]
pub struct SnapshotError(pub String);

/// A started (or replayed) saved-search Run.
#[derive(Debug, Clone, PartialEq)]
pub struct StartedRun {
    /// The admitted Run (`admitted` is false on a replay).
    pub run: AdmittedRun,
    /// The frozen input the Run was built from.
    pub snapshot: Value,
    /// True when an earlier start froze the input.
    pub replayed: bool,
}

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
    /// Our lease passed while we froze the input and another worker took the
    /// start over: our snapshot is not the one stored, and no Run was started
    /// from it.
    #[error("saved search start {key}: the lease moved on before completion; no Run started")]
    FenceLost {
        /// The start key.
        key: String,
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
    /// The stored answer is not a snapshot this module wrote.
    #[error("saved search start {key}: the stored answer is not a snapshot: {reason}")]
    StoredAnswer {
        /// The start key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The plane failed.
    #[error(transparent)]
    Plane(#[from] Error),
}

impl SavedSearchError {
    /// True for the endings a caller should retry later.
    pub fn is_retryable(&self) -> bool {
        match self {
            // FenceLost: starting again answers the Run the winner admitted.
            SavedSearchError::InProgress { .. }
            | SavedSearchError::Snapshot(_)
            | SavedSearchError::FenceLost { .. } => true,
            SavedSearchError::Plane(error) => error.is_transient(),
            _ => false,
        }
    }
}

/// What the claim stores: the snapshot and the Run key derived from the claim.
#[derive(Debug, Serialize, Deserialize)]
struct Prepared {
    run_key: String,
    snapshot: Value,
}

/// Starts saved searches: claim, freeze, complete, admit.
#[derive(Debug, Clone)]
pub struct SavedSearchStart<R, S, Q = PostgrestRepository> {
    service: IdempotencyService<R>,
    runs: RunAdmission<Q>,
    source: S,
    lease: Duration,
}

impl<R: IdempotencyRepository, S: SnapshotSource, Q: RunRepository> SavedSearchStart<R, S, Q> {
    /// A starter with the spec's 30 s lease.
    pub fn new(service: IdempotencyService<R>, runs: RunAdmission<Q>, source: S) -> Self {
        SavedSearchStart { service, runs, source, lease: SAVED_SEARCH_LEASE }
    }

    /// Sets the preparation lease (the spec's is 30 s).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Starts saved search `saved_search_id` for `trigger_id` (the schedule
    /// tick or the click that asked for it): freezes its input once, and
    /// admits one Run from it. Every repeat answers that Run.
    pub async fn start(
        &self,
        organization_id: Uuid,
        saved_search_id: &str,
        trigger_id: &str,
    ) -> Result<StartedRun, SavedSearchError> {
        // Length-prefixed, so ("a:b", "c") and ("a", "b:c") are different keys.
        let key = format!("{}:{saved_search_id}:{trigger_id}", saved_search_id.len());
        let span = tracing::info_span!(
            "saved_search.start",
            %organization_id, key = key.as_str(), outcome = tracing::field::Empty,
            replayed = tracing::field::Empty
        );
        self.start_inner(organization_id, saved_search_id, trigger_id, &key).instrument(span).await
    }

    async fn start_inner(
        &self,
        organization_id: Uuid,
        saved_search_id: &str,
        trigger_id: &str,
        key: &str,
    ) -> Result<StartedRun, SavedSearchError> {
        let hash = RequestHash::of_json(&json!({"saved_search_id": saved_search_id, "trigger_id": trigger_id}));
        let span = tracing::Span::current();
        let outcome = self.service.claim(organization_id, SAVED_SEARCH_START_SCOPE, key, &hash, self.lease).await?;
        let (prepared, replayed) = match outcome {
            ClaimOutcome::Claimed(claim) => {
                let frozen = match self.source.freeze(organization_id, saved_search_id).await {
                    Ok(snapshot) if snapshot.is_null() => Err(SnapshotError("the source froze a null snapshot".into())),
                    other => other,
                };
                let snapshot = match frozen {
                    Ok(snapshot) => snapshot,
                    Err(error) => {
                        self.service.release_or_log(&claim).await;
                        return Err(error.into());
                    }
                };
                let prepared = Prepared { run_key: run_key(organization_id, key), snapshot };
                let response = serde_json::to_value(&prepared)
                    .map_err(|e| SavedSearchError::StoredAnswer { key: key.to_owned(), reason: e.to_string() })?;
                match self.service.complete(&claim, Completion::response(response)).await {
                    Ok(Ending::Recorded) => (prepared, false),
                    Ok(Ending::LeaseMovedOn) => {
                        span.record("outcome", "fence_lost");
                        return Err(SavedSearchError::FenceLost { key: key.to_owned() });
                    }
                    // Refused for good (e.g. a snapshot the store will not
                    // take): release, so the next start freezes again rather
                    // than waiting out the lease. A transient failure keeps
                    // the claim; its lease passing makes it reclaimable.
                    Err(error) => {
                        if !error.is_transient() {
                            self.service.release_or_log(&claim).await;
                        }
                        return Err(error.into());
                    }
                }
            }
            ClaimOutcome::Completed { response, .. } => {
                let prepared = response
                    .ok_or_else(|| "no response".to_owned())
                    .and_then(|value| serde_json::from_value::<Prepared>(value).map_err(|e| e.to_string()))
                    .map_err(|reason| SavedSearchError::StoredAnswer { key: key.to_owned(), reason })?;
                (prepared, true)
            }
            ClaimOutcome::Processing { lease_expires_at } => {
                span.record("outcome", "in_progress");
                return Err(SavedSearchError::InProgress { key: key.to_owned(), lease_expires_at });
            }
            ClaimOutcome::Conflict => {
                span.record("outcome", "conflict");
                return Err(SavedSearchError::Conflict { key: key.to_owned() });
            }
        };
        // Admission is its own claim (agent.runs' unique start key): a replay
        // whose first attempt died after completing admits the Run now, and a
        // start after the snapshot claim was swept finds the Run admitted
        // then, with the input it was admitted with.
        let run = self.runs.admit(organization_id, &prepared.run_key, &prepared.snapshot).await?;
        let replayed = replayed || !run.admitted;
        span.record("outcome", if run.admitted { "admitted" } else { "replayed" });
        span.record("replayed", replayed);
        Ok(StartedRun { snapshot: run.input.clone(), run, replayed })
    }
}

/// The Run key of a saved-search start: derived from the claim's identity
/// (organization, scope, key), so every start of the same trigger, before or
/// after the snapshot claim is swept, names the same Run.
fn run_key(organization_id: Uuid, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(organization_id.as_bytes());
    hasher.update(SAVED_SEARCH_START_SCOPE.as_bytes());
    hasher.update(b":");
    hasher.update(key.as_bytes());
    format!("saved_search:{}", hex::encode(hasher.finalize()))
}
