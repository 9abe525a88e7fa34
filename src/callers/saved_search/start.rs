//! The starter: its lease, checked against the scheduler's retries, and a
//! start from its claim to its answer (a prepared Run, or a replay).

use std::time::Duration;

use serde_json::{json, Value};
use tracing::Instrument;
use uuid::Uuid;

use super::error::{SavedSearchError, StartConfigError};
use super::identity::{
    admission_token, check_reference, run_key, start_key, Prepared, Start, SAVED_SEARCH_START_SCOPE,
};
use super::source::SnapshotSource;
use crate::callers::runs::{AdmittedRun, RunAdmission};
use crate::repo::{IdempotencyRepository, RunRepository};
use crate::service::{
    Begun, Effect, EffectDriver, IdempotencyService, LeaseOutlastsRetries, RequestHash, ResponseRef, RetryHorizon,
    Timing, DEFAULT_JOURNAL_DEADLINE, MAX_LEASE, MIN_LEASE, MIN_LEASE_MARGIN,
};

/// The spec's lease for input preparation.
pub const SAVED_SEARCH_LEASE: Duration = Duration::from_secs(30);

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

impl Start<'_> {
    /// Our preparation's fence moved on: another start holds the trigger
    /// now, and its ending is the one that counts. Nothing to do.
    pub(super) fn fence_lost(&self) -> Started {
        tracing::Span::current().record("outcome", "fence_lost");
        tracing::info!("the preparation's lease moved on to another start; this one does nothing more");
        Started::Superseded
    }
}

/// How a start ended, when it did not fail.
#[derive(Debug, Clone, PartialEq)]
#[must_use = "a start that was superseded started no Run from this call"]
pub enum Started {
    /// The trigger's Run: admitted by this start, or answered from an
    /// earlier one.
    Run(StartedRun),
    /// This start's preparation lost its fence: its lease passed while it
    /// froze the input, and another start took the trigger over, whose
    /// ending is the one that counts. No Run was started from this call's
    /// snapshot. Nothing to do: it is not an error and must not be retried
    /// (the start that holds the trigger admits its Run; a later start of
    /// the trigger answers it).
    Superseded,
}

impl Started {
    /// The Run, unless this start was superseded.
    pub fn into_run(self) -> Option<StartedRun> {
        match self {
            Started::Run(run) => Some(run),
            Started::Superseded => None,
        }
    }
}

/// The shortest preparation lease: 2 s, so that after the margin's floor
/// ([`MIN_LEASE_MARGIN`], 1 s) the freeze and its journal still have time.
pub const MIN_PREPARATION_LEASE: Duration = Duration::from_secs(2);

/// Refuses a lease outside [`MIN_PREPARATION_LEASE`] to the plane's
/// longest, or one still held at the scheduler's last retry.
fn check_lease(lease: Duration, horizon: RetryHorizon) -> Result<(), StartConfigError> {
    const _: () = assert!(MIN_PREPARATION_LEASE.as_millis() >= MIN_LEASE.as_millis());
    if !(MIN_PREPARATION_LEASE..=MAX_LEASE).contains(&lease) {
        return Err(StartConfigError::LeaseOutOfRange { lease, min: MIN_PREPARATION_LEASE, max: MAX_LEASE });
    }
    // The claim is the start's first call: nothing is spent before it.
    if lease >= horizon.until_last() {
        return Err(LeaseOutlastsRetries { lease, spent: Duration::ZERO, horizon: horizon.until_last() }.into());
    }
    Ok(())
}

/// Starts saved searches: claim, freeze, complete, admit (or, for a large
/// snapshot, claim, freeze, admit under the claim's fence, complete).
#[derive(Debug, Clone)]
pub struct SavedSearchStart<R, S, Q> {
    pub(super) driver: EffectDriver<R>,
    pub(super) runs: RunAdmission<Q>,
    pub(super) source: S,
    pub(super) lease: Duration,
    pub(super) horizon: RetryHorizon,
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

    /// The lease's parts: a margin of a sixth of the lease (at least
    /// [`MIN_LEASE_MARGIN`], at most 5 s), then the journal's deadline
    /// (two fifths of the rest, at most [`DEFAULT_JOURNAL_DEADLINE`]) and
    /// the freeze's timeout: 15 s, 10 s and 5 s of the spec's 30 s.
    fn timing(&self) -> Result<Timing, SavedSearchError> {
        let margin = (self.lease / 6).clamp(MIN_LEASE_MARGIN, Duration::from_secs(5));
        let rest = self.lease.saturating_sub(margin);
        let journal = (rest * 2 / 5).min(DEFAULT_JOURNAL_DEADLINE);
        Timing::new(rest - journal, journal, margin).map_err(|refused| SavedSearchError::Plane(refused.into()))
    }

    /// The scheduler's retry horizon the lease was checked against.
    pub fn retry_horizon(&self) -> RetryHorizon {
        self.horizon
    }

    /// Starts saved search `saved_search_id` for `trigger_id` (the schedule
    /// tick or the click that asked for it): freezes its input once, and
    /// admits one Run from it. Every repeat answers that Run; a start whose
    /// preparation was taken over by another answers
    /// [`Started::Superseded`] and does nothing more.
    pub async fn start(
        &self,
        organization_id: Uuid,
        saved_search_id: &str,
        trigger_id: &str,
    ) -> Result<Started, SavedSearchError> {
        let key = start_key(saved_search_id, trigger_id);
        let span = tracing::info_span!(
            "saved_search.start",
            %organization_id, idempotency.key_hash = %crate::telemetry::key_hash(&key),
            outcome = tracing::field::Empty,
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
    ) -> Result<Started, SavedSearchError> {
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
            request: None,
        };
        match self.driver.begin(&effect).await? {
            Begun::Held(held) => self.prepare(&start, saved_search_id, held).await,
            Begun::Replayed(answer) => self.replay(&start, answer.output).await.map(Started::Run),
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
    pub(super) fn started(
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

#[cfg(test)]
mod tests {
    use super::super::source::SnapshotError;
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
        for lease in [Duration::ZERO, MIN_LEASE, MIN_PREPARATION_LEASE - Duration::from_millis(1)] {
            assert_eq!(
                starter(horizon).unwrap().with_lease(lease).err(),
                Some(StartConfigError::LeaseOutOfRange { lease, min: MIN_PREPARATION_LEASE, max: MAX_LEASE })
            );
        }
        let shortest = starter(horizon).unwrap().with_lease(MIN_PREPARATION_LEASE).expect("the shortest");
        let timing = shortest.timing().expect("a timing the plane accepts");
        assert_eq!((timing.margin(), timing.lease()), (MIN_LEASE_MARGIN, MIN_PREPARATION_LEASE));
        let spec = starter(horizon).unwrap().timing().expect("the spec's lease");
        assert_eq!(
            (spec.effect(), spec.journal(), spec.margin()),
            (Duration::from_secs(15), Duration::from_secs(10), Duration::from_secs(5))
        );
        let forever = RetryHorizon::until_last_attempt(MAX_LEASE * 2);
        assert!(starter(forever).unwrap().with_lease(MAX_LEASE).is_ok());
        assert!(matches!(
            starter(forever).unwrap().with_lease(MAX_LEASE + Duration::from_millis(1)),
            Err(StartConfigError::LeaseOutOfRange { .. })
        ));
    }
}
