//! Directory-order prefetch. A reader that opens a directory's files one
//! after another, in listing order or in natural-number order (`f2`
//! before `f10`, as fio names its files), gets the next files fetched
//! whole while it reads the current one: a cold small file then costs a
//! share of a round trip to S3 instead of a whole one.
//!
//! The window is bounded in bytes and files, held against the mount's
//! memory budget, and dropped when the reader changes pattern or stops
//! opening files for [`IDLE_CANCEL`].

use std::cmp::Ordering as CmpOrdering;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lakecache_protocol::ObjectUri;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::data_plane::{read_exact, DataPlane};
use crate::dir::{CachedListing, Listed};
use crate::error::FsError;
use crate::inode::Kind;
use crate::memory::{MemoryBudget, Reservation};

/// In-order opens before the window opens (two may be chance).
const OPENS_BEFORE_PREFETCH: u32 = 3;
/// How far (in files) an open may land from the furthest one so far and
/// still count as in order: loader workers reading interleaved files
/// arrive a little out of order.
const REORDER_SLACK: usize = 16;
/// Prefetches in flight at once, per mount.
const FETCHES_IN_FLIGHT: usize = 16;
/// Most files fetched ahead of one reader.
const MAX_FILES_AHEAD: usize = 128;
/// Largest file fetched whole ahead of its open; larger ones stream with
/// read-ahead once opened, and the window waits at them.
pub const PREFETCH_FILE_MAX: u64 = 8 << 20;
/// A window whose reader opened nothing for this long is dropped.
pub const IDLE_CANCEL: Duration = Duration::from_secs(2);
/// Directories followed at once; the longest idle is dropped first.
const MAX_RUNS: usize = 64;
/// Larger listings are followed in listing order only (sorting them
/// naturally would stall an open).
const NATURAL_ORDER_MAX: usize = 100_000;

/// Counts for tests and `/metrics`.
#[derive(Default, Debug)]
pub struct PrefetchStats {
    /// Files whose fetch was started ahead of their open.
    pub started: AtomicU64,
    /// Prefetched files an open took.
    pub used: AtomicU64,
    /// Prefetched files dropped unopened (cancelled, skipped, changed).
    pub wasted: AtomicU64,
    /// The most bytes any window held (fetched or in flight).
    pub peak_window_bytes: AtomicU64,
}

/// A prefetched file handed to its open: the fetch (maybe still running)
/// and the memory it holds.
pub struct Prefetched {
    pub fetch: JoinHandle<Result<Bytes, FsError>>,
    pub memory: Reservation,
}

pub struct DirPrefetch {
    data: Arc<dyn DataPlane>,
    budget: Arc<MemoryBudget>,
    bucket: String,
    window_bytes: u64,
    fetches: Arc<Semaphore>,
    runs: Mutex<HashMap<u64, DirRun>>,
    /// The node-local tier: files whole there are read locally (or
    /// passed through), so they are not fetched ahead.
    tier: Option<Arc<crate::local_tier::LocalTier>>,
    pub stats: Arc<PrefetchStats>,
}

/// One of the two orders a reader may follow.
struct Order {
    /// `rank[i]`: position of listing entry `i` (`None`: listing order).
    rank: Option<Vec<u32>>,
    /// `at[p]`: the listing entry at position `p` (`None`: listing order).
    at: Option<Vec<u32>>,
    /// The furthest position opened in the current run.
    frontier: Option<usize>,
    /// In-order opens in the current run.
    streak: u32,
}

impl Order {
    fn listing() -> Self {
        Self {
            rank: None,
            at: None,
            frontier: None,
            streak: 0,
        }
    }

    /// Natural-number order, or `None` where it is the listing order.
    fn natural(entries: &[Listed]) -> Option<Self> {
        if entries.len() > NATURAL_ORDER_MAX {
            return None;
        }
        let mut at: Vec<u32> = (0..entries.len() as u32).collect();
        at.sort_by(|&a, &b| natural_cmp(&entries[a as usize].name, &entries[b as usize].name));
        if at.iter().enumerate().all(|(p, &i)| p == i as usize) {
            return None;
        }
        let mut rank = vec![0u32; at.len()];
        for (p, &i) in at.iter().enumerate() {
            rank[i as usize] = p as u32;
        }
        Some(Self {
            rank: Some(rank),
            at: Some(at),
            frontier: None,
            streak: 0,
        })
    }

    fn position(&self, index: usize) -> usize {
        self.rank.as_ref().map_or(index, |r| r[index] as usize)
    }

    fn entry_at(&self, position: usize) -> usize {
        self.at.as_ref().map_or(position, |a| a[position] as usize)
    }

    /// Notes an open at `position`; whether it continues the run.
    fn note(&mut self, position: usize) -> bool {
        let in_order = self.frontier.is_some_and(|f| {
            (position > f && position - f <= REORDER_SLACK)
                || (position <= f && f - position <= REORDER_SLACK)
        });
        if in_order {
            // Only the very next file counts toward a window: a reader
            // following the other order lands near, but not next.
            if self.frontier.is_some_and(|f| position == f + 1) {
                self.streak += 1;
            }
            self.frontier = self.frontier.max(Some(position));
        } else {
            self.streak = 1;
            self.frontier = Some(position);
        }
        in_order
    }
}

/// A reader's progress through one directory.
struct DirRun {
    listing: CachedListing,
    orders: Vec<Order>,
    /// Which of `orders` drives the window.
    following: Option<usize>,
    last_open: Instant,
    /// Fetched or in flight and not yet opened, by key.
    window: HashMap<String, Entry>,
    window_bytes: u64,
    /// The next position the window would fetch.
    next: usize,
}

struct Entry {
    etag: String,
    size: u64,
    position: usize,
    fetch: Option<JoinHandle<Result<Bytes, FsError>>>,
    memory: Reservation,
    stats: Arc<PrefetchStats>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        if let Some(fetch) = self.fetch.take() {
            fetch.abort();
            self.stats.wasted.fetch_add(1, Ordering::Relaxed);
            crate::metrics::global().dir_prefetch("wasted");
        }
    }
}

impl DirRun {
    fn new(listing: CachedListing) -> Self {
        let mut orders = vec![Order::listing()];
        orders.extend(Order::natural(&listing.entries));
        Self {
            listing,
            orders,
            following: None,
            last_open: Instant::now(),
            window: HashMap::new(),
            window_bytes: 0,
            next: 0,
        }
    }

    fn cancel(&mut self) {
        self.window.clear();
        self.window_bytes = 0;
        self.following = None;
    }

    fn take(&mut self, key: &str) -> Option<Entry> {
        let entry = self.window.remove(key)?;
        self.window_bytes -= entry.size;
        Some(entry)
    }
}

impl DirPrefetch {
    /// `window_bytes`: what one reader's window may hold (0: off).
    pub fn new(
        data: Arc<dyn DataPlane>,
        budget: Arc<MemoryBudget>,
        bucket: &str,
        window_bytes: u64,
    ) -> Self {
        Self {
            data,
            budget,
            bucket: bucket.to_string(),
            window_bytes,
            fetches: Arc::new(Semaphore::new(FETCHES_IN_FLIGHT)),
            runs: Mutex::default(),
            tier: None,
            stats: Arc::default(),
        }
    }

    /// Skips files the node-local tier holds whole.
    pub fn set_tier(&mut self, tier: Arc<crate::local_tier::LocalTier>) {
        self.tier = Some(tier);
    }

    /// Whether a window may open at all (a zero window turns it off).
    pub fn enabled(&self) -> bool {
        self.window_bytes > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, DirRun>> {
        self.runs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A file of directory `dir` (listed as `listing`) is opened for
    /// reading at version `etag`: returns its prefetched bytes when the
    /// window holds them, and moves the window along.
    pub fn on_open(
        &self,
        dir: u64,
        listing: Option<CachedListing>,
        name: &str,
        key: &str,
        etag: &str,
        size: u64,
    ) -> Option<Prefetched> {
        if !self.enabled() {
            return None;
        }
        let mut runs = self.lock();
        let mut taken = runs.get_mut(&dir).and_then(|run| run.take(key));
        if taken
            .as_ref()
            .is_some_and(|e| e.etag != etag || e.size != size)
        {
            // Fetched at a version the open no longer sees.
            taken = None;
        }
        let prefetched = taken.and_then(|mut e| {
            let fetch = e.fetch.take()?;
            self.stats.used.fetch_add(1, Ordering::Relaxed);
            crate::metrics::global().dir_prefetch("used");
            Some(Prefetched {
                fetch,
                memory: std::mem::replace(&mut e.memory, Reservation::none()),
            })
        });
        // A window follows the listing it started from: the directory
        // listed again meanwhile (entry TTL, lookups) does not reset it.
        let following = runs.get(&dir).filter(|r| r.following.is_some());
        let (listing, index) = match following.and_then(|r| Some((r, r.listing.position(name)?))) {
            Some((run, index)) => (run.listing.clone(), index),
            None => {
                let Some(listing) = listing else {
                    return prefetched;
                };
                let Some(index) = listing.position(name) else {
                    return prefetched;
                };
                (listing, index)
            }
        };
        if runs.len() >= MAX_RUNS && !runs.contains_key(&dir) {
            let oldest = runs
                .iter()
                .min_by_key(|(_, r)| r.last_open)
                .map(|(d, _)| *d);
            if let Some(oldest) = oldest {
                runs.remove(&oldest);
            }
        }
        let run = runs
            .entry(dir)
            .or_insert_with(|| DirRun::new(listing.clone()));
        if !Arc::ptr_eq(&run.listing.entries, &listing.entries) {
            // Listed again since, and no window: positions moved.
            *run = DirRun::new(listing);
        }
        run.last_open = Instant::now();
        let continued: Vec<bool> = run
            .orders
            .iter_mut()
            .map(|o| {
                let position = o.position(index);
                o.note(position)
            })
            .collect();
        match run.following {
            Some(f) if continued[f] => {}
            Some(_) => run.cancel(), // the reader changed pattern
            None => {}
        }
        if run.following.is_none() {
            run.following = run
                .orders
                .iter()
                .position(|o| o.streak >= OPENS_BEFORE_PREFETCH);
            if let Some(f) = run.following {
                run.next = run.orders[f].frontier.unwrap_or(0) + 1;
            }
        }
        if let Some(f) = run.following {
            let frontier = run.orders[f].frontier.unwrap_or(0);
            // What the reader went past is not going to be opened.
            let passed: Vec<String> = run
                .window
                .iter()
                .filter(|(_, e)| e.position + REORDER_SLACK < frontier)
                .map(|(k, _)| k.clone())
                .collect();
            for k in passed {
                run.take(&k);
            }
            run.next = run.next.max(frontier + 1);
            self.top_up(run, f);
        }
        prefetched
    }

    /// Starts fetches until the window is full in files or bytes, the
    /// memory budget says no, or it meets a file too large to prefetch.
    fn top_up(&self, run: &mut DirRun, following: usize) {
        while run.window.len() < MAX_FILES_AHEAD && run.next < run.listing.entries.len() {
            let entry = &run.listing.entries[run.orders[following].entry_at(run.next)];
            if entry.kind != Kind::File || entry.meta.size == 0 {
                run.next += 1;
                continue;
            }
            let size = entry.meta.size;
            // A listing without ETags (some stores) names no version.
            let Some(etag) = entry.meta.etag.clone().filter(|e| !e.is_empty()) else {
                return;
            };
            if size > PREFETCH_FILE_MAX || run.window_bytes + size > self.window_bytes {
                return;
            }
            let Some(memory) = self.budget.try_reserve(size) else {
                return;
            };
            let Ok(uri) = ObjectUri::new(&self.bucket, &entry.key) else {
                run.next += 1;
                continue;
            };
            let local = self
                .tier
                .as_ref()
                .and_then(|t| t.get(&uri.to_string(), &etag));
            if local.is_some_and(|o| o.is_complete()) {
                run.next += 1;
                continue;
            }
            let (data, fetches) = (self.data.clone(), self.fetches.clone());
            let tag = etag.clone();
            let fetch = tokio::spawn(async move {
                let _permit = fetches.acquire_owned().await;
                read_exact(data.as_ref(), &uri, 0..size, &tag)
                    .await
                    .map_err(FsError::from)
            });
            run.window.insert(
                entry.key.clone(),
                Entry {
                    etag,
                    size,
                    position: run.next,
                    fetch: Some(fetch),
                    memory,
                    stats: self.stats.clone(),
                },
            );
            run.window_bytes += size;
            self.stats
                .peak_window_bytes
                .fetch_max(run.window_bytes, Ordering::Relaxed);
            self.stats.started.fetch_add(1, Ordering::Relaxed);
            run.next += 1;
        }
    }

    /// Drops the windows of readers that stopped opening files.
    pub fn expire(&self, idle: Duration) {
        self.lock().retain(|_, run| run.last_open.elapsed() < idle);
    }

    /// Bytes held in all windows now.
    pub fn held_bytes(&self) -> u64 {
        self.lock().values().map(|r| r.window_bytes).sum()
    }
}

/// Names compared with digit runs as numbers (`f2` < `f10`), otherwise
/// bytewise; ties (`f01` and `f1`) fall back to bytewise.
pub fn natural_cmp(a: &str, b: &str) -> CmpOrdering {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        if x[i].is_ascii_digit() && y[j].is_ascii_digit() {
            let (si, sj) = (i, j);
            while i < x.len() && x[i].is_ascii_digit() {
                i += 1;
            }
            while j < y.len() && y[j].is_ascii_digit() {
                j += 1;
            }
            let trim = |d: &[u8]| -> usize { d.iter().take_while(|&&c| c == b'0').count() };
            let (dx, dy) = (&x[si..i], &y[sj..j]);
            let (dx, dy) = (&dx[trim(dx)..], &dy[trim(dy)..]);
            let by_number = dx.len().cmp(&dy.len()).then_with(|| dx.cmp(dy));
            if by_number != CmpOrdering::Equal {
                return by_number;
            }
        } else {
            if x[i] != y[j] {
                return x[i].cmp(&y[j]);
            }
            i += 1;
            j += 1;
        }
    }
    (x.len() - i).cmp(&(y.len() - j)).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::natural_cmp;
    use std::cmp::Ordering::*;

    #[test]
    fn numbers_in_names_compare_as_numbers() {
        assert_eq!(natural_cmp("f2", "f10"), Less);
        assert_eq!(natural_cmp("small.0.9", "small.0.10"), Less);
        assert_eq!(natural_cmp("a10b2", "a10b10"), Less);
        assert_eq!(natural_cmp("f01", "f1"), Less, "ties fall back to bytes");
        assert_eq!(natural_cmp("f1", "f1"), Equal);
        assert_eq!(natural_cmp("f", "f1"), Less);
        assert_eq!(natural_cmp("b", "a9"), Greater);
        let mut names = vec!["x.10", "x.9", "x.100", "x.0", "x.1"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, ["x.0", "x.1", "x.9", "x.10", "x.100"]);
    }
}
