//! Reads of one open file: sequential readers get a growing read-ahead
//! window of parallel requests; random readers get exactly what they ask.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use lakecache_protocol::{ObjectUri, ReadKind};
use tokio::task::JoinHandle;

use crate::complete::{Completer, DemandRead, COMPLETE_AFTER};
use crate::data_plane::{read_exact, read_exact_as, DataPlane};
use crate::error::FsError;
use crate::local_tier::{CheckedBlocks, TierObject};
use crate::memory::{MemoryBudget, Reservation};

/// How far behind the last read a request may land and still count as
/// the same stream (the kernel issues read-ahead out of order).
const REORDER_SLACK: u64 = 2 << 20;
/// Random jumps within one open object before the tier fetches it whole
/// (objects up to the mount's --random-whole-max): a header-and-footer
/// reader jumps once.
const RANDOM_JUMPS_BEFORE_WHOLE: u32 = 3;
/// A first read at least this large starts read-ahead at once: the
/// kernel asks this much only for a reader that streams (a 64 KiB header
/// read reaches the mount as 128 KiB)...
const LARGE_FIRST_READ: u64 = 512 << 10;
/// ...and smaller than the largest read the kernel sends. A read of that
/// size from offset 0 is either a stream's, whose next read the kernel
/// sends at once itself (its first window is all marked for read-ahead),
/// or a sample reader's that advised random access and reads nothing
/// more: fetching ahead of it fetched a sample nobody asked for, once per
/// shard and epoch (plan-epochs, 2 ranks through mounts: epoch-2 hits
/// 0.82-0.86 with it, 0.97-0.99 without).
const KERNEL_MAX_READ: u64 = crate::adapter::MAX_IO_BYTES as u64;

#[derive(Debug, Clone, Copy)]
pub struct ReadaheadPolicy {
    pub initial: u64,
    pub max: u64,
    pub chunk: u64,
}

struct Chunk {
    range: Range<u64>,
    fetch: Option<JoinHandle<Result<Bytes, FsError>>>,
    data: Option<Bytes>,
    /// Held against the mount's memory budget while the chunk lives.
    _memory: Reservation,
    /// Fetched before any read asked for it (read-ahead proper).
    speculative: bool,
    /// Bytes of it returned to readers.
    served: u64,
}

impl Chunk {
    async fn bytes(&mut self) -> Result<Bytes, FsError> {
        if let Some(task) = self.fetch.take() {
            let got = task.await.map_err(FsError::Task)??;
            self.data = Some(got);
        }
        // A chunk whose fetch failed was already dropped by the reader.
        self.data.clone().ok_or(FsError::BadHandle)
    }

    /// Whether the chunk's bytes are here, without waiting (a finished
    /// fetch is taken in). `Err(())`: the fetch failed (its error is for
    /// the reader that waits on it; the caller starts the stream over).
    fn ready_now(&mut self) -> Result<bool, ()> {
        if let Some(task) = self.fetch.as_mut() {
            if !task.is_finished() {
                return Ok(false);
            }
            match futures::FutureExt::now_or_never(task) {
                Some(Ok(Ok(bytes))) => {
                    self.fetch = None;
                    self.data = Some(bytes);
                }
                Some(_) => {
                    self.fetch = None;
                    return Err(());
                }
                None => return Ok(false),
            }
        }
        Ok(self.data.is_some())
    }

    /// The part of this fetched chunk within `[offset, end)`, counted as
    /// served.
    fn take_piece(&mut self, offset: u64, end: u64) -> Option<Bytes> {
        let bytes = self.data.as_ref()?;
        let from = (offset.max(self.range.start) - self.range.start) as usize;
        let to = (end.min(self.range.end) - self.range.start) as usize;
        self.served += (to - from) as u64;
        if self.speculative {
            crate::metrics::global().readahead_hit((to - from) as u64);
        }
        Some(bytes.slice(from..to))
    }
}

/// Most reads fall inside one chunk: its bytes are handed over uncopied.
fn join_pieces(mut pieces: Vec<Bytes>, len: u64) -> Bytes {
    if pieces.len() == 1 {
        return pieces.remove(0);
    }
    let mut out = BytesMut::with_capacity(len as usize);
    for piece in pieces {
        out.extend_from_slice(&piece);
    }
    out.freeze()
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Some(task) = self.fetch.take() {
            task.abort();
        }
        if self.speculative && self.data.is_some() {
            let len = self.range.end - self.range.start;
            crate::metrics::global().readahead_wasted(len.saturating_sub(self.served));
        }
    }
}

pub struct FileReader {
    data: Arc<dyn DataPlane>,
    uri: ObjectUri,
    etag: String,
    size: u64,
    policy: ReadaheadPolicy,
    /// Where the last read ended.
    next_offset: u64,
    window: u64,
    /// Contiguous prefetched ranges, in order.
    chunks: VecDeque<Chunk>,
    budget: Arc<MemoryBudget>,
    /// Whether any byte was returned through this reader.
    served: bool,
    /// This version's copy in the node-local tier: read first, filled
    /// from what comes back from the workers.
    tier: Option<Arc<TierObject>>,
    /// Tier blocks this reader has checked against their CRCs.
    tier_checked: CheckedBlocks,
    /// Completes the tier copy once this reader shows it wants it whole.
    completer: Option<Arc<Completer>>,
    /// The current run of reads in file order (the kernel's read-ahead
    /// may arrive a little out of order).
    run: Range<u64>,
    /// Whether completion of the tier copy was asked for.
    asked_whole: bool,
    /// Random jumps so far, and the largest object a random reader gets
    /// fetched whole (0: never).
    random_jumps: u32,
    random_whole_max: u64,
}

impl FileReader {
    pub fn new(
        data: Arc<dyn DataPlane>,
        uri: ObjectUri,
        etag: String,
        size: u64,
        policy: ReadaheadPolicy,
        budget: Arc<MemoryBudget>,
    ) -> Self {
        Self {
            data,
            uri,
            etag,
            size,
            policy,
            next_offset: 0,
            window: 0,
            chunks: VecDeque::new(),
            budget,
            served: false,
            tier: None,
            tier_checked: CheckedBlocks::default(),
            completer: None,
            run: 0..0,
            asked_whole: false,
            random_jumps: 0,
            random_whole_max: 0,
        }
    }

    /// A random reader of an object of at most `max` bytes gets it
    /// fetched whole into the tier at once (0: never).
    pub fn whole_on_random(mut self, max: u64) -> Self {
        self.random_whole_max = max;
        self
    }

    pub fn tier_object(&self) -> Option<Arc<TierObject>> {
        self.tier.clone()
    }

    /// Reads and fills `object` (the same URI and ETag) in the local
    /// tier; `completer` fetches the rest of it once reads show the whole
    /// object will be wanted.
    pub fn with_tier(
        mut self,
        object: Option<Arc<TierObject>>,
        completer: Option<Arc<Completer>>,
    ) -> Self {
        self.tier = object;
        self.completer = completer;
        self
    }

    /// Starts this reader with the whole object fetched ahead of its open
    /// (directory-order prefetch). A failed prefetch is fetched again, so
    /// it costs the reader time, never the read; the bytes fill the tier
    /// as any fetch does. Call after [`Self::with_tier`].
    pub fn with_prefetched(mut self, prefetched: crate::fs::Prefetched) -> Self {
        if self.size == 0 || !self.chunks.is_empty() {
            return self;
        }
        // A whole tier copy is read locally (or passed through).
        if self.tier.as_ref().is_some_and(|o| o.covers(0, self.size)) {
            return self;
        }
        let crate::fs::Prefetched { fetch, memory } = prefetched;
        let (data, uri, etag, size) = (
            self.data.clone(),
            self.uri.clone(),
            self.etag.clone(),
            self.size,
        );
        let (tier, budget) = (self.tier.clone(), self.budget.clone());
        let work = async move {
            let bytes = match fetch.await {
                Ok(Ok(bytes)) if bytes.len() as u64 == size => bytes,
                _ => read_exact(data.as_ref(), &uri, 0..size, &etag)
                    .await
                    .map_err(FsError::from)?,
            };
            if let Some(object) = tier {
                object.fill_soon(0, bytes.clone(), &budget).await;
            }
            Ok(bytes)
        };
        self.chunks.push_back(Chunk {
            range: 0..size,
            fetch: Some(tokio::spawn(work)),
            data: None,
            _memory: memory,
            speculative: true,
            served: 0,
        });
        self
    }

    /// A random reader wants the object whole: completion starts at once
    /// instead of waiting for the object to go unread (a random reader
    /// fills almost nothing itself).
    fn ask_whole_now(&mut self) {
        if let Some(object) = &self.tier {
            object.want_now();
        }
        self.asked_whole = false;
        self.ask_whole();
    }

    /// Without a node-local tier: the workers fetch the object whole
    /// into their caches in the background, so this reader's later reads
    /// are served from there instead of costing a round trip to S3 each.
    fn warm_workers(&self) {
        let (data, uri, etag, size) = (
            self.data.clone(),
            self.uri.clone(),
            self.etag.clone(),
            self.size,
        );
        crate::metrics::global().worker_whole_fetch();
        tokio::spawn(async move {
            if let Err(e) = data.warm(&uri, &etag, size).await {
                tracing::info!(%uri, error = %crate::error::Chain(&e), "the workers could not fetch a randomly read object whole; reads fetch what they ask");
            }
        });
    }

    /// Asks for the whole tier copy now (a policy says the object is
    /// wanted whole); once per reader.
    pub fn ask_whole(&mut self) {
        if self.asked_whole {
            return;
        }
        if let (Some(object), Some(completer)) = (&self.tier, &self.completer) {
            self.asked_whole = true;
            object.keep_fills();
            completer.want_whole(object.clone(), self.uri.clone(), self.etag.clone());
        }
    }

    /// Follows the reader's run in file order; a run past
    /// [`COMPLETE_AFTER`] asks for the whole tier copy (once per reader).
    fn track_run(&mut self, offset: u64, end: u64) {
        let continues = offset <= self.run.end.saturating_add(REORDER_SLACK)
            && end.saturating_add(REORDER_SLACK) >= self.run.start;
        if continues {
            self.run.start = self.run.start.min(offset);
            self.run.end = self.run.end.max(end);
        } else {
            self.run = offset..end;
        }
        if self.run.end - self.run.start >= COMPLETE_AFTER {
            self.ask_whole();
        }
    }

    pub fn uri(&self) -> &ObjectUri {
        &self.uri
    }

    pub fn etag(&self) -> &str {
        &self.etag
    }

    pub fn has_served(&self) -> bool {
        self.served
    }

    /// Reads another version from now on (nothing of the old one was
    /// served); read-ahead of the old version is dropped.
    pub fn switch_version(&mut self, etag: String, size: u64) {
        self.chunks.clear();
        self.window = 0;
        self.next_offset = 0;
        self.etag = etag;
        self.size = size;
        // The tier copy is of the old version.
        self.tier = None;
        self.run = 0..0;
        self.tier_checked = CheckedBlocks::default();
    }

    /// The version read was copied in place to `etag` with new
    /// metadata and the same bytes: reads go on from the copy (the old
    /// version may be gone). Read-ahead stays valid; the tier copy is
    /// keyed by the old version and is let go.
    pub fn follow_copy(&mut self, from: &str, etag: &str) {
        if self.etag == from {
            self.etag = etag.to_string();
            self.tier = None;
            self.tier_checked = CheckedBlocks::default();
        }
    }

    /// The object was copied to `uri` as version `etag` (its directory
    /// renamed) and the source is going: reads go on from the copy.
    pub fn follow_move(&mut self, from: &str, uri: ObjectUri, etag: &str) {
        if self.etag == from {
            self.uri = uri;
            self.follow_copy(from, etag);
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes `[offset, offset + len)`, short at end of file.
    pub async fn read(&mut self, offset: u64, len: u64) -> Result<Bytes, FsError> {
        let bytes = self.read_range(offset, len).await?;
        self.served |= !bytes.is_empty();
        Ok(bytes)
    }

    /// Bytes `[offset, offset + len)` when the node-local tier holds them
    /// in blocks this reader has checked and no read-ahead covers them,
    /// read on the calling thread: such a read costs no hop through the
    /// runtime. A block's first read (a whole block read for its CRC)
    /// stays off this thread. `None`: use [`Self::read`]. Call within the
    /// runtime's context (completion of the tier copy may start).
    pub fn read_tier_now(&mut self, offset: u64, len: u64) -> Option<Bytes> {
        let end = offset.saturating_add(len).min(self.size);
        let object = self.tier.clone()?;
        let buffered = self.buffered(offset);
        // read_checked answers None, without I/O, where a block is missing.
        if offset >= end || buffered || !self.tier_checked.cover(offset, end) {
            return None;
        }
        match object.read_checked(offset, end - offset, &mut self.tier_checked) {
            Ok(Some(bytes)) => {
                self.track_run(offset, end);
                object.note_read();
                crate::metrics::global().tier_hit(bytes.len() as u64);
                self.next_offset = self.next_offset.max(end);
                self.served = true;
                Some(bytes)
            }
            Ok(None) => None,
            Err(e) => {
                self.drop_damaged_tier(&e);
                None
            }
        }
    }

    /// Bytes `[offset, offset + len)` when read-ahead already holds all
    /// of them, on the calling thread: a streaming reader's requests cost
    /// no hop through the runtime (at 128 KiB per kernel request, that
    /// hop was a large share of a cold stream's time). The stream goes on
    /// as in [`Self::read`]: the window grows and more is fetched ahead.
    /// `None`: use [`Self::read`]. Call within the runtime's context.
    pub fn read_buffered_now(&mut self, offset: u64, len: u64) -> Option<Bytes> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end || !self.buffered(offset) || self.chunks.back()?.range.end < end {
            return None;
        }
        let mut failed = false;
        for chunk in self.chunks_over(offset, end) {
            match chunk.ready_now() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(()) => {
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            // Start over on the async path, which refetches.
            self.chunks.clear();
            self.window = 0;
            return None;
        }
        self.track_run(offset, end);
        if let Some(object) = &self.tier {
            object.note_read();
        }
        self.advance_stream(offset, end);
        let mut pieces = Vec::new();
        for chunk in self.chunks_over(offset, end) {
            pieces.push(chunk.take_piece(offset, end)?);
        }
        self.served = true;
        Some(join_pieces(pieces, end - offset))
    }

    /// Whether `offset` lies in the read-ahead already fetched or on its way.
    fn buffered(&self, offset: u64) -> bool {
        match (self.chunks.front(), self.chunks.back()) {
            (Some(f), Some(b)) => f.range.start <= offset && offset < b.range.end,
            _ => false,
        }
    }

    /// A damaged or failing local copy costs speed, not the read: this
    /// reader goes to the workers, and the copy's blocks are fetched
    /// again by later reads.
    fn drop_damaged_tier(&mut self, e: &crate::local_tier::TierError) {
        crate::local_tier::Damage::of(e).note(object_id(&self.tier), e, "reading from the workers");
        if let Some(object) = self.tier.take() {
            object.forget_blocks();
        }
    }

    async fn read_range(&mut self, offset: u64, len: u64) -> Result<Bytes, FsError> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return Ok(Bytes::new());
        }
        self.track_run(offset, end);
        if let Some(object) = &self.tier {
            object.note_read();
        }
        let buffered = self.buffered(offset);
        // Bytes already fetched (or on their way) are served from memory;
        // otherwise the tier, where a miss is known without I/O.
        if let Some(object) = self
            .tier
            .clone()
            .filter(|o| !buffered && o.covers(offset, end - offset))
        {
            let mut checked = std::mem::take(&mut self.tier_checked);
            let local = tokio::task::spawn_blocking(move || {
                let got = object.read_checked(offset, end - offset, &mut checked);
                (got, checked)
            })
            .await
            .map_err(FsError::Task)?;
            self.tier_checked = local.1;
            match local.0 {
                Ok(Some(bytes)) => {
                    crate::metrics::global().tier_hit(bytes.len() as u64);
                    self.next_offset = self.next_offset.max(end);
                    return Ok(bytes);
                }
                Ok(None) => {}
                Err(e) => self.drop_damaged_tier(&e),
            }
        }
        if !self.continues_stream(offset, buffered) {
            self.note_jump(offset, end);
            return self.fetch(offset..end).await;
        }
        // A stream's first read fetches what it asked and nothing ahead:
        // a reader of a header (then a footer) only costs what it reads.
        // Read-ahead starts when the next read continues the stream. A
        // large first read from the start (the kernel already streams)
        // fetches as much again, which saves each small file a round trip.
        self.advance_stream(offset, end);
        match self.collect(offset, end).await {
            Ok(bytes) => Ok(bytes),
            Err(e) => {
                // Start over: the next read refetches instead of meeting
                // the failed chunk again, and the window grows anew.
                self.chunks.clear();
                self.window = 0;
                Err(e)
            }
        }
    }

    /// Whether a read at `offset` continues this reader's stream (served
    /// with read-ahead). A reader in random mode (no window) turns
    /// sequential only by continuing exactly where it stopped; a streaming
    /// one may skip ahead a little (the kernel's read-ahead arrives out of
    /// order).
    fn continues_stream(&self, offset: u64, buffered: bool) -> bool {
        let slack = if self.window == 0 {
            0
        } else {
            self.window.max(REORDER_SLACK)
        };
        let forward = offset >= self.next_offset && offset - self.next_offset <= slack;
        buffered || (forward && (offset == 0 || self.next_offset > 0))
    }

    /// A read of `[offset, end)` that does not continue the stream: unless
    /// it lands just behind it, the stream and its read-ahead are dropped
    /// (random access), and a random reader's third jump has the object
    /// fetched whole where that is allowed.
    fn note_jump(&mut self, offset: u64, end: u64) {
        let behind = offset < self.next_offset && self.next_offset - offset <= REORDER_SLACK;
        if behind {
            return;
        }
        self.chunks.clear();
        self.window = 0;
        self.next_offset = end;
        self.random_jumps += 1;
        if self.random_jumps == RANDOM_JUMPS_BEFORE_WHOLE && self.size <= self.random_whole_max {
            if self.tier.is_some() && self.completer.is_some() {
                self.ask_whole_now();
            } else {
                self.warm_workers();
            }
        }
    }

    /// Bytes `[offset, offset + len)` of a read that jumps (a sample
    /// reader's), where the data plane has them close at hand now (a
    /// worker on this host holding them: [`DataPlane::read_cached_now`]),
    /// read on the calling thread. A kernel-request thread that answers
    /// it itself saves the read two hand-offs (to the runtime, then to a
    /// blocking thread for the socket) and two back, each a wait for a
    /// core on a busy node. `None` for streams (read-ahead serves them),
    /// readers with a node-local tier (its fills are asynchronous) and
    /// bytes not held now; use [`Self::read`]. Call within the runtime's
    /// context.
    pub fn read_cached_now(&mut self, offset: u64, len: u64) -> Option<Bytes> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end
            || self.tier.is_some()
            || self.continues_stream(offset, self.buffered(offset))
        {
            return None;
        }
        let bytes = {
            let _demand = DemandRead::start();
            self.data
                .read_cached_now(&self.uri, offset..end, &self.etag)?
        };
        if bytes.len() as u64 != end - offset {
            return None;
        }
        self.track_run(offset, end);
        self.note_jump(offset, end);
        self.served = true;
        crate::metrics::global().cached_now(bytes.len() as u64);
        Some(bytes)
    }

    /// A sequential read of `[offset, end)`: grows the window, drops the
    /// chunks the reader passed and schedules fetches ahead of it.
    fn advance_stream(&mut self, offset: u64, end: u64) {
        let starting = self.window == 0;
        let first_ahead =
            if offset == 0 && (LARGE_FIRST_READ..KERNEL_MAX_READ).contains(&(end - offset)) {
                (end - offset).min(self.policy.initial)
            } else {
                0
            };
        self.window = if starting {
            self.policy.initial
        } else {
            (self.window * 2).min(self.policy.max)
        };
        self.next_offset = self.next_offset.max(end);
        // Drop what the reader has passed, keeping the chunk it just left
        // until it is REORDER_SLACK past it: the kernel's concurrent
        // read-ahead requests arrive out of order, and a late one must
        // still find its bytes here (not refetch them, or count as a jump).
        while self
            .chunks
            .front()
            .is_some_and(|c| c.range.end.saturating_add(REORDER_SLACK) <= offset)
        {
            self.chunks.pop_front();
        }
        if self.chunks.front().is_some_and(|c| c.range.start > offset) {
            self.chunks.clear();
        }
        let ahead = if starting { first_ahead } else { self.window };
        self.schedule(offset, end, end.saturating_add(ahead).min(self.size));
    }

    /// The chunks holding bytes of `[offset, end)`, in order (chunks are
    /// contiguous and sorted).
    fn chunks_over(&mut self, offset: u64, end: u64) -> impl Iterator<Item = &mut Chunk> {
        self.chunks
            .iter_mut()
            .skip_while(move |c| c.range.end <= offset)
            .take_while(move |c| c.range.start < end)
    }

    /// Assembles `[offset, end)` from the scheduled chunks.
    async fn collect(&mut self, offset: u64, end: u64) -> Result<Bytes, FsError> {
        let mut pieces = Vec::new();
        for chunk in self.chunks_over(offset, end) {
            chunk.bytes().await?;
            pieces.push(chunk.take_piece(offset, end).ok_or(FsError::BadHandle)?);
        }
        Ok(join_pieces(pieces, end - offset))
    }

    /// Starts fetches so that chunks cover `[from, until)`: always up to
    /// `demand` (what the reader asked for), beyond it only while the
    /// memory budget allows. While the window is smaller than a chunk,
    /// chunks stop at `until`, so the early reads of a stream fetch what
    /// they asked plus the window, not a whole chunk; after that chunks
    /// end on chunk multiples so that a stream's requests line up.
    fn schedule(&mut self, from: u64, demand: u64, until: u64) {
        let mut pos = self.chunks.back().map_or(from, |c| c.range.end);
        let chunk = self.policy.chunk.max(1);
        while pos < until {
            let mut end = ((pos / chunk + 1) * chunk).min(self.size);
            if self.window < chunk {
                end = end.min(until);
            }
            let memory = match self.budget.try_reserve(end - pos) {
                Some(r) => r,
                None if pos < demand => {
                    end = end.min(demand);
                    Reservation::none()
                }
                None => break, // read-ahead backs off
            };
            let range = pos..end;
            let data = self.data.clone();
            let uri = self.uri.clone();
            let etag = self.etag.clone();
            let r = range.clone();
            let tier = self.tier.clone();
            let budget = self.budget.clone();
            // Bytes past what the reader asked are a guess: the workers'
            // plans must not take them for the reader's own read (a
            // sample reader's first read would move its plan past a
            // sample it reads much later, and plan eviction drop it).
            let kind = if range.start >= demand {
                ReadKind::Ahead
            } else {
                ReadKind::Demand
            };
            // read_exact: a chunk is whole or an error, never short.
            let work = async move {
                let _demand = DemandRead::start();
                let bytes = read_exact_as(data.as_ref(), &uri, r.clone(), &etag, kind)
                    .await
                    .map_err(FsError::from)?;
                if let Some(object) = tier {
                    object.fill_soon(r.start, bytes.clone(), &budget).await;
                }
                Ok(bytes)
            };
            // The worker it waits on shows in the in-flight table under
            // the read that started it.
            // and the fetch stays in the read's trace.
            let work = tracing::Instrument::in_current_span(work);
            let fetch = match lakecache_telemetry::InFlight::current() {
                Some(op) => tokio::spawn(op.scope(work)),
                None => tokio::spawn(work),
            };
            self.chunks.push_back(Chunk {
                speculative: range.start >= demand,
                range,
                fetch: Some(fetch),
                data: None,
                _memory: memory,
                served: 0,
            });
            pos = end;
        }
    }

    async fn fetch(&self, range: Range<u64>) -> Result<Bytes, FsError> {
        let start = range.start;
        let demand = DemandRead::start();
        let bytes = read_exact(self.data.as_ref(), &self.uri, range, &self.etag).await?;
        drop(demand);
        // Out-of-order and random reads fill too, or a file read by
        // several jobs at once would keep holes.
        if let Some(object) = &self.tier {
            object.fill_soon(start, bytes.clone(), &self.budget).await;
        }
        Ok(bytes)
    }
}

fn object_id(tier: &Option<Arc<TierObject>>) -> &str {
    tier.as_deref().map_or("", TierObject::id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data_plane::{DataError, DataFault, DataOp, FaultyDataPlane, MemoryDataPlane};

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn content(len: u64) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    fn setup(len: u64) -> (Arc<FaultyDataPlane<MemoryDataPlane>>, FileReader, Vec<u8>) {
        setup_with(len, MemoryBudget::new(1 << 30))
    }

    fn setup_with(
        len: u64,
        budget: Arc<MemoryBudget>,
    ) -> (Arc<FaultyDataPlane<MemoryDataPlane>>, FileReader, Vec<u8>) {
        let body = content(len);
        let memory = MemoryDataPlane::new();
        let etag = memory.insert("bkt", "obj", body.clone());
        let rec = Arc::new(FaultyDataPlane::new(memory));
        let reader = FileReader::new(
            rec.clone(),
            ObjectUri::new("bkt", "obj").unwrap(),
            etag,
            len,
            ReadaheadPolicy {
                initial: 256 * KIB,
                max: 2 * MIB,
                chunk: 512 * KIB,
            },
            budget,
        );
        (rec, reader, body)
    }

    async fn read_all(r: &mut FileReader, len: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let mut off = 0;
        while off < len {
            let got = r.read(off, 128 * KIB).await.unwrap();
            off += got.len() as u64;
            out.extend_from_slice(&got);
        }
        out
    }

    async fn wait_complete(object: &TierObject) {
        for _ in 0..500 {
            if object.is_complete() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the local tier never completed");
    }

    /// [`setup`] with an empty node-local tier and its object for the reader's version.
    #[allow(clippy::type_complexity)]
    fn setup_with_tier(
        len: u64,
    ) -> (
        Arc<FaultyDataPlane<MemoryDataPlane>>,
        FileReader,
        Vec<u8>,
        tempfile::TempDir,
        crate::local_tier::LocalTier,
        Arc<TierObject>,
    ) {
        let (rec, reader, body) = setup(len);
        let dir = tempfile::tempdir().unwrap();
        let tier = crate::local_tier::LocalTier::open(dir.path(), 64 * MIB).unwrap();
        let object = tier
            .get_or_create("s3://bkt/obj", &reader.etag, len)
            .unwrap();
        (rec, reader, body, dir, tier, object)
    }

    #[tokio::test]
    async fn reads_the_tier_holds_are_served_at_once_and_damage_still_caught() {
        use std::os::unix::fs::FileExt;
        let len = 3 * MIB + 5;
        let (rec, reader, body, _dir, _tier, object) = setup_with_tier(len);
        let mut r = reader.with_tier(Some(object.clone()), None);
        assert!(r.read_tier_now(0, 4096).is_none(), "nothing is there yet");
        object
            .fill(MIB, &body[MIB as usize..2 * MIB as usize])
            .unwrap();
        let fetched = rec.read_ranges().len();
        assert!(
            r.read_tier_now(MIB, 4096).is_none(),
            "a block's first read, which checks it whole, is left to the runtime"
        );
        assert_eq!(
            &r.read(MIB, 4096).await.unwrap()[..],
            expect(&body, MIB, 4096)
        );
        for at in [MIB, MIB + 4096 * 7, 2 * MIB - 4096] {
            let got = r.read_tier_now(at, 4096).expect("a filled block");
            assert_eq!(&got[..], expect(&body, at, 4096));
        }
        assert!(
            r.read_tier_now(2 * MIB - 100, 4096).is_none(),
            "spans a hole"
        );
        assert_eq!(rec.read_ranges().len(), fetched, "no request left the node");
        assert!(r.has_served());

        // A flipped byte in a block this reader has not checked yet: its
        // first read checks it, forgets it and reads from the workers.
        object.fill(0, &body[..MIB as usize]).unwrap();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(object.backing_path())
            .unwrap();
        f.write_all_at(&[body[100] ^ 0xff], 100).unwrap();
        assert!(r.read_tier_now(0, 4096).is_none(), "not checked yet");
        assert_eq!(&r.read(0, 4096).await.unwrap()[..], expect(&body, 0, 4096));
        assert!(!object.covers(0, 4096), "the damaged block is forgotten");
        assert!(r.read_tier_now(0, 4096).is_none());
        assert!(
            rec.read_ranges().len() > fetched,
            "fetched from the workers"
        );
    }

    #[tokio::test]
    async fn a_second_read_comes_from_the_local_tier_and_damage_is_refetched() {
        use std::os::unix::fs::FileExt;
        let len = 5 * MIB + 123;
        let (rec, reader, body, _dir, tier, object) = setup_with_tier(len);
        let mut first = reader.with_tier(Some(object.clone()), None);
        assert_eq!(read_all(&mut first, len).await, body);
        wait_complete(&object).await;
        let fetched = rec.read_ranges().len();

        // Another open of the same version, with the tier's object.
        let reopen = |r: &FileReader| {
            FileReader::new(
                rec.clone(),
                r.uri.clone(),
                r.etag.clone(),
                len,
                r.policy,
                MemoryBudget::new(1 << 30),
            )
            .with_tier(tier.get("s3://bkt/obj", &r.etag), None)
        };
        // A new reader of the same version: no request leaves the node.
        let mut second = reopen(&first);
        assert_eq!(read_all(&mut second, len).await, body);
        assert_eq!(
            rec.read_ranges().len(),
            fetched,
            "the warm read went to a worker"
        );

        // A flipped byte on disk is caught, and those bytes come from the
        // workers instead (and are filled again).
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(object.backing_path())
            .unwrap();
        f.write_all_at(&[body[3 * MIB as usize] ^ 0xff], 3 * MIB)
            .unwrap();
        let mut third = reopen(&first);
        assert_eq!(read_all(&mut third, len).await, body);
        assert!(
            rec.read_ranges().len() > fetched,
            "the damaged block was refetched"
        );
        wait_complete(&object).await;
        assert!(object.verify().unwrap());
    }

    fn expect(body: &[u8], off: u64, len: u64) -> &[u8] {
        let end = (off + len).min(body.len() as u64) as usize;
        &body[off as usize..end]
    }

    #[tokio::test]
    async fn sequential_reads_grow_the_window_in_aligned_chunks() {
        let (rec, mut r, body) = setup(8 * MIB);
        let mut off = 0;
        while off < 8 * MIB {
            let got = r.read(off, 128 * KIB).await.unwrap();
            assert_eq!(&got[..], expect(&body, off, 128 * KIB));
            off += 128 * KIB;
        }
        assert_eq!(r.window, 2 * MIB, "window doubles up to the max");
        let ranges = rec.read_ranges();
        // 64 kernel reads became a handful of chunk requests, together
        // covering the file once; once the window passed a chunk, each
        // request ends on a chunk boundary.
        assert!(ranges.len() <= 24, "{ranges:?}");
        assert!(
            ranges
                .iter()
                .filter(|r| r.start >= 2 * MIB)
                .all(|r| r.end % (512 * KIB) == 0),
            "{ranges:?}"
        );
        let covered: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        assert_eq!(covered, 8 * MIB, "no byte fetched twice: {ranges:?}");
    }

    #[tokio::test]
    async fn a_first_read_fetches_what_it_asked_and_the_next_one_starts_the_window() {
        // Reading a shard's header (then its footer) must cost what it
        // reads; a reader that goes on gets read-ahead from its 2nd read.
        let (rec, mut r, body) = setup(64 * MIB);
        let got = r.read(0, KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, 0, KIB));
        let fetched = |rec: &FaultyDataPlane<MemoryDataPlane>| -> u64 {
            rec.read_ranges().iter().map(|r| r.end - r.start).sum()
        };
        assert_eq!(fetched(&rec), KIB, "the first read: what it asked");
        let got = r.read(KIB, KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, KIB, KIB));
        // The window doubled once (512 KiB, one chunk), so requests now
        // end on chunk boundaries: up to 512 KiB, then the next chunk.
        assert_eq!(
            fetched(&rec),
            MIB,
            "the second: up to the chunk boundaries past its window"
        );
    }

    #[tokio::test]
    async fn a_large_first_read_from_the_start_fetches_at_most_as_much_again() {
        // The kernel asks 512 KiB or more only of a streaming reader: one
        // request covers the next read too, saving a small file a round
        // trip, and never more than twice what was asked.
        let (rec, mut r, body) = setup(64 * MIB);
        let got = r.read(0, 512 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, 0, 512 * KIB));
        // Requests in parallel, split at chunk boundaries; the bytes past
        // what was asked go to the workers as a read-ahead, which their
        // plans do not take for the reader's read (a sample reader's
        // first read at offset 0 looks the same).
        let first = rec.read_ranges();
        assert_eq!(
            rec.read_requests(),
            vec![
                (0..512 * KIB, ReadKind::Demand),
                (512 * KIB..768 * KIB, ReadKind::Ahead)
            ],
            "asked + the initial window"
        );
        let got = r.read(512 * KIB, 256 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, 512 * KIB, 256 * KIB));
        assert!(
            rec.read_ranges()[first.len()..]
                .iter()
                .all(|r| r.start >= 768 * KIB),
            "the second read was served by the first read's requests"
        );
        // Not from the start: what it asked, as for a footer.
        let (rec, mut r, _) = setup(64 * MIB);
        r.read(MIB, 512 * KIB).await.unwrap();
        assert_eq!(rec.read_ranges(), vec![MIB..MIB + 512 * KIB]);
        // The kernel's largest read: a stream's next read comes from the
        // kernel at once, and a sample reader's never does.
        let (rec, mut r, _) = setup(64 * MIB);
        r.read(0, KERNEL_MAX_READ).await.unwrap();
        let asked = rec.read_requests();
        assert_eq!(
            asked.iter().map(|(r, _)| r.end - r.start).sum::<u64>(),
            KERNEL_MAX_READ,
            "{asked:?}"
        );
        assert!(
            asked
                .iter()
                .all(|(r, kind)| r.end <= KERNEL_MAX_READ && *kind == ReadKind::Demand),
            "only what it asked: {asked:?}"
        );
    }

    #[tokio::test]
    async fn read_ahead_backs_off_when_the_memory_budget_is_spent() {
        let budget = MemoryBudget::new(MIB);
        let (rec, mut r, body) = setup_with(16 * MIB, budget.clone());
        // Another file holds most of the budget.
        let held = budget.try_reserve(768 * KIB).unwrap();
        let mut off = 0;
        while off < 4 * MIB {
            let got = r.read(off, 128 * KIB).await.unwrap();
            assert_eq!(&got[..], expect(&body, off, 128 * KIB), "offset {off}");
            off += 128 * KIB;
            let ahead: u64 = r
                .chunks
                .iter()
                .filter(|c| c.range.start >= off)
                .map(|c| c.range.end - c.range.start)
                .sum();
            assert!(
                ahead <= 256 * KIB,
                "read ahead {ahead} bytes past a spent budget"
            );
        }
        drop(held);
        let before = rec.read_ranges().len();
        for _ in 0..4 {
            r.read(off, 128 * KIB).await.unwrap();
            off += 128 * KIB;
        }
        let ahead: u64 = r.chunks.iter().map(|c| c.range.end - c.range.start).sum();
        assert!(ahead > 256 * KIB, "read-ahead resumes once memory is free");
        assert!(rec.read_ranges().len() > before);
    }

    #[tokio::test]
    async fn reordered_reads_stay_one_stream() {
        let (rec, mut r, body) = setup(8 * MIB);
        // The kernel's async read-ahead lands slightly out of order.
        for off in [0, 256 * KIB, 128 * KIB, 512 * KIB, 384 * KIB, 640 * KIB] {
            let got = r.read(off, 128 * KIB).await.unwrap();
            assert_eq!(&got[..], expect(&body, off, 128 * KIB), "offset {off}");
        }
        assert!(r.window > 0, "still streaming");
        let covered: u64 = rec.read_ranges().iter().map(|r| r.end - r.start).sum();
        assert!(covered <= 4 * MIB, "reordering did not restart read-ahead");
    }

    #[tokio::test]
    async fn random_access_fetches_exactly_what_was_asked() {
        let (rec, mut r, body) = setup(64 * MIB);
        r.read(0, 128 * KIB).await.unwrap();
        r.read(128 * KIB, 128 * KIB).await.unwrap();
        assert!(r.window > 0);
        rec.clear_read_log();
        for off in [40 * MIB, 7 * MIB + 13, 63 * MIB, 20 * MIB] {
            let got = r.read(off, 4 * KIB).await.unwrap();
            assert_eq!(&got[..], expect(&body, off, 4 * KIB));
        }
        assert_eq!(r.window, 0, "random access drops the read-ahead");
        assert!(r.chunks.is_empty());
        let ranges = rec.read_ranges();
        assert_eq!(ranges.len(), 4, "{ranges:?}");
        assert!(
            ranges.iter().all(|r| r.end - r.start == 4 * KIB),
            "{ranges:?}"
        );
    }

    #[tokio::test]
    async fn reads_past_the_end_are_short_or_empty() {
        let (_rec, mut r, body) = setup(MIB + 5);
        let got = r.read(MIB, 128 * KIB).await.unwrap();
        assert_eq!(&got[..], &body[MIB as usize..]);
        assert!(r.read(MIB + 5, 10).await.unwrap().is_empty());
        assert!(r.read(10 * MIB, 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_failed_chunk_resets_the_stream_and_the_next_read_recovers() {
        let (rec, mut r, body) = setup(8 * MIB);
        r.read(0, 128 * KIB).await.unwrap();
        rec.inject(
            DataOp::Read,
            0,
            u64::MAX,
            DataFault::Fail(DataError::UploadCut),
        );
        // Everything already prefetched may still serve; the first read
        // needing a new chunk fails.
        let mut off = 128 * KIB;
        let err = loop {
            match r.read(off, 128 * KIB).await {
                Ok(_) => off += 128 * KIB,
                Err(e) => break e,
            }
            assert!(off < 8 * MIB, "the fault never surfaced");
        };
        assert_eq!(err.errno(), libc::EIO);
        assert_eq!(r.window, 0, "an error restarts the window");
        rec.heal();
        let got = r.read(off, 128 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, off, 128 * KIB));
        let got = r.read(off + 128 * KIB, 128 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, off + 128 * KIB, 128 * KIB));
    }

    #[tokio::test]
    async fn a_truncated_body_is_an_error_never_short_data() {
        let (rec, mut r, body) = setup(4 * MIB);
        rec.inject(DataOp::Read, 0, 1, DataFault::Truncate { keep: 1000 });
        let err = r.read(0, 128 * KIB).await.unwrap_err();
        assert_eq!(err.errno(), libc::EIO);
        assert!(
            matches!(err, FsError::DataPlane(DataError::ShortBody { .. })),
            "{err:?}"
        );
        let got = r.read(0, 128 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, 0, 128 * KIB));
        // And on the random path.
        rec.inject(DataOp::Read, 0, 1, DataFault::Truncate { keep: 10 });
        let err = r.read(3 * MIB, 4 * KIB).await.unwrap_err();
        assert_eq!(err.errno(), libc::EIO);
        let got = r.read(3 * MIB, 4 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, 3 * MIB, 4 * KIB));
    }

    /// Lets spawned fetches of the in-memory data plane run to the end.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn fetched_read_ahead_is_served_without_waiting_and_the_stream_goes_on() {
        let len = 8 * MIB + 3;
        let (rec, mut r, body) = setup(len);
        assert!(
            r.read_buffered_now(0, 128 * KIB).is_none(),
            "nothing fetched yet"
        );
        let (mut off, mut now, mut waited) = (0, 0, 0);
        while off < len {
            settle().await;
            let got = match r.read_buffered_now(off, 128 * KIB) {
                Some(bytes) => {
                    now += 1;
                    bytes
                }
                None => {
                    waited += 1;
                    r.read(off, 128 * KIB).await.unwrap()
                }
            };
            assert_eq!(&got[..], expect(&body, off, 128 * KIB), "at {off}");
            off += got.len() as u64;
        }
        // The stream's first reads wait; after that the window keeps
        // ahead of the reader, so every read is served at once.
        assert!(waited <= 3, "{waited} reads waited, {now} did not");
        assert!(now >= 60, "{now}");
        // Each byte fetched once: serving at once dropped no read-ahead.
        let fetched: u64 = rec.read_ranges().iter().map(|r| r.end - r.start).sum();
        assert_eq!(fetched, len);
        assert!(r.has_served());
    }

    #[tokio::test]
    async fn a_failed_read_ahead_chunk_is_refetched_by_the_waiting_path() {
        let len = 4 * MIB;
        let (rec, mut r, body) = setup(len);
        let mut off = 0;
        for _ in 0..2 {
            off += r.read(off, 128 * KIB).await.unwrap().len() as u64;
        }
        // The read-ahead fetched so far is served; the fetches it starts
        // from here on fail, until the first read that meets one.
        rec.inject(DataOp::Read, 0, 64, DataFault::Fail(DataError::UploadCut));
        let mut refused = 0;
        while off < len {
            settle().await;
            let got = match r.read_buffered_now(off, 128 * KIB) {
                Some(bytes) => bytes,
                None => {
                    refused += 1;
                    rec.heal();
                    r.read(off, 128 * KIB).await.unwrap()
                }
            };
            assert_eq!(&got[..], expect(&body, off, 128 * KIB), "at {off}");
            off += got.len() as u64;
        }
        assert!(refused >= 1, "the failed chunk was not served at once");
    }

    #[tokio::test]
    async fn a_late_kernel_read_behind_the_stream_is_served_from_memory() {
        let len = 4 * MIB;
        let (rec, mut r, body) = setup(len);
        // Stream into the second 512 KiB chunk, holding back one read of
        // the first chunk, as the kernel's concurrent requests may.
        let held_back = 384 * KIB;
        let mut off = 0;
        while off < 768 * KIB {
            if off != held_back {
                let got = r.read(off, 128 * KIB).await.unwrap();
                assert_eq!(&got[..], expect(&body, off, 128 * KIB));
            }
            off += 128 * KIB;
        }
        let late = r.read(held_back, 128 * KIB).await.unwrap();
        assert_eq!(&late[..], expect(&body, held_back, 128 * KIB));
        // The stream goes on where it was.
        let got = r.read(off, 128 * KIB).await.unwrap();
        assert_eq!(&got[..], expect(&body, off, 128 * KIB));
        let ranges = rec.read_ranges();
        assert!(
            !ranges.contains(&(held_back..held_back + 128 * KIB)),
            "the late read was fetched again: {ranges:?}"
        );
        let mut starts: Vec<u64> = ranges.iter().map(|r| r.start).collect();
        starts.sort_unstable();
        starts.dedup();
        assert_eq!(
            starts.len(),
            ranges.len(),
            "a range fetched twice: {ranges:?}"
        );
    }

    #[tokio::test]
    async fn a_jump_into_bytes_a_local_worker_holds_is_read_on_the_calling_thread() {
        let (rec, mut reader, body) = setup(4 * MIB);
        let serving = |on: bool| {
            rec.inner().set_quirks(crate::data_plane::Quirks {
                serves_now: on,
                ..Default::default()
            })
        };
        // A plane without such a path: the read waits as usual.
        assert!(reader.read_cached_now(MIB, 128 * KIB).is_none());
        serving(true);
        // A stream's first read (from 0) is left to read-ahead.
        assert!(reader.read_cached_now(0, 128 * KIB).is_none());
        // A sample read inside the file: served now, as asked.
        let got = reader.read_cached_now(MIB + 5, 300 * KIB).unwrap();
        assert_eq!(
            &got[..],
            &body[(MIB + 5) as usize..(MIB + 5 + 300 * KIB) as usize]
        );
        assert_eq!(rec.read_ranges(), vec![MIB + 5..MIB + 5 + 300 * KIB]);
        assert!(reader.has_served());
        // Another jump, short at the end of the file.
        let got = reader.read_cached_now(4 * MIB - 10, 128 * KIB).unwrap();
        assert_eq!(&got[..], &body[(4 * MIB - 10) as usize..]);
        // A read that carries on from the last one is a stream's.
        let (_, mut streaming, _) = setup(4 * MIB);
        streaming.read(2 * MIB, 64 * KIB).await.unwrap();
        assert!(streaming
            .read_cached_now(2 * MIB + 64 * KIB, 64 * KIB)
            .is_none());
        // An armed read fault is for the reads that wait: none now.
        rec.inject(DataOp::Read, 0, 1, DataFault::Fail(DataError::NotFound));
        assert!(reader.read_cached_now(3 * MIB, 4 * KIB).is_none());
        let e = reader.read(3 * MIB, 4 * KIB).await.unwrap_err();
        assert!(matches!(e, FsError::NotFound), "{e:?}");
    }
}
