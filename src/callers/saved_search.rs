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
//!
//! Two ways to keep the snapshot, decided by its size:
//!
//! - **Inline** (it fits the store limit, 64 KiB by default): the claim
//!   completes with the snapshot, then the Run is admitted from it. A
//!   preparation whose fence was lost cannot complete, so it admits nothing.
//! - **By reference** (it does not fit): the snapshot's durable copy is the
//!   Run's own input (up to 4 MiB). The Run is admitted first, through a
//!   *fenced* admission that inserts only while this preparation's claim is
//!   still held by its lease token (one SQL statement), and the claim then
//!   completes with the Run key and a [`ResponseRef`] to the Run (type
//!   [`SNAPSHOT_RESOURCE_TYPE`], its id, the snapshot's size and SHA-256).
//!   A replay reads the snapshot back from the Run and checks it against the
//!   reference. If the worker dies between admission and completion, the
//!   next one reclaims, freezes again, and its fenced admission answers the
//!   Run already admitted: the first snapshot wins.
//!
//! A reclaimed preparation always takes the fenced road, whatever its size:
//! an earlier holder may have admitted a Run before it died, and the claim
//! must then answer that Run's input, not the new freeze. Either way
//! [`StartedRun::snapshot`] is the admitted Run's input.
//!
//! Every start of one trigger admits with the same [`AdmissionToken`],
//! derived from the start's identity, so each of them (a retry after a lost
//! answer, a re-run hours later) is told `admitted = true` for the Run its
//! trigger started.

use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::Instrument;
use uuid::Uuid;

use super::runs::{AdmissionError, AdmissionToken, AdmittedRun, RunAdmission};
use crate::error::{Error, InvalidInput};
use crate::repo::{IdempotencyRepository, RunRepository};
use crate::service::journal;
use crate::service::{
    may_have_written, Answer, Begun, Effect, EffectDriver, Held, IdempotencyService, LeaseOutlastsRetries, Refused,
    RequestHash, ResourceRef, ResponseRef, RetryHorizon, Settle, Settled, Timing, DEFAULT_JOURNAL_DEADLINE, MAX_LEASE,
    MAX_POLICY_RESPONSE_BYTES, MIN_LEASE,
};

/// The scope of saved-search input preparation.
pub const SAVED_SEARCH_START_SCOPE: &str = "surface.saved_search.start";

/// The spec's lease for input preparation.
pub const SAVED_SEARCH_LEASE: Duration = Duration::from_secs(30);

/// The resource a snapshot too large for its claim is kept in: the admitted
/// Run, whose input it is. The claim's `resource_type`, and the type of its
/// [`ResponseRef`].
pub const SNAPSHOT_RESOURCE_TYPE: &str = "agent.run";

/// Where the mutable product data comes from: the brief and the baseline a
/// saved search starts from, read now and frozen.
pub trait SnapshotSource: Send + Sync {
    /// Reads and freezes the saved search's input. Called at most once per
    /// start key while the claim is held. A snapshot that fits the store
    /// limit (64 KiB by default) is kept in the claim; a larger one is kept
    /// as the Run's input and referenced from the claim. One the store
    /// cannot hold at all (above 4 MiB as compact JSON, nested deeper than
    /// 64 levels, holding U+0000) fails the start
    /// ([`Error::is_unstorable_answer`]) and releases the claim.
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
    /// The admitted Run. `admitted` is true for every start of this trigger
    /// (they share its admission token), replays included; false only when
    /// a Run under its key was admitted by someone else.
    pub run: AdmittedRun,
    /// The frozen input the Run was admitted with.
    pub snapshot: Value,
    /// True when an earlier start froze the input the Run was admitted
    /// with: this call froze nothing, or its freeze lost to an earlier one.
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
            // FenceLost: starting again answers the Run the winner admitted.
            SavedSearchError::InProgress { .. }
            | SavedSearchError::Snapshot(_)
            | SavedSearchError::FenceLost { .. }
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
    /// The lease is outside what the plane accepts
    /// ([`MIN_LEASE`] to [`MAX_LEASE`]).
    #[error("saved search lease {lease:?} is outside the plane's {min:?} to {max:?}")]
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

/// Refuses a lease outside the plane's range, or one still held at the
/// scheduler's last retry.
fn check_lease(lease: Duration, horizon: RetryHorizon) -> Result<(), StartConfigError> {
    if !(MIN_LEASE..=MAX_LEASE).contains(&lease) {
        return Err(StartConfigError::LeaseOutOfRange { lease, min: MIN_LEASE, max: MAX_LEASE });
    }
    // The claim is the start's first call: nothing is spent before it.
    if lease >= horizon.until_last() {
        return Err(LeaseOutlastsRetries { lease, spent: Duration::ZERO, horizon: horizon.until_last() }.into());
    }
    Ok(())
}

/// What the claim stores: the Run key derived from the claim, and either the
/// snapshot itself or, when it is too large for the claim, a reference to
/// the Run that holds it as its input.
#[derive(Debug, Serialize, Deserialize)]
struct Prepared {
    run_key: String,
    snapshot: Value,
}

impl Prepared {
    fn inline(run_key: &str, snapshot: &Value) -> Value {
        json!({ "run_key": run_key, "snapshot": snapshot })
    }
}

/// One start's identity, and what is derived from it.
struct Start<'a> {
    organization_id: Uuid,
    key: &'a str,
    run_key: String,
    token: AdmissionToken,
}

impl Start<'_> {
    fn stored_answer(&self, reason: impl Into<String>) -> SavedSearchError {
        SavedSearchError::StoredAnswer { key: self.key.to_owned(), reason: reason.into() }
    }

    fn fence_lost(&self) -> SavedSearchError {
        tracing::Span::current().record("outcome", "fence_lost");
        SavedSearchError::FenceLost { key: self.key.to_owned() }
    }
}

/// Starts saved searches: claim, freeze, complete, admit (or, for a large
/// snapshot, claim, freeze, admit under the claim's fence, complete).
#[derive(Debug, Clone)]
pub struct SavedSearchStart<R, S, Q> {
    driver: EffectDriver<R>,
    runs: RunAdmission<Q>,
    source: S,
    lease: Duration,
    horizon: RetryHorizon,
}

impl<R: IdempotencyRepository, S: SnapshotSource, Q: RunRepository> SavedSearchStart<R, S, Q> {
    /// A starter with the spec's 30 s lease, for a scheduler that retries a
    /// start for `horizon`. Refused when the lease would still hold at the
    /// scheduler's last retry: a worker that died preparing would otherwise
    /// block every retry of its trigger.
    pub fn new(
        service: IdempotencyService<R>,
        runs: RunAdmission<Q>,
        source: S,
        horizon: RetryHorizon,
    ) -> Result<Self, StartConfigError> {
        check_lease(SAVED_SEARCH_LEASE, horizon)?;
        Ok(SavedSearchStart { driver: EffectDriver::new(service), runs, source, lease: SAVED_SEARCH_LEASE, horizon })
    }

    /// Sets the preparation lease (the spec's is 30 s): refused outside the
    /// plane's range, or when it would still hold at the scheduler's last
    /// retry.
    pub fn with_lease(mut self, lease: Duration) -> Result<Self, StartConfigError> {
        check_lease(lease, self.horizon)?;
        self.lease = lease;
        Ok(self)
    }

    /// The preparation lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The lease's parts: the freeze's timeout, the journal's deadline and
    /// a margin (15 s, 10 s and 5 s of the spec's 30 s).
    fn timing(&self) -> Result<Timing, SavedSearchError> {
        let journal = (self.lease / 3).min(DEFAULT_JOURNAL_DEADLINE);
        let margin = (self.lease / 6).min(Duration::from_secs(5));
        Timing::new(self.lease - journal - margin, journal, margin)
            .map_err(|refused| SavedSearchError::Plane(refused.into()))
    }

    /// The scheduler's retry horizon the lease was checked against.
    pub fn retry_horizon(&self) -> RetryHorizon {
        self.horizon
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
            replayed = tracing::field::Empty, fenced = tracing::field::Empty,
            by_reference = tracing::field::Empty
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
        let start = Start {
            organization_id,
            key,
            run_key: run_key(organization_id, key),
            token: admission_token(organization_id, key),
        };
        let span = tracing::Span::current();
        let effect = Effect {
            organization_id,
            scope: SAVED_SEARCH_START_SCOPE,
            key,
            request_hash: &hash,
            timing: self.timing()?,
        };
        match self.driver.begin(&effect).await? {
            Begun::Held(held) => self.prepare(&start, saved_search_id, held).await,
            Begun::Replayed(answer) => self.replay(&start, answer.output).await,
            Begun::InFlight { lease_expires_at } => {
                span.record("outcome", "in_progress");
                Err(SavedSearchError::InProgress { key: key.to_owned(), lease_expires_at })
            }
            Begun::Conflict => {
                span.record("outcome", "conflict");
                Err(SavedSearchError::Conflict { key: key.to_owned() })
            }
        }
    }

    /// We hold the claim: freeze, then keep the snapshot inline or by
    /// reference, and admit the Run. Freezing only reads, and no other start
    /// is answered on the strength of a claim in preparation (they are told
    /// it is in progress): a failed freeze releases.
    async fn prepare(
        &self,
        start: &Start<'_>,
        saved_search_id: &str,
        held: Held<R>,
    ) -> Result<StartedRun, SavedSearchError> {
        // A reclaimed preparation's earlier holder may have admitted a Run
        // under this claim before it died: that Run's input is the
        // snapshot, and nothing is frozen again.
        if held.claim().reclaimed() {
            if let Some(run) = self.runs.find(start.organization_id, &start.run_key, Some(start.token)).await? {
                tracing::info!(run_id = %run.id, "an earlier holder admitted the Run; journaling its input");
                self.journal_run(start, held, &run).await;
                // This start froze nothing: the input is an earlier one's.
                return Ok(self.started(run, true, None));
            }
        }
        let frozen = match held.run(self.source.freeze(start.organization_id, saved_search_id)).await {
            Ok(Ok(snapshot)) if snapshot.is_null() => Err(SnapshotError("the source froze a null snapshot".into())),
            Ok(frozen) => frozen,
            Err(cut) => Err(SnapshotError(format!("freezing the input: {cut}"))),
        };
        let snapshot = match frozen {
            Ok(snapshot) => snapshot,
            Err(error) => {
                let _ = held.settle(Settle::Release).await;
                return Err(error.into());
            }
        };
        // A snapshot no Run could be admitted with (above 4 MiB, holding
        // U+0000, nested too deep) must not be journaled: every replay would
        // fail to admit it.
        if let Some(reason) = journal::unstorable(&snapshot, 0, MAX_POLICY_RESPONSE_BYTES) {
            let _ = held.settle(Settle::Release).await;
            let refused = match reason {
                journal::Unstorable::TooLarge { size, limit } => InvalidInput::ResponseTooLarge { size, limit },
                other => InvalidInput::UnstorableResponse(other),
            };
            return Err(SavedSearchError::Plane(refused.into()));
        }
        // The database stamps claimed_at = lease_expires_at - the lease (in
        // whole milliseconds, rounded up): a Run admitted before it is an
        // earlier start's.
        let claimed_at = held.claim().lease_expires_at() - lease_delta(self.lease);

        let held = if held.claim().reclaimed() {
            held
        } else {
            match held.journal_exact(Answer::success(Prepared::inline(&start.run_key, &snapshot))).await {
                Ok(Settled::Journaled { .. }) => {
                    // Admission is its own claim (agent.runs' unique start
                    // key): a replay whose first attempt died after
                    // completing admits the Run now, and a start after the
                    // snapshot claim was swept finds the Run admitted then,
                    // with the input it was admitted with.
                    let run = self.runs.admit_as(start.organization_id, &start.run_key, &snapshot, start.token).await?;
                    return Ok(self.started(run, false, Some(claimed_at)));
                }
                Ok(Settled::LeaseMovedOn) => return Err(start.fence_lost()),
                Ok(other) => {
                    return Err(SavedSearchError::NotJournaled { key: start.key.to_owned(), ending: other.as_str() })
                }
                // Above the limit, or the scope keeps less: keep it in the
                // Run instead, under the fence.
                Err(Refused { held, error }) => {
                    tracing::info!(%error, "the snapshot does not fit its claim; keeping it in the Run");
                    held
                }
            }
        };

        tracing::Span::current().record("fenced", true);
        let admitted =
            self.runs.admit_fenced(start.organization_id, &start.run_key, &snapshot, start.token, held.claim()).await;
        let run = match admitted {
            Ok(run) => run,
            // The claim is another start's now; ours writes nothing more.
            Err(AdmissionError::FenceLost { .. }) => return Err(start.fence_lost()),
            Err(AdmissionError::Plane(error)) => {
                // Refused before anything was written: no Run, so release and
                // let the next start freeze again. Any other failure may have
                // admitted the Run: left to the lease, whose next holder
                // finds that Run and journals its input.
                let ending = if may_have_written(&error) {
                    Settle::Unknown("the admission's outcome is unknown")
                } else {
                    Settle::Release
                };
                let _ = held.settle(ending).await;
                return Err(error.into());
            }
        };
        // The Run is admitted, under our fence: it is the answer now, however
        // the journal ends.
        self.journal_run(start, held, &run).await;
        Ok(self.started(run, false, Some(claimed_at)))
    }

    /// Journals `run`'s input as the claim's answer, with the Run as its
    /// resource: inline when it fits, else by reference to the Run. A
    /// journal that does not land leaves the claim to its lease; its next
    /// holder finds the Run and journals it.
    async fn journal_run(&self, start: &Start<'_>, held: Held<R>, run: &AdmittedRun) {
        let resource =
            ResourceRef { resource_type: SNAPSHOT_RESOURCE_TYPE.to_owned(), resource_id: run.id.to_string() };
        let answer = Answer::success(Prepared::inline(&start.run_key, &run.input)).with_resource(Some(resource));
        match held.settle(Settle::Journal(answer)).await {
            Settled::Journaled { stand_in } => {
                tracing::Span::current().record("by_reference", stand_in.is_some());
            }
            Settled::LeaseMovedOn => {
                tracing::info!(run_id = %run.id, "the Run is admitted; the claim moved on before its completion")
            }
            other => tracing::warn!(
                ending = other.as_str(), run_id = %run.id,
                "the Run is admitted, its claim not completed; the next start after the lease completes it"
            ),
        }
    }

    /// An earlier start completed the claim: answer its Run, admitting it
    /// now if that start died before admitting an inline snapshot.
    async fn replay(&self, start: &Start<'_>, output: Value) -> Result<StartedRun, SavedSearchError> {
        let run = match ResponseRef::from_stored(&output) {
            Some(reference) => {
                tracing::Span::current().record("by_reference", true);
                let found = self.runs.find(start.organization_id, &start.run_key, Some(start.token)).await?;
                let run = found.ok_or_else(|| start.stored_answer("the Run holding the snapshot is not there"))?;
                check_reference(&reference, &start.run_key, &run).map_err(|reason| start.stored_answer(reason))?;
                run
            }
            None => {
                let prepared =
                    serde_json::from_value::<Prepared>(output).map_err(|e| start.stored_answer(e.to_string()))?;
                self.runs.admit_as(start.organization_id, &prepared.run_key, &prepared.snapshot, start.token).await?
            }
        };
        Ok(self.started(run, true, None))
    }

    /// The answer, with its outcome on the span. `claimed_at`: when our own
    /// claim started, for a start that froze.
    fn started(
        &self,
        run: AdmittedRun,
        replayed_claim: bool,
        claimed_at: Option<chrono::DateTime<chrono::Utc>>,
    ) -> StartedRun {
        let replayed = replayed_claim || !run.admitted || claimed_at.is_some_and(|at| run.admitted_at < at);
        let span = tracing::Span::current();
        span.record("outcome", if replayed { "replayed" } else { "admitted" });
        span.record("replayed", replayed);
        StartedRun { snapshot: run.input.clone(), run, replayed }
    }
}

/// Whether `run` is the Run `reference` names, and the answer it digests
/// (the Run key and the Run's input) is the one the Run holds.
fn check_reference(reference: &ResponseRef, run_key: &str, run: &AdmittedRun) -> Result<(), String> {
    if reference.resource_type != SNAPSHOT_RESOURCE_TYPE || reference.resource_id != run.id.to_string() {
        return Err(format!(
            "it references {}/{}, the Run under its key is {SNAPSHOT_RESOURCE_TYPE}/{}",
            reference.resource_type, reference.resource_id, run.id
        ));
    }
    match journal::digest(&Prepared::inline(run_key, &run.input)) {
        Some((size, sha256)) if size == reference.size && sha256 == reference.sha256 => Ok(()),
        _ => Err(format!("the Run {}'s input is not the snapshot it references", run.id)),
    }
}

/// A lease as the database counts it: whole milliseconds, rounded up.
fn lease_delta(lease: Duration) -> chrono::TimeDelta {
    let ms = i64::try_from(lease.as_nanos().div_ceil(1_000_000)).unwrap_or(i64::MAX);
    chrono::TimeDelta::milliseconds(ms)
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

/// The admission token of a saved-search start: derived from the same
/// identity, so every start of one trigger is the Run's admitter, and
/// anyone else admitting under its key is not.
fn admission_token(organization_id: Uuid, key: &str) -> AdmissionToken {
    AdmissionToken::derived(organization_id, &format!("{SAVED_SEARCH_START_SCOPE}:{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repo::MemoryRepository;

    const THIRTY_S: Duration = SAVED_SEARCH_LEASE;

    type Starter = SavedSearchStart<MemoryRepository, Frozen, MemoryRepository>;

    fn starter(horizon: RetryHorizon) -> Result<Starter, StartConfigError> {
        let service = IdempotencyService::new(MemoryRepository::new());
        SavedSearchStart::new(service, RunAdmission::new(MemoryRepository::new()), Frozen, horizon)
    }

    struct Frozen;

    impl SnapshotSource for Frozen {
        async fn freeze(&self, _: Uuid, _: &str) -> Result<Value, SnapshotError> {
            Ok(json!({}))
        }
    }

    #[test]
    fn a_scheduler_whose_last_retry_comes_before_the_30_second_lease_passes_is_refused() {
        // 5 retries from 1 s, doubling up to 1 min: the last 1+2+4+8+16 = 31 s after the first.
        let horizon = RetryHorizon::exponential(5, Duration::from_secs(1), Duration::from_secs(60));
        let accepted = starter(horizon).expect("the 30 s lease passes before the last retry");
        assert_eq!((accepted.lease(), accepted.retry_horizon()), (THIRTY_S, horizon));

        let short = RetryHorizon::exponential(4, Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(
            starter(short).err(),
            Some(StartConfigError::LeaseOutlastsRetries(LeaseOutlastsRetries {
                lease: THIRTY_S,
                spent: Duration::ZERO,
                horizon: Duration::from_secs(15)
            }))
        );
        let exactly = RetryHorizon::until_last_attempt(THIRTY_S);
        assert!(
            matches!(starter(exactly), Err(StartConfigError::LeaseOutlastsRetries(_))),
            "a lease passing at the last retry still blocks it"
        );
    }

    #[test]
    fn with_lease_checks_the_horizon_and_the_planes_range() {
        let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(120));
        let longer = starter(horizon).unwrap().with_lease(Duration::from_secs(90)).expect("passes before 120 s");
        assert_eq!(longer.lease(), Duration::from_secs(90));
        assert_eq!(
            starter(horizon).unwrap().with_lease(Duration::from_secs(120)).err(),
            Some(StartConfigError::LeaseOutlastsRetries(LeaseOutlastsRetries {
                lease: Duration::from_secs(120),
                spent: Duration::ZERO,
                horizon: Duration::from_secs(120)
            }))
        );
        for lease in [Duration::ZERO, MIN_LEASE - Duration::from_millis(1)] {
            assert_eq!(
                starter(horizon).unwrap().with_lease(lease).err(),
                Some(StartConfigError::LeaseOutOfRange { lease, min: MIN_LEASE, max: MAX_LEASE })
            );
        }
        assert!(starter(horizon).unwrap().with_lease(MIN_LEASE).is_ok());
        let forever = RetryHorizon::until_last_attempt(MAX_LEASE * 2);
        assert!(starter(forever).unwrap().with_lease(MAX_LEASE).is_ok());
        assert!(matches!(
            starter(forever).unwrap().with_lease(MAX_LEASE + Duration::from_millis(1)),
            Err(StartConfigError::LeaseOutOfRange { .. })
        ));
    }

    #[test]
    fn the_lease_is_counted_as_the_database_stamps_it() {
        assert_eq!(lease_delta(Duration::from_micros(30_000_001)), chrono::TimeDelta::milliseconds(30_001));
        assert_eq!(lease_delta(THIRTY_S), chrono::TimeDelta::seconds(30));
    }

    #[test]
    fn a_reference_must_name_the_run_and_digest_its_input() {
        let run = AdmittedRun {
            id: Uuid::new_v4(),
            organization_id: Uuid::new_v4(),
            start_key: "saved_search:x".into(),
            input: json!({"brief": "b"}),
            status: "admitted".into(),
            admitted_at: chrono::Utc::now(),
            retain_until: chrono::Utc::now(),
            admitted: true,
        };
        let (size, sha256) = journal::digest(&Prepared::inline("saved_search:x", &run.input)).unwrap();
        let reference = ResponseRef {
            resource_type: SNAPSHOT_RESOURCE_TYPE.into(),
            resource_id: run.id.to_string(),
            size,
            sha256: sha256.clone(),
        };
        assert_eq!(check_reference(&reference, "saved_search:x", &run), Ok(()));
        let other_run = ResponseRef { resource_id: Uuid::new_v4().to_string(), ..reference.clone() };
        assert!(check_reference(&other_run, "saved_search:x", &run).is_err());
        let other_input = ResponseRef { sha256: "0".repeat(64), ..reference.clone() };
        assert!(check_reference(&other_input, "saved_search:x", &run).is_err());
        let other_type = ResponseRef { resource_type: "blob".into(), ..reference.clone() };
        assert!(check_reference(&other_type, "saved_search:x", &run).is_err());
        assert!(check_reference(&reference, "saved_search:y", &run).is_err(), "another Run key");
    }

    #[test]
    fn the_admission_token_is_the_starts_own() {
        let org = Uuid::new_v4();
        assert_eq!(admission_token(org, "8:search-1:tick-1"), admission_token(org, "8:search-1:tick-1"));
        assert_ne!(admission_token(org, "8:search-1:tick-1"), admission_token(org, "8:search-1:tick-2"));
        assert_ne!(admission_token(org, "8:search-1:tick-1"), admission_token(Uuid::new_v4(), "8:search-1:tick-1"));
    }
}
