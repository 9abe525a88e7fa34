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
    /// The fence: changes on every claim and reclaim.
    pub lease_token: Uuid,
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
}
