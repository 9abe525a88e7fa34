//! Load with stalls: 64 workers, 1,000 keys (`IDEM_LOAD_KEYS` for more),
//! 5 attempts per key, some attempts stalling past their lease after the
//! effect, some failing retryably, a few carrying a changed payload. Exactly
//! one effect per key at the vendor, nothing left processing, no completion
//! lost.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_plane::{ClaimOutcome, Completion, Ending, IdempotencyService, PostgrestRepository, RequestHash};
use rand::Rng;
use serde_json::json;
use uuid::Uuid;

use crate::support::harness::*;

const WORKERS: usize = 64;
/// Keys of the default run: every worker meets races, stalls and
/// reclaims, in a few seconds; `IDEM_LOAD_KEYS=20000` soaks longer.
const DEFAULT_KEYS: usize = 1_000;
const ATTEMPTS_PER_KEY: usize = 5;
/// The lease of every claim here: short, so a stall outlives it.
const SHORT_LEASE: Duration = Duration::from_secs(1);
const STALL: Duration = Duration::from_millis(1_500);

/// A vendor that dedupes on the idempotency key, as the spec requires of
/// any effect a reclaim may repeat: one message per key, however many sends.
#[derive(Default)]
struct Vendor {
    messages: Mutex<HashMap<String, u64>>,
    sends: AtomicU64,
}

impl Vendor {
    fn send(&self, key: &str) -> u64 {
        self.sends.fetch_add(1, Ordering::Relaxed);
        let mut messages = self.messages.lock().expect("vendor");
        let next = messages.len() as u64 + 1;
        *messages.entry(key.to_owned()).or_insert(next)
    }
}

#[derive(Default)]
struct Figures {
    attempts: AtomicU64,
    claims: AtomicU64,
    executions: AtomicU64,
    replays: AtomicU64,
    in_flight: AtomicU64,
    reclaims: AtomicU64,
    releases: AtomicU64,
    conflicts: AtomicU64,
    stalls: AtomicU64,
    fenced: AtomicU64,
}

fn add(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// One attempt at one key: an orchestrator step that retries until the key
/// is settled (completed by someone), or the attempt was a conflict.
async fn attempt(
    service: &IdempotencyService<PostgrestRepository>,
    vendor: &Vendor,
    figures: &Figures,
    org: Uuid,
    key: &str,
    changed_payload: bool,
) {
    add(&figures.attempts);
    let payload = if changed_payload { json!({"key": key, "changed": true}) } else { json!({"key": key}) };
    let hash = RequestHash::of_json(&payload);
    for _ in 0..500 {
        add(&figures.claims);
        let outcome = service.claim(org, "tool.email.send", key, &hash, SHORT_LEASE).await.expect("claim");
        let claim = match outcome {
            ClaimOutcome::Claimed(claim) => claim,
            ClaimOutcome::Completed { .. } => return add(&figures.replays),
            ClaimOutcome::Conflict => {
                assert!(changed_payload, "{key}: a conflict for the original payload");
                return add(&figures.conflicts);
            }
            ClaimOutcome::Processing { .. } => {
                add(&figures.in_flight);
                let backoff = Duration::from_millis(rand::rng().random_range(20..80));
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        if claim.reclaimed() {
            add(&figures.reclaims);
        }
        let (fail, stall) = {
            let mut rng = rand::rng();
            (rng.random_bool(0.08), rng.random_bool(0.04))
        };
        if fail {
            // A vendor 429: no effect; release so the next attempt executes.
            let _ = service.release(&claim).await.expect("release");
            add(&figures.releases);
            continue;
        }
        add(&figures.executions);
        let message = vendor.send(&format!("{org}:{key}"));
        if stall {
            // The worker stalls after the vendor's success, past its lease.
            add(&figures.stalls);
            tokio::time::sleep(STALL).await;
        }
        let completion =
            Completion::response(json!({"message": message})).with_resource("email.message", message.to_string());
        match service.complete(&claim, completion).await.expect("complete") {
            Ending::Recorded => return,
            // Another worker reclaimed it meanwhile; it owns the ending now.
            Ending::LeaseMovedOn => add(&figures.fenced),
        }
    }
    panic!("{key}: not settled after 500 tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_with_stalls_and_failures_every_key_has_exactly_one_effect() {
    let stack = stack().await;
    let client =
        idempotency_plane::PostgrestClient::new(stack.client_config().unwrap().with_pool_max_idle_per_host(WORKERS))
            .unwrap();
    let service = Arc::new(IdempotencyService::new(PostgrestRepository::new(client)));
    let (vendor, figures) = (Arc::new(Vendor::default()), Arc::new(Figures::default()));
    let org = org();

    let keys = std::env::var("IDEM_LOAD_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_KEYS);
    // Every (key, attempt), shuffled so a key's attempts race each other.
    let mut queue: Vec<usize> = (0..keys).flat_map(|k| std::iter::repeat_n(k, ATTEMPTS_PER_KEY)).collect();
    {
        use rand::seq::SliceRandom;
        queue.shuffle(&mut rand::rng());
    }
    let queue = Arc::new(Mutex::new(queue));
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (service, vendor, figures, queue) = (service.clone(), vendor.clone(), figures.clone(), queue.clone());
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().expect("queue").pop();
                    let Some(k) = next else { break };
                    attempt(&service, &vendor, &figures, org, &format!("load-{k}"), false).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    // Then a changed payload under every 50th used key: refused, never run.
    for k in (0..keys).step_by(50) {
        attempt(&service, &vendor, &figures, org, &format!("load-{k}"), true).await;
    }
    let elapsed = started.elapsed();

    // A final pass once every lease has passed: nothing may be left processing.
    tokio::time::sleep(SHORT_LEASE).await;
    let (completed, processing): (i64, i64) = sqlx::query_as(
        "select count(*) filter (where status = 'completed'), count(*) filter (where status = 'processing')
           from agent.idempotency_keys",
    )
    .fetch_one(stack.db())
    .await
    .unwrap();
    let messages = vendor.messages.lock().unwrap().clone();
    let distinct: HashSet<&u64> = messages.values().collect();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "load: {WORKERS} workers, {keys} keys x {ATTEMPTS_PER_KEY} attempts in {:.1} s: attempts {}, claim calls {}, \
         executions {}, vendor sends {}, vendor effects {}, replays {}, in-flight answers {}, reclaims {}, \
         releases {}, conflicts {}, stalls {}, fenced-off endings {}, completed {completed}, processing {processing}",
        elapsed.as_secs_f64(),
        get(&figures.attempts),
        get(&figures.claims),
        get(&figures.executions),
        vendor.sends.load(Ordering::Relaxed),
        distinct.len(),
        get(&figures.replays),
        get(&figures.in_flight),
        get(&figures.reclaims),
        get(&figures.releases),
        get(&figures.conflicts),
        get(&figures.stalls),
        get(&figures.fenced),
    );
    assert_eq!(messages.len(), keys, "every key had its effect");
    assert_eq!(distinct.len(), keys, "exactly one effect per key at the vendor");
    assert_eq!(completed, keys as i64, "no completion lost");
    assert_eq!(processing, 0, "nothing stuck in processing");
    assert_eq!(get(&figures.conflicts), (keys / 50) as u64, "every changed payload was refused");
    assert!(get(&figures.stalls) > 0 && get(&figures.reclaims) > 0 && get(&figures.releases) > 0);
    stack.stop().await.unwrap();
}
