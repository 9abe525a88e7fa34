//! `--metrics-addr`: the process's metrics as Prometheus text, served by the
//! `metrics-exporter-prometheus` exporter; and, when `idem` exports over
//! OTLP ([`crate::otel`]), the same metrics fed to both.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use metrics::{Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder};
use metrics::{SharedString, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use crate::BoxError;

/// Buckets of `idempotency_rpc_duration_seconds`: a call over HTTPS to a
/// database takes milliseconds to seconds; with retries, up to the deadline.
const RPC_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// The process's recorder while it exports over OTLP: the OTLP recorder,
/// and the Prometheus one beside it once an endpoint serves it.
struct Recorders {
    otlp: Box<dyn Recorder + Send + Sync>,
    prometheus: OnceLock<PrometheusRecorder>,
}

/// The installed [`Recorders`], when `idem` exports over OTLP.
static RECORDERS: OnceLock<&'static Recorders> = OnceLock::new();

/// Installs `otlp` as the process's metrics recorder (a Prometheus
/// endpoint served later is fed beside it) and describes the metrics.
pub(crate) fn export_to(otlp: impl Recorder + Send + Sync + 'static) {
    let recorders: &'static Recorders =
        Box::leak(Box::new(Recorders { otlp: Box::new(otlp), prometheus: OnceLock::new() }));
    if metrics::set_global_recorder(recorders).is_ok() {
        let _ = RECORDERS.set(recorders);
        idempotency_plane::telemetry::describe_metrics();
    }
}

/// Installs the Prometheus recorder as the process's global recorder (or
/// beside the OTLP one) and serves `GET /metrics` (any path answers) on
/// `addr`, on the current tokio runtime. Fails when the address cannot be
/// bound.
pub(crate) fn serve(addr: SocketAddr) -> Result<(), BoxError> {
    let builder = PrometheusBuilder::new().with_http_listener(addr).set_buckets_for_metric(
        Matcher::Full(idempotency_plane::telemetry::RPC_DURATION_SECONDS.to_owned()),
        RPC_BUCKETS,
    )?;
    match RECORDERS.get() {
        Some(recorders) => {
            let (recorder, exporter) =
                builder.build().map_err(|error| format!("cannot serve metrics on {addr}: {error}"))?;
            tokio::spawn(exporter);
            if recorders.prometheus.set(recorder).is_err() {
                return Err("the Prometheus endpoint is served already".into());
            }
        }
        None => builder.install().map_err(|error| format!("cannot serve metrics on {addr}: {error}"))?,
    }
    idempotency_plane::telemetry::describe_metrics();
    Ok(())
}

impl Recorder for Recorders {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if let Some(prometheus) = self.prometheus.get() {
            prometheus.describe_counter(key.clone(), unit, description.clone());
        }
        self.otlp.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if let Some(prometheus) = self.prometheus.get() {
            prometheus.describe_gauge(key.clone(), unit, description.clone());
        }
        self.otlp.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        if let Some(prometheus) = self.prometheus.get() {
            prometheus.describe_histogram(key.clone(), unit, description.clone());
        }
        self.otlp.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        let otlp = self.otlp.register_counter(key, metadata);
        match self.prometheus.get() {
            Some(prometheus) => Counter::from_arc(Arc::new(Both(otlp, prometheus.register_counter(key, metadata)))),
            None => otlp,
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        let otlp = self.otlp.register_gauge(key, metadata);
        match self.prometheus.get() {
            Some(prometheus) => Gauge::from_arc(Arc::new(Both(otlp, prometheus.register_gauge(key, metadata)))),
            None => otlp,
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        let otlp = self.otlp.register_histogram(key, metadata);
        match self.prometheus.get() {
            Some(prometheus) => Histogram::from_arc(Arc::new(Both(otlp, prometheus.register_histogram(key, metadata)))),
            None => otlp,
        }
    }
}

/// One handle feeding two recorders' handles.
struct Both<T>(T, T);

impl CounterFn for Both<Counter> {
    fn increment(&self, value: u64) {
        self.0.increment(value);
        self.1.increment(value);
    }

    fn absolute(&self, value: u64) {
        self.0.absolute(value);
        self.1.absolute(value);
    }
}

impl GaugeFn for Both<Gauge> {
    fn increment(&self, value: f64) {
        self.0.increment(value);
        self.1.increment(value);
    }

    fn decrement(&self, value: f64) {
        self.0.decrement(value);
        self.1.decrement(value);
    }

    fn set(&self, value: f64) {
        self.0.set(value);
        self.1.set(value);
    }
}

impl HistogramFn for Both<Histogram> {
    fn record(&self, value: f64) {
        self.0.record(value);
        self.1.record(value);
    }
}
