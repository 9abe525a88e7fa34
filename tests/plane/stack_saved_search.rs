//! Saved-search start and Run admission on the real stack.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::callers::runs::{AdmissionToken, RunAdmission};
use idempotency_plane::callers::saved_search::{SavedSearchError, SavedSearchStart, SnapshotError, SnapshotSource};
use idempotency_plane::{PostgrestRepository, RetryConfig};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::harness::*;
use crate::support::FaultServer;

/// Mutable product data: every freeze reads a newer version, so a test can
/// tell which freeze was stored. Freezes wait for a permit when `gated`.
#[derive(Clone)]
struct ProductTables {
    freezes: Arc<AtomicUsize>,
    gate: Option<Arc<Semaphore>>,
}

impl ProductTables {
    fn open() -> Self {
        ProductTables { freezes: Arc::new(AtomicUsize::new(0)), gate: None }
    }

    fn gated() -> (Self, Arc<Semaphore>) {
        let gate = Arc::new(Semaphore::new(0));
        (ProductTables { freezes: Arc::new(AtomicUsize::new(0)), gate: Some(gate.clone()) }, gate)
    }

    fn freezes(&self) -> usize {
        self.freezes.load(Ordering::SeqCst)
    }
}

impl SnapshotSource for ProductTables {
    async fn freeze(&self, organization_id: Uuid, saved_search_id: &str) -> Result<Value, SnapshotError> {
        let version = self.freezes.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(gate) = &self.gate {
            let permit = gate.acquire().await.map_err(|e| SnapshotError(e.to_string()))?;
            permit.forget();
        }
        Ok(json!({
            "organization_id": organization_id,
            "saved_search_id": saved_search_id,
            "brief": format!("brief v{version}"),
            "baseline": [version],
        }))
    }
}

type Starter = SavedSearchStart<PostgrestRepository, ProductTables>;

fn starter(stack: &idempotency_plane::local::LocalStack, source: ProductTables) -> Starter {
    SavedSearchStart::new(service(stack), RunAdmission::new(client(stack)), source)
}

#[tokio::test]
async fn a_direct_capability_start_writes_no_row_in_the_idempotency_table() {
    let stack = stack().await;
    let runs = RunAdmission::new(client(&stack));
    let org = org();
    let first = runs.admit(org, "capability:summarize:req-1", &json!({"doc": 1})).await.unwrap();
    let again = runs.admit(org, "capability:summarize:req-1", &json!({"doc": 1})).await.unwrap();
    assert!(first.admitted && !again.admitted);
    assert_eq!(first.id, again.id);
    assert_eq!(count_runs(&stack).await, 1);
    assert_eq!(count_rows(&stack).await, 0, "Run admission never writes a claim");
    stack.stop().await.unwrap();
}

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
            Ok(started) => {
                run_ids.insert(started.run.id);
            }
            Err(error @ SavedSearchError::InProgress { .. }) => assert!(error.is_retryable()),
            Err(other) => panic!("unexpected ending: {other:?}"),
        }
    }
    assert_eq!(source.freezes(), 1, "one snapshot");
    assert!(run_ids.len() <= 1);
    assert_eq!(count_runs(&stack).await, 1, "one Run");
    assert_eq!(count_rows(&stack).await, 1);
    // Everyone who retries gets that one Run with that one snapshot.
    let replay = starter.start(org, "search-1", "tick-2026-11-30T06").await.unwrap();
    assert!(replay.replayed && !replay.run.admitted);
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
    let b = starter(&stack, ProductTables::open()).start(org, "search-3", "tick-1").await.unwrap();
    assert!(b.run.admitted);

    // A wakes: its completion is fenced off and it starts no Run.
    gate.add_permits(1);
    let a = stalled.await.expect("task");
    assert!(matches!(a, Err(SavedSearchError::FenceLost { .. })), "{a:?}");
    assert_eq!(count_runs(&stack).await, 1, "only B's Run exists");
    let input: Value = sqlx::query_scalar("select input from agent.runs").fetch_one(stack.db()).await.unwrap();
    assert_eq!(input, b.snapshot, "the Run was built from the stored snapshot");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_snapshot_remains_for_24_hours_and_its_run_key_replays_the_run_for_396_days() {
    let stack = stack().await;
    let org = org();
    let first = starter(&stack, ProductTables::open()).start(org, "search-4", "tick-1").await.unwrap();
    assert!(first.run.admitted && !first.replayed);

    // 23 hours later the product tables changed; a repeat still answers the frozen snapshot.
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    travel_back(&stack, id, Duration::from_secs(23 * 3600)).await;
    let later = ProductTables::open();
    let repeat = starter(&stack, later.clone()).start(org, "search-4", "tick-1").await.unwrap();
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
    let replay =
        RunAdmission::new(client(&stack)).admit(org, &first.run.start_key, &json!({"other": true})).await.unwrap();
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
    let first = starter(&stack, ProductTables::open()).start(org, "search-5", "tick-1").await.unwrap();
    // A day later the sweeper removed the snapshot claim; the trigger fires again.
    sqlx::query("delete from agent.idempotency_keys").execute(stack.db()).await.unwrap();
    let later = ProductTables::open();
    let again = starter(&stack, later.clone()).start(org, "search-5", "tick-1").await.unwrap();
    assert_eq!(again.run.id, first.run.id, "the Run key is stable beyond the claim");
    assert!(again.replayed && !again.run.admitted);
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
    let starter = SavedSearchStart::new(service(&stack), RunAdmission::new(client(&stack)), EmptyTables);
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

#[tokio::test]
async fn an_admission_whose_answer_was_lost_beyond_the_clients_retries_is_admitted_to_a_rerun_with_its_token() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let runs = RunAdmission::new(proxy.client(stack.service_key(), RetryConfig::disabled()));
    let (org, input) = (org(), json!({"capability": "summarize", "request": "req-9"}));
    // The orchestrator step's own token, the same on every re-run.
    let step = AdmissionToken::derived(org, "run-7:step-admit");

    proxy.lose_answer(1);
    let lost = runs.admit_as(org, "capability:summarize:req-9", &input, step).await;
    assert!(lost.is_err(), "the answer is lost and the client does not retry: {lost:?}");
    assert_eq!(count_runs(&stack).await, 1, "the Run was admitted all the same");

    let rerun = runs.admit_as(org, "capability:summarize:req-9", &input, step).await.unwrap();
    assert!(rerun.admitted, "the step that admitted the Run, re-run: still its admitter");
    let other = runs.admit_as(org, "capability:summarize:req-9", &input, AdmissionToken::random()).await.unwrap();
    assert!(!other.admitted, "another token is a replay");
    let default = runs.admit(org, "capability:summarize:req-9", &input).await.unwrap();
    assert!(!default.admitted, "so is the default's fresh token");
    assert_eq!((other.id, default.id), (rerun.id, rerun.id));
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}
