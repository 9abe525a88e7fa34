//! The endings of the tool guard and the webhook gate under the faults that
//! used to repeat effects or lose events, reproduced with real requests
//! against the stack and a proxy that delays or drops chosen RPC answers
//! after the database committed them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::callers::webhook::{Ack, Delivery, DropReason, ProcessingError, ProviderJobs, WebhookGate};
use idempotency_plane::local::LocalStack;
use idempotency_plane::{IdempotencyService, PostgrestRepository};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::harness::*;
use crate::support::proxy::RpcProxy;
use crate::support::transport::proxy_retry;

/// A service whose every call goes through `proxy`.
fn proxied(stack: &LocalStack, proxy: &RpcProxy) -> IdempotencyService<PostgrestRepository> {
    IdempotencyService::new(PostgrestRepository::new(proxy.client(stack.service_key(), proxy_retry())))
}

fn gate_through(stack: &LocalStack, proxy: &RpcProxy) -> WebhookGate<PostgrestRepository, PostgrestRepository> {
    WebhookGate::new(proxied(stack, proxy), ProviderJobs::new(PostgrestRepository::new(client(stack))))
}

fn delivery<'a>(org: Uuid, id: &'a str) -> Delivery<'a> {
    Delivery { organization_id: org, scope: "webhook.nylas", delivery_id: id, body: b"{\"type\":\"message.created\"}" }
}

/// Processing that counts its runs and succeeds after `takes`.
fn counted(
    runs: &Arc<AtomicUsize>,
    takes: Duration,
) -> impl Fn() -> futures_util::future::BoxFuture<'static, Result<Value, ProcessingError>> + Send + Sync + 'static {
    let runs = runs.clone();
    move || {
        runs.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(takes).await;
            Ok(json!({"stored": true}))
        })
    }
}

async fn status_of(stack: &LocalStack, key: &str) -> Option<String> {
    sqlx::query_scalar("select status from agent.idempotency_keys where key = $1")
        .bind(key)
        .fetch_optional(stack.db())
        .await
        .expect("the claim table")
}

/// Whether the claim of `key` is completed within [`WAIT`].
async fn completes(stack: &LocalStack, key: &str) -> bool {
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::time::Instant::now() < deadline {
        if status_of(stack, key).await.as_deref() == Some("completed") {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Sequence 1: the gate's deadline cuts a slow claim the database made and
/// answers 503; the vendor redelivers at once; the redelivery meets that
/// claim and is ACKed as a duplicate. The event must still be processed,
/// once: the gate asks again with the same token and carries the claim.
#[tokio::test]
async fn webhook_a_claim_cut_by_the_deadline_is_carried_so_the_event_its_acked_redelivery_named_is_processed_once() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    proxy.delay("idempotency_claim", Duration::from_millis(1500));
    let gate = gate_through(&stack, &proxy).with_deadline(Duration::from_millis(500));
    let redelivery_gate =
        WebhookGate::new(service(&stack), ProviderJobs::new(PostgrestRepository::new(client(&stack))));
    let (org, runs) = (org(), Arc::new(AtomicUsize::new(0)));

    let first = gate.handle(delivery(org, "evt-cut"), counted(&runs, Duration::ZERO)).await;
    assert_eq!(first.status(), 503, "the claim did not answer within the deadline: {first:?}");
    // The vendor redelivers at once: the claim the database made is there.
    let redelivered = redelivery_gate.handle(delivery(org, "evt-cut"), counted(&runs, Duration::ZERO)).await;
    assert_eq!(redelivered, Ack::Dropped(DropReason::Duplicate), "ACKed: the vendor will not send it again");

    assert!(completes(&stack, "evt-cut").await, "the event an ACKed redelivery named was never processed");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "processed exactly once");
    assert_eq!(proxy.requests("idempotency_release"), 0, "the claim was never given up");
    stack.stop().await.unwrap();
}

/// Sequence 1, second ending: processing fails retryably while a release
/// would be slow. A release the vendor's redelivery overtakes loses the
/// event; the gate never releases, it tries again itself.
#[tokio::test]
async fn webhook_a_retryable_failure_with_a_slow_plane_is_tried_again_in_process_never_released_and_never_lost() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    proxy.delay("idempotency_release", Duration::from_secs(2));
    let gate = gate_through(&stack, &proxy).with_deadline(Duration::from_millis(500));
    let org = org();
    let tries = Arc::new(AtomicUsize::new(0));
    let flaky = {
        let tries = tries.clone();
        move || {
            let first = tries.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if first {
                    Err::<Value, _>(ProcessingError::retryable("downstream 503"))
                } else {
                    Ok(json!({"stored": true}))
                }
            }
        }
    };
    let first = gate.handle(delivery(org, "evt-flaky"), flaky).await;
    assert_eq!(first.status(), 200, "the gate holds the claim and carries it: {first:?}");
    let redelivered = gate.handle(delivery(org, "evt-flaky"), || async { panic!("processed by its owner") }).await;
    assert_eq!(redelivered, Ack::Dropped(DropReason::Duplicate));
    assert!(completes(&stack, "evt-flaky").await, "the event was lost");
    assert_eq!(tries.load(Ordering::SeqCst), 2, "one failure, one success");
    assert_eq!(proxy.requests("idempotency_release"), 0, "never released");
    stack.stop().await.unwrap();
}

/// Sequence 8: 2.2 s of processing under the default 2.5 s deadline was
/// answered 503 on every redelivery and restarted each time. Now it is done
/// once and every delivery is answered 2xx.
#[tokio::test]
async fn webhook_slow_but_successful_processing_under_the_default_deadline_runs_once_and_is_never_a_5xx() {
    let stack = stack().await;
    let gate = WebhookGate::new(service(&stack), ProviderJobs::new(PostgrestRepository::new(client(&stack))));
    let (org, runs) = (org(), Arc::new(AtomicUsize::new(0)));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let ack = gate.handle(delivery(org, "evt-slow"), counted(&runs, Duration::from_millis(2200))).await;
        statuses.push(ack.status());
    }
    assert_eq!(statuses, vec![200, 200, 200], "no 5xx for a slow success");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work started once");
    assert_eq!(status_of(&stack, "evt-slow").await.as_deref(), Some("completed"));
    stack.stop().await.unwrap();
}

/// Sequence 2, the tool guard's shape: the lease was the tool's timeout
/// plus a margin while the journal could take longer, so a second worker
/// reclaimed a passed lease while the first still journaled, and ran the
/// tool again. Now the lease covers the journal's deadline.
#[tokio::test]
async fn tool_a_slow_journal_lands_inside_the_lease_and_a_second_worker_never_runs_the_tool_again() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    proxy.delay_request("idempotency_complete", Duration::from_secs(3));
    let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));
    let slow_journal = ToolGuard::new(proxied(&stack, &proxy), horizon)
        .with_lease_margin(Duration::from_secs(1))
        .unwrap()
        .with_journal_deadline(Duration::from_secs(5))
        .unwrap();
    let other_worker = ToolGuard::new(service(&stack), horizon)
        .with_lease_margin(Duration::from_secs(1))
        .unwrap()
        .with_journal_deadline(Duration::from_secs(5))
        .unwrap();
    let spec = ToolSpec::new("tool.payments.charge", Duration::from_secs(1), RepeatSafety::VendorKey).unwrap();
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "charge"), json!({"amount": 100}));
    let charges = Arc::new(AtomicUsize::new(0));
    let charge = |charges: Arc<AtomicUsize>| {
        move |_| async move {
            let n = charges.fetch_add(1, Ordering::SeqCst);
            ToolResult::success(json!({"charge": n})).with_resource("payments.charge", format!("ch-{n}"))
        }
    };
    let allow = || async { Checkpoint::Allow };

    let first = {
        let (guard, spec, key, args, charge) =
            (slow_journal.clone(), spec.clone(), key.clone(), args.clone(), charge(charges.clone()));
        tokio::spawn(async move { guard.run(org, &spec, &key, &args, allow, charge).await })
    };
    // 2.5 s in: the old lease (1 s + 1 s) has passed, the journal has not landed.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let meanwhile = other_worker.run(org, &spec, &key, &args, allow, charge(charges.clone())).await;
    assert!(matches!(meanwhile, Err(ToolError::ClaimInFlight { .. })), "the lease still holds: {meanwhile:?}");
    let first = first.await.expect("the first worker").expect("its call");
    let ToolRun::Executed(answered) = first else { panic!("the first worker ran the tool: {first:?}") };
    let after = other_worker.run(org, &spec, &key, &args, allow, charge(charges.clone())).await.unwrap();
    assert_eq!(after, ToolRun::Replayed(answered), "one key, one answer");
    assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");
    stack.stop().await.unwrap();
}

/// A claim the database made whose answers were all lost, beyond the
/// client's own retries: the tool guard asks again as the same attempt, so
/// the step runs its tool now instead of meeting its own claim, in flight
/// until its lease passes.
#[tokio::test]
async fn tool_a_claim_whose_answers_are_lost_beyond_the_clients_retries_is_asked_again_and_runs_once() {
    let stack = stack().await;
    let proxy = RpcProxy::start(stack.url()).await;
    proxy.drop_next("idempotency_claim", 4);
    let guard = ToolGuard::new(proxied(&stack, &proxy), RetryHorizon::until_last_attempt(Duration::from_secs(600)));
    let spec = ToolSpec::new("tool.email.send", Duration::from_secs(10), RepeatSafety::VendorKey).unwrap();
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "a@b.c"}));
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let ran = guard
        .run(
            org,
            &spec,
            &key,
            &args,
            || async { Checkpoint::Allow },
            move |_| async move {
                counter.fetch_add(1, Ordering::SeqCst);
                ToolResult::success(json!({"sent": true}))
            },
        )
        .await;
    assert!(matches!(ran, Ok(ToolRun::Executed(_))), "{ran:?}");
    assert!(proxy.requests("idempotency_claim") >= 5, "the client's 4 requests, then the guard's");
    assert_eq!(sent.load(Ordering::SeqCst), 1);
    assert_eq!(status_of(&stack, key.as_str()).await.as_deref(), Some("completed"));
    stack.stop().await.unwrap();
}
