//! The repository: the one road to the database.
//!
//! The repository owns atomic SQL behaviour; the service and the callers own
//! the semantics. Every decision is made by one SQL function in the
//! database; only this module knows their names and arguments
//! ([`SQL_SURFACE`]). Four traits, one per table the plane owns:
//! [`IdempotencyRepository`] (claims), [`RunRepository`] (Run admission),
//! [`ProviderJobRepository`] (provider callbacks' tenants) and
//! [`ExpiredClaims`] (the sweeper's bounded reads and deletes).
//! [`PostgrestRepository`] implements all four over PostgREST;
//! [`MemoryRepository`] implements them in one process, for tests that need
//! no database (one conformance suite runs against both).
//! [`TenantRouter`] spreads organizations over several planes, each on
//! exactly one.

mod batch;
pub mod console;
mod memory;
mod pgmq;
mod postgrest;
pub mod probes;
mod queue;
mod record;
mod routed;
mod surface;

use std::future::Future;
use std::time::Duration;

use uuid::Uuid;

use crate::error::Error;

pub use self::postgrest::PostgrestRepository;
pub use batch::{BatchClaims, ClaimItem, ClaimManyCall, CompletionItem};
pub use memory::MemoryRepository;
pub use pgmq::{QueueMessage, Queues, ReadBatch, UnreadableMessage, QUEUES_SCHEMA};
pub use queue::{PlaneQueues, QueueClaim, QueueEnding, QueueSettled, QueueTakeCall, TakeOutcome, TakenItem};
pub use record::{
    AdmittedRun, ClaimDecision, ClaimRow, ClaimStatus, ExpiredClaim, FailureRow, IdempotencyRecord, ProviderJob,
    Redrivability, RedrivableRow, WorkRow,
};
pub use routed::{RouterConfigError, TenantRouter, TenantRouterBuilder};
pub use surface::{SqlFunction, SQL_SURFACE};

/// The arguments of a claim or a reclaim.
///
/// Durations, not instants: the database computes `lease_expires_at` and
/// `retain_until` from its own clock, so a worker whose clock is off can
/// neither shorten nor lengthen a lease (docs/differences.md, "One clock").
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The tenant; the unique key starts with it.
    pub organization_id: Uuid,
    /// The scope, e.g. `tool.email.send`.
    pub scope: &'a str,
    /// The idempotency key within the scope.
    pub key: &'a str,
    /// Lowercase hex SHA-256 of the request content.
    pub request_hash: &'a str,
    /// The fence the caller minted and will carry to `complete`/`release`.
    pub lease_token: Uuid,
    /// How long the worker holds the key.
    pub lease: Duration,
    /// How long the answer is remembered; the database raises it to `lease`.
    pub retain: Duration,
}

/// The arguments of the one-call claim. No retention: the database takes it
/// from the scope's policy (`agent.idempotency_scopes`).
#[derive(Debug, Clone, Copy)]
pub struct ClaimCall<'a> {
    /// The tenant; the unique key starts with it.
    pub organization_id: Uuid,
    /// The scope, e.g. `tool.email.send`; one the policy table names.
    pub scope: &'a str,
    /// The idempotency key within the scope.
    pub key: &'a str,
    /// Lowercase hex SHA-256 of the request content.
    pub request_hash: &'a str,
    /// The fence the caller minted and will carry to `complete`/`release`;
    /// a fresh random value per call, so a repeat after a lost answer is
    /// recognized as this call.
    pub lease_token: Uuid,
    /// How long the worker holds the key.
    pub lease: Duration,
    /// The work the claim carries, stored with it so that another worker
    /// can [re-drive](OrphanedWork::redrive) it if this one dies: at most
    /// the scope's `max_request_bytes` as compact JSON. Never answered to
    /// another caller's claim, replay or read. `None`: the claim carries
    /// no work, and is never re-driven.
    pub request: Option<&'a serde_json::Value>,
}

/// What a completion stores. The database refuses one that carries neither a
/// response nor a resource id, and a resource id without its type.
#[derive(Debug, Clone, Copy, Default)]
pub struct CompletionArgs<'a> {
    /// The kind of resource the effect made, e.g. `nylas.message`.
    pub resource_type: Option<&'a str>,
    /// The resource's id.
    pub resource_id: Option<&'a str>,
    /// The answer to replay.
    pub response: Option<&'a serde_json::Value>,
}

/// The spec's `IdempotencyRepository` (atomic operations, no policy), plus
/// the one-call claim that decides every ending in one round trip.
pub trait IdempotencyRepository: Send + Sync {
    /// Claims, reclaims, or answers why not, in one call and one
    /// transaction: always exactly one [`ClaimRow`]. The hash is compared
    /// first, whatever the lease says; of concurrent callers on a passed
    /// lease exactly one reclaims. A scope with no policy is
    /// [`Error::UnknownScope`].
    fn claim(&self, call: &ClaimCall<'_>) -> impl Future<Output = Result<ClaimRow, Error>> + Send;

    /// Inserts a new processing claim. `None` when the key is already claimed.
    fn try_claim(
        &self,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Option<IdempotencyRecord>, Error>> + Send;

    /// Moves a passed lease to `request.lease_token`, when the row is still
    /// processing, its lease has passed and its hash matches. `None` when any
    /// of that fails, e.g. another worker reclaimed it first. Never shortens
    /// `retain_until`.
    fn reclaim(
        &self,
        request: &ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Option<IdempotencyRecord>, Error>> + Send;

    /// Reads a claim. Never writes.
    fn get(
        &self,
        organization_id: Uuid,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<IdempotencyRecord>, Error>> + Send;

    /// Completes the claim `claim_id` of `organization_id` if `lease_token`
    /// still holds it. `None` when the lease moved on (or the claim is not
    /// that organization's): the caller must do nothing more. The
    /// organization lets a store partitioned by it go straight to the claim.
    fn complete(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> impl Future<Output = Result<Option<IdempotencyRecord>, Error>> + Send;

    /// Deletes the unfinished claim `claim_id` of `organization_id` if
    /// `lease_token` still holds it. `false` when the lease moved on (or the
    /// claim is not that organization's): the caller must do nothing more.
    fn release(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// The heartbeat: moves the lease of the claim `claim_id` of
    /// `organization_id` to `lease` from now (store clock) if `lease_token`
    /// still holds it, and answers the lease's new end. `None` when the
    /// fence moved on (completed, released, taken over): the holder must
    /// stop its effect. A holder whose lease passed but whom nobody took
    /// over may still extend; a shorter `lease` shortens it.
    fn extend(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<chrono::DateTime<chrono::Utc>>, Error>> + Send;
}

/// What a re-drive takes over.
#[derive(Debug, Clone, Copy)]
pub struct RedriveCall<'a> {
    /// A scope (`webhook.stripe`) or a family (`webhook.*`).
    pub scope: &'a str,
    /// One fresh lease token per orphan the call may take over (at most
    /// [`OrphanedWork::max_bound`], none repeated), minted by the caller as
    /// for claims: a repeat with the same tokens after a lost answer
    /// answers again what they still hold, at the same attempt.
    pub lease_tokens: &'a [Uuid],
    /// The lease each orphan is handed out with.
    pub lease: Duration,
    /// Only this organization's orphans, when given.
    pub organization_id: Option<Uuid>,
}

/// Work whose holder is gone: claims still processing, lease passed,
/// carrying the request they were claimed with.
pub trait OrphanedWork: Send + Sync {
    /// The largest bound a re-drive may ask for: the server's row cap.
    fn max_bound(&self) -> u64;

    /// Takes over up to one orphan per token of `call.lease_tokens` in one
    /// statement, each under its token (the old holder is fenced off) with
    /// its attempt number; one whose work was handed out `max_attempts`
    /// times already comes back journaled as a dead letter instead.
    /// Concurrent callers split the orphans: none is handed to two. Safe to
    /// repeat after a lost answer: the claims the tokens still hold are
    /// answered again, at the same attempt, and nothing taken is left held
    /// by nobody. More tokens than [`max_bound`](Self::max_bound) are
    /// refused before any request, and an answer the server cut short is an
    /// error, never a short page.
    fn redrive(&self, call: &RedriveCall<'_>) -> impl Future<Output = Result<Vec<WorkRow>, Error>> + Send;
}

/// The scope pattern of a [`FailuresCall`] that names every scope.
pub const EVERY_SCOPE: &str = "*";

/// Which journaled failures to list, or to send back to re-drive.
#[derive(Debug, Clone, Copy)]
pub struct FailuresCall<'a> {
    /// A scope (`webhook.stripe`), a family (`webhook.*`), or every scope
    /// ([`EVERY_SCOPE`], `*`).
    pub scope: &'a str,
    /// The most failures to answer; at most [`JournaledFailures::max_bound`].
    pub bound: u64,
    /// Only this organization's, when given.
    pub organization_id: Option<Uuid>,
    /// Only failures claimed at or after this instant (database clock),
    /// when given.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only these claims, when given (never empty): the chosen failures.
    pub claim_ids: Option<&'a [Uuid]>,
}

/// Failures the plane journaled (completed claims whose answer has `"ok":
/// false`, dead letters included), which every later claim of their key
/// replays: listed for an operator, and sent back to re-drive once the bug
/// behind them is fixed.
pub trait JournaledFailures: Send + Sync {
    /// The largest bound a call may ask for: the server's row cap.
    fn max_bound(&self) -> u64;

    /// Up to `call.bound` journaled failures, oldest claim first. Read-only;
    /// `call.claim_ids` is ignored. A bound above
    /// [`max_bound`](Self::max_bound) is refused before any request, and an
    /// answer the server cut short is an error, never a short page.
    fn failures(&self, call: &FailuresCall<'_>) -> impl Future<Output = Result<Vec<FailureRow>, Error>> + Send;

    /// Sends up to `call.bound` journaled failures that carry their work
    /// back to re-drive, in one statement: the chosen `claim_ids`, or every
    /// failure claimed `since`, or both filters (one is required). Each
    /// becomes an orphan again (processing, lease passed, a fresh fence,
    /// attempts counted from one, so the next re-drive hands it out as
    /// attempt 2; retention renewed), and what it replaced
    /// is kept in the row for the audit. Concurrent callers split the
    /// failures, and one sent back is no longer a failure: none is sent
    /// back twice by one pass. A scope with `max_attempts` 1, or without a
    /// policy row, sends nothing back. Answers the rows sent back, each
    /// with the answer it replaced.
    fn redrive_failed(&self, call: &FailuresCall<'_>) -> impl Future<Output = Result<Vec<FailureRow>, Error>> + Send;

    /// Whether each of `call.claim_ids` can be sent back to re-drive, and
    /// why not: one row per id, in their order, read with `call`'s scope,
    /// organization and `since` as [`redrive_failed`](Self::redrive_failed)
    /// reads them (`call.bound` is not used). Read-only. Nothing to ask
    /// (no ids) answers nothing; more ids than
    /// [`max_bound`](Self::max_bound) are refused before any request.
    fn redrivable(&self, call: &FailuresCall<'_>) -> impl Future<Output = Result<Vec<RedrivableRow>, Error>> + Send;
}

/// The plane's own refusal (HTTP 400) of a fenced Run admission whose claim
/// is not held by its lease token: nothing was admitted. The repositories
/// answer it as `None` from [`RunRepository::admit_fenced`].
pub use crate::postgrest::codes::FENCE_LOST;

/// The claim a fenced admission must still hold: its id and the lease token
/// of the worker holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimFence {
    /// The claim id.
    pub claim_id: Uuid,
    /// The lease token that must still hold it.
    pub lease_token: Uuid,
}

/// Run admission: `agent.runs`, whose unique start key per organization is
/// the Run claim. Never the claim table (a fenced admission only reads a
/// claim, to check that it is still held).
pub trait RunRepository: Send + Sync {
    /// Admits the Run `start_key` names, or answers the one already admitted
    /// under it. `admitted` is true for the call that inserted it, and for a
    /// repeat carrying the same `admission_token` (its answer was lost).
    /// `max_run_duration`, when the Run's definition sets one, is kept with
    /// the Run; the store refuses one that is zero or above 30 days.
    fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        max_run_duration: Option<std::time::Duration>,
    ) -> impl Future<Output = Result<AdmittedRun, Error>> + Send;

    /// [`admit`](Self::admit), but only while `fence` holds: its claim is
    /// processing, under `fence.lease_token`, with a live lease by the
    /// store's clock, and belongs to `organization_id`. Checked in the same
    /// statement as the insert, and no reclaim or completion of the claim
    /// can pass between the two. `None` when the fence does not hold
    /// ([`FENCE_LOST`]): nothing was admitted, and no Run is answered, even
    /// when one exists under the key.
    fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        fence: ClaimFence,
    ) -> impl Future<Output = Result<Option<AdmittedRun>, Error>> + Send;

    /// The Run admitted under `start_key`, if any; never writes. `admitted`
    /// is true when `admission_token` is the token that admitted it.
    fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        admission_token: Option<Uuid>,
    ) -> impl Future<Output = Result<Option<AdmittedRun>, Error>> + Send;
}

/// Provider jobs: which organization a job a provider will call back about
/// belongs to (`agent.provider_jobs`).
pub trait ProviderJobRepository: Send + Sync {
    /// Records a job this platform started, once. A repeat answers the stored
    /// job; the same job id under another organization is refused.
    fn register(
        &self,
        organization_id: Uuid,
        provider: &str,
        job_id: &str,
    ) -> impl Future<Output = Result<ProviderJob, Error>> + Send;

    /// The job `provider` knows as `job_id`, if this platform holds it.
    fn lookup(&self, provider: &str, job_id: &str) -> impl Future<Output = Result<Option<ProviderJob>, Error>> + Send;
}

/// The sweeper's side of the claim table: bounded reads of claims past
/// retention, and deletes that re-check it.
pub trait ExpiredClaims: Send + Sync {
    /// The largest bound a read may ask for: the server's row cap.
    fn max_bound(&self) -> u64;

    /// Up to `bound` claims past retention, oldest first. A read the server
    /// cut short is an error, never a short page.
    fn expired(&self, bound: u64) -> impl Future<Output = Result<Vec<ExpiredClaim>, Error>> + Send;

    /// Retires those of `ids` still past retention: deletes them, except
    /// unfinished work (processing, carrying its request) that nobody
    /// re-drove, which is journaled as a dead letter (`swept_unredriven`)
    /// and kept for its scope's retention, so it is listed among the
    /// failures and can be sent back after a fix. Answers how many of each.
    fn retire_expired(&self, ids: &[Uuid]) -> impl Future<Output = Result<Retired, Error>> + Send;
}

/// What [`ExpiredClaims::retire_expired`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
pub struct Retired {
    /// Claims deleted.
    pub deleted: u64,
    /// Unfinished claims journaled as dead letters instead of deleted.
    pub dead_lettered: u64,
}
