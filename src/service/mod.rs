//! The service: the spec's duplicate semantics over any repository.
//!
//! It validates input, mints every lease token, and turns what the
//! repository answers into what a read finds ([`ReadOutcome`]) or how a
//! claim ended ([`ClaimOutcome`]). The
//! database decides a claim in one call (the scope's retention policy
//! included); the service checks the answer is the one it asked for. The
//! request hash is compared before anything else, whatever the lease says.
//!
//! [`IdempotencyService`] reads, claims, completes and releases;
//! [`EffectDriver`] is the one road from claim to journal that every caller
//! takes; [`Answer`] is what it journals, with a stand-in ([`Elided`], a
//! [`ResponseRef`]) for what the store cannot hold ([`Unstorable`]).

mod answer;
mod batch;
mod caller_key;
mod driver;
mod hash;
mod held;
mod idempotency;
pub(crate) mod journal;
mod outcome;
mod replay_cache;
pub(crate) mod scope;
mod stored;
mod timing;
pub(crate) mod validate;
mod written;

#[cfg(feature = "axum")]
pub(crate) use answer::stored_size;
pub(crate) use answer::{store as store_answer, StoredAnswer};
pub use answer::{Answer, MAX_STORED_ERROR_BYTES};
pub use batch::{Batch, BatchItem, BatchReport, ItemEnding};
pub use caller_key::caller_scoped_key;
pub(crate) use driver::asking_cut;
pub use driver::{Attempt, Begun, Effect, EffectDriver, Redriven};
pub use hash::{canonical_json, RequestHash};
pub(crate) use held::Beater;
pub use held::{effect_stop, Cut, Held, LeftToLease, Refused, Settle, Settled};
pub use idempotency::{IdempotencyService, DEFAULT_RESPONSE_LIMIT, MAX_REPLAY_CACHE_TTL};
pub use journal::Elided;
pub use outcome::{
    Claim, ClaimOutcome, Completion, Ending, ReadOutcome, ResourceRef, ResponseRef, MAX_RESOURCE_ID_CHARS,
    MAX_RESOURCE_TYPE_CHARS,
};
pub use scope::{DAY, MAX_SCOPE_CHARS, TOOL_RETENTION};
pub use timing::{
    LeaseOutlastsRetries, RetryHorizon, Timing, DEFAULT_JOURNAL_DEADLINE, MIN_HEARTBEAT_LEASE, MIN_LEASE_MARGIN,
};
pub(crate) use validate::key as validate_key;
pub use validate::{MAX_KEY_CHARS, MAX_LEASE, MIN_LEASE};
pub use written::may_have_written;

pub use crate::storable::{Unstorable, MAX_POLICY_RESPONSE_BYTES, MAX_RESPONSE_DEPTH};
