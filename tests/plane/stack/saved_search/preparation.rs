//! The snapshot's preparation under its claim: one snapshot and one Run
//! under concurrency, a live preparation in progress and reclaimed after
//! its lease, a lost fence that starts no Run, what remains after the
//! sweep, a null snapshot refused, and the spec's 30-second lease.

use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::callers::runs::RunAdmission;
use idempotency_plane::callers::saved_search::{
    SavedSearchError, SavedSearchStart, SnapshotError, SnapshotSource, Started,
};
use idempotency_plane::PostgrestRepository;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::*;

use super::{starter, ProductTables, HORIZON};

#[tokio::test]
async fn twenty_concurrent_preparations_produce_one_snapshot_and_one_run() {
    let stack = stack().await;
    let source = ProductTables::open();
    let starter = Arc::new(starter(&stack, source.clone()));
    let org = org();
    let starts = (0..20).map(|_| {
        let starter = starter.clone();
        tokio::spawn(async move { starter.start(org, "search-1", "tick-2026-11-30T06").await })
    });
    let results: Vec<_> = futures::future::join_all(starts).await.into_iter().map(|j| j.expect("task")).collect();

    let mut run_ids = std::collections::HashSet::new();
    for result in &results {
        match result {
            Ok(Started::Run(started)) => {
                run_ids.insert(started.run.id);
            }
            Err(error @ SavedSearchError::InProgress { .. }) => assert!(error.is_retryable()),
            Ok(Started::Superseded) => panic!("no lease passed, yet a start was superseded"),
            Err(other) => panic!("unexpected ending: {other:?}"),
        }
    }
    assert_eq!(source.freezes(), 1, "one snapshot");
    assert!(run_ids.len() <= 1);
    assert_eq!(count_runs(&stack).await, 1, "one Run");
    assert_eq!(count_rows(&stack).await, 1);
    // Everyone who retries gets that one Run with that one snapshot, and
    // as a start of this trigger, its admitter.
    let replay = starter.start(org, "search-1", "tick-2026-11-30T06").await.unwrap().into_run().expect("a Run");
    assert!(replay.replayed && replay.run.admitted);
    assert_eq!(replay.snapshot["brief"], "brief v1");
    assert_eq!(replay.run.input, replay.snapshot);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_live_preparation_is_retryable_in_progress_and_one_caller_reclaims_it_after_the_lease() {
    let stack = stack().await;
    let (source, _never_opened) = ProductTables::gated();
    let org = org();
    // A worker claims and then dies mid-freeze.
    let crashed = {
        let starter = starter(&stack, source.clone());
        tokio::spawn(async move { starter.start(org, "search-2", "tick-1").await })
    };
    eventually("the crashing worker starts freezing", || source.freezes() > 0).await;
    crashed.abort();
    let _ = crashed.await;

    let live = starter(&stack, ProductTables::open()).start(org, "search-2", "tick-1").await;
    match &live {
        Err(error @ SavedSearchError::InProgress { .. }) => assert!(error.is_retryable()),
        other => panic!("expected a retryable in-progress, got {other:?}"),
    }

    // The 30 s lease passes (moved in SQL); twenty callers race for it.
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    pass_lease(&stack, id).await;
    let after = ProductTables::open();
    let starter = Arc::new(starter(&stack, after.clone()));
    let starts = (0..20).map(|_| {
        let starter = starter.clone();
        tokio::spawn(async move { starter.start(org, "search-2", "tick-1").await })
    });
    let results: Vec<_> = futures::future::join_all(starts).await.into_iter().map(|j| j.expect("task")).collect();
    assert!(results.iter().all(|r| matches!(r, Ok(_) | Err(SavedSearchError::InProgress { .. }))), "{results:?}");
    assert_eq!(after.freezes(), 1, "exactly one caller reclaimed and froze");
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_preparation_whose_fence_was_lost_before_completion_starts_no_run() {
    let stack = stack().await;
    let (slow, gate) = ProductTables::gated();
    let org = org();
    // Worker A claims and stalls while freezing.
    let stalled = {
        let starter = starter(&stack, slow.clone());
        tokio::spawn(async move { starter.start(org, "search-3", "tick-1").await })
    };
    eventually("worker A starts freezing", || slow.freezes() > 0).await;
    // Its lease passes; worker B reclaims, freezes, completes and admits.
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    pass_lease(&stack, id).await;
    let b = starter(&stack, ProductTables::open())
        .start(org, "search-3", "tick-1")
        .await
        .unwrap()
        .into_run()
        .expect("a Run");
    assert!(b.run.admitted);

    // A wakes: its completion is fenced off and it starts no Run.
    gate.add_permits(1);
    let a = stalled.await.expect("task");
    // Superseded: it neither raises nor asks to be retried.
    assert!(matches!(a, Ok(Started::Superseded)), "{a:?}");
    assert_eq!(count_runs(&stack).await, 1, "only B's Run exists");
    let input: Value = sqlx::query_scalar("select input from agent.runs").fetch_one(stack.db()).await.unwrap();
    assert_eq!(input, b.snapshot, "the Run was built from the stored snapshot");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_snapshot_remains_for_24_hours_and_its_run_key_replays_the_run_for_396_days() {
    let stack = stack().await;
    let org = org();
    let first = starter(&stack, ProductTables::open())
        .start(org, "search-4", "tick-1")
        .await
        .unwrap()
        .into_run()
        .expect("a Run");
    assert!(first.run.admitted && !first.replayed);

    // 23 hours later the product tables changed; a repeat still answers the frozen snapshot.
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    travel_back(&stack, id, Duration::from_secs(23 * 3600)).await;
    let later = ProductTables::open();
    let repeat =
        starter(&stack, later.clone()).start(org, "search-4", "tick-1").await.unwrap().into_run().expect("a Run");
    assert!(repeat.replayed);
    assert_eq!(later.freezes(), 0);
    assert_eq!(repeat.snapshot, first.snapshot);
    assert_eq!(repeat.run.id, first.run.id);
    let retain_hours: f64 = sqlx::query_scalar(
        "select extract(epoch from retain_until - claimed_at)::float8 / 3600 from agent.idempotency_keys",
    )
    .fetch_one(stack.db())
    .await
    .unwrap();
    // 24 hours from the completion, a few milliseconds after the claim.
    assert!((24.0..24.0 + 1.0 / 60.0).contains(&retain_hours), "kept for 24 hours: {retain_hours}");

    // 395 days later, the stable Run key still replays the admitted Run.
    sqlx::query("update agent.runs set admitted_at = admitted_at - interval '395 days', retain_until = retain_until - interval '395 days'")
        .execute(stack.db())
        .await
        .unwrap();
    let replay = RunAdmission::new(PostgrestRepository::new(client(&stack)))
        .admit(org, &first.run.start_key, &json!({"other": true}))
        .await
        .unwrap();
    assert!(!replay.admitted);
    assert_eq!(replay.id, first.run.id);
    assert_eq!(replay.input, first.snapshot, "with the input it was admitted with");
    assert!(replay.retain_until > chrono::Utc::now(), "inside the 396-day window");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_start_after_the_snapshot_claim_was_swept_answers_the_same_run() {
    let stack = stack().await;
    let org = org();
    let first = starter(&stack, ProductTables::open())
        .start(org, "search-5", "tick-1")
        .await
        .unwrap()
        .into_run()
        .expect("a Run");
    // A day later the sweeper removed the snapshot claim; the trigger fires again.
    sqlx::query("delete from agent.idempotency_keys").execute(stack.db()).await.unwrap();
    let later = ProductTables::open();
    let again =
        starter(&stack, later.clone()).start(org, "search-5", "tick-1").await.unwrap().into_run().expect("a Run");
    assert_eq!(again.run.id, first.run.id, "the Run key is stable beyond the claim");
    assert!(again.replayed, "the Run predates this start's claim");
    assert!(again.run.admitted, "a start of the same trigger is the Run's admitter");
    assert_eq!(again.snapshot, first.snapshot, "the Run's own input, not the new freeze");
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

/// A source whose tables hold nothing to freeze.
struct EmptyTables;

impl SnapshotSource for EmptyTables {
    async fn freeze(&self, _: Uuid, _: &str) -> Result<Value, SnapshotError> {
        Ok(Value::Null)
    }
}

#[tokio::test]
async fn a_null_snapshot_is_refused_and_the_claim_released() {
    let stack = stack().await;
    let starter = SavedSearchStart::new(
        service(&stack),
        RunAdmission::new(PostgrestRepository::new(client(&stack))),
        EmptyTables,
        HORIZON,
    )
    .unwrap();
    let refused = starter.start(org(), "search-6", "tick-1").await;
    match refused {
        Err(error @ SavedSearchError::Snapshot(_)) => assert!(error.is_retryable()),
        other => panic!("expected a snapshot error, got {other:?}"),
    }
    assert_eq!(count_rows(&stack).await, 0, "released, so the next start freezes again");
    assert_eq!(count_runs(&stack).await, 0);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_saved_search_preparation_carries_the_specs_30_second_lease() {
    let stack = stack().await;
    let (source, gate) = ProductTables::gated();
    let org = org();
    let preparing = {
        let starter = starter(&stack, source.clone());
        tokio::spawn(async move { starter.start(org, "search-lease", "tick-1").await })
    };
    // Read the lease while the freeze is held open, before the completion.
    eventually("the preparation reaches its freeze", || source.freezes() > 0).await;
    assert_eq!(source.freezes(), 1, "one preparation froze");
    assert_eq!(stored_lease_ms(&stack).await, 30_000.0, "surface.saved_search.start: lease 30 s");
    gate.add_permits(1);
    assert!(preparing.await.expect("task").is_ok());
    stack.stop().await.unwrap();
}

/// A source that freezes one given value, and counts its freezes.
struct Fixed(Value, std::sync::atomic::AtomicUsize);

impl SnapshotSource for Fixed {
    async fn freeze(&self, _: Uuid, _: &str) -> Result<Value, SnapshotError> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(self.0.clone())
    }
}

/// The first start answers exactly the snapshot and Run every replay
/// answers, whatever the snapshot holds: members in no sorted order, a
/// 70,000-character string (kept as the Run's input, by reference from the
/// claim). A snapshot the store cannot hold as it is (U+0000, nested deeper
/// than `jsonb` holds) is refused to the first start and to the next alike,
/// and nothing is kept: a Run's input has no lossless wrapper.
#[tokio::test]
async fn the_first_start_answers_what_every_replay_answers() {
    let stack = stack().await;
    let deep = (0..100).fold(json!(1), |inner, _| json!([inner]));
    let cases = [
        ("unsorted", json!({"z": 1, "a": {"y": [3, 2], "b": "brief"}}), true),
        ("long", json!({"brief": "b".repeat(70_000)}), true),
        ("nul", json!({"brief": "a\u{0}b"}), false),
        ("deep", deep, false),
    ];
    for (name, snapshot, storable) in cases {
        let source = Fixed(snapshot.clone(), Default::default());
        let starter = SavedSearchStart::new(
            service(&stack),
            RunAdmission::new(PostgrestRepository::new(client(&stack))),
            source,
            HORIZON,
        )
        .unwrap();
        let org = org();
        let first = starter.start(org, name, "tick-1").await;
        let again = starter.start(org, name, "tick-1").await;
        match (first, again) {
            (Ok(Started::Run(first)), Ok(Started::Run(again))) if storable => {
                assert_eq!((first.run.id, &first.snapshot), (again.run.id, &again.snapshot), "{name}");
                assert_eq!(first.snapshot, snapshot, "{name}");
                assert!(!first.replayed && again.replayed, "{name}");
                // The claim records the frozen input and the Run key; of the
                // Run, only where a snapshot too large for the claim lives.
                let (resource_type,): (Option<String>,) =
                    sqlx::query_as("select resource_type from agent.idempotency_keys where organization_id = $1")
                        .bind(org)
                        .fetch_one(stack.db())
                        .await
                        .unwrap();
                let expected = (name == "long").then(|| "agent.run".to_owned());
                assert_eq!(resource_type, expected, "{name}");
            }
            (Err(first), Err(again)) if !storable => {
                assert!(first.to_string() == again.to_string(), "{name}: {first} / {again}");
                assert!(
                    matches!(first, SavedSearchError::Plane(ref error) if error.is_unstorable_answer()),
                    "{name}: {first:?}"
                );
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    stack.stop().await.unwrap();
}
