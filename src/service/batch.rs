//! Batches of effects: many claims in one round trip, each item then run
//! and ended exactly as a single effect is.
//!
//! [`EffectDriver::begin_many`] claims a whole batch in one call;
//! [`EffectDriver::settle_many`] writes the endings of many held claims
//! in one call per kind (journals, releases). Whenever a batch call fails,
//! each item falls back to its own [`Held::settle`], with every rule a
//! single ending has (retries within the deadline, a stand-in for an
//! answer the store refuses, a release whose answer was lost checked
//! against the row): one item never fails the others.
//! [`EffectDriver::drive_many`] puts the three together and reports each
//! item's ending, the failures listed as a queue wants them (the shape of
//! AWS Powertools' `batchItemFailures`).

use std::future::Future;

use futures_util::StreamExt;
use tokio::time::Instant;
use tracing::{field, Instrument};
use uuid::Uuid;

use super::answer::{self, Answer};
use super::driver::{Begun, EffectDriver};
use super::hash::RequestHash;
use super::held::{Held, LeftToLease, Settle, Settled, FIRST_ENDING_BACKOFF, MAX_ENDING_BACKOFF};
use super::idempotency::{record_ending, record_outcome, IdempotencyService};
use super::outcome::{Claim, ClaimOutcome, Completion, Ending};
use super::stored::{checked, decided, Stored};
use super::timing::Timing;
use super::written::may_have_written;
use super::{scope, validate};
use crate::error::Error;
use crate::repo::{
    BatchClaims, ClaimCall, ClaimFence, ClaimItem, ClaimManyCall, ClaimStatus, CompletionArgs, CompletionItem,
    IdempotencyRepository,
};

/// One effect of a batch: the key it is claimed under and what it carries.
#[derive(Debug, Clone, Copy)]
pub struct BatchItem<'a> {
    /// The idempotency key within the batch's scope.
    pub key: &'a str,
    /// The request's hash.
    pub request_hash: &'a RequestHash,
    /// The work the claim carries, for a re-drive (see
    /// [`Effect::request`](super::Effect::request)).
    pub request: Option<&'a serde_json::Value>,
}

/// A batch of effects: one organization, one scope, one timing.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// The tenant of every item.
    pub organization_id: Uuid,
    /// The scope of every item; one the policy table names.
    pub scope: &'a str,
    /// Each effect's timeout, its journal's deadline, and the lease they make.
    pub timing: Timing,
    /// The items: at most the repository's
    /// [`max_batch`](BatchClaims::max_batch).
    pub items: &'a [BatchItem<'a>],
}

/// How one item of a batch ended.
#[derive(Debug)]
pub enum ItemEnding {
    /// An earlier attempt's answer, replayed: the effect is done.
    Replayed(Answer),
    /// Another worker holds a live lease: the effect may be in flight.
    InFlight {
        /// When that lease passes, by the database clock.
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },
    /// The key answers for a different request: this item never runs.
    Conflict,
    /// This worker held the claim, ran the effect and ended it so.
    Ran(Settled),
}

impl ItemEnding {
    /// True when the item's effect is done and its answer journaled (by
    /// this worker or an earlier one): a queue may let the message go.
    pub fn is_done(&self) -> bool {
        match self {
            ItemEnding::Replayed(_) => true,
            ItemEnding::Ran(settled) => settled.is_journaled(),
            ItemEnding::InFlight { .. } | ItemEnding::Conflict => false,
        }
    }

    /// The item's answer, when it is done: the journaled or replayed one.
    pub fn answer(&self) -> Option<&Answer> {
        match self {
            ItemEnding::Replayed(answer) => Some(answer),
            ItemEnding::Ran(settled) => settled.journaled(),
            ItemEnding::InFlight { .. } | ItemEnding::Conflict => None,
        }
    }

    /// The ending's name, as logged: `replayed`, `in_flight`, `conflict`,
    /// or how a run was settled (`journaled`, `released`, `lease_moved_on`,
    /// `left_to_lease`).
    pub fn as_str(&self) -> &'static str {
        match self {
            ItemEnding::Replayed(_) => "replayed",
            ItemEnding::InFlight { .. } => "in_flight",
            ItemEnding::Conflict => "conflict",
            ItemEnding::Ran(settled) => settled.as_str(),
        }
    }
}

/// Each item's ending, in input order.
#[derive(Debug)]
#[must_use]
pub struct BatchReport {
    /// The endings, one per item, in input order.
    pub items: Vec<ItemEnding>,
}

impl BatchReport {
    /// The items that are not done (see [`ItemEnding::is_done`]), by index:
    /// what a queue must deliver again. The shape of AWS Powertools'
    /// `batchItemFailures`: never the whole batch failed for one item.
    pub fn failures(&self) -> Vec<usize> {
        self.items.iter().enumerate().filter(|(_, item)| !item.is_done()).map(|(index, _)| index).collect()
    }

    /// How many items this worker ran (whatever their ending).
    pub fn ran(&self) -> usize {
        self.items.iter().filter(|item| matches!(item, ItemEnding::Ran(_))).count()
    }

    /// How many items replayed an earlier answer.
    pub fn replayed(&self) -> usize {
        self.items.iter().filter(|item| matches!(item, ItemEnding::Replayed(_))).count()
    }
}

impl<R: IdempotencyRepository + BatchClaims> IdempotencyService<R> {
    /// Claims every item in one round trip, each decided as
    /// [`claim`](Self::claim) would decide it (see
    /// [`BatchClaims::claim_many`]), with the lease tokens the caller
    /// minted, one per item: a repeat with the same tokens after a lost
    /// answer answers each item's own claim again.
    pub(crate) async fn claim_many_as(&self, call: &ClaimManyCall<'_>) -> Result<Vec<ClaimOutcome>, Error> {
        let span = tracing::info_span!(
            "idempotency.claim_many",
            organization_id = %call.organization_id, idempotency.scope = call.scope,
            items = crate::telemetry::span_count(call.items.len()),
            lease_ms = i64::try_from(call.lease.as_millis()).unwrap_or(i64::MAX),
            claimed = field::Empty, replays = field::Empty,
            error.type = field::Empty, otel.status_code = field::Empty
        );
        async {
            scope::validate_scope(call.scope)?;
            validate::lease(call.lease)?;
            for item in call.items {
                validate::key(item.key)?;
            }
            let rows = self.repository().claim_many(call).await?;
            if rows.len() != call.items.len() {
                return Err(Error::Inconsistent(format!(
                    "a batch of {} claims answered {} rows",
                    call.items.len(),
                    rows.len()
                )));
            }
            let mut outcomes = Vec::with_capacity(rows.len());
            for (row, item) in rows.into_iter().zip(call.items) {
                let single = ClaimCall {
                    organization_id: call.organization_id,
                    scope: call.scope,
                    key: item.key,
                    request_hash: item.request_hash,
                    lease_token: item.lease_token,
                    lease: call.lease,
                    request: item.request,
                };
                let outcome = decided(row, &single)?;
                record_outcome("claim", call.scope, outcome.kind());
                outcomes.push(outcome);
            }
            let span = tracing::Span::current();
            let count = crate::telemetry::span_count;
            span.record("claimed", count(outcomes.iter().filter(|o| matches!(o, ClaimOutcome::Claimed(_))).count()));
            span.record(
                "replays",
                count(outcomes.iter().filter(|o| matches!(o, ClaimOutcome::Completed { .. })).count()),
            );
            Ok(outcomes)
        }
        .instrument(span.clone())
        .await
        .inspect_err(|error| crate::telemetry::record_error(&span, error.kind()))
    }

    /// Completes every claim of `organization_id` in one round trip, each as
    /// [`complete`](Self::complete) would: what each completed row stores,
    /// or `None` where the lease moved on. Any completion the service or the
    /// store refuses refuses them all.
    async fn complete_stored_many(
        &self,
        organization_id: Uuid,
        endings: &[(&Claim, Completion)],
    ) -> Result<Vec<Option<Stored>>, Error> {
        let mut elided = Vec::with_capacity(endings.len());
        for (_, completion) in endings {
            completion.validate()?;
            let response = completion.response.as_ref().filter(|v| !v.is_null());
            elided.push(match response {
                Some(response) => self.elide_if_large(response, completion.resource.as_ref())?,
                None => None,
            });
        }
        let items: Vec<CompletionItem<'_>> = endings
            .iter()
            .zip(&elided)
            .map(|((claim, completion), elided)| CompletionItem {
                fence: ClaimFence { claim_id: claim.id, lease_token: claim.lease_token },
                completion: CompletionArgs {
                    resource_type: completion.resource.as_ref().map(|r| r.resource_type.as_str()),
                    resource_id: completion.resource.as_ref().map(|r| r.resource_id.as_str()),
                    response: elided.as_ref().or(completion.response.as_ref().filter(|v| !v.is_null())),
                },
            })
            .collect();
        let rows = self.repository().complete_many(organization_id, &items).await?;
        let mut stored = Vec::with_capacity(rows.len());
        for (row, (claim, _)) in rows.into_iter().zip(endings) {
            let Some(record) = row else {
                record_ending("complete", &claim.scope, Ending::LeaseMovedOn);
                stored.push(None);
                continue;
            };
            let record = checked(record, claim.organization_id, &claim.scope, &claim.key, Some(claim.lease_token))?;
            if record.status != ClaimStatus::Completed || record.id != claim.id {
                return Err(Error::Inconsistent(format!("completing claim {} answered another row", claim.id)));
            }
            let hash = record.request_hash.clone();
            let answer = Stored::of(record.response, record.resource_type, record.resource_id);
            self.remember(claim.organization_id, &claim.scope, &claim.key, &hash, &answer);
            record_ending("complete", &claim.scope, Ending::Recorded);
            stored.push(Some(answer));
        }
        Ok(stored)
    }

    /// Releases every claim of `organization_id` in one round trip, each as
    /// [`release`](Self::release) would.
    async fn release_many(&self, organization_id: Uuid, claims: &[&Claim]) -> Result<Vec<Ending>, Error> {
        let fences: Vec<ClaimFence> =
            claims.iter().map(|claim| ClaimFence { claim_id: claim.id, lease_token: claim.lease_token }).collect();
        let released = self.repository().release_many(organization_id, &fences).await?;
        Ok(released
            .into_iter()
            .zip(claims)
            .map(|(released, claim)| {
                let ending = if released { Ending::Recorded } else { Ending::LeaseMovedOn };
                record_ending("release", &claim.scope, ending);
                ending
            })
            .collect())
    }
}

impl<R: IdempotencyRepository + BatchClaims> EffectDriver<R> {
    /// Claims every item of `batch` in one round trip and answers, per item
    /// in input order, what [`begin`](Self::begin) would: held (run it,
    /// then settle it), replayed, in flight, or a conflict. Each held
    /// claim's deadlines count from now. A failure whose outcome is unknown
    /// (a lost answer) is asked again with the same lease tokens, with
    /// backoff, until the effects' timeout: claims the first try made are
    /// then answered as this batch's own.
    pub async fn begin_many(&self, batch: &Batch<'_>) -> Result<Vec<Begun<R>>, Error> {
        let started = Instant::now();
        let until = started + batch.timing.effect();
        let tokens: Vec<Uuid> = batch.items.iter().map(|_| Uuid::new_v4()).collect();
        let items: Vec<ClaimItem<'_>> = batch
            .items
            .iter()
            .zip(&tokens)
            .map(|(item, token)| ClaimItem {
                key: item.key,
                request_hash: item.request_hash.as_str(),
                lease_token: *token,
                request: item.request,
            })
            .collect();
        let call = ClaimManyCall {
            organization_id: batch.organization_id,
            scope: batch.scope,
            lease: batch.timing.lease(),
            items: &items,
        };
        let mut backoff = FIRST_ENDING_BACKOFF;
        let outcomes = loop {
            let asked = match tokio::time::timeout_at(until, self.service().claim_many_as(&call)).await {
                Ok(asked) => asked,
                Err(_cut) => Err(cut_at(started)),
            };
            match asked {
                Err(error) if may_have_written(&error) && Instant::now() + backoff < until => {
                    tracing::info!(%error, backoff_ms = backoff.as_millis() as u64, "the batch's claims are unknown; asking again with the same tokens");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_ENDING_BACKOFF);
                }
                answered => break answered?,
            }
        };
        Ok(outcomes.into_iter().map(|outcome| self.begun(outcome, batch.timing, started)).collect())
    }

    /// Ends every held claim as its [`Settle`] says, answering each one's
    /// [`Settled`] in input order. The journals go in one round trip and
    /// the releases in another (per organization); an item settled
    /// [`Settle::Unknown`] writes nothing. When a batch call fails, each of
    /// its items is settled on its own instead, by [`Held::settle`] and its
    /// rules, so no item's ending depends on another's.
    pub async fn settle_many(&self, endings: Vec<(Held<R>, Settle)>) -> Vec<Settled> {
        let organization = endings.first().map(|(held, _)| held.claim.organization_id);
        if endings.len() < 2 || endings.iter().any(|(held, _)| Some(held.claim.organization_id) != organization) {
            let singles = endings.into_iter().map(|(held, settle)| held.settle(settle));
            return futures_util::future::join_all(singles).await;
        }
        let organization_id = organization.unwrap_or_default();
        let mut settled: Vec<Option<Settled>> = endings.iter().map(|_| None).collect();
        let mut journals = Vec::new();
        let mut releases = Vec::new();
        for (index, (held, settle)) in endings.into_iter().enumerate() {
            match settle {
                Settle::Journal(answer) => journals.push((index, held, answer)),
                Settle::Release => releases.push((index, held)),
                Settle::Unknown(reason) => {
                    let left = Settled::LeftToLease(LeftToLease::OutcomeUnknown(reason));
                    held.ended(&left);
                    settled[index] = Some(left);
                }
            }
        }
        let (journaled, released) = futures_util::future::join(
            self.journal_many(organization_id, journals),
            self.release_all(organization_id, releases),
        )
        .await;
        for (index, ending) in journaled.into_iter().chain(released) {
            settled[index] = Some(ending);
        }
        settled
            .into_iter()
            .map(|ending| {
                ending.unwrap_or(Settled::LeftToLease(LeftToLease::OutcomeUnknown("the batch lost track of this item")))
            })
            .collect()
    }

    /// Claims `batch`, runs each held item's `effect` (at most `concurrency`
    /// at once, each cut at its timeout as [`Held::run`] cuts it: a cut
    /// leaves the outcome unknown), and settles them all: each item ends
    /// journaled, released or left to its lease exactly as a single effect
    /// does. `effect` gets the item's index and its claim (whose key is the
    /// vendor's idempotency key) and answers how to end it. An error only
    /// when the batch could not be claimed at all.
    pub async fn drive_many<F, Fut>(
        &self,
        batch: &Batch<'_>,
        concurrency: usize,
        effect: F,
    ) -> Result<BatchReport, Error>
    where
        F: Fn(usize, Claim) -> Fut,
        Fut: Future<Output = Settle>,
    {
        let begun = self.begin_many(batch).await?;
        let mut items: Vec<Option<ItemEnding>> = Vec::with_capacity(begun.len());
        let mut held = Vec::new();
        for (index, begun) in begun.into_iter().enumerate() {
            items.push(match begun {
                Begun::Held(claim) => {
                    held.push((index, claim));
                    None
                }
                Begun::Replayed(answer) => Some(ItemEnding::Replayed(answer)),
                Begun::InFlight { lease_expires_at } => Some(ItemEnding::InFlight { lease_expires_at }),
                Begun::Conflict => Some(ItemEnding::Conflict),
            });
        }
        let effect = &effect;
        let ran: Vec<(usize, Held<R>, Settle)> = futures_util::stream::iter(held)
            .map(|(index, held)| async move {
                let settle = match held.run(effect(index, held.claim.clone())).await {
                    Ok(settle) => settle,
                    Err(cut) => Settle::Unknown(cut.as_str()),
                };
                (index, held, settle)
            })
            .buffer_unordered(concurrency.max(1))
            .collect()
            .await;
        let (indices, endings): (Vec<usize>, Vec<(Held<R>, Settle)>) =
            ran.into_iter().map(|(index, held, settle)| (index, (held, settle))).unzip();
        for (index, settled) in indices.into_iter().zip(self.settle_many(endings).await) {
            items[index] = Some(ItemEnding::Ran(settled));
        }
        let items = items
            .into_iter()
            .map(|item| {
                item.unwrap_or(ItemEnding::Ran(Settled::LeftToLease(LeftToLease::OutcomeUnknown(
                    "the batch lost track of this item",
                ))))
            })
            .collect();
        Ok(BatchReport { items })
    }

    /// The journals of `journals`, in one round trip, or each on its own
    /// when that call fails.
    async fn journal_many(
        &self,
        organization_id: Uuid,
        journals: Vec<(usize, Held<R>, Answer)>,
    ) -> Vec<(usize, Settled)> {
        if journals.is_empty() {
            return Vec::new();
        }
        let limit = self.service().response_limit();
        let stored: Vec<answer::StoredAnswer> =
            journals.iter().map(|(_, _, answer)| answer::store(answer, limit, false)).collect();
        let deadline = journals.iter().map(|(_, held, _)| held.ending_deadline).min().unwrap_or_else(Instant::now);
        let answered = {
            let completions: Vec<(&Claim, Completion)> = journals
                .iter()
                .zip(&stored)
                .map(|((_, held, _), stored)| {
                    let completion =
                        Completion { response: Some(stored.response.clone()), resource: stored.resource.clone() };
                    (&held.claim, completion)
                })
                .collect();
            let batch = self.service().complete_stored_many(organization_id, &completions);
            if Instant::now() < deadline {
                tokio::time::timeout_at(deadline, batch).await.ok()
            } else {
                None
            }
        };
        match answered {
            Some(Ok(rows)) => journals
                .into_iter()
                .zip(rows)
                .zip(stored)
                .map(|(((index, held, _), row), stored)| {
                    let settled = match row {
                        Some(row) => Settled::Journaled {
                            stand_in: stored.stand_in,
                            answer: Answer::from_stored(row.response, row.resource, row.response_ref),
                        },
                        None => Settled::LeaseMovedOn,
                    };
                    held.ended(&settled);
                    (index, settled)
                })
                .collect(),
            failed => {
                if let Some(Err(error)) = &failed {
                    tracing::info!(%error, items = journals.len(), "the batch journal failed; journaling each item on its own");
                }
                let singles = journals
                    .into_iter()
                    .map(|(index, held, answer)| async move { (index, held.settle(Settle::Journal(answer)).await) });
                futures_util::future::join_all(singles).await
            }
        }
    }

    /// The releases of `releases`, in one round trip, or each on its own
    /// when that call fails (checked against the row when the batch may
    /// have landed, as a single release whose answer was lost is).
    async fn release_all(&self, organization_id: Uuid, releases: Vec<(usize, Held<R>)>) -> Vec<(usize, Settled)> {
        if releases.is_empty() {
            return Vec::new();
        }
        let deadline = releases.iter().map(|(_, held)| held.ending_deadline).min().unwrap_or_else(Instant::now);
        let answered = {
            let claims: Vec<&Claim> = releases.iter().map(|(_, held)| &held.claim).collect();
            let batch = self.service().release_many(organization_id, &claims);
            if Instant::now() < deadline {
                Some(tokio::time::timeout_at(deadline, batch).await)
            } else {
                None
            }
        };
        let may_have_landed = match answered {
            Some(Ok(Ok(endings))) => {
                return releases
                    .into_iter()
                    .zip(endings)
                    .map(|((index, held), ending)| {
                        let settled = match ending {
                            Ending::Recorded => Settled::Released,
                            Ending::LeaseMovedOn => Settled::LeaseMovedOn,
                        };
                        held.ended(&settled);
                        (index, settled)
                    })
                    .collect();
            }
            Some(Ok(Err(error))) => {
                tracing::info!(%error, items = releases.len(), "the batch release failed; releasing each item on its own");
                may_have_written(&error)
            }
            // Cut at the deadline: it may have landed.
            Some(Err(_elapsed)) => true,
            None => false,
        };
        let singles = releases.into_iter().map(|(index, held)| async move {
            let settled = held.release_after(may_have_landed).await;
            held.ended(&settled);
            (index, settled)
        });
        futures_util::future::join_all(singles).await
    }
}

/// A batch claim cut at its deadline: a request in flight, whose outcome
/// is unknown (transient, as the client's own deadline is).
fn cut_at(started: Instant) -> Error {
    let elapsed = started.elapsed();
    Error::Store(crate::postgrest::ClientError::DeadlineExceeded {
        function: "idempotency_claim_many",
        deadline: elapsed,
        elapsed,
        attempts: 1,
        in_flight: true,
        last_error: None,
    })
}
