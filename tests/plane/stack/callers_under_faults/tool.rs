//! The tool guard under faults: many attempts of each key's step, against a
//! vendor that dedupes on the idempotency key it is handed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::callers::tool::{
    Checkpoint, RepeatSafety, RetryHorizon, ToolCall, ToolError, ToolGuard, ToolKey, ToolResult, ToolRun, ToolSpec,
};
use idempotency_plane::service::Answer;
use idempotency_plane::{IdempotencyService, PostgrestRepository, ReadOutcome, RequestHash};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::faults::{Fault, Faulty, Op};
use crate::support::harness::{client, stack};

use super::{ms, pass_lease_of, rng, seed, stands_for, KeyedFaults, Tally};

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
