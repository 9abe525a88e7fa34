//! The webhook gate's endings when the store loses or delays answers, on
//! the in-memory repository wrapped in [`Faulty`]: a claim or a journal
//! whose answer was lost after it committed is carried to one processing
//! and one journal. (The random run on the real stack is in
//! `stack::callers_under_faults`.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::callers::webhook::{
    Ack, Delivery, DropReason, ProcessingError, ProviderJobs, RetryReason, WebhookGate,
};
use idempotency_plane::repo::{ClaimStatus, IdempotencyRecord};
use idempotency_plane::{IdempotencyRepository, IdempotencyService, MemoryRepository};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::faults::{Fault, Faulty, Op};
use crate::support::{within, WAIT};

const PROCESSING_TIMEOUT: Duration = Duration::from_millis(500);

type Gate = WebhookGate<Faulty<MemoryRepository>, MemoryRepository>;

/// A gate with a 500 ms processing timeout and a 1 s journal deadline.
fn gate(faulty: &Faulty<MemoryRepository>) -> Gate {
    WebhookGate::new(IdempotencyService::new(faulty.clone()), ProviderJobs::new(MemoryRepository::new()))
        .with_processing_timeout(PROCESSING_TIMEOUT)
        .and_then(|gate| gate.with_journal_deadline(Duration::from_secs(1)))
        .expect("a gate")
}

fn delivery(org: Uuid) -> Delivery<'static> {
    Delivery { organization_id: org, scope: "webhook.nylas", delivery_id: "d-1", body: b"{\"id\":\"m-1\"}" }
}

/// Processing that counts its runs and stores the event.
fn counted(runs: &Arc<AtomicUsize>) -> impl Fn() -> std::future::Ready<Result<Value, ProcessingError>> + Send + Sync {
    let runs = runs.clone();
    move || {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(json!("stored")))
    }
}

/// The row once it is completed; panics naming `what` after [`WAIT`].
async fn completed(faulty: &Faulty<MemoryRepository>, org: Uuid, what: &str) -> IdempotencyRecord {
    let poll = async {
        loop {
            match faulty.get(org, "webhook.nylas", "d-1").await.expect("a read") {
                Some(row) if row.status == ClaimStatus::Completed => return row,
                _ => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
    };
    within(WAIT, what, poll).await
}

#[tokio::test]
async fn a_claim_whose_answer_is_lost_is_a_503_asked_again_as_the_same_attempt_and_processed_once() {
    let faulty = Faulty::new(MemoryRepository::new());
    let (gate, org, runs) = (gate(&faulty), Uuid::new_v4(), Arc::new(AtomicUsize::new(0)));
    faulty.once(Op::Claim, Fault::LoseAnswer);
    // The plane could not decide in time: the vendor is asked to redeliver,
    // and the gate asks again in the background as the same attempt.
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Retry(RetryReason::PlaneUnavailable));
    let row = completed(&faulty, org, "the carried claim's journal").await;
    assert_eq!(row.response, Some(json!({"ok": true, "output": "stored"})));
    assert_eq!(faulty.reached(Op::Claim), 2, "the claim whose answer was lost, and the same attempt again");
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_journal_whose_answer_is_lost_is_asked_again_and_a_redelivery_is_a_duplicate() {
    let faulty = Faulty::new(MemoryRepository::new());
    let (gate, org, runs) = (gate(&faulty), Uuid::new_v4(), Arc::new(AtomicUsize::new(0)));
    faulty.once(Op::Complete, Fault::LoseAnswer);
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Processed);
    assert_eq!(faulty.reached(Op::Complete), 2);
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(completed(&faulty, org, "the journal").await.response, Some(json!({"ok": true, "output": "stored"})));
}

#[tokio::test]
async fn a_claim_slower_than_the_answer_deadline_is_a_503_and_is_still_processed_once() {
    let faulty = Faulty::new(MemoryRepository::new());
    let gate = gate(&faulty).with_deadline(Duration::from_millis(100));
    let (org, runs) = (Uuid::new_v4(), Arc::new(AtomicUsize::new(0)));
    faulty.once(Op::Claim, Fault::DelayBefore(Duration::from_millis(300)));
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Retry(RetryReason::PlaneUnavailable));
    completed(&faulty, org, "the carried claim's journal").await;
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A claim whose answer is lost late (here after 450 of the 500 ms of
/// processing time): the gate keeps asking past the processing timeout,
/// while an answer could still be journaled before the lease passes, so the
/// vendor's redelivery, which meets the claim and is acknowledged as a
/// duplicate, loses nothing: the event is processed, or its failure
/// journaled with a drop reason.
#[tokio::test]
async fn an_event_acknowledged_as_a_duplicate_of_a_claim_whose_answer_was_lost_late_is_still_carried_to_a_journal() {
    let faulty = Faulty::new(MemoryRepository::new());
    let (gate, org, runs) = (gate(&faulty), Uuid::new_v4(), Arc::new(AtomicUsize::new(0)));
    faulty.once(Op::Claim, Fault::LoseAnswerAfter(Duration::from_millis(450)));
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Retry(RetryReason::PlaneUnavailable));
    assert_eq!(gate.handle(delivery(org), counted(&runs)).await, Ack::Dropped(DropReason::Duplicate));
    let row = completed(&faulty, org, "the acknowledged event processed, or its failure journaled").await;
    let response = row.response.expect("a response");
    assert!(
        runs.load(Ordering::SeqCst) == 1 || gate.drops().get(DropReason::ProcessingAborted) == 1,
        "processed once, or its failure journaled with a drop reason: {response}"
    );
}

/// With heartbeats, a holder that waited between runs must confirm its
/// lease before the next one; when every beat fails until the effect's
/// deadline, the effect never starts (`Cut::NotStarted`), nothing is
/// written, and the claim (with the work it carries) is left to its lease
/// for a re-drive.
#[tokio::test]
async fn beats_that_fail_until_the_deadline_never_start_the_effect_and_leave_the_claim_to_its_lease() {
    use idempotency_plane::service::{Begun, Cut, Effect, EffectDriver, Settle, Timing};
    let faulty = Faulty::new(MemoryRepository::new());
    let driver = EffectDriver::new(IdempotencyService::new(faulty.clone()));
    let timing = Timing::new(Duration::from_secs(4), Duration::from_secs(1), Duration::from_secs(1))
        .and_then(|timing| timing.with_heartbeats(Duration::from_secs(3)))
        .expect("a timing");
    let (org, hash, work) = (Uuid::new_v4(), idempotency_plane::RequestHash::of_json(&json!(1)), json!({"n": 1}));
    let effect = Effect {
        organization_id: org,
        scope: "webhook.nylas",
        key: "k",
        request_hash: &hash,
        timing,
        request: Some(&work),
    };
    let Begun::Held(held) = driver.begin(&effect).await.expect("begin") else { panic!("claimed") };
    // The plane stops answering heartbeats while the holder waits.
    faulty.set(Op::Extend, Fault::Unavailable);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let started = std::sync::atomic::AtomicBool::new(false);
    let ran = held.run(async { started.store(true, Ordering::SeqCst) }).await;
    assert_eq!(ran, Err(Cut::NotStarted));
    assert!(!started.load(Ordering::SeqCst), "the effect never started");
    assert!(faulty.injected(Op::Extend) >= 1, "it tried to confirm the lease, and the plane failed it");
    assert_eq!(held.settle(Settle::Unknown("the lease could not be confirmed")).await.as_str(), "left_to_lease");
    let row = faulty.get(org, "webhook.nylas", "k").await.expect("read").expect("the claim");
    assert_eq!((row.status, row.response), (ClaimStatus::Processing, None), "nothing written: left to its lease");
}

/// A claim that answers after the processing timeout has passed (a busy
/// plane): processing never starts, and the event is left to its lease with
/// the body its claim stored, for a re-drive, not journaled as a
/// processing that timed out (nothing ran, which is no timeout's "what it
/// did is unknown"). Its redelivery meanwhile is a duplicate.
#[tokio::test]
async fn a_claim_answered_after_the_processing_timeout_never_starts_and_leaves_the_event_for_a_redrive() {
    let faulty = Faulty::new(MemoryRepository::new());
    let gate = gate(&faulty);
    let org = Uuid::new_v4();
    let runs = Arc::new(AtomicUsize::new(0));
    // Counted when the processing runs (is polled), not when its future is made.
    let process = {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<Value, ProcessingError>(json!("stored"))
            }
        }
    };
    faulty.once(Op::Claim, Fault::DelayAfter(PROCESSING_TIMEOUT + Duration::from_millis(100)));
    let ack = gate.handle(delivery(org), process.clone()).await;
    assert_eq!(ack, Ack::Accepted, "held by the plane with its body");
    assert_eq!(runs.load(Ordering::SeqCst), 0, "processing never started");
    assert_eq!(gate.drops().get(DropReason::ProcessingAborted), 0, "nothing journaled as aborted");
    let row = faulty.get(org, "webhook.nylas", "d-1").await.expect("read").expect("the claim");
    assert_eq!((row.status, row.response), (ClaimStatus::Processing, None), "left to its lease");
    assert_eq!(gate.handle(delivery(org), process.clone()).await, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a duplicate runs nothing");
}
