//! A keyless vendor's call reconciled: a worker that stalled after the
//! vendor succeeded is reconciled and the vendor sends once, nothing found
//! executes exactly once, and a reconcile that cannot tell keeps the claim.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::tool::{RepeatSafety, ToolError, ToolKey, ToolResult, ToolRun, ToolSpec};
use idempotency_plane::repo::ClaimStatus;
use serde_json::json;
use uuid::Uuid;

use crate::callers::{row, service};
use crate::support::backends::Plane;
use crate::support::{claimed, org, LEASE};

use super::{allow, guard};

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

crate::support::on_every_plane!(
    reconcile_a_worker_that_stalls_after_the_vendor_succeeded_is_reconciled_and_the_vendor_sends_once,
    reconcile_that_finds_nothing_executes_exactly_once,
    reconcile_that_cannot_tell_keeps_the_claim_so_the_next_attempt_asks_again,
);
