//! The repository over PostgREST: one RPC per operation.

mod batch;
mod queue;

use serde::Serialize;
use uuid::Uuid;

use super::surface::{
    SqlFunction, CLAIM, COMPLETE, EXPIRED, EXTEND, FAILURES, GET, PROVIDER_JOB_LOOKUP, PROVIDER_JOB_REGISTER, RECLAIM,
    REDRIVABLE, REDRIVE, REDRIVE_FAILED, RELEASE, RETIRE_EXPIRED, RUN_ADMIT, RUN_GET, TRY_CLAIM,
};
use super::{
    AdmittedRun, ClaimCall, ClaimFence, ClaimRequest, ClaimRow, CompletionArgs, ExpiredClaim, ExpiredClaims,
    FailureRow, FailuresCall, IdempotencyRecord, IdempotencyRepository, JournaledFailures, OrphanedWork, ProviderJob,
    ProviderJobRepository, RedrivableRow, RedriveCall, Retired, RunRepository, WorkRow, FENCE_LOST,
};
use crate::error::Error;
use crate::postgrest::{codes, ClientError};
use crate::postgrest::{PostgrestClient, Repeat};

/// Every repository trait over the plane's SQL functions, through PostgREST.
///
/// Which calls are retried after a lost answer is the shared retry-safety
/// table's ([`Repeat::of`]), the one the TypeScript client reads too:
/// `try_claim`, `reclaim`, `get` and `complete` are safe to repeat (the
/// functions answer the caller's own row to a repeat with the same token),
/// so the client retries their transient failures. `release` is not: a
/// repeat of a release that did happen answers `false`, which would
/// misreport a recorded ending as a lost fence. It is retried only when the
/// server proves the first attempt never ran.
#[derive(Debug, Clone)]
pub struct PostgrestRepository {
    client: PostgrestClient,
}

impl PostgrestRepository {
    /// A repository over `client`.
    pub fn new(client: PostgrestClient) -> Self {
        PostgrestRepository { client }
    }

    /// The client underneath, for operator tools.
    pub fn client(&self) -> &PostgrestClient {
        &self.client
    }

    /// Calls `function`, retrying as the shared retry-safety table allows.
    async fn rpc<T: serde::de::DeserializeOwned>(
        &self,
        function: &'static str,
        args: &impl Serialize,
    ) -> Result<T, ClientError> {
        self.client.rpc(function, args, Repeat::of(function)).await
    }

    async fn at_most_one(
        &self,
        function: &'static str,
        args: &impl Serialize,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        let mut rows: Vec<IdempotencyRecord> = self.rpc(function, args).await?;
        match rows.len() {
            0 | 1 => Ok(rows.pop()),
            n => Err(Error::Inconsistent(format!("{function} answered {n} rows, at most 1 expected"))),
        }
    }
}

#[derive(Serialize)]
struct ClaimArgs<'a> {
    p_organization_id: Uuid,
    p_scope: &'a str,
    p_key: &'a str,
    p_request_hash: &'a str,
    p_lease_token: Uuid,
    p_lease_ms: u64,
    p_retain_ms: u64,
}

impl<'a> From<&ClaimRequest<'a>> for ClaimArgs<'a> {
    fn from(r: &ClaimRequest<'a>) -> Self {
        ClaimArgs {
            p_organization_id: r.organization_id,
            p_scope: r.scope,
            p_key: r.key,
            p_request_hash: r.request_hash,
            p_lease_token: r.lease_token,
            p_lease_ms: millis(r.lease),
            p_retain_ms: millis(r.retain),
        }
    }
}

/// The database's refusal of a scope with no policy, as the typed error.
fn unknown_scope(error: Error, scope: &str) -> Error {
    match error {
        Error::Store(store) if store.code() == Some(codes::UNKNOWN_SCOPE) => {
            Error::UnknownScope { scope: scope.to_owned() }
        }
        other => other,
    }
}

/// Whole milliseconds, rounded up so no duration shrinks on the way.
fn millis(d: std::time::Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// The work is omitted, never sent as `null`, when there is none (see
/// [`CompleteArgs`]).
#[derive(Serialize)]
struct OneCallArgs<'a> {
    p_organization_id: Uuid,
    p_scope: &'a str,
    p_key: &'a str,
    p_request_hash: &'a str,
    p_lease_token: Uuid,
    p_lease_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_request: Option<&'a serde_json::Value>,
    /// The W3C traceparent of the claim's span, with work (feature `otel`).
    #[serde(skip_serializing_if = "Option::is_none")]
    p_traceparent: Option<String>,
}

#[derive(Serialize)]
struct KeyArgs<'a> {
    p_organization_id: Uuid,
    p_scope: &'a str,
    p_key: &'a str,
}

/// Absent values are omitted, never sent as JSON `null`: postrust-server
/// binds a `null` as `''`, and PostgREST as SQL `NULL`: omitting the key is
/// the one form both servers read as the parameter's `DEFAULT NULL`.
#[derive(Serialize)]
struct CompleteArgs<'a> {
    p_claim_id: Uuid,
    p_lease_token: Uuid,
    p_organization_id: Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_resource_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_resource_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_response: Option<&'a serde_json::Value>,
}

#[derive(Serialize)]
struct FenceArgs {
    p_claim_id: Uuid,
    p_lease_token: Uuid,
    p_organization_id: Uuid,
}

impl IdempotencyRepository for PostgrestRepository {
    async fn claim(&self, call: &ClaimCall<'_>) -> Result<ClaimRow, Error> {
        let request = call.request.filter(|request| !request.is_null());
        let args = OneCallArgs {
            p_organization_id: call.organization_id,
            p_scope: call.scope,
            p_key: call.key,
            p_request_hash: call.request_hash,
            p_lease_token: call.lease_token,
            p_lease_ms: millis(call.lease),
            p_request: request,
            // Stored with the work, so whoever runs it again links to this trace.
            p_traceparent: request.and_then(|_| crate::telemetry::current_traceparent()),
        };
        let rows: Result<Vec<ClaimRow>, _> = self.rpc(CLAIM.name, &args).await;
        let mut rows = rows.map_err(|error| unknown_scope(error.into(), call.scope))?;
        match (rows.pop(), rows.is_empty()) {
            (Some(row), true) => Ok(row),
            _ => Err(Error::Inconsistent("idempotency_claim must answer exactly one row".into())),
        }
    }

    async fn try_claim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        let answer = self.at_most_one(TRY_CLAIM.name, &ClaimArgs::from(request)).await;
        answer.map_err(|error| unknown_scope(error, request.scope))
    }

    async fn reclaim(&self, request: &ClaimRequest<'_>) -> Result<Option<IdempotencyRecord>, Error> {
        let answer = self.at_most_one(RECLAIM.name, &ClaimArgs::from(request)).await;
        answer.map_err(|error| unknown_scope(error, request.scope))
    }

    async fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Result<Option<IdempotencyRecord>, Error> {
        let args = KeyArgs { p_organization_id: organization_id, p_scope: scope, p_key: key };
        self.at_most_one(GET.name, &args).await.map_err(|error| unknown_scope(error, scope))
    }

    async fn complete(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        completion: CompletionArgs<'_>,
    ) -> Result<Option<IdempotencyRecord>, Error> {
        let args = CompleteArgs {
            p_claim_id: claim_id,
            p_lease_token: lease_token,
            p_organization_id: organization_id,
            p_resource_type: completion.resource_type,
            p_resource_id: completion.resource_id,
            p_response: completion.response,
        };
        self.at_most_one(COMPLETE.name, &args).await
    }

    async fn release(&self, organization_id: Uuid, claim_id: Uuid, lease_token: Uuid) -> Result<bool, Error> {
        let args = FenceArgs { p_claim_id: claim_id, p_lease_token: lease_token, p_organization_id: organization_id };
        Ok(self.rpc(RELEASE.name, &args).await?)
    }

    async fn extend(
        &self,
        organization_id: Uuid,
        claim_id: Uuid,
        lease_token: Uuid,
        lease: std::time::Duration,
    ) -> Result<Option<chrono::DateTime<chrono::Utc>>, Error> {
        let args = ExtendArgs {
            p_claim_id: claim_id,
            p_lease_token: lease_token,
            p_lease_ms: millis(lease),
            p_organization_id: organization_id,
        };
        Ok(self.rpc(EXTEND.name, &args).await?)
    }
}

#[derive(Serialize)]
struct ExtendArgs {
    p_claim_id: Uuid,
    p_lease_token: Uuid,
    p_lease_ms: u64,
    p_organization_id: Uuid,
}

/// The organization is omitted, never sent as `null`, when there is none
/// (see [`CompleteArgs`]). `p_row_cap` is the client's configured cap, so
/// the database refuses it when it is above the plane's own.
#[derive(Serialize)]
struct RedriveArgs<'a> {
    p_scope: &'a str,
    p_lease_tokens: &'a [Uuid],
    p_lease_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_organization_id: Option<Uuid>,
    p_row_cap: u64,
    p_max_bytes: u64,
}

/// What a re-drive's answer may hold besides the work, per row: every other
/// column, as JSON, with room to spare.
const REDRIVE_ROW_OVERHEAD_BYTES: u64 = 1024;

/// A re-drive is repeated after a lost answer (the shared retry table marks
/// it safe): the caller's tokens make the repeat answer the claims the
/// first attempt took over, at the same attempt.
impl OrphanedWork for PostgrestRepository {
    fn max_bound(&self) -> u64 {
        u64::from(self.client.config().max_rows())
    }

    async fn redrive(&self, call: &RedriveCall<'_>) -> Result<Vec<WorkRow>, Error> {
        let bound = call.lease_tokens.len() as u64;
        let args = RedriveArgs {
            p_scope: call.scope,
            p_lease_tokens: call.lease_tokens,
            p_lease_ms: millis(call.lease),
            p_organization_id: call.organization_id,
            p_row_cap: OrphanedWork::max_bound(self),
            // The work handed out must fit the answer this client reads
            // whole; orphans beyond it stay orphans, no attempt spent.
            p_max_bytes: (self.client.config().max_response_bytes as u64)
                .saturating_sub(bound * REDRIVE_ROW_OVERHEAD_BYTES)
                .max(1),
        };
        if bound == 0 {
            return Ok(Vec::new());
        }
        let taken = |row: &TakenWork| u64::try_from(row.taken).unwrap_or(0);
        let rows = self.client.rpc_bounded_write(REDRIVE.name, &args, bound, taken, Repeat::of(REDRIVE.name)).await;
        let rows = rows.map_err(|error| unknown_scope(error.into(), call.scope))?;
        Ok(rows.into_iter().map(|row| row.work).collect())
    }
}

/// The arguments of `idempotency_failures` and `idempotency_redrive_failed`;
/// what is not given is omitted, never sent as `null`.
#[derive(Serialize)]
struct FailuresArgs<'a> {
    p_scope: &'a str,
    p_limit: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_organization_id: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_since: Option<chrono::DateTime<chrono::Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_claim_ids: Option<&'a [Uuid]>,
    p_row_cap: u64,
}

/// A row of a failures answer, with how many rows the call answered.
#[derive(serde::Deserialize)]
struct TakenFailure {
    #[serde(flatten)]
    failure: FailureRow,
    taken: i64,
}

/// Sending failures back is not repeated after a lost answer (the shared
/// retry table marks it unsafe): a repeat would answer nothing for what the
/// first attempt sent back. Nothing is lost: those are orphans again, which
/// the next re-drive hands out.
impl JournaledFailures for PostgrestRepository {
    fn max_bound(&self) -> u64 {
        u64::from(self.client.config().max_rows())
    }

    async fn failures(&self, call: &FailuresCall<'_>) -> Result<Vec<FailureRow>, Error> {
        self.failures_of(FAILURES, FailuresCall { claim_ids: None, ..*call }).await
    }

    async fn redrive_failed(&self, call: &FailuresCall<'_>) -> Result<Vec<FailureRow>, Error> {
        self.failures_of(REDRIVE_FAILED, *call).await
    }

    async fn redrivable(&self, call: &FailuresCall<'_>) -> Result<Vec<RedrivableRow>, Error> {
        let Some(ids) = call.claim_ids.filter(|ids| !ids.is_empty()) else { return Ok(Vec::new()) };
        let args = RedrivableArgs {
            p_claim_ids: ids,
            p_scope: call.scope,
            p_organization_id: call.organization_id,
            p_since: call.since,
            p_row_cap: JournaledFailures::max_bound(self),
        };
        let bound = u64::try_from(ids.len()).unwrap_or(u64::MAX);
        if bound > args.p_row_cap {
            return Err(ClientError::BoundAboveCap { bound, cap: args.p_row_cap }.into());
        }
        // One row per id, at most the row cap: a cut answer is told by its
        // length, checked below.
        let rows: Vec<RedrivableRow> = self
            .client
            .rpc(REDRIVABLE.name, &args, Repeat::of(REDRIVABLE.name))
            .await
            .map_err(|error| unknown_scope(error.into(), call.scope))?;
        if rows.len() != ids.len() || rows.iter().zip(ids).any(|(row, id)| row.claim_id != *id) {
            return Err(Error::Inconsistent(format!(
                "{} answered {} rows for {} claim ids, not one per id in their order",
                REDRIVABLE.name,
                rows.len(),
                ids.len()
            )));
        }
        Ok(rows)
    }
}

/// The arguments of `idempotency_redrivable`; what is not given is omitted.
#[derive(Serialize)]
struct RedrivableArgs<'a> {
    p_claim_ids: &'a [Uuid],
    p_scope: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_organization_id: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_since: Option<chrono::DateTime<chrono::Utc>>,
    p_row_cap: u64,
}

impl PostgrestRepository {
    /// Calls `function` (`idempotency_failures` or
    /// `idempotency_redrive_failed`) for `call`, its answer checked whole.
    async fn failures_of(&self, function: SqlFunction, call: FailuresCall<'_>) -> Result<Vec<FailureRow>, Error> {
        if call.bound == 0 {
            return Ok(Vec::new());
        }
        let args = FailuresArgs {
            p_scope: call.scope,
            p_limit: call.bound,
            p_organization_id: call.organization_id,
            p_since: call.since,
            p_claim_ids: call.claim_ids,
            p_row_cap: JournaledFailures::max_bound(self),
        };
        let taken = |row: &TakenFailure| u64::try_from(row.taken).unwrap_or(0);
        let rows =
            self.client.rpc_bounded_write(function.name, &args, call.bound, taken, Repeat::of(function.name)).await;
        let rows = rows.map_err(|error| unknown_scope(error.into(), call.scope))?;
        Ok(rows.into_iter().map(|row| row.failure).collect())
    }
}

/// A row of a re-drive's answer: the work, and how many rows the call
/// answered, which the client checks against the rows that arrived.
#[derive(serde::Deserialize)]
struct TakenWork {
    #[serde(flatten)]
    work: WorkRow,
    taken: i64,
}

/// The fence is omitted, never sent as `null`, when there is none (see
/// [`CompleteArgs`]).
#[derive(Serialize)]
struct AdmitArgs<'a> {
    p_organization_id: Uuid,
    p_start_key: &'a str,
    p_input: &'a serde_json::Value,
    p_admission_token: Uuid,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_claim_id: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_lease_token: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_max_run_duration_ms: Option<u128>,
}

#[derive(Serialize)]
struct RunKeyArgs<'a> {
    p_organization_id: Uuid,
    p_start_key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    p_admission_token: Option<Uuid>,
}

impl PostgrestRepository {
    async fn run_admit(&self, args: &AdmitArgs<'_>) -> Result<AdmittedRun, Error> {
        let mut rows: Vec<AdmittedRun> = self.rpc(RUN_ADMIT.name, args).await?;
        match (rows.pop(), rows.is_empty()) {
            (Some(run), true) => Ok(run),
            _ => Err(Error::Inconsistent(format!("{} must answer exactly one row", RUN_ADMIT.name))),
        }
    }
}

/// `run_admit` is safe to repeat: the admission token makes a repeat of the
/// inserting call answer `admitted = true` again. A fenced repeat whose
/// first attempt's answer was lost answers the same, as long as the fence
/// still holds.
impl RunRepository for PostgrestRepository {
    async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        max_run_duration: Option<std::time::Duration>,
    ) -> Result<AdmittedRun, Error> {
        self.run_admit(&AdmitArgs {
            p_organization_id: organization_id,
            p_start_key: start_key,
            p_input: input,
            p_admission_token: admission_token,
            p_claim_id: None,
            p_lease_token: None,
            p_max_run_duration_ms: max_run_duration.map(|duration| duration.as_millis()),
        })
        .await
    }

    async fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &serde_json::Value,
        admission_token: Uuid,
        fence: ClaimFence,
    ) -> Result<Option<AdmittedRun>, Error> {
        let admitted = self
            .run_admit(&AdmitArgs {
                p_organization_id: organization_id,
                p_start_key: start_key,
                p_input: input,
                p_admission_token: admission_token,
                p_claim_id: Some(fence.claim_id),
                p_lease_token: Some(fence.lease_token),
                p_max_run_duration_ms: None,
            })
            .await;
        match admitted {
            Ok(run) => Ok(Some(run)),
            Err(Error::Store(store)) if store.code() == Some(FENCE_LOST) => Ok(None),
            Err(other) => Err(other),
        }
    }

    async fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        admission_token: Option<Uuid>,
    ) -> Result<Option<AdmittedRun>, Error> {
        let args = RunKeyArgs {
            p_organization_id: organization_id,
            p_start_key: start_key,
            p_admission_token: admission_token,
        };
        let mut rows: Vec<AdmittedRun> = self.rpc(RUN_GET.name, &args).await?;
        match rows.len() {
            0 | 1 => Ok(rows.pop()),
            n => Err(Error::Inconsistent(format!("{} answered {n} rows, at most 1 expected", RUN_GET.name))),
        }
    }
}

#[derive(Serialize)]
struct JobArgs<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    p_organization_id: Option<Uuid>,
    p_provider: &'a str,
    p_job_id: &'a str,
}

impl ProviderJobRepository for PostgrestRepository {
    async fn register(&self, organization_id: Uuid, provider: &str, job_id: &str) -> Result<ProviderJob, Error> {
        let args = JobArgs { p_organization_id: Some(organization_id), p_provider: provider, p_job_id: job_id };
        let mut rows: Vec<ProviderJob> = self.rpc(PROVIDER_JOB_REGISTER.name, &args).await?;
        match (rows.pop(), rows.is_empty()) {
            (Some(job), true) => Ok(job),
            _ => Err(Error::Inconsistent(format!("{} must answer exactly one row", PROVIDER_JOB_REGISTER.name))),
        }
    }

    async fn lookup(&self, provider: &str, job_id: &str) -> Result<Option<ProviderJob>, Error> {
        let args = JobArgs { p_organization_id: None, p_provider: provider, p_job_id: job_id };
        let mut rows: Vec<ProviderJob> = self.rpc(PROVIDER_JOB_LOOKUP.name, &args).await?;
        match rows.len() {
            0 | 1 => Ok(rows.pop()),
            n => {
                Err(Error::Inconsistent(format!("{} answered {n} rows, at most 1 expected", PROVIDER_JOB_LOOKUP.name)))
            }
        }
    }
}

#[derive(Serialize)]
struct LimitArgs {
    p_limit: u64,
}

#[derive(Serialize)]
struct IdsArgs<'a> {
    p_ids: &'a [Uuid],
}

/// The read asks `Prefer: count=exact` and checks `Content-Range`, so a
/// server whose real row cap is lower than configured is
/// [`ClientError::Truncated`]; a bound above the configured cap is
/// [`ClientError::BoundAboveCap`] before any request.
impl ExpiredClaims for PostgrestRepository {
    fn max_bound(&self) -> u64 {
        u64::from(self.client.config().max_rows())
    }

    async fn expired(&self, bound: u64) -> Result<Vec<ExpiredClaim>, Error> {
        let args = LimitArgs { p_limit: bound };
        Ok(self
            .client
            .rpc_bounded(EXPIRED.name, &args, bound, Some("id,retain_until"), Repeat::of(EXPIRED.name))
            .await?)
    }

    async fn retire_expired(&self, ids: &[Uuid]) -> Result<Retired, Error> {
        let rows: Vec<Retired> = self.rpc(RETIRE_EXPIRED.name, &IdsArgs { p_ids: ids }).await?;
        match rows.as_slice() {
            [retired] => Ok(*retired),
            _ => Err(Error::Store(ClientError::Decode {
                function: RETIRE_EXPIRED.name,
                reason: format!("answered {} rows, not one", rows.len()),
            })),
        }
    }
}
