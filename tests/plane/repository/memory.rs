//! The service's decisions and the callers, on the in-memory repository:
//! fast, no database, and run with the library's default features. The
//! conformance suite keeps the fake honest; what only a real database and
//! server can prove stays in `stack`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::callers::webhook::{
    Ack, Delivery, DropReason, ProcessingError, ProviderCallback, ProviderJobs, WebhookGate,
};
use idempotency_plane::{
    ClaimOutcome, Completion, Ending, Error, IdempotencyService, MemoryRepository, ReadOutcome, RequestHash,
};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::{claimed, hash, LEASE};

type Service = IdempotencyService<MemoryRepository>;

fn service() -> Service {
    IdempotencyService::new(MemoryRepository::new())
}

#[tokio::test]
async fn the_service_reads_absent_for_a_passed_lease_and_its_claim_reclaims_it() {
    let service = service();
    let org = Uuid::new_v4();
    let crashed = claimed(service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await);
    assert!(matches!(service.read(org, "tool.email.send", "k", &hash("x")).await, Ok(ReadOutcome::Processing { .. })));
    service.repository().pass_lease(crashed.id());
    assert_eq!(service.read(org, "tool.email.send", "k", &hash("x")).await.unwrap(), ReadOutcome::Absent);
    assert_eq!(service.read(org, "tool.email.send", "k", &hash("y")).await.unwrap(), ReadOutcome::Conflict);
    let taken = claimed(service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await);
    assert!(taken.reclaimed());
    assert_eq!(service.complete(&crashed, Completion::response(json!(1))).await.unwrap(), Ending::LeaseMovedOn);
    assert_eq!(service.complete(&taken, Completion::response(json!(2))).await.unwrap(), Ending::Recorded);
    let replay = service.claim(org, "tool.email.send", "k", &hash("x"), LEASE).await.unwrap();
    assert!(matches!(replay, ClaimOutcome::Completed { response: Some(ref r), .. } if *r == json!(2)), "{replay:?}");
}

fn guard(service: Service) -> ToolGuard<MemoryRepository> {
    ToolGuard::new(service, RetryHorizon::until_last_attempt(Duration::from_secs(600)))
}

fn spec() -> ToolSpec {
    ToolSpec::new("tool.email.send", Duration::from_secs(5), RepeatSafety::VendorKey).expect("spec")
}

async fn allow() -> Checkpoint {
    Checkpoint::Allow
}

#[tokio::test]
async fn the_tool_guard_runs_once_replays_after_and_refuses_changed_arguments() {
    let guard = guard(service());
    let (org, key, args) = (Uuid::new_v4(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "a"}));
    let sends = AtomicUsize::new(0);
    let tool = |_| async {
        sends.fetch_add(1, Ordering::SeqCst);
        ToolResult::success(json!({"id": "m-1"}))
    };
    assert!(matches!(guard.run(org, &spec(), &key, &args, allow, tool).await, Ok(ToolRun::Executed(_))));
    assert!(matches!(guard.run(org, &spec(), &key, &args, allow, tool).await, Ok(ToolRun::Replayed(_))));
    let changed = guard.run(org, &spec(), &key, &json!({"to": "b"}), allow, tool).await;
    assert!(matches!(changed, Err(ToolError::Conflict { .. })), "{changed:?}");
    assert_eq!(sends.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_tool_guard_raises_for_a_call_in_flight_and_releases_a_retryable_failure() {
    let service = service();
    let (org, args) = (Uuid::new_v4(), json!({"to": "a"}));
    let held = ToolKey::for_step(Uuid::new_v4(), "held");
    let _holder =
        claimed(service.claim(org, "tool.email.send", held.as_str(), &RequestHash::of_json(&args), LEASE).await);
    let guard = guard(service);
    let in_flight = guard.run(org, &spec(), &held, &args, allow, |_| async { panic!("in flight") }).await;
    assert!(matches!(in_flight, Err(ToolError::ClaimInFlight { .. })), "{in_flight:?}");

    let key = ToolKey::for_step(Uuid::new_v4(), "rate-limited");
    let failed = guard
        .run(org, &spec(), &key, &args, allow, |_| async { ToolResult::retryable_failure("rate_limited", json!({})) })
        .await;
    assert!(matches!(failed, Ok(ToolRun::Executed(ref r)) if r.retryable), "{failed:?}");
    let next = guard.run(org, &spec(), &key, &args, allow, |_| async { ToolResult::success(json!(1)) }).await;
    assert!(matches!(next, Ok(ToolRun::Executed(ref r)) if r.ok), "released, so the next attempt executes: {next:?}");
}

#[tokio::test]
async fn a_reclaimed_call_of_a_keyless_vendor_is_reconciled_not_sent_again() {
    let service = service();
    let (org, key, args) = (Uuid::new_v4(), ToolKey::for_step(Uuid::new_v4(), "notify"), json!({"to": "ops"}));
    let crashed =
        claimed(service.claim(org, "tool.keyless.send", key.as_str(), &RequestHash::of_json(&args), LEASE).await);
    service.repository().pass_lease(crashed.id());
    let reconcile = RepeatSafety::reconcile(|_, _| async { Ok(Some(ToolResult::success(json!({"id": "found"})))) });
    let spec = ToolSpec::new("tool.keyless.send", Duration::from_secs(5), reconcile).expect("spec");
    let ran = guard(service).run(org, &spec, &key, &args, allow, |_| async { panic!("must not send again") }).await;
    assert!(matches!(ran, Ok(ToolRun::Reconciled(ref r)) if r.output == json!({"id": "found"})), "{ran:?}");
}

fn gate(service: Service) -> WebhookGate<MemoryRepository, MemoryRepository> {
    WebhookGate::new(service, ProviderJobs::over(MemoryRepository::new()))
}

#[tokio::test]
async fn the_webhook_gate_acks_duplicates_and_mismatches_with_their_reasons() {
    let gate = gate(service());
    let org = Uuid::new_v4();
    let delivery =
        |body: &'static [u8]| Delivery { organization_id: org, scope: "webhook.nylas", delivery_id: "d-1", body };
    let processed = std::sync::Arc::new(AtomicUsize::new(0));
    let process = {
        let processed = processed.clone();
        move || {
            processed.fetch_add(1, Ordering::SeqCst);
            async { Ok::<Value, ProcessingError>(json!("stored")) }
        }
    };
    assert_eq!(gate.handle(delivery(b"{\"a\":1}"), process.clone()).await, Ack::Processed);
    assert_eq!(gate.handle(delivery(b"{\"a\":1}"), process.clone()).await, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(gate.handle(delivery(b"{\"a\":2}"), process).await, Ack::Dropped(DropReason::HashMismatch));
    assert_eq!(processed.load(Ordering::SeqCst), 1);
    assert_eq!((gate.drops().get(DropReason::Duplicate), gate.drops().get(DropReason::HashMismatch)), (1, 1));
}

#[tokio::test]
async fn a_provider_callback_for_a_job_nobody_started_is_dropped_before_any_claim() {
    let gate = gate(service());
    let callback = ProviderCallback {
        provider: "transcribe",
        path_job_id: "job-404",
        body_job_id: None,
        delivery_id: "d-9",
        body: b"{}",
    };
    let ack = gate.handle_provider_callback(callback, |_| async { panic!("must not process") }).await;
    assert_eq!(ack, Ack::Dropped(DropReason::UnknownJob));
}

#[tokio::test]
async fn the_in_memory_policy_table_refuses_a_short_tool_retention_and_takes_new_scopes() {
    let short = MemoryRepository::new().with_policy("tool.crm.*", Duration::from_secs(86_400), 65_536);
    assert!(matches!(short, Err(Error::Store(_))), "a tool scope keeps 30 days: {short:?}");
    let repo = MemoryRepository::new().with_policy("payments.charge", Duration::from_secs(7 * 86_400), 4096).unwrap();
    let service = IdempotencyService::new(repo);
    let org = Uuid::new_v4();
    let claim = claimed(service.claim(org, "payments.charge", "p-1", &hash("x"), LEASE).await);
    assert_eq!(claim.retain_until() - claim.lease_expires_at(), chrono::TimeDelta::days(7));
    let unknown = service.claim(org, "payments.refund", "p-1", &hash("x"), LEASE).await;
    assert!(matches!(unknown, Err(Error::UnknownScope { .. })), "{unknown:?}");
}
