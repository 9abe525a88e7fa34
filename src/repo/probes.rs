//! Operator probes: what `idem doctor` asks a deployment before trusting it
//! with the plane. None of them writes, or reads a claim's data: a read of a
//! key no tenant holds, the catalog's view of the SQL surface, synthetic
//! rows for the row cap, counts of orphaned work per scope, and the scopes'
//! policies. They answer the client's error as it is
//! ([`ClientError`]), which says what an operator must fix (the key, the
//! exposed schema, a missing function) better than the crate's [`Error`](crate::Error).

use serde::Deserialize;
use serde_json::{json, Value};

use super::surface::{CAP_PROBE, GET, ORPHANS, POLICIES, ROW_CAP, SCHEDULED_FAILURES, SURFACE};
use super::PostgrestRepository;
use crate::postgrest::{ClientError, ContentRange, Repeat};

/// The tenant of the reachability probe's read: the nil UUID, which no
/// tenant is.
const PROBE_ORGANIZATION: uuid::Uuid = uuid::Uuid::nil();

/// The scope of the reachability probe's read; a `tool.*` scope, which the
/// shipped policy table covers.
const PROBE_SCOPE: &str = "tool.doctor";

/// The key of the reachability probe's read.
const PROBE_KEY: &str = "doctor";

/// One function of schema `agent` as the deployment's catalog reports it
/// ([`PostgrestRepository::deployed_functions`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct DeployedFunction {
    /// Its name.
    pub name: String,
    /// Its identity arguments as `pg_get_function_identity_arguments`
    /// prints them: compare with [`SqlFunction::arguments`](super::SqlFunction::arguments).
    pub arguments: String,
    /// Whether the key's role may execute it.
    pub executable: bool,
    /// The role that owns it; `None` from a plane whose
    /// `agent.idempotency_surface` does not report it (every v0.1 plane does).
    #[serde(default)]
    pub owner: Option<String>,
    /// Whether PUBLIC (every role) may execute it: never so for the plane's
    /// own functions. `None` from a plane whose `agent.idempotency_surface`
    /// does not report it (every v0.1 plane does), as for the two below.
    #[serde(default)]
    pub public_executable: Option<bool>,
    /// Whether `anon` (a request without a user) may execute it.
    #[serde(default)]
    pub anon_executable: Option<bool>,
    /// Whether `authenticated` (any signed-in user) may execute it.
    #[serde(default)]
    pub authenticated_executable: Option<bool>,
}

/// What the server did with a request for more rows than the configured cap
/// ([`PostgrestRepository::probe_row_cap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RowCapProbe {
    /// The `Content-Range` the server answered, with its exact count.
    pub range: ContentRange,
    /// How many rows arrived.
    pub received: u64,
}

/// A scope's orphaned work ([`PostgrestRepository::orphans`]): claims still
/// processing whose lease passed and that carry work nobody is doing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct OrphanedScope {
    /// The scope.
    pub scope: String,
    /// How many of its claims are orphaned.
    pub orphans: u64,
    /// Since when the oldest has waited for a re-drive (database clock).
    pub oldest: chrono::DateTime<chrono::Utc>,
    /// How long the oldest has waited, in milliseconds, by the database
    /// clock.
    pub waited_ms: u64,
}

/// A scheduled call that failed ([`PostgrestRepository::scheduled_failures`]):
/// a pg_cron job's pg_net call answered outside 2xx, with an error, or never
/// answered although the job ran again.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ScheduledFailure {
    /// The job's name (`idempotency-redrive-webhooks`).
    pub job: String,
    /// pg_net's id of the request.
    pub request_id: i64,
    /// When the job made the call (database clock).
    pub called_at: chrono::DateTime<chrono::Utc>,
    /// When its answer was recorded; `None`: never.
    pub answered_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The HTTP status, when one came back.
    pub status_code: Option<i32>,
    /// pg_net's error, `no answer recorded`, or `None` for a status alone.
    pub error: Option<String>,
    /// How many calls failed since the time asked about, whatever the row
    /// cap cut.
    pub failed_calls: u32,
}

/// One row of `agent.idempotency_scopes` as the deployment holds it
/// ([`PostgrestRepository::policies`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[non_exhaustive]
pub struct ScopePolicy {
    /// The scope (`webhook.stripe`) or family (`webhook.*`) the row names.
    pub scope: String,
    /// How long a claim is kept, in milliseconds.
    pub retain_ms: u64,
    /// The largest answer stored, as compact JSON.
    pub max_response_bytes: u64,
    /// The largest work a claim carries, as compact JSON.
    pub max_request_bytes: u64,
    /// How many times its work is handed out before it is dead-lettered.
    pub max_attempts: u32,
}

impl PostgrestRepository {
    /// The policies that govern `scope` (`idempotency_policies`): for one
    /// scope the row that applies to it, for a family (`webhook.*`) that
    /// row and every row under it, by scope. Read-only.
    pub async fn policies(&self, scope: &str) -> Result<Vec<ScopePolicy>, ClientError> {
        self.client().rpc(POLICIES.name, &json!({"p_scope": scope}), Repeat::of(POLICIES.name)).await
    }

    /// The scopes holding orphaned work, most orphans first, at most
    /// `limit` of them (1 to 1000), from `idempotency_orphans`. Read-only.
    pub async fn orphans(&self, limit: u32) -> Result<Vec<OrphanedScope>, ClientError> {
        self.client().rpc(ORPHANS.name, &json!({"p_limit": limit}), Repeat::of(ORPHANS.name)).await
    }

    /// The scheduled calls that failed since `since` (the plane's default:
    /// the last hour), newest first, at most `row_cap` of them, from
    /// `idempotency_scheduled_failures`. Read-only.
    pub async fn scheduled_failures(
        &self,
        since: Option<chrono::DateTime<chrono::Utc>>,
        row_cap: u32,
    ) -> Result<Vec<ScheduledFailure>, ClientError> {
        // Omitted when absent, never sent as null: the server's DEFAULT applies.
        let args = match since {
            Some(since) => json!({"p_since": since, "p_row_cap": row_cap}),
            None => json!({"p_row_cap": row_cap}),
        };
        let (name, bound) = (SCHEDULED_FAILURES.name, u64::from(row_cap));
        self.client().rpc_bounded(name, &args, bound, None, Repeat::of(name)).await
    }

    /// The plane's own row cap (`agent.idempotency_settings.max_rows`, from
    /// `idempotency_row_cap`), which every function that answers rows holds
    /// its callers to. Read-only.
    pub async fn plane_row_cap(&self) -> Result<u64, ClientError> {
        self.client().rpc(ROW_CAP.name, &json!({}), Repeat::of(ROW_CAP.name)).await
    }

    /// One harmless read, `idempotency_get` of a key in scope `tool.doctor`
    /// of the nil tenant, which no caller holds: `Ok` when the server
    /// answered it, whatever it found. Its error tells an unreachable
    /// server, a key the server refuses, and schema `agent` not exposed
    /// apart. Retried as the shared retry-safety table allows.
    pub async fn probe_reachable(&self) -> Result<(), ClientError> {
        let read = json!({"p_organization_id": PROBE_ORGANIZATION, "p_scope": PROBE_SCOPE, "p_key": PROBE_KEY});
        self.client().rpc::<Value>(GET.name, &read, Repeat::of(GET.name)).await.map(|_| ())
    }

    /// Every function of schema `agent` the deployment holds, with its
    /// arguments and whether the key's role may execute it, read from the
    /// catalog (`idempotency_surface`): compare with
    /// [`SQL_SURFACE`](super::SQL_SURFACE). Read-only.
    pub async fn deployed_functions(&self) -> Result<Vec<DeployedFunction>, ClientError> {
        self.client().rpc(SURFACE.name, &json!({}), Repeat::of(SURFACE.name)).await
    }

    /// Asks `idempotency_cap_probe` for `rows` synthetic rows (written to no
    /// table) with an exact count, and answers what the server sent: ask for
    /// one more than the configured cap to see whether the server truncates
    /// where the client expects ([`ClientConfig::max_rows`](crate::ClientConfig::max_rows))
    /// and whether its `Content-Range` counts what arrived. A server that
    /// sends no `Content-Range`, or a malformed one, is
    /// [`ClientError::ContentRange`]. Read-only.
    pub async fn probe_row_cap(&self, rows: u64) -> Result<RowCapProbe, ClientError> {
        let (range, answered) =
            self.client().rpc_counted::<Value>(CAP_PROBE.name, &json!({"p_rows": rows}), Some("id")).await?;
        Ok(RowCapProbe { range, received: answered.len() as u64 })
    }
}
