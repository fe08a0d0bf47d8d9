//! The cache core: metadata with a TTL, page reads with single-flight and
//! read-ahead, LRU eviction. Writes live in `write.rs`.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use lakecache_protocol::{BucketTraffic, ListResponse, ObjectUri, ReadKind};
use tokio::sync::{Notify, Semaphore};

use crate::cache_dir::CacheDir;
use crate::flight::SingleFlight;
use crate::index::{Index, ObjectRecord, PageEntry};
use crate::lru::{Lru, Retention};
use crate::metrics::Metrics;
use crate::pages::{CheckedFile, PageId, PageKey, PageReadError, PageStore, CHECK_BLOCK};
use crate::store::{ObjectMeta, ObjectStore, StoreError};
use lakecache_protocol::memory::MemoryBudget;

mod plan;
mod plan_fetch;
pub use plan::{PlanEntry, PlanReport};
pub use plan_fetch::PlanPrefetchConfig;

tokio::task_local! {
    /// Set when a read being served waits on S3 (or on a fetch already in
    /// flight): the read was not a cache hit.
    static WAITED: std::cell::Cell<bool>;
}

/// Marks the read being served as one that waited for its bytes.
fn mark_waited() {
    let _ = WAITED.try_with(|w| w.set(true));
}

/// Where a read's first piece came from, as `x-lakecache-cache` reports
/// it: a hit had every byte cached when the read was issued; a read that
/// waited on S3 or on a fetch still in flight (a prefetch's too) missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    Hit,
    Miss,
}

impl Served {
    pub fn as_str(self) -> &'static str {
        match self {
            Served::Hit => "hit",
            Served::Miss => "miss",
        }
    }
}

#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub page_size: u64,
    pub capacity: u64,
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// How long HEAD and LIST results are trusted; zero revalidates always.
    pub metadata_ttl: Duration,
    pub readahead_pages: u32,
    pub fetch_concurrency: usize,
    pub part_size: u64,
    /// Largest object copied with one CopyObject, and largest copied part
    /// of bigger ones (S3's limit: 5 GiB, `store::MAX_COPY_BYTES`).
    pub copy_part_limit: u64,
    /// The ring's segment size, when the worker is in a ring: read-ahead
    /// stops at the end of the segment being read.
    pub segment_size: Option<u64>,
    /// Write-back staging and uploads.
    pub writeback: crate::writeback::WriteBackConfig,
    /// Memory for upload parts and pages being fetched, all requests
    /// together; work beyond it waits.
    pub memory_limit: u64,
    /// Per-prefix pin, TTL, skip-cache and max-age rules.
    pub policies: crate::policy::Policies,
    /// Dollars per GB of S3 egress, for the egress-saved metric.
    pub egress_price_per_gb: f64,
    /// Cache bytes each named tenant may hold (pending write-back data
    /// included); tenants not named share what is left by plain LRU.
    pub tenant_quotas: std::collections::BTreeMap<String, u64>,
    /// S3 requests per second each named tenant's work may make.
    pub tenant_s3_rps: std::collections::BTreeMap<String, u32>,
    /// Fetching ahead of jobs that published plans.
    pub plan_prefetch: PlanPrefetchConfig,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum CacheError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("local cache failure: {0}")]
    Local(String),
    #[error("request body failed: {0}")]
    Body(String),
    #[error("request body exceeds the limit of {0} bytes")]
    BodyTooLarge(u64),
    #[error("{0}")]
    BodyIdle(String),
    #[error("object of {0} bytes is larger than a server-side copy allows")]
    CopyTooLarge(u64),
    #[error("the worker is shutting down; the upload was aborted")]
    ShuttingDown,
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A file followed while it was written changed after the worker took
    /// some of it (a writer that patches a header, as zip and HDF5
    /// writers do); the mount then commits it whole.
    #[error("invalid request: {0}")]
    FollowedFileChanged(String),
    #[error("checksum mismatch: {0}")]
    ChecksumMismatch(String),
    /// The write outlived its client's patience (see `fence.rs`).
    #[error("write fenced: {0}")]
    Fenced(String),
    #[error("{0}")]
    StagingFull(String),
    #[error("{0}")]
    ReplicasUnavailable(String),
}

impl From<crate::index::IndexError> for CacheError {
    fn from(e: crate::index::IndexError) -> Self {
        CacheError::Local(e.to_string())
    }
}

pub struct Cache {
    _dir_lock: CacheDir,
    pub(crate) memory: Arc<MemoryBudget>,
    /// Set at shutdown: uploads in progress abort and clean up.
    pub(crate) closing: tokio::sync::watch::Sender<bool>,
    pub(crate) config: CacheConfig,
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) pages: PageStore,
    pub(crate) index: Index,
    pub(crate) lru: Lru,
    pub(crate) metrics: Arc<Metrics>,
    page_flights: SingleFlight<PageKey, Result<Bytes, CacheError>>,
    /// Partial fills: (page, first block, end block).
    block_flights: SingleFlight<(PageKey, u64, u64), Result<Bytes, CacheError>>,
    head_flights: SingleFlight<String, Result<ObjectMeta, CacheError>>,
    fetch_permits: Arc<Semaphore>,
    readahead_permits: Arc<Semaphore>,
    /// Where the last read of each object ended, to detect sequential access.
    last_read_end: Mutex<HashMap<String, u64>>,
    pub(crate) evict: Arc<Notify>,
    pub(crate) peers: crate::placement::Peers,
    /// Preload jobs (`lakecache load`).
    pub preloads: crate::preload::Preloads,
    /// Acknowledged writes not yet in S3 (`None`: write-back is off).
    pub(crate) writeback: Option<Arc<crate::writeback::WriteBack>>,
    /// Totals for `/v1/health` (the same counts feed the metrics).
    traffic: std::sync::Mutex<std::collections::BTreeMap<String, BucketTraffic>>,
    /// Which random misses fetch whole blocks and which exactly.
    random_admission: crate::admission::RandomAdmission,
    /// Fails metadata calls fast while S3 is unreachable.
    pub(crate) s3_down: crate::outage::OutageBreaker,
    /// Pages just fetched whole, served from memory until read.
    fresh: crate::fresh::FreshPages,
    /// Fetched pages whose page file is still being written.
    writing: crate::fresh::PagesInWrite,
    /// The pages each plan reads, for fetching ahead of its reader.
    plan_fetches: plan_fetch::PlanFetches,
}

/// How a read's miss is fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fetch {
    /// The page whole, even over a partly filled one (a plan reads it
    /// again).
    WholePage,
    /// The page whole unless partly filled (then the blocks touched).
    Sequential,
    /// The blocks touched: a plan reads part of the page here.
    Blocks,
    /// The page whole unless partly filled; then its blocks from the read
    /// to the page's end. A read of a planned page that carries on from
    /// the last one: a plan's reader reading on, or the kernel reading
    /// ahead past a sample through a mount, which reads the rest of the
    /// page next (fetching that whole kept those reads hits).
    PlannedSequential,
    /// The blocks touched, or exactly the bytes (see `crate::admission`).
    Random,
}

/// What an S3 fetch holds while its bytes are in use: a fetch permit and
/// the bytes' share of the memory budget.
type FetchHeld = (
    tokio::sync::OwnedSemaphorePermit,
    lakecache_protocol::memory::Reservation,
);

const MAX_TRACKED_STREAMS: usize = 16_384;
/// Largest piece a response stream holds at once, so memory per client
/// stays small whatever the page and request sizes.
const MAX_PIECE: u64 = 1 << 20;
/// HEADs in flight while a listing gets its objects' metadata.
const LISTING_HEADS_IN_FLIGHT: usize = 32;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Cache {
    pub fn open(
        dir: &Path,
        config: CacheConfig,
        store: Arc<dyn ObjectStore>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Self>, CacheError> {
        // The lock comes first: nothing in a live worker's directory is touched.
        let dir_lock =
            CacheDir::open(dir, config.page_size).map_err(|e| CacheError::Local(e.to_string()))?;
        metrics.discarded_pages(dir_lock.discarded_pages);
        let pages = PageStore::open(dir)
            .map_err(|e| CacheError::Local(format!("cache dir {}: {e}", dir.display())))?;
        let index = Index::open(&dir.join("index"))?;
        metrics
            .cache_capacity_bytes
            .store(config.capacity, std::sync::atomic::Ordering::Relaxed);
        let lru = Lru::new(
            config.capacity,
            config.high_watermark,
            config.low_watermark,
            metrics.cache_used_bytes.clone(),
        );
        let restored = index
            .load_pages()?
            .into_iter()
            .map(|(key, seq, entry)| {
                let fetched = if entry.fetched_ms > 0 {
                    entry.fetched_ms
                } else {
                    now_ms()
                };
                crate::lru::RestoredPage {
                    key,
                    seq,
                    len: entry.len,
                    retention: retention(&config.policies, &entry.uri, fetched),
                    tenant: entry.tenant.as_deref().map(Arc::from),
                }
            })
            .collect();
        lru.restore(restored);
        metrics.set_egress_price_per_gb(config.egress_price_per_gb);
        let readahead = (config.fetch_concurrency / 2).max(1);
        // Room for several sequential readers' read-ahead windows.
        let fresh_bytes = (u64::from(config.readahead_pages) + 1)
            .saturating_mul(config.page_size)
            .saturating_mul(8)
            .min(config.memory_limit / 8)
            + plan_fetch::stage_room(config.page_size, config.memory_limit);
        let writeback = crate::writeback::WriteBack::open(dir, config.writeback.clone())
            .map_err(|e| CacheError::Local(e.to_string()))?;
        writeback.keep_spares(config.page_size);
        let writeback = Some(Arc::new(writeback));
        let cache = Arc::new(Self {
            writeback,
            _dir_lock: dir_lock,
            memory: MemoryBudget::new(config.memory_limit),
            closing: tokio::sync::watch::Sender::new(false),
            fetch_permits: Arc::new(Semaphore::new(config.fetch_concurrency.max(1))),
            readahead_permits: Arc::new(Semaphore::new(readahead)),
            config,
            store,
            pages,
            index,
            lru,
            metrics,
            page_flights: SingleFlight::default(),
            head_flights: SingleFlight::default(),
            last_read_end: Mutex::default(),
            block_flights: SingleFlight::default(),
            evict: Arc::new(Notify::new()),
            peers: Default::default(),
            preloads: Default::default(),
            traffic: Default::default(),
            random_admission: Default::default(),
            s3_down: Default::default(),
            fresh: crate::fresh::FreshPages::new(fresh_bytes),
            writing: Default::default(),
            plan_fetches: Default::default(),
        });
        tokio::spawn(evictor(Arc::downgrade(&cache), cache.evict.clone()));
        tokio::spawn(plan_fetch::prefetcher(Arc::downgrade(&cache)));
        if let Some(wb) = &cache.writeback {
            let _ = cache.metrics.writeback.set(Arc::downgrade(wb));
            let _ = cache.metrics.cache.set(Arc::downgrade(&cache));
            tokio::spawn(crate::writeback::uploader(
                Arc::downgrade(&cache),
                wb.clone(),
            ));
            tokio::spawn(crate::writeback::replica_watcher(
                Arc::downgrade(&cache),
                wb.clone(),
            ));
            tokio::spawn(crate::writeback::spare_filler(Arc::downgrade(wb)));
        }
        cache.evict.notify_one();
        Ok(cache)
    }

    pub fn page_size(&self) -> u64 {
        self.config.page_size
    }

    /// Object metadata, from the index while younger than the TTL.
    pub async fn stat(self: &Arc<Self>, uri: &ObjectUri) -> Result<ObjectMeta, CacheError> {
        if let Some(meta) = self.pending_meta(uri)? {
            return Ok(meta);
        }
        let asked_ms = now_ms();
        let (this, key) = (self.clone(), uri.to_string());
        let rec = tokio::task::spawn_blocking(move || this.index.get_object(&key))
            .await
            .map_err(join_failed)??;
        if let Some(rec) = rec {
            let age = now_ms().saturating_sub(rec.validated_ms);
            let ttl = self
                .config
                .policies
                .for_uri(&uri.to_string())
                .and_then(|p| p.max_age)
                .unwrap_or(self.config.metadata_ttl);
            let fresh = age >= 0 && (age as u128) < ttl.as_millis();
            // A record from a listing lacks the user metadata: HEAD once.
            if let (true, Some(user)) = (fresh, rec.user) {
                return Ok(ObjectMeta {
                    size: rec.size,
                    etag: rec.etag,
                    last_modified_ms: rec.last_modified_ms,
                    user,
                });
            }
        }
        self.head_once(uri, Some(asked_ms)).await
    }

    /// HEADs the object (one HEAD for concurrent callers) and records the
    /// answer; a new ETag makes the old version's pages unreachable.
    pub async fn revalidate(self: &Arc<Self>, uri: &ObjectUri) -> Result<ObjectMeta, CacheError> {
        self.head_once(uri, None).await
    }

    /// [`Self::revalidate`]; with `recorded_since`, a record made at or
    /// after that time answers instead of a HEAD: a stat whose index
    /// lookup missed just before another caller's HEAD recorded the object
    /// would otherwise HEAD again once that flight has ended.
    async fn head_once(
        self: &Arc<Self>,
        uri: &ObjectUri,
        recorded_since: Option<i64>,
    ) -> Result<ObjectMeta, CacheError> {
        if let Some(meta) = self.pending_meta(uri)? {
            return Ok(meta);
        }
        let key = uri.to_string();
        let this = self.clone();
        self.head_flights
            .run(key.clone(), || async move {
                if let Some(since) = recorded_since {
                    if let Some(meta) = this.recorded_since(&key, since).await {
                        return Ok(meta);
                    }
                }
                // In its own task: a client giving up must not cancel the
                // call whose outcome opens or closes the breaker. A probe
                // runs on without the caller, who gets the fast answer.
                let headed = match this.s3_down.check() {
                    Err(crate::outage::Blocked::Open) => Err(crate::outage::OutageBreaker::unavailable()),
                    allowed => {
                        let (probe, target) = (this.clone(), uri.clone());
                        let head = crate::tenant::spawn(async move {
                            let r = probe.store.head(&target).await;
                            probe.s3_down.observe(r)
                        });
                        match allowed {
                            Ok(()) => head.await.unwrap_or_else(|e| {
                                Err(StoreError::Other(format!("HEAD task: {e}")))
                            }),
                            Err(_) => Err(crate::outage::OutageBreaker::unavailable()),
                        }
                    }
                };
                match headed {
                    Ok(meta) => {
                        this.replace_meta(&key, Some(&meta)).await?;
                        Ok(meta)
                    }
                    Err(StoreError::NotFound) => {
                        this.replace_meta(&key, None).await?;
                        Err(StoreError::NotFound.into())
                    }
                    // S3 unreachable: what this worker last knew of the
                    // object beats no answer (stale-if-error).
                    Err(e @ (StoreError::Unavailable(_) | StoreError::Throttled(_))) => {
                        match this.known_meta(&key).await {
                            Some(meta) => {
                                tracing::debug!(uri = %key, error = %e, "S3 unavailable; answering from recorded metadata");
                                Ok(meta)
                            }
                            None => Err(e.into()),
                        }
                    }
                    Err(e) => Err(e.into()),
                }
            })
            .await
    }

    /// Records `meta` as the object's current version (`None`: it is
    /// gone) and drops the pages of the version it replaces. RocksDB runs
    /// off the async runtime.
    pub(crate) async fn replace_meta(
        self: &Arc<Self>,
        key: &str,
        meta: Option<&ObjectMeta>,
    ) -> Result<(), CacheError> {
        let (this, owned_key, new) = (self.clone(), key.to_string(), meta.cloned());
        let old = tokio::task::spawn_blocking(move || -> Result<_, CacheError> {
            let old = this.index.get_object(&owned_key)?;
            match &new {
                Some(m) => this.record_meta(&owned_key, m)?,
                None if old.is_some() => this.index.delete_object(&owned_key)?,
                None => {}
            }
            Ok(old)
        })
        .await
        .map_err(join_failed)??;
        if let Some(old) = old.filter(|o| meta.is_none_or(|m| m.etag != o.etag)) {
            self.reclaim_version(key, &old.etag, old.size);
        }
        Ok(())
    }

    /// Metadata recorded for `key`, however old.
    /// The object's recorded metadata if it was validated at or after
    /// `since` (ms) and carries its user metadata.
    async fn recorded_since(self: &Arc<Self>, key: &str, since: i64) -> Option<ObjectMeta> {
        let (this, key) = (self.clone(), key.to_string());
        let rec = tokio::task::spawn_blocking(move || this.index.get_object(&key))
            .await
            .ok()?
            .ok()??;
        let user = rec.user.filter(|_| rec.validated_ms >= since)?;
        Some(ObjectMeta {
            size: rec.size,
            etag: rec.etag,
            last_modified_ms: rec.last_modified_ms,
            user,
        })
    }

    async fn known_meta(self: &Arc<Self>, key: &str) -> Option<ObjectMeta> {
        let (this, key) = (self.clone(), key.to_string());
        let rec = tokio::task::spawn_blocking(move || this.index.get_object(&key))
            .await
            .ok()?
            .ok()??;
        Some(ObjectMeta {
            size: rec.size,
            etag: rec.etag,
            last_modified_ms: rec.last_modified_ms,
            user: rec.user.unwrap_or_default(),
        })
    }

    pub(crate) fn record_meta(&self, key: &str, meta: &ObjectMeta) -> Result<(), CacheError> {
        self.record_meta_with(key, meta, Some(meta.user.clone()))
    }

    /// Records `meta` with user metadata `user` (`None`: not known).
    fn record_meta_with(
        &self,
        key: &str,
        meta: &ObjectMeta,
        user: Option<lakecache_protocol::UserMeta>,
    ) -> Result<(), CacheError> {
        self.index.put_object(
            key,
            &ObjectRecord {
                size: meta.size,
                etag: meta.etag.clone(),
                last_modified_ms: meta.last_modified_ms,
                validated_ms: now_ms(),
                user,
            },
        )?;
        Ok(())
    }

    /// Drops every page of one object version, in the background.
    pub(crate) fn reclaim_version(self: &Arc<Self>, uri: &str, etag: &str, size: u64) {
        let this = self.clone();
        let (uri, etag) = (uri.to_string(), etag.to_string());
        let pages = size.div_ceil(self.config.page_size);
        tokio::task::spawn_blocking(move || {
            let mut keys = Vec::new();
            for idx in 0..pages {
                let key = PageKey::new(&uri, &etag, idx);
                if this.lru.remove(&key).is_some() {
                    this.pages.remove(&key);
                    keys.push(key);
                }
            }
            if let Err(e) = this.index.remove_pages(&keys) {
                tracing::warn!(%uri, error = %e, "dropping old pages from index failed");
            }
            tracing::debug!(%uri, %etag, pages = keys.len(), "reclaimed old version");
        });
    }

    /// Streams `range` of the object version `meta`. The first piece is
    /// fetched before returning, so an error there is still an error
    /// status; a later failure ends the stream with an error (the
    /// connection is cut, never short data). Also says whether the first
    /// piece was a hit.
    pub async fn read(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        range: Range<u64>,
        kind: ReadKind,
    ) -> Result<
        (
            impl Stream<Item = Result<Bytes, CacheError>> + Send + 'static,
            Served,
        ),
        CacheError,
    > {
        let dirty = crate::writeback::is_cache_version(&meta.etag);
        let seq = !dirty && self.maybe_read_ahead(uri, meta, &range);
        let mut served = Served::Hit;
        let first = if range.is_empty() {
            None
        } else {
            let (piece, waited) = WAITED
                .scope(std::cell::Cell::new(false), async {
                    let piece = self
                        .next_piece(uri, meta, range.start, range.end, seq, Some(kind))
                        .await;
                    (piece, WAITED.with(|w| w.get()))
                })
                .await;
            if waited {
                served = Served::Miss;
            }
            Some(piece?)
        };
        let state = (self.clone(), uri.clone(), meta.clone(), range, first);
        // The body is polled after the request's task-local scope ended.
        let tenant = crate::tenant::current();
        let pieces = futures::stream::unfold(state, move |(cache, uri, meta, range, first)| {
            let tenant = tenant.clone();
            async move {
                if range.is_empty() {
                    return None;
                }
                let piece = match first {
                    Some(p) => Ok(p),
                    None => {
                        // A later piece starting a page is a read of it.
                        let new_page = (range.start % cache.config.page_size == 0).then_some(kind);
                        crate::tenant::scope(
                            tenant,
                            cache.next_piece(&uri, &meta, range.start, range.end, seq, new_page),
                        )
                        .await
                    }
                };
                match piece {
                    Ok(bytes) => {
                        let next = range.start + bytes.len() as u64..range.end;
                        cache.metrics.served(bytes.len() as u64);
                        Some((Ok(bytes), (cache, uri, meta, next, None)))
                    }
                    Err(e) => {
                        tracing::warn!(%uri, error = %e, "read failed mid-stream");
                        let done = range.end..range.end;
                        Some((Err(e), (cache, uri, meta, done, None)))
                    }
                }
            }
        });
        Ok((pieces, served))
    }

    /// Bytes from `pos` towards `end`: at most [`MAX_PIECE`], never across
    /// a page boundary.
    async fn next_piece(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        pos: u64,
        end: u64,
        sequential: bool,
        new_page: Option<ReadKind>,
    ) -> Result<Bytes, CacheError> {
        if crate::writeback::is_cache_version(&meta.etag) {
            return self.dirty_piece(uri, meta, pos, end).await;
        }
        self.clean_piece_of(uri, meta, pos, end, sequential, new_page)
            .await
    }

    /// Bytes of a version S3 has (from pages or S3). `new_page`: the
    /// first piece of a read in its page, which plans count as a read of
    /// that kind.
    pub(crate) async fn clean_piece_of(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        pos: u64,
        end: u64,
        sequential: bool,
        new_page: Option<ReadKind>,
    ) -> Result<Bytes, CacheError> {
        let ps = self.config.page_size;
        let idx = pos / ps;
        let page_start = idx * ps;
        let piece_end = end
            .min(page_start + ps)
            .min((pos / MAX_PIECE + 1) * MAX_PIECE);
        let sub = pos - page_start..piece_end - page_start;
        // A request that covers this page whole (the node-local tier or
        // a prefetch fetching an object whole) fetches and keeps the
        // page as a sequential reader's does, joining the flight the
        // worker's read-ahead may have started: streams of one object
        // interleaving must not make it fetch the page again in blocks.
        let page_end = (page_start + ps).min(meta.size);
        let whole_page = pos == page_start && end >= page_end;
        // A page a plan reads in order is fetched whole on a miss (a
        // partly filled one completed). Where the plan reads a sample of
        // it, only that sample's blocks come: its other samples are read
        // at other times, often after the page would be evicted, and a
        // partly filled page counts only the bytes it holds. Fetching
        // 4 MiB pages whole for 1 MiB samples read in a shuffled order
        // fetched 2.4 GiB from S3 for 2 GiB read over two epochs (the
        // least that Belady's rule can do at page granularity), against
        // 1.5 GiB by sample.
        let planned = new_page
            .is_some_and(|kind| self.note_planned_read(uri, &meta.etag, idx, sub.clone(), kind));
        let fetch = if planned && whole_page {
            Fetch::WholePage
        } else if planned && sequential {
            Fetch::PlannedSequential
        } else if planned {
            Fetch::Blocks
        } else if sequential || whole_page {
            Fetch::Sequential
        } else {
            Fetch::Random
        };
        self.page_range(uri, meta, idx, sub, fetch).await
    }

    /// Makes page `idx` of `meta` cached in full (a preload's miss).
    pub(crate) async fn warm_page(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        idx: u64,
    ) -> Result<(), CacheError> {
        let ps = self.config.page_size;
        let len = ps.min(meta.size.saturating_sub(idx * ps));
        self.page_range(uri, meta, idx, 0..len, Fetch::Sequential)
            .await?;
        // A preload counts a page once its file is written, not when its
        // bytes are in memory.
        let key = PageKey::new(&uri.to_string(), &meta.etag, idx);
        self.writing.written(&key).await;
        Ok(())
    }

    /// Fetched pages whose files are still being written.
    pub fn page_writes_in_flight(&self) -> u64 {
        self.writing.len() as u64
    }

    /// `sub` (page-relative) of page `idx`, from disk or S3. A miss of a
    /// sequential reader fetches the whole page; a random reader's miss
    /// fetches only the blocks it touches (the page is filled partly).
    async fn page_range(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        idx: u64,
        sub: Range<u64>,
        fetch: Fetch,
    ) -> Result<Bytes, CacheError> {
        let uri_s = uri.to_string();
        let key = PageKey::new(&uri_s, &meta.etag, idx);
        let id = PageId::new(&uri_s, &meta.etag, idx, self.config.page_size, meta.size);
        let mut partly_filled = false;
        if let Some(bytes) = self
            .fresh
            .serve(&key, &sub)
            .or_else(|| self.writing.serve(&key, &sub))
        {
            self.count_traffic(uri.bucket(), bytes.len() as u64, 0);
            self.metrics.served_fresh(bytes.len() as u64);
            return Ok(bytes);
        }
        if self.lru.contains(&key) {
            match self.read_local(key, id, sub.clone()).await {
                Ok(bytes) => {
                    self.count_traffic(uri.bucket(), bytes.len() as u64, 0);
                    return Ok(bytes);
                }
                Err(PageReadError::Unfilled(_)) => {
                    partly_filled = true;
                    self.lru.set_partly_filled(&key);
                }
                Err(PageReadError::Corrupt(why)) => {
                    tracing::warn!(uri = %uri_s, page = idx, %why, "page file rejected; dropping and refetching");
                    self.metrics.corrupt_page();
                    self.drop_page(&key).await;
                }
                Err(PageReadError::Missing) => self.drop_page(&key).await,
                Err(PageReadError::Io(e)) => {
                    tracing::warn!(uri = %uri_s, page = idx, error = %e, "page read failed; refetching");
                    self.drop_page(&key).await;
                }
            }
        }
        let skip_cache = self
            .config
            .policies
            .for_uri(&uri_s)
            .is_some_and(|p| p.skip_cache);
        mark_waited();
        let fetched = if skip_cache {
            // Pass-through: exactly the bytes asked for, stored nowhere.
            let range = id.offset + sub.start..id.offset + sub.end;
            self.get_exact(uri, meta, range).await.map(|(data, _)| data)
        } else if fetch == Fetch::WholePage
            || (matches!(fetch, Fetch::Sequential | Fetch::PlannedSequential) && !partly_filled)
        {
            self.fetch_page(uri, meta, idx, key, id, true)
                .await
                .map(|page| {
                    self.fresh
                        .serve(&key, &sub)
                        .unwrap_or_else(|| slice_within(&page, &sub))
                })
        } else if fetch == Fetch::PlannedSequential {
            let rest = sub.start..id.len;
            self.fetch_blocks(uri, meta, key, id, &rest)
                .await
                .map(|bytes| slice_within(&bytes, &(0..sub.end - sub.start)))
        } else if fetch == Fetch::Random
            && !self.random_admission.admit(key, &sub, CHECK_BLOCK, id.len)
        {
            // A random read of part of a block: fetched exactly, kept
            // nowhere (see crate::admission).
            let range = id.offset + sub.start..id.offset + sub.end;
            self.get_exact(uri, meta, range).await.map(|(data, _)| data)
        } else {
            self.fetch_blocks(uri, meta, key, id, &sub).await
        };
        let bytes = match fetched {
            Ok(bytes) => bytes,
            Err(e) => {
                if matches!(e, CacheError::Store(StoreError::PreconditionFailed)) {
                    // The object changed under us: forget its metadata so
                    // the next open revalidates instead of failing again.
                    let this = self.clone();
                    let forget = uri_s.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        if let Err(e) = this.index.delete_object(&forget) {
                            tracing::warn!(uri = %forget, error = %e, "forgetting stale metadata failed");
                        }
                    })
                    .await;
                }
                return Err(e);
            }
        };
        self.count_traffic(uri.bucket(), 0, bytes.len() as u64);
        Ok(bytes)
    }

    /// Where bytes `pos..end` of version `meta` lie in a page file, for
    /// a reader on this host (`http::local`): up to the end of the page
    /// holding `pos`. `Ok(None)`: not served this way (a page not cached
    /// or still in memory, a pending write, a skip-cache prefix, a partly
    /// filled or unreadable page); the bytes are sent from memory instead.
    pub(crate) async fn local_page(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        pos: u64,
        end: u64,
        kind: ReadKind,
    ) -> Result<Option<CheckedFile>, CacheError> {
        let uri_s = uri.to_string();
        if crate::writeback::is_cache_version(&meta.etag)
            || pos >= end
            || end > meta.size
            || self
                .config
                .policies
                .for_uri(&uri_s)
                .is_some_and(|p| p.skip_cache)
        {
            return Ok(None);
        }
        let ps = self.config.page_size;
        let idx = pos / ps;
        let sub = pos - idx * ps..end.min((idx + 1) * ps) - idx * ps;
        let key = PageKey::new(&uri_s, &meta.etag, idx);
        let id = PageId::new(&uri_s, &meta.etag, idx, ps, meta.size);
        // A page not on disk yet, or just fetched and still in memory, is
        // sent from memory (inline on the socket, or over HTTP): reading
        // it back from the file costs the reader a disk read per page,
        // which made a single cold stream 18% slower on this project's
        // test VM (cpu-split-local.md).
        if !self.lru.contains(&key) || self.fresh.covers(&key, &sub) {
            return Ok(None);
        }
        {
            let (this, range) = (self.clone(), sub.clone());
            let opened = tokio::task::spawn_blocking(move || {
                let opened = this.pages.open_checked(&key, &id, range)?;
                if let Some(seq) = this.lru.touch(&key) {
                    if let Err(e) = this.index.touch(&key, seq) {
                        tracing::debug!(error = %e, "recording page access failed");
                    }
                }
                Ok::<_, PageReadError>(opened)
            })
            .await
            .map_err(join_failed)?;
            match opened {
                Ok(file) => {
                    self.note_planned_read(uri, &meta.etag, idx, sub.clone(), kind);
                    // Recorded once granted, and as far as the grant goes:
                    // a refused page is read by `Self::read` instead,
                    // which records the same read itself.
                    let granted_end = idx * ps + sub.end;
                    self.maybe_read_ahead(uri, meta, &(pos..granted_end));
                    let len = sub.end - sub.start;
                    self.count_traffic(uri.bucket(), len, 0);
                    self.metrics.served_local(len);
                    return Ok(Some(file));
                }
                Err(PageReadError::Unfilled(_)) => return Ok(None),
                Err(e) => {
                    if matches!(e, PageReadError::Corrupt(_)) {
                        self.metrics.corrupt_page();
                    }
                    // Over HTTP, which fetches the page again.
                    tracing::warn!(uri = %uri_s, page = idx, error = %e, "page file rejected for a local reader; dropping it");
                    self.drop_page(&key).await;
                }
            }
        }
        Ok(None)
    }

    /// Whether every byte of `range` of version `meta` is held now (in
    /// memory, in page files, or in a page being written), so that a read
    /// of it waits on no fetch. Nothing is read or recorded.
    pub(crate) fn holds_now(&self, uri: &ObjectUri, meta: &ObjectMeta, range: Range<u64>) -> bool {
        let ps = self.config.page_size;
        let end = range.end.min(meta.size);
        if range.start >= end {
            return false;
        }
        let uri_s = uri.to_string();
        let mut pos = range.start;
        while pos < end {
            let idx = pos / ps;
            let page_end = ((idx + 1) * ps).min(end);
            let sub = pos - idx * ps..page_end - idx * ps;
            let key = PageKey::new(&uri_s, &meta.etag, idx);
            let held = self.fresh.covers(&key, &sub)
                || self.writing.holds(&key)
                || self.lru.holds_blocks(&key, crate::pages::blocks_of(&sub));
            if !held {
                return false;
            }
            pos = page_end;
        }
        true
    }

    /// Reads from a page file and records the access, off the runtime.
    pub(crate) async fn read_local(
        self: &Arc<Self>,
        key: PageKey,
        id: PageId,
        sub: Range<u64>,
    ) -> Result<Bytes, PageReadError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let bytes = this.pages.read(&key, &id, sub)?;
            if let Some(seq) = this.lru.touch(&key) {
                if let Err(e) = this.index.touch(&key, seq) {
                    tracing::debug!(error = %e, "recording page access failed");
                }
            }
            Ok(bytes)
        })
        .await
        .map_err(|e| PageReadError::Io(std::io::Error::other(e)))?
    }

    pub(crate) async fn drop_page(self: &Arc<Self>, key: &PageKey) {
        self.fresh.forget(key);
        let (this, key) = (self.clone(), *key);
        let _ = tokio::task::spawn_blocking(move || {
            this.lru.remove(&key);
            this.pages.remove(&key);
            if let Err(e) = this.index.remove_pages(&[key]) {
                tracing::warn!(error = %e, "removing page from index failed");
            }
        })
        .await;
    }

    /// The whole page from S3, once for all concurrent callers, then kept
    /// (in memory too while its reader is near: `keep_fresh`).
    async fn fetch_page(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        idx: u64,
        key: PageKey,
        id: PageId,
        keep_fresh: bool,
    ) -> Result<Bytes, CacheError> {
        let this = self.clone();
        self.page_flights
            .run(key, || async move {
                let range = id.offset..id.offset + id.len;
                let (data, held) = this.get_exact(uri, meta, range).await?;
                if keep_fresh {
                    this.fresh.keep(key, data.clone(), &this.memory);
                }
                // Readers get the page now; its file is written behind
                // them (an O_DIRECT write of a page took about a quarter
                // of a cold page's latency). Until indexed, the page is
                // served from memory and read-ahead counts it as held.
                // The fetch permit and the bytes' budget stay held until
                // written, so a slow disk holds S3 fetches back.
                this.writing.insert(key, data.clone());
                let (writer, uri_s, etag, kept) = (
                    this.clone(),
                    uri.to_string(),
                    meta.etag.clone(),
                    data.clone(),
                );
                let tenant = crate::tenant::current();
                tokio::spawn(crate::tenant::scope(tenant, async move {
                    let _held = held;
                    // Unmarked however the write ends (a panic or an
                    // aborted task too): a preload waits on the mark.
                    let _unmark = writer.writing.unmark_on_drop(key);
                    writer.keep_page(uri_s, etag, idx, key, id, kept).await;
                }));
                Ok(data)
            })
            .await
    }

    /// `range` of the object from S3, whole or an error, under a fetch
    /// permit and the bytes' share of the memory budget; both are handed
    /// back, so a caller that stores the bytes holds them until it is done.
    async fn get_exact(
        &self,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        range: Range<u64>,
    ) -> Result<(Bytes, FetchHeld), CacheError> {
        let permit = self
            .fetch_permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| CacheError::Local(e.to_string()))?;
        let want = range.end - range.start;
        let memory = self.memory.reserve(want).await;
        let data = self.store.get_range(uri, range, &meta.etag).await?;
        if data.len() as u64 != want {
            return Err(short_body(want, data.len()));
        }
        Ok((data, (permit, memory)))
    }

    /// The blocks of page `id` that `sub` touches, from S3, written into
    /// the page file (which may stay partly filled).
    async fn fetch_blocks(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        key: PageKey,
        id: PageId,
        sub: &Range<u64>,
    ) -> Result<Bytes, CacheError> {
        let blocks = crate::pages::blocks_of(sub);
        let (first, last) = (blocks.start as u64, blocks.end as u64);
        let this = self.clone();
        let blocks = self
            .block_flights
            .run((key, first, last), || async move {
                let start = first * CHECK_BLOCK;
                let end = (last * CHECK_BLOCK).min(id.len);
                let range = id.offset + start..id.offset + end;
                let (data, _held) = this.get_exact(uri, meta, range).await?;
                let (keeper, kept, entry) = (
                    this.clone(),
                    data.clone(),
                    PageEntry {
                        uri: uri.to_string(),
                        etag: meta.etag.clone(),
                        index: id.index,
                        len: id.len,
                        fetched_ms: 0,
                        tenant: crate::tenant::current().map(|t| t.to_string()),
                    },
                );
                let filled = tokio::task::spawn_blocking(move || {
                    // Recorded under the page's fill lock: two fills of a
                    // page recording out of order left the cache counting
                    // fewer blocks (and bytes) than the file held, about
                    // once a run in plan-epochs at 2 ranks.
                    keeper
                        .pages
                        .fill_then(&key, &id, first as usize, &kept, |filled| {
                            let (whole, bytes) = (filled.whole(&id), filled.bytes(&id));
                            if !keeper.lru.contains(&key) {
                                keeper.index_page_counted(key, entry, bytes);
                            }
                            keeper.lru.set_filled(&key, filled, whole, bytes);
                        })
                })
                .await;
                if let Ok(Err(e)) | Err(e) = filled.map_err(std::io::Error::other) {
                    tracing::warn!(%uri, page = id.index, error = %e, "filling page blocks failed");
                }
                Ok(data)
            })
            .await?;
        let base = first * CHECK_BLOCK;
        Ok(slice_within(&blocks, &(sub.start - base..sub.end - base)))
    }

    /// Writes a fetched page to disk and indexes it; failures only cost a
    /// future miss, so they are logged, not returned.
    pub(crate) async fn keep_page(
        self: &Arc<Self>,
        uri: String,
        etag: String,
        idx: u64,
        key: PageKey,
        id: PageId,
        data: Bytes,
    ) {
        let this = self.clone();
        let entry = PageEntry {
            uri: uri.clone(),
            etag,
            index: idx,
            len: id.len,
            fetched_ms: 0,
            tenant: crate::tenant::current().map(|t| t.to_string()),
        };
        let written = tokio::task::spawn_blocking(move || {
            this.pages.write(&key, &id, &data)?;
            this.index_page(key, entry);
            Ok::<_, std::io::Error>(())
        })
        .await;
        if let Ok(Err(e)) | Err(e) = written.map_err(std::io::Error::other) {
            tracing::warn!(%uri, page = idx, error = %e, "writing page to cache failed");
        }
    }

    pub(crate) fn index_page(&self, key: PageKey, entry: PageEntry) {
        let len = entry.len;
        self.index_page_counted(key, entry, len);
    }

    /// [`Self::index_page`] of a page whose file holds `counted` bytes so
    /// far (a partly filled one). The index keeps the page's whole length:
    /// after a restart, which blocks are filled is not known until read.
    pub(crate) fn index_page_counted(&self, key: PageKey, mut entry: PageEntry, counted: u64) {
        let policy = self.config.policies.for_uri(&entry.uri);
        if policy.is_some_and(|p| p.skip_cache) {
            // A written object under a skip-cache prefix: nothing stays.
            self.pages.remove(&key);
            return;
        }
        entry.fetched_ms = now_ms();
        let kept = retention(&self.config.policies, &entry.uri, entry.fetched_ms);
        let tenant = entry.tenant.as_deref().map(Arc::<str>::from);
        let seq = self.lru.insert_kept(key, counted, kept, tenant.clone());
        if let Err(e) = self.index.put_page(&key, &entry, seq) {
            tracing::warn!(uri = %entry.uri, error = %e, "indexing page failed");
            self.lru.remove(&key);
            self.pages.remove(&key);
            return;
        }
        if let Some(tenant) = tenant {
            self.enforce_quota(&tenant);
        }
        if self.lru.over_high_watermark() {
            self.evict.notify_one();
        }
    }

    /// A tenant over its quota (pages plus its pending write-back data,
    /// which is never evicted) loses its own least-recently-used pages,
    /// so one team's scan cannot flush another team's dataset.
    fn enforce_quota(&self, tenant: &str) {
        let Some(&quota) = self.config.tenant_quotas.get(tenant) else {
            return;
        };
        let pending = self
            .writeback
            .as_ref()
            .map_or(0, |wb| wb.pending_bytes_of_tenant(tenant));
        if self.lru.tenant_used(tenant) + pending <= quota {
            return;
        }
        let victims = self
            .lru
            .take_tenant_victims(tenant, quota.saturating_sub(pending));
        let bytes: u64 = victims.iter().map(|(_, len)| len).sum();
        let keys: Vec<PageKey> = victims.iter().map(|(k, _)| *k).collect();
        if let Err(e) = self.index.remove_pages(&keys) {
            tracing::warn!(tenant, error = %e, "evicting pages from index failed");
        }
        for key in &keys {
            self.pages.remove(key);
        }
        self.metrics.evicted(keys.len() as u64, bytes);
        self.metrics.quota_evicted(tenant, bytes);
    }

    /// Each tenant's cached bytes, quota and pending write-back bytes.
    pub fn tenant_usage(
        &self,
    ) -> std::collections::BTreeMap<String, lakecache_protocol::TenantUsage> {
        let mut out: std::collections::BTreeMap<String, lakecache_protocol::TenantUsage> =
            Default::default();
        for (tenant, bytes) in self.lru.tenant_usage() {
            out.entry(tenant).or_default().cache_bytes = bytes;
        }
        for (tenant, quota) in &self.config.tenant_quotas {
            out.entry(tenant.clone()).or_default().quota_bytes = Some(*quota);
        }
        if let Some(wb) = &self.writeback {
            for (tenant, bytes) in wb.pending_bytes_by_tenant() {
                out.entry(tenant).or_default().pending_bytes = bytes;
            }
        }
        out
    }

    /// Records where this read ends and says whether it continues the
    /// last one (or starts the object); sequential readers get the next
    /// pages fetched in the background, never past the end of the ring
    /// segment this read is in (the pages beyond belong to other workers).
    fn maybe_read_ahead(
        self: &Arc<Self>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        range: &Range<u64>,
    ) -> bool {
        if range.is_empty() {
            return false;
        }
        let key = uri.to_string();
        let sequential = {
            let mut last = self.last_read_end.lock().unwrap_or_else(|p| p.into_inner());
            if last.len() >= MAX_TRACKED_STREAMS {
                last.clear();
            }
            let prev = last.insert(key.clone(), range.end);
            range.start == 0 || prev == Some(range.start)
        };
        let mut window = u64::from(self.config.readahead_pages);
        if self
            .config
            .policies
            .for_uri(&key)
            .is_some_and(|p| p.skip_cache)
        {
            window = 0; // nothing fetched ahead would be kept
        }
        let ps = self.config.page_size;
        // A planned read (a random sample at an object's start, often)
        // gets its next pages from the plan's prefetch, not by guess.
        // (No hashing on the sequential path while no plan is installed.)
        if sequential
            && self.lru.has_plans()
            && self
                .lru
                .is_planned(&PageKey::new(&key, &meta.etag, range.start / ps))
        {
            window = 0;
        }
        if !sequential || window == 0 {
            return sequential;
        }
        let last_page = (range.end - 1) / ps;
        let mut limit = meta.size;
        if let Some(seg) = self.config.segment_size.filter(|s| *s > 0) {
            limit = limit.min(((range.end - 1) / seg + 1) * seg);
        }
        let end_page = limit.div_ceil(ps);
        for idx in last_page + 1..(last_page + 1 + window).min(end_page) {
            let page_key = PageKey::new(&key, &meta.etag, idx);
            if self.page_flights.in_flight(&page_key)
                || self.writing.holds(&page_key)
                || self.lru.contains(&page_key)
            {
                continue;
            }
            let Ok(permit) = self.readahead_permits.clone().try_acquire_owned() else {
                break;
            };
            let id = PageId::new(&key, &meta.etag, idx, ps, meta.size);
            let (this, uri, meta) = (self.clone(), uri.clone(), meta.clone());
            // Read-ahead pages belong to the reader's tenant too.
            let tenant = crate::tenant::current();
            tokio::spawn(crate::tenant::scope(tenant, async move {
                let _permit = permit;
                if let Err(e) = this.fetch_page(&uri, &meta, idx, page_key, id, true).await {
                    tracing::debug!(%uri, page = idx, error = %e, "read-ahead failed");
                }
            }));
        }
        sequential
    }

    /// LIST, straight from the store. Workers keep no listing cache: S3
    /// listings are strongly consistent, and a cache here would be
    /// invalidated only on the worker that saw a write, so another worker
    /// could serve a listing without it. Mounts cache listings themselves
    /// and drop their cache on their own writes. The objects' metadata is
    /// recorded, as a HEAD would, so that reading the files just listed
    /// costs no HEAD each.
    pub async fn list(
        self: &Arc<Self>,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: u32,
    ) -> Result<ListResponse, CacheError> {
        // Our tokens carry the last key of the page they follow, so pending
        // writes land in exactly one page (store tokens are opaque).
        let (after, token) = crate::writeback::split_list_token(token);
        match self.s3_down.check() {
            Ok(()) => {}
            Err(blocked) => {
                if blocked == crate::outage::Blocked::Probe {
                    let this = self.clone();
                    let (bucket, prefix) = (bucket.to_string(), prefix.to_string());
                    tokio::spawn(async move {
                        let r = this.store.list(&bucket, &prefix, None, None, 1).await;
                        let _ = this.s3_down.observe(r);
                    });
                }
                return Err(crate::outage::OutageBreaker::unavailable().into());
            }
        }
        // Pending writes as of before S3 lists: one whose upload finishes
        // while S3 is listing is in neither the listing nor the pending set
        // afterwards, and would vanish from this listing.
        let pending_before = self.pending_under(bucket, prefix);
        let listed = self
            .store
            .list(bucket, prefix, delimiter, token, max_keys)
            .await;
        let mut listing = self.s3_down.observe(listed)?;
        self.merge_pending(
            bucket,
            prefix,
            delimiter,
            after.as_deref(),
            pending_before,
            &mut listing,
        );
        let listed: Vec<(String, ObjectMeta)> = listing
            .objects
            .iter()
            // Stores that list without ETags leave it to the HEAD.
            .filter(|e| !e.etag.is_empty())
            .filter_map(|e| {
                let uri = ObjectUri::new(bucket, &e.key).ok()?;
                let meta = ObjectMeta {
                    size: e.size,
                    etag: e.etag.clone(),
                    last_modified_ms: e.last_modified_ms,
                    user: Default::default(),
                };
                Some((uri.to_string(), meta))
            })
            .collect();
        if !listed.is_empty() {
            let this = self.clone();
            let replaced = tokio::task::spawn_blocking(move || {
                let mut replaced = Vec::new();
                for (key, meta) in listed {
                    let old = this.index.get_object(&key).ok().flatten();
                    // A listing has no user metadata: what was known for
                    // this same version is kept.
                    let user = old
                        .as_ref()
                        .filter(|o| o.etag == meta.etag)
                        .and_then(|o| o.user.clone());
                    if let Err(e) = this.record_meta_with(&key, &meta, user) {
                        tracing::debug!(%key, error = %e, "recording listed metadata failed");
                        continue;
                    }
                    if let Some(old) = old.filter(|o| o.etag != meta.etag) {
                        replaced.push((key, old.etag, old.size));
                    }
                }
                replaced
            })
            .await
            .map_err(join_failed)?;
            for (key, etag, size) in replaced {
                self.reclaim_version(&key, &etag, size);
            }
        }
        Ok(listing)
    }

    /// Gives each listed object its user metadata: recorded here for the
    /// same version, or HEADed (in parallel; one flight per object).
    /// Objects whose metadata cannot be had are left without.
    pub async fn add_user_meta(self: &Arc<Self>, bucket: &str, listing: &mut ListResponse) {
        use futures::StreamExt as _;
        let wanted: Vec<(usize, ObjectUri, String)> = listing
            .objects
            .iter()
            .enumerate()
            // Without an ETag the metadata could belong to another
            // version than the rest of the entry: the client asks itself.
            .filter(|(_, e)| e.meta.is_none() && !e.etag.is_empty())
            .filter_map(|(i, e)| Some((i, ObjectUri::new(bucket, &e.key).ok()?, e.etag.clone())))
            .collect();
        let found: Vec<(usize, Option<lakecache_protocol::UserMeta>)> =
            futures::stream::iter(wanted)
                .map(|(i, uri, etag)| {
                    let this = self.clone();
                    async move {
                        let meta = match this.stat(&uri).await {
                            Ok(m) if etag.is_empty() || m.etag == etag => Some(m.user),
                            _ => None,
                        };
                        (i, meta)
                    }
                })
                .buffer_unordered(LISTING_HEADS_IN_FLIGHT)
                .collect()
                .await;
        for (i, meta) in found {
            if let Some(entry) = listing.objects.get_mut(i) {
                entry.meta = meta;
            }
        }
    }

    pub async fn delete(self: &Arc<Self>, uri: &ObjectUri) -> Result<(), CacheError> {
        if self.delete_in_order(uri).await? {
            return Ok(());
        }
        self.store.delete(uri).await?;
        self.replace_meta(&uri.to_string(), None).await
    }

    pub fn used_bytes(&self) -> u64 {
        self.lru.used()
    }

    /// Bytes of uploads in progress staged on disk.
    pub fn staged_bytes(&self) -> u64 {
        self.lru.staged()
    }

    /// Uploads in progress abort (their multipart uploads too) and no new
    /// one starts.
    pub fn begin_shutdown(&self) {
        self.closing.send_replace(true);
    }

    /// Evicts every page of the objects under `s3://bucket/prefix`,
    /// pinned ones included (an operator asked); pending write-back data
    /// is kept. Returns the pages and bytes freed.
    pub async fn free(
        self: &Arc<Self>,
        bucket: &str,
        prefix: &str,
    ) -> Result<(u64, u64), CacheError> {
        let this = self.clone();
        let target = format!("s3://{bucket}/{prefix}");
        tokio::task::spawn_blocking(move || {
            let keys = this.index.pages_under(&target)?;
            let mut bytes = 0;
            let mut freed = Vec::with_capacity(keys.len());
            for key in keys {
                if let Some(len) = this.lru.remove(&key) {
                    bytes += len;
                    freed.push(key);
                }
                this.pages.remove(&key);
            }
            this.index.remove_pages(&freed)?;
            this.metrics.evicted(freed.len() as u64, bytes);
            tracing::info!(prefix = %target, pages = freed.len(), bytes, "freed on request");
            Ok((freed.len() as u64, bytes))
        })
        .await
        .map_err(join_failed)?
    }

    /// Bytes of pages under a pin policy.
    pub fn pinned_bytes(&self) -> u64 {
        self.lru.pinned_bytes()
    }

    fn count_traffic(&self, bucket: &str, hit: u64, miss: u64) {
        self.metrics.traffic(bucket, hit, miss);
        if let Ok(mut t) = self.traffic.lock() {
            if let Some(b) = t.get_mut(bucket) {
                b.hit_bytes += hit;
                b.miss_bytes += miss;
            } else {
                t.insert(
                    bucket.to_string(),
                    BucketTraffic {
                        hit_bytes: hit,
                        miss_bytes: miss,
                    },
                );
            }
        }
    }

    /// Bytes served from local pages and bytes that needed S3 since
    /// start, by bucket.
    pub fn traffic(&self) -> std::collections::BTreeMap<String, BucketTraffic> {
        self.traffic.lock().map(|t| t.clone()).unwrap_or_default()
    }
}

/// How a page of `uri` stored at `fetched_ms` is kept.
fn retention(policies: &crate::policy::Policies, uri: &str, fetched_ms: i64) -> Retention {
    match policies.for_uri(uri) {
        Some(p) if p.pin => Retention::Pinned,
        Some(p) => match p.ttl {
            Some(ttl) => Retention::ExpiresAtMs(fetched_ms.saturating_add(ttl.as_millis() as i64)),
            None => Retention::Lru,
        },
        None => Retention::Lru,
    }
}

/// Evicts least-recently-used pages whenever usage passes the high
/// watermark, and pages whose TTL ran out (checked every second); exits
/// when the cache is dropped.
async fn evictor(cache: Weak<Cache>, wake: Arc<Notify>) {
    loop {
        let notified = wake.notified();
        let Some(this) = cache.upgrade() else { return };
        let expired = this.lru.expire_plans(std::time::Instant::now());
        if expired > 0 {
            tracing::info!(
                plans = expired,
                "plans not renewed expired; their pages fall back to recency"
            );
        }
        let mut victims = this.lru.take_expired(now_ms());
        victims.extend(this.lru.take_victims());
        if !victims.is_empty() {
            let bytes: u64 = victims.iter().map(|(_, len)| len).sum();
            let count = victims.len() as u64;
            let worker = this.clone();
            let done = tokio::task::spawn_blocking(move || {
                let keys: Vec<PageKey> = victims.iter().map(|(k, _)| *k).collect();
                if let Err(e) = worker.index.remove_pages(&keys) {
                    tracing::warn!(error = %e, "evicting pages from index failed");
                }
                for key in &keys {
                    worker.pages.remove(key);
                }
            })
            .await;
            if done.is_ok() {
                this.metrics.evicted(count, bytes);
                tracing::debug!(pages = count, bytes, "evicted");
            }
        }
        drop(this);
        tokio::select! {
            () = notified => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// `range` of `bytes`, clamped to what is there.
fn slice_within(bytes: &Bytes, range: &Range<u64>) -> Bytes {
    let end = (range.end as usize).min(bytes.len());
    let start = (range.start as usize).min(end);
    bytes.slice(start..end)
}

pub(crate) fn join_failed(e: tokio::task::JoinError) -> CacheError {
    CacheError::Local(format!("blocking task failed: {e}"))
}

fn short_body(expected: u64, got: usize) -> CacheError {
    StoreError::InvalidResponse(format!(
        "expected {expected} bytes from the store, got {got}"
    ))
    .into()
}
