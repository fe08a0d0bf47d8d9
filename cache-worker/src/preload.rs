//! Preload jobs: fetch every page this worker owns under a prefix.
//!
//! The client starts the same job (same id) on every worker; each lists
//! the prefix itself and fetches only the segments the ring gives it, so
//! the work spreads with the ring instead of funnelling through the
//! client. Fetches share one small per-worker budget
//! ([`LOAD_PAGES_IN_FLIGHT`]) apart from the read path's, so a large load
//! leaves room for the reads of running jobs. Pages already cached under
//! the object's current ETag are skipped, which makes a re-run resume.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt as _;
use lakecache_protocol::{
    ListEntry, LoadFailure, LoadProgress, LoadSpec, LoadState, ObjectUri, MAX_LOAD_FAILURES_KEPT,
};
use tokio::sync::{Notify, Semaphore};

use crate::cache::{Cache, CacheError};
use crate::pages::PageKey;
use crate::store::{ObjectMeta, StoreError};

/// Pages fetched for preloads at once on one worker, all jobs together.
pub const LOAD_PAGES_IN_FLIGHT: usize = 8;
/// Jobs a worker keeps (finished ones are forgotten oldest first).
const MAX_JOBS: usize = 64;
/// Objects listed per page of the job's listing.
const LIST_PAGE: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum PreloadError {
    #[error("a load job {0:?} with another prefix exists")]
    Conflict(String),
    #[error("{MAX_JOBS} load jobs are running; wait for one to finish or cancel one")]
    TooMany,
    #[error("include pattern {pattern:?}: {reason}")]
    BadPattern { pattern: String, reason: String },
}

pub struct Preloads {
    jobs: Mutex<Vec<Arc<LoadJob>>>,
    slots: Arc<Semaphore>,
}

impl Default for Preloads {
    fn default() -> Self {
        Self {
            jobs: Mutex::default(),
            slots: Arc::new(Semaphore::new(LOAD_PAGES_IN_FLIGHT)),
        }
    }
}

pub struct LoadJob {
    id: String,
    spec: LoadSpec,
    /// The tenant that started it; only it may see or cancel it.
    pub tenant: Option<String>,
    started: Instant,
    cancelled: AtomicBool,
    cancel: Notify,
    finished: Mutex<Option<(LoadState, Option<String>)>>,
    listing_done: AtomicBool,
    objects_listed: AtomicU64,
    bytes_owned: AtomicU64,
    bytes_fetched: AtomicU64,
    bytes_cached: AtomicU64,
    bytes_failed: AtomicU64,
    objects_failed: AtomicU64,
    failures: Mutex<Vec<LoadFailure>>,
}

impl Preloads {
    /// Starts job `id`, or returns it when it already runs with the same
    /// spec (a client retrying its start).
    pub fn start(
        &self,
        cache: &Arc<Cache>,
        id: &str,
        spec: LoadSpec,
        tenant: Option<String>,
    ) -> Result<Arc<LoadJob>, PreloadError> {
        let include = match &spec.include {
            Some(p) => Some(glob::Pattern::new(p).map_err(|e| PreloadError::BadPattern {
                pattern: p.clone(),
                reason: e.to_string(),
            })?),
            None => None,
        };
        let mut jobs = lock(&self.jobs);
        if let Some(job) = jobs.iter().find(|j| j.id == id) {
            if job.spec == spec && job.tenant == tenant {
                return Ok(job.clone());
            }
            return Err(PreloadError::Conflict(id.to_string()));
        }
        if jobs.len() >= MAX_JOBS {
            match jobs.iter().position(|j| j.state().is_finished()) {
                Some(i) => {
                    jobs.remove(i);
                }
                None => return Err(PreloadError::TooMany),
            }
        }
        let job = Arc::new(LoadJob::new(id, spec, tenant));
        jobs.push(job.clone());
        drop(jobs);
        let (run, cache, slots) = (job.clone(), cache.clone(), self.slots.clone());
        // A job's pages and S3 requests count for the tenant that started it.
        let tenant = job.tenant.as_deref().map(Arc::<str>::from);
        tokio::spawn(crate::tenant::scope(tenant, async move {
            let outcome = tokio::select! {
                r = run.run(&cache, &slots, include.as_ref()) => r,
                _ = run.cancel.notified() => Ok(()),
            };
            let state = match outcome {
                Err(e) => (LoadState::Failed, Some(e)),
                Ok(()) if run.cancelled.load(Ordering::Relaxed) => (LoadState::Cancelled, None),
                Ok(()) => (LoadState::Done, None),
            };
            tracing::info!(job = %run.id, state = ?state.0, fetched = run.bytes_fetched.load(Ordering::Relaxed), "load job ended");
            *lock(&run.finished) = Some(state);
        }));
        Ok(job)
    }

    pub fn get(&self, id: &str) -> Option<Arc<LoadJob>> {
        lock(&self.jobs).iter().find(|j| j.id == id).cloned()
    }

    pub fn all(&self) -> Vec<Arc<LoadJob>> {
        lock(&self.jobs).clone()
    }
}

impl LoadJob {
    fn new(id: &str, spec: LoadSpec, tenant: Option<String>) -> Self {
        Self {
            id: id.to_string(),
            spec,
            tenant,
            started: Instant::now(),
            cancelled: AtomicBool::new(false),
            cancel: Notify::new(),
            finished: Mutex::new(None),
            listing_done: AtomicBool::new(false),
            objects_listed: AtomicU64::new(0),
            bytes_owned: AtomicU64::new(0),
            bytes_fetched: AtomicU64::new(0),
            bytes_cached: AtomicU64::new(0),
            bytes_failed: AtomicU64::new(0),
            objects_failed: AtomicU64::new(0),
            failures: Mutex::default(),
        }
    }

    pub fn state(&self) -> LoadState {
        lock(&self.finished)
            .as_ref()
            .map_or(LoadState::Running, |(s, _)| *s)
    }

    /// Stops the job; what it fetched stays cached.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.cancel.notify_one();
    }

    pub fn progress(&self) -> LoadProgress {
        let finished = lock(&self.finished).clone();
        let (state, error) = finished.unwrap_or((LoadState::Running, None));
        LoadProgress {
            id: self.id.clone(),
            spec: Some(self.spec.clone()),
            state,
            listing_done: self.listing_done.load(Ordering::Relaxed),
            objects_listed: self.objects_listed.load(Ordering::Relaxed),
            bytes_owned: self.bytes_owned.load(Ordering::Relaxed),
            bytes_fetched: self.bytes_fetched.load(Ordering::Relaxed),
            bytes_cached: self.bytes_cached.load(Ordering::Relaxed),
            bytes_failed: self.bytes_failed.load(Ordering::Relaxed),
            objects_failed: self.objects_failed.load(Ordering::Relaxed),
            failures: lock(&self.failures).clone(),
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            error,
        }
    }

    /// Lists the prefix page by page and loads each page's objects.
    async fn run(
        &self,
        cache: &Arc<Cache>,
        slots: &Arc<Semaphore>,
        include: Option<&glob::Pattern>,
    ) -> Result<(), String> {
        let mut token: Option<String> = None;
        loop {
            let page = cache
                .list(
                    &self.spec.bucket,
                    &self.spec.prefix,
                    None,
                    token.as_deref(),
                    LIST_PAGE,
                )
                .await
                .map_err(|e| {
                    format!(
                        "listing s3://{}/{}: {e}",
                        self.spec.bucket, self.spec.prefix
                    )
                })?;
            let wanted: Vec<ListEntry> = page
                .objects
                .into_iter()
                .filter(|e| {
                    let rel = e.key.strip_prefix(&self.spec.prefix).unwrap_or(&e.key);
                    include.is_none_or(|p| p.matches(rel))
                })
                .collect();
            self.objects_listed
                .fetch_add(wanted.len() as u64, Ordering::Relaxed);
            // The page's share is known before it is fetched, so progress
            // has its total (and an ETA) once the listing ends.
            let copies = self.copies();
            let listed: u64 = wanted
                .iter()
                .filter(|e| !crate::writeback::is_cache_version(&e.etag))
                .filter_map(|e| {
                    let uri = ObjectUri::new(&self.spec.bucket, &e.key).ok()?;
                    Some(owned_bytes(cache, &uri, e.size, copies))
                })
                .sum();
            self.bytes_owned.fetch_add(listed, Ordering::Relaxed);
            token = page.next_token;
            if token.is_none() {
                self.listing_done.store(true, Ordering::Relaxed);
            }
            futures::stream::iter(wanted)
                .for_each_concurrent(LOAD_PAGES_IN_FLIGHT, |entry| async move {
                    self.load_object(cache, slots, entry).await;
                })
                .await;
            if token.is_none() {
                return Ok(());
            }
        }
    }

    /// Loads the pages of `entry` this worker owns; an object that changed
    /// since the listing is loaded in its new version.
    async fn load_object(&self, cache: &Arc<Cache>, slots: &Arc<Semaphore>, entry: ListEntry) {
        let Ok(uri) = ObjectUri::new(&self.spec.bucket, &entry.key) else {
            return self.failed(&entry.key, 0, "not a valid object key".into());
        };
        // Pending write-back versions are already here, as dirty pages.
        if crate::writeback::is_cache_version(&entry.etag) || entry.size == 0 {
            return;
        }
        let mut meta = ObjectMeta {
            size: entry.size,
            etag: entry.etag.clone(),
            last_modified_ms: entry.last_modified_ms,
            user: Default::default(),
        };
        // Listings without ETags (some S3-compatible stores): ask.
        if meta.etag.is_empty() {
            match cache.revalidate(&uri).await {
                Ok(m) => meta = m,
                Err(e) => return self.failed(&entry.key, 0, e.to_string()),
            }
        }
        let pages = owned_pages(cache, &uri, &meta, self.copies());
        let owned: u64 = pages.iter().map(|&(_, len)| len).sum();
        // Counted from the listed size; a HEAD may have found another.
        let listed = owned_bytes(cache, &uri, entry.size, self.copies());
        if owned >= listed {
            self.bytes_owned
                .fetch_add(owned - listed, Ordering::Relaxed);
        } else {
            self.bytes_owned
                .fetch_sub(listed - owned, Ordering::Relaxed);
        }
        let left = |i: usize| pages[i..].iter().map(|&(_, l)| l).sum::<u64>();
        let mut retried = false;
        let mut i = 0;
        while i < pages.len() {
            // An object's pages load side by side (the shared slots bound
            // them per worker): one large object is fetched at the rate
            // of many requests in flight, not one round trip per page.
            let failed = {
                let meta = &meta;
                let uri = &uri;
                let mut loads = futures::stream::iter(pages[i..].iter().copied())
                    .map(|(idx, len)| self.load_page(cache, slots, uri, meta, idx, len))
                    .buffered(LOAD_PAGES_IN_FLIGHT);
                loop {
                    match loads.next().await {
                        Some(Ok(())) => i += 1,
                        Some(Err(e)) => break Some(e),
                        None => break None,
                    }
                }
            };
            match failed {
                None => {}
                Some(CacheError::Store(StoreError::PreconditionFailed)) if !retried => {
                    retried = true;
                    match cache.revalidate(&uri).await {
                        Ok(m) if m.size == meta.size => meta = m,
                        Ok(_) => {
                            let why = "changed size since it was listed; re-run the load";
                            return self.failed(&entry.key, left(i), why.into());
                        }
                        Err(e) => return self.failed(&entry.key, left(i), e.to_string()),
                    }
                }
                Some(e) => return self.failed(&entry.key, left(i), e.to_string()),
            }
        }
    }

    async fn load_page(
        &self,
        cache: &Arc<Cache>,
        slots: &Arc<Semaphore>,
        uri: &ObjectUri,
        meta: &ObjectMeta,
        idx: u64,
        len: u64,
    ) -> Result<(), CacheError> {
        let key = PageKey::new(&uri.to_string(), &meta.etag, idx);
        if cache.lru.contains(&key) {
            self.bytes_cached.fetch_add(len, Ordering::Relaxed);
            return Ok(());
        }
        let _slot = slots
            .acquire()
            .await
            .map_err(|_| CacheError::Local("load slots closed".into()))?;
        cache.warm_page(uri, meta, idx).await?;
        self.bytes_fetched.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// How many workers keep each segment.
    fn copies(&self) -> usize {
        self.spec.replicas.unwrap_or(1) as usize
    }

    fn failed(&self, key: &str, bytes: u64, reason: String) {
        tracing::warn!(job = %self.id, key, %reason, "load: object failed");
        self.objects_failed.fetch_add(1, Ordering::Relaxed);
        self.bytes_failed.fetch_add(bytes, Ordering::Relaxed);
        let mut failures = lock(&self.failures);
        if failures.len() < MAX_LOAD_FAILURES_KEPT {
            failures.push(LoadFailure {
                key: key.to_string(),
                reason,
            });
        }
    }
}

/// Bytes of an object of `size` this worker loads (see [`owned_pages`]);
/// none for pending write-back versions and empty objects, which are
/// skipped.
fn owned_bytes(cache: &Cache, uri: &ObjectUri, size: u64, copies: usize) -> u64 {
    let meta = ObjectMeta {
        size,
        etag: String::new(),
        last_modified_ms: 0,
        user: Default::default(),
    };
    owned_pages(cache, uri, &meta, copies)
        .iter()
        .map(|&(_, len)| len)
        .sum()
}

/// (page index, page length) of every page of `meta` in a segment this
/// worker holds one of `copies` copies of; all of them when the worker is
/// in no ring.
fn owned_pages(
    cache: &Cache,
    uri: &ObjectUri,
    meta: &ObjectMeta,
    copies: usize,
) -> Vec<(u64, u64)> {
    let ps = cache.page_size();
    let placement = cache.peers.placement();
    let segment = cache.config.segment_size.filter(|s| *s > 0);
    let mut owners: HashMap<u64, bool> = HashMap::new();
    (0..meta.size.div_ceil(ps))
        .filter(|idx| {
            let (Some(placement), Some(seg)) = (placement, segment) else {
                return true;
            };
            let s = idx * ps / seg;
            *owners
                .entry(s)
                .or_insert_with(|| placement.holds(uri, s, copies))
        })
        .map(|idx| (idx, ps.min(meta.size - idx * ps)))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
