//! The callers' decisions. The tool guard's (`tool`), the webhook gate's
//! (`webhook`) and the service's (`service`: claim, replay, in progress,
//! conflict, reclaim after the lease, release, journal) are each written
//! once as an `async fn` over any [`Plane`] and run by
//! [`on_every_plane!`](crate::support::on_every_plane)
//! on the in-memory repository (`in_memory`, default features) and on a
//! fresh local stack (`on_the_stack`, feature `local`). The effect driver's
//! ending rules (`endings`) run the same way through a fault-injecting
//! wrapper. The gate under slow planes (`gate_deadlines`, wiremock) and
//! lossy ones (`gate_endings`, the in-memory repository behind the wrapper)
//! runs under default features.
//!
//! What only a real database or server can show stays in `crate::stack`.

use idempotency_plane::repo::IdempotencyRecord;
use idempotency_plane::{IdempotencyRepository, IdempotencyService};
use uuid::Uuid;

use crate::support::backends::Plane;

mod batches;
mod endings;
mod gate_deadlines;
mod gate_endings;
mod service;
pub(crate) mod tool;
pub(crate) mod webhook;

/// A service over the plane's store.
pub(crate) fn service<P: Plane>(plane: &P) -> IdempotencyService<P::Repo> {
    IdempotencyService::new(plane.repository())
}

/// The row of a key as the plane stores it; panics if there is none.
pub(crate) async fn row<P: Plane>(plane: &P, org: Uuid, scope: &str, key: &str) -> IdempotencyRecord {
    match plane.repository().get(org, scope, key).await {
        Ok(Some(row)) => row,
        other => panic!("the row of {scope}/{key}: {other:?}"),
    }
}
