//! Where a saved search's input comes from: the mutable product tables,
//! read and frozen once per start.

use std::future::Future;

use serde_json::Value;
use uuid::Uuid;

/// Where the mutable product data comes from: the brief and the baseline a
/// saved search starts from, read now and frozen.
pub trait SnapshotSource: Send + Sync {
    /// Reads and freezes the saved search's input. Called at most once per
    /// start key while the claim is held. A snapshot that fits the store
    /// limit (64 KiB by default) is kept in the claim; a larger one is kept
    /// as the Run's input and referenced from the claim. One the store
    /// cannot hold at all (above 4 MiB as compact JSON, nested deeper than
    /// 64 levels, holding U+0000) fails the start
    /// ([`Error::is_unstorable_answer`](crate::Error::is_unstorable_answer)) and releases the claim.
    fn freeze(
        &self,
        organization_id: Uuid,
        saved_search_id: &str,
    ) -> impl Future<Output = Result<Value, SnapshotError>> + Send;
}

/// The source could not freeze the input. Nothing was stored; the claim is
/// released so a later start tries again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("freezing the saved search input failed: {0}")]
pub struct SnapshotError(pub String);
