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

/// A time-limited map of completed claims, bounded in entries and in
/// bytes, oldest evicted first.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    capacity: usize,
    max_bytes: usize,
    ttl: Duration,
    inner: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    /// Each answer, when it was stored, and the bytes it was counted for.
    map: HashMap<Key, (CachedAnswer, Instant, usize)>,
    order: VecDeque<Key>,
    bytes: usize,
}

/// Approximate bytes one entry holds, its key included.
fn entry_bytes((_, scope, key): &Key, answer: &CachedAnswer) -> usize {
    std::mem::size_of::<(Key, (CachedAnswer, Instant, usize))>()
        + std::mem::size_of::<Key>()
        + 2 * (scope.len() + key.len())
        + answer.approx_bytes()
}

impl ReplayCache {
    pub(crate) fn new(capacity: usize, max_bytes: usize, ttl: Duration) -> Self {
        ReplayCache { capacity, max_bytes, ttl, inner: Mutex::new(Entries::default()) }
    }

    /// The cached answer for a claim, if one was stored less than a TTL ago.
    pub(crate) fn get(&self, organization_id: Uuid, scope: &str, key: &str) -> Option<CachedAnswer> {
        let entries = self.inner.lock().ok()?;
        let (answer, stored_at, _) = entries.map.get(&(organization_id, scope.to_owned(), key.to_owned()))?;
        (stored_at.elapsed() < self.ttl).then(|| answer.clone())
    }

    /// Remembers a completed claim's answer. One larger than the whole byte
    /// bound is not cached at all.
    pub(crate) fn put(&self, organization_id: Uuid, scope: &str, key: &str, answer: CachedAnswer) {
        let entry_key = (organization_id, scope.to_owned(), key.to_owned());
        let size = entry_bytes(&entry_key, &answer);
        if self.capacity == 0 || size > self.max_bytes {
            return;
        }
        let Ok(mut entries) = self.inner.lock() else { return };
        match entries.map.insert(entry_key.clone(), (answer, Instant::now(), size)) {
            Some((_, _, replaced)) => entries.bytes -= replaced,
            None => entries.order.push_back(entry_key),
        }
        entries.bytes += size;
        while entries.map.len() > self.capacity || entries.bytes > self.max_bytes {
            let Some(oldest) = entries.order.pop_front() else { break };
            if let Some((_, _, evicted)) = entries.map.remove(&oldest) {
                entries.bytes -= evicted;
            }
        }
    }

    /// Entries held now.
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().map_or(0, |e| e.map.len())
    }

    /// Approximate bytes the entries hold, keys included.
    pub(crate) fn approx_bytes(&self) -> usize {
        self.inner.lock().map_or(0, |entries| entries.bytes)
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
        let cache = ReplayCache::new(2, usize::MAX, Duration::from_secs(60));
        let org = Uuid::new_v4();
        cache.put(org, "tool.x", "a", answer("1"));
        cache.put(org, "tool.x", "b", answer("2"));
        cache.put(org, "tool.x", "c", answer("3"));
        assert_eq!(cache.len(), 2);
        assert!(cache.get(org, "tool.x", "a").is_none(), "the oldest was evicted");
        assert_eq!(cache.get(org, "tool.x", "c").map(|a| a.request_hash), Some("3".to_owned()));
        assert!(cache.get(Uuid::new_v4(), "tool.x", "c").is_none(), "keys are per tenant");
        assert!(cache.approx_bytes() > 0);

        let expired = ReplayCache::new(2, usize::MAX, Duration::ZERO);
        expired.put(org, "tool.x", "a", answer("1"));
        assert!(expired.get(org, "tool.x", "a").is_none());
    }

    #[test]
    fn the_replay_cache_is_bounded_in_bytes_as_well_as_entries() {
        let org = Uuid::new_v4();
        let big = |hash: &str| CachedAnswer {
            response: Some(serde_json::json!({"text": "x".repeat(10_000)})),
            ..answer(hash)
        };
        let one = entry_bytes(&(org, "tool.x".into(), "a".into()), &big("1"));
        let cache = ReplayCache::new(1_000, one * 2 + one / 2, Duration::from_secs(60));
        for (key, hash) in [("a", "1"), ("b", "2"), ("c", "3")] {
            cache.put(org, "tool.x", key, big(hash));
        }
        assert_eq!(cache.len(), 2, "two entries fit the byte bound, not three");
        assert!(cache.get(org, "tool.x", "a").is_none(), "the oldest was evicted");
        assert!(cache.approx_bytes() <= one * 2 + one / 2);
        // Replacing an entry does not count it twice.
        cache.put(org, "tool.x", "c", big("3"));
        assert_eq!((cache.len(), cache.approx_bytes()), (2, one * 2));
        // One answer above the whole bound is not cached.
        let tiny = ReplayCache::new(1_000, one - 1, Duration::from_secs(60));
        tiny.put(org, "tool.x", "a", big("1"));
        assert_eq!(tiny.len(), 0);
    }
}
