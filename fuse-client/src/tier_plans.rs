//! Plans on the node-local tier (issue #35): a loader that published its
//! rank's read order for the epoch (through the tier socket) gets the
//! next planned objects fetched whole into this node's tier ahead of its
//! reads, as the workers do into their caches. A mount without a tier
//! holds the next planned ranges (samples) in memory instead
//! ([`PlanRanges`]). The lead is kept in time:
//! the reader's pace through the plan (bytes of planned entries passed
//! per second) times [`LEAD`], within the byte budget
//! (`--local-cache-plan-prefetch`, split among the plans held).
//!
//! Where the reader is comes from what the mount sees: opens of planned
//! files, reads through the tier socket, and the notes a Python client
//! sends when it starts on a file it reads itself. A note matches the
//! object's first planned entry at or after the reader (a little behind
//! it too: loader workers run a few samples apart), never one more than
//! [`WINDOW`] entries ahead.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lakecache_protocol::ObjectUri;
use tokio::sync::{Notify, Semaphore};

use crate::complete::Completer;
use crate::data_plane::DataPlane;
use crate::local_tier::LocalTier;
use crate::plan_ranges::PlanRanges;

/// Default bytes fetched ahead, all plans together.
pub const DEFAULT_TIER_PLAN_PREFETCH: u64 = 512 << 20;
/// How far ahead (in time at the reader's pace) the tier keeps planned
/// objects.
pub const LEAD: Duration = Duration::from_secs(2);
/// Entries fetched ahead before a pace is known.
const START_ENTRIES: usize = 2;
/// Plans held at most; the one renewed longest ago goes first.
pub const MAX_PLANS: usize = 16;
const SLACK: usize = 64;
const WINDOW: usize = 4096;
const TICK: Duration = Duration::from_millis(20);
/// Objects being looked up (stat) for prefetch at once.
const LOOKUPS: usize = 4;
/// The longest a plan lives unless renewed.
pub const MAX_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierPlanError {
    #[error("plan entry {index}: range {start}..{end} is empty or reversed")]
    BadRange { index: usize, start: u64, end: u64 },
    #[error("plan entry {index}: object {object} is not in the plan's {objects} objects")]
    BadObject {
        index: usize,
        object: u32,
        objects: usize,
    },
    #[error("plan object {index}: {uri:?}: {why}")]
    BadUri {
        index: usize,
        uri: String,
        why: String,
    },
    #[error("ttl_s is {0}; it must be 1 to {max}", max = MAX_TTL.as_secs())]
    BadTtl(u64),
    #[error("a plan lists at most {limit} entries; this one lists {entries}")]
    TooLong { entries: usize, limit: usize },
}

#[derive(Debug, Default)]
pub struct TierPlanStats {
    /// Objects asked for whole because a plan reads them soon.
    pub prefetched_objects: AtomicU64,
    /// Notes that moved a plan's reader.
    pub moved: AtomicU64,
}

struct Plan {
    objects: Vec<ObjectUri>,
    index: HashMap<String, u32>,
    order: Vec<(u32, u64, u64)>,
    /// Bytes of the entries before each position (one more than entries).
    before: Vec<u64>,
    /// Each object's positions, ascending.
    positions: HashMap<u32, Vec<usize>>,
    /// One past the furthest entry read.
    reached: usize,
    /// Entries read (a note takes the first one of its object not taken).
    taken: Vec<bool>,
    expires: Instant,
    renewed: Instant,
    /// Objects already asked for in this plan.
    requested: HashSet<u32>,
    /// Positions whose range was asked for into memory (see `plan_ranges`).
    ranged: HashSet<usize>,
    pace: Pace,
}

/// Bytes of plan passed per second, decaying rather than dropping when
/// the reader pauses.
struct Pace {
    at: Instant,
    bytes: u64,
    per_s: f64,
}

impl Plan {
    fn note(&mut self, object: u32, offset: Option<u64>) -> bool {
        let Some(positions) = self.positions.get(&object) else {
            return false;
        };
        let from = self.reached.saturating_sub(SLACK);
        let first = positions.partition_point(|&p| p < from);
        for &p in &positions[first..] {
            if p > self.reached + WINDOW {
                break;
            }
            let (_, start, end) = self.order[p];
            if self.taken[p] || offset.is_some_and(|o| o < start || o >= end) {
                continue;
            }
            self.taken[p] = true;
            if p + 1 > self.reached {
                self.reached = p + 1;
                return true;
            }
            return false;
        }
        false
    }

    /// Bytes to keep ahead of the reader.
    fn lead(&mut self, budget: u64, now: Instant) -> u64 {
        let passed = self.before[self.reached];
        let elapsed = now.duration_since(self.pace.at);
        if elapsed >= Duration::from_millis(250) {
            let rate = (passed - self.pace.bytes) as f64 / elapsed.as_secs_f64();
            self.pace.per_s = if rate >= self.pace.per_s {
                rate
            } else {
                0.8 * self.pace.per_s + 0.2 * rate
            };
            self.pace = Pace {
                at: now,
                bytes: passed,
                per_s: self.pace.per_s,
            };
        }
        let start_end = (self.reached + START_ENTRIES).min(self.order.len());
        let start = self.before[start_end] - passed;
        let by_pace = (self.pace.per_s * LEAD.as_secs_f64()) as u64;
        by_pace.max(start).min(budget)
    }

    /// Entries within `lead` bytes of the reader whose ranges were not
    /// asked for yet: (object, start, end, position).
    fn ranges_wanted(&self, lead: u64) -> Vec<(u32, u64, u64, usize)> {
        let mut out = Vec::new();
        let base = self.before[self.reached];
        for p in self.reached..self.order.len() {
            if self.before[p] - base >= lead {
                break;
            }
            if !self.ranged.contains(&p) && !self.taken[p] {
                let (object, start, end) = self.order[p];
                out.push((object, start, end, p));
            }
        }
        out
    }

    /// Objects within `lead` bytes of the reader not asked for yet.
    fn wanted(&mut self, lead: u64) -> Vec<ObjectUri> {
        let mut out = Vec::new();
        let base = self.before[self.reached];
        for p in self.reached..self.order.len() {
            if self.before[p] - base >= lead {
                break;
            }
            let object = self.order[p].0;
            if self.requested.insert(object) {
                out.push(self.objects[object as usize].clone());
            }
        }
        out
    }
}

pub struct TierPlans {
    data: Arc<dyn DataPlane>,
    /// Whole objects go here; a mount without a tier holds ranges only.
    tier: Option<(Arc<LocalTier>, Arc<Completer>)>,
    /// Planned ranges in the mount's memory, ahead of the reader.
    ranges: Option<Arc<PlanRanges>>,
    budget: u64,
    plans: Mutex<HashMap<String, Plan>>,
    /// Plans held, for a check without the lock (every open asks).
    held_count: AtomicUsize,
    wake: Notify,
    lookups: Arc<Semaphore>,
    pub stats: Arc<TierPlanStats>,
}

impl TierPlans {
    /// `budget`: bytes fetched ahead into the tier, all plans together
    /// (clamped to a quarter of the tier, so prefetch never evicts what
    /// it fetched); `ranges`: where planned ranges are held in memory.
    pub fn new(
        data: Arc<dyn DataPlane>,
        tier: Option<(Arc<LocalTier>, Arc<Completer>)>,
        budget: u64,
        ranges: Option<Arc<PlanRanges>>,
    ) -> Arc<Self> {
        let budget = match &tier {
            Some((tier, _)) => budget.min(tier.capacity() / 4),
            None => 0,
        };
        Arc::new(Self {
            data,
            tier,
            ranges,
            budget,
            plans: Mutex::default(),
            held_count: AtomicUsize::new(0),
            wake: Notify::new(),
            lookups: Arc::new(Semaphore::new(LOOKUPS)),
            stats: Arc::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Plan>> {
        self.plans.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes plan `name` (replacing one of that name), checked whole:
    /// returns its entries. `served`: whether the mount serves an object
    /// (entries of other objects are refused with the plan).
    pub fn install(
        &self,
        name: &str,
        ttl_s: u64,
        objects: Vec<String>,
        order: Vec<(u32, u64, u64)>,
        served: impl Fn(&ObjectUri) -> bool,
    ) -> Result<usize, TierPlanError> {
        if ttl_s == 0 || ttl_s > MAX_TTL.as_secs() {
            return Err(TierPlanError::BadTtl(ttl_s));
        }
        let limit = lakecache_protocol::tier_socket::MAX_TIER_PLAN_ENTRIES;
        if order.len() > limit {
            return Err(TierPlanError::TooLong {
                entries: order.len(),
                limit,
            });
        }
        let mut parsed = Vec::with_capacity(objects.len());
        for (index, uri) in objects.into_iter().enumerate() {
            match uri.parse::<ObjectUri>() {
                Ok(u) if served(&u) => parsed.push(u),
                Ok(_) => {
                    return Err(TierPlanError::BadUri {
                        index,
                        uri,
                        why: "outside this mount".into(),
                    })
                }
                Err(e) => {
                    return Err(TierPlanError::BadUri {
                        index,
                        uri,
                        why: e.to_string(),
                    })
                }
            }
        }
        let entries = order.len();
        let mut before = Vec::with_capacity(entries + 1);
        let mut positions: HashMap<u32, Vec<usize>> = HashMap::new();
        let mut total = 0u64;
        for (index, &(object, start, end)) in order.iter().enumerate() {
            if (object as usize) >= parsed.len() {
                return Err(TierPlanError::BadObject {
                    index,
                    object,
                    objects: parsed.len(),
                });
            }
            if start >= end {
                return Err(TierPlanError::BadRange { index, start, end });
            }
            before.push(total);
            total += end - start;
            positions.entry(object).or_default().push(index);
        }
        before.push(total);
        let index = parsed
            .iter()
            .enumerate()
            .map(|(i, u)| (u.to_string(), i as u32))
            .collect();
        let now = Instant::now();
        let plan = Plan {
            objects: parsed,
            index,
            order,
            before,
            positions,
            reached: 0,
            taken: vec![false; entries],
            expires: now + Duration::from_secs(ttl_s),
            renewed: now,
            requested: HashSet::new(),
            ranged: HashSet::new(),
            pace: Pace {
                at: now,
                bytes: 0,
                per_s: 0.0,
            },
        };
        {
            let mut plans = self.lock();
            if !plans.contains_key(name) && plans.len() >= MAX_PLANS {
                let oldest = plans
                    .iter()
                    .min_by_key(|(_, p)| p.renewed)
                    .map(|(n, _)| n.clone());
                if let Some(oldest) = oldest {
                    plans.remove(&oldest);
                }
            }
            plans.insert(name.to_string(), plan);
            self.held_count.store(plans.len(), Ordering::Relaxed);
        }
        self.wake.notify_one();
        Ok(entries)
    }

    /// A reader is at `offset` of `uri` (`None`: it opened the file).
    pub fn note(&self, uri: &str, offset: Option<u64>) {
        let moved = {
            let mut plans = self.lock();
            let mut moved = false;
            for plan in plans.values_mut() {
                if let Some(&object) = plan.index.get(uri) {
                    moved |= plan.note(object, offset);
                }
            }
            moved
        };
        if moved {
            self.stats.moved.fetch_add(1, Ordering::Relaxed);
            self.wake.notify_one();
        }
    }

    /// Evicting by these plans from now on.
    pub fn attach(self: &Arc<Self>) {
        if let Some((tier, _)) = &self.tier {
            let plans: Arc<dyn crate::local_tier::NextUse> = self.clone();
            tier.evict_by(Arc::downgrade(&plans));
        }
    }

    /// The planned ranges held in memory, if this mount holds any.
    pub fn ranges(&self) -> Option<&Arc<PlanRanges>> {
        self.ranges.as_ref()
    }

    /// Whether any plan is held (no lock): opens skip the note otherwise.
    pub fn any(&self) -> bool {
        self.held_count.load(Ordering::Relaxed) > 0
    }

    pub fn held(&self) -> usize {
        self.lock().len()
    }

    /// Fetches ahead of every plan's reader until the task is dropped.
    pub async fn run(self: Arc<Self>) {
        loop {
            let fetch_ended = async {
                match &self.ranges {
                    Some(ranges) => ranges.fetch_ended.notified().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = tokio::time::sleep(TICK) => {}
                () = self.wake.notified() => {}
                () = fetch_ended => {}
            }
            if let Some(ranges) = &self.ranges {
                ranges.expire();
                self.fetch_ranges(ranges);
            }
            for uri in self.wanted_now() {
                let Ok(permit) = self.lookups.clone().acquire_owned().await else {
                    return;
                };
                let this = self.clone();
                tokio::spawn(async move {
                    this.fetch_whole(uri).await;
                    drop(permit);
                });
            }
        }
    }

    /// Asks for each plan's next ranges within its share of the store, at
    /// the reader's pace; a range the store has no room for yet is asked
    /// for again on a later tick.
    fn fetch_ranges(&self, ranges: &Arc<PlanRanges>) {
        let now = Instant::now();
        let mut plans = self.lock();
        let share = ranges.most() / plans.len().max(1) as u64;
        for plan in plans.values_mut() {
            let lead = plan.lead(u64::MAX, now).min(share);
            for (object, start, end, position) in plan.ranges_wanted(lead) {
                // Larger entries stream with read-ahead instead.
                let suited = end - start <= crate::plan_ranges::MAX_RANGE;
                if suited && !ranges.fetch(&plan.objects[object as usize], start, end) {
                    break;
                }
                plan.ranged.insert(position);
            }
        }
    }

    fn wanted_now(&self) -> Vec<ObjectUri> {
        let now = Instant::now();
        let mut plans = self.lock();
        plans.retain(|_, p| p.expires > now);
        self.held_count.store(plans.len(), Ordering::Relaxed);
        if self.tier.is_none() {
            return Vec::new();
        }
        let share = self.budget / plans.len().max(1) as u64;
        let mut out = Vec::new();
        for plan in plans.values_mut() {
            let lead = plan.lead(share, now);
            out.extend(plan.wanted(lead));
        }
        out
    }

    /// Asks for the current version of `uri` whole in the tier.
    async fn fetch_whole(&self, uri: ObjectUri) {
        let stat = match self.data.stat(&uri).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%uri, error = %e, "planned object not prefetched");
                return;
            }
        };
        let Some((tier, completer)) = self.tier.clone() else {
            return;
        };
        let (key, etag) = (uri.to_string(), stat.etag.clone());
        let made =
            tokio::task::spawn_blocking(move || tier.get_or_create(&key, &etag, stat.size)).await;
        let object = match made {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                tracing::debug!(%uri, error = %e, "planned object not prefetched");
                return;
            }
            Err(_) => return,
        };
        if object.is_complete() {
            return;
        }
        self.stats
            .prefetched_objects
            .fetch_add(1, Ordering::Relaxed);
        // Wanted now: fetched at once, not after the readers pause.
        object.want_now();
        completer.want_whole(object, uri, stat.etag);
    }
}

impl crate::local_tier::NextUse for TierPlans {
    fn active(&self) -> bool {
        self.any()
    }

    fn next_use(&self, uri: &str) -> Option<u64> {
        let plans = self.lock();
        plans
            .values()
            .filter_map(|plan| {
                let positions = plan.positions.get(plan.index.get(uri)?)?;
                let first = positions.partition_point(|&p| p < plan.reached);
                let next = positions[first..].iter().find(|&&p| !plan.taken[p])?;
                Some(plan.before[*next] - plan.before[plan.reached])
            })
            .min()
    }
}

#[cfg(test)]
mod tests;
