//! In-memory LRU accounting of pages on disk. The lock is held only to
//! move entries; files are deleted outside it, so eviction never blocks
//! reads of other pages.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::pages::PageKey;

#[derive(Default)]
struct Inner {
    by_key: HashMap<PageKey, (u64, u64)>,
    by_seq: BTreeMap<u64, PageKey>,
    next_seq: u64,
    used: u64,
    /// Bytes of uploads being staged: not evictable yet, but on disk.
    staged: u64,
    /// Pages under a pin policy: counted in `used`, absent from `by_seq`,
    /// so eviction never picks them.
    pinned: HashSet<PageKey>,
    /// Pages under a TTL policy: when (ms since the epoch) they go.
    expires_ms: HashMap<PageKey, i64>,
}

/// How a page is kept, from the policy of its object's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    Lru,
    Pinned,
    /// Evicted at this time (ms since the epoch), or earlier by LRU.
    ExpiresAtMs(i64),
}

impl Inner {
    fn set_retention(&mut self, key: PageKey, seq: u64, retention: Retention) {
        self.pinned.remove(&key);
        self.expires_ms.remove(&key);
        match retention {
            Retention::Pinned => {
                self.by_seq.remove(&seq);
                self.pinned.insert(key);
            }
            Retention::ExpiresAtMs(at) => {
                self.expires_ms.insert(key, at);
            }
            Retention::Lru => {}
        }
    }

    fn forget(&mut self, key: &PageKey) -> Option<u64> {
        let (seq, len) = self.by_key.remove(key)?;
        self.by_seq.remove(&seq);
        self.pinned.remove(key);
        self.expires_ms.remove(key);
        self.used -= len;
        Some(len)
    }
}

pub struct Lru {
    inner: Mutex<Inner>,
    capacity: u64,
    high: u64,
    low: u64,
    used_gauge: Arc<AtomicU64>,
}

impl Lru {
    pub fn new(capacity: u64, high: f64, low: f64, used_gauge: Arc<AtomicU64>) -> Self {
        Self {
            inner: Mutex::default(),
            capacity,
            high: (capacity as f64 * high) as u64,
            low: (capacity as f64 * low) as u64,
            used_gauge,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Restores state loaded from the index (oldest first after sorting):
    /// key, access sequence, length and retention.
    pub fn restore(&self, mut pages: Vec<(PageKey, u64, u64, Retention)>) {
        pages.sort_by_key(|(_, seq, _, _)| *seq);
        let mut inner = self.lock();
        for (key, _, len, retention) in pages {
            let seq = inner.next_seq;
            inner.next_seq += 1;
            inner.by_key.insert(key, (seq, len));
            inner.by_seq.insert(seq, key);
            inner.used += len;
            inner.set_retention(key, seq, retention);
        }
        self.used_gauge.store(inner.used, Ordering::Relaxed);
    }

    /// Adds or refreshes a page kept by LRU; returns its access sequence.
    #[cfg(test)]
    pub fn insert(&self, key: PageKey, len: u64) -> u64 {
        self.insert_kept(key, len, Retention::Lru)
    }

    /// Adds or refreshes a page; returns its new access sequence.
    pub fn insert_kept(&self, key: PageKey, len: u64, retention: Retention) -> u64 {
        let mut inner = self.lock();
        let seq = inner.next_seq;
        inner.next_seq += 1;
        if let Some((old_seq, old_len)) = inner.by_key.insert(key, (seq, len)) {
            inner.by_seq.remove(&old_seq);
            inner.used -= old_len;
        }
        inner.by_seq.insert(seq, key);
        inner.used += len;
        inner.set_retention(key, seq, retention);
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        seq
    }

    /// Marks a page as just used; `None` if it is not tracked.
    pub fn touch(&self, key: &PageKey) -> Option<u64> {
        let mut inner = self.lock();
        let seq = inner.next_seq;
        let (old_seq, len) = *inner.by_key.get(key)?;
        if inner.pinned.contains(key) {
            return Some(old_seq);
        }
        inner.next_seq += 1;
        inner.by_seq.remove(&old_seq);
        inner.by_seq.insert(seq, *key);
        inner.by_key.insert(*key, (seq, len));
        Some(seq)
    }

    pub fn remove(&self, key: &PageKey) -> Option<u64> {
        let mut inner = self.lock();
        let len = inner.forget(key)?;
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        Some(len)
    }

    pub fn contains(&self, key: &PageKey) -> bool {
        self.lock().by_key.contains_key(key)
    }

    pub fn used(&self) -> u64 {
        self.lock().used
    }

    pub fn over_high_watermark(&self) -> bool {
        let inner = self.lock();
        inner.used + inner.staged > self.high
    }

    /// Counts `len` staged bytes against the capacity; false when they
    /// would not fit even after evicting every committed page.
    pub fn reserve_staging(&self, len: u64) -> bool {
        let mut inner = self.lock();
        if inner.staged + len > self.capacity {
            return false;
        }
        inner.staged += len;
        true
    }

    pub fn release_staging(&self, len: u64) {
        let mut inner = self.lock();
        inner.staged = inner.staged.saturating_sub(len);
    }

    pub fn staged(&self) -> u64 {
        self.lock().staged
    }

    /// Bytes of pinned pages (part of [`Lru::used`]).
    pub fn pinned_bytes(&self) -> u64 {
        let inner = self.lock();
        inner
            .pinned
            .iter()
            .filter_map(|k| inner.by_key.get(k))
            .map(|(_, len)| len)
            .sum()
    }

    /// Takes pages whose TTL ran out by `now_ms` out of the accounting;
    /// the caller deletes them.
    pub fn take_expired(&self, now_ms: i64) -> Vec<(PageKey, u64)> {
        let mut inner = self.lock();
        let due: Vec<PageKey> = inner
            .expires_ms
            .iter()
            .filter(|(_, at)| **at <= now_ms)
            .map(|(k, _)| *k)
            .collect();
        let victims = due
            .into_iter()
            .filter_map(|k| inner.forget(&k).map(|len| (k, len)))
            .collect();
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        victims
    }

    /// Takes least-recently-used pages out of the accounting until usage
    /// is at the low watermark; the caller deletes them.
    pub fn take_victims(&self) -> Vec<(PageKey, u64)> {
        let mut inner = self.lock();
        let mut victims = Vec::new();
        if inner.used + inner.staged <= self.high {
            return victims;
        }
        while inner.used + inner.staged > self.low {
            let Some((_, key)) = inner.by_seq.pop_first() else {
                break;
            };
            if let Some(len) = inner.forget(&key) {
                victims.push((key, len));
            }
        }
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        victims
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> PageKey {
        PageKey([i; 32])
    }

    #[test]
    fn evicts_least_recent_down_to_low_watermark() {
        let lru = Lru::new(100, 0.9, 0.5, Arc::default());
        for i in 0..9 {
            lru.insert(key(i), 10);
        }
        assert!(!lru.over_high_watermark());
        lru.touch(&key(0));
        lru.insert(key(9), 10);
        assert!(lru.over_high_watermark());
        let victims: Vec<u8> = lru.take_victims().iter().map(|(k, _)| k.0[0]).collect();
        assert_eq!(victims, vec![1, 2, 3, 4, 5]);
        assert_eq!(lru.used(), 50);
        assert!(lru.touch(&key(0)).is_some());
        assert!(lru.touch(&key(1)).is_none());
    }

    #[test]
    fn pinned_pages_are_never_victims_and_expired_pages_leave_on_time() {
        let lru = Lru::new(100, 0.9, 0.5, Arc::default());
        lru.insert_kept(key(0), 30, Retention::Pinned);
        lru.insert_kept(key(1), 10, Retention::ExpiresAtMs(1_000));
        for i in 2..8 {
            lru.insert(key(i), 10);
        }
        assert_eq!(lru.used(), 100);
        assert_eq!(lru.pinned_bytes(), 30);
        // Touching a pinned page does not put it back in the LRU order.
        lru.touch(&key(0));
        let victims: Vec<PageKey> = lru.take_victims().into_iter().map(|(k, _)| k).collect();
        assert!(!victims.contains(&key(0)), "a pinned page was evicted");
        assert!(lru.contains(&key(0)));
        assert_eq!(lru.used(), 50);
        // The TTL page was evicted by LRU already or goes at its time.
        lru.insert_kept(key(9), 10, Retention::ExpiresAtMs(2_000));
        assert!(lru.take_expired(1_999).iter().all(|(k, _)| *k != key(9)));
        assert_eq!(lru.take_expired(2_000), vec![(key(9), 10)]);
        assert!(!lru.contains(&key(9)));
        // Removing a pinned page releases its bytes.
        assert_eq!(lru.remove(&key(0)), Some(30));
        assert_eq!(lru.pinned_bytes(), 0);
    }

    #[test]
    fn staged_upload_bytes_count_against_the_capacity() {
        let lru = Lru::new(100, 0.9, 0.5, Arc::default());
        for i in 0..5 {
            lru.insert(key(i), 10);
        }
        // Committed pages make room for staged ones.
        assert!(lru.reserve_staging(45));
        assert!(lru.over_high_watermark());
        assert_eq!(lru.take_victims().len(), 5);
        assert!(!lru.reserve_staging(60), "more than the capacity");
        lru.release_staging(45);
        assert_eq!(lru.staged(), 0);
    }
}
