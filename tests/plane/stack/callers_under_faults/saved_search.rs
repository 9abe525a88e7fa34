//! Randomized endings on the real stack: many concurrent attempts of every
//! caller — the tool guard, the webhook gate and the saved-search start
//! through [`Faulty`], the `Idempotency-Key` layer through an [`RpcProxy`]
//! — with faults a seeded generator chooses, and the invariants each caller
//! promises checked on what the store holds and what its callers were
//! answered.
//!
//! Each test prints its seed; set `IDEM_RANDOM_SEED` to run one again. The
//! seed decides every choice made for a key (the store's faults on its
//! calls, what each attempt's tool or processing does, when attempts start),
//! but not how the tasks interleave, so a run is reproduced in kind, not to
//! the millisecond.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::idempotency_key::IdempotencyKeyLayer;
use idempotency_plane::callers::runs::RunAdmission;
use idempotency_plane::callers::saved_search::{
    SavedSearchError, SavedSearchStart, SnapshotError, SnapshotSource, StartedRun, SAVED_SEARCH_START_SCOPE,
    SNAPSHOT_RESOURCE_TYPE,
};
use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolCall, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::callers::webhook::{Ack, Delivery, DropReason, ProcessingError, ProviderJobs, WebhookGate};
use idempotency_plane::repo::{AdmittedRun, ClaimFence, RunRepository};
use idempotency_plane::service::{Answer, Elided, ResponseRef};
use idempotency_plane::{
    ClientError, Error, IdempotencyService, PostgrestClient, PostgrestRepository, ReadOutcome, RequestHash, RetryConfig,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::faults::{Call, Fault, Faulty, Op};
use crate::support::harness::{client, stack, WAIT};
use crate::support::proxy::RpcProxy;

const fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// The run's seed: `IDEM_RANDOM_SEED` when set, else a fresh one; printed.
fn seed(test: &str) -> u64 {
    let seed = match std::env::var("IDEM_RANDOM_SEED") {
        Ok(text) => text.trim().parse().unwrap_or_else(|_| panic!("IDEM_RANDOM_SEED={text:?} is not a u64")),
        Err(_) => rand::random(),
    };
    println!("{test}: seed {seed} (IDEM_RANDOM_SEED={seed} runs it again)");
    seed
}

/// A generator for one decision, from the seed and the decision's
/// coordinates (SplitMix64 over them).
fn rng(seed: u64, coordinates: &[u64]) -> StdRng {
    let mut state = seed;
    for &part in coordinates {
        state = state.wrapping_add(part).wrapping_add(0x9E37_79B9_7F4A_7C15);
        state = (state ^ (state >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        state = (state ^ (state >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        state ^= state >> 31;
    }
    StdRng::seed_from_u64(state)
}

/// The store's faults on the calls of each key, each drawn from a
/// generator of the key's own, so the faults a key meets do not depend on
/// how the other keys' calls interleave with its own.
#[derive(Clone)]
struct KeyedFaults {
    generators: Arc<Mutex<HashMap<String, StdRng>>>,
}

impl KeyedFaults {
    fn new(seed: u64, keys: &[String]) -> Self {
        let generators =
            keys.iter().enumerate().map(|(n, key)| (key.clone(), rng(seed, &[0xFA17, n as u64]))).collect();
        KeyedFaults { generators: Arc::new(Mutex::new(generators)) }
    }

    /// Sets `op`'s chooser on `faulty`: `choose` gets the key's generator.
    fn aim<R>(&self, faulty: &Faulty<R>, op: Op, choose: fn(&mut StdRng, &str) -> Option<Fault>) {
        let generators = self.generators.clone();
        faulty.choose_with(op, move |call: &Call<'_>| {
            let key = call.key?;
            let mut generators = generators.lock().unwrap();
            choose(generators.get_mut(key)?, key)
        });
    }
}

/// Moves the lease of `key`'s processing claim into the past, as if its
/// worker had stalled past it.
async fn pass_lease_of(db: &PgPool, org: Uuid, scope: &str, key: &str) {
    sqlx::query(
        "update agent.idempotency_keys
            set lease_expires_at = now() - interval '1 second',
                claimed_at = claimed_at - (lease_expires_at - now()) - interval '1 second'
          where organization_id = $1 and scope = $2 and key = $3 and status = 'processing'",
    )
    .bind(org)
    .bind(scope)
    .bind(key)
    .execute(db)
    .await
    .expect("pass the lease");
}

/// Size and lowercase hex SHA-256 of `value` as compact JSON.
fn digest(value: &Value) -> (u64, String) {
    let bytes = serde_json::to_vec(value).expect("serializable");
    (bytes.len() as u64, hex::encode(Sha256::digest(&bytes)))
}

/// Whether `journaled` is `output` as the journal keeps it: itself, or a
/// reference or summary carrying its size and digest.
fn stands_for(journaled: &Value, output: &Value) -> bool {
    if journaled == output {
        return true;
    }
    let (size, sha256) = digest(output);
    let reference = journaled.get("$response_ref").cloned().and_then(|r| serde_json::from_value::<ResponseRef>(r).ok());
    if let Some(reference) = reference.filter(|_| journaled.as_object().is_some_and(|m| m.len() == 1)) {
        return (reference.size, reference.sha256) == (size, sha256);
    }
    Elided::from_stored(journaled).is_some_and(|elided| (elided.size, elided.sha256) == (Some(size), Some(sha256)))
}

// ---------------------------------------------------------------------------
// The tool guard
// ---------------------------------------------------------------------------

const TOOL_SCOPE: &str = "tool.email.send";
const TOOL_KEYS: usize = 12;
const TOOL_ATTEMPTS: usize = 4;
const TOOL_TIMEOUT: Duration = ms(400);
/// How many times one attempt (an orchestrator step) is retried at most.
const STEP_TRIES: usize = 40;

/// What the vendor answers for a key's call, fixed per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ToolKind {
    /// A message, answered small.
    Small,
    /// A message whose answer is above the store limit: journaled by
    /// reference to the message.
    Large,
    /// A business failure (no message): journaled as the failure.
    Failure,
    /// A business failure with a 100 KiB error and no resource.
    LargeFailure,
}

/// A vendor that dedupes on the idempotency key it is handed: the same key
/// answers the same message, a new key makes one. Remembers which tool key
/// each message was made for, so a key with two messages is seen.
#[derive(Default)]
struct Vendor {
    messages: Mutex<HashMap<String, (usize, String)>>,
    calls: AtomicUsize,
}

impl Vendor {
    fn send(&self, tool_key: usize, kind: ToolKind, call: &ToolCall) -> ToolResult {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match kind {
            ToolKind::Failure => {
                return ToolResult::business_failure("invalid_recipient", json!({"key": tool_key}));
            }
            ToolKind::LargeFailure => {
                let error = format!("invalid_recipient: {}", "r".repeat(100 * 1024));
                return ToolResult::business_failure(error, json!({"key": tool_key}));
            }
            ToolKind::Small | ToolKind::Large => {}
        }
        let id = {
            let mut messages = self.messages.lock().unwrap();
            let next = format!("msg-{}", messages.len() + 1);
            messages.entry(call.idempotency_key().to_owned()).or_insert((tool_key, next)).1.clone()
        };
        let body = match kind {
            ToolKind::Large => json!({"id": id, "body": "b".repeat(70_000)}),
            _ => json!({"id": id}),
        };
        ToolResult::success(body).with_resource("email.message", id)
    }

    /// The messages made for `tool_key`.
    fn messages_for(&self, tool_key: usize) -> Vec<String> {
        let messages = self.messages.lock().unwrap();
        messages.values().filter(|(key, _)| *key == tool_key).map(|(_, id)| id.clone()).collect()
    }
}

/// What one try of a tool does, drawn per try.
#[derive(Debug, Clone, Copy)]
enum ToolTry {
    /// Calls the vendor and answers it.
    Normal,
    /// The vendor answers 429 before doing anything.
    RateLimited,
    /// The worker stalls past the tool's timeout before reaching the vendor.
    StallBefore,
    /// The worker reaches the vendor, then stalls past the timeout.
    StallAfter,
    /// The worker reaches the vendor, then panics.
    PanicAfter,
}

fn tool_try(rng: &mut StdRng) -> ToolTry {
    match rng.random_range(0..100) {
        0..12 => ToolTry::RateLimited,
        12..20 => ToolTry::StallBefore,
        20..30 => ToolTry::StallAfter,
        30..34 => ToolTry::PanicAfter,
        _ => ToolTry::Normal,
    }
}

fn tool_claim_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..10 => Some(Fault::LoseAnswer),
        10..20 => Some(Fault::DelayBefore(ms(rng.random_range(50..300)))),
        20..25 => Some(Fault::DelayAfter(ms(rng.random_range(50..300)))),
        _ => None,
    }
}

/// A journal's deadline is 1 s after the tool's 400 ms timeout: 200–500 ms
/// is within it, 1.8 s beyond it whenever the tool answered.
fn tool_complete_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..12 => Some(Fault::LoseAnswer),
        12..22 => Some(Fault::DelayBefore(ms(rng.random_range(200..500)))),
        22..28 => Some(Fault::DelayBefore(ms(1800))),
        28..34 => Some(Fault::DelayAfter(ms(1800))),
        34..38 => Some(Fault::refuse_journal()),
        _ => None,
    }
}

fn tool_release_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..15 => Some(Fault::LoseAnswer),
        15..25 => Some(Fault::DelayBefore(ms(rng.random_range(100..400)))),
        _ => None,
    }
}

/// What the attempts of one key saw.
#[derive(Default)]
struct Seen {
    executed: Vec<ToolResult>,
    replayed: Vec<ToolResult>,
}

type Guard = ToolGuard<Faulty<PostgrestRepository>>;

/// Everything one orchestrator step needs, owned.
#[derive(Clone)]
struct Step {
    guard: Guard,
    spec: ToolSpec,
    vendor: Arc<Vendor>,
    db: PgPool,
    org: Uuid,
    seed: u64,
    tally: Tally,
}

/// How often each ending of a try was seen, for the log.
#[derive(Clone, Default)]
struct Tally(Arc<Mutex<std::collections::BTreeMap<&'static str, usize>>>);

impl Tally {
    fn add(&self, what: &'static str) {
        *self.0.lock().unwrap().entry(what).or_default() += 1;
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0.lock().unwrap())
    }
}

/// A retryable failure's name, for the tally.
fn ending(error: &ToolError) -> &'static str {
    match error {
        ToolError::ClaimInFlight { .. } => "in_flight",
        ToolError::TimedOut { .. } => "timed_out",
        ToolError::Panicked { .. } => "panicked",
        ToolError::NotJournaled { .. } => "not_journaled",
        ToolError::Plane(_) => "plane",
        _ => "other",
    }
}

impl Step {
    /// Runs the step for key `n`, retrying it the way an orchestrator
    /// would, until it has an answer or `STEP_TRIES` ran out; `chaos`
    /// draws what each try does, else every try is normal.
    async fn run(self, n: usize, key: ToolKey, kind: ToolKind, attempt: usize, chaos: bool, seen: Arc<Mutex<Seen>>) {
        let arguments = json!({"to": format!("user-{n}@example.com")});
        let mut waits = rng(self.seed, &[0x57E9, n as u64, attempt as u64]);
        for try_number in 0..STEP_TRIES {
            let mut draw = rng(self.seed, &[0x7001, n as u64, attempt as u64, try_number as u64]);
            let behaviour = if chaos { tool_try(&mut draw) } else { ToolTry::Normal };
            let vendor = self.vendor.clone();
            let tool = move |call: ToolCall| async move {
                match behaviour {
                    ToolTry::Normal => vendor.send(n, kind, &call),
                    ToolTry::RateLimited => ToolResult::retryable_failure("rate_limited", json!({})),
                    ToolTry::StallBefore => {
                        tokio::time::sleep(TOOL_TIMEOUT * 3).await;
                        vendor.send(n, kind, &call)
                    }
                    ToolTry::StallAfter => {
                        let sent = vendor.send(n, kind, &call);
                        tokio::time::sleep(TOOL_TIMEOUT * 3).await;
                        sent
                    }
                    ToolTry::PanicAfter => {
                        vendor.send(n, kind, &call);
                        panic!("the worker dies after the vendor answered (this test expects it)");
                    }
                }
            };
            let ran =
                self.guard.run(self.org, &self.spec, &key, &arguments, || async { Checkpoint::Allow }, tool).await;
            match ran {
                Ok(ToolRun::Executed(result)) if result.retryable => self.tally.add("retryable"),
                Ok(ToolRun::Executed(result)) => {
                    self.tally.add("executed");
                    return seen.lock().unwrap().executed.push(result);
                }
                Ok(ToolRun::Replayed(result)) => {
                    self.tally.add("replayed");
                    return seen.lock().unwrap().replayed.push(result);
                }
                Ok(other) => panic!("seed {}: key {n}: a VendorKey tool never ends {other:?}", self.seed),
                Err(ToolError::ClaimInFlight { .. }) if waits.random_bool(0.5) => {
                    // The holder is taken for stalled: its lease passes.
                    self.tally.add("in_flight, lease passed");
                    pass_lease_of(&self.db, self.org, TOOL_SCOPE, key.as_str()).await;
                }
                Err(error) if error.is_retryable() => {
                    self.tally.add(ending(&error));
                    tokio::time::sleep(ms(waits.random_range(10..120))).await;
                }
                Err(error) => panic!("seed {}: key {n}: the step failed for good: {error}", self.seed),
            }
        }
    }
}

/// Many attempts of the tool guard over a store with faults: per key, at
/// most one message at the vendor (a key whose journal is a success has
/// exactly that one), every replay equals the journaled answer, and every
/// answer a step executed is the one journaled (or what the journal keeps
/// in its place).
#[tokio::test]
async fn randomized_tool_calls_make_at_most_one_vendor_effect_per_key_and_replay_the_journal() {
    let seed = seed("tool calls");
    let stack = stack().await;
    let faulty = Faulty::new(PostgrestRepository::new(client(&stack)));
    let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(600));
    let guard = ToolGuard::new(IdempotencyService::new(faulty.clone()), horizon)
        .with_journal_deadline(ms(1000))
        .and_then(|guard| guard.with_lease_margin(ms(1000)))
        .expect("a guard");
    let spec = ToolSpec::new(TOOL_SCOPE, TOOL_TIMEOUT, RepeatSafety::VendorKey).expect("a spec");
    let step = Step {
        guard,
        spec,
        vendor: Arc::default(),
        db: stack.db().clone(),
        org: Uuid::new_v4(),
        seed,
        tally: Tally::default(),
    };

    let keys: Vec<ToolKey> = (0..TOOL_KEYS).map(|n| ToolKey::for_step(Uuid::new_v4(), &format!("send-{n}"))).collect();
    let kinds: Vec<ToolKind> = (0..TOOL_KEYS)
        .map(|n| match rng(seed, &[0x5EED, n as u64]).random_range(0..10) {
            0..5 => ToolKind::Small,
            5..7 => ToolKind::Large,
            7..9 => ToolKind::Failure,
            _ => ToolKind::LargeFailure,
        })
        .collect();
    let names: Vec<String> = keys.iter().map(|key| key.as_str().to_owned()).collect();
    let aimed = KeyedFaults::new(seed, &names);
    aimed.aim(&faulty, Op::Claim, tool_claim_fault);
    aimed.aim(&faulty, Op::Complete, tool_complete_fault);
    aimed.aim(&faulty, Op::Release, tool_release_fault);

    let seen: Vec<Arc<Mutex<Seen>>> = (0..TOOL_KEYS).map(|_| Arc::default()).collect();
    let mut attempts = Vec::new();
    for n in 0..TOOL_KEYS {
        for attempt in 0..TOOL_ATTEMPTS {
            let start = ms(rng(seed, &[0x57A7, n as u64, attempt as u64]).random_range(0..400));
            let (step, key, kind, seen) = (step.clone(), keys[n].clone(), kinds[n], seen[n].clone());
            attempts.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                step.run(n, key, kind, attempt, true, seen).await;
            }));
        }
    }
    for attempt in attempts {
        attempt.await.expect("an attempt panicked outside the tool");
    }

    // The faults stop; one more attempt per key, until it has an answer.
    faulty.clear_all();
    for n in 0..TOOL_KEYS {
        step.clone().run(n, keys[n].clone(), kinds[n], TOOL_ATTEMPTS, false, seen[n].clone()).await;
    }
    println!(
        "tool calls: {} vendor calls; tries {}; faults injected: claim {}, complete {}, release {}",
        step.vendor.calls.load(Ordering::SeqCst),
        step.tally,
        faulty.injected(Op::Claim),
        faulty.injected(Op::Complete),
        faulty.injected(Op::Release)
    );
    assert!(faulty.injected(Op::Claim) + faulty.injected(Op::Complete) > 0, "seed {seed}: no fault was injected");

    let service = IdempotencyService::new(PostgrestRepository::new(client(&stack)));
    for n in 0..TOOL_KEYS {
        let context = format!("seed {seed}, key {n} ({:?})", kinds[n]);
        let arguments = json!({"to": format!("user-{n}@example.com")});
        let read = service.read(step.org, TOOL_SCOPE, keys[n].as_str(), &RequestHash::of_json(&arguments)).await;
        let journal = match read {
            Ok(ReadOutcome::Completed { response, resource, response_ref }) => {
                Answer::from_stored(response, resource, response_ref)
            }
            other => panic!("{context}: the final attempt left no journal: {other:?}"),
        };
        let messages = step.vendor.messages_for(n);
        assert!(messages.len() <= 1, "{context}: {} messages at the vendor: {messages:?}", messages.len());
        match kinds[n] {
            ToolKind::Small | ToolKind::Large => {
                assert!(journal.ok, "{context}: journaled {journal:?}");
                let message = journal.resource.as_ref().map(|r| r.resource_id.clone());
                assert_eq!(message.as_ref(), messages.first(), "{context}: the journal names the one message");
            }
            ToolKind::Failure | ToolKind::LargeFailure => {
                assert!(!journal.ok && journal.resource.is_none(), "{context}: journaled {journal:?}");
                assert!(messages.is_empty(), "{context}: a business failure made a message");
            }
        }
        let seen = seen[n].lock().unwrap();
        assert!(!seen.executed.is_empty() || !seen.replayed.is_empty(), "{context}: no attempt got an answer");
        for replay in &seen.replayed {
            let replayed = (replay.ok, &replay.error, &replay.output, &replay.resource);
            assert_eq!(replayed, (journal.ok, &journal.error, &journal.output, &journal.resource), "{context}");
        }
        for executed in &seen.executed {
            assert_eq!((executed.ok, &executed.resource), (journal.ok, &journal.resource), "{context}: {executed:?}");
            let error_kept = match (&executed.error, &journal.error) {
                (Some(error), Some(kept)) => error.starts_with(kept.as_str()) && !kept.is_empty(),
                (error, kept) => error == kept,
            };
            assert!(error_kept, "{context}: executed {:?}, journaled {:?}", executed.error, journal.error);
            assert!(stands_for(&journal.output, &executed.output), "{context}: journaled {}", journal.output);
        }
    }
    stack.stop().await.unwrap();
}

// ---------------------------------------------------------------------------
// The webhook gate
// ---------------------------------------------------------------------------

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
    matches!(ack, Ack::Dropped(DropReason::ProcessingFailed | DropReason::ProcessingAborted))
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
    let rows = match tokio::time::timeout(WAIT, rows).await {
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
        "webhook deliveries: faults injected: claim {}, complete {}; drops: duplicate {}, failed {}, aborted {}",
        faulty.injected(Op::Claim),
        faulty.injected(Op::Complete),
        gate.drops().get(DropReason::Duplicate),
        gate.drops().get(DropReason::ProcessingFailed),
        gate.drops().get(DropReason::ProcessingAborted),
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
            flaky if flaky == format!("flaky:{n}") => matches!(event.kind, EventKind::Flaky(_)),
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
    let counted = || gate.drops().get(DropReason::ProcessingFailed) + gate.drops().get(DropReason::ProcessingAborted);
    let settled = async {
        while counted() < gate_failures {
            tokio::time::sleep(ms(20)).await;
        }
    };
    let _ = tokio::time::timeout(WAIT, settled).await;
    assert_eq!(counted(), gate_failures, "seed {seed}: one drop reason counted per failure the gate journaled");
    stack.stop().await.unwrap();
}

// ---------------------------------------------------------------------------
// The saved-search start
// ---------------------------------------------------------------------------

const SEARCH_SCOPE: &str = SAVED_SEARCH_START_SCOPE;
const TRIGGERS: usize = 8;
/// Concurrent starts of one trigger: scheduler chains, each retrying.
const STARTS: usize = 4;
/// How many times one chain starts its trigger at most.
const START_TRIES: usize = 40;
/// The preparation's lease: the freeze is cut at 1.5 s, the journal at
/// 2.5 s, both counted from before the claim; 0.5 s of margin.
const SEARCH_LEASE: Duration = ms(3000);
const FREEZE_TIMEOUT: Duration = ms(1500);

tokio::task_local! {
    /// The start (one call of `SavedSearchStart::start`) this task runs:
    /// the freeze and the admissions it makes are counted as its own.
    static START: u64;
}

/// One start's identity: its trigger, its chain and its try.
fn start_id(trigger: usize, chain: usize, try_number: usize) -> u64 {
    (trigger as u64) << 32 | (chain as u64) << 16 | try_number as u64
}

/// The claim key `SavedSearchStart::start` derives for trigger `n`.
fn start_key(n: usize) -> String {
    let search = search_id(n);
    format!("{}:{search}:tick-{n}", search.len())
}

fn search_id(n: usize) -> String {
    format!("search-{n}")
}

/// How large a trigger's snapshots are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SnapshotSize {
    /// Within the 64 KiB a claim keeps: journaled inline.
    Small,
    /// Above it: kept as the Run's input, referenced from the claim.
    Large,
    /// Either, from one freeze to the next.
    Mixed,
}

/// What one freeze does, drawn per start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FreezeTry {
    /// Reads the tables and answers.
    Normal,
    /// The tables cannot be read: the claim is released.
    Fails,
    /// Stalls past the freeze's timeout: cut, the claim released.
    Stalls,
    /// Stalls past the lease, by the database's clock (moved in SQL): the
    /// freeze answers after another start reclaimed, or after 800 ms.
    LeasePasses,
}

fn freeze_try(rng: &mut StdRng) -> FreezeTry {
    match rng.random_range(0..100) {
        0..10 => FreezeTry::Fails,
        10..16 => FreezeTry::Stalls,
        16..30 => FreezeTry::LeasePasses,
        _ => FreezeTry::Normal,
    }
}

/// Mutable product tables: every freeze reads a newer version (numbered
/// across all triggers), so the freeze whose snapshot was stored can be
/// told, and which start froze it.
#[derive(Clone)]
struct Tables(Arc<TablesState>);

struct TablesState {
    seed: u64,
    db: PgPool,
    sizes: Vec<SnapshotSize>,
    chaos: std::sync::atomic::AtomicBool,
    versions: AtomicUsize,
    /// Which start froze each version.
    frozen: Mutex<HashMap<u64, u64>>,
    story: Story,
}

impl Tables {
    /// The start that froze `snapshot`.
    fn frozen_by(&self, snapshot: &Value) -> Option<u64> {
        let version = snapshot["version"].as_u64()?;
        self.0.frozen.lock().unwrap().get(&version).copied()
    }

    fn freezes(&self) -> usize {
        self.0.versions.load(Ordering::SeqCst)
    }
}

impl SnapshotSource for Tables {
    async fn freeze(&self, organization_id: Uuid, saved_search_id: &str) -> Result<Value, SnapshotError> {
        let tables = &self.0;
        let start = START.try_with(|start| *start).expect("a freeze inside a start");
        let n: usize = saved_search_id.strip_prefix("search-").and_then(|n| n.parse().ok()).expect("a search id");
        let mut draw = rng(tables.seed, &[0xF2EE, start]);
        let behaviour = if tables.chaos.load(Ordering::SeqCst) { freeze_try(&mut draw) } else { FreezeTry::Normal };
        let version = tables.versions.fetch_add(1, Ordering::SeqCst) as u64 + 1;
        match behaviour {
            FreezeTry::Normal => tokio::time::sleep(ms(draw.random_range(5..60))).await,
            FreezeTry::Fails => {
                tables.story.tell("freeze failed");
                return Err(SnapshotError(format!("the tables of {saved_search_id} are locked")));
            }
            FreezeTry::Stalls => {
                tables.story.tell("freeze stalls past its timeout");
                tokio::time::sleep(FREEZE_TIMEOUT * 2).await;
            }
            FreezeTry::LeasePasses => {
                let key = start_key(n);
                let held = holder(&tables.db, organization_id, &key).await;
                pass_lease_of(&tables.db, organization_id, SEARCH_SCOPE, &key).await;
                let reclaimed = async {
                    while holder(&tables.db, organization_id, &key).await == held {
                        tokio::time::sleep(ms(20)).await;
                    }
                };
                let _ = tokio::time::timeout(ms(800), reclaimed).await;
            }
        }
        let large = match tables.sizes[n] {
            SnapshotSize::Small => false,
            SnapshotSize::Large => true,
            SnapshotSize::Mixed => draw.random_bool(0.5),
        };
        let mut snapshot = json!({
            "organization_id": organization_id,
            "saved_search_id": saved_search_id,
            "version": version,
            "brief": format!("brief v{version}"),
            "baseline": [version, n],
        });
        if large {
            snapshot["rows"] = json!("r".repeat(draw.random_range(70..140) * 1024));
        }
        tables.frozen.lock().unwrap().insert(version, start);
        tables.story.tell(format!("froze v{version} ({behaviour:?}{})", if large { ", large" } else { "" }));
        Ok(snapshot)
    }
}

/// What happened to each start, in order, for the message of a failed
/// check: its freeze, the faults its calls met, its admissions, its ending.
#[derive(Clone, Default)]
struct Story(Arc<Mutex<Vec<(u64, String)>>>);

impl Story {
    /// Tells `what` of the start running in this task, if any.
    fn tell(&self, what: impl Into<String>) {
        if let Ok(start) = START.try_with(|start| *start) {
            self.tell_of(start, what);
        }
    }

    fn tell_of(&self, start: u64, what: impl Into<String>) {
        self.0.lock().unwrap().push((start, what.into()));
    }

    /// Trigger `n`'s story, one line per event.
    fn of(&self, n: usize) -> String {
        let events = self.0.lock().unwrap();
        let lines = events.iter().filter(|(start, _)| (start >> 32) as usize == n);
        lines.map(|(start, what)| format!("  start {start:#x}: {what}")).collect::<Vec<_>>().join("\n")
    }
}

/// The lease token and status of `key`'s claim, if there is one.
async fn holder(db: &PgPool, org: Uuid, key: &str) -> Option<(Uuid, String)> {
    sqlx::query_as(
        "select lease_token, status from agent.idempotency_keys
          where organization_id = $1 and scope = $2 and key = $3",
    )
    .bind(org)
    .bind(SEARCH_SCOPE)
    .bind(key)
    .fetch_optional(db)
    .await
    .expect("read the claim")
}

/// Run admission whose answers are sometimes lost after the Run was
/// admitted (or the fence refused), drawn per start (a start admits once at
/// most); records, per start, the admissions that answered a Run.
#[derive(Clone)]
struct LossyRuns {
    inner: PostgrestRepository,
    seed: u64,
    chaos: Arc<std::sync::atomic::AtomicBool>,
    lost: Arc<AtomicUsize>,
    answered: Arc<Mutex<Vec<(u64, Uuid)>>>,
    story: Story,
}

impl LossyRuns {
    /// Whether this admission's answer is lost: 12% while the chaos lasts.
    fn loses(&self) -> bool {
        let start = START.try_with(|start| *start).expect("an admission inside a start");
        self.chaos.load(Ordering::SeqCst) && rng(self.seed, &[0xAD17, start]).random_range(0..100) < 12
    }

    fn answer<T>(
        &self,
        call: &str,
        answered: Result<T, Error>,
        lose: bool,
        run: impl Fn(&T) -> Option<(Uuid, Value)>,
    ) -> Result<T, Error> {
        let answered = answered.inspect_err(|error| self.story.tell(format!("{call} failed: {error}")))?;
        let version = |answered: &T| run(answered).map(|(_, input)| input["version"].clone());
        self.story.tell(format!(
            "{call} answered Run v{:?}{}",
            version(&answered),
            if lose { ", answer lost" } else { "" }
        ));
        if lose {
            self.lost.fetch_add(1, Ordering::SeqCst);
            return Err(Error::Store(ClientError::DeadlineExceeded {
                function: "run_admit",
                deadline: ms(0),
                elapsed: ms(0),
                attempts: 1,
                in_flight: true,
                last_error: None,
            }));
        }
        if let (Some((id, _)), Ok(start)) = (run(&answered), START.try_with(|start| *start)) {
            self.answered.lock().unwrap().push((start, id));
        }
        Ok(answered)
    }
}

impl RunRepository for LossyRuns {
    async fn admit(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &Value,
        admission_token: Uuid,
    ) -> Result<AdmittedRun, Error> {
        let lose = self.loses();
        let admitted = self.inner.admit(organization_id, start_key, input, admission_token).await;
        self.answer("admit", admitted, lose, |run| Some((run.id, run.input.clone())))
    }

    async fn admit_fenced(
        &self,
        organization_id: Uuid,
        start_key: &str,
        input: &Value,
        admission_token: Uuid,
        fence: ClaimFence,
    ) -> Result<Option<AdmittedRun>, Error> {
        let lose = self.loses();
        let admitted = self.inner.admit_fenced(organization_id, start_key, input, admission_token, fence).await;
        self.answer("admit_fenced", admitted, lose, |run| run.as_ref().map(|run| (run.id, run.input.clone())))
    }

    async fn find(
        &self,
        organization_id: Uuid,
        start_key: &str,
        admission_token: Option<Uuid>,
    ) -> Result<Option<AdmittedRun>, Error> {
        self.inner.find(organization_id, start_key, admission_token).await
    }
}

fn search_claim_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..10 => Some(Fault::LoseAnswer),
        10..20 => Some(Fault::DelayBefore(ms(rng.random_range(50..300)))),
        20..25 => Some(Fault::DelayAfter(ms(rng.random_range(50..300)))),
        _ => None,
    }
}

/// The journal's deadline is 2.5 s after the claim was asked for: 100–400
/// ms is within it (a freeze that answers takes at most 1.5 s), 3 s beyond
/// it, before the write (it never lands) or after it (it landed, unheard).
fn search_complete_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..20 => Some(Fault::LoseAnswer),
        20..35 => Some(Fault::DelayBefore(ms(rng.random_range(100..400)))),
        35..43 => Some(Fault::DelayBefore(ms(3000))),
        43..50 => Some(Fault::DelayAfter(ms(3000))),
        50..58 => Some(Fault::refuse_journal()),
        _ => None,
    }
}

fn search_release_fault(rng: &mut StdRng, _: &str) -> Option<Fault> {
    match rng.random_range(0..100) {
        0..15 => Some(Fault::LoseAnswer),
        15..25 => Some(Fault::DelayBefore(ms(rng.random_range(100..400)))),
        _ => None,
    }
}

type Starter = SavedSearchStart<Faulty<PostgrestRepository>, Tables, LossyRuns>;

/// What the starts of one trigger saw.
#[derive(Default)]
struct Starts {
    started: Vec<(u64, StartedRun)>,
    fence_lost: Vec<u64>,
}

/// Everything one scheduler chain needs, owned.
#[derive(Clone)]
struct Scheduler {
    starter: Arc<Starter>,
    db: PgPool,
    org: Uuid,
    seed: u64,
    tally: Tally,
    story: Story,
}

/// A start's ending, for the tally.
fn start_ending(error: &SavedSearchError) -> &'static str {
    match error {
        SavedSearchError::InProgress { .. } => "in_progress",
        SavedSearchError::FenceLost { .. } => "fence_lost",
        SavedSearchError::Snapshot(_) => "snapshot_failed",
        SavedSearchError::NotJournaled { .. } => "not_journaled",
        SavedSearchError::Plane(_) => "plane",
        _ => "other",
    }
}

impl Scheduler {
    /// Chain `chain` of trigger `n`: starts it again after every retryable
    /// ending, until a Run is answered or `START_TRIES` ran out. A start
    /// told the trigger is in progress sometimes takes its holder for
    /// stalled: its lease passes.
    async fn run(self, n: usize, chain: usize, seen: Arc<Mutex<Starts>>) {
        let mut waits = rng(self.seed, &[0x5C4E, n as u64, chain as u64]);
        for try_number in 0..START_TRIES {
            let id = start_id(n, chain, try_number);
            let started = START.scope(id, self.starter.start(self.org, &search_id(n), &format!("tick-{n}"))).await;
            match &started {
                Ok(run) => self
                    .story
                    .tell_of(id, format!("answered v{} (replayed: {})", run.snapshot["version"], run.replayed)),
                Err(error) => self.story.tell_of(id, format!("ended {error}")),
            }
            match started {
                Ok(started) => {
                    self.tally.add(if started.replayed { "replayed" } else { "admitted" });
                    return seen.lock().unwrap().started.push((id, started));
                }
                Err(SavedSearchError::InProgress { .. }) if waits.random_bool(0.4) => {
                    self.tally.add("in_progress, lease passed");
                    self.story.tell_of(id, "passes the holder's lease");
                    pass_lease_of(&self.db, self.org, SEARCH_SCOPE, &start_key(n)).await;
                }
                Err(error) if error.is_retryable() => {
                    self.tally.add(start_ending(&error));
                    if matches!(error, SavedSearchError::FenceLost { .. }) {
                        seen.lock().unwrap().fence_lost.push(id);
                    }
                    tokio::time::sleep(ms(waits.random_range(10..150))).await;
                }
                Err(error) => panic!("seed {}: trigger {n}: the start failed for good: {error:?}", self.seed),
            }
        }
    }
}

/// Several concurrent starts of each of several triggers, over a store
/// whose answers are lost, slow or refused, Run admissions whose answers
/// are lost, and freezes that fail, stall past their timeout or past the
/// lease, with small and large snapshots that change from one freeze to
/// the next. Per trigger: one Run under its key; every start answered
/// carries that Run and its input, replays included; a start answered
/// `replayed = false` froze that input itself; a start whose fence was lost
/// neither froze that input nor was answered a Run by an admission; and
/// the completed claim journals that input, inline or by reference to the
/// Run. A trigger whose claim journals another freeze is reported instead
/// of failed only where its story shows the known gap (a claim released
/// after a fenced admission answered a Run; see
/// `a_reclaimed_preparation_whose_freeze_fails_releases_a_claim_whose_run_exists`):
/// once `src` closes it, drop that arm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_saved_search_starts_admit_one_run_per_trigger_from_one_frozen_snapshot() {
    let seed = seed("saved-search starts");
    let stack = stack().await;
    let org = Uuid::new_v4();
    let faulty = Faulty::new(PostgrestRepository::new(client(&stack)));
    let story = Story::default();
    let sizes: Vec<SnapshotSize> = (0..TRIGGERS)
        .map(|n| match rng(seed, &[0x517E, n as u64]).random_range(0..3) {
            0 => SnapshotSize::Small,
            1 => SnapshotSize::Large,
            _ => SnapshotSize::Mixed,
        })
        .collect();
    let tables = Tables(Arc::new(TablesState {
        seed,
        db: stack.db().clone(),
        sizes: sizes.clone(),
        chaos: true.into(),
        versions: AtomicUsize::new(0),
        frozen: Mutex::default(),
        story: story.clone(),
    }));
    let keys: Vec<String> = (0..TRIGGERS).map(start_key).collect();
    let runs = LossyRuns {
        inner: PostgrestRepository::new(client(&stack)),
        seed,
        chaos: Arc::new(true.into()),
        lost: Arc::default(),
        answered: Arc::default(),
        story: story.clone(),
    };
    let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(60));
    let starter = SavedSearchStart::new(
        IdempotencyService::new(faulty.clone()),
        RunAdmission::new(runs.clone()),
        tables.clone(),
        horizon,
    )
    .and_then(|starter| starter.with_lease(SEARCH_LEASE))
    .expect("a starter");
    let aimed = KeyedFaults::new(seed, &keys);
    for (op, choose) in [
        (Op::Claim, search_claim_fault as fn(&mut StdRng, &str) -> Option<Fault>),
        (Op::Complete, search_complete_fault),
        (Op::Release, search_release_fault),
    ] {
        let (generators, story) = (aimed.generators.clone(), story.clone());
        faulty.choose_with(op, move |call: &Call<'_>| {
            let key = call.key?;
            let fault = choose(generators.lock().unwrap().get_mut(key)?, key);
            story.tell(format!("{} meets {fault:?}", op.function()));
            fault
        });
    }
    let scheduler = Scheduler {
        starter: Arc::new(starter),
        db: stack.db().clone(),
        org,
        seed,
        tally: Tally::default(),
        story: story.clone(),
    };

    let seen: Vec<Arc<Mutex<Starts>>> = (0..TRIGGERS).map(|_| Arc::default()).collect();
    let mut chains = Vec::new();
    for (n, seen) in seen.iter().enumerate() {
        for chain in 0..STARTS {
            let start = ms(rng(seed, &[0x57A7, n as u64, chain as u64]).random_range(0..600));
            let (scheduler, seen) = (scheduler.clone(), seen.clone());
            chains.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                scheduler.run(n, chain, seen).await;
            }));
        }
    }
    for chain in chains {
        chain.await.expect("a start panicked");
    }

    // The faults stop; one more chain per trigger, until it has a Run.
    faulty.clear_all();
    tables.0.chaos.store(false, Ordering::SeqCst);
    runs.chaos.store(false, Ordering::SeqCst);
    for (n, seen) in seen.iter().enumerate() {
        scheduler.clone().run(n, STARTS, seen.clone()).await;
    }
    println!(
        "saved-search starts: {} freezes; starts {}; faults injected: claim {}, complete {}, release {}, admission answers lost {}",
        tables.freezes(),
        scheduler.tally,
        faulty.injected(Op::Claim),
        faulty.injected(Op::Complete),
        faulty.injected(Op::Release),
        runs.lost.load(Ordering::SeqCst),
    );

    let rows: Vec<(Uuid, String, Value)> =
        sqlx::query_as("select id, start_key, input from agent.runs where organization_id = $1")
            .bind(org)
            .fetch_all(stack.db())
            .await
            .expect("read the Runs");
    assert_eq!(rows.len(), TRIGGERS, "seed {seed}: one Run per trigger, none under another key: {rows:?}");
    let answered = runs.answered.lock().unwrap().clone();
    for (n, seen) in seen.iter().enumerate() {
        let context = format!("seed {seed}, trigger {n} ({:?}); its starts:\n{}\n", sizes[n], story.of(n));
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        let (_, last) = seen.started.last().unwrap_or_else(|| panic!("{context}: no start was answered a Run"));
        let run_key = last.run.start_key.clone();
        let under_key: Vec<_> = rows.iter().filter(|(_, key, _)| *key == run_key).collect();
        assert_eq!(under_key.len(), 1, "{context}: Runs under {run_key}: {under_key:?}");
        let (run_id, _, input) = under_key[0].clone();
        let froze_it = tables.frozen_by(&input).unwrap_or_else(|| panic!("{context}: no freeze made {input}"));
        assert_eq!(input["saved_search_id"], json!(search_id(n)), "{context}: another trigger's snapshot");
        for (start, started) in &seen.started {
            let what = format!("{context}, start {start:#x}");
            assert_eq!((started.run.id, &started.run.start_key), (run_id, &run_key), "{what}");
            assert_eq!(started.snapshot, input, "{what}: answered another snapshot than the Run's input");
            assert_eq!(started.run.input, input, "{what}");
            assert!(started.run.admitted, "{what}: a start of the trigger is its Run's admitter");
            if !started.replayed {
                assert_eq!(
                    *start, froze_it,
                    "{what}: answered replayed = false, yet the Run holds the freeze of start {froze_it:#x}"
                );
            }
        }
        for start in &seen.fence_lost {
            let what = format!("{context}, start {start:#x}, whose fence was lost");
            assert_ne!(*start, froze_it, "{what}: its snapshot is the Run's input");
            let admitted: Vec<_> = answered.iter().filter(|(by, _)| by == start).collect();
            assert!(admitted.is_empty(), "{what}: an admission answered it a Run: {admitted:?}");
        }

        let (status, response, resource_type, resource_id): (String, Option<Value>, Option<String>, Option<String>) =
            sqlx::query_as(
                "select status, response, resource_type, resource_id from agent.idempotency_keys
                  where organization_id = $1 and scope = $2 and key = $3",
            )
            .bind(org)
            .bind(SEARCH_SCOPE)
            .bind(start_key(n))
            .fetch_one(stack.db())
            .await
            .unwrap_or_else(|error| panic!("{context}: the claim: {error}"));
        assert_eq!(status, "completed", "{context}");
        let response = response.unwrap_or_else(|| panic!("{context}: a completed claim without a response"));
        let prepared = json!({"run_key": run_key, "snapshot": input});
        let output = &response["output"];
        match output.get("$response_ref") {
            Some(reference) => {
                let (size, sha256) = digest(&prepared);
                let expected = json!({"resource_type": SNAPSHOT_RESOURCE_TYPE, "resource_id": run_id, "size": size, "sha256": sha256});
                assert_eq!(reference, &expected, "{context}: the claim references another snapshot or Run");
                let resource = (resource_type.as_deref(), resource_id);
                assert_eq!(resource, (Some(SNAPSHOT_RESOURCE_TYPE), Some(run_id.to_string())), "{context}");
            }
            None => {
                let journaled = output["snapshot"]["version"].clone();
                assert!(
                    output == &prepared,
                    "{context}: the claim journals snapshot version {journaled}, the Run holds version {} (frozen by start {froze_it:#x})",
                    input["version"]
                );
            }
        }
    }
    stack.stop().await.unwrap();
}

/// A source for the known gap's test: answers `version` (padded above the
/// claim's limit when `large`), or fails.
struct Version {
    version: u64,
    large: bool,
    fails: bool,
}

impl SnapshotSource for Version {
    async fn freeze(&self, _: Uuid, saved_search_id: &str) -> Result<Value, SnapshotError> {
        if self.fails {
            return Err(SnapshotError(format!("the tables of {saved_search_id} are locked")));
        }
        let mut snapshot = json!({"saved_search_id": saved_search_id, "version": self.version});
        if self.large {
            snapshot["rows"] = json!("r".repeat(100 * 1024));
        }
        Ok(snapshot)
    }
}

/// Found by the randomized start test: a reclaimed preparation whose
/// earlier holder admitted a Run under the claim and died before its
/// journal landed journals that Run's input, and freezes nothing (here its
/// source would fail). Before, it froze, failed, released the claim, and
/// the next start journaled a snapshot no Run was started from.
#[tokio::test]
async fn a_reclaimed_preparation_journals_the_run_an_earlier_holder_admitted_instead_of_freezing_again() {
    let stack = stack().await;
    let org = Uuid::new_v4();
    let faulty = Faulty::new(PostgrestRepository::new(client(&stack)));
    let horizon = RetryHorizon::until_last_attempt(Duration::from_secs(60));
    let starter = |source: Version| {
        SavedSearchStart::new(
            IdempotencyService::new(faulty.clone()),
            RunAdmission::new(PostgrestRepository::new(client(&stack))),
            source,
            horizon,
        )
        .and_then(|starter| starter.with_lease(SEARCH_LEASE))
        .expect("a starter")
    };
    // A freezes a large snapshot, admits its Run under the claim's fence,
    // and dies before its journal lands.
    faulty.once(Op::Complete, Fault::DelayBefore(Duration::from_secs(60)));
    let a = {
        let starter = starter(Version { version: 1, large: true, fails: false });
        tokio::spawn(async move { starter.start(org, "search-gap", "tick-1").await })
    };
    let admitted = async {
        while crate::support::harness::count_runs(&stack).await == 0 {
            tokio::time::sleep(ms(10)).await;
        }
    };
    crate::support::harness::within(WAIT, "A admits its Run", admitted).await;
    a.abort();
    let _ = a.await;
    faulty.clear_all();
    let key = "10:search-gap:tick-1";
    assert_eq!(holder(stack.db(), org, key).await.map(|(_, status)| status).as_deref(), Some("processing"));

    // Its lease passes; B reclaims: it finds A's Run and journals it, and
    // never calls its source (which would fail).
    pass_lease_of(stack.db(), org, SEARCH_SCOPE, key).await;
    let b = starter(Version { version: 2, large: false, fails: true }).start(org, "search-gap", "tick-1").await;
    let b = b.expect("B answers A's Run");
    assert_eq!(b.snapshot["version"], json!(1), "the Run A admitted wins");

    // C starts the trigger: it answers A's Run, and its claim must say so.
    let c = starter(Version { version: 3, large: false, fails: false }).start(org, "search-gap", "tick-1").await;
    let c = c.expect("C answers the Run");
    assert_eq!(c.snapshot["version"], json!(1), "the Run A admitted wins");
    let (response,): (Value,) = sqlx::query_as(
        "select response from agent.idempotency_keys where organization_id = $1 and scope = $2 and key = $3",
    )
    .bind(org)
    .bind(SEARCH_SCOPE)
    .bind(key)
    .fetch_one(stack.db())
    .await
    .expect("C's claim");
    let output = &response["output"];
    let journaled = match output.get("$response_ref") {
        Some(reference) if reference["resource_id"] == json!(c.run.id) => json!(1),
        Some(reference) => panic!("the claim references another Run: {reference}"),
        None => output["snapshot"]["version"].clone(),
    };
    assert_eq!(journaled, json!(1), "the claim journals snapshot v{journaled}, the Run holds v1: {output}");
    stack.stop().await.unwrap();
}

// ---------------------------------------------------------------------------
// The Idempotency-Key layer
// ---------------------------------------------------------------------------

const HTTP_KEYS: usize = 10;
const CALLERS: [&str; 2] = ["alice", "bob"];
const REPLICAS: usize = 2;
/// How long the fault schedule runs.
const HTTP_CHAOS: Duration = ms(4000);
/// How many times one client sends its request at most.
const CLIENT_TRIES: usize = 60;
/// The handler's timeout, counted from before the claim; with the 1 s
/// journal deadline and a 0.5 s margin, a 3 s lease. A claim answered late
/// leaves the handler less of it: the handler pauses (at most 40 ms) before
/// its effect and makes the effect and its answer in one poll, so a cut
/// never falls between them (one before the effect is a 504, and the retry
/// runs cleanly).
const HANDLER_TIMEOUT: Duration = ms(1500);
/// The plane client's deadline: a claim answer later than this is a 503.
const CLIENT_DEADLINE: Duration = ms(1200);

/// The API's effects, one per handler run that reached it: who it was for.
#[derive(Clone)]
struct Shop {
    seed: u64,
    runs: Arc<AtomicUsize>,
    effects: Arc<Mutex<Vec<(String, String)>>>,
}

impl Shop {
    fn effects_for(&self, caller: &str, key: &str) -> Vec<usize> {
        let effects = self.effects.lock().unwrap();
        let made = effects.iter().enumerate().filter(|(_, (c, k))| c == caller && k == key);
        made.map(|(effect, _)| effect).collect()
    }
}

/// `POST /orders`: pauses a little, then makes one counted effect for the
/// (caller, key) and answers a body naming it: 201 with the order, or, when
/// the order asks for it, 403, a business refusal the layer journals too.
/// Never a 5xx, a 429 or a panic: no answer of its own is one the layer
/// releases, so a second effect for one (caller, key) is never legitimate.
async fn place_order(
    axum::extract::State(shop): axum::extract::State<Shop>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let (caller, key) = (header("x-user"), header("idempotency-key"));
    let run = shop.runs.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(ms(rng(shop.seed, &[0x5409, run as u64]).random_range(0..40))).await;
    let order: Value = serde_json::from_slice(&body).expect("the clients send JSON");
    // The effect and the answer, with no await between them.
    let effect = {
        let mut effects = shop.effects.lock().unwrap();
        effects.push((caller.clone(), key.clone()));
        effects.len() - 1
    };
    let (status, answer) = if order["decline"] == json!(true) {
        (403, json!({"error": "declined", "effect": effect, "caller": caller, "key": key}))
    } else {
        (201, json!({"effect": effect, "caller": caller, "key": key, "order": order}))
    };
    axum::response::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("location", format!("/orders/{effect}"))
        .body(axum::body::Body::from(serde_json::to_vec(&answer).expect("an answer")))
        .expect("a response")
}

/// One answer a client got.
#[derive(Debug, Clone)]
struct Got {
    status: u16,
    content_type: Option<String>,
    location: Option<String>,
    replayed: Option<String>,
    body: bytes::Bytes,
}

impl Got {
    /// The handler's answer (first or replayed): the API's own JSON, not
    /// one of the layer's problems.
    fn is_handlers(&self) -> bool {
        self.content_type.as_deref() == Some("application/json")
    }

    /// The layer's problem type, for one of its own answers.
    fn problem(&self) -> Option<String> {
        if self.content_type.as_deref() != Some("application/problem+json") {
            return None;
        }
        let problem: Value = serde_json::from_slice(&self.body).ok()?;
        // `…#idempotency-key-problems-<slug>`
        Some(problem["type"].as_str()?.rsplit_once("problems-")?.1.to_owned())
    }
}

/// One (caller, key) and what its clients got.
struct Pair {
    caller: &'static str,
    key: String,
    body: String,
    got: Mutex<Vec<Got>>,
}

/// Everything a client needs, owned.
#[derive(Clone)]
struct Clients {
    http: reqwest::Client,
    urls: Arc<Vec<String>>,
    seed: u64,
    tally: Tally,
}

impl Clients {
    /// Sends `pair`'s request, to a replica drawn each time, until the
    /// handler's answer (first or replayed) came `wanted` times, as a client
    /// that lost an answer sends again, or `tries` ran out; again after the
    /// layer's own 409, 503 or 504, which leave the key to a retry.
    async fn send(self, n: usize, client: usize, pair: Arc<Pair>, wanted: usize, tries: usize) {
        let mut draw = rng(self.seed, &[0xC11E, n as u64, client as u64]);
        let mut answered = 0;
        for _ in 0..tries {
            let url = &self.urls[draw.random_range(0..self.urls.len())];
            let response = self
                .http
                .post(format!("{url}/orders"))
                .header("idempotency-key", &pair.key)
                .header("x-user", pair.caller)
                .header("content-type", "application/json")
                .body(pair.body.clone())
                .send()
                .await
                .expect("the API answers");
            let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let (status, content_type, location, replayed) =
                (response.status().as_u16(), header("content-type"), header("location"), header("idempotent-replayed"));
            let body = response.bytes().await.expect("the answer's body");
            let got = Got { status, content_type, location, replayed, body };
            pair.got.lock().unwrap().push(got.clone());
            if got.is_handlers() {
                self.tally.add(if got.replayed.is_some() { "replayed" } else { "handled" });
                answered += 1;
                if answered == wanted {
                    return;
                }
                tokio::time::sleep(ms(draw.random_range(100..600))).await;
                continue;
            }
            match got.problem().as_deref() {
                Some(slug @ ("in-flight" | "unavailable" | "handler-timeout")) => {
                    self.tally.add(match slug {
                        "in-flight" => "in-flight",
                        "unavailable" => "unavailable",
                        _ => "handler-timeout",
                    });
                    tokio::time::sleep(ms(draw.random_range(50..200))).await;
                }
                _ => panic!(
                    "seed {}: {} with key {}: the layer answered {status} {:?}",
                    self.seed,
                    pair.caller,
                    pair.key,
                    String::from_utf8_lossy(&got.body)
                ),
            }
        }
    }
}

/// Changes the proxy's rules every 150–400 ms until `chaos` has passed:
/// answers of `idempotency_claim` and `idempotency_complete` late (within
/// the client's deadline or beyond it; the journal's within its deadline or
/// beyond it) or dropped after the database answered. Never a request held
/// or dropped before it reaches the database: every journal sent lands
/// while its claim is held, so no handler is run twice for a key by a
/// journal that never landed.
async fn network_faults(proxy: Arc<RpcProxy>, seed: u64, chaos: Duration) -> Tally {
    const CLAIM: &str = "idempotency_claim";
    const COMPLETE: &str = "idempotency_complete";
    let mut draw = rng(seed, &[0x4E7]);
    let end = tokio::time::Instant::now() + chaos;
    let rules = Tally::default();
    while tokio::time::Instant::now() < end {
        proxy.clear();
        match draw.random_range(0..100) {
            0..25 => rules.add("claim clean"),
            25..50 => {
                rules.add("claim late");
                proxy.delay(CLAIM, ms(draw.random_range(50..900)));
            }
            50..60 => {
                rules.add("claim later than the client's deadline");
                proxy.delay(CLAIM, CLIENT_DEADLINE + ms(300));
            }
            _ => {
                rules.add("claim answers dropped");
                proxy.drop_next(CLAIM, draw.random_range(1..=3));
            }
        }
        match draw.random_range(0..100) {
            0..30 => rules.add("journal clean"),
            30..55 => {
                rules.add("journal late");
                proxy.delay(COMPLETE, ms(draw.random_range(50..800)));
            }
            55..70 => {
                rules.add("journal later than its deadline");
                proxy.delay(COMPLETE, ms(2500));
            }
            _ => {
                rules.add("journal answers dropped");
                proxy.drop_next(COMPLETE, draw.random_range(1..=3));
            }
        }
        tokio::time::sleep(ms(draw.random_range(150..400))).await;
    }
    proxy.clear();
    rules
}

/// Clients of two callers of one tenant send each key's request
/// concurrently, retrying, to two replicas of an API behind the layer,
/// whose plane's claim and journal answers are late or lost; some keys are
/// used by both callers with the same body. Per (caller, key): the handler
/// made its effect exactly once; every answer of the handler a client got
/// is the first one, byte for byte, and every one but the first says it is
/// replayed; and each answer names an effect made for that caller and key,
/// never the other caller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_idempotency_keys_run_each_callers_request_once_and_replay_its_first_answer() {
    let seed = seed("idempotency keys");
    let stack = stack().await;
    let proxy = Arc::new(RpcProxy::start(stack.url()).await);
    let shop = Shop { seed, runs: Arc::default(), effects: Arc::default() };
    let tenant = Uuid::new_v4();
    let mut urls = Vec::new();
    for _ in 0..REPLICAS {
        // Each replica has its own client of the plane, which does not retry
        // itself: a lost answer is the layer's to handle.
        let config = proxy
            .client_config(stack.service_key())
            .with_retry(RetryConfig::disabled())
            .with_deadline(CLIENT_DEADLINE)
            .expect("a deadline");
        let service =
            IdempotencyService::new(PostgrestRepository::new(PostgrestClient::new(config).expect("a client")));
        let layer = IdempotencyKeyLayer::new(service, move |_| Some(tenant))
            .principal(|parts| parts.headers.get("x-user")?.to_str().ok().map(str::to_owned))
            .handler_timeout(HANDLER_TIMEOUT, ms(500))
            .and_then(|layer| layer.journal_deadline(ms(1000)))
            .expect("a lease the plane accepts");
        let app = axum::Router::new()
            .route("/orders", axum::routing::post(place_order))
            .route_layer(layer)
            .with_state(shop.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        urls.push(format!("http://{}", listener.local_addr().expect("an address")));
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    let clients = Clients { http: reqwest::Client::new(), urls: Arc::new(urls), seed, tally: Tally::default() };

    let mut pairs: Vec<Arc<Pair>> = Vec::new();
    for n in 0..HTTP_KEYS {
        let mut draw = rng(seed, &[0x0B5E, n as u64]);
        let callers: &[&'static str] = match draw.random_range(0..3) {
            0 => &CALLERS[..1],
            1 => &CALLERS[1..],
            _ => &CALLERS,
        };
        let body = json!({"item": n, "decline": draw.random_bool(0.3)}).to_string();
        for &caller in callers {
            pairs.push(Arc::new(Pair { caller, key: format!("order-{n}"), body: body.clone(), got: Mutex::default() }));
        }
    }

    let faults = tokio::spawn(network_faults(proxy.clone(), seed, HTTP_CHAOS));
    let mut sends = Vec::new();
    for (n, pair) in pairs.iter().enumerate() {
        let mut draw = rng(seed, &[0xC0C0, n as u64]);
        for client in 0..draw.random_range(2..=4) {
            let (start, wanted) = (ms(draw.random_range(0..2500)), draw.random_range(1..=3));
            let (clients, pair) = (clients.clone(), pair.clone());
            sends.push(tokio::spawn(async move {
                tokio::time::sleep(start).await;
                clients.send(n, client, pair, wanted, CLIENT_TRIES).await;
            }));
        }
    }
    let rules = faults.await.expect("the fault schedule");
    for send in sends {
        send.await.expect("a client panicked");
    }
    // The network is clean; one more client per (caller, key), until answered.
    for (n, pair) in pairs.iter().enumerate() {
        clients.clone().send(n, 99, pair.clone(), 1, 200).await;
    }
    println!(
        "idempotency keys: {} (caller, key) pairs, {} handler runs; answers {}; network {rules}; \
         claim requests {}, journal requests {}",
        pairs.len(),
        shop.runs.load(Ordering::SeqCst),
        clients.tally,
        proxy.requests("idempotency_claim"),
        proxy.requests("idempotency_complete"),
    );

    let effects = shop.effects.lock().unwrap().clone();
    for pair in &pairs {
        let context = format!("seed {seed}, {} with key {}", pair.caller, pair.key);
        let made = shop.effects_for(pair.caller, &pair.key);
        assert_eq!(made.len(), 1, "{context}: the handler made {} effects: {made:?}", made.len());
        let got = pair.got.lock().unwrap().clone();
        let answers: Vec<&Got> = got.iter().filter(|got| got.is_handlers()).collect();
        let firsts: Vec<&Got> = answers.iter().copied().filter(|got| got.replayed.is_none()).collect();
        assert_eq!(firsts.len(), 1, "{context}: {} answers not marked replayed: {firsts:?}", firsts.len());
        let first = firsts[0];
        let named: Value = serde_json::from_slice(&first.body).expect("the handler's JSON");
        assert_eq!(named["effect"], json!(made[0]), "{context}: the first answer names another effect: {named}");
        assert_eq!((named["caller"].as_str(), named["key"].as_str()), (Some(pair.caller), Some(&*pair.key)));
        let declined = pair.body.contains(r#""decline":true"#);
        assert_eq!(first.status, if declined { 403 } else { 201 }, "{context}: {first:?}");
        for answer in &answers {
            let named: Value = serde_json::from_slice(&answer.body).expect("the handler's JSON");
            let owner = named["effect"].as_u64().and_then(|effect| effects.get(effect as usize));
            assert_eq!(
                owner,
                Some(&(pair.caller.to_owned(), pair.key.clone())),
                "{context}: received an answer produced for another (caller, key): {named}"
            );
            let same = (answer.status, &answer.content_type, &answer.location, &answer.body);
            assert_eq!(
                same,
                (first.status, &first.content_type, &first.location, &first.body),
                "{context}: an answer other than the first"
            );
            if !std::ptr::eq(*answer, first) {
                assert_eq!(answer.replayed.as_deref(), Some("true"), "{context}: {answer:?}");
            }
        }
    }
    assert_eq!(effects.len(), pairs.len(), "seed {seed}: effects for no (caller, key) of the test: {effects:?}");
    stack.stop().await.unwrap();
}
