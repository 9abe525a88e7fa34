//! The stored claim, as the claim functions answer it.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A claim's status. A released claim has no row at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimStatus {
    /// A worker holds (or held) the key and has not finished.
    Processing,
    /// The effect is done; the row is the journal entry.
    Completed,
}

/// One row of `agent.idempotency_keys`, plus `lease_live`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    /// The claim id `complete` and `release` filter on.
    pub id: Uuid,
    /// The tenant.
    pub organization_id: Uuid,
    /// The scope.
    pub scope: String,
    /// The key within the scope.
    pub key: String,
    /// Lowercase hex SHA-256 of the request that claimed the key.
    pub request_hash: String,
    /// Processing or completed.
    pub status: ClaimStatus,
    /// The fence, which changes on every claim and reclaim: present only in
    /// an answer to its holder (its claim, reclaim or completion). Every read
    /// answers `None`; whether a worker holds the claim is
    /// [`lease_live`](Self::lease_live).
    pub lease_token: Option<Uuid>,
    /// What kind of resource the effect made.
    pub resource_type: Option<String>,
    /// The resource the effect made.
    pub resource_id: Option<String>,
    /// The stored answer.
    pub response: Option<serde_json::Value>,
    /// When the current holder claimed it (database clock).
    pub claimed_at: DateTime<Utc>,
    /// When the current lease passes (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// How long the row is remembered (database clock).
    pub retain_until: DateTime<Utc>,
    /// Whether a worker holds a live lease, by the database clock when the
    /// row was read. Always false for a completed row.
    pub lease_live: bool,
}

impl IdempotencyRecord {
    /// Whether the row journaled a failure: completed, its answer
    /// `"ok": false` (what `idempotency_failures` lists and
    /// `idempotency_redrive_failed` may send back).
    pub fn journaled_failure(&self) -> bool {
        self.status == ClaimStatus::Completed
            && self.response.as_ref().and_then(|response| response.get("ok")) == Some(&serde_json::Value::Bool(false))
    }
}

/// What the one-call claim (`agent.idempotency_claim`) decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimDecision {
    /// The key was free; the caller holds it now.
    Claimed,
    /// A passed lease was taken over; the caller holds it now.
    Reclaimed,
    /// The effect is done: the row carries the stored answer.
    Completed,
    /// Another worker holds a live lease.
    Processing,
    /// The key answers for a request with a different hash.
    Conflict,
}

/// One answer of the one-call claim: the decision, and the claim as the
/// caller may see it. Only `claimed` and `reclaimed` carry the lease token;
/// `processing` and `conflict` carry no response or resource, and
/// `conflict` not the stored request hash either.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimRow {
    /// What the database decided.
    pub outcome: ClaimDecision,
    /// The claim id.
    pub id: Uuid,
    /// The tenant.
    pub organization_id: Uuid,
    /// The scope.
    pub scope: String,
    /// The key within the scope.
    pub key: String,
    /// The stored request hash; absent on a conflict.
    pub request_hash: Option<String>,
    /// Processing or completed.
    pub status: ClaimStatus,
    /// The fence, for `claimed` and `reclaimed` only.
    pub lease_token: Option<Uuid>,
    /// The resource type, for `completed` only.
    pub resource_type: Option<String>,
    /// The resource id, for `completed` only.
    pub resource_id: Option<String>,
    /// The stored answer, for `completed` only.
    pub response: Option<serde_json::Value>,
    /// When the current holder claimed it (database clock).
    pub claimed_at: DateTime<Utc>,
    /// When the current lease passes (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// How long the row is remembered (database clock).
    pub retain_until: DateTime<Utc>,
    /// Whether a worker holds a live lease, by the database clock.
    pub lease_live: bool,
    /// For `claimed` and `reclaimed`: the W3C traceparent of the worker
    /// that first claimed the key, when it sent one. `None` from a plane
    /// older than this field.
    #[serde(default)]
    pub traceparent: Option<String>,
}

/// An admitted Run, as `agent.run_admit` answers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdmittedRun {
    /// The Run's id.
    pub id: Uuid,
    /// Its organization.
    pub organization_id: Uuid,
    /// The start key it was admitted under.
    pub start_key: String,
    /// The input it was admitted with (a replay answers this, not its own).
    pub input: serde_json::Value,
    /// Its status.
    pub status: String,
    /// When it was admitted (database clock).
    pub admitted_at: DateTime<Utc>,
    /// How long the Run row is kept (396 days).
    pub retain_until: DateTime<Utc>,
    /// True for the call that inserted it (its retries included); a replay
    /// by anyone else answers false.
    pub admitted: bool,
}

/// A job started at a provider that answers by callback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderJob {
    /// Our row id.
    pub id: Uuid,
    /// The tenant the job belongs to.
    pub organization_id: Uuid,
    /// The provider, e.g. `transcribe`.
    pub provider: String,
    /// The provider's job id.
    pub job_id: String,
}

/// One expired claim, as the sweeper reads it (`?select=id,retain_until`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpiredClaim {
    /// The claim id.
    pub id: Uuid,
    /// When its retention ended.
    pub retain_until: DateTime<Utc>,
}

/// A claim's work as a re-drive answers it (`agent.idempotency_work`).
///
/// [`ClaimStatus::Processing`]: the work is the caller's now, under
/// `lease_token` until `lease_expires_at`, and `request` is what to run.
/// [`ClaimStatus::Completed`]: the work had been handed out as often as its
/// scope's `max_attempts` allows; it is journaled as a dead letter
/// (`response`), with neither token nor request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkRow {
    /// The claim id, for completing, releasing or extending it.
    pub id: Uuid,
    /// The tenant.
    pub organization_id: Uuid,
    /// The scope.
    pub scope: String,
    /// The key within the scope.
    pub key: String,
    /// Lowercase hex SHA-256 of the request that claimed the key.
    pub request_hash: String,
    /// Processing (handed out) or completed (dead-lettered).
    pub status: ClaimStatus,
    /// The new holder's fence; `None` for a dead letter.
    pub lease_token: Option<Uuid>,
    /// The work the claim carries; `None` for a dead letter.
    pub request: Option<serde_json::Value>,
    /// Which attempt this is: 1 for the first claim, one more for every
    /// takeover.
    pub attempt: u32,
    /// When this holder took it (database clock).
    pub claimed_at: DateTime<Utc>,
    /// When this holder's lease passes (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// How long the claim is remembered (database clock).
    pub retain_until: DateTime<Utc>,
    /// The journaled dead letter, `{"ok": false, "error": "dead_lettered",
    /// "output": {"attempts": n}}`; `None` for work handed out.
    pub response: Option<serde_json::Value>,
    /// The W3C traceparent of the worker that first claimed the work, when
    /// it sent one: the span that runs it again links to that trace. `None`
    /// from a plane older than this field.
    #[serde(default)]
    pub traceparent: Option<String>,
}

impl WorkRow {
    /// Whether this row is a dead letter rather than work handed out.
    pub fn is_dead_letter(&self) -> bool {
        self.status == ClaimStatus::Completed
    }
}

/// Whether a named claim can be sent back to re-drive, and why not, as
/// [`JournaledFailures::redrivable`](super::JournaledFailures::redrivable)
/// answers it (`agent.idempotency_redrivable`'s `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Redrivability {
    /// A journaled failure that carries its work: a send-back takes it.
    Redrivable,
    /// No claim has this id: never made, released, or swept.
    Absent,
    /// It belongs to another organization than the one named.
    OtherOrganization,
    /// It is in another scope than the one (or the family) named.
    OtherScope,
    /// A worker holds a live lease on it: in flight.
    InFlight,
    /// Processing with its lease passed: waiting for a re-drive, which takes
    /// it as it is (a failure sent back already included).
    Orphaned,
    /// It journaled a success: there is nothing to run again.
    Succeeded,
    /// A failure whose work is not kept: nothing can run it again.
    NoWork,
    /// Its scope runs work once (`max_attempts` 1), or has lost its policy.
    SingleAttempt,
    /// Its last attempt was claimed before the instant named.
    BeforeSince,
}

impl Redrivability {
    /// What it means for an operator, in a few words.
    pub fn explain(self) -> &'static str {
        match self {
            Redrivability::Redrivable => "a failure that keeps its work: it can be sent back",
            Redrivability::Absent => "no claim has this id (never made, released, or swept)",
            Redrivability::OtherOrganization => "it belongs to another organization than --org",
            Redrivability::OtherScope => "it is in another scope than --scope",
            Redrivability::InFlight => "still processing: a worker holds its lease",
            Redrivability::Orphaned => {
                "processing with its lease passed: the next re-drive takes it as it is (sent back already?)"
            }
            Redrivability::Succeeded => "it succeeded: there is nothing to run again",
            Redrivability::NoWork => "its work was not kept (the caller stored none): nothing can run it again",
            Redrivability::SingleAttempt => "its scope runs work once (max_attempts 1), or has lost its policy",
            Redrivability::BeforeSince => "its last attempt was claimed before --since",
        }
    }
}

/// A named claim and whether it can be sent back to re-drive
/// ([`JournaledFailures::redrivable`](super::JournaledFailures::redrivable)).
/// Everything but the id and the verdict is `None` for an absent claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RedrivableRow {
    /// The claim id asked about.
    pub claim_id: Uuid,
    /// The tenant.
    pub organization_id: Option<Uuid>,
    /// The scope.
    pub scope: Option<String>,
    /// The key within the scope.
    pub key: Option<String>,
    /// Its status.
    pub status: Option<ClaimStatus>,
    /// The journaled answer's `error`, for a failure.
    pub error: Option<String>,
    /// How many attempts it took (or takes, while processing).
    pub attempts: Option<u32>,
    /// When its last attempt claimed it (database clock).
    pub claimed_at: Option<DateTime<Utc>>,
    /// Whether it can be sent back, and why not.
    pub reason: Redrivability,
}

/// A journaled failure, as [`JournaledFailures`](super::JournaledFailures)
/// lists it or answers it sent back to re-drive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureRow {
    /// The claim id: name it to send this failure back.
    pub id: Uuid,
    /// The tenant.
    pub organization_id: Uuid,
    /// The scope.
    pub scope: String,
    /// The key within the scope (a webhook's event id).
    pub key: String,
    /// Completed (listed), or processing (sent back: an orphan again,
    /// which the next re-drive hands out).
    pub status: ClaimStatus,
    /// The journaled answer's `error` (`dead_lettered` for a dead letter).
    pub error: Option<String>,
    /// The journaled answer, or, for a row sent back, the answer it replaced.
    pub response: Option<serde_json::Value>,
    /// The journaled resource's type, if it named one.
    pub resource_type: Option<String>,
    /// The journaled resource, if it named one.
    pub resource_id: Option<String>,
    /// How many attempts the failure took.
    pub attempts: u32,
    /// When its last attempt claimed it (database clock); for a row sent
    /// back, when it was sent back.
    pub claimed_at: DateTime<Utc>,
    /// How long the row is remembered (database clock).
    pub retain_until: DateTime<Utc>,
    /// Whether the claim carries its work, so it can be sent back.
    pub redrivable: bool,
    /// How often it was sent back already (what each replaced is kept for
    /// the audit in the row, at most 20: the first and the last 19).
    pub requeues: u32,
    /// When the first attempt that failed was claimed: kept however often
    /// the failure is sent back and fails again (the audit keeps the first
    /// send-back's entry), while [`claimed_at`](Self::claimed_at) moves to
    /// each new attempt. `None` from a plane older than this field.
    #[serde(default)]
    pub first_claimed_at: Option<DateTime<Utc>>,
    /// The W3C traceparent of the worker that first claimed the work, when
    /// it sent one: kept when the failure is sent back, so its re-drive's
    /// span links to that trace. `None` from a plane older than this field.
    #[serde(default)]
    pub traceparent: Option<String>,
}
