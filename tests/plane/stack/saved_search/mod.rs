//! Saved-search start and Run admission on the real stack.
//!
//! By job: `preparation` (the snapshot's claim: concurrency, leases,
//! fences, the sweep), `admission` (Run admission, its lost answers and its
//! fence) and `large_snapshots` (snapshots kept as the Run's input); here,
//! the product tables, the starter and the claim reads they share.

mod admission;
mod large_snapshots;
mod preparation;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::callers::runs::RunAdmission;
use idempotency_plane::callers::saved_search::{SavedSearchStart, SnapshotError, SnapshotSource};
use idempotency_plane::callers::tool::RetryHorizon;
use idempotency_plane::PostgrestRepository;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::support::harness::*;

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
