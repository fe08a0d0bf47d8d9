//! In-memory LRU accounting of pages on disk. The lock is held only to
//! move entries; files are deleted outside it, so eviction never blocks
//! reads of other pages.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::pages::{FilledBlocks, PageKey};
use crate::plan_order::{PlanError, PlanOrder, ReadKind};

/// Least recent pages [`Lru::prefetch_horizon`] looks among for one no
/// plan reads again, and furthest planned pages it looks at for a cached
/// one, at most: it runs every prefetcher tick, under the lock.
const HORIZON_SCAN: usize = 64;
const HORIZON_SCAN_PLANNED: usize = 4096;

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
    /// Pages fetched for a tenant, and each tenant's share.
    tenant_of: HashMap<PageKey, Arc<str>>,
    tenants: HashMap<Arc<str>, TenantPages>,
    /// Read orders published by jobs: the eviction order of the pages
    /// they read again (see `plan_order`).
    plans: PlanOrder,
    /// Pages some of whose blocks are not filled yet (a random reader's
    /// misses, and a plan's reads of part of a page, fill only what they
    /// touch), with the blocks known filled. Not known after a restart
    /// until a read finds a hole (then no block is known filled).
    partly_filled: HashMap<PageKey, FilledBlocks>,
}

/// One tenant's pages: bytes, and the evictable ones in access order.
#[derive(Default)]
struct TenantPages {
    used: u64,
    by_seq: BTreeMap<u64, PageKey>,
}

/// A page from the index, restored at start.
pub struct RestoredPage {
    pub key: PageKey,
    pub seq: u64,
    pub len: u64,
    pub retention: Retention,
    pub tenant: Option<Arc<str>>,
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
        self.partly_filled.remove(key);
        self.expires_ms.remove(key);
        self.used -= len;
        if let Some(tenant) = self.tenant_of.remove(key) {
            if let Some(t) = self.tenants.get_mut(&tenant) {
                t.used -= len;
                t.by_seq.remove(&seq);
                if t.used == 0 {
                    self.tenants.remove(&tenant);
                }
            }
        }
        Some(len)
    }

    /// Evictable pages to free `need` bytes. Recency decides whose page
    /// goes: each least-recently-used page is taken, unless its own
    /// tenant's plans read it again; then that tenant gives up another of
    /// its pages instead (see [`Self::tenant_order`]). So a plan reorders
    /// its tenant's evictions and never shifts them onto another tenant.
    fn pick_victims(&self, need: u64) -> Vec<PageKey> {
        let mut picked = Vec::new();
        let mut taken = HashSet::new();
        let mut orders: HashMap<Option<Arc<str>>, std::vec::IntoIter<PageKey>> = HashMap::new();
        let mut freed = 0;
        for key in self.by_seq.values() {
            if freed >= need {
                break;
            }
            if taken.contains(key) {
                continue;
            }
            let tenant = self.tenant_of.get(key).cloned();
            let victim = if self.plans.is_empty()
                || self.plans.distance_for(key, tenant.as_deref()).is_none()
            {
                Some(*key)
            } else {
                let order = orders
                    .entry(tenant.clone())
                    .or_insert_with(|| self.tenant_order(tenant.as_deref()).into_iter());
                order.find(|k| !taken.contains(k))
            };
            let Some(victim) = victim else { continue };
            taken.insert(victim);
            freed += self.by_key.get(&victim).map_or(0, |(_, len)| *len);
            picked.push(victim);
        }
        picked
    }

    /// `tenant`'s evictable pages (`None`: pages of no tenant), in the
    /// order its plans give: the least recently used of those its plans do
    /// not read again, then those read again furthest in the future.
    fn tenant_order(&self, tenant: Option<&str>) -> Vec<PageKey> {
        let mine = |k: &PageKey| self.tenant_of.get(k).map(|t| &**t) == tenant;
        // A tenant's own access order where it has one; pages of no
        // tenant are picked out of the whole cache's.
        let by_seq = match tenant {
            Some(t) => self.tenants.get(t).map(|p| &p.by_seq),
            None => Some(&self.by_seq),
        };
        let unplanned = by_seq
            .into_iter()
            .flat_map(|s| s.values())
            .filter(|k| mine(k) && self.plans.distance_for(k, tenant).is_none())
            .copied();
        let planned = self
            .plans
            .furthest_first(tenant)
            .filter(|k| self.by_key.contains_key(k) && !self.pinned.contains(k) && mine(k));
        unplanned.chain(planned).collect()
    }

    /// Counts `key` as `len` bytes from now on.
    fn resize(&mut self, key: &PageKey, len: u64) {
        let Some((_, old)) = self.by_key.get_mut(key) else {
            return;
        };
        let old = std::mem::replace(old, len);
        self.used = self.used - old + len;
        if let Some(tenant) = self.tenant_of.get(key) {
            if let Some(t) = self.tenants.get_mut(tenant) {
                t.used = t.used - old + len;
            }
        }
    }

    fn add(
        &mut self,
        key: PageKey,
        len: u64,
        retention: Retention,
        tenant: Option<Arc<str>>,
    ) -> u64 {
        self.forget(&key);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_key.insert(key, (seq, len));
        self.by_seq.insert(seq, key);
        self.used += len;
        self.set_retention(key, seq, retention);
        if let Some(tenant) = tenant {
            let t = self.tenants.entry(tenant.clone()).or_default();
            t.used += len;
            // Pinned pages count against the tenant but are never evicted.
            if retention != Retention::Pinned {
                t.by_seq.insert(seq, key);
            }
            self.tenant_of.insert(key, tenant);
        }
        seq
    }
}

pub struct Lru {
    inner: Mutex<Inner>,
    capacity: u64,
    high: u64,
    low: u64,
    used_gauge: Arc<AtomicU64>,
    /// Whether any plan is installed, read without the lock on every
    /// client read.
    planned: AtomicBool,
}

impl Lru {
    pub fn new(capacity: u64, high: f64, low: f64, used_gauge: Arc<AtomicU64>) -> Self {
        Self {
            inner: Mutex::default(),
            capacity,
            high: (capacity as f64 * high) as u64,
            low: (capacity as f64 * low) as u64,
            used_gauge,
            planned: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Restores state loaded from the index (oldest first after sorting):
    /// key, access sequence, length and retention.
    pub fn restore(&self, mut pages: Vec<RestoredPage>) {
        pages.sort_by_key(|p| p.seq);
        let mut inner = self.lock();
        for p in pages {
            inner.add(p.key, p.len, p.retention, p.tenant);
        }
        self.used_gauge.store(inner.used, Ordering::Relaxed);
    }

    /// Adds or refreshes a page kept by LRU; returns its access sequence.
    #[cfg(test)]
    pub fn insert(&self, key: PageKey, len: u64) -> u64 {
        self.insert_kept(key, len, Retention::Lru, None)
    }

    /// Adds or refreshes a page, fetched for `tenant`; returns its new
    /// access sequence.
    pub fn insert_kept(
        &self,
        key: PageKey,
        len: u64,
        retention: Retention,
        tenant: Option<Arc<str>>,
    ) -> u64 {
        let mut inner = self.lock();
        let seq = inner.add(key, len, retention, tenant);
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        seq
    }

    /// Bytes of each tenant's pages.
    pub fn tenant_usage(&self) -> Vec<(String, u64)> {
        let inner = self.lock();
        let mut out: Vec<(String, u64)> = inner
            .tenants
            .iter()
            .map(|(t, p)| (t.to_string(), p.used))
            .collect();
        out.sort();
        out
    }

    pub fn tenant_used(&self, tenant: &str) -> u64 {
        self.lock().tenants.get(tenant).map_or(0, |t| t.used)
    }

    /// Takes `tenant`'s pages out of the accounting until its bytes are
    /// at most `down_to`, least recently used first, or in its plans'
    /// order when it has plans; the caller deletes them.
    pub fn take_tenant_victims(&self, tenant: &str, down_to: u64) -> Vec<(PageKey, u64)> {
        let mut inner = self.lock();
        let mut victims = Vec::new();
        if inner.tenants.get(tenant).is_none_or(|t| t.used <= down_to) {
            return victims;
        }
        // Without plans, its oldest pages one by one (this runs at each
        // insert past the quota: no pass over the tenant's pages).
        let order = if inner.plans.has_tenant(Some(tenant)) {
            inner.tenant_order(Some(tenant))
        } else {
            inner.tenants.get(tenant).map_or_else(Vec::new, |t| {
                let over = t.used - down_to;
                let mut freed = 0;
                t.by_seq
                    .values()
                    .take_while(|k| {
                        let more = freed < over;
                        freed += inner.by_key.get(*k).map_or(0, |(_, len)| *len);
                        more
                    })
                    .copied()
                    .collect()
            })
        };
        for key in order {
            if inner.tenants.get(tenant).is_none_or(|t| t.used <= down_to) {
                break;
            }
            if let Some(len) = inner.forget(&key) {
                victims.push((key, len));
            }
        }
        self.used_gauge.store(inner.used, Ordering::Relaxed);
        victims
    }

    /// Installs or renews a job's plan (see `plan_order`), live for `ttl`.
    pub fn install_plan(
        &self,
        name: &str,
        tenant: Option<Arc<str>>,
        pages: &[PageKey],
        spans: &[(u32, u32)],
        ttl: std::time::Duration,
    ) -> Result<(), PlanError> {
        let expires = std::time::Instant::now() + ttl;
        let mut inner = self.lock();
        inner.plans.install(name, tenant, pages, spans, expires)?;
        self.planned.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Where plan `name`'s reader is (see `PlanOrder::cursor`); `None`
    /// once the plan expired.
    pub fn plan_cursor(&self, name: &str) -> Option<u64> {
        self.lock().plans.cursor(name)
    }

    /// See [`crate::plan_order::PlanOrder::upcoming`].
    pub fn plan_upcoming(&self, name: &str, lead: u64, limit: usize) -> Vec<(u64, PageKey)> {
        self.lock().plans.upcoming(name, lead, limit)
    }

    pub fn has_plans(&self) -> bool {
        self.planned.load(Ordering::Relaxed)
    }

    /// A client read `key` (a hit or a miss): the plans move on. Returns
    /// whether some plan reads it again after this read.
    pub fn planned_read(&self, key: &PageKey, part: std::ops::Range<u64>, kind: ReadKind) -> bool {
        let mut inner = self.lock();
        inner.plans.read_part(key, Some(part), kind);
        inner.plans.distance(key).is_some()
    }

    /// How soon (in plan entries) `tenant`'s plans must read a page for
    /// fetching it ahead to beat keeping what eviction would take for it:
    /// the next use of the planned page that would go first. `None` while
    /// there is room, or pages no plan reads again to evict (among the
    /// least recent [`HORIZON_SCAN`]). Looks at [`HORIZON_SCAN_PLANNED`]
    /// of the furthest planned pages at most.
    pub fn prefetch_horizon(&self, tenant: Option<&str>) -> Option<u64> {
        let inner = self.lock();
        if inner.used + inner.staged < self.low {
            return None;
        }
        let unplanned = inner.by_seq.values().take(HORIZON_SCAN).any(|k| {
            let owner = inner.tenant_of.get(k).map(|t| &**t);
            inner.plans.distance_for(k, owner).is_none()
        });
        if unplanned {
            return None;
        }
        // Bounded under the lock: past HORIZON_SCAN_PLANNED pages not
        // cached, the victim is nearer than the last one looked at, which
        // then bounds the horizon from above (prefetch may fetch a little
        // too far).
        let mut looked = None;
        for key in inner
            .plans
            .furthest_first(tenant)
            .take(HORIZON_SCAN_PLANNED)
        {
            if inner.by_key.contains_key(&key) && !inner.pinned.contains(&key) {
                return inner.plans.distance_for(&key, tenant);
            }
            looked = Some(key);
        }
        inner.plans.distance_for(&looked?, tenant)
    }

    /// Whether some plan reads `key` (now or later).
    pub fn is_planned(&self, key: &PageKey) -> bool {
        self.has_plans() && self.lock().plans.distance(key).is_some()
    }

    /// How soon `tenant`'s plans read `key`, in plan entries.
    pub fn plan_distance(&self, key: &PageKey, tenant: Option<&str>) -> Option<u64> {
        self.lock().plans.distance_for(key, tenant)
    }

    /// Drops plans their jobs stopped renewing; returns how many.
    pub fn expire_plans(&self, now: std::time::Instant) -> usize {
        let mut inner = self.lock();
        let expired = inner.plans.expire(now);
        self.planned
            .store(!inner.plans.is_empty(), Ordering::Relaxed);
        expired
    }

    /// Marks a page as just used; `None` if it is not tracked. (A read
    /// moves the plans through [`Self::planned_read`], once per read.)
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
        if let Some(tenant) = inner.tenant_of.get(key).cloned() {
            if let Some(t) = inner.tenants.get_mut(&tenant) {
                t.by_seq.remove(&old_seq);
                t.by_seq.insert(seq, *key);
            }
        }
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

    /// Whether `key` is on disk with every block filled (as far as this
    /// worker knows: see `Inner::partly_filled`).
    pub fn holds_whole(&self, key: &PageKey) -> bool {
        let inner = self.lock();
        inner.by_key.contains_key(key) && !inner.partly_filled.contains_key(key)
    }

    /// Whether `key` is on disk with `blocks` filled, as far as this
    /// worker knows.
    pub fn holds_blocks(&self, key: &PageKey, blocks: Range<usize>) -> bool {
        let inner = self.lock();
        inner.by_key.contains_key(key)
            && inner
                .partly_filled
                .get(key)
                .is_none_or(|filled| filled.covers(blocks))
    }

    /// Records that a tracked page lacks blocks a read wanted, without
    /// knowing which it holds (its bytes stay counted as they were); an
    /// untracked page is left alone (it was evicted meanwhile).
    pub fn set_partly_filled(&self, key: &PageKey) {
        let mut inner = self.lock();
        if inner.by_key.contains_key(key) {
            inner.partly_filled.entry(*key).or_default();
        }
    }

    /// Records which blocks of a tracked page are filled after a fill, and
    /// counts only their `bytes`: a page filled a sample at a time takes
    /// the room of what it holds, not of the whole page.
    pub fn set_filled(&self, key: &PageKey, filled: FilledBlocks, whole: bool, bytes: u64) {
        let mut inner = self.lock();
        if !inner.by_key.contains_key(key) {
            return;
        }
        if whole {
            inner.partly_filled.remove(key);
        } else {
            inner.partly_filled.insert(*key, filled);
        }
        inner.resize(key, bytes);
        self.used_gauge.store(inner.used, Ordering::Relaxed);
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
        let need = (inner.used + inner.staged).saturating_sub(self.low);
        for key in inner.pick_victims(need) {
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
    fn a_partly_filled_page_is_not_held_whole_until_refilled_or_rewritten() {
        let lru = Lru::new(100, 0.9, 0.5, Arc::default());
        // Not tracked: nothing to mark.
        lru.set_partly_filled(&key(1));
        lru.insert(key(1), 10);
        assert!(lru.holds_whole(&key(1)));
        lru.set_partly_filled(&key(1));
        assert!(lru.contains(&key(1)) && !lru.holds_whole(&key(1)));
        assert!(!lru.holds_blocks(&key(1), 0..1), "no block is known");
        lru.set_filled(&key(1), FilledBlocks::default(), true, 10);
        assert!(lru.holds_whole(&key(1)) && lru.holds_blocks(&key(1), 0..4));
        // Written whole again (re-added), or evicted: the mark goes.
        lru.set_partly_filled(&key(1));
        lru.insert(key(1), 10);
        assert!(lru.holds_whole(&key(1)));
        lru.set_partly_filled(&key(1));
        lru.remove(&key(1));
        lru.insert(key(1), 10);
        assert!(lru.holds_whole(&key(1)));
    }

    #[test]
    fn a_partly_filled_page_counts_the_bytes_it_holds() {
        let used = Arc::new(AtomicU64::new(0));
        let lru = Lru::new(100, 0.9, 0.5, used.clone());
        lru.insert_kept(key(1), 40, Retention::Lru, Some("t".into()));
        lru.insert(key(2), 40);
        assert_eq!(lru.used(), 80);
        // Two of page 1's four blocks.
        lru.set_filled(&key(1), FilledBlocks::of_range(1..3), false, 20);
        assert_eq!((lru.used(), used.load(Ordering::Relaxed)), (60, 60));
        assert_eq!(lru.tenant_used("t"), 20);
        assert!(lru.holds_blocks(&key(1), 1..3) && !lru.holds_blocks(&key(1), 0..2));
        assert!(!lru.holds_whole(&key(1)));
        // Filled whole: its whole length again.
        lru.set_filled(&key(1), FilledBlocks::of_range(0..4), true, 40);
        assert_eq!((lru.used(), lru.tenant_used("t")), (80, 40));
        assert!(lru.holds_whole(&key(1)));
        // Eviction frees what a page is counted as.
        lru.set_filled(&key(2), FilledBlocks::of_range(0..1), false, 10);
        assert_eq!(lru.remove(&key(2)), Some(10));
        assert_eq!(lru.used(), 40);
        // A page evicted meanwhile is not brought back by its fill.
        lru.set_filled(&key(2), FilledBlocks::of_range(0..2), false, 20);
        assert!(!lru.contains(&key(2)));
        assert_eq!(lru.used(), 40);
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
        lru.insert_kept(key(0), 30, Retention::Pinned, None);
        lru.insert_kept(key(1), 10, Retention::ExpiresAtMs(1_000), None);
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
        lru.insert_kept(key(9), 10, Retention::ExpiresAtMs(2_000), None);
        assert!(lru.take_expired(1_999).iter().all(|(k, _)| *k != key(9)));
        assert_eq!(lru.take_expired(2_000), vec![(key(9), 10)]);
        assert!(!lru.contains(&key(9)));
        // Removing a pinned page releases its bytes.
        assert_eq!(lru.remove(&key(0)), Some(30));
        assert_eq!(lru.pinned_bytes(), 0);
    }

    #[test]
    fn a_tenant_over_its_share_loses_its_own_oldest_pages_first() {
        let lru = Lru::new(1000, 0.9, 0.5, Arc::default());
        let (a, b): (Arc<str>, Arc<str>) = ("team-a".into(), "team-b".into());
        lru.insert_kept(key(0), 100, Retention::Lru, Some(a.clone()));
        lru.insert_kept(key(1), 100, Retention::Pinned, Some(b.clone()));
        for i in 2..8 {
            lru.insert_kept(key(i), 100, Retention::Lru, Some(b.clone()));
        }
        lru.touch(&key(2)); // b's oldest evictable is now key(3)
        assert_eq!(lru.tenant_used("team-b"), 700);
        let victims: Vec<PageKey> = lru
            .take_tenant_victims("team-b", 450)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(victims, vec![key(3), key(4), key(5)]);
        assert_eq!(lru.tenant_used("team-b"), 400);
        assert!(lru.contains(&key(0)), "another tenant's page was taken");
        assert!(lru.contains(&key(1)), "a pinned page was taken");
        // Pinned pages are never victims, even below the target.
        let rest = lru.take_tenant_victims("team-b", 0);
        assert_eq!(rest.len(), 3);
        assert_eq!(lru.tenant_used("team-b"), 100);
        assert_eq!(
            lru.tenant_usage(),
            vec![("team-a".to_string(), 100), ("team-b".to_string(), 100)]
        );
        lru.remove(&key(1));
        assert_eq!(lru.tenant_usage(), vec![("team-a".to_string(), 100)]);
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
