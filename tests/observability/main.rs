//! What an operator sees: spans and warnings, captured by one global
//! subscriber. Its own test binary, so the subscriber is installed before any
//! callsite is hit; each test reads only what its own thread recorded (a
//! `#[tokio::test]` runtime runs the test, the stack and the server on the
//! test's thread).

#![cfg(feature = "local")]

#[path = "../plane/support/mod.rs"]
// The whole support module, for its harness; most of it serves `plane` only.
#[allow(dead_code, unused_imports)]
mod support;

use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolGuard, ToolKey, ToolResult, ToolSpec,
};
use idempotency_plane::sweeper::Sweeper;
use serde_json::json;
use support::harness::*;
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;

/// What one thread recorded: (span or event name, field, value).
type Records = Vec<(ThreadId, String, String, String)>;

fn records() -> &'static Mutex<Records> {
    static RECORDS: OnceLock<Mutex<Records>> = OnceLock::new();
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(Capture);
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
    });
    RECORDS.get_or_init(|| Mutex::new(Vec::new()))
}

fn mine(name: &str) -> Vec<(String, String)> {
    let me = std::thread::current().id();
    records()
        .lock()
        .expect("records")
        .iter()
        .filter(|(thread, n, _, _)| *thread == me && n == name)
        .map(|(_, _, field, value)| (field.clone(), value.clone()))
        .collect()
}

struct Capture;

struct Fields<'a>(&'a str, &'a mut Vec<(String, String)>);

impl tracing::field::Visit for Fields<'_> {
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.1.push((field.name().to_owned(), value.to_string()));
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.1.push((field.name().to_owned(), value.to_string()));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = self.0;
        self.1.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl<S> tracing_subscriber::Layer<S> for Capture
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = Vec::new();
        values.record(&mut Fields(span.name(), &mut fields));
        store(span.name(), fields);
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let name = format!("{}:{}", event.metadata().level(), event.metadata().target());
        let mut fields = Vec::new();
        event.record(&mut Fields(&name, &mut fields));
        store(&name, fields);
    }
}

fn store(name: &str, fields: Vec<(String, String)>) {
    let me = std::thread::current().id();
    if let Ok(mut records) = records().lock() {
        records.extend(fields.into_iter().map(|(field, value)| (me, name.to_owned(), field, value)));
    }
}

#[tokio::test]
async fn a_replayed_tool_call_marks_its_span_replayed() {
    records();
    let stack = stack().await;
    let guard = ToolGuard::new(service(&stack), RetryHorizon::until_last_attempt(Duration::from_secs(600)));
    let spec = ToolSpec::new("tool.email.send", Duration::from_secs(30), RepeatSafety::VendorKey).unwrap();
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({}));
    let allow = || async { Checkpoint::Allow };
    guard.run(org, &spec, &key, &args, allow, |_| async { ToolResult::success(json!(1)) }).await.unwrap();
    guard.run(org, &spec, &key, &args, allow, |_| async { panic!("replay") }).await.unwrap();

    let replayed: Vec<String> =
        mine("tool.call").into_iter().filter(|(field, _)| field == "replayed").map(|(_, value)| value).collect();
    assert_eq!(replayed, ["false", "true"]);
    let outcomes: Vec<String> =
        mine("tool.call").into_iter().filter(|(field, _)| field == "outcome").map(|(_, value)| value).collect();
    assert_eq!(outcomes, ["\"completed\"", "\"replayed\""]);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn five_times_the_bound_drains_over_several_passes_warning_until_the_last() {
    records();
    let stack = stack().await;
    expired_rows(&stack, 50).await;
    let sweeper = Sweeper::new(client(&stack), 10).unwrap();
    let warnings = || {
        mine("WARN:idempotency_plane::sweeper")
            .into_iter()
            .filter(|(field, value)| field == "message" && value.contains("filled its bound"))
            .count()
    };
    let mut reads = Vec::new();
    for pass in 1..=10 {
        let report = sweeper.pass().await.unwrap();
        reads.push(report.read);
        if !report.filled {
            break;
        }
        assert_eq!((report.deleted, report.bound), (10, 10));
        assert_eq!(warnings(), pass, "pass {pass} filled its read and warned");
    }
    assert_eq!(reads, [10, 10, 10, 10, 10, 0]);
    assert_eq!(warnings(), 5, "the quiet last pass does not warn");
    assert_eq!(count_rows(&stack).await, 0);
    stack.stop().await.unwrap();
}

/// The one global metrics recorder, installed on first use.
fn snapshotter() -> &'static metrics_util::debugging::Snapshotter {
    static SNAPSHOTTER: OnceLock<metrics_util::debugging::Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only global recorder");
        snapshotter
    })
}

/// Counters as one snapshot: (name, labels, value). A snapshot drains what
/// it reads, so each test takes one and reads it whole.
type Counters = Vec<(String, Vec<(String, String)>, u64)>;

fn counters() -> Counters {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            metrics_util::debugging::DebugValue::Counter(n) => Some((
                key.key().name().to_owned(),
                key.key().labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect(),
                n,
            )),
            _ => None,
        })
        .collect()
}

/// The sum of counter `name` over the series whose labels include `labels`.
fn count(counters: &Counters, name: &str, labels: &[(&str, &str)]) -> u64 {
    counters
        .iter()
        .filter(|(n, l, _)| n == name && labels.iter().all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v)))
        .map(|(_, _, value)| value)
        .sum()
}

#[tokio::test]
async fn outcomes_and_drop_reasons_are_counted_through_the_metrics_facade() {
    use idempotency_plane::callers::webhook::{Ack, Delivery, DropReason, ProcessingError, ProviderJobs, WebhookGate};
    records();
    snapshotter();
    let stack = stack().await;
    // A scope no other test uses, so counts from tests running alongside do not mix in.
    let scope = "webhook.metrics_probe";
    let gate = WebhookGate::new(
        service(&stack),
        ProviderJobs::new(idempotency_plane::PostgrestRepository::new(client(&stack))),
    );
    let delivery = Delivery { organization_id: org(), scope, delivery_id: "d-1", body: b"{}" };
    let ok = || async { Ok::<serde_json::Value, ProcessingError>(json!("ok")) };
    assert_eq!(gate.handle(delivery, ok).await, Ack::Processed);
    assert_eq!(gate.handle(delivery, ok).await, Ack::Dropped(DropReason::Duplicate));

    let counters = counters();
    let outcome = |operation, outcome| {
        count(
            &counters,
            "idempotency_outcomes_total",
            &[("scope", scope), ("operation", operation), ("outcome", outcome)],
        )
    };
    assert_eq!(outcome("claim", "claimed"), 1);
    assert_eq!(outcome("claim", "completed"), 1, "the redelivery replayed");
    let recorded = &[("scope", scope), ("operation", "complete"), ("ending", "recorded")];
    assert_eq!(count(&counters, "idempotency_endings_total", recorded), 1);
    // Other tests may drop duplicates meanwhile; ours is among them.
    assert!(count(&counters, "idempotency_webhook_drops_total", &[("reason", "duplicate")]) >= 1);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn no_secret_appears_in_any_log_record_or_span_field() {
    use idempotency_plane::postgrest::{ClientConfig, PostgrestClient, RetryConfig};
    use idempotency_plane::{ClaimOutcome, Completion, IdempotencyService, PostgrestRepository};
    records();
    let stack = stack().await;
    let key = stack.service_key().to_owned();
    // A server that first refuses with 503 makes the client log its retries.
    let flaky = wiremock::MockServer::start().await;
    wiremock::Mock::given(wiremock::matchers::any())
        .respond_with(
            wiremock::ResponseTemplate::new(503)
                .insert_header("retry-after", "0")
                .set_body_json(json!({"code": "PGRST002", "message": "schema cache", "details": null, "hint": null})),
        )
        .mount(&flaky)
        .await;
    let retry = RetryConfig {
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(2),
        ..RetryConfig::default()
    };
    let failing = PostgrestClient::new(
        ClientConfig::new(&flaky.uri(), key.clone()).unwrap().with_apikey(key.clone()).with_retry(retry),
    )
    .unwrap();
    let service = IdempotencyService::new(PostgrestRepository::new(failing));
    assert!(service.claim(org(), "tool.email.send", "k", &hash("x"), LEASE).await.is_err());
    // And a real claim, replay and completion on the stack.
    let real = IdempotencyService::new(PostgrestRepository::new(client(&stack)));
    let claim = claimed(real.claim(org(), "tool.email.send", "k", &hash("x"), LEASE).await);
    let _ = real.complete(&claim, Completion::response(json!(1))).await.unwrap();
    assert!(matches!(
        real.claim(claim.organization_id(), "tool.email.send", "k", &hash("x"), LEASE).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));

    let me = std::thread::current().id();
    let mine: Vec<String> = records()
        .lock()
        .unwrap()
        .iter()
        .filter(|(thread, ..)| *thread == me)
        .map(|(_, name, field, value)| format!("{name} {field}={value}"))
        .collect();
    assert!(mine.iter().any(|r| r.contains("retrying PostgREST call")), "the retries were logged: {mine:?}");
    let signature = key.rsplit('.').next().unwrap_or(&key);
    for record in &mine {
        assert!(!record.contains(signature), "a log record carries the key: {record}");
    }
    stack.stop().await.unwrap();
}
