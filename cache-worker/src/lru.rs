//! In-memory LRU accounting of pages on disk. The lock is held only to
//! move entries; files are deleted outside it, so eviction never blocks
//! reads of other pages.

use std::collections::{BTreeMap, HashMap};
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

    /// Restores state loaded from the index (oldest first after sorting).
    pub fn restore(&self, mut pages: Vec<(PageKey, u64, u64)>) {
        pages.sort_by_key(|(_, seq, _)| *seq);
        let mut inner = self.lock();
        for (key, _, len) in pages {
            let seq = inner.next_seq;
            inner.next_seq += 1;
            inner.by_key.insert(key, (seq, len));
            inner.by_seq.insert(seq, key);
            inner.used += len;
        }
        self.used_gauge.store(inner.used, Ordering::Relaxed);
    }

    /// Adds or refreshes a page; returns its new access sequence.
    pub fn insert(&self, key: PageKey, len: u64) -> u64 {
        let mut inner = self.lock();
        let seq = inner.next_seq;
        inner.next_seq += 1;
        if let Some((old_seq, old_len)) = inner.by_key.insert(key, (seq, len)) {
            inner.by_seq.remove(&old_seq);
            inner.used -= old_len;
        }
        inner.by_seq.insert(seq, key);
        inner.used += len;
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        seq
    }

    /// Marks a page as just used; `None` if it is not tracked.
    pub fn touch(&self, key: &PageKey) -> Option<u64> {
        let mut inner = self.lock();
        let seq = inner.next_seq;
        let (old_seq, len) = *inner.by_key.get(key)?;
        inner.next_seq += 1;
        inner.by_seq.remove(&old_seq);
        inner.by_seq.insert(seq, *key);
        inner.by_key.insert(*key, (seq, len));
        Some(seq)
    }

    pub fn remove(&self, key: &PageKey) -> Option<u64> {
        let mut inner = self.lock();
        let (seq, len) = inner.by_key.remove(key)?;
        inner.by_seq.remove(&seq);
        inner.used -= len;
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
            if let Some((_, len)) = inner.by_key.remove(&key) {
                inner.used -= len;
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
