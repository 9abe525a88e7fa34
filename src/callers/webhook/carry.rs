//! The road one delivery takes in a task of its own, past the answer when
//! it must: claim, process (retrying what may succeed), journal.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;
use tokio::time::Instant;
use uuid::Uuid;

use super::ack::{drop_delivery, too_large, unavailable, Ack, DropCounters, DropReason, FAILED_ACK_ERROR_CHARS};
use super::delivery::ProcessingError;
use crate::error::{Error, InvalidInput};
use crate::postgrest::codes;
use crate::repo::IdempotencyRepository;
use crate::service::{
    may_have_written, Answer, Attempt, Begun, Cut, Effect, EffectDriver, Held, RequestHash, Settle, Timing,
};

/// The first wait before processing is tried again after a retryable
/// failure; doubled each time up to [`MAX_PROCESSING_BACKOFF`].
const FIRST_PROCESSING_BACKOFF: Duration = Duration::from_millis(100);

/// The longest wait between two tries of processing.
const MAX_PROCESSING_BACKOFF: Duration = Duration::from_secs(2);

/// One delivery, owned, for the task that carries it past the answer.
pub(super) struct Carried<R> {
    pub(super) driver: EffectDriver<R>,
    pub(super) drops: Arc<DropCounters>,
    pub(super) timing: Timing,
    pub(super) organization_id: Uuid,
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) hash: RequestHash,
    /// The delivery's body as its claim stores it, for a re-drive.
    pub(super) request: Value,
    /// Set once the gate holds the claim: an answer cut by the deadline is
    /// then [`Ack::Accepted`], else [`Ack::Retry`].
    pub(super) held: Arc<AtomicBool>,
}

impl<R: IdempotencyRepository + 'static> Carried<R> {
    /// Claims, processes and journals one delivery, sending the answer on
    /// `answer` as soon as it is known (the caller may have stopped waiting).
    pub(super) async fn carry<F, Fut>(self, process: F, answer: oneshot::Sender<Ack>)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ProcessingError>> + Send + 'static,
    {
        let mut answer = Some(answer);
        // Sends the answer, once: false when the caller had answered
        // already (its deadline came), so a drop it never heard is not counted.
        let mut say = |ack: Ack| match answer.take() {
            Some(answer) => answer.send(ack).is_ok(),
            None => false,
        };
        let effect = Effect {
            organization_id: self.organization_id,
            scope: &self.scope,
            key: &self.key,
            request_hash: &self.hash,
            timing: self.timing,
            request: Some(&self.request),
        };
        let held = match self.claim(&effect, &mut say).await {
            Some(held) => held,
            None => return,
        };
        self.held.store(true, Ordering::SeqCst);
        let (settle, dropped) = process_to_an_answer(&held, &process).await;
        let left = matches!(settle, Settle::Unknown(_));
        let failed = match &settle {
            Settle::Journal(answer) if !answer.ok => {
                Some(answer.error.as_deref().unwrap_or("failed").chars().take(FAILED_ACK_ERROR_CHARS).collect())
            }
            _ => None,
        };
        let settled = held.settle(settle).await;
        if !settled.is_journaled() && !left {
            tracing::error!(
                ending = settled.as_str(),
                "processed, but the answer is not journaled; the vendor is not asked to redeliver"
            );
        }
        // A failure journaled with its reason is counted whether or not the
        // vendor still hears the answer: it is the event's record. An event
        // left for a re-drive is held by the plane with its body: accepted.
        say(match (dropped, failed) {
            (None, _) if left => Ack::Accepted,
            (None, Some(error)) => Ack::Failed { error },
            (None, None) => Ack::Processed,
            (Some(reason), _) => drop_delivery(&self.drops, reason),
        });
    }

    /// Claims the delivery: [asks](Self::ask) the plane, then
    /// [decides](decide) by its answer. `None` when the delivery was
    /// answered without a claim of ours.
    async fn claim(&self, effect: &Effect<'_>, say: &mut impl FnMut(Ack) -> bool) -> Option<Held<R>> {
        let (begun, answered) = self.ask(effect, say).await;
        decide(begun, answered, say)
    }

    /// Asks for the claim as one attempt, asking again with the same lease
    /// token after an answer that did not come (a claim the database may
    /// have made), while there would be time left to process: the vendor
    /// is answered 503 meanwhile. The plane's last answer, and whether the
    /// vendor was answered already.
    async fn ask(&self, effect: &Effect<'_>, say: &mut impl FnMut(Ack) -> bool) -> (Result<Begun<R>, Error>, bool) {
        let attempt = Attempt::new();
        // Ask while an answer could still be journaled before the lease
        // passes: a claim confirmed after the processing timeout never
        // starts processing (Cut::NotStarted), and the event waits, with
        // the body its claim stored, for a re-drive.
        let ask_until = attempt.started() + self.timing.effect() + self.timing.journal() / 2;
        let begun = match tokio::time::timeout_at(ask_until, self.driver.begin_as(effect, &attempt)).await {
            Ok(begun) => begun,
            Err(_cut) => Err(crate::service::asking_cut(&attempt)),
        };
        match &begun {
            Err(error) if may_have_written(error) => {
                // The vendor hears now; the gate keeps asking.
                say(unavailable(error));
                (self.driver.begin_until(effect, &attempt, ask_until).await, true)
            }
            _ => (begun, false),
        }
    }
}

/// What the claim's answer leads to: the claim is ours to carry
/// (`Some`), or the delivery is answered as a duplicate, a hash mismatch,
/// an invalid delivery or a retry. Once `answered` (503), a late answer
/// that holds no claim of ours is no drop of this delivery.
fn decide<R>(begun: Result<Begun<R>, Error>, answered: bool, say: &mut impl FnMut(Ack) -> bool) -> Option<Held<R>> {
    match begun {
        Ok(Begun::Held(held)) => Some(held),
        // Answered 503 already: a late answer that holds no claim of ours
        // is no drop of this delivery, and nothing is left to do.
        Ok(late) if answered => {
            tracing::info!(
                outcome = late_outcome(&late),
                "the claim asked again holds no claim of ours; nothing to carry"
            );
            None
        }
        Ok(Begun::Replayed(_)) => {
            tracing::Span::current().record("replayed", true);
            say_drop(say, DropReason::Duplicate);
            None
        }
        Ok(Begun::InFlight { .. }) => {
            say_drop(say, DropReason::Duplicate);
            None
        }
        Ok(Begun::Conflict) => {
            say_drop(say, DropReason::HashMismatch);
            None
        }
        // Only the delivery's own id can make it unclaimable for good;
        // any other refusal is the gate's configuration, and answering
        // 503 keeps the delivery until that is fixed.
        Err(Error::Invalid(
            refused @ (InvalidInput::EmptyKey | InvalidInput::KeyTooLong { .. } | InvalidInput::KeyHasNul),
        )) => {
            tracing::warn!(%refused, "the delivery id cannot be claimed");
            say_drop(say, DropReason::InvalidDelivery);
            None
        }
        Err(error) if stores_no_such_delivery(&error) => {
            say(too_large(&error));
            None
        }
        Err(error) => {
            say(unavailable(&error));
            None
        }
    }
}

/// Whether the plane refused the claim for the delivery it carries: above
/// the scope's `max_request_bytes`, or nested too deep.
fn stores_no_such_delivery(error: &Error) -> bool {
    matches!(error, Error::Store(store) if matches!(store.code(), Some(codes::REQUEST_TOO_LARGE | codes::REQUEST_TOO_DEEP)))
}

/// Answers a drop for `reason`; the gate counts it when the answer is
/// given (a claim that answered after the deadline is no drop the vendor
/// heard).
fn say_drop(say: &mut impl FnMut(Ack) -> bool, reason: DropReason) {
    if !say(Ack::Dropped(reason)) {
        tracing::info!(drop_reason = reason.as_str(), "the claim answered after the deadline; no drop was answered");
    }
}

/// What a claim answered, for the log.
fn late_outcome<R>(begun: &Begun<R>) -> &'static str {
    match begun {
        Begun::Held(_) => "held",
        Begun::Replayed(_) => "completed",
        Begun::InFlight { .. } => "processing",
        Begun::Conflict => "conflict",
    }
}

/// Why a claim whose processing kept failing with retryable failures is
/// left to its lease: a re-drive carries it on.
const LEFT_FOR_REDRIVE: &str = "processing kept failing; left for a re-drive";

/// Runs `process` under `held` until it answers, trying again after a
/// retryable failure while its timeout allows: the ending, and the drop
/// reason when that ending is a failure the gate journals. An ending of
/// [`Settle::Unknown`] leaves the event (and the body its claim carries) to
/// its lease, for a re-drive or a redelivery after it to carry on: when
/// processing kept failing with retryable failures, or when another worker
/// took the claim over.
pub(super) async fn process_to_an_answer<R, F, Fut>(held: &Held<R>, process: &F) -> (Settle, Option<DropReason>)
where
    R: IdempotencyRepository,
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Value, ProcessingError>>,
{
    let mut backoff = FIRST_PROCESSING_BACKOFF;
    loop {
        match held.run(process()).await {
            Ok(Ok(output)) => return (Settle::Journal(Answer::success(output)), None),
            Ok(Err(failure)) if !failure.retryable => {
                tracing::warn!(error = %failure.message, "processing failed; the failure is the delivery's answer");
                return (Settle::Journal(Answer::failure(failure.message, Value::Null)), None);
            }
            Ok(Err(failure)) => {
                if Instant::now() + backoff < held.effect_deadline() {
                    tracing::info!(error = %failure.message, backoff_ms = backoff.as_millis() as u64, "processing failed without an effect; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_PROCESSING_BACKOFF);
                    continue;
                }
                // Journaling this failure would answer every later delivery
                // with it, even once the downstream is back. The event and
                // its body stay in the plane instead: a re-drive takes it
                // over once the lease passes (that wait is its backoff), and
                // its scope's max_attempts makes it a dead letter at last.
                tracing::warn!(
                    error = %failure.message,
                    claim_id = %held.claim().id(),
                    outcome = "left_for_redrive",
                    "processing kept failing until its timeout; the event is left to its lease for a re-drive"
                );
                return (Settle::Unknown(LEFT_FOR_REDRIVE), None);
            }
            Err(Cut::FenceLost) => {
                // Another worker (a re-driver, or a redelivery after our lease
                // passed) carries the event now: its ending is the one that counts.
                tracing::warn!("processing was stopped: the claim was taken over; its new holder ends it");
                return (Settle::Unknown("the claim was taken over by another worker"), None);
            }
            Err(Cut::LeaseUnconfirmed) => {
                // The plane did not confirm the lease: processing was told to
                // stop before another worker could take the event over; the
                // event and its body wait for whoever holds it next.
                tracing::warn!(
                    outcome = "left_for_redrive",
                    "processing was stopped: the lease could not be confirmed; the event is left to its lease"
                );
                return (Settle::Unknown("the lease could not be confirmed; processing was stopped"), None);
            }
            Err(Cut::NotStarted) => {
                // Nothing ran (the claim answered after the timeout, or the
                // lease could not be confirmed): the event and its body wait
                // for a re-drive.
                tracing::warn!(outcome = "left_for_redrive", "processing never started");
                return (Settle::Unknown("processing never started"), None);
            }
            Err(cut) => {
                tracing::error!(%cut, "processing was cut; what it did is unknown, and that is journaled");
                let error = match cut {
                    Cut::TimedOut => "processing_timed_out",
                    Cut::Panicked | Cut::FenceLost | Cut::NotStarted | Cut::LeaseUnconfirmed => "processing_panicked",
                };
                return (Settle::Journal(Answer::failure(error, Value::Null)), Some(DropReason::ProcessingAborted));
            }
        }
    }
}
