//! The tool guard's decisions, each case written once over any [`Plane`]
//! and run on the in-memory repository and, with feature `local`, on the
//! stack: run once and replay, release a retryable failure, raise for a call
//! in flight, reclaim after a crash and reconcile a keyless vendor, hold at
//! the checkpoint before any claim, size the lease, and journal outputs the
//! store cannot hold as they are.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::repo::ClaimStatus;
use idempotency_plane::service::Elided;
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use super::super::{row, service};
use crate::support::backends::Plane;
use crate::support::{claimed, org, LEASE};

/// An orchestrator whose last attempt comes ten minutes after the first.
const HORIZON: RetryHorizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));

/// A guard over the plane, with a ten-minute retry horizon.
pub(crate) fn guard<P: Plane>(plane: &P) -> ToolGuard<P::Repo> {
    ToolGuard::new(service(plane), HORIZON)
}

/// `tool.email.send`: 30 s per call, the vendor dedupes on the key.
pub(crate) fn spec() -> ToolSpec {
    ToolSpec::new("tool.email.send", Duration::from_secs(30), RepeatSafety::VendorKey).expect("spec")
}

/// A checkpoint that lets every call through.
pub(crate) async fn allow() -> Checkpoint {
    Checkpoint::Allow
}

async fn a_retryable_tool_failure_releases_the_claim_and_the_next_attempt_executes<P: Plane>(plane: &P) {
    let guard = guard(plane);
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
    assert_eq!(plane.claims().await, 0, "released, not stored");

    let second = guard
        .run(org, &spec(), &key, &args, allow, |_| async {
            calls.fetch_add(1, Ordering::SeqCst);
            ToolResult::success(json!({"message_id": "m-1"})).with_resource("email.message", "m-1")
        })
        .await
        .unwrap();
    assert!(matches!(&second, ToolRun::Executed(r) if r.ok), "{second:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 2, "the next attempt executed");
}

async fn a_business_failure_completes_the_claim_and_the_next_attempt_returns_the_stored_answer<P: Plane>(plane: &P) {
    let guard = guard(plane);
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
}

async fn a_live_lease_on_the_callers_own_key_raises_and_no_result_reports_it<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let service = service(plane);
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
}

async fn the_journal_is_read_before_the_checkpoint_and_claimed_after_it<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "needs-approval"), json!({"amount": 10}));

    // Held at the checkpoint: no key is taken, so the resumed step can claim.
    let held = guard
        .run(org, &spec(), &key, &args, || async { Checkpoint::Hold }, |_| async { panic!("a held call must not run") })
        .await
        .unwrap();
    assert_eq!(held, ToolRun::Held);
    assert_eq!(plane.claims().await, 0);

    // Approved later: the checkpoint runs before any row exists, the tool after the claim.
    let resumed = guard
        .run(
            org,
            &spec(),
            &key,
            &args,
            || async move {
                assert_eq!(plane.claims().await, 0, "nothing claimed before the checkpoint");
                Checkpoint::Allow
            },
            |_| async move {
                assert_eq!(plane.claims().await, 1, "claimed before the tool runs");
                ToolResult::success(json!({"charged": 10}))
            },
        )
        .await
        .unwrap();
    assert!(matches!(resumed, ToolRun::Executed(_)));
}

async fn a_crashed_workers_tool_claim_is_reclaimed_and_the_run_continues<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let service = service(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "y"}));
    let hash = idempotency_plane::RequestHash::of_json(&args);
    let crashed = claimed(service.claim(org, "tool.email.send", key.as_str(), &hash, LEASE).await);
    plane.pass_lease(crashed.id()).await;

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
}

async fn the_lease_is_the_tools_timeout_plus_the_journal_deadline_plus_the_margin<P: Plane>(plane: &P) {
    let guard = guard(plane).with_lease_margin(Duration::from_secs(7)).unwrap();
    let spec = ToolSpec::new("tool.crm.company.create", Duration::from_secs(120), RepeatSafety::VendorKey).unwrap();
    let (org, key) = (org(), ToolKey::for_step(Uuid::new_v4(), "create"));
    let key_ref = &key;
    guard
        .run(org, &spec, &key, &json!({}), allow, |_| async move {
            let row = row(plane, org, "tool.crm.company.create", key_ref.as_str()).await;
            let lease = row.lease_expires_at - row.claimed_at;
            assert_eq!(lease.num_milliseconds(), 137_000, "120 s + 10 s journal deadline + 7 s");
            ToolResult::success(json!({"id": "c-1"})).with_resource("crm.company", "c-1")
        })
        .await
        .unwrap();
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

async fn vendor_idempotency_prevents_a_duplicate_send_after_a_crash_and_retry<P: Plane>(plane: &P) {
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
    let (guard1, key1, args1, vendor_uri) = (guard(plane), key.clone(), args.clone(), vendor.uri());
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
    assert!(matches!(died, Ok(Err(ToolError::Panicked { .. }))), "{died:?}");
    let left = row(plane, org, "tool.email.send", key.as_str()).await;
    assert_eq!(left.status, ClaimStatus::Processing, "the dead worker left its claim");

    // Its lease passes; the orchestrator's retry reclaims and reaches the vendor with the same key.
    plane.pass_lease(left.id).await;
    let retry = guard(plane)
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
}

async fn a_tool_claim_survives_a_run_that_waited_on_an_approval_for_longer_than_a_day<P: Plane>(plane: &P) {
    let guard = guard(plane);
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
    plane.age(Duration::from_secs(29 * 86_400)).await;
    let expired = plane.expired(100).await;
    assert!(expired.is_empty(), "a sweep would not touch it: {expired:?}");

    let replay =
        guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("the effect must not repeat") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("{replay:?}") };
    assert_eq!(stored.output, answer.output);
    assert_eq!(stored.resource, answer.resource);
}

async fn the_same_key_with_different_arguments_is_a_conflict_and_nothing_runs<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "send"), json!({"to": "a"}));
    let sends = AtomicUsize::new(0);
    let tool = |_| async {
        sends.fetch_add(1, Ordering::SeqCst);
        ToolResult::success(json!(1))
    };
    assert!(matches!(guard.run(org, &spec(), &key, &args, allow, tool).await, Ok(ToolRun::Executed(_))));
    assert!(matches!(guard.run(org, &spec(), &key, &args, allow, tool).await, Ok(ToolRun::Replayed(_))));
    let changed = guard.run(org, &spec(), &key, &json!({"to": "b"}), allow, |_| async { panic!("must not run") }).await;
    assert!(matches!(changed, Err(ToolError::Conflict { .. })), "{changed:?}");
    assert!(!changed.unwrap_err().is_retryable());
    assert_eq!(sends.load(Ordering::SeqCst), 1);
}

async fn a_tool_that_overruns_its_timeout_is_cut_off_and_its_claim_waits_for_the_lease<P: Plane>(plane: &P) {
    // A 61 s lease: the retry below meets it live however slow this machine is.
    let guard = guard(plane).with_lease_margin(Duration::from_secs(60)).unwrap();
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
    assert_eq!(row(plane, org, "tool.email.send", key.as_str()).await.status, ClaimStatus::Processing);
    let retry = guard.run(org, &spec, &key, &args, allow, |_| async { panic!("lease is live") }).await;
    assert!(matches!(retry, Err(ToolError::ClaimInFlight { .. })), "{retry:?}");
}

async fn a_resource_the_store_would_refuse_still_journals_the_answer<P: Plane>(plane: &P) {
    let guard = guard(plane);
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
}

async fn a_tool_output_above_the_store_limit_with_no_resource_is_journaled_as_a_summary<P: Plane>(plane: &P) {
    let guard = ToolGuard::new(service(plane).with_response_limit(1024), HORIZON);
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
}

async fn a_tool_output_holding_nul_is_journaled_whole_and_the_next_attempt_replays_it_without_a_second_vendor_call<
    P: Plane,
>(
    plane: &P,
) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "fetch"), json!({"url": "https://x"}));
    let vendor_calls = AtomicUsize::new(0);
    let tool = |_| async {
        vendor_calls.fetch_add(1, Ordering::SeqCst);
        // A vendor's body with a NUL byte in it: PostgreSQL jsonb cannot hold it.
        ToolResult::success(json!({"body": "PK\u{0}\u{3}\u{4}", "status": 200}))
    };

    let first = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    assert!(matches!(first, ToolRun::Executed(ref r) if r.ok), "{first:?}");
    let status = row(plane, org, "tool.email.send", key.as_str()).await.status;
    assert_eq!(status, ClaimStatus::Completed, "the effect is journaled, not left processing");

    let again = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
    let ToolRun::Replayed(replayed) = again else { panic!("expected a replay, got {again:?}") };
    assert!(replayed.ok);
    assert_eq!(
        replayed.output,
        json!({"body": "PK\u{0}\u{3}\u{4}", "status": 200}),
        "replayed as it was, NUL included"
    );
    assert_eq!(vendor_calls.load(Ordering::SeqCst), 1, "no second vendor call");
}

async fn a_large_business_failure_with_a_resource_replays_as_the_same_business_failure<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "import"), json!({"file": "f-1"}));
    let output = json!({"errors": "e".repeat(100 * 1024)});
    let made = ToolResult::business_failure("invalid_input", output).with_resource("crm.import", "imp-1");

    let first = guard.run(org, &spec(), &key, &args, allow, |_| async { made.clone() }).await.unwrap();
    assert_eq!(first, ToolRun::Executed(made.clone()));

    let again = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must replay") }).await.unwrap();
    let ToolRun::Replayed(replayed) = again else { panic!("expected a replay, got {again:?}") };
    assert!(!replayed.ok, "a business failure replays as a failure, not a success");
    assert!(!replayed.retryable);
    assert_eq!(replayed.error.as_deref(), Some("invalid_input"));
    assert_eq!(replayed.resource, made.resource);
    let reference: idempotency_plane::ResponseRef =
        serde_json::from_value(replayed.output["$response_ref"].clone()).expect("a reference");
    assert_eq!((reference.resource_type.as_str(), reference.resource_id.as_str()), ("crm.import", "imp-1"));
    assert!(reference.size > 100 * 1024);
}

async fn a_replay_and_a_claim_in_flight_never_call_the_checkpoint<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let service = service(plane);
    let checkpoints = AtomicUsize::new(0);
    let checkpoint = || async {
        checkpoints.fetch_add(1, Ordering::SeqCst);
        Checkpoint::Allow
    };
    let org = org();

    // A completed call: its replay is read before the checkpoint.
    let (done, args) = (ToolKey::for_step(Uuid::new_v4(), "done"), json!({"n": 1}));
    guard.run(org, &spec(), &done, &args, checkpoint, |_| async { ToolResult::success(json!(1)) }).await.unwrap();
    assert_eq!(checkpoints.load(Ordering::SeqCst), 1, "the first attempt passed the checkpoint");
    let replay = guard.run(org, &spec(), &done, &args, checkpoint, |_| async { panic!("must replay") }).await;
    assert!(matches!(replay, Ok(ToolRun::Replayed(_))), "{replay:?}");

    // A call another worker holds: in flight, read before the checkpoint.
    let (held, args) = (ToolKey::for_step(Uuid::new_v4(), "held"), json!({"n": 2}));
    let hash = idempotency_plane::RequestHash::of_json(&args);
    let _holder = claimed(service.claim(org, "tool.email.send", held.as_str(), &hash, LEASE).await);
    let in_flight = guard.run(org, &spec(), &held, &args, checkpoint, |_| async { panic!("in flight") }).await;
    assert!(matches!(in_flight, Err(ToolError::ClaimInFlight { .. })), "{in_flight:?}");

    assert_eq!(
        checkpoints.load(Ordering::SeqCst),
        1,
        "neither the replay nor the claim in flight reached the checkpoint"
    );
}

/// A vendor that takes no idempotency key: every send makes a message. It
/// can be searched by the reference a tool attaches to a send.
#[derive(Default, Clone)]
struct KeylessVendor {
    sent: Arc<Mutex<Vec<(String, String)>>>,
}

impl KeylessVendor {
    fn send(&self, reference: &str) -> String {
        let mut sent = self.sent.lock().unwrap();
        let id = format!("msg-{}", sent.len() + 1);
        sent.push((reference.to_owned(), id.clone()));
        id
    }

    fn find(&self, reference: &str) -> Option<String> {
        self.sent.lock().unwrap().iter().find(|(r, _)| r == reference).map(|(_, id)| id.clone())
    }

    fn effects(&self) -> usize {
        self.sent.lock().unwrap().len()
    }

    /// A tool spec whose repeats are made safe by searching this vendor.
    fn spec(&self) -> ToolSpec {
        let vendor = self.clone();
        let reconcile = RepeatSafety::reconcile(move |call, _arguments| {
            let vendor = vendor.clone();
            async move {
                Ok(vendor
                    .find(call.idempotency_key())
                    .map(|id| ToolResult::success(json!({"message_id": id})).with_resource("keyless.message", id)))
            }
        });
        ToolSpec::new("tool.keyless.send", Duration::from_secs(1), reconcile).unwrap()
    }
}

async fn reconcile_a_worker_that_stalls_after_the_vendor_succeeded_is_reconciled_and_the_vendor_sends_once<P: Plane>(
    plane: &P,
) {
    let guard = guard(plane).with_lease_margin(Duration::from_secs(1)).unwrap();
    let vendor = KeylessVendor::default();
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "notify"), json!({"to": "ops"}));

    // Worker A reaches the vendor, then stalls past its timeout: cut off,
    // its claim left processing, its answer never journaled.
    let stalled = guard
        .run(org, &vendor.spec(), &key, &args, allow, |call| {
            let vendor = vendor.clone();
            async move {
                let id = vendor.send(call.idempotency_key());
                tokio::time::sleep(Duration::from_secs(30)).await;
                ToolResult::success(json!({"message_id": id}))
            }
        })
        .await;
    assert!(matches!(stalled, Err(ToolError::TimedOut { .. })), "{stalled:?}");
    assert_eq!(vendor.effects(), 1);
    plane.pass_lease(row(plane, org, "tool.keyless.send", key.as_str()).await.id).await;

    // Worker B reclaims; the reconciler finds A's message.
    let retried = guard
        .run(org, &vendor.spec(), &key, &args, allow, |_| async { panic!("the vendor must not be called again") })
        .await
        .unwrap();
    let ToolRun::Reconciled(found) = retried else { panic!("expected a reconciled answer, got {retried:?}") };
    assert_eq!(found.output, json!({"message_id": "msg-1"}));
    assert_eq!(vendor.effects(), 1, "exactly one vendor effect");

    // The journaled answer is the vendor's, and it replays.
    let replay = guard.run(org, &vendor.spec(), &key, &args, allow, |_| async { panic!("must replay") }).await.unwrap();
    let ToolRun::Replayed(stored) = replay else { panic!("expected a replay, got {replay:?}") };
    assert_eq!(stored.output, json!({"message_id": "msg-1"}));
    let journaled = row(plane, org, "tool.keyless.send", key.as_str()).await;
    let resource = (journaled.resource_type.as_deref(), journaled.resource_id.as_deref());
    assert_eq!(resource, (Some("keyless.message"), Some("msg-1")));
}

async fn reconcile_that_finds_nothing_executes_exactly_once<P: Plane>(plane: &P) {
    let guard = guard(plane).with_lease_margin(Duration::from_secs(1)).unwrap();
    let vendor = KeylessVendor::default();
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "notify"), json!({"to": "ops"}));

    // Worker A stalls before it reaches the vendor.
    let stalled = guard
        .run(org, &vendor.spec(), &key, &args, allow, |_| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            ToolResult::success(json!(null))
        })
        .await;
    assert!(matches!(stalled, Err(ToolError::TimedOut { .. })), "{stalled:?}");
    plane.pass_lease(row(plane, org, "tool.keyless.send", key.as_str()).await.id).await;

    let send = |call: idempotency_plane::callers::tool::ToolCall| {
        let vendor = vendor.clone();
        async move {
            assert!(call.reclaimed());
            let id = vendor.send(call.idempotency_key());
            ToolResult::success(json!({"message_id": id}))
        }
    };
    let retried = guard.run(org, &vendor.spec(), &key, &args, allow, send).await.unwrap();
    assert!(matches!(retried, ToolRun::Executed(ref r) if r.output == json!({"message_id": "msg-1"})), "{retried:?}");
    let replay = guard.run(org, &vendor.spec(), &key, &args, allow, send).await.unwrap();
    assert!(matches!(replay, ToolRun::Replayed(_)), "{replay:?}");
    assert_eq!(vendor.effects(), 1, "exactly one execution");
}

async fn reconcile_that_cannot_tell_keeps_the_claim_so_the_next_attempt_asks_again<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let service = service(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "notify"), json!({"to": "ops"}));
    let hash = idempotency_plane::RequestHash::of_json(&args);
    let crashed = claimed(service.claim(org, "tool.keyless.send", key.as_str(), &hash, LEASE).await);
    plane.pass_lease(crashed.id()).await;
    let unsure = ToolSpec::new(
        "tool.keyless.send",
        Duration::from_secs(1),
        RepeatSafety::reconcile(|_, _| async { Err("the vendor's search is down".to_owned()) }),
    )
    .unwrap();

    let outcome = guard.run(org, &unsure, &key, &args, allow, |_| async { panic!("must not run unreconciled") }).await;
    match outcome {
        Err(error @ ToolError::ReconcileFailed { .. }) => assert!(error.is_retryable()),
        other => panic!("expected ReconcileFailed, got {other:?}"),
    }
    let status = row(plane, org, "tool.keyless.send", key.as_str()).await.status;
    assert_eq!(status, ClaimStatus::Processing, "kept, not released: a fresh claim would skip the reconciler");
}

async fn a_business_failure_with_an_error_of_64_kib_or_more_replays_as_that_failure_with_or_without_a_resource<
    P: Plane,
>(
    plane: &P,
) {
    let guard = guard(plane);
    let org = org();
    let long_error = format!("invalid_input: {}", "the field is wrong. ".repeat(4_000));
    assert!(long_error.len() >= 64 * 1024);
    for (step, resource) in [("with-resource", Some(("crm.note", "n-1"))), ("without-resource", None)] {
        let (key, args) = (ToolKey::for_step(Uuid::new_v4(), step), json!({"step": step}));
        let runs = AtomicUsize::new(0);
        let tool = |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            let failure = ToolResult::business_failure(long_error.clone(), json!({"field": "name"}));
            match resource {
                Some((kind, id)) => failure.with_resource(kind, id),
                None => failure,
            }
        };
        let first = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
        assert!(matches!(&first, ToolRun::Executed(r) if !r.ok), "{step}: {first:?}");
        let again = guard.run(org, &spec(), &key, &args, allow, tool).await.unwrap();
        let ToolRun::Replayed(replayed) = again else { panic!("{step}: a replay, got {again:?}") };
        assert!(!replayed.ok, "{step}: a business failure replays as a failure, never as ok: true");
        let kept = replayed.error.expect("the error is kept");
        assert!(long_error.starts_with(&kept) && !kept.is_empty(), "{step}: the error's start is kept");
        assert_eq!(replayed.output, json!({"field": "name"}), "{step}: the small output is kept whole");
        assert_eq!(replayed.resource.is_some(), resource.is_some(), "{step}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{step}: the tool ran once");
    }
}

async fn a_business_failure_whose_error_holds_nul_is_journaled_and_replays_equal<P: Plane>(plane: &P) {
    let guard = guard(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "nul-error"), json!({}));
    let failure = ToolResult::business_failure("bad byte \u{0} in name", json!(null));
    let first = guard.run(org, &spec(), &key, &args, allow, |_| async { failure.clone() }).await.unwrap();
    assert!(matches!(first, ToolRun::Executed(_)));
    let status = row(plane, org, "tool.email.send", key.as_str()).await.status;
    assert_eq!(status, ClaimStatus::Completed, "journaled, not left processing for a second run after the lease");
    let again = guard.run(org, &spec(), &key, &args, allow, |_| async { panic!("must not run twice") }).await.unwrap();
    assert_eq!(again, ToolRun::Replayed(failure));
}

async fn time_spent_in_the_checkpoint_counts_against_the_retry_horizon<P: Plane>(plane: &P) {
    // Lease 1 s + 1 s journal + 1 s margin = 3 s; the last attempt comes 4 s after the first.
    let guard = ToolGuard::new(service(plane), RetryHorizon::until_last_attempt(Duration::from_secs(4)))
        .with_lease_margin(Duration::from_secs(1))
        .unwrap()
        .with_journal_deadline(Duration::from_secs(1))
        .unwrap();
    let spec = ToolSpec::new("tool.email.send", Duration::from_secs(1), RepeatSafety::VendorKey).unwrap();
    assert!(guard.check(&spec).is_ok(), "3 s of lease passes before the last attempt at 4 s");
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "slow-checkpoint"), json!({}));
    let slow_checkpoint = || async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Checkpoint::Allow
    };
    let ran = guard.run(org, &spec, &key, &args, slow_checkpoint, |_| async { panic!("must not run") }).await;
    assert!(
        matches!(ran, Err(ToolError::LeaseOutlastsRetries { spent, .. }) if spent >= Duration::from_millis(1500)),
        "a claim made 1.5 s in would hold its 3 s lease past the last attempt: {ran:?}"
    );
    assert_eq!(plane.claims().await, 0, "refused before any claim");
}

on_every_plane!(
    a_retryable_tool_failure_releases_the_claim_and_the_next_attempt_executes,
    a_business_failure_completes_the_claim_and_the_next_attempt_returns_the_stored_answer,
    a_live_lease_on_the_callers_own_key_raises_and_no_result_reports_it,
    the_journal_is_read_before_the_checkpoint_and_claimed_after_it,
    a_crashed_workers_tool_claim_is_reclaimed_and_the_run_continues,
    the_lease_is_the_tools_timeout_plus_the_journal_deadline_plus_the_margin,
    vendor_idempotency_prevents_a_duplicate_send_after_a_crash_and_retry,
    a_tool_claim_survives_a_run_that_waited_on_an_approval_for_longer_than_a_day,
    the_same_key_with_different_arguments_is_a_conflict_and_nothing_runs,
    a_tool_that_overruns_its_timeout_is_cut_off_and_its_claim_waits_for_the_lease,
    a_resource_the_store_would_refuse_still_journals_the_answer,
    a_tool_output_above_the_store_limit_with_no_resource_is_journaled_as_a_summary,
    a_tool_output_holding_nul_is_journaled_whole_and_the_next_attempt_replays_it_without_a_second_vendor_call,
    a_large_business_failure_with_a_resource_replays_as_the_same_business_failure,
    a_replay_and_a_claim_in_flight_never_call_the_checkpoint,
    reconcile_a_worker_that_stalls_after_the_vendor_succeeded_is_reconciled_and_the_vendor_sends_once,
    reconcile_that_finds_nothing_executes_exactly_once,
    reconcile_that_cannot_tell_keeps_the_claim_so_the_next_attempt_asks_again,
    a_business_failure_with_an_error_of_64_kib_or_more_replays_as_that_failure_with_or_without_a_resource,
    a_business_failure_whose_error_holds_nul_is_journaled_and_replays_equal,
    time_spent_in_the_checkpoint_counts_against_the_retry_horizon,
);
