//! Eviction by plan (issue #35). A training job knows its read order for
//! the coming epoch before it starts; with that order published as a plan,
//! the page that some plan reads again furthest in the future goes first
//! (Belady's rule: the fewest misses possible for a known sequence, where
//! recency is the worst rule for an epoch-by-epoch scan). Pages that no
//! plan reads again go before all of these, least recently used first
//! ([`crate::lru`] keeps that order).
//!
//! Distances are counted in plan entries from each plan's cursor (the
//! first entry not read yet): plans of one job's ranks read at about one
//! pace, so their distances compare directly.

use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::pages::PageKey;
pub use lakecache_protocol::ReadKind;

/// Pages a plan may list at most, and all plans together: the index costs
/// about 230 bytes per entry (benches/results/plan-cost.md).
pub const MAX_PLAN_PAGES: usize = 1 << 20;
pub const MAX_TOTAL_PAGES: usize = 4 << 20;
/// How far ahead of the furthest read (in entries) a read still counts as
/// a plan's own reader's, and how far behind it an entry not read yet is
/// still waited for at most.
pub const DEFAULT_WINDOW: u64 = 4096;
/// Reads a plan remembers to tell where its reader is.
const RECENT_READS: usize = 5;
/// How far the furthest read may run ahead of the recent ones before it
/// is taken for a stray read, not the reader's position.
const STRAY_GAP: u64 = 64;
/// A plan's out-of-order spread shrinks by this share of itself per read
/// without a read as late: slowly, as its loader workers' lateness comes
/// back with every batch.
const SPREAD_DECAY: u64 = 256;
/// Positions a plan remembers having taken, to tell a later piece of one
/// of those reads from a new read: more than its loader workers have
/// reads in flight.
const TAKEN_MEMORY: usize = 32;

/// How a plan sees a read of some bytes of a page.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Claim {
    /// It reads the page again, but not these bytes next.
    Other,
    /// Its next read of the page takes in these bytes.
    Meets,
    /// One of its coming reads of the page takes in where these bytes
    /// start: a sample inside an entry of several, or one the plan
    /// reads well after where its reader is.
    Within,
    /// These bytes are a later piece of a read it took moments ago.
    Continues,
    /// One of its coming reads, near where its reader is, starts where
    /// these bytes start.
    Starts,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error("a plan lists at most {limit} pages; this one lists {pages}")]
    TooLong { pages: usize, limit: usize },
    #[error("plans hold at most {limit} pages in all; {held} are held and this one adds {pages}")]
    Full {
        pages: usize,
        held: usize,
        limit: usize,
    },
}

/// One plan: the pages it reads, in order, and which of those reads
/// have happened.
///
/// Loader workers read a little out of order, so a read consumes only its
/// own page's next position; positions passed over stay, until they fall
/// `window` behind the furthest read (then they count as skipped).
struct Plan {
    /// The first position not yet read (or skipped): distances count
    /// from here.
    cursor: u64,
    /// One past the furthest position read: where the reader is.
    reached: u64,
    /// Each page's positions not yet read, ascending.
    ahead: HashMap<PageKey, VecDeque<u64>>,
    /// Each page's next position, keyed by that position (unique).
    next: BTreeMap<u64, PageKey>,
    /// Per position, the bytes of its page the plan reads there
    /// (page-relative); empty where the plan gave none.
    spans: Vec<(u32, u32)>,
    /// The position each page was last read at.
    read_at: HashMap<PageKey, u64>,
    len: usize,
    /// The page read last: a reader reads a page in several pieces, and
    /// only the first is a read of the plan's.
    last: Option<PageKey>,
    /// The positions of the last [`RECENT_READS`] reads, oldest first.
    recent: VecDeque<u64>,
    /// How far behind where the reader was its reads have arrived lately
    /// (loader workers read out of order), decaying: see
    /// [`Plan::skip_gap`].
    spread: u64,
    /// The bytes of the last [`TAKEN_MEMORY`] reads taken (each grown by
    /// its later pieces), oldest first.
    taken: VecDeque<(PageKey, Range<u64>)>,
    expires: Instant,
    /// The tenant that published it: it ranks that tenant's pages only.
    tenant: Option<Arc<str>>,
}

impl Plan {
    /// A plan of `pages`, a page listed again right after itself kept
    /// once (two samples in one page are one read of it). `spans`, where
    /// given, holds each entry's bytes of its page.
    fn new(
        pages: &[PageKey],
        spans: &[(u32, u32)],
        expires: Instant,
        tenant: Option<Arc<str>>,
    ) -> Self {
        let mut ahead: HashMap<PageKey, VecDeque<u64>> = HashMap::new();
        let with_spans = spans.len() == pages.len();
        let mut kept_spans: Vec<(u32, u32)> = Vec::new();
        let mut at = 0;
        for (i, key) in pages.iter().enumerate() {
            if i > 0 && pages[i - 1] == *key {
                if let (true, Some(last)) = (with_spans, kept_spans.last_mut()) {
                    *last = (last.0.min(spans[i].0), last.1.max(spans[i].1));
                }
                continue;
            }
            ahead.entry(*key).or_default().push_back(at);
            if with_spans {
                kept_spans.push(spans[i]);
            }
            at += 1;
        }
        let next = ahead
            .iter()
            .filter_map(|(key, at)| at.front().map(|a| (*a, *key)))
            .collect();
        Self {
            cursor: 0,
            reached: 0,
            ahead,
            next,
            spans: kept_spans,
            read_at: HashMap::new(),
            len: pages.len(),
            last: None,
            recent: VecDeque::with_capacity(RECENT_READS),
            spread: 0,
            taken: VecDeque::with_capacity(TAKEN_MEMORY),
            expires,
            tenant,
        }
    }

    /// Where the reader is, to fetch ahead of it: the furthest read,
    /// unless the recent reads lie well behind it. Then that read was a
    /// stray one (a mount's read-ahead into a page the plan reads much
    /// later, at 1 MiB pages) and the reader is where most recent reads
    /// are: one past their lower median. Fetching from the stray read
    /// on left every page between unfetched (plan-epochs, mounts, 1 MiB
    /// pages: prefetch ran about 600 positions ahead of the reader).
    fn reader_at(&self) -> u64 {
        // On the stack: this runs twice on every planned read.
        let mut held = [0u64; RECENT_READS];
        for (slot, at) in held.iter_mut().zip(&self.recent) {
            *slot = *at;
        }
        let recent = &mut held[..self.recent.len()];
        recent.sort_unstable();
        match recent.get(recent.len().saturating_sub(1) / 2) {
            Some(&median) if self.reached - (median + 1) > STRAY_GAP => {
                (median + 1).max(self.cursor)
            }
            _ => self.reached,
        }
    }

    /// How far behind its reader a position not read yet is still
    /// waited for: twice the reads' recent spread, and [`STRAY_GAP`]
    /// more, `window` at most. Past that the position was skipped (its
    /// read went to another plan, or never came). Waiting on it for the
    /// whole window held the cursor, where distances count from, that
    /// far back: in plan-epochs at 2 ranks one plan's cursor sat 120-150
    /// positions behind its reader at the end of epoch 1, every distance
    /// of that plan was too long by as much, and the next epoch's first
    /// pages of that rank were evicted for the other rank's later ones
    /// (1-3 misses in epoch 2's first step, and 70-200 ms of waiting).
    fn skip_gap(&self, window: u64) -> u64 {
        self.spread
            .saturating_mul(2)
            .saturating_add(STRAY_GAP)
            .min(window)
    }

    fn distance(&self, key: &PageKey) -> Option<u64> {
        let at = self.ahead.get(key)?.front()?;
        Some(at - self.cursor)
    }

    fn span_meets(&self, at: u64, part: &Range<u64>) -> bool {
        self.spans
            .get(at as usize)
            .is_none_or(|&(start, end)| u64::from(start) < part.end && part.start < u64::from(end))
    }

    /// How this plan sees a read of `key`'s bytes `part` (page-relative,
    /// where known), and the position that read takes: `None` if the
    /// plan neither reads the page again nor took a read it continues.
    /// Without bytes or spans, a read of the page this plan read last is
    /// not this plan's (a later piece of that read, or another plan's
    /// read of the page).
    fn claim(&self, key: &PageKey, part: Option<&Range<u64>>, window: u64) -> Option<(Claim, u64)> {
        let next = self.ahead.get(key).and_then(|p| p.front()).copied();
        let Some(part) = part.filter(|_| !self.spans.is_empty()) else {
            if self.last == Some(*key) {
                return None;
            }
            return next.map(|at| (Claim::Meets, at));
        };
        // A mount reads a sample in pieces: a later piece of a read taken
        // moments ago is no other plan's read of those bytes (another
        // rank's read of the same sample in the next epoch).
        if self
            .taken
            .iter()
            .any(|(k, r)| k == key && r.contains(&part.start))
        {
            return Some((Claim::Continues, 0));
        }
        // Loader workers read several samples of one page at once, in any
        // order: a read takes the first coming position whose bytes take
        // in where it starts.
        let end = self.reached.saturating_add(window);
        let within = self.ahead.get(key).and_then(|positions| {
            positions
                .iter()
                .take_while(|at| **at < end)
                .copied()
                .find_map(|at| {
                    let &(start, end) = self.spans.get(at as usize)?;
                    (u64::from(start)..u64::from(end))
                        .contains(&part.start)
                        .then_some((at, u64::from(start) == part.start))
                })
        });
        if let Some((at, starts)) = within {
            let near = at <= self.reader_at().saturating_add(STRAY_GAP);
            let claim = if starts && near {
                Claim::Starts
            } else {
                Claim::Within
            };
            return Some((claim, at));
        }
        next.map(|at| {
            if self.span_meets(at, part) {
                (Claim::Meets, at)
            } else {
                (Claim::Other, at)
            }
        })
    }

    /// A later piece `part` of a read of `key` this plan took.
    fn continue_read(&mut self, key: &PageKey, part: &Range<u64>) {
        if let Some((_, r)) = self
            .taken
            .iter_mut()
            .rev()
            .find(|(k, r)| k == key && r.contains(&part.start))
        {
            r.end = r.end.max(part.end);
        }
    }

    /// The read of `key` at position `at` happened (`part`: its bytes),
    /// if `at` lies within `window` of where the reader is. A read further
    /// ahead is not this plan's reader (another job reading the same data)
    /// and changes nothing. Unless the read was matched to `at` by its
    /// bytes (`exact`), so does a read of the page read last, or of a page
    /// read moments ago at an earlier position while the reader is not
    /// yet halfway to the next one (a second piece of one read, or a
    /// second sample in one page).
    fn read(
        &mut self,
        key: &PageKey,
        at: u64,
        part: Option<&Range<u64>>,
        window: u64,
        exact: bool,
    ) {
        if self.last == Some(*key) && !exact {
            return;
        }
        if at >= self.reached.saturating_add(window) {
            return;
        }
        if let (Some(&before), false) = (self.read_at.get(key), exact) {
            if self.reached < before + at.saturating_sub(before) / 2 {
                return;
            }
        }
        if let Some(part) = part {
            if self.taken.len() == TAKEN_MEMORY {
                self.taken.pop_front();
            }
            // The entry's bytes: its later pieces, and the other samples
            // of an entry of several, are no new reads.
            let span = match self.spans.get(at as usize) {
                Some(&(s, e)) if exact => u64::from(s).min(part.start)..u64::from(e).max(part.end),
                _ => part.clone(),
            };
            self.taken.push_back((*key, span));
        }
        self.last = Some(*key);
        self.read_at.insert(*key, at);
        let late = self.reader_at().saturating_sub(at + 1);
        self.spread = late.max(self.spread - self.spread / SPREAD_DECAY);
        self.reached = self.reached.max(at + 1);
        if self.recent.len() == RECENT_READS {
            self.recent.pop_front();
        }
        self.recent.push_back(at);
        self.take(key, at);
        // Positions left this far behind the reader were skipped. Counted
        // from where the reader is, not from the furthest read, which may
        // be a stray read far ahead.
        let behind = self.reader_at().saturating_sub(self.skip_gap(window));
        while let Some((&pos, &page)) = self.next.first_key_value() {
            if pos >= behind {
                break;
            }
            self.advance(&page);
        }
        self.cursor = self
            .next
            .first_key_value()
            .map_or(self.reached, |(pos, _)| *pos);
    }

    /// Drops position `at` of `page`: its next, or a later one read
    /// before it.
    fn take(&mut self, page: &PageKey, at: u64) {
        let Some(positions) = self.ahead.get_mut(page) else {
            return;
        };
        if positions.front() == Some(&at) {
            self.advance(page);
        } else if let Some(i) = positions.iter().position(|p| *p == at) {
            positions.remove(i);
        }
    }

    /// Drops `page`'s next position.
    fn advance(&mut self, page: &PageKey) {
        let Some(positions) = self.ahead.get_mut(page) else {
            return;
        };
        if let Some(pos) = positions.pop_front() {
            self.next.remove(&pos);
        }
        match positions.front() {
            Some(p) => {
                self.next.insert(*p, *page);
            }
            None => {
                self.ahead.remove(page);
                self.read_at.remove(page);
            }
        }
    }
}

/// Every live plan, by the name its job gave it (`job/rank`).
pub struct PlanOrder {
    plans: HashMap<String, Plan>,
    /// How far ahead of a plan's cursor a read may land and still count
    /// as that plan's reader (loader workers read a little out of order).
    window: u64,
}

impl Default for PlanOrder {
    fn default() -> Self {
        Self::new(DEFAULT_WINDOW)
    }
}

impl PlanOrder {
    pub fn new(window: u64) -> Self {
        Self {
            plans: HashMap::new(),
            window,
        }
    }

    /// Installs (or renews, from its start) plan `name`, live until
    /// `expires`. `spans`, if not empty, gives each entry's bytes of its
    /// page (page-relative): reads are then told apart by them.
    pub fn install(
        &mut self,
        name: &str,
        tenant: Option<Arc<str>>,
        pages: &[PageKey],
        spans: &[(u32, u32)],
        expires: Instant,
    ) -> Result<(), PlanError> {
        if pages.len() > MAX_PLAN_PAGES {
            return Err(PlanError::TooLong {
                pages: pages.len(),
                limit: MAX_PLAN_PAGES,
            });
        }
        let held: usize = self
            .plans
            .iter()
            .filter(|(n, _)| n.as_str() != name)
            .map(|(_, p)| p.len)
            .sum();
        if held + pages.len() > MAX_TOTAL_PAGES {
            return Err(PlanError::Full {
                pages: pages.len(),
                held,
                limit: MAX_TOTAL_PAGES,
            });
        }
        self.plans
            .insert(name.to_string(), Plan::new(pages, spans, expires, tenant));
        Ok(())
    }

    /// Drops plans not renewed by `now`; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.plans.len();
        self.plans.retain(|_, p| p.expires > now);
        before - self.plans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }

    /// Where plan `name`'s reader is: one past the furthest position
    /// (in its pages, a page listed again right after itself counted
    /// once) read so far, unless that read was a stray one far ahead of
    /// the recent reads (see `Plan::reader_at`).
    pub fn cursor(&self, name: &str) -> Option<u64> {
        self.plans.get(name).map(Plan::reader_at)
    }

    /// Plan `name`'s entries not read yet, from its first unread one to
    /// `lead` past where its reader is, in order and at most `limit`:
    /// each page at its next position only.
    pub fn upcoming(&self, name: &str, lead: u64, limit: usize) -> Vec<(u64, PageKey)> {
        let Some(plan) = self.plans.get(name) else {
            return Vec::new();
        };
        let end = plan.reader_at().saturating_add(lead);
        if end <= plan.cursor {
            return Vec::new();
        }
        plan.next
            .range(plan.cursor..end)
            .take(limit)
            .map(|(at, key)| (*at, *key))
            .collect()
    }

    /// Whether `tenant` has published any plan.
    pub fn has_tenant(&self, tenant: Option<&str>) -> bool {
        self.plans.values().any(|p| p.tenant.as_deref() == tenant)
    }

    /// How many entries from now some plan reads `key` again (the
    /// nearest over all plans); `None` if none does.
    pub fn distance(&self, key: &PageKey) -> Option<u64> {
        self.plans.values().filter_map(|p| p.distance(key)).min()
    }

    /// As [`Self::distance`], over the plans `tenant` published: a plan
    /// ranks its own tenant's pages only.
    pub fn distance_for(&self, key: &PageKey, tenant: Option<&str>) -> Option<u64> {
        self.plans
            .values()
            .filter(|p| p.tenant.as_deref() == tenant)
            .filter_map(|p| p.distance(key))
            .min()
    }

    /// A reader read `key`: the plan (or plans) it was nearest for moves
    /// on, the read being that plan's reader's; the others stay. A
    /// read-ahead ([`ReadKind::Ahead`]) moves a plan on only where the
    /// page is among the next [`STRAY_GAP`] positions past the furthest
    /// read: a mount streaming ahead reads what its plan reads next, but
    /// its guess past a sample lands in a page the plan reads much later,
    /// and taking that for the plan's read would leave the page unplanned
    /// (evicted first) until the plan's reader reads it.
    pub fn read(&mut self, key: &PageKey, kind: ReadKind) {
        self.read_part(key, None, kind);
    }

    /// [`Self::read`] of the bytes `part` of the page (page-relative),
    /// where known. The bytes tell the plans apart: ranks of one job read
    /// different samples of one page (at 4 MiB pages of four 1 MiB
    /// samples, two ranks share most pages), and one rank's sample is
    /// often another's in the next epoch. The read goes to the nearest of
    /// the plans with the best [`Claim`] on it: a coming read near the
    /// reader that starts where it starts; failing that, it is nothing if
    /// it is a later piece of a read some plan took; failing that, a
    /// coming read that takes in where it starts, then a next read that
    /// takes in its bytes, then any plan that reads the page.
    /// Taking a piece of rank 0's read for rank 1's read of that sample
    /// in the next epoch left rank 0's position unread, so its distances
    /// grew by up to 190 entries and the next epoch's first pages went
    /// before the other rank's later ones (plan-epochs, 2 ranks).
    pub fn read_part(&mut self, key: &PageKey, part: Option<Range<u64>>, kind: ReadKind) {
        let window = match kind {
            ReadKind::Demand => self.window,
            ReadKind::Ahead => STRAY_GAP.min(self.window),
        };
        let claims: Vec<Option<(Claim, u64)>> = self
            .plans
            .values()
            .map(|p| p.claim(key, part.as_ref(), window))
            .collect();
        let Some(best) = claims.iter().flatten().map(|(c, _)| *c).max() else {
            return;
        };
        if best == Claim::Continues {
            if let Some(part) = &part {
                for (plan, claim) in self.plans.values_mut().zip(&claims) {
                    if matches!(claim, Some((Claim::Continues, _))) {
                        plan.continue_read(key, part);
                    }
                }
            }
            return;
        }
        let distance = |plan: &Plan, at: u64| at.saturating_sub(plan.cursor);
        let Some(nearest) = self
            .plans
            .values()
            .zip(&claims)
            .filter_map(|(plan, claim)| match claim {
                Some((c, at)) if *c == best => Some(distance(plan, *at)),
                _ => None,
            })
            .min()
        else {
            return;
        };
        for (plan, claim) in self.plans.values_mut().zip(claims) {
            if let Some((c, at)) = claim {
                if c == best && distance(plan, at) == nearest {
                    plan.read(key, at, part.as_ref(), window, c >= Claim::Within);
                }
            }
        }
    }

    /// Pages `tenant`'s plans read again, the furthest next use first,
    /// each once at its nearest distance over those plans. One pass costs
    /// at most the plans' entries.
    pub fn furthest_first(&self, tenant: Option<&str>) -> impl Iterator<Item = PageKey> + '_ {
        let plans: Vec<&Plan> = self
            .plans
            .values()
            .filter(|p| p.tenant.as_deref() == tenant)
            .collect();
        let tenant: Option<Arc<str>> = tenant.map(Arc::from);
        let mut cursors: Vec<_> = plans.iter().map(|p| p.next.iter().rev()).collect();
        let mut heap = BinaryHeap::new();
        for (i, it) in cursors.iter_mut().enumerate() {
            if let Some((pos, key)) = it.next() {
                heap.push((pos - plans[i].cursor, i, *key));
            }
        }
        let mut seen = HashSet::new();
        std::iter::from_fn(move || {
            while let Some((distance, i, key)) = heap.pop() {
                if let Some((pos, next)) = cursors[i].next() {
                    heap.push((pos - plans[i].cursor, i, *next));
                }
                // Met first at its furthest distance in some plan; it is
                // ranked by its nearest, where it is met again.
                if self.distance_for(&key, tenant.as_deref()) == Some(distance) && seen.insert(key)
                {
                    return Some(key);
                }
            }
            None
        })
    }
}

#[cfg(test)]
mod tests;
