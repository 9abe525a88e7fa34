//! Randomized endings on the real stack: many concurrent attempts of every
//! caller — the tool guard, the webhook gate and the saved-search start
//! through [`Faulty`], the `Idempotency-Key` layer through an
//! [`RpcProxy`](crate::support::proxy::RpcProxy)
//! — with faults a seeded generator chooses, and the invariants each caller
//! promises checked on what the store holds and what its callers were
//! answered.
//!
//! Each test prints its seed; set `IDEM_RANDOM_SEED` to run one again. The
//! seed decides every choice made for a key (the store's faults on its
//! calls, what each attempt's tool or processing does, when attempts start),
//! but not how the tasks interleave, so a run is reproduced in kind, not to
//! the millisecond.
//!
//! One file per caller: `tool`, `webhook`, `saved_search` (its tables, Run
//! admission and story in `saved_search_fakes`) and `idempotency_key`, each
//! with its test; here, what they share: the seed and the generators drawn
//! from it, the store's faults aimed per key, and the checks on what a
//! journal keeps.

mod idempotency_key;
mod saved_search;
mod saved_search_fakes;
mod tool;
mod webhook;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_plane::service::{Elided, ResponseRef};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use crate::support::faults::{Call, Fault, Faulty, Op};

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
