//! An in-process cache of completed claims, so a replay costs no round trip.
//!
//! Only completed claims are cached: they are terminal, and their answer does
//! not change while they are retained. A processing claim is never cached (its
//! lease moves, and the next caller may have to reclaim it). Entries live for
//! a short time-to-live of the process's own monotonic clock, far below the
//! shortest retention (24 hours), so the cache never decides anything the
//! database clock has not: at worst it answers, for less than one TTL past a
//! claim's retention, the answer that claim really stored.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::outcome::{ResourceRef, ResponseRef};

/// What a completed claim answers.
#[derive(Debug, Clone)]
pub(crate) struct CachedAnswer {
    pub(crate) request_hash: String,
    pub(crate) response: Option<serde_json::Value>,
    pub(crate) resource: Option<ResourceRef>,
    pub(crate) response_ref: Option<ResponseRef>,
}

impl CachedAnswer {
    /// Approximate heap and inline bytes this answer holds.
    fn approx_bytes(&self) -> usize {
        let strings = |r: &Option<ResourceRef>| r.as_ref().map_or(0, |r| r.resource_type.len() + r.resource_id.len());
        std::mem::size_of::<Self>()
            + self.request_hash.len()
            + self.response.as_ref().map_or(0, |v| v.to_string().len() * 2)
            + strings(&self.resource)
            + self.response_ref.as_ref().map_or(0, |r| r.resource_type.len() + r.resource_id.len() + r.sha256.len())
    }
}

type Key = (Uuid, String, String);

/// A bounded, time-limited map of completed claims, oldest evicted first.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    capacity: usize,
    ttl: Duration,
    inner: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<Key, (CachedAnswer, Instant)>,
    order: VecDeque<Key>,
}

impl ReplayCache {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        ReplayCache { capacity, ttl, inner: Mutex::new(Entries::default()) }
    }

    /// The cached answer for a claim, if one was stored less than a TTL ago.
    pub(crate) fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Option<CachedAnswer> {
        let entries = self.inner.lock().ok()?;
        let (answer, stored_at) = entries.map.get(&(organization_id, scope.to_owned(), key.to_owned()))?;
        (stored_at.elapsed() < self.ttl).then(|| answer.clone())
    }

    /// Remembers a completed claim's answer.
    pub(crate) fn put(&self, organization_id: Uuid, scope: &str, key: &str, answer: CachedAnswer) {
        if self.capacity == 0 {
            return;
        }
        let Ok(mut entries) = self.inner.lock() else { return };
        let entry_key = (organization_id, scope.to_owned(), key.to_owned());
        if entries.map.insert(entry_key.clone(), (answer, Instant::now())).is_none() {
            entries.order.push_back(entry_key);
        }
        while entries.map.len() > self.capacity {
            match entries.order.pop_front() {
                Some(oldest) => {
                    entries.map.remove(&oldest);
                }
                None => break,
            }
        }
    }

    /// Entries held now.
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().map_or(0, |e| e.map.len())
    }

    /// Approximate bytes the entries hold, keys included.
    pub(crate) fn approx_bytes(&self) -> usize {
        self.inner.lock().map_or(0, |entries| {
            entries
                .map
                .iter()
                .map(|((_, scope, key), (answer, _))| {
                    std::mem::size_of::<(Key, (CachedAnswer, Instant))>()
                        + std::mem::size_of::<Key>()
                        + 2 * (scope.len() + key.len())
                        + answer.approx_bytes()
                })
                .sum()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(hash: &str) -> CachedAnswer {
        CachedAnswer {
            request_hash: hash.into(),
            response: Some(serde_json::json!({"ok": true})),
            resource: None,
            response_ref: None,
        }
    }

    #[test]
    fn entries_are_bounded_oldest_first_and_expire() {
        let cache = ReplayCache::new(2, Duration::from_secs(60));
        let org = Uuid::new_v4();
        cache.put(org, "tool.x", "a", answer("1"));
        cache.put(org, "tool.x", "b", answer("2"));
        cache.put(org, "tool.x", "c", answer("3"));
        assert_eq!(cache.len(), 2);
        assert!(cache.get(org, "tool.x", "a").is_none(), "the oldest was evicted");
        assert_eq!(cache.get(org, "tool.x", "c").map(|a| a.request_hash), Some("3".to_owned()));
        assert!(cache.get(Uuid::new_v4(), "tool.x", "c").is_none(), "keys are per tenant");
        assert!(cache.approx_bytes() > 0);

        let expired = ReplayCache::new(2, Duration::ZERO);
        expired.put(org, "tool.x", "a", answer("1"));
        assert!(expired.get(org, "tool.x", "a").is_none());
    }
}
