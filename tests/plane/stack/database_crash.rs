//! The database crashes mid-run: `kill -9` of the postmaster of a
//! PostgreSQL 15 cluster of the test's own, while many workers claim, run
//! an effect at a vendor, complete and release; then the cluster restarts
//! (crash recovery) and the run finishes, on the same PostgREST-compatible
//! server, which was never restarted.
//!
//! Per key: the vendor made one effect (it dedupes on the vendor key, as the
//! plane requires of an effect a reclaim may repeat, and a second send of a
//! key is explained by a completion the client never saw acknowledged);
//! every completion the client saw acknowledged is in the table with its
//! answer; no key is left processing; every error the client saw is
//! classified transient (each one was the outage).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_plane::local::LocalStackConfig;
use idempotency_plane::{ClaimOutcome, Completion, Ending, Error};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::support::cluster::{server_binaries_missing, Cluster};
use crate::support::harness::*;

const WORKERS: usize = 16;
const KEYS: usize = 200;
const ATTEMPTS_PER_KEY: usize = 3;
/// Short, so claims caught by the crash are reclaimed within the run.
const CRASH_LEASE: Duration = Duration::from_secs(2);
/// Acknowledged completions before the kill.
const KILL_AFTER_ACKS: u64 = 50;
const DOWN_FOR: Duration = Duration::from_secs(1);
const BOUND: Duration = Duration::from_secs(120);
const SCOPE: &str = "tool.email.send";

/// A vendor that dedupes on the vendor key: one message per key, however
/// many sends, and it counts the sends. It refuses the first send of every
/// `refuse_every`-th key, as a rate limit does (a 429: no effect), so
/// workers release too.
#[derive(Default)]
pub(super) struct Vendor {
    messages: Mutex<HashMap<String, (String, u64)>>,
    refuse_every: usize,
    refused: Mutex<std::collections::HashSet<String>>,
}

/// The vendor refused a send: no effect was made, so the claim is released.
pub(super) struct RateLimited;

impl Vendor {
    /// A vendor that refuses the first send of every `n`-th key it sees
    /// (by the number at the end of the key).
    pub(super) fn refusing_first_send_of_every(n: usize) -> Vendor {
        Vendor { refuse_every: n, ..Vendor::default() }
    }

    /// Sends for `key`; answers the one message id the key ever gets.
    pub(super) fn send(&self, key: &str) -> Result<String, RateLimited> {
        let number = key.rsplit('-').next().and_then(|n| n.parse::<usize>().ok());
        if number.is_some_and(|number| self.refuse_every > 0 && number % self.refuse_every == 0)
            && self.refused.lock().expect("vendor").insert(key.to_owned())
        {
            return Err(RateLimited);
        }
        let mut messages = self.messages.lock().expect("vendor");
        let entry = messages.entry(key.to_owned()).or_insert_with(|| (format!("m-{}", Uuid::new_v4()), 0));
        entry.1 += 1;
        Ok(entry.0.clone())
    }

    /// How many sends were refused.
    pub(super) fn refused(&self) -> usize {
        self.refused.lock().expect("vendor").len()
    }

    /// `(message id, sends)` of every key.
    pub(super) fn by_key(&self) -> HashMap<String, (String, u64)> {
        self.messages.lock().expect("vendor").clone()
    }
}

/// What the workers saw.
#[derive(Default)]
pub(super) struct Seen {
    /// Key → the response of a completion acknowledged `Recorded`.
    pub(super) acked: Mutex<HashMap<String, Value>>,
    /// Key → the lease token of the first completion acknowledged.
    pub(super) acked_tokens: Mutex<HashMap<String, Uuid>>,
    /// Keys whose completion failed or went unanswered at least once.
    pub(super) unacked: Mutex<Vec<String>>,
    /// Every error: what it was and whether it was classified transient.
    pub(super) errors: Mutex<Vec<(String, bool)>>,
    pub(super) acks: AtomicU64,
    /// When each completion call began (before its request was sent).
    pub(super) completions_begun: Mutex<Vec<Instant>>,
    /// Each completion call that ended: when it began, and whether it was
    /// acknowledged `Recorded`.
    pub(super) completions: Mutex<Vec<(Instant, bool)>>,
    /// Releases acknowledged, and releases that failed (the claim then
    /// waits out its lease).
    pub(super) releases: AtomicU64,
    pub(super) failed_releases: AtomicU64,
}

impl Seen {
    fn error(&self, error: &Error) {
        self.errors.lock().expect("seen").push((error.to_string(), error.is_transient()));
    }

    /// A completion call begins now: when.
    pub(super) fn completion_begins(&self) -> Instant {
        let began = Instant::now();
        self.completions_begun.lock().expect("seen").push(began);
        began
    }

    /// The completion call that began at `began` ended with `ended`.
    pub(super) fn completion_ended(&self, began: Instant, ended: &Result<Ending, Error>) {
        self.completions.lock().expect("seen").push((began, matches!(ended, Ok(Ending::Recorded))));
    }

    /// Of the completion calls begun after `instant` (ended or not): how
    /// many, and how many of those that ended were acknowledged `Recorded`.
    pub(super) fn completions_begun_after(&self, instant: Instant) -> (usize, usize) {
        let begun = self.completions_begun.lock().expect("seen").iter().filter(|began| **began > instant).count();
        let completions = self.completions.lock().expect("seen");
        let acked = completions.iter().filter(|(began, recorded)| *began > instant && *recorded).count();
        (begun, acked)
    }
}

/// One attempt of one key, as a worker makes it: claim, send, complete (or
/// release, when the vendor refused the send). Retries its own failures
/// until the key is completed by someone.
pub(super) async fn attempt(service: &Service, org: Uuid, key: &str, vendor: &Vendor, seen: &Seen) {
    let request = hash(key);
    loop {
        match service.claim(org, SCOPE, key, &request, CRASH_LEASE).await {
            Ok(ClaimOutcome::Claimed(claim)) => {
                let Ok(message) = vendor.send(key) else {
                    // No effect: release, so the next attempt claims at once.
                    match service.release(&claim).await {
                        Ok(_) => seen.releases.fetch_add(1, Ordering::SeqCst),
                        Err(error) => {
                            seen.error(&error);
                            seen.failed_releases.fetch_add(1, Ordering::SeqCst)
                        }
                    };
                    continue;
                };
                let response = json!({ "message_id": message });
                let began = seen.completion_begins();
                let ended = service.complete(&claim, Completion::response(response.clone())).await;
                seen.completion_ended(began, &ended);
                match ended {
                    Ok(Ending::Recorded) => {
                        seen.acked.lock().expect("seen").insert(key.to_owned(), response);
                        // The first acknowledgement: a later one would mean it was lost.
                        seen.acked_tokens.lock().expect("seen").entry(key.to_owned()).or_insert(claim.lease_token());
                        seen.acks.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    Ok(_) => {
                        // The lease moved on: another worker owns the key now.
                        seen.unacked.lock().expect("seen").push(key.to_owned());
                    }
                    Err(error) => {
                        seen.error(&error);
                        seen.unacked.lock().expect("seen").push(key.to_owned());
                    }
                }
            }
            Ok(ClaimOutcome::Completed { .. }) => return,
            Ok(ClaimOutcome::Processing { .. }) => tokio::time::sleep(Duration::from_millis(100)).await,
            Ok(ClaimOutcome::Conflict) => panic!("{key}: a conflict, but every attempt sends the same request"),
            Err(error) => {
                seen.error(&error);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Every acknowledged completion is the one stored: its row still carries
/// the lease token of the claim that completed it, so it was not lost and
/// redone by a later attempt (which would store the same answer, the
/// vendor's one message, under a new token).
pub(super) async fn assert_acknowledged_completions_kept(db: &sqlx::PgPool, org: Uuid, seen: &Seen) {
    let rows: Vec<(String, Uuid)> =
        sqlx::query_as("select key, lease_token from agent.idempotency_keys where organization_id = $1")
            .bind(org)
            .fetch_all(db)
            .await
            .expect("the claims' lease tokens");
    let stored: HashMap<String, Uuid> = rows.into_iter().collect();
    for (key, token) in seen.acked_tokens.lock().expect("seen").iter() {
        assert_eq!(stored.get(key), Some(token), "{key}: the acknowledged completion was lost and redone");
    }
}

/// `workers` tasks that make the attempts in `attempts` (keys, in order),
/// each taking the next one when its last is done.
pub(super) fn run_attempts(
    workers: usize,
    service: &Arc<Service>,
    org: Uuid,
    attempts: Vec<String>,
    vendor: &Arc<Vendor>,
    seen: &Arc<Seen>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let queue = Arc::new(Mutex::new(attempts.into_iter().rev().collect::<Vec<String>>()));
    (0..workers)
        .map(|_| {
            let (service, vendor, seen, queue) = (service.clone(), vendor.clone(), seen.clone(), queue.clone());
            tokio::spawn(async move {
                loop {
                    let Some(key) = queue.lock().expect("queue").pop() else { return };
                    attempt(&service, org, &key, &vendor, &seen).await;
                }
            })
        })
        .collect()
}

/// The claims of `org` by key: `(status, response)`.
pub(super) async fn claims_by_key(db: &sqlx::PgPool, org: Uuid) -> HashMap<String, (String, Option<Value>)> {
    let rows: Vec<(String, String, Option<Value>)> =
        sqlx::query_as("select key, status, response from agent.idempotency_keys where organization_id = $1")
            .bind(org)
            .fetch_all(db)
            .await
            .expect("the claims after the outage");
    rows.into_iter().map(|(key, status, response)| (key, (status, response))).collect()
}

/// Per key, after an outage: completed, its stored answer the vendor's one
/// message and, when a completion of it was acknowledged, that one; and
/// every error the workers saw classified transient.
pub(super) fn assert_each_key_completed_once(
    keys: &[String],
    rows: &HashMap<String, (String, Option<Value>)>,
    seen: &Seen,
    vendor: &Vendor,
) {
    let acked = seen.acked.lock().expect("seen").clone();
    let sent = vendor.by_key();
    for key in keys {
        let (status, stored) = rows.get(key).unwrap_or_else(|| panic!("{key}: no claim after the run"));
        assert_eq!(status, "completed", "{key}: left {status}");
        let (message, _) = sent.get(key).unwrap_or_else(|| panic!("{key}: the vendor never saw it"));
        // The journal answers the one effect the vendor made.
        assert_eq!(stored.as_ref(), Some(&json!({ "message_id": message })), "{key}");
        if let Some(response) = acked.get(key) {
            assert_eq!(Some(response), stored.as_ref(), "{key}: the stored answer is not the acknowledged one");
        }
    }
    for (error, transient) in seen.errors.lock().expect("seen").iter() {
        assert!(transient, "an error of the outage classified as permanent: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_crash_mid_run_loses_no_acknowledged_completion_and_repeats_no_effect() {
    let test = "a_database_crash_mid_run_loses_no_acknowledged_completion_and_repeats_no_effect";
    if server_binaries_missing(test) {
        return;
    }
    let mut cluster = Cluster::start("crash", "");
    let config =
        LocalStackConfig { database_url: cluster.url("postgres"), pool_size: 8, ..LocalStackConfig::default() };
    let stack = stack_with(config).await;
    let service = Arc::new(service(&stack));
    let (vendor, seen) = (Arc::new(Vendor::refusing_first_send_of_every(5)), Arc::new(Seen::default()));
    let org = org();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("crash-{i}")).collect();
    let began = Instant::now();

    let run = async {
        // Every key attempted ATTEMPTS_PER_KEY times, spread over the workers.
        let attempts = (0..ATTEMPTS_PER_KEY).flat_map(|_| keys.iter().cloned()).collect();
        let workers = run_attempts(WORKERS, &service, org, attempts, &vendor, &seen);
        // The crash, once enough completions were acknowledged.
        while seen.acks.load(Ordering::SeqCst) < KILL_AFTER_ACKS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster.kill();
        let acked_before_restart = seen.acks.load(Ordering::SeqCst);
        tokio::time::sleep(DOWN_FOR).await;
        let down = Instant::now();
        cluster.restart();
        let recovered_in = down.elapsed();
        for worker in workers {
            worker.await.expect("a worker panicked");
        }
        (acked_before_restart, recovered_in)
    };
    let (acked_at_kill, recovered_in) = within(BOUND, "the crash run", run).await;

    // Per key, from the table.
    let rows = claims_by_key(stack.db(), org).await;
    assert_each_key_completed_once(&keys, &rows, &seen, &vendor);
    assert_acknowledged_completions_kept(stack.db(), org, &seen).await;
    let (acked, unacked) = (seen.acked.lock().unwrap().clone(), seen.unacked.lock().unwrap().clone());
    let sent = vendor.by_key();
    for (key, (_, sends)) in &sent {
        if *sends > 1 {
            assert!(unacked.contains(key), "{key}: sent {sends} times, yet no completion of it went unacknowledged");
        }
    }
    let errors = seen.errors.lock().unwrap().clone();
    assert_eq!(acked.len(), KEYS, "every key's completion was acknowledged to someone");
    // The same server, never restarted, serves a fresh claim.
    let after = claimed(service.claim(org, SCOPE, "after-the-crash", &hash("after"), LEASE).await);
    assert_eq!(service.release(&after).await.unwrap(), Ending::Recorded);
    let repeated = sent.values().filter(|(_, sends)| *sends > 1).count();
    eprintln!(
        "database crash: {KEYS} keys, {} sends, {repeated} keys sent twice (vendor-deduped), {acked_at_kill} acked \
         before the restart and all kept, {} sends refused and {} released ({} releases failed and waited out \
         their lease), {} errors (all transient), recovery {:.1} s, run {:.1} s",
        sent.values().map(|(_, sends)| sends).sum::<u64>(),
        vendor.refused(),
        seen.releases.load(Ordering::SeqCst),
        seen.failed_releases.load(Ordering::SeqCst),
        errors.len(),
        recovered_in.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
    stack.stop().await.unwrap();
}
