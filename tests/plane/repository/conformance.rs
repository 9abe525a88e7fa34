//! One conformance suite, run against every backend: the in-memory
//! repository (always, no database) and PostgreSQL behind the embedded
//! PostgREST-compatible server (with `--features local`). A fake that
//! disagrees with the database fails here, next to the same case on the
//! real stack.

use std::time::Duration;

use idempotency_plane::repo::{
    ClaimCall, ClaimDecision, ClaimFence, ClaimRequest, ClaimStatus, CompletionArgs, ExpiredClaims, FailuresCall,
    JournaledFailures, OrphanedWork, Redrivability, RedriveCall, Retired, EVERY_SCOPE,
};
use idempotency_plane::{ClientError, Error};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::backends::{Backend, TimeTravel};
use crate::support::LEASE;

mod batches;
use batches::{
    a_batch_answers_exactly_what_single_claims_would, a_batch_is_bounded_and_refused_whole_for_one_bad_item,
    batch_completions_and_releases_are_fenced_per_item,
};

/// The hash of `{"content": content}`, as the repository takes it.
fn hash_text(content: &str) -> String {
    crate::support::hash(content).as_str().to_owned()
}

fn call<'a>(org: Uuid, scope: &'a str, key: &'a str, hash: &'a str, token: Uuid) -> ClaimCall<'a> {
    ClaimCall { organization_id: org, scope, key, request_hash: hash, lease_token: token, lease: LEASE, request: None }
}

/// A re-drive of `scope`'s orphans of `org` alone, handed out for [`LEASE`].
fn redrive(org: Uuid, scope: &str, bound: u64) -> RedriveCall<'_> {
    RedriveCall { scope, lease_tokens: crate::support::lease_tokens(bound), lease: LEASE, organization_id: Some(org) }
}

fn code(result: Result<impl std::fmt::Debug, Error>) -> String {
    match result {
        Err(Error::Store(ClientError::Api { error, .. })) => error.code.clone(),
        other => panic!("expected a refusal by the database, got {other:?}"),
    }
}

/// The one-call claim through every outcome, and what each discloses.
async fn the_one_call_claim_decides_every_outcome(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h, token) = (Uuid::new_v4(), hash_text("one call"), Uuid::new_v4());
    let claimed = repo.claim(&call(org, "tool.email.send", "k", &h, token)).await.unwrap();
    assert_eq!((claimed.outcome, claimed.lease_token, claimed.lease_live), (ClaimDecision::Claimed, Some(token), true));
    let again = repo.claim(&call(org, "tool.email.send", "k", &h, token)).await.unwrap();
    assert_eq!((again.outcome, again.id), (ClaimDecision::Claimed, claimed.id), "a repeat is the caller's own claim");

    let other = repo.claim(&call(org, "tool.email.send", "k", &h, Uuid::new_v4())).await.unwrap();
    assert_eq!((other.outcome, other.lease_token, other.response.clone()), (ClaimDecision::Processing, None, None));

    let answer = json!({"sent": 1});
    let args =
        CompletionArgs { response: Some(&answer), resource_type: Some("email.message"), resource_id: Some("m-1") };
    let done = repo.complete(claimed.organization_id, claimed.id, token, args).await.unwrap().expect("completed");
    assert_eq!((done.status, done.lease_live), (ClaimStatus::Completed, false));
    let replay = repo.claim(&call(org, "tool.email.send", "k", &h, Uuid::new_v4())).await.unwrap();
    assert_eq!((replay.outcome, replay.response, replay.lease_token), (ClaimDecision::Completed, Some(answer), None));
    assert_eq!(replay.resource_id.as_deref(), Some("m-1"));

    let conflict = repo.claim(&call(org, "tool.email.send", "k", &hash_text("other"), Uuid::new_v4())).await.unwrap();
    assert_eq!(conflict.outcome, ClaimDecision::Conflict);
    assert_eq!((conflict.lease_token, conflict.response, conflict.request_hash), (None, None, None));

    let crashed = repo.claim(&call(org, "tool.email.send", "k2", &h, Uuid::new_v4())).await.unwrap();
    time.pass_lease(crashed.id).await;
    let token2 = Uuid::new_v4();
    let reclaimed = repo.claim(&call(org, "tool.email.send", "k2", &h, token2)).await.unwrap();
    assert_eq!(
        (reclaimed.outcome, reclaimed.id, reclaimed.lease_token),
        (ClaimDecision::Reclaimed, crashed.id, Some(token2))
    );
    let repeat = repo.claim(&call(org, "tool.email.send", "k2", &h, token2)).await.unwrap();
    assert_eq!(repeat.outcome, ClaimDecision::Reclaimed, "a repeat of a reclaim says so");
}

/// The spec's repository protocol (v1): try_claim, reclaim, complete, release.
async fn the_v1_protocol_claims_reclaims_completes_and_releases_under_its_fence(
    repo: &impl Backend,
    time: &impl TimeTravel,
) {
    let (org, h) = (Uuid::new_v4(), hash_text("v1"));
    let request = |token| ClaimRequest {
        organization_id: org,
        scope: "tool.email.send",
        key: "k",
        request_hash: &h,
        lease_token: token,
        lease: LEASE,
        retain: Duration::from_secs(1),
    };
    let token = Uuid::new_v4();
    let first = repo.try_claim(&request(token)).await.unwrap().expect("a free key");
    assert_eq!(repo.try_claim(&request(token)).await.unwrap().map(|r| r.id), Some(first.id), "a repeat is ours");
    assert!(repo.try_claim(&request(Uuid::new_v4())).await.unwrap().is_none(), "taken");
    assert!(repo.reclaim(&request(Uuid::new_v4())).await.unwrap().is_none(), "a live lease is not taken over");

    time.pass_lease(first.id).await;
    assert!(repo.try_claim(&request(Uuid::new_v4())).await.unwrap().is_none(), "try_claim never reclaims");
    let other = hash_text("other");
    let mismatched = ClaimRequest { request_hash: &other, ..request(Uuid::new_v4()) };
    assert!(repo.reclaim(&mismatched).await.unwrap().is_none(), "reclaim checks the hash");
    let token2 = Uuid::new_v4();
    let second = repo.reclaim(&request(token2)).await.unwrap().expect("taken over");
    assert_eq!((second.id, second.lease_token), (first.id, Some(token2)));

    let answer = json!({"ok": true});
    let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    assert!(
        repo.complete(first.organization_id, first.id, token, args).await.unwrap().is_none(),
        "the old token is fenced off"
    );
    assert!(!repo.release(first.organization_id, first.id, token).await.unwrap(), "the old token cannot release");
    // A claim is addressed by its organization and its id: named with
    // another organization, it is not the caller's, whatever the token.
    let stranger = Uuid::new_v4();
    assert!(repo.complete(stranger, first.id, token2, args).await.unwrap().is_none(), "another organization's claim");
    assert!(!repo.release(stranger, first.id, token2).await.unwrap(), "another organization's claim is not released");
    assert_eq!(repo.get(org, "tool.email.send", "k").await.unwrap().map(|r| r.status), Some(ClaimStatus::Processing));
    let done = repo.complete(first.organization_id, first.id, token2, args).await.unwrap().expect("completed");
    assert_eq!(
        repo.complete(first.organization_id, first.id, token2, args).await.unwrap(),
        Some(done),
        "a repeat answers the same row"
    );
    assert!(!repo.release(first.organization_id, first.id, token2).await.unwrap(), "a completed claim is the journal");

    let free = repo.try_claim(&ClaimRequest { key: "k-release", ..request(Uuid::new_v4()) }).await.unwrap().unwrap();
    let free_token = free.lease_token.expect("the claimant's answer carries its token");
    assert!(repo.release(free.organization_id, free.id, free_token).await.unwrap());
    assert!(repo.get(org, "tool.email.send", "k-release").await.unwrap().is_none());
}

/// Scopes and their retention come from the policy; arguments only lengthen it.
async fn retention_is_the_scopes_policy_and_an_unknown_scope_is_refused(repo: &impl Backend, _: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("policy"));
    for (scope, days) in [
        ("tool.crm.company.create", 30),
        ("webhook.nylas", 1),
        ("surface.saved_search.start", 1),
        ("http.post.orders", 1),
    ] {
        let row = repo.claim(&call(org, scope, "k", &h, Uuid::new_v4())).await.unwrap();
        assert_eq!(row.retain_until - row.lease_expires_at, chrono::TimeDelta::days(days), "{scope}");
    }
    let longer = ClaimRequest {
        organization_id: org,
        scope: "webhook.nylas",
        key: "long",
        request_hash: &h,
        lease_token: Uuid::new_v4(),
        lease: LEASE,
        retain: Duration::from_secs(40 * 86_400),
    };
    let row = repo.try_claim(&longer).await.unwrap().unwrap();
    assert_eq!(row.retain_until - row.lease_expires_at, chrono::TimeDelta::days(40), "an argument lengthens it");
    for refused in [
        repo.claim(&call(org, "payments.charge", "k", &h, Uuid::new_v4())).await.map(|_| ()),
        repo.get(org, "payments.charge", "k").await.map(|_| ()),
    ] {
        assert!(matches!(refused, Err(Error::UnknownScope { .. })), "{refused:?}");
    }
    let bad_lease = ClaimCall { lease: Duration::from_millis(999), ..call(org, "tool.x", "k", &h, Uuid::new_v4()) };
    assert_eq!(code(repo.claim(&bad_lease).await), "22023");
    assert_eq!(code(repo.claim(&call(org, "tool.x", "k", "ABC", Uuid::new_v4())).await), "22023");
}

/// What a completion may store.
async fn a_completion_is_refused_without_an_answer_or_above_the_limit(repo: &impl Backend, _: &impl TimeTravel) {
    let (org, token) = (Uuid::new_v4(), Uuid::new_v4());
    let row = repo.claim(&call(org, "tool.email.send", "k", &hash_text("limit"), token)).await.unwrap();
    assert_eq!(code(repo.complete(row.organization_id, row.id, token, CompletionArgs::default()).await), "22023");
    let large = json!({"text": "x".repeat(70_000)});
    let args = CompletionArgs { response: Some(&large), ..CompletionArgs::default() };
    assert_eq!(code(repo.complete(row.organization_id, row.id, token, args).await), "IDEM2");
    // 65 containers, the innermost empty: deeper than 64 levels, as arrays or objects.
    let arrays = (0..64).fold(json!([]), |inner, _| json!([inner]));
    let objects = (0..64).fold(json!({}), |inner, _| json!({ "a": inner }));
    for deep in [&arrays, &objects] {
        let args = CompletionArgs { response: Some(deep), ..CompletionArgs::default() };
        assert_eq!(code(repo.complete(row.organization_id, row.id, token, args).await), "IDEM3");
    }
    let stored = repo.get(org, "tool.email.send", "k").await.unwrap().unwrap();
    assert_eq!(stored.status, ClaimStatus::Processing, "the refused completions wrote nothing");
}

/// The response limit counts compact JSON, whatever form the store keeps:
/// PostgreSQL writes a jsonb with a space after every `,` and `:`.
async fn the_response_limit_counts_compact_json(repo: &impl Backend, _: &impl TimeTravel) {
    let org = Uuid::new_v4();
    for (elements, fits) in [(32_000, true), (33_000, false)] {
        // `[1,1,…]` is 2n+1 bytes compact (64,001 and 66,001) and 3n in
        // PostgreSQL's text form (96,000 and 99,000), against 65,536.
        let token = Uuid::new_v4();
        let key = format!("array-{elements}");
        let row = repo.claim(&call(org, "tool.email.send", &key, &hash_text(&key), token)).await.unwrap();
        let response = json!(vec![1; elements]);
        let args = CompletionArgs { response: Some(&response), ..CompletionArgs::default() };
        let completed = repo.complete(row.organization_id, row.id, token, args).await;
        if fits {
            assert_eq!(completed.unwrap().map(|r| r.status), Some(ClaimStatus::Completed), "{elements}");
        } else {
            assert_eq!(code(completed), "IDEM2", "{elements}");
        }
    }
}

/// The sweeper's reads and deletes.
async fn expired_claims_are_read_oldest_first_within_the_bound_and_deleted(
    repo: &impl Backend,
    time: &impl TimeTravel,
) {
    let org = Uuid::new_v4();
    for k in 0..3 {
        repo.claim(&call(org, "webhook.nylas", &format!("k{k}"), &hash_text("sweep"), Uuid::new_v4())).await.unwrap();
        time.age(Duration::from_secs(60)).await;
    }
    assert!(repo.expired(ExpiredClaims::max_bound(repo)).await.unwrap().is_empty(), "nothing past retention yet");
    time.age(Duration::from_secs(2 * 86_400)).await;
    let two = repo.expired(2).await.unwrap();
    assert_eq!(two.len(), 2);
    assert!(two[0].retain_until <= two[1].retain_until, "oldest first");
    assert!(matches!(
        repo.expired(ExpiredClaims::max_bound(repo) + 1).await,
        Err(Error::Store(ClientError::BoundAboveCap { .. }))
    ));
    let ids: Vec<Uuid> = two.iter().map(|c| c.id).collect();
    assert_eq!(repo.retire_expired(&ids).await.unwrap(), Retired { deleted: 2, dead_lettered: 0 });
    assert_eq!(repo.retire_expired(&ids).await.unwrap(), Retired::default(), "gone already");
    assert_eq!(repo.expired(ExpiredClaims::max_bound(repo)).await.unwrap().len(), 1);
}

/// Run admission and provider jobs.
async fn runs_are_admitted_once_and_provider_jobs_belong_to_one_organization(repo: &impl Backend, _: &impl TimeTravel) {
    let (org, input, token) = (Uuid::new_v4(), json!({"q": 1}), Uuid::new_v4());
    let run = repo.admit(org, "capability:x:1", &input, token, None).await.unwrap();
    assert!(run.admitted);
    assert!(
        repo.admit(org, "capability:x:1", &input, token, None).await.unwrap().admitted,
        "a repeat of the same call"
    );
    let other = repo.admit(org, "capability:x:1", &json!({"q": 2}), Uuid::new_v4(), None).await.unwrap();
    assert_eq!((other.admitted, other.id, other.input), (false, run.id, input));

    // A Run's max_run_duration: above zero, at most 30 days (the tool
    // retention, which every tool claim of the Run is kept for).
    let thirty_days = Duration::from_secs(30 * 86_400);
    let kept = repo.admit(org, "capability:x:2", &json!({}), Uuid::new_v4(), Some(thirty_days)).await.unwrap();
    assert!(kept.admitted, "30 days is the cap, and allowed");
    for refused in [Duration::ZERO, Duration::from_micros(999), thirty_days + Duration::from_millis(1)] {
        let answer = repo.admit(org, "capability:x:3", &json!({}), Uuid::new_v4(), Some(refused)).await;
        assert_eq!(code(answer), "22023", "{refused:?}");
    }
    assert_eq!(repo.find(org, "capability:x:3", None).await.unwrap(), None, "nothing admitted");

    let job = repo.register(org, "transcribe", "job-1").await.unwrap();
    assert_eq!(repo.register(org, "transcribe", "job-1").await.unwrap(), job, "a repeat answers the job");
    assert_eq!(code(repo.register(Uuid::new_v4(), "transcribe", "job-1").await), "23505");
    assert_eq!(repo.lookup("transcribe", "job-1").await.unwrap(), Some(job));
    assert_eq!(repo.lookup("transcribe", "job-2").await.unwrap(), None);
}

/// A fenced admission inserts only while its claim is held by its token,
/// and a Run is read back by its start key.
async fn a_fenced_admission_admits_only_while_its_claim_is_held(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h, lease_token) = (Uuid::new_v4(), hash_text("fenced"), Uuid::new_v4());
    let scope = "surface.saved_search.start";
    let claim = repo.claim(&call(org, scope, "start-1", &h, lease_token)).await.unwrap();
    let fence = ClaimFence { claim_id: claim.id, lease_token };
    let (input, admitter) = (json!({"snapshot": 1}), Uuid::new_v4());

    let run = repo.admit_fenced(org, "start:1", &input, admitter, fence).await.unwrap().expect("the fence holds");
    assert!(run.admitted);
    let again = repo.admit_fenced(org, "start:1", &json!({"snapshot": 2}), admitter, fence).await.unwrap();
    let again = again.expect("a repeat under the same fence");
    assert_eq!((again.id, again.admitted, &again.input), (run.id, true, &input), "the first input wins");

    let wrong_token = ClaimFence { lease_token: Uuid::new_v4(), ..fence };
    let refused = repo.admit_fenced(org, "start:1", &input, admitter, wrong_token).await.unwrap();
    assert_eq!(refused, None, "another token's fence: refused even though the Run exists");
    let other_org = repo.admit_fenced(Uuid::new_v4(), "start:2", &input, admitter, fence).await.unwrap();
    assert_eq!(other_org, None, "a claim fences only its own organization's Runs");
    let unknown = ClaimFence { claim_id: Uuid::new_v4(), lease_token };
    assert_eq!(repo.admit_fenced(org, "start:2", &input, admitter, unknown).await.unwrap(), None);

    // The lease passes: the old holder starts nothing; the new holder may.
    time.pass_lease(claim.id).await;
    assert_eq!(repo.admit_fenced(org, "start:2", &input, admitter, fence).await.unwrap(), None, "lease passed");
    assert_eq!(repo.find(org, "start:2", Some(admitter)).await.unwrap(), None, "no Run from the lost fence");
    let token2 = Uuid::new_v4();
    let reclaimed = repo.claim(&call(org, scope, "start-1", &h, token2)).await.unwrap();
    assert_eq!(reclaimed.outcome, ClaimDecision::Reclaimed);
    let fence2 = ClaimFence { claim_id: claim.id, lease_token: token2 };
    let second = repo.admit_fenced(org, "start:2", &input, admitter, fence2).await.unwrap().expect("the new fence");
    assert!(second.admitted);

    // A completed claim fences nothing.
    let answer = json!({"done": true});
    let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    repo.complete(claim.organization_id, claim.id, token2, args).await.unwrap().expect("completed");
    assert_eq!(repo.admit_fenced(org, "start:3", &input, admitter, fence2).await.unwrap(), None, "completed");

    // Reading back: the Run, admitted for its own token only; nothing else.
    let found = repo.find(org, "start:1", Some(admitter)).await.unwrap().expect("admitted");
    assert_eq!((found.id, found.admitted, &found.input), (run.id, true, &input));
    let other = repo.find(org, "start:1", Some(Uuid::new_v4())).await.unwrap().expect("admitted");
    assert!(!other.admitted);
    assert!(!repo.find(org, "start:1", None).await.unwrap().expect("admitted").admitted);
    assert_eq!(repo.find(org, "start:3", Some(admitter)).await.unwrap(), None);
    assert_eq!(repo.find(Uuid::new_v4(), "start:1", Some(admitter)).await.unwrap(), None);
    assert_eq!(code(repo.find(org, "", None).await), "22023");
    assert_eq!(code(repo.admit_fenced(org, "", &input, admitter, fence2).await), "22023");
}

/// A claim carries its work: no claim, replay, conflict or read answers it;
/// a re-drive hands it out once its holder's lease passed, with a fresh
/// fence and the next attempt, and the old holder is fenced off.
async fn a_claim_carries_its_work_and_only_a_redrive_hands_it_out(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h, token) = (Uuid::new_v4(), hash_text("work"), Uuid::new_v4());
    let work = json!({"event": "evt_carried_work", "amount": 100});
    let carrying = ClaimCall { request: Some(&work), ..call(org, "webhook.stripe", "evt-1", &h, token) };
    let claimed = repo.claim(&carrying).await.unwrap();
    assert_eq!(claimed.outcome, ClaimDecision::Claimed);
    let plain = repo.claim(&call(org, "webhook.stripe", "evt-2", &h, Uuid::new_v4())).await.unwrap();
    let shows_work = |answer: &dyn std::fmt::Debug| format!("{answer:?}").contains("evt_carried_work");
    assert!(!shows_work(&claimed), "not even the claimant's own answer repeats the work");
    let again = ClaimCall { request: Some(&work), ..call(org, "webhook.stripe", "evt-1", &h, Uuid::new_v4()) };
    let other = repo.claim(&again).await.unwrap();
    assert_eq!(other.outcome, ClaimDecision::Processing);
    assert!(!shows_work(&other) && !shows_work(&repo.get(org, "webhook.stripe", "evt-1").await.unwrap()));
    assert_eq!(repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap(), vec![], "a live lease is no orphan");

    time.pass_lease(claimed.id).await;
    time.pass_lease(plain.id).await;
    let taken = repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap();
    assert_eq!(taken.len(), 1, "only the claim that carries its work is re-driven: {taken:?}");
    let orphan = &taken[0];
    assert_eq!((orphan.id, orphan.status, orphan.attempt), (claimed.id, ClaimStatus::Processing, 2));
    assert_eq!((orphan.request.as_ref(), orphan.response.as_ref()), (Some(&work), None));
    let fresh = orphan.lease_token.expect("the new holder's token");
    assert_ne!(fresh, token);
    assert_eq!(repo.redrive(&redrive(org, "webhook.stripe", 10)).await.unwrap(), vec![], "handed out once");

    // The old holder wakes up: every fenced call answers that the fence moved on.
    assert_eq!(repo.extend(org, claimed.id, token, LEASE).await.unwrap(), None);
    let answer = json!({"ok": true});
    let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    assert!(repo.complete(org, claimed.id, token, args).await.unwrap().is_none());
    assert!(!repo.release(org, claimed.id, token).await.unwrap());
    assert!(repo.complete(org, claimed.id, fresh, args).await.unwrap().is_some(), "the new holder completes");

    let replay = repo.claim(&call(org, "webhook.stripe", "evt-1", &h, Uuid::new_v4())).await.unwrap();
    assert_eq!((replay.outcome, replay.response.as_ref()), (ClaimDecision::Completed, Some(&answer)));
    let conflict = repo.claim(&call(org, "webhook.stripe", "evt-1", &hash_text("x"), Uuid::new_v4())).await.unwrap();
    assert_eq!(conflict.outcome, ClaimDecision::Conflict);
    assert!(!shows_work(&replay) && !shows_work(&conflict));
    time.pass_lease(claimed.id).await;
    assert_eq!(repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap(), vec![], "completed work is done");
}

/// The heartbeat moves the lease of its holder only, and answers `None`
/// once the fence moved on.
async fn a_heartbeat_moves_the_lease_of_its_holder_alone(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h, token) = (Uuid::new_v4(), hash_text("heartbeat"), Uuid::new_v4());
    let claimed = repo.claim(&call(org, "tool.render", "k", &h, token)).await.unwrap();
    let end = repo.extend(org, claimed.id, token, 2 * LEASE).await.unwrap().expect("held");
    assert!(end > claimed.lease_expires_at, "{end} after {}", claimed.lease_expires_at);
    assert_eq!(repo.extend(org, claimed.id, Uuid::new_v4(), LEASE).await.unwrap(), None, "another token");
    assert_eq!(repo.extend(Uuid::new_v4(), claimed.id, token, LEASE).await.unwrap(), None, "another organization");
    assert_eq!(code(repo.extend(org, claimed.id, token, Duration::from_millis(999)).await), "22023");

    // A holder whose lease passed but whom nobody replaced keeps it.
    time.pass_lease(claimed.id).await;
    assert!(repo.extend(org, claimed.id, token, LEASE).await.unwrap().is_some());
    let rival = repo.claim(&call(org, "tool.render", "k", &h, Uuid::new_v4())).await.unwrap();
    assert_eq!(rival.outcome, ClaimDecision::Processing, "the extended lease is live again");

    // Taken over: the heartbeat says stop.
    time.pass_lease(claimed.id).await;
    let taker = Uuid::new_v4();
    let taken = repo.claim(&call(org, "tool.render", "k", &h, taker)).await.unwrap();
    assert_eq!(taken.outcome, ClaimDecision::Reclaimed);
    assert_eq!(repo.extend(org, claimed.id, token, LEASE).await.unwrap(), None);
    let answer = json!({"rendered": true});
    let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    repo.complete(org, claimed.id, taker, args).await.unwrap().expect("completed");
    assert_eq!(repo.extend(org, claimed.id, taker, LEASE).await.unwrap(), None, "a completed claim holds no lease");
}

/// Work handed out `max_attempts` times (5 by default) is journaled as a
/// dead letter by the next re-drive, and every later claim replays it.
async fn a_redrive_dead_letters_work_handed_out_max_attempts_times(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("dead"));
    let work = json!({"event": "poison"});
    let carrying = ClaimCall { request: Some(&work), ..call(org, "webhook.svix", "evt-poison", &h, Uuid::new_v4()) };
    let claimed = repo.claim(&carrying).await.unwrap();
    for attempt in 2..=5 {
        time.pass_lease(claimed.id).await;
        let taken = repo.redrive(&redrive(org, "webhook.svix", 10)).await.unwrap();
        assert_eq!(taken.iter().map(|w| (w.attempt, w.is_dead_letter())).collect::<Vec<_>>(), [(attempt, false)]);
    }
    time.pass_lease(claimed.id).await;
    let dead = repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap();
    let letter = json!({"ok": false, "error": "dead_lettered", "output": {"attempts": 5}});
    assert_eq!(dead.len(), 1);
    assert!(dead[0].is_dead_letter());
    assert_eq!((dead[0].attempt, dead[0].lease_token, dead[0].request.as_ref()), (5, None, None));
    assert_eq!(dead[0].response.as_ref(), Some(&letter));
    let replay = repo.claim(&call(org, "webhook.svix", "evt-poison", &h, Uuid::new_v4())).await.unwrap();
    assert_eq!((replay.outcome, replay.response.as_ref()), (ClaimDecision::Completed, Some(&letter)));
    let read = repo.get(org, "webhook.svix", "evt-poison").await.unwrap().expect("journaled");
    assert_eq!((read.status, read.response.as_ref()), (ClaimStatus::Completed, Some(&letter)));
    time.pass_lease(claimed.id).await;
    assert_eq!(repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap(), vec![]);
}

/// A re-drive is bounded like every read, and a claim's work by its scope:
/// what is refused changes nothing.
async fn work_and_redrives_are_bounded_and_bad_input_is_refused(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("bounds"));
    let above = redrive(org, "webhook.*", OrphanedWork::max_bound(repo) + 1);
    assert!(matches!(repo.redrive(&above).await, Err(Error::Store(ClientError::BoundAboveCap { .. }))));
    for unknown in ["nope.*", "nope.x"] {
        let refused = repo.redrive(&redrive(org, unknown, 10)).await;
        assert!(matches!(refused, Err(Error::UnknownScope { .. })), "{unknown}: {refused:?}");
    }
    for malformed in ["Webhook.*", "webhook.", "*", "webhook..x"] {
        assert_eq!(code(repo.redrive(&redrive(org, malformed, 10)).await), "22023", "{malformed}");
    }
    let short = RedriveCall { lease: Duration::from_millis(10), ..redrive(org, "webhook.*", 10) };
    assert_eq!(code(repo.redrive(&short).await), "22023");

    // The scope's max_request_bytes (384 KiB for webhook.*), as compact JSON.
    let large = json!({"body": "x".repeat(400_000)});
    let deep = (0..70).fold(json!(1), |inner, _| json!([inner]));
    for (work, refusal) in [(&large, "IDEM5"), (&deep, "IDEM6")] {
        let carrying = ClaimCall { request: Some(work), ..call(org, "webhook.stripe", "too-much", &h, Uuid::new_v4()) };
        assert_eq!(code(repo.claim(&carrying).await), refusal);
        assert!(repo.get(org, "webhook.stripe", "too-much").await.unwrap().is_none(), "nothing written");
    }

    let work = json!({"n": 1});
    let mut ids = Vec::new();
    for key in ["a", "b", "c"] {
        let carrying = ClaimCall { request: Some(&work), ..call(org, "webhook.stripe", key, &h, Uuid::new_v4()) };
        ids.push(repo.claim(&carrying).await.unwrap().id);
    }
    for id in &ids {
        time.pass_lease(*id).await;
    }
    assert_eq!(repo.redrive(&redrive(org, "webhook.stripe", 2)).await.unwrap().len(), 2);
    assert_eq!(repo.redrive(&redrive(org, "webhook.stripe", 2)).await.unwrap().len(), 1);
    assert_eq!(ExpiredClaims::max_bound(repo), OrphanedWork::max_bound(repo));
}

/// What `failures` lists of `org` in `scope`: the keys, their errors and
/// whether each can be sent back.
fn failures_of(org: Uuid, scope: &str, bound: u64) -> FailuresCall<'_> {
    FailuresCall { scope, bound, organization_id: Some(org), since: None, claim_ids: None }
}

/// Journaled failures are listed, sent back to re-drive once each (what
/// they replaced kept for the audit), handed out again as orphans with
/// their attempts counted anew, and what succeeds then is every replay's
/// answer; what carries no work, or is no failure, is never sent back.
async fn journaled_failures_are_listed_and_sent_back_to_redrive_once(repo: &impl Backend, time: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("failures"));
    let work = json!({"body_text": "{\"id\":\"evt\"}"});
    let (work_ref, h_ref) = (&work, &h);
    let journal = |key: &'static str, carries: bool, answer: Value| async move {
        let token = Uuid::new_v4();
        let claim =
            ClaimCall { request: carries.then_some(work_ref), ..call(org, "webhook.stripe", key, h_ref, token) };
        let claimed = repo.claim(&claim).await.unwrap();
        let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
        repo.complete(org, claimed.id, token, args).await.unwrap().expect("journaled");
        claimed.id
    };
    let failed = journal("evt-failed", true, json!({"ok": false, "error": "downstream 500", "output": null})).await;
    let unstored = journal("evt-no-work", false, json!({"ok": false, "error": "bad", "output": null})).await;
    journal("evt-fine", true, json!({"ok": true, "output": 1})).await;

    let listed = repo.failures(&failures_of(org, "webhook.*", 10)).await.unwrap();
    let seen: Vec<_> = listed.iter().map(|f| (f.key.as_str(), f.error.as_deref(), f.redrivable, f.requeues)).collect();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.contains(&("evt-failed", Some("downstream 500"), true, 0)), "{seen:?}");
    assert!(seen.contains(&("evt-no-work", Some("bad"), false, 0)), "{seen:?}");
    assert!(listed.iter().all(|f| f.status == ClaimStatus::Completed && f.attempts == 1));
    assert_eq!(repo.failures(&failures_of(Uuid::new_v4(), "webhook.*", 10)).await.unwrap(), vec![]);

    // Sending back: the chosen id, once; one without work is not sent.
    let chosen = [failed, unstored];
    let send = FailuresCall { claim_ids: Some(&chosen), ..failures_of(org, "webhook.stripe", 10) };
    let sent = repo.redrive_failed(&send).await.unwrap();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(
        (sent[0].id, sent[0].status, sent[0].error.as_deref()),
        (failed, ClaimStatus::Processing, Some("downstream 500"))
    );
    assert_eq!((sent[0].requeues, sent[0].attempts), (1, 1));
    assert_eq!(repo.redrive_failed(&send).await.unwrap(), vec![], "a failure is sent back once");
    let still = repo.failures(&failures_of(org, "webhook.*", 10)).await.unwrap();
    assert_eq!(still.iter().map(|f| f.key.as_str()).collect::<Vec<_>>(), ["evt-no-work"]);
    // A redelivery meanwhile finds no answer to replay.
    assert!(repo.get(org, "webhook.stripe", "evt-failed").await.unwrap().is_some_and(|row| row.response.is_none()));

    // The next re-drive hands it out, attempts counted anew, with its work.
    let taken = repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!((taken[0].id, taken[0].attempt, taken[0].request.as_ref()), (failed, 2, Some(&work)));
    // It fails again, before the fix: listed again, its first failure's time kept.
    let first = listed.iter().find(|f| f.id == failed).map(|f| f.claimed_at).expect("listed");
    assert!(listed.iter().all(|f| f.first_claimed_at == Some(f.claimed_at)), "{listed:?}");
    assert_eq!(sent[0].first_claimed_at, Some(first), "the send-back keeps the failed attempt's claim");
    let again = json!({"ok": false, "error": "downstream 500 again", "output": null});
    let args = CompletionArgs { response: Some(&again), ..CompletionArgs::default() };
    repo.complete(org, failed, taken[0].lease_token.expect("held"), args).await.unwrap().expect("journaled");
    let relisted = repo.failures(&failures_of(org, "webhook.stripe", 10)).await.unwrap();
    let row = relisted.iter().find(|f| f.id == failed).expect("failed again, listed");
    assert_eq!(row.first_claimed_at, Some(first), "{row:?}");
    assert!(row.claimed_at >= first && row.requeues == 1, "{row:?}");
    let send_again = FailuresCall { claim_ids: Some(&chosen[..1]), ..failures_of(org, "webhook.stripe", 10) };
    assert_eq!(repo.redrive_failed(&send_again).await.unwrap()[0].first_claimed_at, Some(first));
    let taken = repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap();
    assert_eq!((taken.len(), taken[0].id), (1, failed));
    let fixed = json!({"ok": true, "output": "processed after the fix"});
    let args = CompletionArgs { response: Some(&fixed), ..CompletionArgs::default() };
    let token = taken[0].lease_token.expect("held");
    repo.complete(org, failed, token, args).await.unwrap().expect("journaled");
    let replay = repo.claim(&call(org, "webhook.stripe", "evt-failed", &h, Uuid::new_v4())).await.unwrap();
    assert_eq!((replay.outcome, replay.response.as_ref()), (ClaimDecision::Completed, Some(&fixed)));
    time.pass_lease(failed).await;
    assert_eq!(repo.redrive(&redrive(org, "webhook.*", 10)).await.unwrap(), vec![]);
}

/// A failure sent back and failing again more often than the audit keeps
/// entries (20) still answers its first failed attempt's claim: the audit
/// keeps its first entry and the latest.
async fn the_first_failure_is_remembered_however_often_it_is_sent_back(repo: &impl Backend, _time: &impl TimeTravel) {
    let (org, h, work) = (Uuid::new_v4(), hash_text("sent back often"), json!({"n": 1}));
    let token = Uuid::new_v4();
    let claim = ClaimCall { request: Some(&work), ..call(org, "webhook.stripe", "evt-often", &h, token) };
    let claimed = repo.claim(&claim).await.unwrap();
    let failed = json!({"ok": false, "error": "still failing", "output": null});
    let args = || CompletionArgs { response: Some(&failed), ..CompletionArgs::default() };
    repo.complete(org, claimed.id, token, args()).await.unwrap().expect("journaled");
    let first = repo.failures(&failures_of(org, "webhook.stripe", 10)).await.unwrap()[0].claimed_at;
    let ids = [claimed.id];
    let send = FailuresCall { claim_ids: Some(&ids), ..failures_of(org, "webhook.stripe", 10) };
    for round in 1..=22u32 {
        let sent = repo.redrive_failed(&send).await.unwrap();
        assert_eq!((sent.len(), sent[0].requeues.min(20), sent[0].first_claimed_at), (1, round.min(20), Some(first)));
        let taken = repo.redrive(&redrive(org, "webhook.stripe", 10)).await.unwrap();
        let token = taken[0].lease_token.expect("held");
        repo.complete(org, claimed.id, token, args()).await.unwrap().expect("journaled");
    }
    let listed = repo.failures(&failures_of(org, "webhook.stripe", 10)).await.unwrap();
    assert_eq!((listed[0].requeues, listed[0].first_claimed_at), (20, Some(first)), "{listed:?}");
    assert!(listed[0].claimed_at > first);
}

/// What [`JournaledFailures::redrivable`] says of each claim `call` names.
async fn verdicts(repo: &impl Backend, call: FailuresCall<'_>) -> Vec<Redrivability> {
    repo.redrivable(&call).await.expect("a verdict").into_iter().map(|row| row.reason).collect()
}

/// Listing and sending back are bounded like every read; a call that
/// names nothing to send back, an unknown or malformed scope, or an empty
/// choice is refused, and changes nothing.
async fn failures_calls_are_bounded_and_bad_input_is_refused(repo: &impl Backend, _time: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("failure bounds"));
    let work = json!({"n": 1});
    for key in ["a", "b", "c"] {
        let token = Uuid::new_v4();
        let claim = ClaimCall { request: Some(&work), ..call(org, "webhook.svix", key, &h, token) };
        let id = repo.claim(&claim).await.unwrap().id;
        let failure = json!({"ok": false, "error": key, "output": null});
        let args = CompletionArgs { response: Some(&failure), ..CompletionArgs::default() };
        repo.complete(org, id, token, args).await.unwrap().expect("journaled");
    }
    let above = failures_of(org, "webhook.*", JournaledFailures::max_bound(repo) + 1);
    assert!(matches!(repo.failures(&above).await, Err(Error::Store(ClientError::BoundAboveCap { .. }))));
    let since = Some(chrono::Utc::now() - chrono::TimeDelta::hours(1));
    let above = FailuresCall { since, ..above };
    assert!(matches!(repo.redrive_failed(&above).await, Err(Error::Store(ClientError::BoundAboveCap { .. }))));
    for unknown in ["nope.*", "nope.x"] {
        let refused = repo.failures(&failures_of(org, unknown, 10)).await;
        assert!(matches!(refused, Err(Error::UnknownScope { .. })), "{unknown}: {refused:?}");
    }
    for malformed in ["Webhook.*", "webhook.", "**", ".*"] {
        assert_eq!(code(repo.failures(&failures_of(org, malformed, 10)).await), "22023", "{malformed}");
    }
    assert_eq!(code(repo.redrive_failed(&failures_of(org, "webhook.*", 10)).await), "22023", "names nothing");
    let none: [Uuid; 0] = [];
    let empty = FailuresCall { claim_ids: Some(&none), ..failures_of(org, "webhook.*", 10) };
    assert_eq!(code(repo.redrive_failed(&empty).await), "22023", "an empty choice");
    assert_eq!(repo.failures(&failures_of(org, "webhook.svix", 10)).await.unwrap().len(), 3, "nothing changed");
    assert_eq!(repo.failures(&failures_of(org, EVERY_SCOPE, 10)).await.unwrap().len(), 3, "every scope: *");

    // Why a named claim would not be sent back, read as a send-back reads it.
    let listed = repo.failures(&failures_of(org, "webhook.svix", 10)).await.unwrap();
    let ids = [listed[0].id, Uuid::new_v4()];
    let named = FailuresCall { claim_ids: Some(&ids), ..failures_of(org, "webhook.*", 1) };
    assert_eq!(verdicts(repo, named).await, [Redrivability::Redrivable, Redrivability::Absent]);
    let one = FailuresCall { claim_ids: Some(&ids[..1]), ..named };
    assert_eq!(verdicts(repo, FailuresCall { scope: "tool.*", ..one }).await, [Redrivability::OtherScope]);
    let stranger = Some(Uuid::new_v4());
    assert_eq!(
        verdicts(repo, FailuresCall { organization_id: stranger, ..one }).await,
        [Redrivability::OtherOrganization]
    );
    let future = Some(chrono::Utc::now() + chrono::TimeDelta::hours(1));
    assert_eq!(verdicts(repo, FailuresCall { since: future, ..one }).await, [Redrivability::BeforeSince]);
    assert_eq!(verdicts(repo, FailuresCall { scope: EVERY_SCOPE, ..one }).await, [Redrivability::Redrivable]);
    let row = repo.redrivable(&one).await.unwrap().remove(0);
    assert_eq!(
        (row.scope.as_deref(), row.key.as_deref(), row.error.as_deref(), row.attempts),
        (Some("webhook.svix"), Some("a"), Some("a"), Some(1))
    );
    let too_many = vec![Uuid::new_v4(); usize::try_from(JournaledFailures::max_bound(repo)).unwrap() + 1];
    let refused = repo.redrivable(&FailuresCall { claim_ids: Some(&too_many), ..one }).await;
    assert!(matches!(refused, Err(Error::Store(ClientError::BoundAboveCap { .. }))), "{refused:?}");

    // Since an instant: the two pages of a bound of 2 send back all three.
    let all = FailuresCall { since, ..failures_of(org, "webhook.svix", 2) };
    assert_eq!(repo.failures(&all).await.unwrap().len(), 2);
    let later = FailuresCall { since: Some(chrono::Utc::now() + chrono::TimeDelta::hours(1)), ..all };
    assert_eq!(repo.failures(&later).await.unwrap(), vec![], "none claimed since");
    assert_eq!(repo.redrive_failed(&all).await.unwrap().len(), 2);
    assert_eq!(repo.redrive_failed(&all).await.unwrap().len(), 1);
    assert_eq!(repo.redrive_failed(&all).await.unwrap(), vec![]);
    assert_eq!(verdicts(repo, one).await, [Redrivability::Orphaned], "sent back: waiting for a re-drive");
    assert_eq!(JournaledFailures::max_bound(repo), OrphanedWork::max_bound(repo));
}

crate::support::on_every_plane!(
    in_memory: |case| {
        let repo = idempotency_plane::MemoryRepository::new();
        case(&repo, &repo).await
    },
    on_the_stack: |case, stack| {
        let repo = idempotency_plane::PostgrestRepository::new(crate::support::harness::client(&stack));
        case(&repo, &stack).await
    };
    the_one_call_claim_decides_every_outcome,
    the_v1_protocol_claims_reclaims_completes_and_releases_under_its_fence,
    retention_is_the_scopes_policy_and_an_unknown_scope_is_refused,
    a_completion_is_refused_without_an_answer_or_above_the_limit,
    the_response_limit_counts_compact_json,
    expired_claims_are_read_oldest_first_within_the_bound_and_deleted,
    runs_are_admitted_once_and_provider_jobs_belong_to_one_organization,
    a_fenced_admission_admits_only_while_its_claim_is_held,
    a_claim_carries_its_work_and_only_a_redrive_hands_it_out,
    a_heartbeat_moves_the_lease_of_its_holder_alone,
    a_redrive_dead_letters_work_handed_out_max_attempts_times,
    work_and_redrives_are_bounded_and_bad_input_is_refused,
    journaled_failures_are_listed_and_sent_back_to_redrive_once,
    the_first_failure_is_remembered_however_often_it_is_sent_back,
    failures_calls_are_bounded_and_bad_input_is_refused,
    a_batch_answers_exactly_what_single_claims_would,
    batch_completions_and_releases_are_fenced_per_item,
    a_batch_is_bounded_and_refused_whole_for_one_bad_item,
);
