//! A drain through the plane's own queue functions: the batch read and
//! claimed in one transaction (`agent.idempotency_queue_take`), the effects
//! run, their endings journaled and their messages archived in another
//! (`agent.idempotency_queue_settle`). Two round trips plus the effects;
//! heartbeats (`agent.idempotency_queue_extend`) keep a long effect's
//! messages hidden with its lease.

use std::future::Future;
use std::sync::Arc;

use futures_util::StreamExt;
use serde_json::Value;
use tokio::time::Instant;
use uuid::Uuid;

use super::consumer::{Drained, MessageContext, QueueConsumer};
use crate::callers::tool::vendor_key;
use crate::error::Error;
use crate::repo::QueueMessage;
use crate::repo::{
    BatchClaims, CompletionArgs, IdempotencyRepository, PlaneQueues, QueueClaim, QueueEnding, QueueTakeCall,
    TakeOutcome, TakenItem,
};
use crate::service::{store_answer, Beater, Claim, Held, Settle, StoredAnswer};

/// A claim this drain holds: its message (none for re-driven work), the
/// ids of the message and its copies in the batch, and its payload.
struct Run<R> {
    message: Option<QueueMessage>,
    msg_ids: Vec<i64>,
    payload: Value,
    held: Held<R>,
}

impl<R: IdempotencyRepository + BatchClaims + PlaneQueues + 'static> QueueConsumer<R> {
    /// [`drain`](QueueConsumer::drain) through the plane's queue functions.
    pub(super) async fn drain_in_plane<F, Fut>(&self, process: &F) -> Result<Drained, Error>
    where
        F: Fn(Value, MessageContext) -> Fut,
        Fut: Future<Output = Settle>,
    {
        let options = &self.options;
        let repo = self.driver.service().repository();
        let started = Instant::now();
        let tokens: Vec<Uuid> = (0..options.batch_size).map(|_| Uuid::new_v4()).collect();
        let call = QueueTakeCall {
            queue: &options.queue,
            dead_letter_queue: &options.dead_letter_queue,
            organization_id: Some(options.organization_id),
            organizations: options.organizations.as_deref(),
            scope: &options.scope,
            lease: options.timing.lease(),
            lease_tokens: &tokens,
            max_reads: options.max_reads,
        };
        let items = repo.queue_take(&call).await?;
        let mut drained =
            Drained { read: items.iter().filter(|item| item.msg_id.is_some()).count(), ..Drained::default() };
        let mut runs = Vec::new();
        for item in &items {
            drained.archived += usize::from(item.archived);
            drained.dead_lettered += usize::from(item.dead_lettered);
            match item.outcome {
                TakeOutcome::Claimed | TakeOutcome::Reclaimed | TakeOutcome::Redriven => {
                    runs.push(self.hold(item, &items, started)?);
                }
                TakeOutcome::Completed if item.msg_id.is_some() => drained.replayed += 1,
                TakeOutcome::Completed => {}
                TakeOutcome::Processing => drained.left += 1,
                TakeOutcome::Malformed => {
                    tracing::warn!(queue = %options.queue, msg_id = item.msg_id, reason = item.reason.as_deref().unwrap_or(""), drop_reason = "malformed_message", "dead-lettered: no client can read this message");
                }
                TakeOutcome::Conflict => {
                    tracing::warn!(queue = %options.queue, msg_id = item.msg_id, idempotency.key_hash = %crate::telemetry::key_hash(item.key.as_deref().unwrap_or("")), drop_reason = "hash_mismatch", "dead-lettered: the key answers for another payload");
                }
                // A copy ends with its first message: counted with it below.
                TakeOutcome::Copy => {}
            }
        }

        let ran: Vec<(Run<R>, Settle)> = futures_util::stream::iter(runs)
            .map(|run| async move {
                let context = MessageContext {
                    message: run.message.clone(),
                    claim: run.held.claim().clone(),
                    vendor_key: vendor_key(run.held.claim().organization_id(), &options.scope, run.held.claim().key()),
                };
                let settle = match run.held.run(process(run.payload.clone(), context)).await {
                    Ok(settle) => settle,
                    Err(cut) => Settle::Unknown(cut.as_str()),
                };
                (run, settle)
            })
            .buffer_unordered(options.concurrency.max(1))
            .collect()
            .await;

        let limit = self.driver.service().response_limit();
        let stored: Vec<Option<StoredAnswer>> = ran
            .iter()
            .map(|(_, settle)| match settle {
                Settle::Journal(answer) => Some(store_answer(answer, limit, false)),
                Settle::Release | Settle::Unknown(_) => None,
            })
            .collect();
        // Only what changes something is sent: an unknown outcome is left
        // to its lease as it stands.
        let endings: Vec<(usize, QueueClaim<'_>, QueueEnding<'_>)> = ran
            .iter()
            .zip(&stored)
            .enumerate()
            .filter_map(|(index, ((run, settle), stored))| {
                let claim = run.held.claim();
                let fence = QueueClaim {
                    organization_id: claim.organization_id(),
                    claim_id: claim.id(),
                    lease_token: claim.lease_token(),
                    msg_ids: &run.msg_ids,
                };
                let ending = match (settle, stored) {
                    (Settle::Journal(_), Some(stored)) => QueueEnding::Journal(CompletionArgs {
                        response: Some(&stored.response),
                        resource_type: stored.resource.as_ref().map(|resource| resource.resource_type.as_str()),
                        resource_id: stored.resource.as_ref().map(|resource| resource.resource_id.as_str()),
                    }),
                    (Settle::Release, _) => QueueEnding::Release,
                    _ => return None,
                };
                Some((index, fence, ending))
            })
            .collect();
        let deadline = ran.iter().map(|(run, _)| run.held.ending_deadline()).min().unwrap_or_else(Instant::now);
        let sent: Vec<(QueueClaim<'_>, QueueEnding<'_>)> =
            endings.iter().map(|(_, claim, ending)| (*claim, *ending)).collect();
        let settled = if sent.is_empty() {
            Ok(Vec::new())
        } else {
            let asked = Instant::now();
            match tokio::time::timeout_at(
                deadline,
                repo.queue_settle(&options.queue, &options.dead_letter_queue, &sent),
            )
            .await
            {
                Ok(settled) => settled,
                // Cut in flight: the settle may have run (it is safe to ask
                // again; the messages come back and find what it journaled).
                Err(_cut) => Err(Error::Store(crate::postgrest::ClientError::DeadlineExceeded {
                    function: "idempotency_queue_settle",
                    deadline: deadline.saturating_duration_since(asked),
                    elapsed: asked.elapsed(),
                    attempts: 1,
                    in_flight: true,
                    last_error: None,
                })),
            }
        };
        let mut journaled = vec![None; ran.len()];
        match settled {
            Ok(settled) => {
                for ((index, _, _), settled) in endings.iter().zip(settled) {
                    journaled[*index] = Some(settled);
                }
            }
            Err(error) => {
                // Nothing is known to have ended: every message comes back,
                // and finds its claim journaled (replayed) or passed (run
                // again, under the same vendor key).
                tracing::warn!(queue = %options.queue, %error, items = endings.len(), "the settle failed; the batch's messages are left to come back");
            }
        }
        for (((run, settle), stored), settled) in ran.iter().zip(&stored).zip(journaled) {
            drained.ran += 1;
            if run.message.is_none() {
                drained.redriven += 1;
            }
            let copies = run.msg_ids.len().saturating_sub(1);
            match settled {
                Some(settled) if settled.journaled => {
                    drained.archived += usize::try_from(settled.archived).unwrap_or(0);
                    drained.dead_lettered += usize::from(settled.dead_lettered);
                    drained.replayed += copies;
                    let ok = matches!(settle, Settle::Journal(answer) if answer.ok) && stored.is_some();
                    if !ok {
                        drained.failed += 1;
                    }
                }
                _ => {
                    drained.failed += 1;
                    drained.left += run.msg_ids.len();
                }
            }
        }
        tracing::info!(
            queue = %options.queue, scope = %options.scope, read = drained.read, ran = drained.ran,
            replayed = drained.replayed, failed = drained.failed, archived = drained.archived,
            dead_lettered = drained.dead_lettered, left = drained.left, redriven = drained.redriven,
            "queue drained in the plane"
        );
        Ok(drained)
    }

    /// The claim `item` holds, its heartbeat (if the timing has one) made
    /// by the queue's, which keeps its messages hidden with its lease.
    fn hold(&self, item: &TakenItem, items: &[TakenItem], started: Instant) -> Result<Run<R>, Error> {
        let options = &self.options;
        let missing = |what: &str| {
            Error::Inconsistent(format!("idempotency_queue_take answered a claim to run without its {what}"))
        };
        let claim = Claim {
            id: item.id.ok_or_else(|| missing("id"))?,
            organization_id: item.organization_id.ok_or_else(|| missing("organization"))?,
            scope: options.scope.clone(),
            key: item.key.clone().ok_or_else(|| missing("key"))?,
            lease_token: item.lease_token.ok_or_else(|| missing("lease token"))?,
            lease_expires_at: item.lease_expires_at.ok_or_else(|| missing("lease end"))?,
            retain_until: item.retain_until.ok_or_else(|| missing("retention"))?,
            reclaimed: item.outcome != TakeOutcome::Claimed,
            attempt: match item.outcome {
                TakeOutcome::Claimed => Some(1),
                _ => item.attempt.and_then(|attempt| u32::try_from(attempt).ok()),
            },
            // A redelivery or a re-drive links its effect to the first trace.
            origin: item.traceparent.clone(),
        };
        let msg_ids: Vec<i64> = match item.msg_id {
            Some(first) => std::iter::once(first)
                .chain(items.iter().filter(|copy| copy.copy_of == Some(first)).filter_map(|copy| copy.msg_id))
                .collect(),
            None => Vec::new(),
        };
        let payload = match (&item.message, &item.payload) {
            (Some(Value::Object(message)), _) => message.get("payload").cloned().unwrap_or(Value::Null),
            (None, Some(payload)) => payload.clone(),
            _ => return Err(missing("message or payload")),
        };
        let beater = options.timing.heartbeat().map(|_| self.beater(&claim, &msg_ids));
        let held = self.driver.hold_with(claim, options.timing, started, beater);
        Ok(Run { message: message_of(item), msg_ids, payload, held })
    }

    /// One claim's heartbeat through `agent.idempotency_queue_extend`.
    fn beater(&self, claim: &Claim, msg_ids: &[i64]) -> Beater {
        let driver = self.driver.clone();
        let queue: Arc<str> = Arc::from(self.options.queue.as_str());
        let (organization_id, claim_id, lease_token) = (claim.organization_id(), claim.id(), claim.lease_token());
        let msg_ids: Arc<[i64]> = Arc::from(msg_ids);
        Beater(Arc::new(move |lease| {
            let (driver, queue, msg_ids) = (driver.clone(), queue.clone(), msg_ids.clone());
            Box::pin(async move {
                let claim = QueueClaim { organization_id, claim_id, lease_token, msg_ids: &msg_ids };
                let extended = driver.service().repository().queue_extend(&queue, lease, &[claim]).await?;
                Ok(extended.into_iter().next().flatten())
            })
        }))
    }
}

/// The message of an item to run, as the effect's context shows it.
fn message_of(item: &TakenItem) -> Option<QueueMessage> {
    Some(QueueMessage {
        msg_id: item.msg_id?,
        read_ct: item.read_ct.unwrap_or(0),
        enqueued_at: item.enqueued_at?,
        message: item.message.clone()?,
    })
}
