//! Prefetch by plan (issue #35): a job that published its read order gets
//! the pages it reads next fetched ahead of it. The lead is kept in time:
//! each plan's reader pace (pages per second, from how its cursor moves)
//! times [`PlanPrefetchConfig::lead`], within a byte budget per job on
//! each worker. A prefetched page is an ordinary cached page; eviction by
//! plan keeps it, its next use being near.
//!
//! A prefetch never moves a plan's cursor (only client reads do), and a
//! read that finds its page still being prefetched waits for it and counts
//! as a miss ([`super::Served`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use lakecache_protocol::ObjectUri;

use super::{Cache, CacheError};
use crate::pages::{blocks_of, PageId, PageKey, CHECK_BLOCK};
use crate::store::ObjectMeta;

/// How far ahead of each job's readers a worker fetches.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanPrefetchConfig {
    /// Bytes one job's plans on one worker fetch ahead of their readers,
    /// at most (and never over a quarter of the cache); pages cached
    /// anyway do not count. 0 turns prefetch off.
    pub budget_bytes: u64,
    /// How far ahead in time: the reader's pace times this.
    pub lead: Duration,
}

impl Default for PlanPrefetchConfig {
    fn default() -> Self {
        Self {
            budget_bytes: 512 << 20,
            lead: Duration::from_secs(2),
        }
    }
}

/// How often the prefetcher looks at the plans' cursors.
const TICK: Duration = Duration::from_millis(20);
/// Pages one plan has in flight at most.
const IN_FLIGHT_PER_PLAN: usize = 16;
/// An epoch's start is a burst: the job renews its plans and every loader
/// reads its first batches at once, out of the lead the last epoch left.
/// For [`RENEWAL_BURST`] after a renewal, while clients are reading (a
/// read began within [`DEMAND_RECENT`]) and the lead is healthy
/// (nothing is missing within this share of it), nothing more is fetched:
/// fetches needed a second from now would slow the reads waited on now.
/// A lead with a gap nearer than that is filled as usual, and so is every
/// lead once the burst is over.
const DEMAND_FIRST_SHARE: u32 = 4;
/// See [`DEMAND_FIRST_SHARE`].
const RENEWAL_BURST: Duration = Duration::from_millis(500);
/// How recent a client's read must be for the worker to count as serving.
const DEMAND_RECENT: Duration = Duration::from_millis(10);
/// Pages fetched ahead of a reader whose pace is not known yet.
const START_LEAD_PAGES: u64 = 8;
/// A pace is measured over at least this long.
const PACE_WINDOW: Duration = Duration::from_millis(250);
/// How far ahead of its reader (at its pace) a plan's cached pages are
/// read from their files into memory, so that its reads do not wait on
/// the disk: page files are written around the page cache, and a 1 MiB
/// read of one took 0.8 ms alone and 3 ms four at a time on this
/// project's test VM, most of a cached sample's latency.
const STAGE_LEAD: Duration = Duration::from_millis(300);
/// Positions staged for a reader whose pace is not known yet (the start
/// of an epoch: its first batches).
const START_STAGE_POSITIONS: u64 = 16;
/// Memory for staged pages at most: on top of the read-ahead's room in
/// [`crate::fresh::FreshPages`].
const STAGE_ROOM: u64 = 64 << 20;

/// Room for staged pages, of a worker with `page_size` pages and
/// `memory_limit` bytes of memory.
pub(crate) fn stage_room(page_size: u64, memory_limit: u64) -> u64 {
    STAGE_ROOM.max(4 * page_size).min(memory_limit / 8)
}

/// What a plan reads of one page at one position: from `start` to `end`
/// (page-relative; pages are at most 64 MiB), the span of its entries
/// there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlannedRead {
    start: u32,
    end: u32,
}

impl PlannedRead {
    /// The part of the page at `page_start` (of `page_size` bytes) that
    /// the object range `start..end` reads.
    pub(crate) fn of(page_start: u64, start: u64, end: u64, page_size: u64) -> Self {
        let to_page = |at: u64| (at.clamp(page_start, page_start + page_size) - page_start) as u32;
        Self {
            start: to_page(start),
            end: to_page(end),
        }
    }

    /// The bytes of its page read there, page-relative.
    pub(crate) fn span(&self) -> (u32, u32) {
        (self.start, self.end)
    }

    /// This read and `next` (of the same page, at the same position).
    pub(crate) fn joined(self, next: Self) -> Self {
        Self {
            start: self.start.min(next.start),
            end: self.end.max(next.end),
        }
    }

    /// The part of a page of `len` bytes read; `None`: all of it.
    fn part(self, len: u64) -> Option<Range<u64>> {
        let range = u64::from(self.start)..u64::from(self.end).min(len);
        (range.start > 0 || range.end < len).then_some(range)
    }
}

/// One plan's pages, resolved for fetching: position `i` is page
/// `keys[i]`, page `at[i].1` of object `objects[at[i].0]`, of which the
/// plan reads `reads[i]` there.
pub(crate) struct PlanFetch {
    generation: u64,
    tenant: Option<Arc<str>>,
    objects: Vec<(ObjectUri, ObjectMeta)>,
    keys: Vec<PageKey>,
    at: Vec<(u32, u64)>,
    reads: Vec<PlannedRead>,
    progress: Mutex<Progress>,
}

/// How far a plan's prefetch got.
#[derive(Default)]
struct Progress {
    /// Fetches in flight: each page's block ranges (a whole page's are
    /// all of its blocks).
    in_flight: HashMap<PageKey, Vec<Range<usize>>>,
    /// Pages this plan fetched (or is fetching) for positions the reader
    /// has not reached: (position, bytes), in position order. They are
    /// what the budget counts; pages cached anyway are free.
    ahead: VecDeque<(u64, u64, PageKey)>,
    ahead_bytes: u64,
    /// Positions before this one were fetched or found cached.
    scanned_to: u64,
    /// Pages read from disk into memory, with the position each was
    /// read for.
    staged: HashSet<(PageKey, u64)>,
}

impl Progress {
    /// Fetches the reader has passed (`cursor`) no longer count. Not
    /// only from the front: after a renewal the fetches carried over sit
    /// before new ones for nearer positions (the scan starts again at the
    /// reader). Popping from the front only, one carried fetch far ahead
    /// held the whole budget while the reader passed everything behind it
    /// and prefetch stopped (plan-epochs through a mount: for about 1 s
    /// of epoch 2 it fetched nothing, and the epoch waited 8-10% against
    /// 1%).
    fn passed(&mut self, cursor: u64) {
        if self.ahead.iter().any(|&(pos, _, _)| pos < cursor) {
            self.ahead.retain(|&(pos, _, _)| pos >= cursor);
            self.ahead_bytes = self.ahead.iter().map(|&(_, len, _)| len).sum();
        }
    }

    /// Whether a fetch in flight for `key` takes in all of `blocks`.
    fn in_flight_covers(&self, key: &PageKey, blocks: &Range<usize>) -> bool {
        self.in_flight.get(key).is_some_and(|ranges| {
            ranges
                .iter()
                .any(|r| r.start <= blocks.start && blocks.end <= r.end)
        })
    }

    fn fetches_in_flight(&self) -> usize {
        self.in_flight.values().map(Vec::len).sum()
    }

    /// A fetch of `blocks` of `key` ended.
    fn fetched(&mut self, key: &PageKey, blocks: &Range<usize>) {
        if let Some(ranges) = self.in_flight.get_mut(key) {
            if let Some(i) = ranges.iter().position(|r| r == blocks) {
                ranges.swap_remove(i);
            }
            if ranges.is_empty() {
                self.in_flight.remove(key);
            }
        }
    }
}

impl PlanFetch {
    pub(crate) fn new(
        tenant: Option<Arc<str>>,
        objects: Vec<(ObjectUri, ObjectMeta)>,
        keys: Vec<PageKey>,
        at: Vec<(u32, u64)>,
        reads: Vec<PlannedRead>,
    ) -> Self {
        Self {
            generation: 0,
            tenant,
            objects,
            keys,
            at,
            reads,
            progress: Mutex::default(),
        }
    }

    /// How many positions from `from` on (`most` at most, and at least
    /// one) the plan reads within `bytes`, counting what it reads at
    /// each. Staging room is counted so, not in pages: a plan that reads
    /// 1 MiB samples of 4 MiB pages stages four times as many positions
    /// in the same memory. In plan-epochs at 2 ranks, the first 40 ms of
    /// epoch 2 (four loader workers filling their first batches at once)
    /// then read 0-3 MiB from disk of the 7-50 MiB served (9 runs), where
    /// a count of pages left 6-15 MiB of 24-31 MiB to it (2 runs).
    fn positions_within(&self, from: u64, most: u64, bytes: u64) -> u64 {
        let end = from.saturating_add(most).min(self.reads.len() as u64);
        let mut total = 0u64;
        let mut positions = 0;
        for pos in from..end {
            let (start, stop) = self.reads[pos as usize].span();
            total += u64::from(stop.saturating_sub(start));
            if total > bytes && positions > 0 {
                break;
            }
            positions += 1;
        }
        positions.max(1)
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A renewed plan (the next epoch's, published as it starts) takes
    /// over the pages its predecessor fetched ahead of the reader that it
    /// reads too: they still count against the job's budget. Otherwise
    /// the renewal fetched a whole budget more at once, and the epoch's
    /// first reads queued behind that burst of fetches and page writes
    /// (plan-epochs bench, 1 rank: epoch-2 data wait 1.7-2.4% renewed,
    /// 0.3-0.4% with the first plan left to run on).
    fn carry_ahead(&mut self, old: &Progress) {
        if old.ahead.is_empty() {
            return;
        }
        let wanted: HashSet<PageKey> = old.ahead.iter().map(|&(_, _, key)| key).collect();
        let mut first: HashMap<PageKey, u64> = HashMap::with_capacity(wanted.len());
        for (pos, key) in self.keys.iter().enumerate() {
            if wanted.contains(key) {
                first.entry(*key).or_insert(pos as u64);
            }
        }
        let mut ahead: Vec<(u64, u64, PageKey)> = old
            .ahead
            .iter()
            .filter_map(|&(_, len, key)| first.remove(&key).map(|pos| (pos, len, key)))
            .collect();
        ahead.sort_unstable_by_key(|&(pos, _, _)| pos);
        let progress = self.progress.get_mut().unwrap_or_else(|p| p.into_inner());
        progress.ahead_bytes = ahead.iter().map(|&(_, len, _)| len).sum();
        progress.ahead = ahead.into();
    }
}

/// The installed plans' fetch lists, by plan name.
#[derive(Default)]
pub(crate) struct PlanFetches {
    plans: Mutex<HashMap<String, Arc<PlanFetch>>>,
    installs: std::sync::atomic::AtomicU64,
    demand: DemandClock,
}

/// When a client last began a read here (noted while plans are
/// installed).
struct DemandClock {
    base: Instant,
    /// Microseconds after `base`; 0: never.
    last_us: std::sync::atomic::AtomicU64,
}

impl Default for DemandClock {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            last_us: Default::default(),
        }
    }
}

impl DemandClock {
    fn mark(&self, now: Instant) {
        let us = now.duration_since(self.base).as_micros() as u64;
        self.last_us
            .store(us.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    fn recent(&self, now: Instant) -> bool {
        let last = self.last_us.load(std::sync::atomic::Ordering::Relaxed);
        last != 0
            && now
                .duration_since(self.base)
                .saturating_sub(Duration::from_micros(last))
                < DEMAND_RECENT
    }
}

impl PlanFetches {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<PlanFetch>>> {
        self.plans.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn install(&self, name: &str, mut plan: PlanFetch) {
        plan.generation = self
            .installs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut plans = self.lock();
        if let Some(old) = plans.get(name) {
            plan.carry_ahead(&old.progress());
        }
        plans.insert(name.to_string(), Arc::new(plan));
    }

    /// A client's read began now (noted while plans are installed).
    pub(crate) fn demand_read(&self) {
        self.demand.mark(Instant::now());
    }

    fn snapshot(&self) -> Vec<(String, Arc<PlanFetch>)> {
        self.lock()
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// Drops plan `name` unless it was renewed since `generation`.
    fn remove(&self, name: &str, generation: u64) {
        let mut plans = self.lock();
        if plans.get(name).is_some_and(|p| p.generation == generation) {
            plans.remove(name);
        }
    }
}

/// The job a plan named `job/rank` belongs to.
fn job_of(name: &str) -> &str {
    name.rsplit_once('/').map_or(name, |(job, _)| job)
}

/// A plan's reader pace, from where its cursor was when.
struct Pace {
    generation: u64,
    /// When the plan was installed or last renewed.
    renewed: Instant,
    mark: (u64, Instant),
    pages_per_s: Option<f64>,
}

impl Pace {
    fn new(generation: u64, cursor: u64, now: Instant) -> Self {
        Self {
            generation,
            renewed: now,
            mark: (cursor, now),
            pages_per_s: None,
        }
    }

    fn observe(&mut self, cursor: u64, now: Instant) {
        let (at, since) = self.mark;
        let elapsed = now.duration_since(since);
        if elapsed < PACE_WINDOW {
            return;
        }
        let sample = cursor.saturating_sub(at) as f64 / elapsed.as_secs_f64();
        // A reader that stalls (between epochs, or waiting on a miss)
        // keeps most of its lead: the pace decays, never drops to 0 at once.
        self.pages_per_s = Some(match self.pages_per_s {
            None => sample,
            Some(old) => 0.6 * old + 0.4 * sample,
        });
        self.mark = (cursor, now);
    }

    fn lead_pages(&self, lead: Duration) -> u64 {
        match self.pages_per_s {
            None => START_LEAD_PAGES,
            Some(rate) => ((rate * lead.as_secs_f64()).ceil() as u64).max(2),
        }
    }

    /// While the worker is `serving` client reads just after a renewal:
    /// how near the reader a missing page must be to be fetched now
    /// ([`DEMAND_FIRST_SHARE`] of the lead). None: fetch as usual.
    fn burst_defer(&self, lead: Duration, serving: bool, now: Instant) -> Option<u64> {
        (serving && self.pages_per_s.is_some() && now.duration_since(self.renewed) < RENEWAL_BURST)
            .then(|| self.lead_pages(lead / DEMAND_FIRST_SHARE))
    }

    /// Positions to stage in memory ahead of the reader at its pace
    /// (before the room they need is counted).
    fn stage_positions(&self) -> u64 {
        match self.pages_per_s {
            None => START_STAGE_POSITIONS,
            Some(rate) => ((rate * STAGE_LEAD.as_secs_f64()).ceil() as u64).max(2),
        }
    }
}

/// Fetches the pages each plan reads next, every [`TICK`]; exits when the
/// cache is dropped or shuts down.
pub(crate) async fn prefetcher(cache: Weak<Cache>) {
    let mut paces: HashMap<String, Pace> = HashMap::new();
    loop {
        tokio::time::sleep(TICK).await;
        let Some(this) = cache.upgrade() else { return };
        if *this.closing.borrow() {
            return;
        }
        let config = this.config.plan_prefetch.clone();
        let plans = this.plan_fetches.snapshot();
        paces.retain(|name, _| plans.iter().any(|(n, _)| n == name));
        if config.budget_bytes == 0 || plans.is_empty() {
            continue;
        }
        let mut per_job: HashMap<&str, u64> = HashMap::new();
        for (name, _) in &plans {
            *per_job.entry(job_of(name)).or_default() += 1;
        }
        let budget = config.budget_bytes.min(this.config.capacity / 4);
        let now = Instant::now();
        let serving = this.plan_fetches.demand.recent(now);
        for (name, plan) in &plans {
            let Some(cursor) = this.lru.plan_cursor(name) else {
                // Expired (or replaced by a plan with no pages here).
                this.plan_fetches.remove(name, plan.generation);
                continue;
            };
            let pace = paces
                .entry(name.clone())
                .or_insert_with(|| Pace::new(plan.generation, cursor, now));
            if pace.generation != plan.generation {
                // Renewed (a new epoch, say): its reader goes on at the
                // pace it had, from the renewed plan's start.
                let known = pace.pages_per_s;
                *pace = Pace::new(plan.generation, cursor, now);
                pace.pages_per_s = known;
            }
            pace.observe(cursor, now);
            let share = budget / per_job.get(job_of(name)).copied().unwrap_or(1).max(1);
            // Half the staging room, shared by the plans: staged parts
            // are not pushed out by the next ones before they are read.
            let stage_bytes = stage_room(this.config.page_size, this.config.memory_limit)
                / 2
                / plans.len() as u64;
            let stage = plan.positions_within(cursor, pace.stage_positions(), stage_bytes);
            let lead = pace.lead_pages(config.lead);
            let defer = pace.burst_defer(config.lead, serving, now);
            this.prefetch_ahead(plan, cursor, lead, defer, stage, share);
            this.stage_ahead(name, plan, stage);
        }
    }
}

impl Cache {
    /// Starts fetches of `plan`'s pages from `cursor` on, `lead` pages
    /// ahead at most, while the pages it fetched ahead of the reader stay
    /// within `budget` bytes; none where the first missing page lies
    /// `defer` pages or more ahead (see [`DEMAND_FIRST_SHARE`]). Pages
    /// within `stage` of the reader are kept in memory too (see
    /// [`Self::stage_ahead`]).
    fn prefetch_ahead(
        self: &Arc<Self>,
        plan: &Arc<PlanFetch>,
        cursor: u64,
        lead: u64,
        mut defer: Option<u64>,
        stage: u64,
        budget: u64,
    ) {
        let ps = self.config.page_size;
        let end = cursor.saturating_add(lead).min(plan.keys.len() as u64);
        let mut progress = plan.progress();
        progress.passed(cursor);
        let tenant = plan.tenant.as_deref();
        // Fetching a page that is read after what it would evict only
        // moves a miss: Belady's rule applies to fetches ahead too.
        // Looked up once a page needs fetching: most ticks find none.
        let mut horizon: Option<Option<u64>> = None;
        let mut pos = progress.scanned_to.max(cursor);
        while pos < end {
            let key = plan.keys[pos as usize];
            let (obj, idx) = plan.at[pos as usize];
            let Some((uri, meta)) = plan.objects.get(obj as usize) else {
                pos += 1;
                continue;
            };
            let page_len = ps.min(meta.size.saturating_sub(idx * ps));
            // Only the part of the page the plan reads here, where that is
            // a part (see `Cache::clean_piece_of`).
            let part = plan
                .reads
                .get(pos as usize)
                .and_then(|read| read.part(page_len));
            let sub = part.clone().unwrap_or(0..page_len);
            let blocks = blocks_of(&sub);
            if progress.in_flight_covers(&key, &blocks)
                || self.fresh.covers(&key, &sub)
                || self.writing.holds(&key)
                || match part {
                    None => self.lru.holds_whole(&key),
                    Some(_) => self.lru.holds_blocks(&key, blocks.clone()),
                }
            {
                pos += 1;
                continue;
            }
            let len = match part {
                None => page_len,
                Some(_) => (blocks.len() as u64 * CHECK_BLOCK).min(page_len),
            };
            // The first missing page decides (pages before it are cached
            // or on their way).
            if defer
                .take()
                .is_some_and(|near| pos >= cursor.saturating_add(near))
            {
                break;
            }
            if progress.ahead_bytes + len > budget
                || progress.fetches_in_flight() >= IN_FLIGHT_PER_PLAN
            {
                break;
            }
            let horizon = *horizon.get_or_insert_with(|| self.lru.prefetch_horizon(tenant));
            if let Some(horizon) = horizon {
                let next_use = self.lru.plan_distance(&key, tenant);
                if next_use.is_none_or(|d| d >= horizon) {
                    break;
                }
            }
            progress
                .in_flight
                .entry(key)
                .or_default()
                .push(blocks.clone());
            progress.ahead.push_back((pos, len, key));
            progress.ahead_bytes += len;
            // A page read soon stays in memory; one read seconds from now
            // would only push out pages read sooner (it is staged from
            // its file when its reader gets near).
            let keep_fresh = pos < cursor.saturating_add(stage);
            pos += 1;
            let (this, plan, uri, meta) = (self.clone(), plan.clone(), uri.clone(), meta.clone());
            let tenant = plan.tenant.clone();
            tokio::spawn(crate::tenant::scope(tenant, async move {
                let fetched = this
                    .prefetch_page(&uri, &meta, (idx, key), part, keep_fresh)
                    .await;
                plan.progress().fetched(&key, &blocks);
                match fetched {
                    Ok(true) => this.metrics.plan_prefetched(len),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(%uri, page = idx, error = %e, "plan prefetch failed")
                    }
                }
            }));
        }
        progress.scanned_to = pos;
    }

    /// Reads the cached pages plan `name` reads within its next `stage`
    /// pages from their files into memory ([`crate::fresh::FreshPages`]),
    /// each once for the position it is read at: the reader's read is
    /// then served from memory, which it leaves once read whole. A staged
    /// read is not a read of the plan's and moves no cursor.
    fn stage_ahead(self: &Arc<Self>, name: &str, plan: &Arc<PlanFetch>, stage: u64) {
        let upcoming = self.lru.plan_upcoming(name, stage, stage as usize);
        let mut progress = plan.progress();
        let Some(&(first, _)) = upcoming.first() else {
            progress.staged.clear();
            return;
        };
        // Positions before the first unread one were read (or skipped).
        progress.staged.retain(|(_, at)| *at >= first);
        let ps = self.config.page_size;
        for (pos, key) in upcoming {
            let Some(&(obj, idx)) = plan.at.get(pos as usize) else {
                continue;
            };
            let Some((uri, meta)) = plan.objects.get(obj as usize) else {
                continue;
            };
            // Only the part of the page the plan reads there: staging a
            // 4 MiB page for one 1 MiB sample read four times its bytes
            // from disk, and the page then waited in memory for samples
            // read much later (plan-epochs at 4 MiB pages cost 7.0-7.7
            // CPU-s per GiB so). Each sample is staged as its own part:
            // with one part per page, a page whose other sample (or the
            // other rank's) was held waited until that was read, and the
            // reads of the samples after it went to disk (plan-epochs,
            // 2 ranks: 39% of epoch 2's reads, against 17% so).
            let len = ps.min(meta.size.saturating_sub(idx * ps));
            let Some(read) = plan.reads.get(pos as usize) else {
                continue;
            };
            let part = read.part(len);
            let sub = part.clone().unwrap_or(0..len);
            if progress.staged.contains(&(key, pos))
                || progress.in_flight.contains_key(&key)
                || !match &part {
                    None => self.lru.holds_whole(&key),
                    Some(sub) => self.lru.holds_blocks(&key, blocks_of(sub)),
                }
                || self.fresh.covers(&key, &sub)
                || self.writing.holds(&key)
            {
                continue;
            }
            let id = PageId::new(&uri.to_string(), &meta.etag, idx, ps, meta.size);
            progress.staged.insert((key, pos));
            let this = self.clone();
            tokio::spawn(async move {
                let start = sub.start;
                match this.read_local(key, id, sub).await {
                    Ok(bytes) => {
                        let len = bytes.len() as u64;
                        this.fresh.keep_part(key, start, bytes, &this.memory);
                        this.metrics.plan_staged(len);
                    }
                    // The reader's own read settles the page.
                    Err(e) => {
                        tracing::debug!(page = idx, error = %e, "staging a planned page failed")
                    }
                }
            });
        }
    }

    /// Whether the page holding `offset` of `uri`'s current version is
    /// cached (on disk or in memory), without reading it: a read would
    /// count as a plan's reader's.
    pub async fn is_cached(self: &Arc<Self>, uri: &ObjectUri, offset: u64) -> bool {
        let Ok(meta) = self.stat(uri).await else {
            return false;
        };
        let ps = self.config.page_size;
        let key = PageKey::new(&uri.to_string(), &meta.etag, offset / ps);
        let whole = 0..ps.min(meta.size.saturating_sub(offset / ps * ps));
        self.lru.holds_whole(&key) || self.fresh.covers(&key, &whole) || self.writing.holds(&key)
    }

    /// Fetches page `idx` unless cached: whole, or where `part` is given
    /// (page-relative), the blocks it touches. `Ok(true)` once written
    /// (the budget counts pages until then).
    async fn prefetch_page(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        (idx, key): (u64, PageKey),
        part: Option<Range<u64>>,
        keep_fresh: bool,
    ) -> Result<bool, CacheError> {
        let cached = match &part {
            None => self.lru.holds_whole(&key),
            Some(sub) => self.lru.holds_blocks(&key, blocks_of(sub)),
        };
        if cached {
            return Ok(false);
        }
        let id = PageId::new(
            &uri.to_string(),
            &meta.etag,
            idx,
            self.config.page_size,
            meta.size,
        );
        match part {
            None => {
                self.fetch_page(uri, meta, idx, key, id, keep_fresh).await?;
                self.writing.written(&key).await;
            }
            // Filled before the fetch returns.
            Some(sub) => {
                self.fetch_blocks(uri, meta, key, id, &sub).await?;
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(keys: &[PageKey]) -> PlanFetch {
        PlanFetch::new(
            None,
            Vec::new(),
            keys.to_vec(),
            vec![(0, 0); keys.len()],
            vec![PlannedRead::of(0, 0, 1, 1); keys.len()],
        )
    }

    #[test]
    fn a_renewed_plan_keeps_counting_the_pages_fetched_ahead_for_it() {
        let key = |i: u64| PageKey::new("s3://b/shard", "etag", i);
        let fetches = PlanFetches::default();
        fetches.install("job/0", plan(&[key(0), key(1), key(2), key(3)]));
        {
            let old = fetches.snapshot()[0].1.clone();
            let mut progress = old.progress();
            // The reader is at 1; pages 2 and 3 were fetched ahead of it.
            for (pos, k) in [(2, key(2)), (3, key(3))] {
                progress.ahead.push_back((pos, 10, k));
            }
            progress.ahead_bytes = 20;
            progress.scanned_to = 4;
        }
        // The next epoch reads 3 first, then 5, then 2 and 3 again; 3 is
        // counted once, where it is first read.
        fetches.install("job/0", plan(&[key(3), key(5), key(2), key(3)]));
        let renewed = fetches.snapshot()[0].1.clone();
        let progress = renewed.progress();
        let carried: Vec<(u64, u64)> = progress.ahead.iter().map(|&(p, l, _)| (p, l)).collect();
        assert_eq!(carried, vec![(0, 10), (2, 10)]);
        assert_eq!(progress.ahead_bytes, 20);
        assert_eq!(
            progress.scanned_to, 0,
            "the renewed plan is scanned from its start"
        );
        drop(progress);
        // Another plan name takes nothing over.
        fetches.install("job/1", plan(&[key(3)]));
        let other = fetches
            .snapshot()
            .into_iter()
            .find(|(n, _)| n == "job/1")
            .unwrap()
            .1;
        assert_eq!(other.progress().ahead_bytes, 0);
    }

    #[test]
    fn a_planned_read_is_the_part_of_its_page_the_entries_there_read() {
        const PS: u64 = 4 << 20;
        const MIB: u64 = 1 << 20;
        // Page 1 of an object: bytes 4-8 MiB.
        let sample = PlannedRead::of(PS, 5 * MIB, 6 * MIB, PS);
        assert_eq!(sample.part(PS), Some(MIB..2 * MIB));
        // An entry running over the page from before it to after it.
        assert_eq!(PlannedRead::of(PS, 0, 20 * MIB, PS).part(PS), None);
        // Entries read one after another at one position join.
        let rest = PlannedRead::of(PS, 6 * MIB, 8 * MIB, PS);
        assert_eq!(sample.joined(rest).part(PS), Some(MIB..4 * MIB));
        assert_eq!(
            PlannedRead::of(PS, 4 * MIB, 5 * MIB, PS)
                .joined(sample.joined(rest))
                .part(PS),
            None
        );
        // A short last page is whole once read to its end.
        assert_eq!(PlannedRead::of(PS, 4 * MIB, 5 * MIB, PS).part(MIB), None);
        assert_eq!(
            PlannedRead::of(PS, 4 * MIB + 1, 5 * MIB, PS).part(MIB),
            Some(1..MIB)
        );
    }

    #[test]
    fn fetches_the_reader_passed_stop_counting_wherever_they_sit() {
        let key = |i: u64| PageKey::new("s3://b/shard", "etag", i);
        let mut progress = Progress::default();
        // Carried over by a renewal (far ahead), then new fetches near
        // the reader, pushed after it.
        for (pos, k) in [(400, key(0)), (5, key(1)), (6, key(2)), (120, key(3))] {
            progress.ahead.push_back((pos, 10, k));
        }
        progress.ahead_bytes = 40;
        progress.passed(7);
        let left: Vec<u64> = progress.ahead.iter().map(|&(p, _, _)| p).collect();
        assert_eq!(left, vec![400, 120]);
        assert_eq!(progress.ahead_bytes, 20);
        progress.passed(7);
        assert_eq!(progress.ahead_bytes, 20);
    }

    #[test]
    fn a_plan_name_belongs_to_its_job() {
        assert_eq!(job_of("train/3"), "train");
        assert_eq!(job_of("a/b/0"), "a/b");
        assert_eq!(job_of("solo"), "solo");
    }

    #[test]
    fn the_lead_follows_the_readers_pace_and_decays_when_it_stalls() {
        let t0 = Instant::now();
        let mut pace = Pace::new(0, 0, t0);
        assert_eq!(pace.lead_pages(Duration::from_secs(2)), START_LEAD_PAGES);
        // 40 pages in half a second: 80 pages/s, 160 pages in 2 s.
        pace.observe(40, t0 + Duration::from_millis(500));
        assert_eq!(pace.lead_pages(Duration::from_secs(2)), 160);
        // Too soon to measure: unchanged.
        pace.observe(41, t0 + Duration::from_millis(600));
        assert_eq!(pace.lead_pages(Duration::from_secs(2)), 160);
        // A stall lowers the pace without dropping it to nothing.
        pace.observe(40, t0 + Duration::from_millis(1000));
        let lead = pace.lead_pages(Duration::from_secs(2));
        assert!(lead > 2 && lead < 160, "{lead}");
    }

    #[test]
    fn while_clients_read_just_after_a_renewal_a_healthy_lead_waits() {
        let t0 = Instant::now();
        let mut pace = Pace::new(0, 0, t0);
        pace.observe(40, t0 + Duration::from_millis(500));
        let lead = Duration::from_secs(2);
        let soon = t0 + RENEWAL_BURST / 2;
        assert_eq!(pace.burst_defer(lead, false, soon), None);
        assert_eq!(pace.burst_defer(lead, true, soon), Some(40));
        // Past the renewal's burst, a reader reading all the time gets
        // its lead filled as usual.
        let later = t0 + RENEWAL_BURST + Duration::from_millis(1);
        assert_eq!(pace.burst_defer(lead, true, later), None);
        // So does a reader of unknown pace (a new job).
        let new = Pace::new(0, 0, t0);
        assert_eq!(new.burst_defer(lead, true, soon), None);

        let clock = DemandClock::default();
        let base = clock.base;
        assert!(!clock.recent(base + Duration::from_millis(1)), "never read");
        clock.mark(base + Duration::from_millis(100));
        assert!(clock.recent(base + Duration::from_millis(100)));
        assert!(clock.recent(base + Duration::from_millis(109)));
        assert!(!clock.recent(base + DEMAND_RECENT + Duration::from_millis(101)));
    }
}
