//! Saved-search start and Run admission on the real stack.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::callers::runs::{AdmissionToken, RunAdmission};
use idempotency_plane::callers::saved_search::{
    SavedSearchError, SavedSearchStart, SnapshotError, SnapshotSource, SNAPSHOT_RESOURCE_TYPE,
};
use idempotency_plane::callers::tool::RetryHorizon;
use idempotency_plane::postgrest::{ClientError, Repeat};
use idempotency_plane::repo::{ClaimCall, ClaimRequest, ClaimRow, CompletionArgs};
use idempotency_plane::{
    Error, IdempotencyRecord, IdempotencyRepository, IdempotencyService, PostgrestRepository, RetryConfig,
};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::transport::FaultServer;

/// Mutable product data: every freeze reads a newer version, so a test can
/// tell which freeze was stored. Freezes wait for a permit when `gated`; a
/// `padded` baseline makes the snapshot that many bytes larger.
#[derive(Clone)]
struct ProductTables {
    freezes: Arc<AtomicUsize>,
    first_version: usize,
    gate: Option<Arc<Semaphore>>,
    padding: usize,
}

impl ProductTables {
    fn open() -> Self {
        ProductTables { freezes: Arc::new(AtomicUsize::new(0)), first_version: 1, gate: None, padding: 0 }
    }

    fn gated() -> (Self, Arc<Semaphore>) {
        let gate = Arc::new(Semaphore::new(0));
        (ProductTables { gate: Some(gate.clone()), ..ProductTables::open() }, gate)
    }

    /// Snapshots above the 64 KiB a claim keeps: `kib` KiB of baseline.
    fn padded(self, kib: usize) -> Self {
        ProductTables { padding: kib * 1024, ..self }
    }

    /// Tables whose first freeze reads version `version`.
    fn starting_at(self, version: usize) -> Self {
        ProductTables { first_version: version, ..self }
    }

    fn freezes(&self) -> usize {
        self.freezes.load(Ordering::SeqCst)
    }
}

impl SnapshotSource for ProductTables {
    async fn freeze(&self, organization_id: Uuid, saved_search_id: &str) -> Result<Value, SnapshotError> {
        let version = self.freezes.fetch_add(1, Ordering::SeqCst) + self.first_version;
        if let Some(gate) = &self.gate {
            let permit = gate.acquire().await.map_err(|e| SnapshotError(e.to_string()))?;
            permit.forget();
        }
        let mut snapshot = json!({
            "organization_id": organization_id,
            "saved_search_id": saved_search_id,
            "brief": format!("brief v{version}"),
            "baseline": [version],
        });
        if self.padding > 0 {
            snapshot["rows"] = json!("r".repeat(self.padding));
        }
        Ok(snapshot)
    }
}

/// A scheduler that retries a start for ten minutes: the 30 s lease passes
/// well before its last retry.
const HORIZON: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));

type Starter<R = PostgrestRepository> = SavedSearchStart<R, ProductTables, PostgrestRepository>;

fn starter(stack: &idempotency_plane::local::LocalStack, source: ProductTables) -> Starter {
    SavedSearchStart::new(service(stack), RunAdmission::new(PostgrestRepository::new(client(stack))), source, HORIZON)
        .expect("a starter")
}

/// A claim's status, response, resource type and resource id.
type Stored = (String, Option<Value>, Option<String>, Option<String>);

/// The only claim's stored answer and resource, by a superuser connection.
async fn stored(stack: &idempotency_plane::local::LocalStack) -> Stored {
    sqlx::query_as("select status, response, resource_type, resource_id from agent.idempotency_keys")
        .fetch_one(stack.db())
        .await
        .expect("the claim")
}

/// The only claim's id.
async fn claim_id(stack: &idempotency_plane::local::LocalStack) -> Uuid {
    sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.expect("the claim")
}

#[tokio::test]
async fn a_direct_capability_start_writes_no_row_in_the_idempotency_table() {
    let stack = stack().await;
    let runs = RunAdmission::new(PostgrestRepository::new(client(&stack)));
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
    // Everyone who retries gets that one Run with that one snapshot, and
    // as a start of this trigger, its admitter.
    let replay = starter.start(org, "search-1", "tick-2026-11-30T06").await.unwrap();
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
    let first = starter(&stack, ProductTables::open()).start(org, "search-5", "tick-1").await.unwrap();
    // A day later the sweeper removed the snapshot claim; the trigger fires again.
    sqlx::query("delete from agent.idempotency_keys").execute(stack.db()).await.unwrap();
    let later = ProductTables::open();
    let again = starter(&stack, later.clone()).start(org, "search-5", "tick-1").await.unwrap();
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

#[tokio::test]
async fn an_admission_whose_answer_was_lost_beyond_the_clients_retries_is_admitted_to_a_rerun_with_its_token() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let runs = RunAdmission::new(PostgrestRepository::new(proxy.client(stack.service_key(), RetryConfig::disabled())));
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

#[tokio::test]
async fn a_start_rerun_after_its_admission_answer_was_lost_beyond_the_clients_retries_is_still_its_admitter() {
    let stack = stack().await;
    let proxy = FaultServer::lossy_proxy(stack.url()).await;
    let lossy = RunAdmission::new(PostgrestRepository::new(proxy.client(stack.service_key(), RetryConfig::disabled())));
    let starter = SavedSearchStart::new(service(&stack), lossy, ProductTables::open(), HORIZON).unwrap();
    let org = org();

    // The snapshot is completed, the Run admitted, and the admission's answer lost.
    proxy.lose_answer(1);
    let lost = starter.start(org, "search-lost", "tick-1").await;
    assert!(matches!(lost, Err(SavedSearchError::Plane(_))), "{lost:?}");
    assert_eq!(count_runs(&stack).await, 1);

    // The scheduler runs the start again: the same trigger admitted that Run.
    let again = starter.start(org, "search-lost", "tick-1").await.unwrap();
    assert!(again.run.admitted, "every start of the trigger carries its admission token: {again:?}");
    assert!(again.replayed, "the snapshot was frozen by the first start");
    assert_eq!(again.snapshot["brief"], "brief v1");
    let other = RunAdmission::new(PostgrestRepository::new(client(&stack)))
        .admit(org, &again.run.start_key, &json!({"x": 1}))
        .await
        .unwrap();
    assert!(!other.admitted && other.id == again.run.id, "anyone else admitting under its key is not its admitter");
    assert_eq!(count_runs(&stack).await, 1);
    stack.stop().await.unwrap();
}

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
    let first = starter(&stack, ProductTables::open().padded(200)).start(org, "search-large", "tick-1").await.unwrap();
    assert!(first.run.admitted && !first.replayed);
    assert!(digest(&first.snapshot).0 > 200 * 1024, "above the 64 KiB a claim keeps");
    assert_eq!(first.run.input, first.snapshot);
    assert_kept_by_reference(&stored(&stack).await, &first.run, &first.snapshot);

    // The product tables changed; a repeat answers the frozen snapshot, read back from the Run.
    let later = ProductTables::open().padded(200).starting_at(5);
    let replay = starter(&stack, later.clone()).start(org, "search-large", "tick-1").await.unwrap();
    assert!(replay.replayed && replay.run.admitted);
    assert_eq!((replay.run.id, &replay.snapshot), (first.run.id, &first.snapshot));
    assert_eq!(later.freezes(), 0);

    // After the snapshot claim is swept, the Run still answers with its own input.
    sqlx::query("delete from agent.idempotency_keys").execute(stack.db()).await.unwrap();
    let again = starter(&stack, later.clone()).start(org, "search-large", "tick-1").await.unwrap();
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
            Ok(started) => {
                assert_eq!(started.run.input, started.snapshot);
                answers.insert((started.run.id, started.snapshot["brief"].clone()));
            }
            Err(error @ SavedSearchError::InProgress { .. }) => assert!(error.is_retryable()),
            Err(other) => panic!("unexpected ending: {other:?}"),
        }
    }
    assert_eq!(source.freezes(), 1, "one snapshot");
    assert!(answers.len() <= 1, "{answers:?}");
    assert_eq!((count_runs(&stack).await, count_rows(&stack).await), (1, 1), "one Run, one claim");
    let replay = starter.start(org, "search-large-20", "tick-1").await.unwrap();
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
    assert!(matches!(&lost, Err(error @ SavedSearchError::FenceLost { .. }) if error.is_retryable()), "{lost:?}");
    assert_eq!(count_runs(&stack).await, 0, "no Run from the loser");

    // B admits its own snapshot.
    gate_b.add_permits(1);
    let won = b.await.expect("task").unwrap();
    assert!(won.run.admitted && !won.replayed);
    assert_eq!(won.snapshot["brief"], "brief v2");
    assert_eq!(count_runs(&stack).await, 1);
    assert_kept_by_reference(&stored(&stack).await, &won.run, &won.snapshot);
    // A's retry answers B's Run.
    let retried = starter(&stack, ProductTables::open()).start(org, "search-fenced", "tick-1").await.unwrap();
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
    async fn complete(&self, _: Uuid, _: Uuid, _: CompletionArgs<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        Err(Error::Inconsistent("the worker died before completing".into()))
    }
    async fn release(&self, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        self.0.release(claim_id, lease_token).await
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
    let first = dies.start(org, "search-crash", "tick-1").await.unwrap();
    assert!(first.run.admitted, "the Run was admitted under the fence; it is the answer");
    assert_eq!(stored(&stack).await.0, "processing", "the claim was never completed");
    let waiting = starter(&stack, ProductTables::open()).start(org, "search-crash", "tick-1").await;
    assert!(matches!(waiting, Err(SavedSearchError::InProgress { .. })), "{waiting:?}");

    // The lease passes; the next start reclaims, finds the Run admitted
    // first and journals its input, freezing nothing.
    pass_lease(&stack, claim_id(&stack).await).await;
    let tables = ProductTables::open().starting_at(7);
    let next = starter(&stack, tables.clone()).start(org, "search-crash", "tick-1").await.unwrap();
    assert_eq!(tables.freezes(), 0, "the Run's input is the snapshot; nothing is frozen again");
    assert!(next.replayed && next.run.admitted);
    assert_eq!((next.run.id, &next.snapshot), (first.run.id, &first.snapshot), "the first snapshot wins");
    assert_kept_by_reference(&stored(&stack).await, &first.run, &first.snapshot);
    let replay = starter(&stack, ProductTables::open()).start(org, "search-crash", "tick-1").await.unwrap();
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

#[tokio::test]
async fn a_fence_names_its_claim_and_its_token_together_and_a_lost_one_is_refused_with_idem4() {
    let stack = stack().await;
    let client = client(&stack);
    let base = json!({"p_organization_id": org(), "p_start_key": "start:fenced", "p_input": {"q": 1},
                      "p_admission_token": Uuid::new_v4()});
    let with = |fields: Value| {
        let mut args = base.clone();
        args.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
        args
    };
    for (args, code, named) in [
        (with(json!({"p_claim_id": Uuid::new_v4()})), "22023", "p_lease_token"),
        (with(json!({"p_lease_token": Uuid::new_v4()})), "22023", "p_claim_id"),
        (with(json!({"p_claim_id": Uuid::new_v4(), "p_lease_token": Uuid::new_v4()})), "IDEM4", "no Run admitted"),
    ] {
        match client.rpc::<Value>("run_admit", &args, Repeat::Safe).await {
            Err(ClientError::Api { status: 400, error, .. }) => {
                assert_eq!(error.code, code, "{args}");
                assert!(error.message.contains(named), "{}", error.message);
            }
            other => panic!("{args}: expected 400 {code}, got {other:?}"),
        }
    }
    assert_eq!(idempotency_plane::repo::FENCE_LOST, "IDEM4");
    assert_eq!(count_runs(&stack).await, 0);
    stack.stop().await.unwrap();
}
