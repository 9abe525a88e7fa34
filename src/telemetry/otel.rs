//! OpenTelemetry export (feature `otel`): the crate's spans through
//! `tracing-opentelemetry` and its metrics through the `metrics` facade,
//! both sent over OTLP/HTTP to the endpoint the standard variables name.
//!
//! Configured only by the environment, as every OpenTelemetry SDK is:
//!
//! | variable | meaning |
//! |---|---|
//! | `OTEL_EXPORTER_OTLP_ENDPOINT` | base URL of the collector; `/v1/traces` and `/v1/metrics` are appended (default `http://localhost:4318`) |
//! | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` | one signal's full URL, used as given |
//! | `OTEL_EXPORTER_OTLP_PROTOCOL` (or a signal's) | `http/protobuf` (the default) or `http/json`; `grpc` is refused |
//! | `OTEL_EXPORTER_OTLP_HEADERS` (or a signal's) | `key=value,…` sent with every export (a collector's token) |
//! | `OTEL_EXPORTER_OTLP_TIMEOUT` (or a signal's) | milliseconds one export may take (default 10000) |
//! | `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` | the resource; the service name defaults to the caller's |
//! | `OTEL_METRIC_EXPORT_INTERVAL` | milliseconds between metric exports (default 60000) |
//! | `OTEL_BSP_*`, `OTEL_TRACES_SAMPLER` | the batch span processor and the sampler, as the SDK reads them |
//!
//! Exports go through the crate's own reqwest client (rustls), on a runtime
//! of their own (one thread), so a flush never waits on the caller's
//! runtime. [`Otel::shutdown`] (or dropping the [`Otel`]) flushes what is
//! buffered: call it before the process exits.
//!
//! ```no_run
//! # fn main() -> Result<(), idempotency_plane::telemetry::otel::OtelError> {
//! // A worker with no subscriber of its own: logs on stderr (RUST_LOG), spans
//! // and metrics to the collector.
//! let otel = idempotency_plane::telemetry::otel::init("orders-worker")?;
//! // ... serve ...
//! otel.shutdown()?;
//! # Ok(()) }
//! ```

mod http;

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use super::{MetricKind, METRICS};

/// The instrumentation scope the spans and metrics are reported under.
const SCOPE: &str = "idempotency-plane";

/// Bucket bounds of the crate's histograms, in seconds: a call over HTTPS
/// takes milliseconds to seconds, an effect up to its timeout.
const SECONDS_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

/// What can stop the export from starting or flushing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtelError {
    /// A protocol variable names a protocol this crate does not export with.
    #[error("{variable} is {value:?}: this crate exports over OTLP/HTTP, http/protobuf (the default) or http/json")]
    UnsupportedProtocol {
        /// The variable that named it.
        variable: &'static str,
        /// What it named.
        value: String,
    },
    /// `OTEL_EXPORTER_OTLP_TIMEOUT` is not a number of milliseconds.
    #[error("OTEL_EXPORTER_OTLP_TIMEOUT is {0:?}: it must be a number of milliseconds")]
    BadTimeout(String),
    /// The exporter refused its configuration (an endpoint that is no URL).
    #[error("the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// The export's HTTP client could not be built.
    #[error("the OTLP exporter's HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// The export's runtime could not be started.
    #[error("the OTLP exporter's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// Another global tracing subscriber or metrics recorder was installed first.
    #[error("another global {0} is installed")]
    AlreadyInstalled(&'static str),
    /// A flush or shutdown did not complete (the collector did not answer in time).
    #[error("the OTLP export did not flush: {0}")]
    Flush(#[from] opentelemetry_sdk::error::OTelSdkError),
}

/// Whether the environment names an OTLP endpoint for traces
/// (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
/// non-empty) and does not disable the SDK (`OTEL_SDK_DISABLED=true`):
/// what `idem` exports on.
pub fn endpoint_configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|value| value.trim().eq_ignore_ascii_case("true"));
    !disabled && (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
}

/// The export, started: a tracer provider and a meter provider sending
/// over OTLP/HTTP. Hand its [`layer`](Self::layer) to the tracing
/// subscriber and its [`metrics_recorder`](Self::metrics_recorder) to the
/// `metrics` facade (or let [`init`] do both); [`shutdown`](Self::shutdown)
/// flushes, and so does dropping it.
#[derive(Debug)]
pub struct Otel {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
    shut_down: bool,
}

impl Otel {
    /// Starts the export as the `OTEL_*` variables say (see the module's
    /// table), reporting as `default_service_name` unless
    /// `OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`)
    /// names the service. Installs nothing global.
    pub fn from_env(default_service_name: &str) -> Result<Otel, OtelError> {
        let client = http::ExportClient::new(export_timeout()?)?;
        let resource = resource(default_service_name);
        let spans = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client.clone())
            .with_protocol(protocol("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")?)
            .build()?;
        let metrics = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(protocol("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")?)
            .build()?;
        let tracer_provider =
            SdkTracerProvider::builder().with_batch_exporter(spans).with_resource(resource.clone()).build();
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(metrics).build())
            .with_resource(resource)
            .build();
        Ok(Otel { tracer_provider, meter_provider, shut_down: false })
    }

    /// The tracing layer that exports spans (their fields as attributes,
    /// `otel.status_code` as the status, events as span events). Add it to
    /// the subscriber, with a filter of its own if the subscriber's other
    /// layers log less than `info`.
    pub fn layer<S>(&self) -> impl Layer<S>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        tracing_opentelemetry::layer().with_tracer(self.tracer_provider.tracer(SCOPE))
    }

    /// A `metrics` recorder that records into this export's meter: install
    /// it (or let [`install_metrics`](Self::install_metrics) do so), or put
    /// it beside another recorder in a fanout.
    pub fn metrics_recorder(&self) -> OtelRecorder {
        let meter = self.meter_provider.meter(SCOPE);
        let mut recorder =
            metrics_opentelemetry::OpenTelemetryRecorder::new(metrics_opentelemetry::OpenTelemetryMetrics::new(meter));
        let histograms = METRICS.iter().filter(|metric| metric.kind == MetricKind::Histogram);
        recorder.set_histogram_bounds_mut(histograms.map(|metric| metric.name), SECONDS_BUCKETS);
        OtelRecorder(recorder)
    }

    /// Installs [`metrics_recorder`](Self::metrics_recorder) as the
    /// process's `metrics` recorder and describes the crate's metrics.
    pub fn install_metrics(&self) -> Result<(), OtelError> {
        metrics::set_global_recorder(self.metrics_recorder())
            .map_err(|_| OtelError::AlreadyInstalled("metrics recorder"))?;
        super::describe_metrics();
        Ok(())
    }

    /// Exports what is buffered now, spans and metrics, without stopping.
    pub fn flush(&self) -> Result<(), OtelError> {
        let spans = self.tracer_provider.force_flush();
        self.meter_provider.force_flush()?;
        Ok(spans?)
    }

    /// Flushes everything buffered and stops the export. Call it before the
    /// process exits: spans still buffered are lost otherwise.
    pub fn shutdown(mut self) -> Result<(), OtelError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), OtelError> {
        if std::mem::replace(&mut self.shut_down, true) {
            return Ok(());
        }
        // Spans first: the meter's last export then counts what they ended.
        let spans = self.tracer_provider.shutdown();
        self.meter_provider.shutdown()?;
        Ok(spans?)
    }
}

impl Drop for Otel {
    fn drop(&mut self) {
        if let Err(error) = self.stop() {
            tracing::warn!(%error, "the OpenTelemetry export did not flush before it stopped");
        }
    }
}

/// For a process with no tracing subscriber or metrics recorder of its
/// own: starts the export ([`Otel::from_env`]), installs a global
/// subscriber that logs to stderr as `RUST_LOG` says (default `warn`) and
/// exports spans of level `info` and above, and installs the metrics
/// recorder. Keep the answer and [`shutdown`](Otel::shutdown) it before
/// exiting.
pub fn init(default_service_name: &str) -> Result<Otel, OtelError> {
    let otel = Otel::from_env(default_service_name)?;
    let logs = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(logs))
        .with(otel.layer().with_filter(tracing_subscriber::filter::LevelFilter::INFO))
        .try_init()
        .map_err(|_| OtelError::AlreadyInstalled("tracing subscriber"))?;
    otel.install_metrics()?;
    Ok(otel)
}

/// The resource every span and metric is reported with: the SDK's own
/// (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`), the service named
/// `default_service_name` when neither names it.
fn resource(default_service_name: &str) -> Resource {
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|name| !name.trim().is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES")
            .is_ok_and(|attributes| attributes.split(',').any(|pair| pair.trim_start().starts_with("service.name=")));
    let builder = Resource::builder();
    if named {
        builder.build()
    } else {
        builder.with_service_name(default_service_name.to_owned()).build()
    }
}

/// The protocol a signal exports with: its own variable, else
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, else http/protobuf (the specification's
/// default).
fn protocol(signal_variable: &'static str) -> Result<Protocol, OtelError> {
    for variable in [signal_variable, "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        let Ok(value) = std::env::var(variable) else { continue };
        return match value.trim().to_ascii_lowercase().as_str() {
            "" => continue,
            "http/protobuf" => Ok(Protocol::HttpBinary),
            "http/json" => Ok(Protocol::HttpJson),
            _ => Err(OtelError::UnsupportedProtocol { variable, value }),
        };
    }
    Ok(Protocol::HttpBinary)
}

/// How long one export request may take: `OTEL_EXPORTER_OTLP_TIMEOUT`
/// milliseconds, 10 s by default.
fn export_timeout() -> Result<Duration, OtelError> {
    match std::env::var("OTEL_EXPORTER_OTLP_TIMEOUT") {
        Ok(value) if !value.trim().is_empty() => {
            value.trim().parse::<u64>().map(Duration::from_millis).map_err(|_| OtelError::BadTimeout(value))
        }
        _ => Ok(Duration::from_secs(10)),
    }
}

/// The `metrics` recorder of an [`Otel`] export: counters as OpenTelemetry
/// counters, histograms as histograms (bucketed in seconds), gauges as
/// gauges, each with the description [`describe_metrics`](super::describe_metrics) gave it.
pub struct OtelRecorder(metrics_opentelemetry::OpenTelemetryRecorder);

impl std::fmt::Debug for OtelRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OtelRecorder")
    }
}

impl metrics::Recorder for OtelRecorder {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description)
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description)
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description)
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.0.register_counter(key, metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.0.register_gauge(key, metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.0.register_histogram(key, metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_histogram_is_in_seconds() {
        // The one bucket list fits them all only while each measures seconds.
        for metric in METRICS.iter().filter(|metric| metric.kind == MetricKind::Histogram) {
            assert_eq!(metric.unit, Unit::Seconds, "{}", metric.name);
        }
    }
}
