//! Re-drive: the gate takes over events whose worker died after it claimed
//! them (and, often, after a delivery of them was answered 2xx), and runs
//! them through the same `process` with the same endings.
//!
//! Every delivery the gate claims carries its body ([`stored`](super::stored)),
//! so any worker can finish it. Run [`WebhookGate::redrive`] from whatever
//! runs on a schedule: a pg_cron job calling the function's re-drive route,
//! `idem redrive`, or a loop in a long-running worker.

use std::future::Future;

use futures_util::future::join_all;
use serde_json::Value;
use tracing::Instrument;
use uuid::Uuid;

use super::ack::{drop_delivery, DropReason};
use super::carry::process_to_an_answer;
use super::delivery::ProcessingError;
use super::gate::WebhookGate;
use super::stored::body_of;
use crate::error::Error;
use crate::repo::{IdempotencyRepository, OrphanedWork, ProviderJobRepository};
use crate::service::{Held, Redriven, Settle, Settled};

/// An event handed to this worker by a re-drive: what its first delivery
/// carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redelivery {
    /// The tenant.
    pub organization_id: Uuid,
    /// The vendor scope, e.g. `webhook.stripe`.
    pub scope: String,
    /// The vendor's delivery (event) id.
    pub delivery_id: String,
    /// The body exactly as first delivered (and verified).
    pub body: Vec<u8>,
    /// Which attempt this is: 2 for the first re-drive.
    pub attempt: u32,
}

/// What one re-drive did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedriveReport {
    /// Orphans taken over and run through `process`.
    pub redriven: u64,
    /// Of those, journaled (processed, or failed for good).
    pub journaled: u64,
    /// Orphans journaled as dead letters instead (their scope's
    /// `max_attempts` reached).
    pub dead_lettered: u64,
    /// Taken over but not journaled (processing kept failing with retryable
    /// failures, the claim was taken over again, the journal did not land,
    /// or a claim this gate did not store): re-driven again, as its next
    /// attempt, once the lease this re-drive gave it passes.
    pub left: u64,
}

impl<R: IdempotencyRepository + OrphanedWork + 'static, J: ProviderJobRepository> WebhookGate<R, J> {
    /// Takes over up to `bound` orphaned events of `scope` (or a family,
    /// `webhook.*`) and runs each through `process`, concurrently, with the
    /// endings a delivery gets: retried in process while retryable within
    /// the processing timeout, journaled, kept alive by heartbeats when the
    /// gate has them. An event past its scope's `max_attempts` is journaled
    /// as a dead letter (counted as [`DropReason::DeadLettered`]). A bound
    /// above the server's row cap is refused before any request.
    pub async fn redrive<F, Fut>(&self, scope: &str, bound: u64, process: F) -> Result<RedriveReport, Error>
    where
        F: Fn(Redelivery) -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        self.redrive_of(None, scope, bound, process).await
    }

    /// [`redrive`](Self::redrive), of `organization_id`'s orphans alone when
    /// given: for a receiver that serves one tenant and must leave the
    /// others' events to their own receivers.
    pub async fn redrive_of<F, Fut>(
        &self,
        organization_id: Option<Uuid>,
        scope: &str,
        bound: u64,
        process: F,
    ) -> Result<RedriveReport, Error>
    where
        F: Fn(Redelivery) -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        let span = tracing::info_span!("webhook.redrive", idempotency.scope = scope, bound, organization_id = ?organization_id);
        async {
            let taken = self.driver().redrive(scope, bound, organization_id, self.timing()).await?;
            let mut report = RedriveReport::default();
            let mut running = Vec::new();
            for redriven in taken {
                match redriven {
                    Redriven::DeadLettered { .. } => {
                        report.dead_lettered += 1;
                        drop_delivery(self.drops(), DropReason::DeadLettered);
                    }
                    Redriven::Held { held, request, attempt } => {
                        report.redriven += 1;
                        running.push(self.carry_again(held, request, attempt, &process));
                    }
                }
            }
            for journaled in join_all(running).await {
                if journaled {
                    report.journaled += 1;
                } else {
                    report.left += 1;
                }
            }
            tracing::info!(
                redriven = report.redriven,
                journaled = report.journaled,
                dead_lettered = report.dead_lettered,
                left = report.left,
                "re-drive done"
            );
            Ok(report)
        }
        .instrument(span)
        .await
    }

    /// Runs one re-driven event through `process` and settles it; true when
    /// its ending was journaled.
    async fn carry_again<F, Fut>(&self, held: Held<R>, request: Value, attempt: u32, process: &F) -> bool
    where
        F: Fn(Redelivery) -> Fut,
        Fut: Future<Output = Result<Value, ProcessingError>>,
    {
        let claim = held.claim();
        let Some(body) = body_of(&request) else {
            tracing::error!(claim_id = %claim.id(), "a re-driven claim carries work this gate did not store; left to its lease");
            let _ = held.settle(Settle::Unknown("the claim carries work this gate did not store")).await;
            return false;
        };
        let redelivery = Redelivery {
            organization_id: claim.organization_id(),
            scope: claim.scope().to_owned(),
            delivery_id: claim.key().to_owned(),
            body,
            attempt,
        };
        let (settle, dropped) = process_to_an_answer(&held, &|| process(redelivery.clone())).await;
        let settled = held.settle(settle).await;
        if let (Some(reason), Settled::Journaled { .. }) = (dropped, &settled) {
            drop_delivery(self.drops(), reason);
        }
        settled.is_journaled()
    }
}
