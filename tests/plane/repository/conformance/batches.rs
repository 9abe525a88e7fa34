//! Batches: the same decisions as N single calls, in one round trip.

use idempotency_plane::postgrest::codes;
use idempotency_plane::repo::{
    ClaimDecision, ClaimFence, ClaimItem, ClaimManyCall, ClaimRow, CompletionArgs, CompletionItem, OrphanedWork,
};
use idempotency_plane::{ClientError, Error};
use serde_json::json;
use uuid::Uuid;

use super::{call, code, hash_text};
use crate::support::backends::{Backend, TimeTravel};
use crate::support::LEASE;
use idempotency_plane::repo::ClaimCall;

const SCOPE: &str = "tool.batch";

/// What a batch and the single claims must agree on: the decision, whether
/// the caller holds the claim (and under its own token), and what it may
/// see of the stored answer.
fn seen(row: &ClaimRow, token: Uuid) -> (ClaimDecision, bool, bool, Option<serde_json::Value>, Option<String>) {
    let holds = row.lease_token == Some(token);
    (row.outcome, holds, row.lease_token.is_some(), row.response.clone(), row.request_hash.clone())
}

/// Makes, under `org`, a completed key, a key held by another worker, a
/// key of another request, and an orphan whose lease passed.
async fn every_state(repo: &impl Backend, time: &impl TimeTravel, org: Uuid, h: &str) {
    let done = repo.claim(&call(org, SCOPE, "done", h, Uuid::new_v4())).await.unwrap();
    let answer = json!({"ok": true, "sent": 1});
    let args = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    let token = done.lease_token.unwrap();
    repo.complete(org, done.id, token, args).await.unwrap().expect("completed");
    repo.claim(&call(org, SCOPE, "held", h, Uuid::new_v4())).await.unwrap();
    repo.claim(&call(org, SCOPE, "other", &hash_text("another request"), Uuid::new_v4())).await.unwrap();
    let orphan = repo.claim(&call(org, SCOPE, "orphan", h, Uuid::new_v4())).await.unwrap();
    time.pass_lease(orphan.id).await;
}

/// A batch that mixes every outcome answers, item by item, exactly what the
/// same claims made one by one answer; a repeat of the batch (its answer
/// lost) answers each item's own claim again.
pub(super) async fn a_batch_answers_exactly_what_single_claims_would(repo: &impl Backend, time: &impl TimeTravel) {
    let h = hash_text("batch");
    let other = hash_text("a changed request");
    let plan: [(&str, &str); 10] = [
        ("fresh", &h),
        ("done", &h),
        ("held", &h),
        ("other", &h),
        ("orphan", &h),
        ("fresh", &h),
        ("fresh", &other),
        ("second", &h),
        // A key whose first occurrence carries work and whose second does not:
        // the first claims it, with its work.
        ("worked", &h),
        ("worked", &h),
    ];
    let work = json!({"order": 7});
    let request = |index: usize| (index == 8).then_some(&work);
    let tokens: Vec<Uuid> = plan.iter().map(|_| Uuid::new_v4()).collect();

    let (singles_org, batch_org) = (Uuid::new_v4(), Uuid::new_v4());
    every_state(repo, time, singles_org, &h).await;
    every_state(repo, time, batch_org, &h).await;

    let mut singles = Vec::new();
    for (index, ((key, hash), token)) in plan.iter().zip(&tokens).enumerate() {
        let single = ClaimCall { request: request(index), ..call(singles_org, SCOPE, key, hash, *token) };
        singles.push(repo.claim(&single).await.unwrap());
    }
    let items: Vec<ClaimItem<'_>> = plan
        .iter()
        .zip(&tokens)
        .enumerate()
        .map(|(index, ((key, hash), token))| ClaimItem {
            key,
            request_hash: hash,
            lease_token: *token,
            request: request(index),
        })
        .collect();
    let batch = ClaimManyCall { organization_id: batch_org, scope: SCOPE, lease: LEASE, items: &items };
    let answered = repo.claim_many(&batch).await.unwrap();

    assert_eq!(answered.len(), plan.len(), "one row per item");
    let outcomes: Vec<ClaimDecision> = answered.iter().map(|row| row.outcome).collect();
    use ClaimDecision::*;
    assert_eq!(
        outcomes,
        [Claimed, Completed, Processing, Conflict, Reclaimed, Processing, Conflict, Claimed, Claimed, Processing]
    );
    assert_eq!(answered[8].lease_token, Some(tokens[8]), "the occurrence carrying work holds the key");
    for (index, ((single, batched), token)) in singles.iter().zip(&answered).zip(&tokens).enumerate() {
        assert_eq!(seen(single, *token), seen(batched, *token), "item {index}: {:?}", plan[index]);
        assert_eq!(batched.key, plan[index].0, "item {index} answers its own key");
        assert_eq!(batched.organization_id, batch_org);
    }
    assert_eq!(answered[0].id, answered[5].id, "a key repeated in a batch is one claim, decided once");
    assert_eq!(answered[1].response, Some(json!({"ok": true, "sent": 1})), "a completed key replays its answer");

    let repeated = repo.claim_many(&batch).await.unwrap();
    let again: Vec<_> = repeated.iter().map(|row| (row.outcome, row.id, row.lease_token)).collect();
    let first: Vec<_> = answered.iter().map(|row| (row.outcome, row.id, row.lease_token)).collect();
    assert_eq!(again, first, "a repeated batch answers each item's own claim");
}

/// Completions and releases are fenced per item and answered in order.
pub(super) async fn batch_completions_and_releases_are_fenced_per_item(repo: &impl Backend, _: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("endings"));
    let keys = ["a", "b", "c", "d"];
    let items: Vec<ClaimItem<'_>> = keys
        .iter()
        .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: None })
        .collect();
    let claimed = repo
        .claim_many(&ClaimManyCall { organization_id: org, scope: SCOPE, lease: LEASE, items: &items })
        .await
        .unwrap();
    let fence = |row: &ClaimRow| ClaimFence { claim_id: row.id, lease_token: row.lease_token.expect("held") };
    let answer = json!({"ok": true});
    let stored = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    let resource = CompletionArgs { resource_type: Some("email.message"), resource_id: Some("m-2"), response: None };
    let stranger = ClaimFence { claim_id: claimed[2].id, lease_token: Uuid::new_v4() };
    let completions = [
        CompletionItem { fence: fence(&claimed[0]), completion: stored },
        CompletionItem { fence: fence(&claimed[1]), completion: resource },
        CompletionItem { fence: stranger, completion: stored },
    ];
    let done = repo.complete_many(org, &completions).await.unwrap();
    let ids: Vec<Option<Uuid>> = done.iter().map(|row| row.as_ref().map(|row| row.id)).collect();
    assert_eq!(ids, [Some(claimed[0].id), Some(claimed[1].id), None], "the fence is checked per item");
    assert_eq!(done[1].as_ref().and_then(|row| row.resource_id.clone()).as_deref(), Some("m-2"));
    let repeated = repo.complete_many(org, &completions).await.unwrap();
    assert_eq!(
        repeated.iter().map(Option::is_some).collect::<Vec<_>>(),
        [true, true, false],
        "a repeat answers the same"
    );

    let elsewhere = repo.complete_many(Uuid::new_v4(), &completions[..1]).await.unwrap();
    assert_eq!(elsewhere, [None], "a claim of another organization is not completed");

    let released = repo.release_many(org, &[fence(&claimed[3]), stranger, fence(&claimed[0])]).await.unwrap();
    assert_eq!(released, [true, false, false], "held: released; another token: no; completed: never released");
    let gone = repo.get(org, SCOPE, "d").await.unwrap();
    assert_eq!(gone, None, "a released key is free again");
    assert_eq!(
        repo.claim_many(&ClaimManyCall { organization_id: org, scope: SCOPE, lease: LEASE, items: &[] }).await.unwrap(),
        []
    );
}

/// A batch above the row cap, or with a bad item anywhere, is refused whole,
/// names the item, and writes nothing.
pub(super) async fn a_batch_is_bounded_and_refused_whole_for_one_bad_item(repo: &impl Backend, _: &impl TimeTravel) {
    let (org, h) = (Uuid::new_v4(), hash_text("bounded"));
    let cap = repo.max_batch();
    assert_eq!(cap, OrphanedWork::max_bound(repo), "a batch is bounded by the row cap");
    let keys: Vec<String> = (0..=cap).map(|i| format!("k-{i}")).collect();
    let items: Vec<ClaimItem<'_>> = keys
        .iter()
        .map(|key| ClaimItem { key, request_hash: &h, lease_token: Uuid::new_v4(), request: None })
        .collect();
    let many = |items| ClaimManyCall { organization_id: org, scope: SCOPE, lease: LEASE, items };
    let above = repo.claim_many(&many(&items)).await;
    assert!(
        matches!(above, Err(Error::Store(ClientError::BoundAboveCap { bound, cap: c })) if bound == cap + 1 && c == cap),
        "{above:?}"
    );
    assert_eq!(repo.get(org, SCOPE, "k-0").await.unwrap(), None, "nothing written");

    let malformed = "not-a-hash";
    let mut bad = items[..5].to_vec();
    bad[3].request_hash = malformed;
    let refused = repo.claim_many(&many(&bad)).await;
    assert_item_refused(refused, codes::INVALID_PARAMETER_VALUE, 3);
    assert_eq!(repo.get(org, SCOPE, "k-0").await.unwrap(), None, "nothing written for a bad item");

    let mut repeated = items[..3].to_vec();
    repeated[2].lease_token = repeated[0].lease_token;
    assert_item_refused(repo.claim_many(&many(&repeated)).await, codes::INVALID_PARAMETER_VALUE, 2);

    let big = json!({"blob": "x".repeat(70_000)});
    let mut heavy = items[..3].to_vec();
    heavy[2].request = Some(&big);
    assert_item_refused(repo.claim_many(&many(&heavy)).await, codes::REQUEST_TOO_LARGE, 2);
    assert_eq!(repo.get(org, SCOPE, "k-0").await.unwrap(), None, "an item over the limit writes nothing either");

    let unknown = ClaimManyCall { scope: "nowhere.known", ..many(&items[..2]) };
    assert!(matches!(repo.claim_many(&unknown).await, Err(Error::UnknownScope { .. })));

    let claimed = repo.claim_many(&many(&items[..2])).await.unwrap();
    let held = ClaimFence { claim_id: claimed[0].id, lease_token: items[0].lease_token };
    let nothing = CompletionArgs::default();
    let answer = json!({"ok": true});
    let fine = CompletionArgs { response: Some(&answer), ..CompletionArgs::default() };
    let completions =
        [CompletionItem { fence: held, completion: fine }, CompletionItem { fence: held, completion: nothing }];
    assert_eq!(code(repo.complete_many(org, &completions).await), codes::INVALID_PARAMETER_VALUE);
    let still = repo.get(org, SCOPE, "k-0").await.unwrap().expect("claimed");
    assert_eq!(still.response, None, "the good item of a refused batch is not completed");
    let fences: Vec<ClaimFence> = (0..=cap).map(|_| held).collect();
    assert!(matches!(repo.release_many(org, &fences).await, Err(Error::Store(ClientError::BoundAboveCap { .. }))));
    assert!(repo.get(org, SCOPE, "k-0").await.unwrap().is_some(), "nothing released");
}

fn assert_item_refused<T: std::fmt::Debug>(result: Result<T, Error>, expected: &str, index: usize) {
    match result {
        Err(Error::Store(ClientError::Api { error, .. })) => {
            assert_eq!(error.code, expected, "{error:?}");
            let named = format!("p_items[{index}]");
            assert!(error.message.contains(&named), "the refusal names {named}: {}", error.message);
        }
        other => panic!("expected a refusal of item {index}, got {other:?}"),
    }
}
