//! The metrics this crate emits through the `metrics` facade, by name, and
//! their descriptions. Install any recorder (Prometheus, StatsD, …) and call
//! [`describe_metrics`] once so each series carries its help text and unit.
//!
//! Labels are bounded sets: SQL function names, outcomes, error kinds, drop
//! reasons, and the scopes callers pass (keep those static, such as
//! `tool.email.send`, never per-call names, or the series multiply).

use metrics::Unit;

/// Counter `{operation, scope, outcome}`: what each read or claim answered.
pub const OUTCOMES_TOTAL: &str = "idempotency_outcomes_total";
/// Counter `{operation, scope, ending}`: completions and releases recorded,
/// or fenced off because the lease moved on.
pub const ENDINGS_TOTAL: &str = "idempotency_endings_total";
/// Counter `{scope, ending}`: how the effect driver ended each effect
/// (`journaled`, `released`, `lease_moved_on`, `left_to_lease`).
pub const EFFECT_ENDINGS_TOTAL: &str = "idempotency_effect_endings_total";
/// Counter `{reason}`: webhook deliveries acknowledged without processing.
pub const WEBHOOK_DROPS_TOTAL: &str = "idempotency_webhook_drops_total";
/// Counter: expired claims the sweeper read.
pub const SWEEP_READ_TOTAL: &str = "idempotency_sweep_read_total";
/// Counter: expired claims the sweeper deleted.
pub const SWEEP_DELETED_TOTAL: &str = "idempotency_sweep_deleted_total";
/// Counter: sweeper passes whose read filled the bound (a backlog).
pub const SWEEP_FILLED_TOTAL: &str = "idempotency_sweep_filled_total";
/// Counter: scheduled sweeper passes that failed (`idem sweep --every`).
pub const SWEEP_ERRORS_TOTAL: &str = "idempotency_sweep_errors_total";
/// Counter: unfinished claims the sweeper journaled as dead letters
/// (`swept_unredriven`) instead of deleting them.
pub const SWEEP_DEAD_LETTERED_TOTAL: &str = "idempotency_sweep_dead_lettered_total";
/// Counter: heartbeats that found the fence moved on (the claim was taken
/// over), so the effect under them was stopped.
pub const HEARTBEATS_FENCED_TOTAL: &str = "idempotency_heartbeats_fenced_total";
/// Counter: effects stopped because no heartbeat confirmed their lease in
/// time (the plane was unreachable); each was left to its lease.
pub const LEASES_UNCONFIRMED_TOTAL: &str = "idempotency_leases_unconfirmed_total";
/// Counter `{scope, outcome}`: claims a re-drive took over (`redriven`) or
/// journaled as dead letters (`dead_lettered`).
pub const REDRIVES_TOTAL: &str = "idempotency_redrives_total";
/// Histogram `{function}`: seconds per SQL function call over PostgREST,
/// retries included.
pub const RPC_DURATION_SECONDS: &str = "idempotency_rpc_duration_seconds";
/// Counter `{function, kind}`: SQL function calls that failed, by
/// [`ClientError::kind`](crate::ClientError::kind).
pub const RPC_ERRORS_TOTAL: &str = "idempotency_rpc_errors_total";

/// Describes every metric above to the installed recorder. Call it once,
/// after installing the recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(OUTCOMES_TOTAL, Unit::Count, "Reads and claims, by operation, scope and outcome.");
    metrics::describe_counter!(
        ENDINGS_TOTAL,
        Unit::Count,
        "Completions and releases, by operation, scope and ending (recorded, or lease_moved_on: fenced off)."
    );
    metrics::describe_counter!(
        EFFECT_ENDINGS_TOTAL,
        Unit::Count,
        "Effects ended by the driver, by scope and ending (journaled, released, lease_moved_on, left_to_lease)."
    );
    metrics::describe_counter!(
        WEBHOOK_DROPS_TOTAL,
        Unit::Count,
        "Webhook deliveries acknowledged without processing, by reason."
    );
    metrics::describe_counter!(SWEEP_READ_TOTAL, Unit::Count, "Expired claims read by the sweeper.");
    metrics::describe_counter!(SWEEP_DELETED_TOTAL, Unit::Count, "Expired claims deleted by the sweeper.");
    metrics::describe_counter!(
        SWEEP_FILLED_TOTAL,
        Unit::Count,
        "Sweeper passes whose read filled the bound: expired claims are waiting."
    );
    metrics::describe_counter!(SWEEP_ERRORS_TOTAL, Unit::Count, "Scheduled sweeper passes that failed.");
    metrics::describe_counter!(
        SWEEP_DEAD_LETTERED_TOTAL,
        Unit::Count,
        "Unfinished claims past retention that nobody re-drove, journaled by the sweeper as dead letters."
    );
    metrics::describe_counter!(
        HEARTBEATS_FENCED_TOTAL,
        Unit::Count,
        "Heartbeats that found the claim taken over; the effect under them was stopped."
    );
    metrics::describe_counter!(
        LEASES_UNCONFIRMED_TOTAL,
        Unit::Count,
        "Effects stopped because no heartbeat confirmed their lease in time; each was left to its lease."
    );
    metrics::describe_counter!(
        REDRIVES_TOTAL,
        Unit::Count,
        "Orphaned claims a re-drive took over (redriven) or journaled as dead letters (dead_lettered), by scope."
    );
    metrics::describe_histogram!(
        RPC_DURATION_SECONDS,
        Unit::Seconds,
        "SQL function calls over PostgREST, by function, retries included."
    );
    metrics::describe_counter!(
        RPC_ERRORS_TOTAL,
        Unit::Count,
        "SQL function calls that failed, by function and error kind."
    );
}
