//! The tool guard on the real stack.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::service::Elided;
use idempotency_plane::PostgrestRepository;
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use crate::harness::*;

/// An orchestrator whose last attempt comes ten minutes after the first.
const HORIZON: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));

fn guard(stack: &idempotency_plane::local::LocalStack) -> ToolGuard<PostgrestRepository> {
    ToolGuard::new(service(stack), HORIZON)
}

fn spec() -> ToolSpec {
    ToolSpec::new("tool.email.send", Duration::from_secs(30), RepeatSafety::VendorKey).expect("spec")
}

async fn allow() -> Checkpoint {
    Checkpoint::Allow
}

#[tokio::test]
async fn a_retryable_tool_failure_releases_the_claim_and_the_next_attempt_executes() {
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send-1"), json!({"to": "a@b.c"}));
    let calls = AtomicUsize::new(0);

    let first = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            calls.fetch_add(1, Ordering::SeqCst);
            ToolResult::retryable_failure("rate_limited", json!({"status": 429}))
        })
        .await
        .unwrap();
    assert!(matches!(&first, ToolRun::Executed(r) if r.retryable && !r.ok), "{first:?}");
    assert_eq!(count_rows(&stack).await, 0, "released, not stored");

    let second = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            calls.fetch_add(1, Ordering::SeqCst);
            ToolResult::success(json!({"message_id": "m-1"})).with_resource("email.message", "m-1")
        })
        .await
        .unwrap();
    assert!(matches!(&second, ToolRun::Executed(r) if r.ok), "{second:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the next attempt executed");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_business_failure_completes_the_claim_and_the_next_attempt_returns_the_stored_answer() {
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "lookup"), json!({"id": 7}));
    let calls = AtomicUsize::new(0);
    let tool = |_| async {
        calls.fetch_add(1, Ordering::SeqCst);
        ToolResult::business_failure("not_found", json!({"id": 7}))
    };

    let first = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    let ToolRun::Executed(answer) = first else { panic!("executed: {first:?}") };
    let again = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    assert_eq!(again, ToolRun::Replayed(answer));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the stored answer was returned, the tool not run");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_live_lease_on_the_callers_own_key_raises_and_no_result_reports_it() {
    let stack = stack().await;
    let guard = guard(&stack);
    let service = service(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "x"}));
    // A healthy worker holds the key (a second orchestrator attempt, a duplicate proposal).
    let hash = idempotency_plane::RequestHash::of_json(&args);
    let _holder = claimed(service.claim(org, "tool.email.send", key.as_str(), &hash, LEASE).await);

    let ran = AtomicUsize::new(0);
    let outcome = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            ran.fetch_add(1, Ordering::SeqCst);
            ToolResult::success(json!(null))
        })
        .await;
    match outcome {
        Err(ToolError::ClaimInFlight { key: k, .. }) => assert_eq!(k, key.as_str()),
        other => panic!("expected ClaimInFlight, got {other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_journal_is_read_before_the_checkpoint_and_claimed_after_it() {
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "needs-approval"), json!({"amount": 10}));

    // Held at the checkpoint: no key is taken, so the resumed step can claim.
    let held = guard
        .run(org, &spec(), &key, &args, || async { Checkpoint::Hold }, |_| async { panic!("a held call must not run") })
        .await
        .unwrap();
    assert_eq!(held, ToolRun::Held);
    assert_eq!(count_rows(&stack).await, 0);

    // Approved later: the checkpoint runs before any row exists, the tool after the claim.
    let stack_ref = &stack;
    let resumed = guard
        .run(
            org,
            &spec(),
            &key,
            &args,
            || async move {
                assert_eq!(count_rows(stack_ref).await, 0, "nothing claimed before the checkpoint");
                Checkpoint::Allow
            },
            |_| async move {
                assert_eq!(count_rows(stack_ref).await, 1, "claimed before the tool runs");
                ToolResult::success(json!({"charged": 10}))
            },
        )
        .await
        .unwrap();
    assert!(matches!(resumed, ToolRun::Executed(_)));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_crashed_workers_tool_claim_is_reclaimed_and_the_run_continues() {
    let stack = stack().await;
    let guard = guard(&stack);
    let service = service(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "y"}));
    let hash = idempotency_plane::RequestHash::of_json(&args);
    let crashed = claimed(service.claim(org, "tool.email.send", key.as_str(), &hash, LEASE).await);
    pass_lease(&stack, crashed.id()).await;

    let run = guard
        .run(org, &spec(), &key, &args, allow, |call| async move {
            assert!(call.reclaimed(), "this attempt took over a dead worker's claim");
            ToolResult::success(json!({"sent": true}))
        })
        .await
        .unwrap();
    assert!(matches!(run, ToolRun::Executed(ref r) if r.ok));
    let replay = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must replay") }).await.unwrap();
    assert!(matches!(replay, ToolRun::Replayed(ref r) if r.output == json!({"sent": true})));
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_lease_is_the_tools_timeout_plus_the_margin() {
    let stack = stack().await;
    let guard = guard(&stack).with_lease_margin(Duration::from_secs(7)).unwrap();
    let spec = ToolSpec::new("tool.crm.company.create", Duration::from_secs(120), RepeatSafety::VendorKey).unwrap();
    let (org, key) = (org(), ToolKey::for_step(Uuid::new_v4(), "create"));
    let stack_ref = &stack;
    guard
        .run(org, &spec, &key, &json!({}), allow, |_| async move {
            let lease_ms: f64 = sqlx::query_scalar(
                "select extract(epoch from lease_expires_at - claimed_at)::float8 * 1000 from agent.idempotency_keys",
            )
            .fetch_one(stack_ref.db())
            .await
            .unwrap();
            assert_eq!(lease_ms, 127_000.0);
            ToolResult::success(json!({"id": "c-1"})).with_resource("crm.company", "c-1")
        })
        .await
        .unwrap();
    stack.stop().await.unwrap();
}

/// A vendor that dedupes on `Idempotency-Key`: the same key answers the same
/// message, and only a new key makes a message.
#[derive(Default, Clone)]
struct DedupingVendor {
    messages: Arc<Mutex<HashMap<String, String>>>,
}

impl Respond for DedupingVendor {
    fn respond(&self, request: &Request) -> ResponseTemplate {
        let Some(key) = request.headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
            return ResponseTemplate::new(400);
        };
        let mut messages = self.messages.lock().expect("vendor state");
        let next = format!("msg_{}", messages.len() + 1);
        let id = messages.entry(key.to_owned()).or_insert(next).clone();
        ResponseTemplate::new(200).set_body_json(json!({"id": id}))
    }
}

async fn send_email(vendor: &str, idempotency_key: &str) -> ToolResult {
    let answer = reqwest::Client::new()
        .post(format!("{vendor}/messages"))
        .header("Idempotency-Key", idempotency_key)
        .json(&json!({"to": "a@b.c"}))
        .send()
        .await;
    match answer {
        Ok(response) if response.status().is_success() => match response.json::<Value>().await {
            Ok(body) => {
                let id = body["id"].as_str().unwrap_or_default().to_owned();
                ToolResult::success(body).with_resource("email.message", id)
            }
            Err(e) => ToolResult::retryable_failure("vendor_garbage", json!(e.to_string())),
        },
        Ok(response) => ToolResult::retryable_failure("vendor_status", json!(response.status().as_u16())),
        Err(e) => ToolResult::retryable_failure("vendor_unreachable", json!(e.to_string())),
    }
}

#[tokio::test]
async fn vendor_idempotency_prevents_a_duplicate_send_after_a_crash_and_retry() {
    let stack = stack().await;
    let vendor_state = DedupingVendor::default();
    let vendor = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/messages"))
        .respond_with(vendor_state.clone())
        .expect(2)
        .mount(&vendor)
        .await;
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "a@b.c"}));

    // Worker 1 sends; the vendor makes the message; the worker dies before completing.
    let (guard1, key1, args1, vendor_uri) = (guard(&stack), key.clone(), args.clone(), vendor.uri());
    let died = tokio::spawn(async move {
        guard1
            .run(org, &spec(), &key1, &args1, allow, |call| async move {
                let sent = send_email(&vendor_uri, call.idempotency_key()).await;
                assert!(sent.ok);
                panic!("worker 1 dies after the vendor's success, before complete()");
            })
            .await
    })
    .await;
    assert!(died.is_err_and(|e| e.is_panic()));
    let row: (String,) =
        sqlx::query_as("select status from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    assert_eq!(row.0, "processing", "the dead worker left its claim");

    // Its lease passes; the orchestrator's retry reclaims and reaches the vendor with the same key.
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    pass_lease(&stack, id).await;
    let retry = guard(&stack)
        .run(org, &spec(), &key, &args, allow, |call| async move {
            assert!(call.reclaimed());
            send_email(&vendor.uri(), call.idempotency_key()).await
        })
        .await
        .unwrap();
    let ToolRun::Executed(result) = retry else { panic!("{retry:?}") };
    assert_eq!(result.output, json!({"id": "msg_1"}), "the vendor answered the first message again");

    let messages = vendor_state.messages.lock().unwrap().len();
    assert_eq!(messages, 1, "exactly one message exists at the vendor");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_tool_claim_survives_a_run_that_waited_on_an_approval_for_longer_than_a_day() {
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send-before-approval"), json!({"n": 1}));
    let first = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            ToolResult::success(json!({"id": "m-9"})).with_resource("email.message", "m-9")
        })
        .await
        .unwrap();
    let ToolRun::Executed(answer) = first else { panic!("{first:?}") };

    // The Run waits on an approval for 29 days (max_run_duration is capped at
    // 30); then a restarted segment replays this step.
    let id: Uuid = sqlx::query_scalar("select id from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    travel_back(&stack, id, Duration::from_secs(29 * 86_400)).await;
    let expired: Vec<Value> = client(&stack)
        .rpc_bounded(
            "idempotency_expired",
            &json!({"p_limit": 100}),
            100,
            Some("id"),
            idempotency_plane::postgrest::Repeat::Safe,
        )
        .await
        .unwrap();
    assert!(expired.is_empty(), "a sweep would not touch it: {expired:?}");

    let replay =
        guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("the effect must not repeat") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("{replay:?}") };
    assert_eq!(stored.output, answer.output);
    assert_eq!(stored.resource, answer.resource);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn the_same_key_with_different_arguments_is_a_conflict_and_nothing_runs() {
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"));
    guard
        .run(org, &spec(), &key, &json!({"to": "a"}), allow, |_| async { ToolResult::success(json!(1)) })
        .await
        .unwrap();
    let changed = guard.run(org, &spec(), &key, &json!({"to": "b"}), allow, |_| async { panic!("must not run") }).await;
    assert!(matches!(changed, Err(ToolError::Conflict { .. })), "{changed:?}");
    assert!(!changed.unwrap_err().is_retryable());
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_tool_that_overruns_its_timeout_is_cut_off_and_its_claim_waits_for_the_lease() {
    let stack = stack().await;
    let guard = guard(&stack).with_lease_margin(Duration::from_secs(5)).unwrap();
    let spec = ToolSpec::new("tool.email.send", Duration::from_secs(1), RepeatSafety::VendorKey).unwrap();
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "slow"), json!({}));
    let overran = guard
        .run(org, &spec, &key, &args, allow, |_| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            ToolResult::success(json!("too late"))
        })
        .await;
    match overran {
        Err(error @ ToolError::TimedOut { .. }) => assert!(error.is_retryable()),
        other => panic!("expected TimedOut, got {other:?}"),
    }
    // The effect is unknown: neither completed nor released; a retry meets the live lease.
    let status: String =
        sqlx::query_scalar("select status from agent.idempotency_keys").fetch_one(stack.db()).await.unwrap();
    assert_eq!(status, "processing");
    let retry = guard.run(org, &spec, &key, &args, allow, |_| async { panic!("lease is live") }).await;
    assert!(matches!(retry, Err(ToolError::ClaimInFlight { .. })), "{retry:?}");
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_resource_the_store_would_refuse_still_journals_the_answer() {
    let stack = stack().await;
    let guard = guard(&stack);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({}));
    let first = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            // A vendor answered without an id: the effect happened all the same.
            ToolResult::success(json!({"status": "queued"})).with_resource("email.message", "")
        })
        .await
        .unwrap();
    assert!(matches!(first, ToolRun::Executed(_)));
    let replay =
        guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("the effect must not repeat") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("{replay:?}") };
    assert_eq!(stored.output, json!({"status": "queued"}));
    assert_eq!(stored.resource, None);
    stack.stop().await.unwrap();
}

#[tokio::test]
async fn a_tool_output_above_the_store_limit_with_no_resource_is_journaled_as_a_summary() {
    let stack = stack().await;
    let guard = ToolGuard::new(service(&stack).with_response_limit(1024), HORIZON);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "export"), json!({}));
    let big = json!({"rows": "x".repeat(4096)});
    let ran = guard.run(org, &spec(), &key, &args, allow, |_| async move { ToolResult::success(big) }).await.unwrap();
    assert!(matches!(ran, ToolRun::Executed(ref r) if r.ok));
    // The effect is journaled: a replay answers, it does not run the tool again.
    let replay = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must not run twice") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("{replay:?}") };
    assert!(stored.ok);
    let elided = Elided::from_stored(&stored.output).expect("the output is an elided summary");
    assert_eq!(elided.reason, "too_large");
    assert!(elided.size.is_some_and(|size| size > 4096), "{elided:?}");
    stack.stop().await.unwrap();
}
