//! The effect driver's ending rules, once, on every backend: each case runs
//! on the in-memory repository (always) and on PostgreSQL behind the
//! embedded PostgREST-compatible server (with `--features local`), both
//! wrapped in [`Faulty`] so the store can be slow, lose answers after it
//! committed, or refuse a journal.
//!
//! An effect ends in exactly one of three ways: journaled (a repeat replays
//! the answer), released (the next attempt runs), or left to its lease
//! (nothing written; the next attempt after the lease reclaims). The cases
//! below pin down which, under each fault, and what the store holds after.

use std::fmt::Debug;
use std::time::Duration;

use idempotency_plane::repo::{ClaimStatus, IdempotencyRecord};
use idempotency_plane::service::{
    Answer, Attempt, Begun, Cut, Effect, EffectDriver, Elided, Held, LeftToLease, ResourceRef, ResponseRef, Settle,
    Settled, Timing, Unstorable, MAX_STORED_ERROR_BYTES,
};
use idempotency_plane::{IdempotencyRepository, IdempotencyService, RequestHash};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use uuid::Uuid;

use crate::support::backends::TimeTravel;
use crate::support::faults::{Fault, Faulty, Op};

/// What a case needs of the repository under the wrapper.
pub(crate) trait Repo: IdempotencyRepository + Debug + 'static {}
impl<T: IdempotencyRepository + Debug + 'static> Repo for T {}

const SCOPE: &str = "tool.email.send";

/// The store's response limit for [`SCOPE`], and the service's.
const LIMIT: u64 = 64 * 1024;

const fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// A lease of 6 s: effect 2 s, journal 3 s, margin 1 s.
fn roomy() -> Timing {
    Timing::new(ms(2000), ms(3000), ms(1000)).expect("a valid timing")
}

/// Short deadlines for the cases that wait for one: effect 300 ms, journal
/// 1 s, margin 1 s.
fn tight() -> Timing {
    Timing::new(ms(300), ms(1000), ms(1000)).expect("a valid timing")
}

/// One key of one tenant, with the timing its effects run under.
struct Key {
    org: Uuid,
    key: String,
    hash: RequestHash,
    timing: Timing,
}

impl Key {
    fn new(name: &str, timing: Timing) -> Key {
        Key { org: Uuid::new_v4(), key: name.to_owned(), hash: RequestHash::of_json(&json!({ "key": name })), timing }
    }

    fn effect(&self) -> Effect<'_> {
        Effect {
            organization_id: self.org,
            scope: SCOPE,
            key: &self.key,
            request_hash: &self.hash,
            timing: self.timing,
            request: None,
        }
    }
}

fn driver<R: Repo>(faulty: &Faulty<R>) -> EffectDriver<Faulty<R>> {
    EffectDriver::new(IdempotencyService::new(faulty.clone()))
}

/// Claims `key`; panics with whatever else `begin` answered.
async fn hold<R: Repo>(driver: &EffectDriver<Faulty<R>>, key: &Key) -> Held<Faulty<R>> {
    match driver.begin(&key.effect()).await {
        Ok(Begun::Held(held)) => held,
        other => panic!("expected to hold {}, got {other:?}", key.key),
    }
}

/// What a repeat of `key` replays; panics with whatever else it answered.
async fn replay<R: Repo>(driver: &EffectDriver<Faulty<R>>, key: &Key) -> Answer {
    match driver.begin(&key.effect()).await {
        Ok(Begun::Replayed(answer)) => answer,
        other => panic!("expected a replay of {}, got {other:?}", key.key),
    }
}

/// The row of `key`, read through the wrapper (reads pass through).
async fn row<R: Repo>(faulty: &Faulty<R>, key: &Key) -> Option<IdempotencyRecord> {
    faulty.get(key.org, SCOPE, &key.key).await.expect("a read")
}

fn resource(id: &str) -> Option<ResourceRef> {
    Some(ResourceRef { resource_type: "email.message".into(), resource_id: id.into() })
}

/// Size and lowercase hex SHA-256 of `value` as compact JSON.
fn digest(value: &Value) -> (u64, String) {
    let bytes = serde_json::to_vec(value).expect("serializable");
    (bytes.len() as u64, hex::encode(Sha256::digest(&bytes)))
}

/// The reference an output was replaced by; panics if it is anything else.
fn reference(output: &Value) -> ResponseRef {
    let only = output.as_object().filter(|members| members.len() == 1).and_then(|m| m.get("$response_ref"));
    let only = only.unwrap_or_else(|| panic!("expected a reference, got {output}"));
    serde_json::from_value(only.clone()).expect("a reference")
}

/// The summary an output was replaced by; panics if it is anything else.
fn summary(output: &Value) -> Elided {
    Elided::from_stored(output).unwrap_or_else(|| panic!("expected a summary, got {output}"))
}

fn nested(levels: usize) -> Value {
    (0..levels).fold(json!("leaf"), |inner, level| if level % 2 == 0 { json!([inner]) } else { json!({ "n": inner }) })
}

// ---------------------------------------------------------------------------
// Journaled
// ---------------------------------------------------------------------------

/// Whatever an answer holds, a repeat replays it equal: ok, error, output,
/// resource; U+0000 anywhere and nesting deeper than the store holds
/// included, with no stand-in.
async fn a_journaled_answer_replays_equal_whatever_it_holds<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let driver = driver(&faulty);
    let answers = [
        Answer::success(json!({"id": "m-1", "to": ["a@b.c"]})).with_resource(resource("m-1")),
        Answer::success(json!("plain")),
        Answer::success(Value::Null),
        Answer::failure("invalid_recipient", json!({"field": "to"})),
        Answer::failure("not_found", json!(null)).with_resource(resource("m-2")),
        Answer::success(json!({"text": "a\u{0}b", "k\u{0}": 1, "list": ["\u{0}"]})),
        Answer::failure("bad\u{0}input", json!({"echo": "\u{0}"})).with_resource(resource("m-3")),
        Answer::success(nested(65)),
        Answer::success(nested(100)),
        Answer::failure("deep", nested(90)),
        Answer::success(json!({"$json": "{}"})),
        Answer::success(json!({"$elided": {"reason": "nul"}})),
    ];
    for (n, answer) in answers.iter().enumerate() {
        let key = Key::new(&format!("equal-{n}"), roomy());
        let held = hold(&driver, &key).await;
        let settled = held.settle(Settle::Journal(answer.clone())).await;
        assert!(matches!(settled, Settled::Journaled { stand_in: None, .. }), "answer {n}: {settled:?}");
        let back = replay(&driver, &key).await;
        assert_eq!(back, *answer, "answer {n} replays equal");
        assert_eq!(settled.journaled(), Some(&back), "answer {n}: the first answer is the replay's");
        let stored = row(&faulty, &key).await.expect("a row");
        assert_eq!(stored.status, ClaimStatus::Completed);
        assert_eq!(stored.resource_id.as_deref(), answer.resource.as_ref().map(|r| r.resource_id.as_str()));
    }
    assert_eq!(faulty.calls(Op::Complete), answers.len(), "one journal write each, no retries");
}

/// A business failure replays as a failure, even when its error is 100 KiB:
/// the error keeps its start, the resource is kept, and the output, which
/// fits once the error is shortened, stays whole.
async fn a_business_failure_with_a_100_kib_error_replays_as_a_failure<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let driver = driver(&faulty);
    let error = format!("vendor said: {}", "e".repeat(100 * 1024));
    for with_resource in [true, false] {
        let key = Key::new(&format!("large-error-{with_resource}"), roomy());
        let answer = Answer::failure(error.clone(), Value::Null).with_resource(if with_resource {
            resource("m-9")
        } else {
            None
        });
        let settled = hold(&driver, &key).await.settle(Settle::Journal(answer.clone())).await;
        assert!(
            matches!(settled, Settled::Journaled { stand_in: Some(Unstorable::TooLarge { .. }), .. }),
            "{settled:?}"
        );
        let back = replay(&driver, &key).await;
        assert_eq!(settled.journaled(), Some(&back), "the first answer is the replay's");
        assert!(!back.ok, "a failure replays as a failure");
        let kept = back.error.expect("the error is kept");
        assert!(!kept.is_empty() && kept.len() <= MAX_STORED_ERROR_BYTES && error.starts_with(&kept), "{kept:.40}");
        assert_eq!(back.resource, answer.resource, "the resource is kept");
        assert_eq!(back.output, Value::Null, "the output is kept whole");
        let stored = row(&faulty, &key).await.expect("a row").response.expect("a response");
        assert!(serde_json::to_vec(&stored).unwrap().len() as u64 <= LIMIT, "the stored form fits the limit");
    }
}

/// An output above the limit goes by reference to the effect's resource,
/// which is kept, with the original's size and digest; `ok` stays. Without
/// a resource it goes as a summary with the same size and digest.
async fn an_answer_above_the_limit_goes_by_reference_and_keeps_its_resource<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let output = json!({"body": "x".repeat(100_000)});
    for with_resource in [true, false] {
        let key = Key::new(&format!("large-output-{with_resource}"), roomy());
        let answer =
            Answer::success(output.clone()).with_resource(if with_resource { resource("m-big") } else { None });
        let settled = hold(&driver, &key).await.settle(Settle::Journal(answer.clone())).await;
        assert!(
            matches!(settled, Settled::Journaled { stand_in: Some(Unstorable::TooLarge { size, limit }), .. }
                if size > limit && limit == LIMIT),
            "{settled:?}"
        );
        let back = replay(&driver, &key).await;
        assert_eq!(settled.journaled(), Some(&back), "the first answer is the replay's");
        assert_eq!((back.ok, back.error.as_deref(), &back.resource), (true, None, &answer.resource));
        if with_resource {
            let reference = reference(&back.output);
            assert_eq!(reference.resource_id, "m-big");
            assert_eq!((reference.size, reference.sha256), digest(&output));
        } else {
            let summary = summary(&back.output);
            assert_eq!((summary.size, summary.sha256), (Some(digest(&output).0), Some(digest(&output).1)));
        }
    }
}

// ---------------------------------------------------------------------------
// Journal faults
// ---------------------------------------------------------------------------

/// A journal the store refuses once (IDEM2) is written again with its
/// output by reference, keeping the resource; without a resource, as a
/// summary saying it was refused. Refused twice, nothing is written and the
/// claim is left to its lease with the refusal as the reason.
async fn a_journal_the_store_refuses_falls_back_to_a_reference_and_keeps_the_resource<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let output = json!({"id": "m-5", "small": true});
    for with_resource in [true, false] {
        let key = Key::new(&format!("refused-{with_resource}"), roomy());
        let answer = Answer::success(output.clone()).with_resource(if with_resource { resource("m-5") } else { None });
        let before = (faulty.calls(Op::Complete), faulty.reached(Op::Complete));
        faulty.once(Op::Complete, Fault::refuse_journal());
        let settled = hold(&driver, &key).await.settle(Settle::Journal(answer.clone())).await;
        assert!(matches!(settled, Settled::Journaled { stand_in: Some(_), .. }), "{settled:?}");
        assert_eq!(
            (faulty.calls(Op::Complete) - before.0, faulty.reached(Op::Complete) - before.1),
            (2, 1),
            "the refused write, then the stand-in"
        );
        let back = replay(&driver, &key).await;
        assert_eq!(settled.journaled(), Some(&back), "the first answer is the replay's");
        assert_eq!((back.ok, &back.resource), (true, &answer.resource));
        if with_resource {
            let reference = reference(&back.output);
            assert_eq!(reference.resource_id, "m-5");
            assert_eq!((reference.size, reference.sha256), digest(&output));
        } else {
            assert_eq!(summary(&back.output).reason, "refused");
        }
    }

    let key = Key::new("refused-twice", roomy());
    faulty.set(Op::Complete, Fault::refuse_journal());
    let answer = Answer::success(output).with_resource(resource("m-6"));
    let settled = hold(&driver, &key).await.settle(Settle::Journal(answer)).await;
    faulty.clear(Op::Complete);
    assert!(
        matches!(&settled, Settled::LeftToLease(LeftToLease::Failed { ending: "journal", error })
            if error.is_unstorable_answer()),
        "{settled:?}"
    );
    assert_eq!(row(&faulty, &key).await.expect("a row").status, ClaimStatus::Processing, "nothing written");
}

/// A journal whose answer is lost after it committed is asked again within
/// its deadline with the same token, which answers the completed row: the
/// effect ends journaled, and a repeat replays it.
async fn a_journal_whose_answer_is_lost_after_commit_is_retried_and_ends_journaled<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let key = Key::new("lost-journal", roomy());
    let answer = Answer::success(json!({"id": "m-7"})).with_resource(resource("m-7"));
    let held = hold(&driver, &key).await;
    let deadline = held.ending_deadline();
    faulty.once(Op::Complete, Fault::LoseAnswer);
    let settled = held.settle(Settle::Journal(answer.clone())).await;
    assert!(matches!(settled, Settled::Journaled { stand_in: None, .. }), "{settled:?}");
    assert_eq!(faulty.reached(Op::Complete), 2, "the write whose answer was lost, and its repeat");
    assert!(faulty.reached_at(Op::Complete).iter().all(|at| *at < deadline), "both within the deadline");
    assert_eq!(replay(&driver, &key).await, answer);
}

/// A journal slower than its deadline ends left to its lease, and this
/// worker writes nothing after the deadline. What is in the store then
/// depends on where the time went: a write still waiting to be sent was
/// never made (the claim stays processing, and the next attempt after the
/// lease journals its own answer); a write that committed and whose answer
/// was slow did land, and replays.
async fn a_journal_slower_than_its_deadline_is_left_to_its_lease_and_writes_nothing_after_it<R: Repo>(
    faulty: Faulty<R>,
    time: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let late = ms(3000);

    // Slow before the write: never made.
    let key = Key::new("slow-before", tight());
    let held = hold(&driver, &key).await;
    let (claim_id, deadline) = (held.claim().id(), held.ending_deadline());
    faulty.once(Op::Complete, Fault::DelayBefore(late));
    let settled = held.settle(Settle::Journal(Answer::success(json!("first")))).await;
    assert!(matches!(settled, Settled::LeftToLease(LeftToLease::Deadline { ending: "journal" })), "{settled:?}");
    assert!(Instant::now() >= deadline, "it gave up at the deadline, not before");
    assert_eq!((faulty.calls(Op::Complete), faulty.reached(Op::Complete)), (1, 0), "no write was made, none is left");
    assert_eq!(row(&faulty, &key).await.expect("a row").status, ClaimStatus::Processing);
    time.pass_lease(claim_id).await;
    let next = hold(&driver, &key).await;
    assert!(next.claim().reclaimed());
    let settled = next.settle(Settle::Journal(Answer::success(json!("second")))).await;
    assert!(settled.is_journaled(), "{settled:?}");
    assert_eq!(replay(&driver, &key).await, Answer::success(json!("second")));

    // Slow after the write: it committed.
    let key = Key::new("slow-after", tight());
    let held = hold(&driver, &key).await;
    let reached = faulty.reached(Op::Complete);
    faulty.once(Op::Complete, Fault::DelayAfter(late));
    let settled = held.settle(Settle::Journal(Answer::success(json!("landed")))).await;
    assert!(matches!(settled, Settled::LeftToLease(LeftToLease::Deadline { ending: "journal" })), "{settled:?}");
    assert_eq!(faulty.reached(Op::Complete) - reached, 1, "one write, no retry after the deadline");
    assert_eq!(replay(&driver, &key).await, Answer::success(json!("landed")), "the slow write did land");

    // Slow within the deadline: it lands.
    let key = Key::new("slow-within", tight());
    let held = hold(&driver, &key).await;
    faulty.once(Op::Complete, Fault::DelayBefore(ms(300)));
    assert!(held.settle(Settle::Journal(Answer::success(json!("in time")))).await.is_journaled());

    // Unavailable until the deadline: retried within it, never after.
    let key = Key::new("unavailable", tight());
    let held = hold(&driver, &key).await;
    let deadline = held.ending_deadline();
    let (calls, reached) = (faulty.calls(Op::Complete), faulty.reached(Op::Complete));
    faulty.set(Op::Complete, Fault::Unavailable);
    let settled = held.settle(Settle::Journal(Answer::success(json!("never")))).await;
    faulty.clear(Op::Complete);
    assert!(
        matches!(&settled, Settled::LeftToLease(LeftToLease::Failed { ending: "journal", error }) if error.is_transient()),
        "{settled:?}"
    );
    let tries = &faulty.calls_at(Op::Complete)[calls..];
    assert!(tries.len() >= 2, "a transient failure is retried: {} tries", tries.len());
    assert!(tries.iter().all(|at| *at < deadline), "no try after the deadline");
    assert_eq!(faulty.reached(Op::Complete), reached);
    assert_eq!(row(&faulty, &key).await.expect("a row").status, ClaimStatus::Processing, "nothing written");
}

// ---------------------------------------------------------------------------
// Released
// ---------------------------------------------------------------------------

/// A release deletes the claim and the next attempt runs; a release whose
/// answer was lost after it committed is asked again, ends released or
/// lease-moved-on (its repeat finds nothing to delete), and the next
/// attempt runs as a fresh claim.
async fn a_release_lost_after_commit_still_ends_and_the_next_attempt_runs<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let key = Key::new("released", roomy());
    assert!(matches!(hold(&driver, &key).await.settle(Settle::Release).await, Settled::Released));
    assert!(row(&faulty, &key).await.is_none(), "the claim is gone");

    let key = Key::new("lost-release", roomy());
    let held = hold(&driver, &key).await;
    let first = held.claim().id();
    faulty.once(Op::Release, Fault::LoseAnswer);
    let before = faulty.reached(Op::Release);
    let settled = held.settle(Settle::Release).await;
    // The repeat deletes nothing; the row is gone, so the first one landed:
    // reported released, never as a fence that moved on.
    assert!(matches!(settled, Settled::Released), "{settled:?}");
    assert_eq!(faulty.reached(Op::Release) - before, 2, "the lost release, and its repeat");
    assert!(row(&faulty, &key).await.is_none(), "the claim is gone");
    let next = hold(&driver, &key).await;
    assert!(!next.claim().reclaimed() && next.claim().id() != first, "a fresh claim: {:?}", next.claim());
    assert!(next.settle(Settle::Journal(Answer::success(json!("ran")))).await.is_journaled());
    assert_eq!(replay(&driver, &key).await, Answer::success(json!("ran")));
}

/// A release whose answer is lost after it committed, while another worker
/// claims the freed key before the driver's repeat: the repeat deletes
/// nothing (another token), the row it then reads is the other worker's,
/// and the ending is reported `LeaseMovedOn`; the other worker's claim is
/// untouched and ends as it chooses.
async fn a_lost_release_whose_key_another_worker_took_meanwhile_is_reported_moved_on<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let key = Key::new("lost-release-taken", roomy());
    let held = hold(&driver, &key).await;
    let first = held.claim().id();
    // The release commits, then its answer is lost 2 s later: time enough,
    // on a loaded machine, for the other worker's claim to land first (the
    // ending's deadline, 5 s from the claim, leaves room for the repeat).
    faulty.once(Op::Release, Fault::LoseAnswerAfter(ms(2000)));
    let releasing = tokio::spawn(async move { held.settle(Settle::Release).await });
    crate::support::within(ms(5000), "the release commits", async {
        while row(&faulty, &key).await.is_some() {
            tokio::time::sleep(ms(10)).await;
        }
    })
    .await;
    let other = hold(&driver, &key).await;
    assert_ne!(other.claim().id(), first, "a fresh claim of the freed key");
    let settled = releasing.await.expect("the release task");
    assert!(matches!(settled, Settled::LeaseMovedOn), "{settled:?}");
    let stored = row(&faulty, &key).await.expect("the other worker's claim is still there");
    assert_eq!((stored.id, stored.status), (other.claim().id(), ClaimStatus::Processing));
    assert!(other.settle(Settle::Journal(Answer::success(json!("theirs")))).await.is_journaled());
    assert_eq!(replay(&driver, &key).await, Answer::success(json!("theirs")));
}

// ---------------------------------------------------------------------------
// Left to the lease
// ---------------------------------------------------------------------------

/// An unknown outcome writes nothing: the claim stays processing, a repeat
/// meanwhile meets it in flight, and the first attempt after the lease
/// reclaims the same claim.
async fn an_unknown_outcome_writes_nothing_and_the_next_attempt_after_the_lease_reclaims<R: Repo>(
    faulty: Faulty<R>,
    time: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let key = Key::new("unknown", roomy());
    let held = hold(&driver, &key).await;
    let claim_id = held.claim().id();
    let settled = held.settle(Settle::Unknown("the vendor did not answer")).await;
    assert!(
        matches!(settled, Settled::LeftToLease(LeftToLease::OutcomeUnknown("the vendor did not answer"))),
        "{settled:?}"
    );
    assert_eq!((faulty.calls(Op::Complete), faulty.calls(Op::Release)), (0, 0), "nothing written");
    let stored = row(&faulty, &key).await.expect("a row");
    assert_eq!((stored.status, stored.lease_live), (ClaimStatus::Processing, true));
    assert!(matches!(driver.begin(&key.effect()).await, Ok(Begun::InFlight { .. })), "in flight until the lease");

    time.pass_lease(claim_id).await;
    let next = hold(&driver, &key).await;
    assert!(next.claim().reclaimed() && next.claim().id() == claim_id, "{:?}", next.claim());
    assert!(next.settle(Settle::Journal(Answer::success(json!("after the lease")))).await.is_journaled());
    assert_eq!(replay(&driver, &key).await, Answer::success(json!("after the lease")));
}

/// A worker whose lease passed and was reclaimed by another ends
/// lease-moved-on, whichever ending it tries and whenever: before the other
/// worker journals (whose journal still lands), or after (whose answer is
/// not overwritten).
async fn a_settle_after_the_lease_moved_on_does_not_overwrite_the_other_workers_answer<R: Repo>(
    faulty: Faulty<R>,
    time: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let ours = Answer::success(json!({"worker": "stalled"}));
    let theirs = Answer::success(json!({"worker": "reclaimer"})).with_resource(resource("m-theirs"));

    // The stalled worker settles after the reclaimer journaled.
    let key = Key::new("moved-on-after", roomy());
    let stalled = hold(&driver, &key).await;
    time.pass_lease(stalled.claim().id()).await;
    let reclaimer = hold(&driver, &key).await;
    assert!(reclaimer.claim().reclaimed());
    assert!(reclaimer.settle(Settle::Journal(theirs.clone())).await.is_journaled());
    assert!(matches!(stalled.settle(Settle::Journal(ours.clone())).await, Settled::LeaseMovedOn));
    assert_eq!(replay(&driver, &key).await, theirs, "the reclaimer's answer stands");

    // The stalled worker settles first, then the reclaimer journals.
    for stalled_ending in [Settle::Journal(ours.clone()), Settle::Release] {
        let key = Key::new(&format!("moved-on-before-{}", matches!(stalled_ending, Settle::Release)), roomy());
        let stalled = hold(&driver, &key).await;
        time.pass_lease(stalled.claim().id()).await;
        let reclaimer = hold(&driver, &key).await;
        let settled = stalled.settle(stalled_ending).await;
        assert!(matches!(settled, Settled::LeaseMovedOn), "{settled:?}");
        let stored = row(&faulty, &key).await.expect("the reclaimer's claim is still there");
        // Held by the reclaimer (whose token the read never shows): the
        // reclaimer's journal below lands, so the stalled ending took nothing.
        assert_eq!((stored.status, stored.lease_live, stored.lease_token), (ClaimStatus::Processing, true, None));
        assert!(reclaimer.settle(Settle::Journal(theirs.clone())).await.is_journaled());
        assert_eq!(replay(&driver, &key).await, theirs);
    }
}

// ---------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------

/// The lease is the effect's timeout plus the journal's deadline plus the
/// margin, as the store stamps it; the effect's deadline and the ending's
/// count from the attempt's start, so both pass before the lease does.
async fn the_lease_is_effect_plus_journal_plus_margin<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let driver = driver(&faulty);
    let timing = Timing::new(ms(2500), ms(4000), ms(1500)).expect("a valid timing");
    assert_eq!(timing.lease(), ms(8000));
    let key = Key::new("lease", timing);
    let attempt = Attempt::new();
    let Ok(Begun::Held(held)) = driver.begin_as(&key.effect(), &attempt).await else { panic!("not held") };
    let stored = row(&faulty, &key).await.expect("a row");
    assert_eq!((stored.lease_expires_at - stored.claimed_at).to_std().unwrap(), ms(8000));
    assert_eq!(held.claim().lease_expires_at(), stored.lease_expires_at);
    assert_eq!(held.effect_deadline(), attempt.started() + ms(2500));
    assert_eq!(held.ending_deadline(), attempt.started() + ms(6500));
    assert!(matches!(held.settle(Settle::Release).await, Settled::Released));
}

/// `Held::run` answers what the effect returned, cuts one that outlives
/// its deadline, and catches a panic; either cut leaves the claim to its
/// lease when settled as unknown.
async fn held_run_cuts_the_effect_at_its_deadline_and_catches_panics<R: Repo>(faulty: Faulty<R>, _: &impl TimeTravel) {
    let driver = driver(&faulty);
    let key = Key::new("run", tight());
    let held = hold(&driver, &key).await;
    assert_eq!(held.run(async { 7 }).await, Ok(7));
    let never = tokio::time::timeout(Duration::from_secs(30), held.run(std::future::pending::<()>()));
    assert_eq!(never.await.expect("cut by its own deadline"), Err(Cut::TimedOut));
    assert!(Instant::now() >= held.effect_deadline(), "cut at the deadline, not before");
    let settled = held.settle(Settle::Unknown("timed out")).await;
    assert!(matches!(settled, Settled::LeftToLease(LeftToLease::OutcomeUnknown(_))), "{settled:?}");

    let key = Key::new("panics", tight());
    let held = hold(&driver, &key).await;
    let panicked = held.run(async { panic!("the effect panics (this test expects it)") }).await;
    assert_eq!(panicked, Err::<(), _>(Cut::Panicked));
    assert!(matches!(held.settle(Settle::Unknown("panicked")).await, Settled::LeftToLease(_)));
    assert_eq!(row(&faulty, &key).await.expect("a row").status, ClaimStatus::Processing, "left to its lease");
    assert!(matches!(driver.begin(&key.effect()).await, Ok(Begun::InFlight { .. })));
}

/// A claim whose answer was lost after it committed is this attempt's own
/// when asked again as the same attempt; any other attempt meets it in
/// flight.
async fn a_claim_whose_answer_was_lost_is_ours_when_asked_again_as_the_same_attempt<R: Repo>(
    faulty: Faulty<R>,
    _: &impl TimeTravel,
) {
    let driver = driver(&faulty);
    let key = Key::new("lost-claim", roomy());
    let attempt = Attempt::new();
    faulty.once(Op::Claim, Fault::LoseAnswer);
    let lost = driver.begin_as(&key.effect(), &attempt).await.map(|_| ()).expect_err("the answer is lost");
    assert!(lost.is_transient(), "{lost}");
    assert!(matches!(driver.begin(&key.effect()).await, Ok(Begun::InFlight { .. })), "another attempt");
    let Ok(Begun::Held(held)) = driver.begin_as(&key.effect(), &attempt).await else { panic!("not ours") };
    assert!(!held.claim().reclaimed());
    assert_eq!(held.effect_deadline(), attempt.started() + key.timing.effect(), "deadlines from the first try");
    assert!(held.settle(Settle::Journal(Answer::success(json!(1)))).await.is_journaled());
    assert_eq!(faulty.reached(Op::Claim), 3);
}

crate::support::on_every_plane!(
    in_memory: |case| {
        let faulty = crate::support::faults::Faulty::new(idempotency_plane::MemoryRepository::new());
        case(faulty.clone(), faulty.inner()).await
    },
    on_the_stack: |case, stack| {
        let repo = idempotency_plane::PostgrestRepository::new(crate::support::harness::client(&stack));
        case(crate::support::faults::Faulty::new(repo), &stack).await
    };
    a_journaled_answer_replays_equal_whatever_it_holds,
    a_business_failure_with_a_100_kib_error_replays_as_a_failure,
    an_answer_above_the_limit_goes_by_reference_and_keeps_its_resource,
    a_journal_the_store_refuses_falls_back_to_a_reference_and_keeps_the_resource,
    a_journal_whose_answer_is_lost_after_commit_is_retried_and_ends_journaled,
    a_journal_slower_than_its_deadline_is_left_to_its_lease_and_writes_nothing_after_it,
    a_release_lost_after_commit_still_ends_and_the_next_attempt_runs,
    a_lost_release_whose_key_another_worker_took_meanwhile_is_reported_moved_on,
    an_unknown_outcome_writes_nothing_and_the_next_attempt_after_the_lease_reclaims,
    a_settle_after_the_lease_moved_on_does_not_overwrite_the_other_workers_answer,
    the_lease_is_effect_plus_journal_plus_margin,
    held_run_cuts_the_effect_at_its_deadline_and_catches_panics,
    a_claim_whose_answer_was_lost_is_ours_when_asked_again_as_the_same_attempt,
);
