//! Saved-search start: the one surface claim before Run admission.
//!
//! A saved search must freeze its brief and baseline from mutable product
//! tables before the Run request can be built. That preparation is claimed
//! under `surface.saved_search.start`, and the frozen snapshot is the claim's
//! response, together with the Run key derived from the claim's identity
//! (organization, scope, key). The claim never records admission, dispatch or
//! Run status: the Run is admitted through `agent.runs` with that key, so a
//! replay finds the same Run — also after the 24-hour snapshot claim is gone,
//! for the Run's whole 396-day retention.
//!
//! Two ways to keep the snapshot, decided by its size:
//!
//! - **Inline** (it fits the store limit, 64 KiB by default): the claim
//!   completes with the snapshot, then the Run is admitted from it. A
//!   preparation whose fence was lost cannot complete, so it admits nothing.
//! - **By reference** (it does not fit): the snapshot's durable copy is the
//!   Run's own input (up to 4 MiB). The Run is admitted first, through a
//!   *fenced* admission that inserts only while this preparation's claim is
//!   still held by its lease token (one SQL statement), and the claim then
//!   completes with the Run key and a [`ResponseRef`](crate::service::ResponseRef) to the Run (type
//!   [`SNAPSHOT_RESOURCE_TYPE`], its id, the snapshot's size and SHA-256).
//!   A replay reads the snapshot back from the Run and checks it against the
//!   reference. If the worker dies between admission and completion, the
//!   next one reclaims, freezes again, and its fenced admission answers the
//!   Run already admitted: the first snapshot wins.
//!
//! A reclaimed preparation always takes the fenced road, whatever its size:
//! an earlier holder may have admitted a Run before it died, and the claim
//! must then answer that Run's input, not the new freeze. Either way
//! [`StartedRun::snapshot`] is the admitted Run's input.
//!
//! Every start of one trigger admits with the same [`AdmissionToken`](crate::callers::runs::AdmissionToken),
//! derived from the start's identity, so each of them (a retry after a lost
//! answer, a re-run hours later) is told `admitted = true` for the Run its
//! trigger started.
//!
//! The module by job: the starter and a start's road to its answer
//! (`start`), the preparation a start holding its claim makes (`prepare`),
//! a start's identity and what its claim stores (`identity`), the source
//! of the input (`source`), and the errors (`error`).

mod error;
mod identity;
mod prepare;
mod source;
mod start;

pub use error::{SavedSearchError, StartConfigError};
pub use identity::{SAVED_SEARCH_START_SCOPE, SNAPSHOT_RESOURCE_TYPE};
pub use source::{SnapshotError, SnapshotSource};
pub use start::{SavedSearchStart, Started, StartedRun, MIN_PREPARATION_LEASE, SAVED_SEARCH_LEASE};
