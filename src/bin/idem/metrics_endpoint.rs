//! `--metrics-addr`: the process's metrics as Prometheus text, served by the
//! `metrics-exporter-prometheus` exporter.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use crate::BoxError;

/// Buckets of `idempotency_rpc_duration_seconds`: a call over HTTPS to a
/// database takes milliseconds to seconds; with retries, up to the deadline.
const RPC_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Installs the Prometheus recorder as the process's global recorder and
/// serves `GET /metrics` (any path answers) on `addr`, on the current tokio
/// runtime. Fails when the address cannot be bound.
pub(crate) fn serve(addr: SocketAddr) -> Result<(), BoxError> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full(idempotency_plane::telemetry::RPC_DURATION_SECONDS.to_owned()),
            RPC_BUCKETS,
        )?
        .install()
        .map_err(|error| format!("cannot serve metrics on {addr}: {error}"))?;
    idempotency_plane::telemetry::describe_metrics();
    Ok(())
}
