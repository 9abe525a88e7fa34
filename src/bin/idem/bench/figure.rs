//! One scenario's figure: how many operations, how fast, and their p50 and
//! p99 latencies. What every scenario measures, and the report reads.

use std::time::Duration;

use serde::Serialize;

/// Latencies of one scenario.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Figure {
    pub(super) name: String,
    pub(super) operations: usize,
    pub(super) seconds: f64,
    pub(super) per_second: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
}

impl Figure {
    /// The figure of `latencies` measured over `elapsed`: operations per
    /// second, p50 and p99.
    pub(super) fn from(name: &str, mut latencies: Vec<Duration>, elapsed: Duration) -> Figure {
        latencies.sort_unstable();
        let at = |q: f64| {
            latencies
                .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
        };
        Figure {
            name: name.to_owned(),
            operations: latencies.len(),
            seconds: elapsed.as_secs_f64(),
            per_second: latencies.len() as f64 / elapsed.as_secs_f64().max(f64::EPSILON),
            p50_ms: at(0.50),
            p99_ms: at(0.99),
        }
    }
}
