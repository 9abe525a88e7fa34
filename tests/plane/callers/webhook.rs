//! The webhook gate's and provider callbacks' decisions, each case written
//! once over any [`Plane`] and run on the in-memory repository and, with
//! feature `local`, on the stack: duplicates and hash mismatches acked with
//! their reasons, failures tried again in process or journaled (never
//! released), callbacks resolved to their tenant before any claim, and the
//! lease and timeouts a gate takes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency_plane::callers::webhook::{
    Ack, Delivery, DropReason, ProcessingError, ProviderCallback, ProviderJobs, Redelivery, RedriveReport, RetryReason,
    WebhookGate, DEFAULT_WEBHOOK_BODY_LIMIT,
};
use idempotency_plane::repo::ClaimStatus;
use idempotency_plane::IdempotencyRepository;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::{row, service};
use crate::support::backends::Plane;
use crate::support::org;

/// A gate over the plane, its job directory the plane's.
pub(crate) fn gate<P: Plane>(plane: &P) -> WebhookGate<P::Repo, P::Jobs> {
    WebhookGate::new(service(plane), ProviderJobs::new(plane.jobs()))
}

/// A `webhook.nylas` delivery.
fn delivery<'a>(org: uuid::Uuid, id: &'a str, body: &'a [u8]) -> Delivery<'a> {
    Delivery { organization_id: org, scope: "webhook.nylas", delivery_id: id, body }
}

/// Processing that counts its runs in `runs` and answers `output`.
pub(crate) fn counted(
    runs: &Arc<AtomicUsize>,
    output: Value,
) -> impl Fn() -> std::future::Ready<Result<Value, ProcessingError>> + Send + Sync + 'static {
    let runs = runs.clone();
    move || {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(output.clone()))
    }
}

async fn a_redelivery_of_a_handled_delivery_is_acked_as_a_duplicate_and_performs_nothing<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let body = br#"{"type":"message.created","id":"m-1"}"#;
    let performed = Arc::new(AtomicUsize::new(0));
    let process = counted(&performed, json!({"stored": "m-1"}));

    assert_eq!(gate.handle(delivery(org, "d-1", body), process).await, Ack::Processed);
    let again = gate.handle(delivery(org, "d-1", body), counted(&performed, json!(null))).await;
    assert_eq!(again, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(again.status(), 200, "a duplicate is an ACK, never a 5xx");
    assert_eq!(performed.load(Ordering::SeqCst), 1);
    assert_eq!(gate.drops().get(DropReason::Duplicate), 1);
}

async fn a_concurrent_redelivery_while_the_first_is_processing_is_acked_as_a_duplicate<P: Plane>(plane: &P) {
    let gate = Arc::new(gate(plane));
    let org = org();
    let body: &'static [u8] = b"{\"id\":\"m-2\"}";
    let (started, finish) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));

    let first = {
        let (gate, started, finish) = (gate.clone(), started.clone(), finish.clone());
        tokio::spawn(async move {
            gate.handle(delivery(org, "d-2", body), move || {
                let (started, finish) = (started.clone(), finish.clone());
                async move {
                    started.add_permits(1);
                    finish.acquire().await.expect("gate").forget();
                    Ok::<Value, ProcessingError>(json!("done"))
                }
            })
            .await
        })
    };
    started.acquire().await.expect("first started").forget();
    let concurrent = gate.handle(delivery(org, "d-2", body), || async { panic!("must not process twice") }).await;
    assert_eq!(concurrent, Ack::Dropped(DropReason::Duplicate));
    finish.add_permits(1);
    assert_eq!(first.await.expect("task"), Ack::Processed);
}

async fn the_same_delivery_id_with_a_different_body_is_acked_as_a_hash_mismatch<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let ok = || async { Ok::<Value, ProcessingError>(json!(1)) };
    assert_eq!(gate.handle(delivery(org, "d-3", b"{\"v\":1}"), ok).await, Ack::Processed);
    let changed = gate.handle(delivery(org, "d-3", b"{\"v\":2}"), || async { panic!("not safe to process") }).await;
    assert_eq!(changed, Ack::Dropped(DropReason::HashMismatch));
    assert_eq!(gate.drops().get(DropReason::HashMismatch), 1);
}

async fn a_retryable_processing_failure_is_tried_again_in_process_and_never_released<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let body = b"{\"id\":\"m-4\"}";
    let tries = Arc::new(AtomicUsize::new(0));
    let flaky = {
        let tries = tries.clone();
        move || {
            let failed_before = tries.fetch_add(1, Ordering::SeqCst) < 2;
            async move {
                if failed_before {
                    Err::<Value, _>(ProcessingError::retryable("downstream 503"))
                } else {
                    Ok(json!("ok"))
                }
            }
        }
    };
    let ack = gate.handle(delivery(org, "d-4", body), flaky).await;
    assert_eq!(ack, Ack::Processed, "two retryable failures, then success, within one delivery");
    assert_eq!(tries.load(Ordering::SeqCst), 3);
    let redelivered = gate.handle(delivery(org, "d-4", body), || async { panic!("processed once") }).await;
    assert_eq!(redelivered, Ack::Dropped(DropReason::Duplicate));
}

async fn processing_that_keeps_failing_until_its_timeout_is_left_for_a_redrive_which_finishes_it<P: Plane>(plane: &P) {
    let gate = gate(plane).with_processing_timeout(std::time::Duration::from_secs(2)).unwrap();
    let org = org();
    let failing = || async { Err::<Value, _>(ProcessingError::retryable("downstream 503")) };
    let ack = gate.handle(delivery(org, "d-4b", b"{\"n\":4}"), failing).await;
    assert_eq!(ack, Ack::Accepted, "held by the plane with its body, not journaled");
    assert_eq!(ack.status(), 200, "never silently lost, and not a 5xx");
    let left = row(plane, org, "webhook.nylas", "d-4b").await;
    assert_eq!((left.status, left.response), (ClaimStatus::Processing, None), "no stored failure to replay");
    let redelivered = gate.handle(delivery(org, "d-4b", b"{\"n\":4}"), failing).await;
    assert_eq!(redelivered, Ack::Dropped(DropReason::Duplicate), "the claim is held until its lease passes");

    // Once its lease passed (its backoff), a re-drive carries it on with
    // the body its first delivery stored, and the downstream is back.
    plane.pass_lease(left.id).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let process = {
        let seen = seen.clone();
        move |redelivery: Redelivery| {
            seen.lock().unwrap().push((redelivery.body.clone(), redelivery.attempt));
            async { Ok::<_, ProcessingError>(json!("stored")) }
        }
    };
    let report = gate.redrive("webhook.nylas", 10, process).await.unwrap();
    assert_eq!(report, RedriveReport { redriven: 1, journaled: 1, dead_lettered: 0, left: 0 });
    assert_eq!(*seen.lock().unwrap(), vec![(b"{\"n\":4}".to_vec(), 2)]);
    let done = row(plane, org, "webhook.nylas", "d-4b").await;
    assert_eq!((done.status, done.response), (ClaimStatus::Completed, Some(json!({"ok": true, "output": "stored"}))));
}

async fn an_event_whose_processing_keeps_failing_on_every_redrive_becomes_a_dead_letter<P: Plane>(plane: &P) {
    let gate = gate(plane).with_processing_timeout(std::time::Duration::from_secs(2)).unwrap();
    let org = org();
    let failing = || async { Err::<Value, _>(ProcessingError::retryable("downstream 503")) };
    assert_eq!(gate.handle(delivery(org, "d-4c", b"{}"), failing).await, Ack::Accepted);
    let id = row(plane, org, "webhook.nylas", "d-4c").await.id;
    let runs = Arc::new(AtomicUsize::new(0));
    let failing_again = {
        let runs = runs.clone();
        move |_: Redelivery| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Err::<Value, _>(ProcessingError::retryable("downstream 503")) }
        }
    };
    // Attempts 2 to 5 are handed out and left again; the scope allows 5
    // (its max_attempts by default), so the next re-drive journals the
    // event as a dead letter instead of handing it out a sixth time.
    let mut reports = Vec::new();
    for _ in 0..5 {
        plane.pass_lease(id).await;
        reports.push(gate.redrive("webhook.nylas", 10, &failing_again).await.unwrap());
    }
    let left = RedriveReport { redriven: 1, journaled: 0, dead_lettered: 0, left: 1 };
    let dead = RedriveReport { dead_lettered: 1, ..RedriveReport::default() };
    assert_eq!(reports, vec![left, left, left, left, dead]);
    assert!(runs.load(Ordering::SeqCst) >= 4, "each attempt ran processing");
    assert_eq!(gate.drops().get(DropReason::DeadLettered), 1);
    let dead_letter = row(plane, org, "webhook.nylas", "d-4c").await;
    let expected = json!({"ok": false, "error": "dead_lettered", "output": {"attempts": 5}});
    assert_eq!((dead_letter.status, dead_letter.response), (ClaimStatus::Completed, Some(expected)));
}

async fn a_permanent_processing_failure_is_stored_and_acked<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let failed = gate
        .handle(delivery(org, "d-5", b"{}"), || async {
            Err::<Value, _>(ProcessingError::permanent("unknown event type"))
        })
        .await;
    // Acknowledged (2xx, so the vendor stops), saying it failed.
    assert_eq!(failed, Ack::Failed { error: "unknown event type".to_owned() });
    assert_eq!(failed.status(), 200);
    let response = row(plane, org, "webhook.nylas", "d-5").await.response;
    assert_eq!(response, Some(json!({"ok": false, "error": "unknown event type", "output": null})));
}

async fn a_provider_callback_resolves_its_tenant_before_it_claims<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let jobs = ProviderJobs::new(plane.jobs());
    let org = org();
    jobs.register(org, "transcribe", "job-42").await.unwrap();
    let callback = ProviderCallback {
        provider: "transcribe",
        path_job_id: "job-42",
        body_job_id: Some("job-42"),
        delivery_id: "evt-1",
        body: b"{\"job_id\":\"job-42\",\"status\":\"done\"}",
    };
    let ack = gate
        .handle_provider_callback(callback, move |job| async move {
            assert_eq!(job.organization_id, org);
            Ok::<Value, ProcessingError>(json!("stored transcript"))
        })
        .await;
    assert_eq!(ack, Ack::Processed);
    let claim = row(plane, org, "webhook.transcribe", "evt-1").await;
    assert_eq!((claim.organization_id, claim.scope.as_str()), (org, "webhook.transcribe"));
    assert_eq!(plane.claims().await, 1, "the one claim, the tenant's");
}

async fn a_callback_for_a_job_we_do_not_hold_is_acked_as_unknown_job<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let callback = ProviderCallback {
        provider: "transcribe",
        path_job_id: "job-nobody-started",
        body_job_id: None,
        delivery_id: "evt-2",
        body: b"{}",
    };
    let ack = gate.handle_provider_callback(callback, |_| async { panic!("no tenant, no processing") }).await;
    assert_eq!(ack, Ack::Dropped(DropReason::UnknownJob));
    assert_eq!(ack.status(), 200);
    assert_eq!(gate.drops().get(DropReason::UnknownJob), 1);
    assert_eq!(plane.claims().await, 0, "nothing claimed");
}

async fn a_callback_whose_body_names_another_job_is_acked_as_job_mismatch<P: Plane>(plane: &P) {
    let gate = gate(plane);
    ProviderJobs::new(plane.jobs()).register(org(), "transcribe", "job-1").await.unwrap();
    let callback = ProviderCallback {
        provider: "transcribe",
        path_job_id: "job-1",
        body_job_id: Some("job-2"),
        delivery_id: "evt-3",
        body: b"{\"job_id\":\"job-2\"}",
    };
    let ack = gate.handle_provider_callback(callback, |_| async { panic!("mismatched job") }).await;
    assert_eq!(ack, Ack::Dropped(DropReason::JobMismatch));
    assert_eq!(gate.drops().get(DropReason::JobMismatch), 1);
    assert_eq!(plane.claims().await, 0);
}

async fn a_delivery_that_can_never_be_claimed_is_acked_as_invalid<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let long_id = "d".repeat(600);
    let ack = gate.handle(delivery(org(), &long_id, b"{}"), || async { panic!("never claimed") }).await;
    assert_eq!(ack, Ack::Dropped(DropReason::InvalidDelivery));
    assert_eq!(ack.status(), 200, "redelivering it would never help");
    assert_eq!(gate.drops().get(DropReason::InvalidDelivery), 1);
}

async fn processing_that_panics_or_overruns_is_journaled_as_aborted_never_released<P: Plane>(plane: &P) {
    let gate = gate(plane).with_processing_timeout(std::time::Duration::from_secs(2)).unwrap();
    let org = org();
    let panicked = gate.handle(delivery(org, "d-6", b"{}"), || async { panic!("a bug in the handler") }).await;
    assert_eq!(panicked, Ack::Dropped(DropReason::ProcessingAborted));
    let overran = gate
        .handle(delivery(org, "d-6b", b"{}"), || async {
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            Ok::<Value, ProcessingError>(json!("late"))
        })
        .await;
    assert_eq!(overran, Ack::Dropped(DropReason::ProcessingAborted));
    assert_eq!(gate.drops().get(DropReason::ProcessingAborted), 2);
    let mut errors = Vec::new();
    for key in ["d-6", "d-6b"] {
        let stored = row(plane, org, "webhook.nylas", key).await;
        assert_eq!(stored.status, ClaimStatus::Completed, "{key}");
        errors.push(stored.response.expect("a journal")["error"].clone());
    }
    assert_eq!(errors, vec![json!("processing_panicked"), json!("processing_timed_out")]);
    let redelivered = gate.handle(delivery(org, "d-6", b"{}"), || async { panic!("recorded once") }).await;
    assert_eq!(redelivered, Ack::Dropped(DropReason::Duplicate));
}

async fn a_processing_output_above_the_store_limit_still_completes_the_delivery<P: Plane>(plane: &P) {
    let gate = WebhookGate::new(service(plane).with_response_limit(1024), ProviderJobs::new(plane.jobs()));
    let org = org();
    let big = || async { Ok::<Value, ProcessingError>(json!({"rows": "x".repeat(4096)})) };
    assert_eq!(gate.handle(delivery(org, "d-big", b"{}"), big).await, Ack::Processed);
    let again = gate.handle(delivery(org, "d-big", b"{}"), || async { panic!("processed once") }).await;
    assert_eq!(again, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(row(plane, org, "webhook.nylas", "d-big").await.status, ClaimStatus::Completed);
}

async fn a_delivery_whose_body_holds_nul_is_journaled_and_its_redelivery_is_a_duplicate<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let body = b"{\"type\":\"file.uploaded\",\"name\":\"a\\u0000b\"}";
    let performed = Arc::new(AtomicUsize::new(0));
    // Processing echoes what it stored, NUL included: jsonb cannot hold it.
    let parsed: Value = serde_json::from_slice(body).expect("the body is JSON");
    let process = counted(&performed, json!({"stored": parsed["name"]}));

    assert_eq!(gate.handle(delivery(org, "d-nul", body), process).await, Ack::Processed);
    let stored = row(plane, org, "webhook.nylas", "d-nul").await;
    assert_eq!(stored.status, ClaimStatus::Completed, "journaled, not left processing");
    let response = stored.response.expect("the journal");
    assert_eq!(response["ok"], json!(true));
    assert_eq!(response["output"], json!({"$json": "{\"stored\":\"a\\u0000b\"}"}), "stored whole, as its text");
    let again = gate.handle(delivery(org, "d-nul", body), counted(&performed, json!(null))).await;
    assert_eq!(again, Ack::Dropped(DropReason::Duplicate));
    assert_eq!(performed.load(Ordering::SeqCst), 1, "processed once");
}

async fn a_webhook_claim_carries_the_specs_30_second_lease<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let ack =
        gate.handle(delivery(org, "d-lease", b"{}"), || async { Ok::<Value, ProcessingError>(json!("done")) }).await;
    assert_eq!(ack, Ack::Processed);
    let stored = row(plane, org, "webhook.nylas", "d-lease").await;
    assert_eq!(
        (stored.lease_expires_at - stored.claimed_at).num_milliseconds(),
        30_000,
        "webhook.nylas: lease 30 s (15 s processing, 10 s journal, 5 s margin)"
    );
}

async fn an_absurd_processing_timeout_is_refused_not_a_panic<P: Plane>(plane: &P) {
    for timeout in [std::time::Duration::MAX, std::time::Duration::ZERO, std::time::Duration::from_secs(86_400)] {
        assert!(gate(plane).with_processing_timeout(timeout).is_err(), "{timeout:?}");
    }
    assert!(gate(plane).with_processing_timeout(std::time::Duration::from_secs(60)).is_ok());
    assert!(
        gate(plane).with_processing_timeout(std::time::Duration::from_secs(400)).is_err(),
        "a lease past the vendor's last redelivery (6 min)"
    );
}

/// What a vendor hears of a delivery is an ACK alone (200, no body): the
/// first delivery is answered `Processed` and every redelivery a counted
/// `duplicate`, whatever processing answered (a 70,000-character failure, NUL, an
/// output above the store limit, one the store keeps through its lossless
/// wrapper); the first is journaled whole or by its stand-in, and each
/// redelivery is counted as a duplicate, as the spec requires.
async fn the_first_delivery_is_answered_as_every_redelivery_is<P: Plane>(plane: &P) {
    let gate = gate(plane);
    let org = org();
    let deep = (0..100).fold(json!(1), |inner, _| json!([inner]));
    let answers: [(&str, Result<Value, ProcessingError>); 4] = [
        ("long-error", Err(ProcessingError::permanent("e".repeat(70_000)))),
        ("nul", Ok(json!({"body": "PK\u{0}\u{3}"}))),
        ("oversized", Ok(json!({"rows": "x".repeat(100 * 1024)}))),
        ("deep", Ok(deep)),
    ];
    for (n, (id, answer)) in answers.into_iter().enumerate() {
        let body = format!("{{\"id\":\"{id}\"}}");
        let process = move || std::future::ready(answer.clone());
        let first = gate.handle(delivery(org, id, body.as_bytes()), process).await;
        let again =
            gate.handle(delivery(org, id, body.as_bytes()), || async { panic!("must not process twice") }).await;
        let answered = match id {
            "long-error" => {
                Ack::Failed { error: "e".repeat(idempotency_plane::callers::webhook::FAILED_ACK_ERROR_CHARS) }
            }
            _ => Ack::Processed,
        };
        assert_eq!((&first, &again), (&answered, &Ack::Dropped(DropReason::Duplicate)), "{id}");
        let stored = row(plane, org, "webhook.nylas", id).await;
        assert_eq!(stored.status, ClaimStatus::Completed, "{id}");
        // The event's record: the failure as a failure, whatever its size.
        let kept = idempotency_plane::service::Answer::from_stored(stored.response, None, None);
        assert_eq!(kept.ok, id != "long-error", "{id}: {:?}", kept.error);
        assert_eq!(gate.drops().get(DropReason::Duplicate), n as u64 + 1);
    }
}

/// A JSON event of exactly `size` bytes, as a vendor signs one.
fn event_of(id: &str, size: usize) -> Vec<u8> {
    let head = format!("{{\"id\":\"{id}\",\"type\":\"message.created\",\"data\":\"");
    let mut event = head.into_bytes();
    event.resize(size - 2, b'x');
    event.extend_from_slice(b"\"}");
    event
}

/// The issue's event (104 KB) and bodies of exactly the default limit, in
/// the forms that store largest: JSON text, bytes that are not text, text
/// whose JSON escapes are six times its size. Each is taken, stored with
/// its claim whole, and handed back byte for byte by a re-drive.
async fn an_event_up_to_the_default_body_limit_is_stored_with_its_claim_and_re_driven_byte_for_byte<P: Plane>(
    plane: &P,
) {
    // The timeout counts from before the claim, which carries the whole
    // body: long enough that claiming it on a busy machine leaves processing
    // time, and processing then fails until the timeout leaves the event to
    // a re-drive.
    let gate = gate(plane).with_processing_timeout(std::time::Duration::from_secs(2)).unwrap();
    assert_eq!(gate.body_limit(), DEFAULT_WEBHOOK_BODY_LIMIT);
    assert_eq!(DEFAULT_WEBHOOK_BODY_LIMIT, 256 * 1024);
    let org = org();
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("evt-104kb", event_of("evt-104kb", 104_000)),
        ("evt-at-limit", event_of("evt-at-limit", DEFAULT_WEBHOOK_BODY_LIMIT)),
        ("bytes-at-limit", vec![0xff; DEFAULT_WEBHOOK_BODY_LIMIT]),
        ("controls-at-limit", vec![0x01; DEFAULT_WEBHOOK_BODY_LIMIT]),
    ];
    let failing = || async { Err::<Value, _>(ProcessingError::retryable("downstream 503")) };
    for (id, body) in &bodies {
        let ack = gate.handle(delivery(org, id, body), failing).await;
        assert_eq!(ack, Ack::Accepted, "{id}: held by the plane with its body, left for a re-drive");
        plane.pass_lease(row(plane, org, "webhook.nylas", id).await.id).await;
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let process = {
        let seen = seen.clone();
        move |redelivery: Redelivery| {
            seen.lock().unwrap().push((redelivery.delivery_id, redelivery.body));
            async { Ok::<_, ProcessingError>(json!("done")) }
        }
    };
    let report = gate.redrive("webhook.nylas", 10, process).await.unwrap();
    assert_eq!(report, RedriveReport { redriven: 4, journaled: 4, dead_lettered: 0, left: 0 });
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    let mut expected: Vec<(String, Vec<u8>)> =
        bodies.iter().map(|(id, body)| ((*id).to_owned(), body.clone())).collect();
    expected.sort();
    assert!(seen == expected, "every body handed back byte for byte");
    for (id, body) in &bodies {
        let again = gate.handle(delivery(org, id, body), || async { panic!("processed once") }).await;
        assert_eq!(again, Ack::Dropped(DropReason::Duplicate), "{id}: replayed, not processed again");
    }
}

/// A body above the gate's limit is answered 413 before anything else: no
/// claim, no job lookup, no processing; one at the limit is processed.
async fn a_body_above_the_gate_limit_is_refused_413_before_any_lookup_or_claim<P: Plane>(plane: &P) {
    let runs = Arc::new(AtomicUsize::new(0));
    let org = org();
    let over = vec![b'x'; DEFAULT_WEBHOOK_BODY_LIMIT + 1];
    let ack = gate(plane).handle(delivery(org, "d-over", &over), counted(&runs, json!(1))).await;
    assert_eq!((ack.clone(), ack.status()), (Ack::Retry(RetryReason::DeliveryTooLarge), 413));
    assert!(plane.repository().get(org, "webhook.nylas", "d-over").await.unwrap().is_none(), "never claimed");
    // A callback for a job nobody registered: refused for its size, before
    // the lookup that would have dropped it as an unknown job.
    let callback = ProviderCallback {
        provider: "transcribe",
        path_job_id: "job-nobody-holds",
        body_job_id: None,
        delivery_id: "d-over-callback",
        body: &over,
    };
    let ack = gate(plane).handle_provider_callback(callback, move |_| async { Ok(json!(1)) }).await;
    assert_eq!(ack, Ack::Retry(RetryReason::DeliveryTooLarge));

    let small = gate(plane).with_body_limit(1024);
    assert_eq!(small.body_limit(), 1024);
    let ack = small.handle(delivery(org, "d-1025", &[b'y'; 1025]), counted(&runs, json!(1))).await;
    assert_eq!(ack, Ack::Retry(RetryReason::DeliveryTooLarge));
    let ack = small.handle(delivery(org, "d-1024", &[b'y'; 1024]), counted(&runs, json!(1))).await;
    assert_eq!(ack, Ack::Processed, "a body at the limit is taken");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the body at the limit was processed");
    assert_eq!(small.drops().get(DropReason::UnknownJob), 0);
}

crate::support::on_every_plane!(
    an_event_up_to_the_default_body_limit_is_stored_with_its_claim_and_re_driven_byte_for_byte,
    a_body_above_the_gate_limit_is_refused_413_before_any_lookup_or_claim,
    the_first_delivery_is_answered_as_every_redelivery_is,
    a_redelivery_of_a_handled_delivery_is_acked_as_a_duplicate_and_performs_nothing,
    a_concurrent_redelivery_while_the_first_is_processing_is_acked_as_a_duplicate,
    the_same_delivery_id_with_a_different_body_is_acked_as_a_hash_mismatch,
    a_retryable_processing_failure_is_tried_again_in_process_and_never_released,
    processing_that_keeps_failing_until_its_timeout_is_left_for_a_redrive_which_finishes_it,
    an_event_whose_processing_keeps_failing_on_every_redrive_becomes_a_dead_letter,
    a_permanent_processing_failure_is_stored_and_acked,
    a_provider_callback_resolves_its_tenant_before_it_claims,
    a_callback_for_a_job_we_do_not_hold_is_acked_as_unknown_job,
    a_callback_whose_body_names_another_job_is_acked_as_job_mismatch,
    a_delivery_that_can_never_be_claimed_is_acked_as_invalid,
    processing_that_panics_or_overruns_is_journaled_as_aborted_never_released,
    a_processing_output_above_the_store_limit_still_completes_the_delivery,
    a_delivery_whose_body_holds_nul_is_journaled_and_its_redelivery_is_a_duplicate,
    a_webhook_claim_carries_the_specs_30_second_lease,
    an_absurd_processing_timeout_is_refused_not_a_panic,
);
