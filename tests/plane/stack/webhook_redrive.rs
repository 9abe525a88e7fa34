//! The webhook gate's work outlives its worker: every delivery it claims
//! carries its body, so after the worker that ACKed it stops, another
//! worker's re-drive processes the event, once, with the very bytes sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::webhook::{Ack, Delivery, DropReason, ProviderJobs, RetryReason, WebhookGate};
use idempotency_plane::service::IdempotencyService;
use idempotency_plane::{IdempotencyRepository, PostgrestRepository};
use serde_json::json;

use crate::support::harness::*;
use crate::support::within;

type Gate = WebhookGate<PostgrestRepository, PostgrestRepository>;

/// A gate with heartbeats on a 3 s lease, answering within 1 s.
fn gate(stack: &idempotency_plane::local::LocalStack) -> Gate {
    let repo = || PostgrestRepository::new(client(stack));
    WebhookGate::new(IdempotencyService::new(repo()), ProviderJobs::new(repo()))
        .with_deadline(Duration::from_secs(1))
        .with_heartbeats(Duration::from_secs(3))
        .expect("a 3 s heartbeat lease")
}

// Multi-threaded: the stack's server runs on this test's runtime, and must
// serve while the first worker's own runtime runs on a thread of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_acked_by_a_worker_that_stopped_mid_processing_is_re_driven_once_with_its_bytes() {
    let stack = stack().await;
    let org = org();
    // Not UTF-8: stored losslessly, handed back byte for byte.
    let body: Vec<u8> = [b"{\"id\":\"evt_1\",\"sig\":\"".as_slice(), &[0xff, 0x00, 0xfe], b"\"}"].concat();

    // The first worker: ACKs (processing outlasts the answer's deadline),
    // then stops mid-processing, as a serverless worker at its wall clock
    // limit: its runtime is dropped with every task in it.
    let started = Arc::new(AtomicUsize::new(0));
    let ack = {
        let (gate, body, started) = (gate(&stack), body.clone(), started.clone());
        tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let delivery =
                Delivery { organization_id: org, scope: "webhook.stripe", delivery_id: "evt_1", body: &body };
            let ack = runtime.block_on(gate.handle(delivery, move || {
                started.fetch_add(1, Ordering::SeqCst);
                std::future::pending()
            }));
            drop(runtime);
            ack
        })
        .await
        .expect("the first worker")
    };
    assert_eq!(ack, Ack::Accepted, "the vendor heard 200 and will not redeliver");
    assert_eq!(started.load(Ordering::SeqCst), 1);

    // Nothing is lost: the claim holds the event. Before its lease passes
    // a re-drive finds nothing; after it, another worker's re-drive runs it.
    let second = gate(&stack);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let process = |seen: Arc<Mutex<Vec<_>>>| {
        move |redelivery: idempotency_plane::callers::webhook::Redelivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(redelivery);
                Ok(json!({"processed": true}))
            }
        }
    };
    let early = second.redrive("webhook.*", 10, process(seen.clone())).await.unwrap();
    assert_eq!(early.redriven, 0, "the dead worker's lease still holds");
    // The lease passes 3 s after the claim or its last heartbeat.
    let report = within(Duration::from_secs(20), "the orphan is re-driven", async {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let report = second.redrive("webhook.*", 10, process(seen.clone())).await.unwrap();
            if report.redriven > 0 {
                return report;
            }
        }
    })
    .await;
    assert_eq!((report.redriven, report.journaled, report.dead_lettered, report.left), (1, 1, 0, 0));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!((seen[0].delivery_id.as_str(), seen[0].attempt, seen[0].organization_id), ("evt_1", 2, org));
    assert_eq!(seen[0].body, body, "the very bytes the vendor sent");

    // A later redelivery meets the journal.
    let again = Delivery { organization_id: org, scope: "webhook.stripe", delivery_id: "evt_1", body: &body };
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let ack = second
        .handle(again, move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok(json!(0)) }
        })
        .await;
    assert_eq!((ack, runs.load(Ordering::SeqCst)), (Ack::Dropped(DropReason::Duplicate), 0));
    let redriven = second.redrive("webhook.*", 10, process(Arc::default())).await.unwrap();
    assert_eq!(redriven.redriven, 0, "a journaled event is never re-driven");
    stack.stop().await.unwrap();
}

/// A gate told to take more than its scope stores (1 MiB against the
/// 384 KiB webhook.* keeps): the store refuses the work, and the delivery
/// is answered 413, never claimed. (`idem doctor` names such a deployment.)
#[tokio::test]
async fn a_delivery_too_large_to_store_with_its_claim_is_never_acked_and_never_claimed() {
    let stack = stack().await;
    let org = org();
    let body = vec![b'x'; 400_000];
    let delivery = Delivery { organization_id: org, scope: "webhook.stripe", delivery_id: "evt_big", body: &body };
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let ack = gate(&stack)
        .with_body_limit(1024 * 1024)
        .without_deadline()
        .handle(delivery, move || {
            counter.fetch_add(1, Ordering::SeqCst);
            async { Ok(json!(0)) }
        })
        .await;
    assert_eq!(ack, Ack::Retry(RetryReason::DeliveryTooLarge));
    assert_eq!(ack.status(), 413, "the vendor records a failure and keeps the event");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let repo = PostgrestRepository::new(client(&stack));
    assert_eq!(repo.get(org, "webhook.stripe", "evt_big").await.unwrap(), None, "nothing claimed");
    stack.stop().await.unwrap();
}
