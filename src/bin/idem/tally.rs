//! The demo's counters, shared by every worker.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// What the workers saw, counted as it happened.
#[derive(Debug)]
pub(crate) struct Tally {
    /// `claim()` calls, orchestrator retries included.
    pub(crate) attempts: AtomicU64,
    /// `Claimed` answers: a worker owned the key and called the vendor.
    pub(crate) executions: AtomicU64,
    /// `Completed` answers: the stored result was replayed.
    pub(crate) replays: AtomicU64,
    /// Replays whose message id differs from the one the vendor made.
    pub(crate) replay_mismatches: AtomicU64,
    /// `Processing` answers: another worker held a live lease.
    pub(crate) processing: AtomicU64,
    /// `Conflict` answers: the key was used for different content.
    pub(crate) conflicts: AtomicU64,
    /// `Claimed` answers that took over a passed lease.
    pub(crate) reclaims: AtomicU64,
    /// `complete()`/`release()` calls answered `LeaseMovedOn`.
    pub(crate) fenced: AtomicU64,
    /// Per key: executions and reclaims.
    per_key: Vec<KeyTally>,
}

/// Counters of one key.
#[derive(Debug, Default)]
pub(crate) struct KeyTally {
    executions: AtomicU32,
    reclaims: AtomicU32,
}

impl Tally {
    /// Zeroed counters for `keys` keys.
    pub(crate) fn new(keys: usize) -> Tally {
        Tally {
            attempts: AtomicU64::new(0),
            executions: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            replay_mismatches: AtomicU64::new(0),
            processing: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            reclaims: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            per_key: (0..keys).map(|_| KeyTally::default()).collect(),
        }
    }

    /// Adds one to `counter`.
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads `counter`.
    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Counts one execution of key `index`, and whether it was a reclaim.
    pub(crate) fn executed(&self, index: usize, reclaimed: bool) {
        Tally::bump(&self.executions);
        if let Some(key) = self.per_key.get(index) {
            key.executions.fetch_add(1, Ordering::Relaxed);
            if reclaimed {
                key.reclaims.fetch_add(1, Ordering::Relaxed);
            }
        }
        if reclaimed {
            Tally::bump(&self.reclaims);
        }
    }

    /// `(executions, reclaims)` of key `index`.
    pub(crate) fn of_key(&self, index: usize) -> (u32, u32) {
        self.per_key
            .get(index)
            .map_or((0, 0), |key| (key.executions.load(Ordering::Relaxed), key.reclaims.load(Ordering::Relaxed)))
    }
}
