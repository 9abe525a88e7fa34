//! The webhook gate under faults: many deliveries of each event, concurrent
//! and over time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::webhook::{
    Ack, Delivery, DropReason, ProcessingError, ProviderJobs, Redelivery, WebhookGate,
};
use idempotency_plane::{IdempotencyService, PostgrestRepository};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::faults::{Call, Fault, Faulty, Op};
use crate::support::harness::{client, stack, WAIT};

use super::{ms, rng, seed, KeyedFaults};

const WEBHOOK_SCOPE: &str = "webhook.nylas";
const EVENTS: usize = 10;
const PROCESSING_TIMEOUT: Duration = ms(800);

/// What processing an event does, fixed per event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventKind {
    /// Stores the event.
    Stores,
    /// Fails without an effect this many times, then stores it.
    Flaky(usize),
    /// Fails for good: the failure is the event's answer.
    Rejects,
    /// Stalls past the processing timeout.
    Stalls,
    /// Panics.
    Panics,
}

/// One event: its kind, how often processing ran, and how often it stored
/// the event (the effect that must happen at most once).
struct Event {
    id: String,
    kind: EventKind,
    runs: AtomicUsize,
    effects: AtomicUsize,
    acks: Mutex<Vec<Ack>>,
}

impl Event {
    fn output(n: usize) -> Value {
        json!({"event": n})
    }

    /// Processing for event `n`, as the gate calls it (again after a
    /// retryable failure).
    fn processing(
        self: &Arc<Self>,
        n: usize,
        seed: u64,
    ) -> impl Fn() -> futures_util::future::BoxFuture<'static, Result<Value, ProcessingError>> + Send + Sync + 'static
    {
        let event = self.clone();
        move || {
            let event = event.clone();
            let run = event.runs.fetch_add(1, Ordering::SeqCst);
            let work = ms(rng(seed, &[0x3011, n as u64, run as u64]).random_range(5..60));
            Box::pin(async move {
                match event.kind {
                    EventKind::Panics => panic!("processing panics (this test expects it)"),
                    EventKind::Stalls => {
                        tokio::time::sleep(PROCESSING_TIMEOUT * 4).await;
                        return Err(ProcessingError::permanent("stalled"));
                    }
                    _ => tokio::time::sleep(work).await,
                }
                match event.kind {
                    EventKind::Rejects => Err(ProcessingError::permanent(format!("rejected:{n}"))),
                    EventKind::Flaky(failures) if run < failures => {
                        Err(ProcessingError::retryable(format!("flaky:{n}")))
                    }
                    _ => {
                        event.effects.fetch_add(1, Ordering::SeqCst);
                        Ok(Event::output(n))
                    }
                }
            })
        }
    }
}

/// A claim's answer lost (at most once per event: the test's chooser keeps
/// the count), slow before the call, or slow after it; some slower than
/// the gate's 500 ms answer deadline. The gate asks again as the same
/// attempt while its processing timeout allows, so one quick loss is
/// carried; a loss late in the timeout is not (see `callers::gate_endings`), nor is
/// a claim whose every answer is lost.
fn webhook_claim_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..15 => Some(Fault::LoseAnswer),
        15..30 => Some(Fault::DelayBefore(ms(rng.random_range(100..700)))),
        30..40 => Some(Fault::DelayAfter(ms(rng.random_range(100..700)))),
        _ => None,
    }
}

/// The gate's journal deadline: 3 s, so a journal still lands on a machine
/// busy with the rest of the suite (a 1 s deadline missed there, leaving
/// the claim to its lease).
const WEBHOOK_JOURNAL_DEADLINE: Duration = ms(3000);

/// The journal: lost after commit, slow within its deadline, or slow beyond
/// it after it committed. The deadlines count from before the claim (the
/// processing timeout, 800 ms, then the journal's 3 s), and a claim may take
/// 700 ms of them: a journal starts by 800 ms, and 300 ms leaves it time.
/// Never slow beyond the deadline before the write: a journal that never
/// lands leaves the claim to its lease, as a worker that died would, and
/// only a delivery after the lease would carry the event on.
fn webhook_complete_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..15 => Some(Fault::LoseAnswer),
        15..30 => Some(Fault::DelayBefore(ms(rng.random_range(50..300)))),
        30..40 => Some(Fault::DelayAfter(WEBHOOK_JOURNAL_DEADLINE + ms(1000))),
        _ => None,
    }
}

/// Whether `ack` reports a failure the gate journaled.
fn gate_failed(ack: &Ack) -> bool {
    matches!(ack, Ack::Dropped(DropReason::ProcessingAborted | DropReason::DeadLettered))
}

/// Delivers `event` as the vendor does: again after a 503, until an ACK or
/// `tries` ran out; records every answer.
async fn deliver(
    gate: &WebhookGate<Faulty<PostgrestRepository>, PostgrestRepository>,
    org: Uuid,
    n: usize,
    event: &Arc<Event>,
    seed: u64,
    tries: usize,
    chain: u64,
) {
    let body = serde_json::to_vec(&json!({"type": "message.created", "event": n})).expect("a body");
    for try_number in 0..tries {
        let delivery = Delivery { organization_id: org, scope: WEBHOOK_SCOPE, delivery_id: &event.id, body: &body };
        let ack = gate.handle(delivery, event.processing(n, seed)).await;
        event.acks.lock().unwrap().push(ack.clone());
        if ack.status() != 503 {
            return;
        }
        let wait = rng(seed, &[0x8E7, n as u64, chain, try_number as u64]).random_range(100..300);
        tokio::time::sleep(ms(wait)).await;
    }
}

/// Many deliveries of each event, concurrent and over time, through a store
/// with faults: every event ends with a completed row; an event stored is
/// stored exactly once and its row holds its output; an event not stored
/// has its failure journaled, and the gate's failures are counted as drop
/// reasons, one per event.
// Two workers: a panic's backtrace, printed while the worker holds the
// processing, must not stall every delivery's deadline with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_deliveries_process_each_acknowledged_event_exactly_once_or_journal_its_failure() {
    let seed = seed("webhook deliveries");
    let stack = stack().await;
    let faulty = Faulty::new(PostgrestRepository::new(client(&stack)));
    let gate = WebhookGate::new(
        IdempotencyService::new(faulty.clone()),
        ProviderJobs::new(PostgrestRepository::new(client(&stack))),
    )
    .with_processing_timeout(PROCESSING_TIMEOUT)
    .and_then(|gate| gate.with_journal_deadline(WEBHOOK_JOURNAL_DEADLINE))
    .expect("a gate")
    .with_deadline(ms(500));
    let org = Uuid::new_v4();
    let events: Vec<Arc<Event>> = (0..EVENTS)
        .map(|n| {
            let kind = match rng(seed, &[0xE7E, n as u64]).random_range(0..10) {
                0..4 => EventKind::Stores,
                4..6 => EventKind::Flaky(1 + n % 2),
                6..8 => EventKind::Rejects,
                8 => EventKind::Stalls,
                _ => EventKind::Panics,
            };
            Arc::new(Event {
                id: format!("evt-{n}-{}", Uuid::new_v4()),
                kind,
                runs: AtomicUsize::new(0),
                effects: AtomicUsize::new(0),
                acks: Mutex::default(),
            })
        })
        .collect();
    let names: Vec<String> = events.iter().map(|event| event.id.clone()).collect();
    let aimed = KeyedFaults::new(seed, &names);
    // At most one lost claim answer per event (see webhook_claim_fault).
    let lost_claims: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    {
        let (generators, lost_claims) = (aimed.generators.clone(), lost_claims.clone());
        faulty.choose_with(Op::Claim, move |call: &Call<'_>| {
            let key = call.key?;
            let fault = webhook_claim_fault(generators.lock().unwrap().get_mut(key)?, key);
            if fault == Some(Fault::LoseAnswer) {
                let mut lost = lost_claims.lock().unwrap();
                let count = lost.entry(key.to_owned()).or_default();
                *count += 1;
                if *count > 1 {
                    return None;
                }
            }
            fault
        });
    }
    aimed.aim(&faulty, Op::Complete, webhook_complete_fault);

    // A re-driver on a schedule, as pg_cron or `idem redrive --every` runs
    // one: events left to their lease (processing kept failing, a journal
    // that did not land) are carried on by it, with the body they stored.
    let redriven = Arc::new(AtomicUsize::new(0));
    let redriver = {
        let (gate, events, redriven) = (gate.clone(), events.clone(), redriven.clone());
        tokio::spawn(async move {
            loop {
                let process = |redelivery: Redelivery| {
                    let n = events.iter().position(|event| event.id == redelivery.delivery_id);
                    let run = n.map(|n| events[n].processing(n, seed)());
                    async move {
                        match run {
                            Some(run) => run.await,
                            None => Err(ProcessingError::permanent("an event this test never sent")),
                        }
                    }
                };
                if let Ok(report) = gate.redrive(WEBHOOK_SCOPE, 100, process).await {
                    redriven.fetch_add(report.redriven as usize, Ordering::SeqCst);
                }
                tokio::time::sleep(ms(250)).await;
            }
        })
    };

    let mut chains = Vec::new();
    for (n, event) in events.iter().enumerate() {
        let deliveries = rng(seed, &[0xDE1, n as u64]).random_range(3..=5);
        for chain in 0..deliveries {
            let start = ms(rng(seed, &[0x57A7, n as u64, chain]).random_range(0..1500));
            let (gate, event) = (gate.clone(), event.clone());
            chains.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                deliver(&gate, org, n, &event, seed, 8, chain).await;
            }));
        }
    }
    for chain in chains {
        chain.await.expect("a delivery panicked");
    }

    // The faults stop; the vendor delivers each event once more, until ACKed.
    faulty.clear_all();
    for (n, event) in events.iter().enumerate() {
        deliver(&gate, org, n, event, seed, 20, 99).await;
        let acked = event.acks.lock().unwrap().iter().any(|ack| ack.status() == 200);
        assert!(acked, "seed {seed}: event {n} was never acknowledged: {:?}", event.acks.lock().unwrap());
    }

    // Work carried past an answer finishes on its own: wait for every row.
    let rows = async {
        loop {
            let rows: Vec<(String, String, Option<Value>)> = sqlx::query_as(
                "select key, status, response from agent.idempotency_keys where organization_id = $1 and scope = $2",
            )
            .bind(org)
            .bind(WEBHOOK_SCOPE)
            .fetch_all(stack.db())
            .await
            .expect("read the rows");
            if rows.len() == EVENTS && rows.iter().all(|(_, status, _)| status == "completed") {
                return rows.into_iter().map(|(key, _, response)| (key, response)).collect::<HashMap<_, _>>();
            }
            tokio::time::sleep(ms(20)).await;
        }
    };
    let rows = tokio::time::timeout(WAIT, rows).await;
    redriver.abort();
    let rows = match rows {
        Ok(rows) => rows,
        Err(_) => {
            let rows: Vec<(String, String, bool)> = sqlx::query_as(
                "select key, status, lease_expires_at > now() from agent.idempotency_keys
                  where organization_id = $1 and scope = $2",
            )
            .bind(org)
            .bind(WEBHOOK_SCOPE)
            .fetch_all(stack.db())
            .await
            .expect("read the rows");
            let unfinished: Vec<String> = events
                .iter()
                .enumerate()
                .filter_map(|(n, event)| {
                    let row = rows.iter().find(|(key, _, _)| *key == event.id);
                    if row.is_some_and(|(_, status, _)| status == "completed") {
                        return None;
                    }
                    Some(format!(
                        "event {n} ({:?}): row {row:?}, {} runs, acks {:?}",
                        event.kind,
                        event.runs.load(Ordering::SeqCst),
                        event.acks.lock().unwrap()
                    ))
                })
                .collect();
            panic!("seed {seed}: rows not completed within {WAIT:?}:\n{}", unfinished.join("\n"));
        }
    };
    println!(
        "webhook deliveries: faults injected: claim {}, complete {}; drops: duplicate {}, aborted {}, dead lettered {}; \
         re-driven {}",
        faulty.injected(Op::Claim),
        faulty.injected(Op::Complete),
        gate.drops().get(DropReason::Duplicate),
        gate.drops().get(DropReason::ProcessingAborted),
        gate.drops().get(DropReason::DeadLettered),
        redriven.load(Ordering::SeqCst),
    );

    let mut gate_failures = 0;
    for (n, event) in events.iter().enumerate() {
        let context = format!("seed {seed}, event {n} ({:?})", event.kind);
        let response =
            rows[&event.id].clone().unwrap_or_else(|| panic!("{context}: a completed row without a response"));
        let effects = event.effects.load(Ordering::SeqCst);
        let acks = event.acks.lock().unwrap().clone();
        if response["ok"] == json!(true) {
            assert_eq!(response, json!({"ok": true, "output": Event::output(n)}), "{context}");
            assert_eq!(effects, 1, "{context}: stored {effects} times");
            assert!(matches!(event.kind, EventKind::Stores | EventKind::Flaky(_)), "{context}: {response}");
            assert!(!acks.iter().any(gate_failed), "{context}: stored, yet answered a gate failure: {acks:?}");
            continue;
        }
        assert_eq!(effects, 0, "{context}: journaled as a failure, yet stored {effects} times: {response}");
        let error = response["error"].as_str().unwrap_or_else(|| panic!("{context}: no error in {response}"));
        assert_eq!(response.as_object().map(|m| m.len()), Some(3), "{context}: ok, error, output: {response}");
        let by_the_gate = match error {
            "processing_timed_out" => true,
            "processing_panicked" => event.kind == EventKind::Panics,
            rejected if rejected == format!("rejected:{n}") => {
                assert_eq!(event.kind, EventKind::Rejects, "{context}");
                false
            }
            other => panic!("{context}: journaled an error no processing gave: {other:?}"),
        };
        assert!(by_the_gate || event.kind == EventKind::Rejects, "{context}: {error}");
        if by_the_gate {
            gate_failures += 1;
            assert!(!acks.contains(&Ack::Processed), "{context}: answered processed, journaled {error}: {acks:?}");
        } else {
            assert!(!acks.iter().any(gate_failed), "{context}: answered a gate failure, journaled {error}: {acks:?}");
        }
    }
    // A journal whose answer was slow lands before the gate counts its drop
    // reason: wait for the count, then check it.
    let counted = || gate.drops().get(DropReason::ProcessingAborted) + gate.drops().get(DropReason::DeadLettered);
    let settled = async {
        while counted() < gate_failures {
            tokio::time::sleep(ms(20)).await;
        }
    };
    let _ = tokio::time::timeout(WAIT, settled).await;
    assert_eq!(counted(), gate_failures, "seed {seed}: one drop reason counted per failure the gate journaled");
    stack.stop().await.unwrap();
}
