//! The plane's SQL surface: every function a client may call, in one list.
//!
//! The repository calls them by these names; `idem doctor` checks a
//! deployment against this list; the tests check the migrations and the
//! README against it. Names, argument names and answer shapes are a public
//! contract: TypeScript, `curl` and other clients call them directly.

/// One function of the SQL surface, in schema `agent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqlFunction {
    /// Its name.
    pub name: &'static str,
    /// Its identity arguments exactly as PostgreSQL's
    /// `pg_get_function_identity_arguments` prints them.
    pub arguments: &'static str,
}

impl SqlFunction {
    /// The argument names, in order.
    pub fn argument_names(&self) -> impl Iterator<Item = &'static str> {
        self.arguments.split(", ").filter_map(|argument| argument.split(' ').next()).filter(|name| !name.is_empty())
    }

    /// The function as SQL names it in `ALTER FUNCTION` or `GRANT`:
    /// `agent.name(type, …)`, its argument types in order.
    pub fn signature(&self) -> String {
        let types: Vec<&str> =
            self.arguments.split(", ").filter_map(|argument| argument.split_once(' ').map(|(_, kind)| kind)).collect();
        format!("agent.{}({})", self.name, types.join(", "))
    }

    /// The function of the surface named `name`.
    pub fn named(name: &str) -> Option<SqlFunction> {
        SQL_SURFACE.iter().copied().find(|function| function.name == name)
    }
}

const fn function(name: &'static str, arguments: &'static str) -> SqlFunction {
    SqlFunction { name, arguments }
}

const CLAIM_ARGUMENTS: &str = "p_organization_id uuid, p_scope text, p_key text, p_request_hash text, \
                               p_lease_token uuid, p_lease_ms bigint, p_request jsonb, p_traceparent text";
const V1_CLAIM_ARGUMENTS: &str = "p_organization_id uuid, p_scope text, p_key text, p_request_hash text, \
                                  p_lease_token uuid, p_lease_ms bigint, p_retain_ms bigint";

pub(crate) const CLAIM: SqlFunction = function("idempotency_claim", CLAIM_ARGUMENTS);
pub(crate) const TRY_CLAIM: SqlFunction = function("idempotency_try_claim", V1_CLAIM_ARGUMENTS);
pub(crate) const RECLAIM: SqlFunction = function("idempotency_reclaim", V1_CLAIM_ARGUMENTS);
pub(crate) const GET: SqlFunction = function("idempotency_get", "p_organization_id uuid, p_scope text, p_key text");
pub(crate) const COMPLETE: SqlFunction = function(
    "idempotency_complete",
    "p_claim_id uuid, p_lease_token uuid, p_resource_type text, p_resource_id text, p_response jsonb, \
     p_organization_id uuid",
);
pub(crate) const RELEASE: SqlFunction =
    function("idempotency_release", "p_claim_id uuid, p_lease_token uuid, p_organization_id uuid");
pub(crate) const EXTEND: SqlFunction =
    function("idempotency_extend", "p_claim_id uuid, p_lease_token uuid, p_lease_ms bigint, p_organization_id uuid");
pub(crate) const REDRIVE: SqlFunction = function(
    "idempotency_redrive",
    "p_scope text, p_lease_tokens uuid[], p_lease_ms bigint, p_organization_id uuid, p_row_cap integer, \
     p_max_bytes bigint",
);
pub(crate) const ORPHANS: SqlFunction = function("idempotency_orphans", "p_limit integer");
pub(crate) const POLICIES: SqlFunction = function("idempotency_policies", "p_scope text");
pub(crate) const FAILURES: SqlFunction = function(
    "idempotency_failures",
    "p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer",
);
pub(crate) const REDRIVE_FAILED: SqlFunction = function(
    "idempotency_redrive_failed",
    "p_scope text, p_limit integer, p_organization_id uuid, p_since timestamp with time zone, p_claim_ids uuid[], \
     p_row_cap integer",
);
pub(crate) const REDRIVABLE: SqlFunction = function(
    "idempotency_redrivable",
    "p_claim_ids uuid[], p_scope text, p_organization_id uuid, p_since timestamp with time zone, p_row_cap integer",
);
pub(crate) const SCHEDULED_CALL: SqlFunction =
    function("idempotency_scheduled_call", "p_job text, p_request_id bigint, p_answers jsonb");
pub(crate) const SCHEDULED_PENDING: SqlFunction = function("idempotency_scheduled_pending", "p_job text");
pub(crate) const SCHEDULED_FAILURES: SqlFunction =
    function("idempotency_scheduled_failures", "p_since timestamp with time zone, p_row_cap integer");
pub(crate) const CLAIM_MANY: SqlFunction = function(
    "idempotency_claim_many",
    "p_organization_id uuid, p_scope text, p_lease_ms bigint, p_items jsonb, p_row_cap integer",
);
pub(crate) const COMPLETE_MANY: SqlFunction =
    function("idempotency_complete_many", "p_organization_id uuid, p_items jsonb, p_row_cap integer");
pub(crate) const RELEASE_MANY: SqlFunction =
    function("idempotency_release_many", "p_organization_id uuid, p_items jsonb, p_row_cap integer");
pub(crate) const EXPIRED: SqlFunction = function("idempotency_expired", "p_limit integer");
pub(crate) const DELETE_EXPIRED: SqlFunction = function("idempotency_delete_expired", "p_ids uuid[]");
pub(crate) const RETIRE_EXPIRED: SqlFunction = function("idempotency_retire_expired", "p_ids uuid[]");
pub(crate) const SWEEP: SqlFunction = function("idempotency_sweep", "p_bound integer, p_row_cap integer");
pub(crate) const RUN_ADMIT: SqlFunction = function(
    "run_admit",
    "p_organization_id uuid, p_start_key text, p_input jsonb, p_admission_token uuid, p_claim_id uuid, \
     p_lease_token uuid, p_max_run_duration_ms bigint",
);
pub(crate) const RUN_GET: SqlFunction =
    function("run_get", "p_organization_id uuid, p_start_key text, p_admission_token uuid");
pub(crate) const PROVIDER_JOB_REGISTER: SqlFunction =
    function("provider_job_register", "p_organization_id uuid, p_provider text, p_job_id text");
pub(crate) const PROVIDER_JOB_LOOKUP: SqlFunction = function("provider_job_lookup", "p_provider text, p_job_id text");
pub(crate) const CAP_PROBE: SqlFunction = function("idempotency_cap_probe", "p_rows integer");
pub(crate) const ROW_CAP: SqlFunction = function("idempotency_row_cap", "p_row_cap integer");
pub(crate) const SURFACE: SqlFunction = function("idempotency_surface", "");
pub(crate) const REQUEST_HASH: SqlFunction = function("idempotency_request_hash", "p_value jsonb");
pub(crate) const QUEUE_TAKE: SqlFunction = function(
    "idempotency_queue_take",
    "p_queue text, p_dead_letter_queue text, p_organization_id uuid, p_lease_ms bigint, p_lease_tokens uuid[], \
     p_max_reads integer, p_scope text, p_organizations uuid[], p_row_cap integer, p_traceparent text",
);
pub(crate) const QUEUE_SETTLE: SqlFunction =
    function("idempotency_queue_settle", "p_queue text, p_dead_letter_queue text, p_items jsonb, p_row_cap integer");
pub(crate) const QUEUE_EXTEND: SqlFunction =
    function("idempotency_queue_extend", "p_queue text, p_lease_ms bigint, p_items jsonb, p_row_cap integer");
pub(crate) const IN_FLIGHT: SqlFunction = function("idempotency_in_flight", "p_limit integer");
pub(crate) const PROCESSING: SqlFunction = function("idempotency_processing", "p_scope text, p_limit integer");
pub(crate) const ABANDON: SqlFunction = function("idempotency_abandon", "p_id uuid, p_version text");
pub(crate) const FAILURE_COUNTS: SqlFunction = function("idempotency_failure_counts", "p_limit integer");
pub(crate) const SWEEP_BACKLOG: SqlFunction = function("idempotency_sweep_backlog", "p_limit integer");
pub(crate) const ACTIVITY: SqlFunction =
    function("idempotency_activity", "p_since timestamp with time zone, p_bucket_s integer, p_limit integer");

/// Every function of the SQL surface.
pub const SQL_SURFACE: &[SqlFunction] = &[
    CLAIM,
    TRY_CLAIM,
    RECLAIM,
    GET,
    COMPLETE,
    RELEASE,
    EXTEND,
    CLAIM_MANY,
    COMPLETE_MANY,
    RELEASE_MANY,
    REDRIVE,
    ORPHANS,
    POLICIES,
    FAILURES,
    REDRIVE_FAILED,
    REDRIVABLE,
    SCHEDULED_CALL,
    SCHEDULED_PENDING,
    SCHEDULED_FAILURES,
    EXPIRED,
    DELETE_EXPIRED,
    RETIRE_EXPIRED,
    SWEEP,
    RUN_ADMIT,
    RUN_GET,
    PROVIDER_JOB_REGISTER,
    PROVIDER_JOB_LOOKUP,
    CAP_PROBE,
    ROW_CAP,
    SURFACE,
    REQUEST_HASH,
    QUEUE_TAKE,
    QUEUE_SETTLE,
    QUEUE_EXTEND,
    IN_FLIGHT,
    PROCESSING,
    ABANDON,
    FAILURE_COUNTS,
    SWEEP_BACKLOG,
    ACTIVITY,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_names_the_argument_types_in_order() {
        assert_eq!(
            SqlFunction::named("idempotency_claim").map(|f| f.signature()).as_deref(),
            Some("agent.idempotency_claim(uuid, text, text, text, uuid, bigint, jsonb, text)")
        );
        assert_eq!(
            SqlFunction::named("idempotency_failures").map(|f| f.signature()).as_deref(),
            Some("agent.idempotency_failures(text, integer, uuid, timestamp with time zone, integer)")
        );
        assert_eq!(
            SqlFunction::named("idempotency_surface").map(|f| f.signature()).as_deref(),
            Some("agent.idempotency_surface()")
        );
        assert_eq!(SqlFunction::named("nope"), None);
    }

    #[test]
    fn argument_names_are_read_off_the_identity_arguments() {
        assert_eq!(RELEASE.argument_names().collect::<Vec<_>>(), ["p_claim_id", "p_lease_token", "p_organization_id"]);
        assert_eq!(SURFACE.argument_names().count(), 0);
        let names: std::collections::BTreeSet<_> = SQL_SURFACE.iter().map(|f| f.name).collect();
        assert_eq!(names.len(), SQL_SURFACE.len(), "each function once");
    }

    #[test]
    fn the_shared_retry_table_lists_exactly_the_sql_surface() {
        let listed = crate::postgrest::rpc_policy_functions().expect("rpc_policy.json parses");
        let surface: std::collections::BTreeSet<&str> = SQL_SURFACE.iter().map(|f| f.name).collect();
        assert_eq!(listed.collect::<std::collections::BTreeSet<_>>(), surface);
    }
}
