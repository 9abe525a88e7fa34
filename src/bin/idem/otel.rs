//! `idem`'s logs and, when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, its spans and metrics
//! exported over OTLP (http/protobuf unless `OTEL_EXPORTER_OTLP_PROTOCOL`
//! says http/json), flushed before it exits.

use idempotency_plane::telemetry::otel::{endpoint_configured, Otel};
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The service name spans and metrics are reported under, unless
/// `OTEL_SERVICE_NAME` names another.
const SERVICE_NAME: &str = "idem";

/// Logs go to stderr, filtered by `RUST_LOG` (else `default_filter`); with
/// an OTLP endpoint configured, the plane's and `idem`'s spans of level
/// `info` and above, and every metric, are exported too. Answers the
/// export, to [`shutdown`] before the process exits. An export that cannot
/// start (a protocol it does not speak) is warned about, and `idem` runs
/// without it.
pub(crate) fn init_logging(default_filter: &str) -> Option<Otel> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colour codes only where a terminal shows them, never in a log file.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let logs = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr).with_filter(filter);
    let otel = endpoint_configured()
        .then(|| Otel::from_env(SERVICE_NAME))
        .and_then(|started| started.inspect_err(|error| eprintln!("warning: no OpenTelemetry export: {error}")).ok());
    let exported = otel.as_ref().map(|otel| {
        let plane = Targets::new().with_target("idempotency_plane", Level::INFO).with_target("idem", Level::INFO);
        otel.layer().with_filter(plane)
    });
    let _ = tracing_subscriber::registry().with(logs).with(exported).try_init();
    if let Some(otel) = &otel {
        crate::metrics_endpoint::export_to(otel.metrics_recorder());
    }
    otel
}

/// Flushes the export, if there is one: what is buffered reaches the
/// collector before the process exits (a failure is warned about; the
/// command's exit code stands).
pub(crate) fn shutdown(otel: Option<Otel>) {
    if let Some(Err(error)) = otel.map(Otel::shutdown) {
        eprintln!("warning: {error}");
    }
}
