//! Whole pages just fetched from S3, kept in memory until their reader
//! has had them. Page files are written with `O_DIRECT` (no page-cache
//! copy), so without this a sequential reader's next request for a page
//! the read-ahead fetched a moment ago would read it back from disk. A
//! plan's staged read of part of a page (one sample of it) is kept the
//! same way: one part per page, served where a read falls within it.
//!
//! Bounded in bytes, each page holding its share of the process's memory
//! budget (a page that does not fit is simply not kept). A page leaves
//! once every byte kept of it was served, when it is dropped from the cache,
//! when newer pages push it out, or after [`MAX_AGE`] unread (a reader
//! that stopped must not hold budget that uploads wait for).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use lakecache_protocol::memory::{MemoryBudget, Reservation};

use crate::pages::PageKey;

/// Pages unread this long after their fetch are let go.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(20);

struct Kept {
    /// Where `bytes` start in the page.
    start: u64,
    bytes: Bytes,
    kept_at: Instant,
    /// Bytes of this part served so far.
    served: u64,
    _held: Reservation,
}

#[derive(Default)]
struct Inner {
    /// Each page's parts, none overlapping another.
    pages: HashMap<PageKey, Vec<Kept>>,
    /// Parts by page and start, in the order kept; may name parts gone.
    order: VecDeque<(PageKey, u64)>,
    /// Parts held, over all pages.
    parts: usize,
    bytes: u64,
}

impl Kept {
    fn covers(&self, range: &Range<u64>) -> bool {
        range.start < range.end && self.start <= range.start && range.end <= self.end()
    }

    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

impl Inner {
    /// Lets go of parts kept longer than [`MAX_AGE`] (oldest first).
    fn expire(&mut self, now: Instant) {
        while let Some(&(key, start)) = self.order.front() {
            let age = self
                .part(&key, start)
                .map(|k| now.duration_since(k.kept_at));
            if age.is_some_and(|age| age < MAX_AGE) {
                break;
            }
            self.remove_part(&key, start);
            self.order.pop_front();
        }
    }

    fn part(&self, key: &PageKey, start: u64) -> Option<&Kept> {
        self.pages.get(key)?.iter().find(|k| k.start == start)
    }

    fn remove_part(&mut self, key: &PageKey, start: u64) {
        let Some(parts) = self.pages.get_mut(key) else {
            return;
        };
        if let Some(i) = parts.iter().position(|k| k.start == start) {
            self.bytes -= parts.swap_remove(i).bytes.len() as u64;
            self.parts -= 1;
        }
        if parts.is_empty() {
            self.pages.remove(key);
        }
    }

    fn remove_page(&mut self, key: &PageKey) {
        if let Some(parts) = self.pages.remove(key) {
            self.bytes -= parts.iter().map(|k| k.bytes.len() as u64).sum::<u64>();
            self.parts -= parts.len();
        }
    }
}

pub(crate) struct FreshPages {
    inner: Mutex<Inner>,
    capacity: u64,
}

impl FreshPages {
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `bytes` (a whole page) if the budget has room for it now.
    pub(crate) fn keep(&self, key: PageKey, bytes: Bytes, budget: &MemoryBudget) {
        self.keep_part(key, 0, bytes, budget);
    }

    /// Keeps `bytes`, the page's bytes from `start` on, in place of any
    /// part kept of it that they overlap, if the budget has room for them
    /// now. Other parts of the page stay: a plan stages each sample it
    /// reads soon, and two ranks read different samples of one page.
    pub(crate) fn keep_part(&self, key: PageKey, start: u64, bytes: Bytes, budget: &MemoryBudget) {
        let len = bytes.len() as u64;
        if len == 0 || len > self.capacity {
            return;
        }
        let Some(held) = budget.try_reserve(len) else {
            return;
        };
        let mut inner = self.lock();
        inner.expire(Instant::now());
        let overlapping: Vec<u64> = inner.pages.get(&key).map_or(Vec::new(), |parts| {
            parts
                .iter()
                .filter(|k| k.start < start + len && start < k.end())
                .map(|k| k.start)
                .collect()
        });
        for old in overlapping {
            inner.remove_part(&key, old);
        }
        while inner.bytes + len > self.capacity {
            let Some((oldest, at)) = inner.order.pop_front() else {
                break;
            };
            inner.remove_part(&oldest, at);
        }
        let kept = Kept {
            start,
            bytes,
            kept_at: Instant::now(),
            served: 0,
            _held: held,
        };
        inner.pages.entry(key).or_default().push(kept);
        inner.bytes += len;
        inner.parts += 1;
        inner.order.push_back((key, start));
        // `order` may name parts gone; keep it from growing without bound.
        if inner.order.len() > 4 * inner.parts + 64 {
            let Inner { pages, order, .. } = &mut *inner;
            order.retain(|(k, at)| {
                pages
                    .get(k)
                    .is_some_and(|p| p.iter().any(|x| x.start == *at))
            });
        }
    }

    /// `range` (page-relative) of a kept page, where a part kept of it
    /// holds the range; a part leaves once all of it was served.
    pub(crate) fn serve(&self, key: &PageKey, range: &Range<u64>) -> Option<Bytes> {
        let mut inner = self.lock();
        inner.expire(Instant::now());
        let kept = inner
            .pages
            .get_mut(key)?
            .iter_mut()
            .find(|k| k.covers(range))?;
        let at = (range.start - kept.start) as usize..(range.end - kept.start) as usize;
        let out = kept.bytes.slice(at);
        kept.served += range.end - range.start;
        if kept.served >= kept.bytes.len() as u64 {
            let start = kept.start;
            inner.remove_part(key, start);
        }
        Some(out)
    }

    /// Whether some of `key` is held (a page just fetched, or a part of
    /// one staged, not yet read whole).
    #[cfg(test)]
    pub(crate) fn holds(&self, key: &PageKey) -> bool {
        self.lock().pages.contains_key(key)
    }

    /// Whether a part held of `key` holds `range` (page-relative).
    pub(crate) fn covers(&self, key: &PageKey, range: &Range<u64>) -> bool {
        self.lock()
            .pages
            .get(key)
            .is_some_and(|parts| parts.iter().any(|k| k.covers(range)))
    }

    pub(crate) fn forget(&self, key: &PageKey) {
        self.lock().remove_page(key);
    }

    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.lock().bytes
    }
}

/// Pages fetched from S3 whose page file is being written behind their
/// readers: served from memory, and counted as present by read-ahead,
/// until indexed. Unbounded here because each entry's bytes are held by
/// its writer anyway (under a fetch permit and the memory budget).
#[derive(Default)]
pub(crate) struct PagesInWrite {
    pages: Mutex<HashMap<PageKey, Bytes>>,
    /// Woken as each write ends.
    done: tokio::sync::Notify,
}

impl PagesInWrite {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PageKey, Bytes>> {
        self.pages.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn insert(&self, key: PageKey, bytes: Bytes) {
        self.lock().insert(key, bytes);
    }

    pub(crate) fn remove(&self, key: &PageKey) {
        self.lock().remove(key);
        self.done.notify_waiters();
    }

    /// Removes `key` when the returned guard drops.
    pub(crate) fn unmark_on_drop(&self, key: PageKey) -> Unmark<'_> {
        Unmark { pages: self, key }
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Returns once `key` is not being written (now, or when its write
    /// ends, whether or not it succeeded).
    pub(crate) async fn written(&self, key: &PageKey) {
        loop {
            // Created before the check: a write ending in between wakes it.
            let ended = self.done.notified();
            if !self.holds(key) {
                return;
            }
            ended.await;
        }
    }

    pub(crate) fn holds(&self, key: &PageKey) -> bool {
        self.lock().contains_key(key)
    }

    /// `range` of the page, if it is being written and holds the range.
    pub(crate) fn serve(&self, key: &PageKey, range: &Range<u64>) -> Option<Bytes> {
        let pages = self.lock();
        let bytes = pages.get(key)?;
        let fits = range.start < range.end && range.end <= bytes.len() as u64;
        fits.then(|| bytes.slice(range.start as usize..range.end as usize))
    }
}

pub(crate) struct Unmark<'a> {
    pages: &'a PagesInWrite,
    key: PageKey,
}

impl Drop for Unmark<'_> {
    fn drop(&mut self) {
        self.pages.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> PageKey {
        PageKey([n; 32])
    }

    #[test]
    fn pages_are_served_until_read_whole_and_stay_within_bytes_and_budget() {
        let budget = MemoryBudget::new(1 << 30);
        let fresh = FreshPages::new(3 << 20);
        let page = Bytes::from(vec![7u8; 1 << 20]);
        fresh.keep(key(1), page.clone(), &budget);
        // Served in pieces; gone once every byte went out.
        let half = 512 * 1024;
        assert_eq!(
            fresh.serve(&key(1), &(0..half)).unwrap().len(),
            half as usize
        );
        assert!(
            fresh.serve(&key(1), &(0..(1 << 21))).is_none(),
            "past the page"
        );
        assert!(fresh.serve(&key(1), &(half..1 << 20)).is_some());
        assert!(fresh.serve(&key(1), &(0..1)).is_none());
        assert_eq!(fresh.bytes(), 0);
        // Newer pages push the oldest out at the byte bound.
        for n in 2..=5 {
            fresh.keep(key(n), page.clone(), &budget);
        }
        assert_eq!(fresh.bytes(), 3 << 20);
        assert!(fresh.serve(&key(2), &(0..1)).is_none());
        assert!(fresh.serve(&key(5), &(0..1)).is_some());
        fresh.forget(&key(5));
        assert!(fresh.serve(&key(5), &(0..1)).is_none());
        // Nothing is kept that the memory budget cannot hold now.
        let tight = MemoryBudget::new(1 << 20);
        let _all = tight.try_reserve(1 << 20).unwrap();
        fresh.keep(key(9), page.clone(), &tight);
        assert!(fresh.serve(&key(9), &(0..1)).is_none());
    }

    #[test]
    fn a_part_of_a_page_is_served_where_reads_fall_within_it() {
        const MIB: u64 = 1 << 20;
        let budget = MemoryBudget::new(1 << 30);
        let fresh = FreshPages::new(8 * MIB);
        // Bytes 1-2 MiB of a 4 MiB page: byte i of the part is i % 251.
        let part: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
        fresh.keep_part(key(1), MIB, Bytes::from(part.clone()), &budget);
        assert_eq!(fresh.bytes(), MIB);
        assert!(fresh.holds(&key(1)));
        assert!(fresh.covers(&key(1), &(MIB..2 * MIB)));
        assert!(!fresh.covers(&key(1), &(0..4 * MIB)), "not the whole page");
        assert!(fresh.serve(&key(1), &(0..10)).is_none(), "before the part");
        assert!(fresh.serve(&key(1), &(2 * MIB - 1..2 * MIB + 1)).is_none());
        // Offsets are the page's: 100 bytes at 1 MiB + 7 are the part's 7..107.
        let got = fresh.serve(&key(1), &(MIB + 7..MIB + 107)).unwrap();
        assert_eq!(&got[..], &part[7..107]);
        // Gone once every byte of the part went out.
        assert!(fresh.serve(&key(1), &(MIB..2 * MIB)).is_some());
        assert!(!fresh.holds(&key(1)));
        assert_eq!(fresh.bytes(), 0);
    }

    #[test]
    fn parts_of_one_page_are_kept_apart_and_an_overlapping_one_replaces() {
        const MIB: u64 = 1 << 20;
        let budget = MemoryBudget::new(1 << 30);
        let fresh = FreshPages::new(8 * MIB);
        let part = |b: u8| Bytes::from(vec![b; MIB as usize]);
        // Two samples of one page, staged for two readers.
        fresh.keep_part(key(1), 0, part(1), &budget);
        fresh.keep_part(key(1), 2 * MIB, part(2), &budget);
        assert_eq!(fresh.bytes(), 2 * MIB);
        assert!(fresh.covers(&key(1), &(0..MIB)));
        assert!(fresh.covers(&key(1), &(2 * MIB..3 * MIB)));
        assert!(!fresh.covers(&key(1), &(MIB..2 * MIB)));
        assert!(
            !fresh.covers(&key(1), &(0..3 * MIB)),
            "no read spans two parts"
        );
        assert_eq!(
            fresh.serve(&key(1), &(2 * MIB..2 * MIB + 4)).unwrap()[..],
            [2; 4]
        );
        // A part overlapping one kept takes its place.
        fresh.keep_part(key(1), MIB / 2, part(3), &budget);
        assert_eq!(fresh.bytes(), 2 * MIB);
        assert!(!fresh.covers(&key(1), &(0..1)));
        assert_eq!(fresh.serve(&key(1), &(MIB..MIB + 2)).unwrap()[..], [3; 2]);
        // Each leaves once read whole; the page with its last.
        assert!(fresh.serve(&key(1), &(2 * MIB..3 * MIB)).is_some());
        assert!(fresh.holds(&key(1)));
        assert!(fresh.serve(&key(1), &(MIB / 2..MIB / 2 + MIB)).is_some());
        assert!(!fresh.holds(&key(1)));
        assert_eq!(fresh.bytes(), 0);
        // The byte bound lets the oldest part go first.
        for n in 0..9 {
            fresh.keep_part(key(2), n * MIB, part(n as u8), &budget);
        }
        assert_eq!(fresh.bytes(), 8 * MIB);
        assert!(!fresh.covers(&key(2), &(0..1)));
        assert!(fresh.covers(&key(2), &(8 * MIB..9 * MIB)));
        fresh.forget(&key(2));
        assert_eq!(fresh.bytes(), 0);
    }

    #[tokio::test]
    async fn pages_in_write_are_served_until_removed() {
        let writing = std::sync::Arc::new(PagesInWrite::default());
        writing.insert(key(1), Bytes::from(vec![3u8; 1 << 20]));
        assert!(writing.holds(&key(1)));
        assert_eq!(writing.serve(&key(1), &(10..20)).unwrap(), vec![3u8; 10]);
        assert!(
            writing.serve(&key(1), &(0..(2 << 20))).is_none(),
            "past the page"
        );
        assert!(writing.serve(&key(1), &(5..5)).is_none(), "empty");
        let waiting = writing.clone();
        let task = tokio::spawn(async move { waiting.written(&key(1)).await });
        tokio::task::yield_now().await;
        assert!(
            !task.is_finished(),
            "returned while the page was being written"
        );
        writing.remove(&key(1));
        task.await.unwrap();
        assert_eq!(writing.len(), 0);
        assert!(!writing.holds(&key(1)));
        // A write that ends by panicking still unmarks its page.
        writing.insert(key(2), Bytes::from_static(b"page"));
        let w = writing.clone();
        let died = tokio::spawn(async move {
            let _unmark = w.unmark_on_drop(key(2));
            panic!("the page write failed hard");
        })
        .await;
        assert!(died.is_err());
        assert!(!writing.holds(&key(2)));
        writing.written(&key(2)).await;
        assert!(writing.serve(&key(1), &(0..1)).is_none());
    }

    #[test]
    fn pages_left_unread_are_let_go_and_their_budget_returned() {
        let budget = MemoryBudget::new(4 << 20);
        let fresh = FreshPages::new(4 << 20);
        fresh.keep(key(1), Bytes::from(vec![1u8; 1 << 20]), &budget);
        assert!(budget.available() < 4 << 20);
        let later = Instant::now() + MAX_AGE + Duration::from_secs(1);
        fresh.lock().expire(later);
        assert_eq!(fresh.bytes(), 0);
        assert_eq!(budget.available(), 4 << 20);
        assert!(fresh.serve(&key(1), &(0..1)).is_none());
    }
}
