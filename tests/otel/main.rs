//! The OpenTelemetry export, received: an OTLP/HTTP receiver in the test
//! (POST /v1/traces and /v1/metrics, protobuf or JSON) takes what the crate
//! and `idem` export, and the tests read the spans back: their names and
//! attributes, the link a re-drive makes to the trace that first claimed its
//! work, and the metrics' names. Its own test binary: the process's global
//! subscriber and metrics recorder are the exporting ones.
//!
//! The tests run one at a time (they share the receiver, and the in-process
//! one points the exporter at it through the environment).

#![cfg(all(feature = "otel", feature = "local"))]

#[path = "../plane/support/mod.rs"]
// The whole support module, for its harness; most of it serves `plane` only.
#[allow(dead_code, unused_imports)]
mod support;

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use idempotency_plane::service::{Answer, Begun, Effect, EffectDriver, Redriven, Settle, Timing};
use idempotency_plane::telemetry::key_hash;
use idempotency_plane::telemetry::otel::Otel;
use opentelemetry::trace::TraceContextExt;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;
use support::harness::*;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

/// A scope whose claims carry work and may be re-driven (the gate's).
const SCOPE: &str = "webhook.stripe";

/// What the receiver took: each export as decoded, and how it was sent.
#[derive(Default)]
struct Received {
    /// (content type, service name, spans) of every trace export.
    spans: Vec<(String, String, Vec<Span>)>,
    /// The metric names of every metric export, with its service name.
    metrics: Vec<(String, Vec<String>)>,
}

/// The receiver, started once on a thread and runtime of its own (each test
/// has its own runtime): its base URL.
fn receiver() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port for the receiver");
        listener.set_nonblocking(true).expect("a nonblocking listener");
        let url = format!("http://{}", listener.local_addr().expect("its address"));
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                let app = axum::Router::new()
                    .route("/v1/traces", axum::routing::post(traces))
                    .route("/v1/metrics", axum::routing::post(metrics));
                axum::serve(listener, app).await.expect("the receiver serves");
            });
        });
        url
    })
}

fn received() -> &'static Mutex<Received> {
    static RECEIVED: OnceLock<Mutex<Received>> = OnceLock::new();
    RECEIVED.get_or_init(Mutex::default)
}

fn content_type(headers: &HeaderMap) -> String {
    headers.get("content-type").and_then(|value| value.to_str().ok()).unwrap_or("").to_owned()
}

/// Decodes an export as OTLP/HTTP sends it: protobuf, or JSON.
fn decode<T: Message + Default + serde::de::DeserializeOwned>(kind: &str, body: &[u8]) -> Result<T, String> {
    match kind {
        "application/x-protobuf" => T::decode(body).map_err(|error| error.to_string()),
        "application/json" => serde_json::from_slice(body).map_err(|error| error.to_string()),
        other => Err(format!("an unexpected content type {other:?}")),
    }
}

fn service_name(resource: Option<&opentelemetry_proto::tonic::resource::v1::Resource>) -> String {
    resource.and_then(|resource| text(&resource.attributes, "service.name")).unwrap_or_default()
}

async fn traces(headers: HeaderMap, body: Bytes) -> (StatusCode, Vec<u8>) {
    let kind = content_type(&headers);
    let Ok(export) = decode::<ExportTraceServiceRequest>(&kind, &body) else {
        return (StatusCode::BAD_REQUEST, vec![]);
    };
    let mut received = received().lock().expect("received");
    for resource in export.resource_spans {
        let service = service_name(resource.resource.as_ref());
        let spans = resource.scope_spans.into_iter().flat_map(|scope| scope.spans).collect();
        received.spans.push((kind.clone(), service, spans));
    }
    (StatusCode::OK, answer(&kind))
}

async fn metrics(headers: HeaderMap, body: Bytes) -> (StatusCode, Vec<u8>) {
    let kind = content_type(&headers);
    let Ok(export) = decode::<ExportMetricsServiceRequest>(&kind, &body) else {
        return (StatusCode::BAD_REQUEST, vec![]);
    };
    let mut received = received().lock().expect("received");
    for resource in export.resource_metrics {
        let service = service_name(resource.resource.as_ref());
        let names = resource
            .scope_metrics
            .into_iter()
            .flat_map(|scope| scope.metrics)
            .filter(|metric| metric.data.is_some())
            .map(|metric| metric.name)
            .collect();
        received.metrics.push((service, names));
    }
    (StatusCode::OK, answer(&kind))
}

/// An empty export answer in the request's encoding.
fn answer(kind: &str) -> Vec<u8> {
    if kind == "application/json" {
        b"{}".to_vec()
    } else {
        Vec::new()
    }
}

/// The spans received from `service`, with the content types they came in.
fn spans_of(service: &str) -> Vec<(String, Span)> {
    let received = received().lock().expect("received");
    received
        .spans
        .iter()
        .filter(|(_, name, _)| name == service)
        .flat_map(|(kind, _, spans)| spans.iter().map(move |span| (kind.clone(), span.clone())))
        .collect()
}

fn metric_names_of(service: &str) -> Vec<String> {
    let received = received().lock().expect("received");
    received.metrics.iter().filter(|(name, _)| name == service).flat_map(|(_, names)| names.clone()).collect()
}

fn value(attributes: &[KeyValue], key: &str) -> Option<any_value::Value> {
    attributes.iter().find(|attribute| attribute.key == key).and_then(|attribute| attribute.value.clone()?.value)
}

fn text(attributes: &[KeyValue], key: &str) -> Option<String> {
    match value(attributes, key)? {
        any_value::Value::StringValue(text) => Some(text),
        _ => None,
    }
}

fn flag(span: &Span, key: &str) -> Option<bool> {
    match value(&span.attributes, key)? {
        any_value::Value::BoolValue(flag) => Some(flag),
        _ => None,
    }
}

fn number(span: &Span, key: &str) -> Option<i64> {
    match value(&span.attributes, key)? {
        any_value::Value::IntValue(number) => Some(number),
        _ => None,
    }
}

/// Every string anywhere in an attribute value (arrays and maps included).
fn strings(value: &AnyValue, out: &mut Vec<String>) {
    match &value.value {
        Some(any_value::Value::StringValue(text)) => out.push(text.clone()),
        Some(any_value::Value::ArrayValue(array)) => array.values.iter().for_each(|value| strings(value, out)),
        Some(any_value::Value::KvlistValue(list)) => {
            list.values.iter().filter_map(|kv| kv.value.as_ref()).for_each(|value| strings(value, out))
        }
        _ => {}
    }
}

/// Every text of a span: its name, its events' names (a log line's
/// message), and the attributes of the span, its events and its links.
fn attribute_texts(span: &Span) -> Vec<String> {
    let mut out = vec![span.name.clone()];
    out.extend(span.events.iter().map(|event| event.name.clone()));
    let attributes = span
        .attributes
        .iter()
        .chain(span.events.iter().flat_map(|event| &event.attributes))
        .chain(span.links.iter().flat_map(|link| &link.attributes));
    for attribute in attributes {
        out.push(attribute.key.clone());
        if let Some(value) = &attribute.value {
            strings(value, &mut out);
        }
    }
    out
}

/// Waits (at most 20 s) until `found` finds what it looks for in what the
/// receiver holds.
async fn eventually_received<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(value) = found() {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: not received within 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tests one at a time: the receiver is shared, and the in-process
/// export is pointed at it through the environment.
fn serial() -> &'static tokio::sync::Mutex<()> {
    static SERIAL: OnceLock<tokio::sync::Mutex<()>> = OnceLock::new();
    SERIAL.get_or_init(|| tokio::sync::Mutex::new(()))
}

/// The service name the in-process export reports under.
const IN_PROCESS: &str = "otel-test";

/// The in-process export, started once with only OTEL_EXPORTER_OTLP_ENDPOINT
/// naming the receiver, behind the global subscriber and metrics recorder.
fn exporting() -> &'static Otel {
    static OTEL: OnceLock<Otel> = OnceLock::new();
    OTEL.get_or_init(|| {
        for (name, _) in std::env::vars() {
            if name.starts_with("OTEL_") {
                std::env::remove_var(name);
            }
        }
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", receiver());
        let otel = Otel::from_env(IN_PROCESS).expect("the export starts");
        let subscriber = tracing_subscriber::registry().with(otel.layer());
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
        otel.install_metrics().expect("the only metrics recorder");
        otel
    })
}

/// The trace id of `span`, as the receiver shows it (16 bytes).
fn trace_id_of(span: &tracing::Span) -> Vec<u8> {
    span.context().span().span_context().trace_id().to_bytes().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_a_replay_and_a_redrive_linked_to_the_first_trace_reach_the_collector() {
    let _one_at_a_time = serial().lock().await;
    let otel = exporting();
    let stack = stack().await;
    let driver = EffectDriver::new(service(&stack));
    let org = org();
    let timing = Timing::new(Duration::from_secs(5), Duration::from_secs(2), Duration::from_secs(1)).expect("a timing");
    // Keys that would be personal data: no attribute may carry them.
    let (done_key, orphan_key) =
        (format!("person-{}@example.com", Uuid::new_v4()), format!("person-{}@example.org", Uuid::new_v4()));
    let request = json!({"body": "what the first worker was asked"});

    // A claim that ran and journaled its answer, then a replay of it.
    let done_hash = hash(&done_key);
    let effect = Effect {
        organization_id: org,
        scope: SCOPE,
        key: &done_key,
        request_hash: &done_hash,
        timing,
        request: Some(&request),
    };
    let first = tracing::info_span!(parent: None, "test.first_worker");
    async {
        let Begun::Held(held) = driver.begin(&effect).await.expect("a claim") else { panic!("the key was free") };
        let ran = held.run(async { Settle::Journal(Answer::success(json!({"sent": true}))) }).await;
        assert!(held.settle(ran.expect("the effect ran")).await.is_journaled());
        assert!(matches!(driver.begin(&effect).await.expect("a replay"), Begun::Replayed(_)));
    }
    .instrument(first.clone())
    .await;

    // A claim carrying work whose worker stopped (dropped unsettled), in a
    // trace of its own; its lease passes.
    let orphan_hash = hash(&orphan_key);
    let orphaned = tracing::info_span!(parent: None, "test.worker_that_stopped");
    let orphan_claim = async {
        let effect = Effect { key: &orphan_key, request_hash: &orphan_hash, ..effect };
        let Begun::Held(held) = driver.begin(&effect).await.expect("a claim") else { panic!("the key was free") };
        held.claim().id()
    }
    .instrument(orphaned.clone())
    .await;
    let orphaned_trace = trace_id_of(&orphaned);
    drop(orphaned);
    pass_lease(&stack, orphan_claim).await;

    // The re-drive, in another trace: its effect is linked to the first.
    let redriver = tracing::info_span!(parent: None, "test.redriver");
    let redriver_trace = trace_id_of(&redriver);
    async {
        let taken = driver.redrive(SCOPE, 10, Some(org), timing).await.expect("a re-drive");
        assert_eq!(taken.len(), 1, "the one orphan");
        for redriven in taken {
            let Redriven::Held { held, request: work, attempt } = redriven else { panic!("not a dead letter") };
            assert_eq!((work, attempt), (request.clone(), 2));
            let ran = held.run(async { Settle::Journal(Answer::success(json!({"sent": "again"}))) }).await;
            assert!(held.settle(ran.expect("the effect ran")).await.is_journaled());
        }
    }
    .instrument(redriver.clone())
    .await;
    drop((first, redriver));
    assert_ne!(orphaned_trace, redriver_trace);
    otel.flush().expect("the export flushes");

    let spans = || spans_of(IN_PROCESS).into_iter().map(|(_, span)| span).collect::<Vec<_>>();
    let with_key = |span: &Span, key: &str| text(&span.attributes, "idempotency.key_hash") == Some(key_hash(key));
    let claims_of = |key: &str| -> Vec<Span> {
        spans().into_iter().filter(|span| span.name == "idempotency.claim" && with_key(span, key)).collect()
    };

    // The claim, then its replay.
    let done =
        eventually_received("the two claims of one key", || Some(claims_of(&done_key)).filter(|c| c.len() == 2)).await;
    let outcome = |span: &Span| text(&span.attributes, "idempotency.outcome");
    let claimed = done.iter().find(|span| outcome(span).as_deref() == Some("claimed")).expect("a claimed claim span");
    let replayed =
        done.iter().find(|span| outcome(span).as_deref() == Some("replayed")).expect("a replayed claim span");
    for span in [claimed, replayed] {
        assert_eq!(text(&span.attributes, "idempotency.scope").as_deref(), Some(SCOPE));
    }
    assert_eq!(
        (flag(claimed, "idempotency.replayed"), number(claimed, "idempotency.attempt")),
        (Some(false), Some(1)),
        "{:?}",
        claimed.attributes
    );
    assert_eq!(flag(claimed, "idempotency.reclaimed"), Some(false));
    assert_eq!(flag(replayed, "idempotency.replayed"), Some(true));
    assert_eq!(claimed.trace_id, replayed.trace_id, "one worker's trace");

    // The stopped worker's claim, in its trace.
    let stopped = eventually_received("the stopped worker's claim", || claims_of(&orphan_key).into_iter().next()).await;
    assert_eq!(stopped.trace_id, orphaned_trace);
    assert_eq!(outcome(&stopped).as_deref(), Some("claimed"));

    // The re-drive's effect: in the re-driver's trace, linked to the first.
    let effect_of = |key: &str| {
        spans()
            .into_iter()
            .find(|span| span.name == "idempotency.effect" && with_key(span, key) && span.trace_id == redriver_trace)
    };
    let rerun = eventually_received("the re-driven effect", || effect_of(&orphan_key)).await;
    assert_eq!(number(&rerun, "idempotency.attempt"), Some(2));
    assert_eq!(flag(&rerun, "idempotency.reclaimed"), Some(true));
    assert_eq!(text(&rerun.attributes, "idempotency.ending").as_deref(), Some("journaled"));
    assert_eq!(rerun.links.len(), 1, "one link, to the trace that first claimed the work");
    assert_eq!(rerun.links[0].trace_id, orphaned_trace, "linked to the first trace");
    assert_eq!(rerun.links[0].span_id, stopped.span_id, "linked to the claim that stored the work");
    assert_ne!(rerun.trace_id, orphaned_trace, "a link, not a parent: the re-drive runs in its own trace");
    let redrive_span = spans()
        .into_iter()
        .find(|span| span.name == "idempotency.redrive" && span.trace_id == redriver_trace)
        .expect("the re-drive's span");
    assert_eq!(text(&redrive_span.attributes, "idempotency.scope").as_deref(), Some(SCOPE));
    assert!(
        spans().iter().filter(|span| span.trace_id == orphaned_trace).all(|span| span.links.is_empty()),
        "the first trace links to nothing"
    );
    assert!(
        spans().iter().filter(|span| span.trace_id == claimed.trace_id).all(|span| span.links.is_empty()),
        "work run by the worker that claimed it links to nothing"
    );
    assert!(
        spans().iter().any(|span| span.name == "idempotency.effect" && span.trace_id == claimed.trace_id),
        "the first worker's effect has a span"
    );

    // No attribute anywhere carries a raw key.
    for span in spans() {
        for text in attribute_texts(&span) {
            assert!(!text.contains(&done_key) && !text.contains(&orphan_key), "{}: {text}", span.name);
        }
    }

    // The outcome metrics, by the names both clients share.
    otel.flush().expect("the export flushes");
    let shared: Vec<serde_json::Value> =
        serde_json::from_str(include_str!("../vectors/metric_names.json")).expect("the shared metric list");
    let shared: Vec<String> = shared.iter().filter_map(|metric| metric["name"].as_str().map(str::to_owned)).collect();
    let names = eventually_received("the outcome metrics", || {
        let names = metric_names_of(IN_PROCESS);
        names.iter().any(|name| name == "idempotency_effect_duration_seconds").then_some(names)
    })
    .await;
    for name in ["idempotency_outcomes_total", "idempotency_effect_endings_total", "idempotency_redrives_total"] {
        assert!(names.iter().any(|received| received == name), "{name} not received: {names:?}");
    }
    for name in names.iter().filter(|name| name.starts_with("idempotency_")) {
        assert!(shared.contains(name), "{name} is not in tests/vectors/metric_names.json");
    }
    stack.stop().await.expect("the stack stops");
}

/// Runs `idem` with `args` against `stack`, exporting to the receiver with
/// only `otel` set of the OTEL_* variables, `input` on stdin.
async fn idem(
    stack: &idempotency_plane::local::LocalStack,
    otel: &[(&str, String)],
    args: &[&str],
    input: &str,
) -> std::process::Output {
    use tokio::io::AsyncWriteExt;
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    for (name, _) in std::env::vars() {
        if name.starts_with("OTEL_") {
            command.env_remove(name);
        }
    }
    let mut child = command
        .args(args)
        .env_remove("SUPABASE_URL")
        .env_remove("IDEM_MAX_ROWS")
        .env("IDEM_POSTGREST_URL", stack.url())
        .env("IDEM_SERVICE_KEY", stack.service_key())
        .envs(otel.iter().map(|(name, value)| (*name, value.as_str())))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idem");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.as_bytes()).await.expect("write stdin");
    drop(stdin);
    within(Duration::from_secs(120), "idem", child.wait_with_output()).await.expect("run idem")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_exports_its_spans_to_the_endpoint_the_environment_names_and_flushes_before_it_exits() {
    let _one_at_a_time = serial().lock().await;
    let stack = stack().await;
    let org = Uuid::new_v4().to_string();
    // http/protobuf by default (the endpoint alone), http/json when asked.
    for (service, protocol) in [("idem-default", None), ("idem-json", Some("http/json"))] {
        let key = format!("customer-{}", Uuid::new_v4());
        let mut otel = vec![("OTEL_EXPORTER_OTLP_ENDPOINT", receiver().to_owned())];
        otel.push(("OTEL_SERVICE_NAME", service.to_owned()));
        if let Some(protocol) = protocol {
            otel.push(("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.to_owned()));
        }
        let args = ["claim", "--org", &org, "--scope", "tool.email.send", "--key", &key, "--hold", "--release"];
        let output = idem(&stack, &otel, &args, r#"{"to":"a@example.com"}"#).await;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "idem claim: {stderr}");
        assert!(!stderr.contains("warning"), "{stderr}");
        // idem exited: what it exported arrived before it did (no waiting).
        let spans = spans_of(service);
        let claim = spans
            .iter()
            .find(|(_, span)| span.name == "idempotency.claim")
            .unwrap_or_else(|| panic!("{service}: no claim span among {} spans", spans.len()));
        let wanted = if protocol.is_some() { "application/json" } else { "application/x-protobuf" };
        assert_eq!(claim.0, wanted, "{service}");
        let claim = &claim.1;
        assert_eq!(text(&claim.attributes, "idempotency.scope").as_deref(), Some("tool.email.send"));
        assert_eq!(text(&claim.attributes, "idempotency.key_hash"), Some(key_hash(&key)));
        assert_eq!(text(&claim.attributes, "idempotency.outcome").as_deref(), Some("claimed"));
        assert_eq!(flag(claim, "idempotency.replayed"), Some(false));
        let release = spans.iter().find(|(_, span)| span.name == "idempotency.release").expect("the release's span");
        assert_eq!(text(&release.1.attributes, "idempotency.ending").as_deref(), Some("recorded"));
        for (_, span) in &spans {
            for text in attribute_texts(span) {
                assert!(!text.contains(&key), "{}: {text}", span.name);
            }
        }
        // Its metrics too, flushed at exit.
        let names = metric_names_of(service);
        assert!(names.iter().any(|name| name == "idempotency_outcomes_total"), "{service}: {names:?}");
    }
    stack.stop().await.expect("the stack stops");
}
