//! The operator console's reads and its one ending (`idem console`): what is
//! in flight by scope, the claims of a scope still processing, journaled
//! failures counted by scope, the sweep's backlog, the plane's activity over
//! time, and ending a stuck claim as a failure when it is unchanged since
//! it was shown. Each is one of the plane's own functions, bounded by the
//! plane's row cap (a larger limit is refused, never clamped); every read
//! is callable by `service_role` only and never writes.

use chrono::{DateTime, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use super::surface::{SqlFunction, ABANDON, ACTIVITY, FAILURE_COUNTS, IN_FLIGHT, PROCESSING, SWEEP_BACKLOG};
use super::{FailureRow, PostgrestRepository};
use crate::postgrest::{ClientError, Repeat};

/// The error [`PostgrestRepository::abandon`] journals as the claim's
/// answer.
pub const ABANDONED_BY_OPERATOR: &str = "abandoned_by_operator";

/// One scope's claims still processing ([`PostgrestRepository::in_flight`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct InFlightScope {
    /// The scope.
    pub scope: String,
    /// Its claims processing, live or not.
    pub processing: u64,
    /// Those a worker holds a live lease on.
    pub live: u64,
    /// Those whose lease passed and that carry work: waiting for a re-drive.
    pub orphans: u64,
    /// When the oldest of them was claimed (database clock).
    pub oldest_claimed_at: Option<DateTime<Utc>>,
    /// The earliest lease end among them (database clock).
    pub oldest_lease_expires_at: Option<DateTime<Utc>>,
}

/// A claim still processing ([`PostgrestRepository::processing`]), with
/// the version an operator names to end it ([`PostgrestRepository::abandon`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProcessingClaim {
    /// The claim id.
    pub id: Uuid,
    /// The tenant.
    pub organization_id: Uuid,
    /// The scope.
    pub scope: String,
    /// The key within the scope.
    pub key: String,
    /// When its current attempt claimed it (database clock).
    pub claimed_at: DateTime<Utc>,
    /// When its lease ends, or ended (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// Whether a worker holds it now.
    pub lease_live: bool,
    /// Which attempt holds it (1 for the first).
    pub attempt: u32,
    /// Whether it carries its work (a re-drive can take it over).
    pub carries_work: bool,
    /// An opaque digest of the claim's state, never its lease token: any
    /// change to the claim (a reclaim, an extension, an ending) changes it.
    pub version: String,
}

/// One scope's journaled failures ([`PostgrestRepository::failure_counts`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct FailureCount {
    /// The scope (a queue's is `queue.<name>` unless its consumer set one).
    pub scope: String,
    /// Its journaled failures, dead letters included.
    pub failures: u64,
    /// Those that keep their work: they can be sent back.
    pub redrivable: u64,
    /// Those journaled as dead letters (their attempts ran out).
    pub dead_lettered: u64,
    /// When the oldest of them was claimed (database clock).
    pub oldest_claimed_at: Option<DateTime<Utc>>,
}

/// Rows past retention that wait for the sweep, by the day their retention
/// ended ([`PostgrestRepository::sweep_backlog`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SweepBacklogDay {
    /// The day (UTC) their retention ended.
    pub retain_date: NaiveDate,
    /// How many rows.
    pub rows: u64,
}

/// What the plane did in one time bucket ([`PostgrestRepository::activity`]):
/// claims by their latest claim, failures by the claim of the attempt that
/// failed (among rows the sweep has not retired), replays as the plane
/// counted them (kept 7 days).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ActivityBucket {
    /// The bucket's start (database clock).
    pub bucket: DateTime<Utc>,
    /// Claims taken.
    pub claims: u64,
    /// Calls answered from the journal (replays).
    pub replays: u64,
    /// Failures journaled.
    pub failures: u64,
}

impl PostgrestRepository {
    /// The scopes with claims processing, at most `limit` of them
    /// (`idempotency_in_flight`). Read-only.
    pub async fn in_flight(&self, limit: u32) -> Result<Vec<InFlightScope>, ClientError> {
        self.bounded_read(IN_FLIGHT, &json!({"p_limit": limit}), limit).await
    }

    /// The claims of `scope` still processing, at most `limit` of them, each
    /// with its version (`idempotency_processing`). Read-only.
    pub async fn processing(&self, scope: &str, limit: u32) -> Result<Vec<ProcessingClaim>, ClientError> {
        self.bounded_read(PROCESSING, &json!({"p_scope": scope, "p_limit": limit}), limit).await
    }

    /// Ends the processing claim `id` as a journaled failure with error
    /// [`ABANDONED_BY_OPERATOR`], only if its version is still `version`
    /// (compare-and-set), and fences its holder off (its lease token
    /// changes): `Some` with the failure as journaled, `None` when the claim
    /// changed since `version` was read or is no longer processing (nothing
    /// was written then). Never repeated after a lost answer: the version
    /// changed with the first attempt, so a repeat would answer `None`.
    pub async fn abandon(&self, id: Uuid, version: &str) -> Result<Option<FailureRow>, ClientError> {
        let args = json!({"p_id": id, "p_version": version});
        let mut rows: Vec<FailureRow> = self.client().rpc(ABANDON.name, &args, Repeat::of(ABANDON.name)).await?;
        match rows.len() {
            0 | 1 => Ok(rows.pop()),
            n => Err(ClientError::Decode { function: ABANDON.name, reason: format!("answered {n} rows, at most 1") }),
        }
    }

    /// The scopes with journaled failures, at most `limit` of them
    /// (`idempotency_failure_counts`). Read-only.
    pub async fn failure_counts(&self, limit: u32) -> Result<Vec<FailureCount>, ClientError> {
        self.bounded_read(FAILURE_COUNTS, &json!({"p_limit": limit}), limit).await
    }

    /// The rows past retention waiting for the sweep, by day, at most
    /// `limit` days (`idempotency_sweep_backlog`). Read-only.
    pub async fn sweep_backlog(&self, limit: u32) -> Result<Vec<SweepBacklogDay>, ClientError> {
        self.bounded_read(SWEEP_BACKLOG, &json!({"p_limit": limit}), limit).await
    }

    /// Claims, replays and failures from the minute of `since` to now, in
    /// buckets of `bucket_s` seconds (whole minutes, up to a day), every
    /// bucket answered, zeros included; the buckets must fit `limit`
    /// (`idempotency_activity`). Read-only.
    pub async fn activity(
        &self,
        since: DateTime<Utc>,
        bucket_s: u32,
        limit: u32,
    ) -> Result<Vec<ActivityBucket>, ClientError> {
        let args = json!({"p_since": since, "p_bucket_s": bucket_s, "p_limit": limit});
        self.bounded_read(ACTIVITY, &args, limit).await
    }

    /// A read of at most `limit` rows, refused above the configured row cap
    /// and checked whole against the server's count.
    async fn bounded_read<T: serde::de::DeserializeOwned>(
        &self,
        function: SqlFunction,
        args: &serde_json::Value,
        limit: u32,
    ) -> Result<Vec<T>, ClientError> {
        self.client().rpc_bounded(function.name, args, u64::from(limit), None, Repeat::of(function.name)).await
    }
}
