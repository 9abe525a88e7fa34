//! The tool guard runs a call once and replays it: a retryable failure
//! released, a call in flight raised, a crashed worker's claim reclaimed, a
//! vendor's own idempotency carried through a retry, a conflicting call
//! refused, a tool past its timeout cut off; the checkpoint held before any
//! claim, never for a replay, its time counted against the retry horizon;
//! and the lease sized.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::repo::ClaimStatus;
use serde_json::{json, Value};
use uuid::Uuid;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Request, Respond, ResponseTemplate};

use crate::callers::{row, service};
use crate::support::backends::Plane;
use crate::support::{claimed, org, LEASE};

use super::{allow, guard, spec};

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

async fn with_heartbeats_a_call_is_claimed_for_a_short_lease_that_its_beats_keep_past_its_end<P: Plane>(plane: &P) {
    assert!(guard(plane).with_heartbeats(Duration::from_secs(2)).is_err(), "below the 3 s floor");
    let guard = guard(plane).with_heartbeats(Duration::from_secs(3)).unwrap();
    assert_eq!(guard.lease_for(&spec()), Duration::from_secs(3), "a dead worker frees the key after 3 s");
    let service = service(plane);
    let (org, key, args) = (org(), ToolKey::for_step(Uuid::new_v4(), "render"), json!({"frames": 900}));
    let hash = idempotency_plane::RequestHash::of_json(&args);
    let (key_ref, service_ref, hash_ref) = (&key, &service, &hash);
    let run = guard
        .run(org, &spec(), &key, &args, allow, |_| async move {
            // Claimed for the 3 s heartbeat lease (a beat may have moved
            // it a little since), not the whole 45 s.
            let row = row(plane, org, "tool.email.send", key_ref.as_str()).await;
            let lease = (row.lease_expires_at - row.claimed_at).num_milliseconds();
            assert!((3_000..10_000).contains(&lease), "{lease} ms");
            // Past the first lease's end, a rival still finds the call in flight.
            tokio::time::sleep(Duration::from_millis(4_200)).await;
            let rival = service_ref.claim(org, "tool.email.send", key_ref.as_str(), hash_ref, LEASE).await.unwrap();
            assert!(matches!(rival, idempotency_plane::ClaimOutcome::Processing { .. }), "{rival:?}");
            ToolResult::success(json!({"rendered": true}))
        })
        .await
        .unwrap();
    assert!(matches!(run, ToolRun::Executed(ref r) if r.ok), "{run:?}");
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

crate::support::on_every_plane!(
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
    a_replay_and_a_claim_in_flight_never_call_the_checkpoint,
    time_spent_in_the_checkpoint_counts_against_the_retry_horizon,
    with_heartbeats_a_call_is_claimed_for_a_short_lease_that_its_beats_keep_past_its_end,
);
