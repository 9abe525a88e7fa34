//! The road of a start that holds its claim, step by step: adopt a Run an
//! earlier holder admitted, freeze, keep the snapshot inline (then admit),
//! or admit it under the claim's fence and keep a reference to the Run.

use serde_json::Value;

use super::error::SavedSearchError;
use super::identity::{lease_delta, Prepared, Start, SNAPSHOT_RESOURCE_TYPE};
use super::source::{SnapshotError, SnapshotSource};
use super::start::{SavedSearchStart, Started};
use crate::callers::runs::{AdmissionError, AdmittedRun};
use crate::error::InvalidInput;
use crate::repo::{IdempotencyRepository, RunRepository};
use crate::service::journal;
use crate::service::{
    may_have_written, Answer, Held, Refused, ResourceRef, Settle, Settled, MAX_POLICY_RESPONSE_BYTES,
};

/// Where a step of the preparation leads.
enum Next<R> {
    /// On to the next step, still holding the claim.
    Go(Held<R>),
    /// The start is answered.
    Done(Started),
}

/// When our own claim started, by the database's clock: a Run admitted
/// before it is an earlier start's.
type ClaimedAt = chrono::DateTime<chrono::Utc>;

impl<R: IdempotencyRepository, S: SnapshotSource, Q: RunRepository> SavedSearchStart<R, S, Q> {
    /// We hold the claim: freeze, then keep the snapshot inline or by
    /// reference, and admit the Run. Freezing only reads, and no other start
    /// is answered on the strength of a claim in preparation (they are told
    /// it is in progress): a failed freeze releases.
    pub(super) async fn prepare(
        &self,
        start: &Start<'_>,
        saved_search_id: &str,
        held: Held<R>,
    ) -> Result<Started, SavedSearchError> {
        let held = match self.adopt_earlier_run(start, held).await? {
            Next::Go(held) => held,
            Next::Done(started) => return Ok(started),
        };
        let (held, snapshot) = self.freeze(start, saved_search_id, held).await?;
        // The database stamps claimed_at = lease_expires_at - the lease (in
        // whole milliseconds, rounded up): a Run admitted before it is an
        // earlier start's.
        let claimed_at = held.claim().lease_expires_at() - lease_delta(self.lease);
        let held = match self.keep_inline(start, held, &snapshot, claimed_at).await? {
            Next::Go(held) => held,
            Next::Done(started) => return Ok(started),
        };
        self.admit_fenced(start, held, &snapshot, claimed_at).await
    }

    /// A reclaimed preparation's earlier holder may have admitted a Run
    /// under this claim before it died: that Run's input is the snapshot,
    /// it is journaled as the claim's answer, and nothing is frozen again.
    async fn adopt_earlier_run(&self, start: &Start<'_>, held: Held<R>) -> Result<Next<R>, SavedSearchError> {
        if !held.claim().reclaimed() {
            return Ok(Next::Go(held));
        }
        match self.runs.find(start.organization_id, &start.run_key, Some(start.token)).await? {
            Some(run) => {
                tracing::info!(run_id = %run.id, "an earlier holder admitted the Run; journaling its input");
                self.journal_run(start, held, &run).await;
                // This start froze nothing: the input is an earlier one's.
                Ok(Next::Done(Started::Run(self.started(run, true, None))))
            }
            None => Ok(Next::Go(held)),
        }
    }

    /// Freezes the input under the claim, cut off at its timeout. A failed
    /// or null freeze, or a snapshot no Run could be admitted with (above
    /// 4 MiB, holding U+0000, nested too deep), releases the claim: it must
    /// not be journaled, or every replay would fail to admit it.
    async fn freeze(
        &self,
        start: &Start<'_>,
        saved_search_id: &str,
        held: Held<R>,
    ) -> Result<(Held<R>, Value), SavedSearchError> {
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
        if let Some(reason) = journal::unstorable(&snapshot, 0, MAX_POLICY_RESPONSE_BYTES) {
            let _ = held.settle(Settle::Release).await;
            let refused = match reason {
                journal::Unstorable::TooLarge { size, limit } => InvalidInput::ResponseTooLarge { size, limit },
                other => InvalidInput::UnstorableResponse(other),
            };
            return Err(SavedSearchError::Plane(refused.into()));
        }
        Ok((held, snapshot))
    }

    /// A first holder's snapshot that fits its claim completes the claim
    /// with it, then admits the Run from it. One the store refuses (above
    /// the limit, or the scope keeps less), and every reclaimed
    /// preparation's, goes on to be kept in the Run, under the fence.
    async fn keep_inline(
        &self,
        start: &Start<'_>,
        held: Held<R>,
        snapshot: &Value,
        claimed_at: ClaimedAt,
    ) -> Result<Next<R>, SavedSearchError> {
        if held.claim().reclaimed() {
            return Ok(Next::Go(held));
        }
        match held.journal_exact(Answer::success(Prepared::inline(&start.run_key, snapshot))).await {
            Ok(Settled::Journaled { .. }) => {
                // Admission is its own claim (agent.runs' unique start
                // key): a replay whose first attempt died after completing
                // admits the Run now, and a start after the snapshot claim
                // was swept finds the Run admitted then, with the input it
                // was admitted with.
                let run = self.runs.admit_as(start.organization_id, &start.run_key, snapshot, start.token).await?;
                Ok(Next::Done(Started::Run(self.started(run, false, Some(claimed_at)))))
            }
            Ok(Settled::LeaseMovedOn) => Ok(Next::Done(start.fence_lost())),
            Ok(other) => Err(SavedSearchError::NotJournaled { key: start.key.to_owned(), ending: other.as_str() }),
            Err(Refused { held, error }) => {
                tracing::info!(%error, "the snapshot does not fit its claim; keeping it in the Run");
                Ok(Next::Go(held))
            }
        }
    }

    /// Admits the Run with the snapshot as its input, only while our claim
    /// still holds, then journals a reference to it. A refusal before
    /// anything was written releases the claim, so the next start freezes
    /// again; any other failure may have admitted the Run and leaves the
    /// claim to its lease, whose next holder finds that Run.
    async fn admit_fenced(
        &self,
        start: &Start<'_>,
        held: Held<R>,
        snapshot: &Value,
        claimed_at: ClaimedAt,
    ) -> Result<Started, SavedSearchError> {
        tracing::Span::current().record("fenced", true);
        let admitted =
            self.runs.admit_fenced(start.organization_id, &start.run_key, snapshot, start.token, held.claim()).await;
        let run = match admitted {
            Ok(run) => run,
            // The claim is another start's now; ours writes nothing more.
            Err(AdmissionError::FenceLost { .. }) => return Ok(start.fence_lost()),
            Err(AdmissionError::Plane(error)) => {
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
        Ok(Started::Run(self.started(run, false, Some(claimed_at))))
    }

    /// Journals `run`'s input as the claim's answer: inline when it fits,
    /// recording nothing of the Run (the spec's claim holds the frozen input
    /// and the Run key only); else by reference to the Run, whose input is
    /// the snapshot's only home, with the Run as the claim's resource (the
    /// one thing of a Run a claim records, docs/differences.md says why). A
    /// journal that does not land leaves the claim to its lease; its next
    /// holder finds the Run and journals it.
    async fn journal_run(&self, start: &Start<'_>, held: Held<R>, run: &AdmittedRun) {
        let answer = Answer::success(Prepared::inline(&start.run_key, &run.input));
        let held = match held.journal_exact(answer.clone()).await {
            Ok(settled) => return record_journaled_run(run, settled),
            Err(Refused { held, .. }) => held,
        };
        let resource =
            ResourceRef { resource_type: SNAPSHOT_RESOURCE_TYPE.to_owned(), resource_id: run.id.to_string() };
        record_journaled_run(run, held.settle(Settle::Journal(answer.with_resource(Some(resource)))).await);
    }
}

/// Records how journaling an admitted Run's input as the claim's answer ended.
fn record_journaled_run(run: &AdmittedRun, settled: Settled) {
    match settled {
        Settled::Journaled { stand_in, .. } => {
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
