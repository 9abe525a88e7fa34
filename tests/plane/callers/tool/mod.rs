//! The tool guard's decisions, each case written once over any [`Plane`]
//! and run on the in-memory repository and, with feature `local`, on the
//! stack: run once and replay, release a retryable failure, raise for a call
//! in flight, reclaim after a crash and reconcile a keyless vendor, hold at
//! the checkpoint before any claim, size the lease, and journal outputs the
//! store cannot hold as they are.
//!
//! By job: `runs` (run once and replay, release, raise, reclaim, the
//! checkpoint and the lease), `reconcile` (a keyless vendor) and `journal`
//! (outputs the store cannot hold as they are); here, the guard, the spec
//! and the checkpoint they share, which `crate::stack` uses too.

mod journal;
mod reconcile;
mod runs;

use std::time::Duration;

use idempotency_plane::callers::tool::{Checkpoint, RepeatSafety, RetryHorizon, ToolGuard, ToolSpec};

use crate::support::backends::Plane;

use super::service;

/// An orchestrator whose last attempt comes ten minutes after the first.
pub(crate) const HORIZON: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));

/// A guard over the plane, with a ten-minute retry horizon.
pub(crate) fn guard<P: Plane>(plane: &P) -> ToolGuard<P::Repo> {
    ToolGuard::new(service(plane), HORIZON)
}

/// `tool.email.send`: 30 s per call, the vendor dedupes on the key.
pub(crate) fn spec() -> ToolSpec {
    ToolSpec::new("tool.email.send", Duration::from_secs(30), RepeatSafety::VendorKey).expect("spec")
}

/// A checkpoint that lets every call through.
pub(crate) async fn allow() -> Checkpoint {
    Checkpoint::Allow
}
