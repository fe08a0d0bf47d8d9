//! Planned sample ranges held in the mount's memory (issue #35). The
//! node-local tier fetches whole objects; a loader that reads samples out
//! of large shards needs the next samples of its plan on this node
//! instead, and most at an epoch's start, when every loader worker asks
//! for its first batch at once. Plans already run on into the next epoch,
//! so the samples it starts with are fetched here while the last one
//! ends, and a read finds them in memory, answered on the thread that
//! took the kernel's request.
//!
//! A held range is served once, to a read inside it with the object's
//! version (ETag) it was fetched at, and then let go. A read that comes
//! while its range is still being fetched goes to the workers as usual
//! and the fetch is dropped: a read never waits on a prefetch. Ranges
//! nobody reads go after [`UNREAD_TTL`]. The bytes are held against the
//! mount's memory budget, and no more than the store's bound.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lakecache_protocol::ObjectUri;
use tokio::sync::Notify;

use crate::data_plane::{read_exact, DataPlane};
use crate::memory::{MemoryBudget, Reservation};

/// Default bytes of planned ranges held, all plans together.
pub const DEFAULT_PLAN_MEMORY: u64 = 32 << 20;
/// A held range nobody read for this long goes.
pub const UNREAD_TTL: Duration = Duration::from_secs(30);
/// How long an object's version, learnt for a fetch, is used for more.
const VERSION_TTL: Duration = Duration::from_secs(60);
/// Largest range held (larger entries stream with read-ahead).
pub const MAX_RANGE: u64 = 16 << 20;
/// Fetches in flight at once: a renewed plan's window must not send a
/// burst at the workers just as every loader worker starts reading.
pub const FETCHES_IN_FLIGHT: usize = 4;

#[derive(Debug, Default)]
pub struct PlanRangeStats {
    /// Ranges whose fetch was started.
    pub fetched: AtomicU64,
    /// Reads answered from a held range.
    pub served: AtomicU64,
    /// Ranges let go unread (expired, superseded, or failed).
    pub dropped: AtomicU64,
}

struct Slot {
    end: u64,
    /// `None` while the fetch runs.
    held: Option<(String, Bytes)>,
    since: Instant,
    _memory: Reservation,
}

pub struct PlanRanges {
    data: Arc<dyn DataPlane>,
    budget: Arc<MemoryBudget>,
    most: u64,
    /// By object, by range start.
    slots: Mutex<HashMap<String, BTreeMap<u64, Slot>>>,
    held_bytes: AtomicU64,
    in_flight: AtomicUsize,
    /// Woken when a fetch ends, so the next one starts then.
    pub fetch_ended: Notify,
    versions: Mutex<HashMap<String, (String, Instant)>>,
    pub stats: Arc<PlanRangeStats>,
}

impl PlanRanges {
    pub fn new(data: Arc<dyn DataPlane>, budget: Arc<MemoryBudget>, most: u64) -> Arc<Self> {
        Arc::new(Self {
            data,
            budget,
            most,
            slots: Mutex::default(),
            held_bytes: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            fetch_ended: Notify::new(),
            versions: Mutex::default(),
            stats: Arc::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, BTreeMap<u64, Slot>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most bytes held at once.
    pub fn most(&self) -> u64 {
        self.most
    }

    /// Bytes held or being fetched.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes.load(Ordering::Relaxed)
    }

    /// Whether `uri`'s range from `start` is fetched and waiting for its
    /// read.
    pub fn is_ready(&self, uri: &str, start: u64) -> bool {
        self.lock()
            .get(uri)
            .and_then(|s| s.get(&start))
            .is_some_and(|slot| slot.held.is_some())
    }

    /// Whether `uri`'s range from `start` is held or being fetched.
    pub fn has(&self, uri: &str, start: u64) -> bool {
        self.lock().get(uri).is_some_and(|s| s.contains_key(&start))
    }

    /// Starts fetching `start..end` of `uri` unless it is held already,
    /// too large, over the store's bound or the mount's budget, or
    /// [`FETCHES_IN_FLIGHT`] are running: `false` then (the caller tries
    /// again later).
    pub fn fetch(self: &Arc<Self>, uri: &ObjectUri, start: u64, end: u64) -> bool {
        let len = end.saturating_sub(start);
        if len == 0 || len > MAX_RANGE {
            return false;
        }
        let key = uri.to_string();
        {
            let mut slots = self.lock();
            if slots.get(&key).is_some_and(|s| s.contains_key(&start)) {
                return true;
            }
            if self.held_bytes() + len > self.most
                || self.in_flight.load(Ordering::Relaxed) >= FETCHES_IN_FLIGHT
            {
                return false;
            }
            let Some(memory) = self.budget.try_reserve(len) else {
                return false;
            };
            slots.entry(key.clone()).or_default().insert(
                start,
                Slot {
                    end,
                    held: None,
                    since: Instant::now(),
                    _memory: memory,
                },
            );
            self.held_bytes.fetch_add(len, Ordering::Relaxed);
            self.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.fetched.fetch_add(1, Ordering::Relaxed);
        crate::metrics::global().plan_range("fetched");
        let (this, uri) = (self.clone(), uri.clone());
        tokio::spawn(async move {
            let fetched = match this.version(&uri).await {
                Some(etag) => read_exact(this.data.as_ref(), &uri, start..end, &etag)
                    .await
                    .ok()
                    .map(|b| (etag, b)),
                None => None,
            };
            this.in_flight.fetch_sub(1, Ordering::Relaxed);
            this.fetch_ended.notify_one();
            let mut slots = this.lock();
            let Some(slot) = slots.get_mut(&key).and_then(|s| s.get_mut(&start)) else {
                // A read came first and took the range from the workers.
                return;
            };
            match fetched {
                Some(held) => {
                    slot.held = Some(held);
                    crate::metrics::global().plan_range("ready");
                }
                None => {
                    tracing::debug!(%uri, start, end, "planned range not prefetched");
                    this.drop_unread(&mut slots, &key, start);
                }
            }
        });
        true
    }

    /// The object's current version, learnt once in a while.
    async fn version(&self, uri: &ObjectUri) -> Option<String> {
        let key = uri.to_string();
        {
            let versions = self.versions.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((etag, at)) = versions.get(&key) {
                if at.elapsed() < VERSION_TTL {
                    return Some(etag.clone());
                }
            }
        }
        let stat = self.data.stat(uri).await.ok()?;
        let mut versions = self.versions.lock().unwrap_or_else(|p| p.into_inner());
        if versions.len() >= 65_536 {
            versions.clear();
        }
        versions.insert(key, (stat.etag.clone(), Instant::now()));
        Some(stat.etag)
    }

    /// Lets go of a range nobody will read from here, and counts it.
    fn drop_unread(&self, slots: &mut HashMap<String, BTreeMap<u64, Slot>>, key: &str, start: u64) {
        self.remove(slots, key, start);
        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        crate::metrics::global().plan_range("dropped");
    }

    fn remove(&self, slots: &mut HashMap<String, BTreeMap<u64, Slot>>, key: &str, start: u64) {
        let Some(of_object) = slots.get_mut(key) else {
            return;
        };
        if let Some(slot) = of_object.remove(&start) {
            self.held_bytes
                .fetch_sub(slot.end - start, Ordering::Relaxed);
        }
        if of_object.is_empty() {
            slots.remove(key);
        }
    }

    /// The bytes `offset..offset + len` of `uri` at version `etag`, when
    /// held ranges cover them: one, or several that follow one another (a
    /// kernel read-ahead of two samples at once). A range goes once read
    /// to its end. When they do not cover the read (a range still being
    /// fetched, of another version, or a gap), every range the read
    /// overlaps is dropped: the read takes those bytes from the workers,
    /// and the ranges would hold their room in the store unread.
    pub fn take(&self, uri: &str, etag: &str, offset: u64, len: u64) -> Option<Bytes> {
        let end = offset.saturating_add(len);
        let mut slots = self.lock();
        let of_object = slots.get(uri)?;
        // One range per start; two plans may name overlapping ones. The
        // read looks at the last one starting at or before it and any
        // starting inside it, in order (a range that starts before that
        // one and runs past it is left alone, to be read or expire).
        let overlapping: Vec<(u64, u64)> = of_object
            .range(..=offset)
            .next_back()
            .into_iter()
            .chain(of_object.range(offset.saturating_add(1)..end))
            .map(|(start, slot)| (*start, slot.end))
            .filter(|&(_, slot_end)| slot_end > offset)
            .collect();
        if overlapping.is_empty() {
            return None;
        }
        let pieces = Self::covering(of_object, &overlapping, etag, offset..end);
        let Some(pieces) = pieces else {
            for (start, _) in overlapping {
                self.drop_unread(&mut slots, uri, start);
            }
            return None;
        };
        let out = match &pieces[..] {
            [one] => one.clone(),
            many => {
                let mut joined = bytes::BytesMut::with_capacity(len as usize);
                for piece in many {
                    joined.extend_from_slice(piece);
                }
                joined.freeze()
            }
        };
        for (start, slot_end) in overlapping {
            if slot_end <= end {
                self.remove(&mut slots, uri, start);
            }
        }
        drop(slots);
        self.stats.served.fetch_add(1, Ordering::Relaxed);
        crate::metrics::global().plan_range("served");
        Some(out)
    }

    /// The pieces of `want` that the held ranges `ranges` (start, end)
    /// hold at version `etag`, when they cover all of it without a gap.
    fn covering(
        of_object: &BTreeMap<u64, Slot>,
        ranges: &[(u64, u64)],
        etag: &str,
        want: std::ops::Range<u64>,
    ) -> Option<Vec<Bytes>> {
        let mut at = want.start;
        let mut pieces = Vec::with_capacity(ranges.len());
        for (start, slot_end) in ranges {
            let (held_etag, bytes) = of_object[start].held.as_ref()?;
            if held_etag != etag || *start > at {
                return None;
            }
            let upto = (*slot_end).min(want.end);
            pieces.push(bytes.slice((at - start) as usize..(upto - start) as usize));
            at = upto;
        }
        (at == want.end).then_some(pieces)
    }

    /// Lets go of ranges held unread for [`UNREAD_TTL`].
    pub fn expire(&self) {
        let mut slots = self.lock();
        let old: Vec<(String, u64)> = slots
            .iter()
            .flat_map(|(k, s)| {
                s.iter()
                    .filter(|(_, slot)| slot.since.elapsed() >= UNREAD_TTL)
                    .map(move |(start, _)| (k.clone(), *start))
            })
            .collect();
        for (key, start) in old {
            self.drop_unread(&mut slots, &key, start);
        }
    }
}

#[cfg(test)]
mod tests;
