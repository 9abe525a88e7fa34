//! Snapshots above the 64 KiB a claim keeps: kept as the Run's input and
//! referenced from the claim, one Run under concurrency, none when the
//! fence was lost, completed by the next start after one died between
//! admission and completion, and refused above what a Run may hold.

use std::sync::Arc;

use idempotency_plane::callers::runs::RunAdmission;
use idempotency_plane::callers::saved_search::{SavedSearchError, SavedSearchStart, Started, SNAPSHOT_RESOURCE_TYPE};
use idempotency_plane::repo::{ClaimCall, ClaimRequest, ClaimRow, CompletionArgs};
use idempotency_plane::{Error, IdempotencyRecord, IdempotencyRepository, IdempotencyService, PostgrestRepository};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::*;

use super::{claim_id, starter, stored, ProductTables, Stored, HORIZON};

/// Size and lowercase hex SHA-256 of `value` as compact JSON.
fn digest(value: &Value) -> (u64, String) {
    use sha2::{Digest, Sha256};
    let bytes = serde_json::to_vec(value).unwrap();
    (bytes.len() as u64, hex::encode(Sha256::digest(&bytes)))
}

/// The claim keeps a reference to the Run that holds `snapshot` (its id,
/// and the size and digest of the Run key with the snapshot), and names the
/// Run as its resource.
fn assert_kept_by_reference(stored: &Stored, run: &idempotency_plane::callers::runs::AdmittedRun, snapshot: &Value) {
    let (status, response, resource_type, resource_id) = stored;
    assert_eq!(status, "completed");
    let response = response.as_ref().expect("a response");
    assert_eq!(resource_type.as_deref(), Some(SNAPSHOT_RESOURCE_TYPE));
    assert_eq!(resource_id.as_deref(), Some(&*run.id.to_string()));
    assert_eq!(response["ok"], json!(true), "{response}");
    let (size, sha256) = digest(&json!({"run_key": run.start_key, "snapshot": snapshot}));
    assert_eq!(
        response["output"],
        json!({"$response_ref": {"resource_type": SNAPSHOT_RESOURCE_TYPE, "resource_id": run.id, "size": size, "sha256": sha256}}),
        "no body in the claim, a reference to the Run"
    );
    assert!(serde_json::to_vec(response).unwrap().len() < 1024, "the claim keeps a small answer");
}

#[tokio::test]
async fn a_200_kib_snapshot_starts_a_run_that_keeps_it_and_every_replay_answers_the_same_snapshot() {
    let stack = stack().await;
    let org = org();
    let first = starter(&stack, ProductTables::open().padded(200))
        .start(org, "search-large", "tick-1")
        .await
        .unwrap()
        .into_run()
        .expect("a Run");
    assert!(first.run.admitted && !first.replayed);
    assert!(digest(&first.snapshot).0 > 200 * 1024, "above the 64 KiB a claim keeps");
    assert_eq!(first.run.input, first.snapshot);
    assert_kept_by_reference(&stored(&stack).await, &first.run, &first.snapshot);

    // The product tables changed; a repeat answers the frozen snapshot, read back from the Run.
    let later = ProductTables::open().padded(200).starting_at(5);
    let replay =
        starter(&stack, later.clone()).start(org, "search-large", "tick-1").await.unwrap().into_run().expect("a Run");
    assert!(replay.replayed && replay.run.admitted);
    assert_eq!((replay.run.id, &replay.snapshot), (first.run.id, &first.snapshot));
    assert_eq!(later.freezes(), 0);

    // After the snapshot claim is swept, the Run still answers with its own input.
    sqlx::query("delete from agent.idempotency_keys").execute(stack.db()).await.unwrap();
    let again =
        starter(&stack, later.clone()).start(org, "search-large", "tick-1").await.unwrap().into_run().expect("a Run");
    assert_eq!(later.freezes(), 1, "a new claim froze again");
    assert!(again.replayed, "but the Run predates it");
    assert_eq!((again.run.id, &again.snapshot), (first.run.id, &first.snapshot), "the first snapshot wins");
    assert_kept_by_reference(&stored(&stack).await, &first.run, &first.snapshot);
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn twenty_concurrent_starts_with_a_large_snapshot_produce_one_run_and_one_snapshot() {
    let stack = stack().await;
    let source = ProductTables::open().padded(100);
    let starter = Arc::new(starter(&stack, source.clone()));
    let org = org();
    let starts = (0..20).map(|_| {
        let starter = starter.clone();
        tokio::spawn(async move { starter.start(org, "search-large-20", "tick-1").await })
    });
    let results: Vec<_> = futures::future::join_all(starts).await.into_iter().map(|j| j.expect("task")).collect();
    let mut answers = std::collections::HashSet::new();
    for result in &results {
        match result {
            Ok(Started::Run(started)) => {
                assert_eq!(started.run.input, started.snapshot);
                answers.insert((started.run.id, started.snapshot["brief"].clone()));
            }
            Err(error @ SavedSearchError::InProgress { .. }) => assert!(error.is_retryable()),
            Ok(Started::Superseded) => panic!("no lease passed, yet a start was superseded"),
            Err(other) => panic!("unexpected ending: {other:?}"),
        }
    }
    assert_eq!(source.freezes(), 1, "one snapshot");
    assert!(answers.len() <= 1, "{answers:?}");
    assert_eq!((count_runs(&stack).await, count_rows(&stack).await), (1, 1), "one Run, one claim");
    let replay = starter.start(org, "search-large-20", "tick-1").await.unwrap().into_run().expect("a Run");
    assert!(replay.replayed && replay.run.admitted);
    assert_eq!(replay.snapshot["brief"], "brief v1");
    assert_kept_by_reference(&stored(&stack).await, &replay.run, &replay.snapshot);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_large_snapshot_preparation_whose_fence_was_lost_starts_no_run() {
    let stack = stack().await;
    let org = org();
    // Worker A claims and stalls while freezing a large snapshot.
    let (slow_a, gate_a) = ProductTables::gated();
    let slow_a = slow_a.padded(200);
    let a = {
        let starter = starter(&stack, slow_a.clone());
        tokio::spawn(async move { starter.start(org, "search-fenced", "tick-1").await })
    };
    eventually("worker A starts freezing", || slow_a.freezes() > 0).await;
    // Its lease passes; worker B reclaims and is freezing too.
    pass_lease(&stack, claim_id(&stack).await).await;
    let (slow_b, gate_b) = ProductTables::gated();
    let slow_b = slow_b.padded(200).starting_at(2);
    let b = {
        let starter = starter(&stack, slow_b.clone());
        tokio::spawn(async move { starter.start(org, "search-fenced", "tick-1").await })
    };
    eventually("worker B reclaims and starts freezing", || slow_b.freezes() > 0).await;

    // A wakes first: its fenced admission is refused, and no Run exists.
    gate_a.add_permits(1);
    let lost = a.await.expect("task");
    // Superseded: not an error, and nothing for its caller to retry.
    assert!(matches!(&lost, Ok(Started::Superseded)), "{lost:?}");
    assert_eq!(count_runs(&stack).await, 0, "no Run from the loser");

    // B admits its own snapshot.
    gate_b.add_permits(1);
    let won = b.await.expect("task").unwrap().into_run().expect("a Run");
    assert!(won.run.admitted && !won.replayed);
    assert_eq!(won.snapshot["brief"], "brief v2");
    assert_eq!(count_runs(&stack).await, 1);
    assert_kept_by_reference(&stored(&stack).await, &won.run, &won.snapshot);
    // A later start of the trigger answers B's Run.
    let retried = starter(&stack, ProductTables::open())
        .start(org, "search-fenced", "tick-1")
        .await
        .unwrap()
        .into_run()
        .expect("a Run");
    assert!(retried.replayed);
    assert_eq!((retried.run.id, &retried.snapshot), (won.run.id, &won.snapshot));
    stack.stop().await.unwrap();
}

/// A claim repository whose completions never arrive, as if its worker
/// died right after admitting the Run.
struct DiesBeforeCompleting(PostgrestRepository);

impl IdempotencyRepository for DiesBeforeCompleting {
    async fn claim(&self, call: &ClaimCall<'_>) -> Result<ClaimRow, Error> {
        self.0.claim(call).await
    }
    async fn try_claim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.try_claim(request).await
    }
    async fn reclaim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.reclaim(request).await
    }
    async fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, Error> {
        self.0.get(organization_id, scope, key).await
    }
    async fn complete(
        &self,
        _: Uuid,
        _: Uuid,
        _: Uuid,
        _: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        Err(Error::Inconsistent("the worker died before completing".into()))
    }
    async fn release(&self, organization_id: Uuid, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        self.0.release(organization_id, claim_id, lease_token).await
    }
    async fn extend(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        lease: std::time::Duration,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, Error> {
        self.0.extend(organization_id, claim_id, lease_token, lease).await
    }
}

#[tokio::test]
async fn a_start_that_died_between_a_large_admission_and_its_completion_is_completed_by_the_next_with_the_first_snapshot(
) {
    let stack = stack().await;
    let org = org();
    let dies = SavedSearchStart::new(
        IdempotencyService::new(DiesBeforeCompleting(PostgrestRepository::new(client(&stack)))),
        RunAdmission::new(PostgrestRepository::new(client(&stack))),
        ProductTables::open().padded(200),
        HORIZON,
    )
    .unwrap();
    let first = dies.start(org, "search-crash", "tick-1").await.unwrap().into_run().expect("a Run");
    assert!(first.run.admitted, "the Run was admitted under the fence; it is the answer");
    assert_eq!(stored(&stack).await.0, "processing", "the claim was never completed");
    let waiting = starter(&stack, ProductTables::open()).start(org, "search-crash", "tick-1").await;
    assert!(matches!(waiting, Err(SavedSearchError::InProgress { .. })), "{waiting:?}");

    // The lease passes; the next start reclaims, finds the Run admitted
    // first and journals its input, freezing nothing.
    pass_lease(&stack, claim_id(&stack).await).await;
    let tables = ProductTables::open().starting_at(7);
    let next =
        starter(&stack, tables.clone()).start(org, "search-crash", "tick-1").await.unwrap().into_run().expect("a Run");
    assert_eq!(tables.freezes(), 0, "the Run's input is the snapshot; nothing is frozen again");
    assert!(next.replayed && next.run.admitted);
    assert_eq!((next.run.id, &next.snapshot), (first.run.id, &first.snapshot), "the first snapshot wins");
    assert_kept_by_reference(&stored(&stack).await, &first.run, &first.snapshot);
    let replay = starter(&stack, ProductTables::open())
        .start(org, "search-crash", "tick-1")
        .await
        .unwrap()
        .into_run()
        .expect("a Run");
    assert_eq!(replay.snapshot, first.snapshot);
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_snapshot_above_what_a_run_may_hold_fails_the_start_and_releases_the_claim() {
    let stack = stack().await;
    let refused = starter(&stack, ProductTables::open().padded(4 * 1024 + 1)).start(org(), "search-huge", "t").await;
    match refused {
        Err(SavedSearchError::Plane(error)) => assert!(error.is_unstorable_answer(), "{error}"),
        other => panic!("expected the store's refusal, got {other:?}"),
    }
    assert_eq!((count_rows(&stack).await, count_runs(&stack).await), (0, 0), "released, nothing admitted");
    stack.stop().await.unwrap();
}
