//! What the crate tells an operator: the metrics it emits through the
//! `metrics` facade, by name ([`METRICS`] lists them all, with their kind,
//! labels and descriptions), and the attributes its spans carry.
//!
//! Install any recorder (Prometheus, StatsD, OpenTelemetry through `otel`
//! with the `otel` feature, …) and call [`describe_metrics`] once so each
//! series carries its help text and unit. The TypeScript client emits the
//! same names (`tests/vectors/metric_names.json` holds the list both are
//! tested against).
//!
//! Labels are bounded sets: SQL function names, outcomes, error kinds, drop
//! reasons, and the scopes callers pass (keep those static, such as
//! `tool.email.send`, never per-call names, or the series multiply).
//!
//! Spans: every plane call (`idempotency.claim`, `.read`, `.complete`, …)
//! and every effect (`idempotency.effect`) carries `idempotency.scope` and,
//! for one key, `idempotency.key_hash` ([`key_hash`]: never the raw key,
//! which may hold personal data); outcomes, attempts and errors are
//! recorded on them as they are known (the `SPAN_*` names below).

use metrics::Unit;

mod spans;

#[cfg(feature = "otel")]
pub mod otel;

pub(crate) use spans::{current_traceparent, link_to_origin, record_error, span_count};
pub use spans::{
    key_hash, SPAN_ATTEMPT, SPAN_ENDING, SPAN_ERROR_TYPE, SPAN_KEY_HASH, SPAN_OUTCOME, SPAN_RECLAIMED, SPAN_REPLAYED,
    SPAN_SCOPE,
};

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
/// Histogram `{scope, ending}`: seconds from a claim this worker held to its
/// ending (the effect and its journal), by how it ended (`journaled`,
/// `released`, `lease_moved_on`, `left_to_lease`).
pub const EFFECT_DURATION_SECONDS: &str = "idempotency_effect_duration_seconds";
/// Counter `{operation, scope}`: reads and claims that met another worker's
/// live claim (`processing`): the caller must wait for it, or come back.
pub const WAITS_TOTAL: &str = "idempotency_waits_total";

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// A monotonic count.
    Counter,
    /// A distribution of observed values.
    Histogram,
}

impl MetricKind {
    /// `counter` or `histogram`, as `tests/vectors/metric_names.json` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One metric the crate emits: its name, kind, unit, label names and help text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    /// The series name, e.g. `idempotency_outcomes_total`.
    pub name: &'static str,
    /// Counter or histogram.
    pub kind: MetricKind,
    /// The unit it is described with.
    pub unit: Unit,
    /// Its label names, in the order the crate sets them.
    pub labels: &'static [&'static str],
    /// Its help text.
    pub description: &'static str,
}

const fn counter(name: &'static str, labels: &'static [&'static str], description: &'static str) -> Metric {
    Metric { name, kind: MetricKind::Counter, unit: Unit::Count, labels, description }
}

const fn seconds(name: &'static str, labels: &'static [&'static str], description: &'static str) -> Metric {
    Metric { name, kind: MetricKind::Histogram, unit: Unit::Seconds, labels, description }
}

/// Every metric the crate emits, in one list: what [`describe_metrics`]
/// describes, and what `tests/vectors/metric_names.json` must list.
pub const METRICS: &[Metric] = &[
    counter(OUTCOMES_TOTAL, &["operation", "scope", "outcome"], "Reads and claims, by operation, scope and outcome."),
    counter(
        ENDINGS_TOTAL,
        &["operation", "scope", "ending"],
        "Completions and releases, by operation, scope and ending (recorded, or lease_moved_on: fenced off).",
    ),
    counter(
        EFFECT_ENDINGS_TOTAL,
        &["scope", "ending"],
        "Effects ended by the driver, by scope and ending (journaled, released, lease_moved_on, left_to_lease).",
    ),
    seconds(
        EFFECT_DURATION_SECONDS,
        &["scope", "ending"],
        "Seconds from a claim this worker held to its ending (the effect and its journal), by scope and ending.",
    ),
    counter(
        WAITS_TOTAL,
        &["operation", "scope"],
        "Reads and claims that met another worker's live claim (processing): the caller waits or comes back.",
    ),
    counter(WEBHOOK_DROPS_TOTAL, &["reason"], "Webhook deliveries acknowledged without processing, by reason."),
    counter(SWEEP_READ_TOTAL, &[], "Expired claims read by the sweeper."),
    counter(SWEEP_DELETED_TOTAL, &[], "Expired claims deleted by the sweeper."),
    counter(SWEEP_FILLED_TOTAL, &[], "Sweeper passes whose read filled the bound: expired claims are waiting."),
    counter(SWEEP_ERRORS_TOTAL, &[], "Scheduled sweeper passes that failed."),
    counter(
        SWEEP_DEAD_LETTERED_TOTAL,
        &[],
        "Unfinished claims past retention that nobody re-drove, journaled by the sweeper as dead letters.",
    ),
    counter(
        HEARTBEATS_FENCED_TOTAL,
        &[],
        "Heartbeats that found the claim taken over; the effect under them was stopped.",
    ),
    counter(
        LEASES_UNCONFIRMED_TOTAL,
        &[],
        "Effects stopped because no heartbeat confirmed their lease in time; each was left to its lease.",
    ),
    counter(
        REDRIVES_TOTAL,
        &["scope", "outcome"],
        "Orphaned claims a re-drive took over (redriven) or journaled as dead letters (dead_lettered), by scope.",
    ),
    seconds(RPC_DURATION_SECONDS, &["function"], "SQL function calls over PostgREST, by function, retries included."),
    counter(RPC_ERRORS_TOTAL, &["function", "kind"], "SQL function calls that failed, by function and error kind."),
];

/// Describes every metric of [`METRICS`] to the installed recorder. Call it
/// once, after installing the recorder.
pub fn describe_metrics() {
    for metric in METRICS {
        match metric.kind {
            MetricKind::Counter => metrics::describe_counter!(metric.name, metric.unit, metric.description),
            MetricKind::Histogram => metrics::describe_histogram!(metric.name, metric.unit, metric.description),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tests/vectors/metric_names.json`, the list both clients emit.
    const SHARED_METRICS: &str = include_str!("../../tests/vectors/metric_names.json");

    /// `tests/vectors/key_hash.json`, the key hashes both clients compute.
    const SHARED_KEY_HASHES: &str = include_str!("../../tests/vectors/key_hash.json");

    #[test]
    fn the_metrics_are_the_list_both_clients_share() {
        let shared: Vec<serde_json::Value> = serde_json::from_str(SHARED_METRICS).expect("a JSON array");
        let ours: Vec<serde_json::Value> = METRICS
            .iter()
            .map(|metric| {
                serde_json::json!({
                    "name": metric.name,
                    "kind": metric.kind.as_str(),
                    "labels": metric.labels,
                    "description": metric.description,
                })
            })
            .collect();
        assert_eq!(ours, shared, "src/telemetry/mod.rs and tests/vectors/metric_names.json differ");
    }

    #[test]
    fn every_metric_is_listed_once_under_the_plane_prefix() {
        let mut names: Vec<&str> = METRICS.iter().map(|metric| metric.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), METRICS.len(), "a metric is listed twice");
        for metric in METRICS {
            assert!(metric.name.starts_with("idempotency_"), "{}", metric.name);
            let suffix = match metric.kind {
                MetricKind::Counter => "_total",
                MetricKind::Histogram => "_seconds",
            };
            assert!(metric.name.ends_with(suffix), "{} is a {:?}", metric.name, metric.kind);
        }
        for name in [EFFECT_DURATION_SECONDS, WAITS_TOTAL, OUTCOMES_TOTAL, RPC_DURATION_SECONDS] {
            assert!(METRICS.iter().any(|metric| metric.name == name), "{name} is not listed");
        }
    }

    #[test]
    fn key_hash_gives_the_shared_vectors() {
        let shared: serde_json::Value = serde_json::from_str(SHARED_KEY_HASHES).expect("JSON");
        let vectors = shared["key_hash"].as_array().expect("a key_hash array");
        assert!(!vectors.is_empty());
        for vector in vectors {
            let key = vector["key"].as_str().expect("a key");
            assert_eq!(Some(key_hash(key).as_str()), vector["key_hash"].as_str(), "key {key:?}");
        }
    }
}
