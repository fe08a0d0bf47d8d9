//! The filesystem core: POSIX operations over S3 keys, driven by the
//! kernel adapter or directly by tests. Directories are key prefixes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{validate_key, ObjectStat, ObjectUri, WriteMode, MAX_KEY_BYTES};
use tokio::sync::Mutex as AsyncMutex;

use crate::config::FsConfig;
use crate::data_plane::{DataError, DataPlane};
use crate::dir::{DirStream, Listed, ListingCache};
use crate::error::{Chain, FsError};
use crate::inode::{Inode, InodeTable, Kind, Meta};
use crate::memory::MemoryBudget;
use crate::read::{FileReader, ReadaheadPolicy};
use crate::write::FileWriter;

mod meta;
mod object_locks;
pub mod prefetch;
mod staging;
mod update;
pub use meta::{Creator, SetAttr, METADATA_DELAY};
pub use prefetch::{DirPrefetch, Prefetched};

const MAX_NAME_BYTES: usize = 255;

/// One directory entry as `readdir` returns it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub name: String,
    pub node: Inode,
    /// Where `readdir` goes on after this entry.
    pub offset: u64,
}

#[derive(Clone)]
enum Handle {
    Read {
        reader: Arc<AsyncMutex<FileReader>>,
        ino: u64,
    },
    Write {
        writer: Arc<AsyncMutex<FileWriter>>,
        ino: u64,
        /// Thread group that opened the file: only its flush commits.
        owner_tgid: Option<u32>,
        /// Metadata before an overwrite, restored if the upload fails.
        previous: Option<Meta>,
        /// Set when the file was unlinked while open: nothing is stored.
        discarded: Arc<std::sync::atomic::AtomicBool>,
    },
    Dir(Arc<AsyncMutex<DirStream>>),
    /// Opened for writing without `O_TRUNC` (see `update.rs`).
    Update(Arc<update::Update>),
}

pub struct Fs {
    data: Arc<dyn DataPlane>,
    config: FsConfig,
    inodes: Arc<InodeTable>,
    /// Pushes whole-fetched objects into the kernel's page cache.
    kernel_cache: Arc<crate::kernel_cache::KernelCache>,
    handles: Mutex<HashMap<u64, Handle>>,
    staged: staging::StagedInodes,
    next_fh: AtomicU64,
    listings: Arc<ListingCache>,
    /// Directories whose names lookups asked S3 for one by one.
    lookup_misses: Mutex<HashMap<String, LookupMisses>>,
    forgets: AtomicU64,
    memory: Arc<MemoryBudget>,
    /// The node-local cache tier, when the mount has one.
    tier: Option<Arc<crate::local_tier::LocalTier>>,
    /// Plans the tier fetches ahead of (with a tier only).
    tier_plans: Option<Arc<crate::tier_plans::TierPlans>>,
    /// Fetches the rest of tier objects readers want whole.
    completer: Option<Arc<crate::complete::Completer>>,
    /// Metadata changes not yet stored in S3.
    dirty_meta: meta::DirtyMeta,
    /// Metadata stores, renames and unlinks of one object take turns.
    object_locks: object_locks::ObjectLocks,
    /// Fetches the next files of a directory read in order.
    prefetch: DirPrefetch,
}

/// Entries one `readdir` call prepares; the kernel's buffer takes fewer.
const READDIR_BATCH: usize = 512;
/// Names kept in complete listings across all directories.
const MAX_CACHED_NAMES: usize = 1_000_000;
/// A directory whose names are looked up this often without a listing
/// is listed in the background, so the rest of the lookups (a tool
/// `stat`ing every file by name) are answered without a HEAD each.
const LOOKUPS_BEFORE_LISTING: u32 = 2;
/// Largest directory listed for lookups (in entries); a bigger one keeps
/// costing a HEAD per name.
const LOOKUP_LISTING_MAX: usize = 100_000;
/// Stats in flight while a directory's entries get their metadata.
const STATS_IN_FLIGHT: usize = 32;
/// Directories tracked for lookup misses before the table is reset.
const MAX_TRACKED_DIRS: usize = 4096;

struct LookupMisses {
    count: u32,
    /// When a background listing of the directory started.
    listed: Option<std::time::Instant>,
}

fn meta_of(stat: &ObjectStat) -> Meta {
    Meta {
        size: stat.size,
        etag: Some(stat.etag.clone()),
        mtime_ms: stat.last_modified_ms,
        user: Some(stat.meta.clone()),
    }
}

/// Thread group of a task (FUSE requests carry thread ids); read from
/// /proc off the runtime threads.
async fn tgid_of(pid: u32) -> Option<u32> {
    tokio::task::spawn_blocking(move || read_tgid(pid))
        .await
        .ok()
        .flatten()
}

fn read_tgid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

impl Fs {
    /// The S3 key behind an inode, for naming operations in flight.
    pub fn key_of(&self, ino: u64) -> String {
        self.inodes.get(ino).map(|n| n.key).unwrap_or_default()
    }

    pub fn new(data: Arc<dyn DataPlane>, config: FsConfig) -> Self {
        let inodes = Arc::new(InodeTable::new(&config.prefix));
        let kernel_cache =
            crate::kernel_cache::KernelCache::new(inodes.clone(), config.push_page_cache);
        tracing::debug!(bytes = config.memory_limit, "mount memory budget");
        let memory = MemoryBudget::new(config.memory_limit);
        let prefetch = DirPrefetch::new(
            data.clone(),
            memory.clone(),
            &config.bucket,
            config.dir_prefetch_window,
        );
        Self {
            prefetch,
            data,
            listings: Arc::new(ListingCache::new(config.entry_ttl, MAX_CACHED_NAMES)),
            lookup_misses: Mutex::default(),
            config,
            inodes,
            kernel_cache,
            handles: Mutex::new(HashMap::new()),
            staged: staging::StagedInodes::default(),
            next_fh: AtomicU64::new(1),
            forgets: AtomicU64::new(0),
            memory,
            tier: None,
            tier_plans: None,
            completer: None,
            dirty_meta: meta::DirtyMeta::default(),
            object_locks: object_locks::ObjectLocks::default(),
        }
    }

    /// Planned ranges held in memory, where `--plan-memory` allows.
    fn plan_ranges(&self) -> Option<Arc<crate::plan_ranges::PlanRanges>> {
        (self.config.plan_memory > 0).then(|| {
            crate::plan_ranges::PlanRanges::new(
                self.data.clone(),
                self.memory.clone(),
                self.config.plan_memory,
            )
        })
    }

    /// Takes plans through a socket in `config.client_socket_dir` though
    /// it has no node-local tier: their next ranges are held in memory.
    pub fn with_client_plans(mut self) -> Self {
        if self.tier.is_none() && self.config.client_socket_dir.is_some() {
            if let Some(ranges) = self.plan_ranges() {
                let plans =
                    crate::tier_plans::TierPlans::new(self.data.clone(), None, 0, Some(ranges));
                self.tier_plans = Some(plans);
            }
        }
        self
    }

    /// Serves reads from (and fills) a node-local tier.
    pub fn with_local_tier(mut self, tier: Arc<crate::local_tier::LocalTier>) -> Self {
        self.prefetch.set_tier(tier.clone());
        self.completer = Some(Arc::new(
            crate::complete::Completer::new(self.data.clone(), tier.clone(), self.memory.clone())
                .with_kernel_cache(self.kernel_cache.clone()),
        ));
        // With a tier, plans fetch whole objects into it (not ranges too:
        // the same bytes would be fetched twice).
        self.tier_plans = None;
        if self.config.tier_plan_prefetch > 0 {
            if let Some(completer) = &self.completer {
                let plans = crate::tier_plans::TierPlans::new(
                    self.data.clone(),
                    Some((tier.clone(), completer.clone())),
                    self.config.tier_plan_prefetch,
                    None,
                );
                plans.attach();
                self.tier_plans = Some(plans);
            }
        }
        self.tier = Some(tier);
        self
    }

    /// Plans published to the node-local tier (through its socket).
    pub fn tier_plans(&self) -> Option<&Arc<crate::tier_plans::TierPlans>> {
        self.tier_plans.as_ref()
    }

    /// The cluster (or what stands for it) this mount reads and writes.
    pub fn data_plane(&self) -> &Arc<dyn DataPlane> {
        &self.data
    }

    /// Pushes whole-fetched objects into the kernel's page cache, once
    /// the mount connects it to the kernel.
    pub fn kernel_cache(&self) -> &Arc<crate::kernel_cache::KernelCache> {
        &self.kernel_cache
    }

    /// The tier's background completion, when the mount has a tier.
    pub fn completer(&self) -> Option<&Arc<crate::complete::Completer>> {
        self.completer.as_ref()
    }

    /// Goes on completing what a previous mount's readers wanted whole
    /// (call on the runtime).
    pub fn resume_completion(&self) {
        if let Some(completer) = &self.completer {
            completer.resume();
        }
    }

    /// For a read handle whose object is whole (and checked) in the local
    /// tier: that file, opened, for the kernel to read directly.
    pub async fn passthrough_file(&self, fh: u64) -> Option<std::fs::File> {
        let Ok(Handle::Read { reader, .. }) = self.handle(fh) else {
            return None;
        };
        let object = reader.lock().await.tier_object()?;
        let ready = tokio::task::spawn_blocking(move || match object.ready_for_passthrough() {
            Ok(true) => std::fs::File::open(object.backing_path()).ok(),
            Ok(false) => None,
            Err(e) => {
                // Checking the copy end to end failed (truncated, gone):
                // forget it, so reads fetch and fill it again.
                crate::local_tier::Damage::of(&e).note(object.id(), &e, "reading from the workers");
                object.forget_blocks();
                None
            }
        })
        .await;
        ready.ok().flatten()
    }

    /// A passthrough handle of `ino` opened (`true`) or the last one
    /// closed (`false`); see [`Inode::version_pins`].
    pub fn pin_version(&self, ino: u64, pinned: bool) {
        self.inodes.update(ino, |n| {
            n.version_pins = if pinned {
                n.version_pins + 1
            } else {
                n.version_pins.saturating_sub(1)
            };
        });
    }

    pub fn local_tier(&self) -> Option<&Arc<crate::local_tier::LocalTier>> {
        self.tier.as_ref()
    }

    /// This version's object in the local tier (created empty if new);
    /// `None` without a tier, or when the tier cannot take it.
    async fn tier_object(
        &self,
        uri: &ObjectUri,
        etag: &str,
        size: u64,
    ) -> Option<Arc<crate::local_tier::TierObject>> {
        let tier = self.tier.clone()?;
        if !lakecache_protocol::is_cache_version(etag) {
            self.rekey_written_back(&tier, uri, etag).await;
        }
        let (uri, etag) = (uri.to_string(), etag.to_string());
        // A held object is found in memory: no hop to the blocking pool
        // (one per open of each small file).
        if let Some(object) = tier.get(&uri, &etag) {
            return Some(object);
        }
        let made = tokio::task::spawn_blocking(move || tier.get_or_create(&uri, &etag, size)).await;
        match made {
            Ok(Ok(object)) => Some(object),
            Ok(Err(e @ crate::local_tier::TierError::Io { .. })) => {
                crate::local_tier::Damage::of(&e).note(
                    "",
                    &e,
                    "reading this file from the workers",
                );
                None
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "not using the local tier for this file");
                None
            }
            Err(_) => None,
        }
    }

    /// The tier holds `uri` under a cache version and S3 now names it
    /// `etag`: when the worker says `etag` is that version uploaded, the
    /// tier keeps the bytes under `etag` instead of reading them again.
    async fn rekey_written_back(
        &self,
        tier: &Arc<crate::local_tier::LocalTier>,
        uri: &ObjectUri,
        etag: &str,
    ) {
        let Some(held) = tier.cache_version_of(&uri.to_string()) else {
            return;
        };
        let Ok(stat) = self.data.stat(uri).await else {
            return;
        };
        if stat.etag != etag || stat.written_as.as_deref() != Some(held.as_str()) {
            return;
        }
        let (tier, key, etag) = (tier.clone(), uri.to_string(), etag.to_string());
        let moved = tokio::task::spawn_blocking(move || tier.rekey(&key, &held, &etag)).await;
        match moved {
            Ok(Ok(true)) => {
                tracing::debug!(%uri, "local tier kept a written-back file under its S3 ETag")
            }
            Ok(Err(e)) => {
                tracing::debug!(%uri, error = %e, "re-keying a written-back file in the local tier failed")
            }
            _ => {}
        }
    }

    pub fn config(&self) -> &FsConfig {
        &self.config
    }

    fn uri(&self, key: &str) -> Result<ObjectUri, FsError> {
        ObjectUri::new(&self.config.bucket, key).map_err(|e| FsError::InvalidName(e.to_string()))
    }

    fn handle(&self, fh: u64) -> Result<Handle, FsError> {
        let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles.get(&fh).cloned().ok_or(FsError::BadHandle)
    }

    fn add_handle(&self, handle: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles.insert(fh, handle);
        fh
    }

    fn take_handle(&self, fh: u64) -> Option<Handle> {
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles.remove(&fh)
    }

    fn node(&self, ino: u64) -> Result<Inode, FsError> {
        self.inodes.get(ino).ok_or(FsError::NotFound)
    }

    fn dir(&self, ino: u64) -> Result<Inode, FsError> {
        let node = self.node(ino)?;
        match node.kind {
            Kind::Dir => Ok(node),
            Kind::File => Err(FsError::NotDir),
        }
    }

    fn child_key(&self, parent: &Inode, name: &str, kind: Kind) -> Result<String, FsError> {
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
            return Err(FsError::InvalidName(format!("{name:?}")));
        }
        if name.len() > MAX_NAME_BYTES {
            return Err(FsError::NameTooLong);
        }
        let mut key = format!("{}{name}", parent.key);
        if kind == Kind::Dir {
            key.push('/');
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(FsError::NameTooLong);
        }
        validate_key(&key).map_err(|e| FsError::InvalidName(e.to_string()))?;
        Ok(key)
    }

    /// Resolves `parent/name` from the table while fresh, else from S3.
    /// Does not count a kernel lookup.
    /// The inode of `name` in `parent`, asking the cluster once the
    /// cached entry is older than the entry TTL. A name known here stays
    /// resolvable while the cluster cannot answer (stale-if-error): a
    /// worker restarting must not turn the open of a file a job already
    /// knows, and may hold in the node-local tier, into EIO.
    pub async fn resolve(&self, parent: u64, name: &str) -> Result<Inode, FsError> {
        let known = self.inodes.child(parent, name);
        match self.resolve_fresh(parent, name).await {
            Err(FsError::DataPlane(e)) if unreachable(&e) => match known {
                Some(node) => {
                    tracing::warn!(key = %node.key, error = %Chain(&e), "the cluster did not answer a lookup; using the name as last known");
                    Ok(node)
                }
                None => Err(FsError::DataPlane(e)),
            },
            other => other,
        }
    }

    async fn resolve_fresh(&self, parent: u64, name: &str) -> Result<Inode, FsError> {
        let p = self.dir(parent)?;
        let file_key = self.child_key(&p, name, Kind::File)?;
        if let Some(node) = self.inodes.child(parent, name) {
            if node.is_fresh(self.config.entry_ttl) && node.meta.user.is_some() {
                return Ok(node);
            }
        }
        if let Some(cached) = self.listings.get(&p.key) {
            // Only names the listing has: one created elsewhere since the
            // listing is still found by asking S3 below.
            if let Some(entry) = cached.find(name) {
                let meta = self
                    .with_user_meta(entry.kind, &entry.key, entry.meta.clone())
                    .await;
                let meta = match meta {
                    Err(FsError::NotFound) => {
                        self.inodes.unlink(parent, name);
                        return Err(FsError::NotFound);
                    }
                    other => other?,
                };
                return Ok(self.inodes.upsert_at(
                    parent,
                    name,
                    entry.kind,
                    entry.key.clone(),
                    meta,
                    cached.at,
                ));
            }
        } else {
            self.note_lookup_miss(&p.key);
        }
        let dir_key = format!("{file_key}/");
        let file_uri = self.uri(&file_key)?;
        let (stat, listing) = tokio::join!(
            self.data.stat(&file_uri),
            self.data
                .list(&self.config.bucket, &dir_key, Some("/"), None, Some(1))
        );
        // S3 is down and this directory is written back: a name the cache
        // does not know is taken as absent, so checkpoint writers can
        // create files through an outage (O_EXCL cannot be promised then).
        // A directory made through the mount stays: taking it as absent
        // failed every create under it with ENOENT once the kernel had
        // forgotten its inode (after `drop_caches`, or memory pressure).
        if self.config.write_mode_for(&file_key) == WriteMode::Back
            && store_down(&listing)
            && (store_down(&stat) || matches!(stat, Err(DataError::NotFound)))
        {
            // The marker of a directory made through a mount is pending
            // on its worker, which answers a stat of it without S3 (the
            // kernel may have forgotten the directory's inode meanwhile).
            if let Ok(marker) = self.data.stat(&self.uri(&dir_key)?).await {
                let meta = Meta {
                    user: Some(marker.meta),
                    ..Meta::default()
                };
                return Ok(self.inodes.upsert(parent, name, Kind::Dir, dir_key, meta));
            }
            if let Some(node) = self.inodes.child(parent, name) {
                tracing::debug!(key = %node.key, "S3 unavailable: lookup under a write-back prefix keeps a known name");
                return Ok(node);
            }
            tracing::debug!(key = %file_key, "S3 unavailable: lookup under a write-back prefix answers not found");
            return Err(FsError::NotFound);
        }
        let listing = listing.map_err(FsError::from)?;
        // A prefix shadows an object of the same name, as in `ls` of S3.
        if !listing.objects.is_empty() || !listing.common_prefixes.is_empty() {
            let meta = self
                .with_user_meta(Kind::Dir, &dir_key, Meta::default())
                .await?;
            return Ok(self.inodes.upsert(parent, name, Kind::Dir, dir_key, meta));
        }
        match stat.map_err(FsError::from) {
            Ok(stat) => Ok(self
                .inodes
                .upsert(parent, name, Kind::File, file_key, meta_of(&stat))),
            Err(FsError::NotFound) => {
                self.inodes.unlink(parent, name);
                Err(FsError::NotFound)
            }
            Err(e) => Err(e),
        }
    }

    /// Counts a lookup in a directory without a cached listing; the
    /// [`LOOKUPS_BEFORE_LISTING`]th starts listing it in the background.
    fn note_lookup_miss(&self, dir_key: &str) {
        let ttl = self.config.entry_ttl;
        if ttl.is_zero() {
            return;
        }
        {
            let mut misses = self.lookup_misses.lock().unwrap_or_else(|p| p.into_inner());
            if misses.len() >= MAX_TRACKED_DIRS && !misses.contains_key(dir_key) {
                misses.clear();
            }
            let entry = misses.entry(dir_key.to_string()).or_insert(LookupMisses {
                count: 0,
                listed: None,
            });
            if entry.listed.is_some_and(|at| at.elapsed() < ttl) {
                return;
            }
            entry.count += 1;
            if entry.count < LOOKUPS_BEFORE_LISTING {
                return;
            }
            *entry = LookupMisses {
                count: 0,
                listed: Some(std::time::Instant::now()),
            };
        }
        let data = self.data.clone();
        let listings = self.listings.clone();
        let mut stream = DirStream::new(
            &self.config.bucket,
            dir_key,
            Vec::new(),
            listings.generation(),
        )
        .with_meta(self.config.posix_metadata);
        let dir_key = dir_key.to_string();
        tokio::spawn(async move {
            match stream.fill_to(data.as_ref(), LOOKUP_LISTING_MAX + 1).await {
                Ok(()) if stream.is_done() => {
                    let count = stream.listed.len();
                    listings.put(&dir_key, stream.generation, stream.listed_at, stream.listed);
                    tracing::debug!(dir = %dir_key, count, "listed a directory for lookups");
                }
                Ok(()) => tracing::debug!(dir = %dir_key, "too many names to list for lookups"),
                Err(e) => tracing::debug!(dir = %dir_key, error = %e, "listing for lookups failed"),
            }
        });
    }

    /// The kernel's LOOKUP: resolves and counts a reference.
    pub async fn lookup(&self, parent: u64, name: &str) -> Result<Inode, FsError> {
        let mut node = self.resolve(parent, name).await?;
        self.inodes.add_lookup(node.ino);
        if node.writer.is_some() {
            self.refresh_staged_size(node.ino);
            node = self.node(node.ino)?;
        }
        Ok(node)
    }

    pub fn forget(&self, ino: u64, n: u64) {
        self.inodes.forget(ino, n);
        self.forgets.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs while the mount lives: drops expired listings, and once the
    /// kernel has stopped forgetting inodes for a second (a dropped
    /// dentry cache forgets millions in a burst), hands the freed memory
    /// back to the OS, so a mount that listed millions of names shrinks.
    pub async fn housekeeping(fs: std::sync::Weak<Fs>) {
        let (mut last_tick, mut last_trim) = (0, 0);
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let Some(fs) = fs.upgrade() else { return };
            let forgets = fs.forgets.load(Ordering::Relaxed);
            fs.prefetch.expire(prefetch::IDLE_CANCEL);
            let purged = fs.listings.purge_expired();
            let settled = forgets == last_tick && forgets != last_trim;
            if settled || purged > 0 {
                fs.inodes.shrink();
                crate::memory::trim();
                last_trim = forgets;
                tracing::debug!(purged, inodes = fs.inode_count(), "returned freed memory");
            }
            last_tick = forgets;
        }
    }

    /// Directory-order prefetch, for its counts.
    pub fn dir_prefetch(&self) -> &DirPrefetch {
        &self.prefetch
    }

    /// Inodes the table holds (the root included).
    pub fn inode_count(&self) -> usize {
        self.inodes.len()
    }

    /// This mount changed directory `ino`: its cached listing is stale.
    fn dir_changed(&self, ino: u64) {
        if let Some(dir) = self.inodes.get(ino) {
            self.listings.invalidate(&dir.key);
        }
    }

    pub fn add_lookup(&self, ino: u64) {
        self.inodes.add_lookup(ino);
    }

    /// [`Self::getattr`] where it needs no call: the attributes are
    /// fresh. `None` sends the caller the long way.
    pub fn getattr_now(&self, ino: u64) -> Option<Inode> {
        self.refresh_staged_size(ino);
        let node = self.node(ino).ok()?;
        (node.meta.user.is_some() && node.is_fresh(self.config.attr_ttl)).then_some(node)
    }

    pub async fn getattr(&self, ino: u64) -> Result<Inode, FsError> {
        match self.getattr_now(ino) {
            Some(node) => Ok(node),
            None => self.getattr_asking(ino).await,
        }
    }

    /// [`Self::getattr`] once [`Self::getattr_now`] had no answer: asks
    /// the store (or, for a directory, its user metadata) unless another
    /// call made them fresh meanwhile.
    pub async fn getattr_asking(&self, ino: u64) -> Result<Inode, FsError> {
        let node = self.node(ino)?;
        if node.meta.user.is_none() && node.kind == Kind::Dir {
            let meta = self
                .with_user_meta(Kind::Dir, &node.key, node.meta.clone())
                .await?;
            return self
                .inodes
                .update(ino, |n| {
                    if n.meta.user.is_none() {
                        n.meta = meta;
                    }
                    n.clone()
                })
                .ok_or(FsError::NotFound);
        }
        // Another getattr may have filled them in since.
        if node.is_fresh(self.config.attr_ttl) && node.meta.user.is_some() {
            return Ok(node);
        }
        self.revalidate(ino).await
    }

    /// Asks the store for the object's current size and version.
    async fn revalidate(&self, ino: u64) -> Result<Inode, FsError> {
        let node = self.node(ino)?;
        let asked = std::time::Instant::now();
        match self.data.stat(&self.uri(&node.key)?).await {
            Ok(stat) => {
                let meta = meta_of(&stat);
                let pinned_away = self
                    .inodes
                    .get(ino)
                    .is_some_and(|n| n.pinned_away_from(&meta));
                if pinned_away {
                    // Handles read this version through passthrough: the
                    // inode stays it, and the name's next lookup gets a
                    // new inode for the new version (or already has).
                    self.inodes.unlink_inode(ino, node.parent, &node.name);
                    return Ok(node);
                }
                self.inodes.update(ino, |n| {
                    // Not over a change made here while S3 was asked.
                    if n.writer.is_none() && !n.meta_dirty && asked >= n.validated {
                        if n.meta.etag != meta.etag {
                            n.link_target = None;
                        }
                        n.meta = meta;
                        n.validated = std::time::Instant::now();
                    }
                    n.clone()
                })
            }
            .ok_or(FsError::NotFound),
            Err(e) => {
                let e = FsError::from(e);
                if matches!(e, FsError::NotFound) {
                    self.inodes.unlink_inode(ino, node.parent, &node.name);
                }
                Err(e)
            }
        }
    }

    /// Opens a directory after its first LIST page (or from a listing
    /// cached within the entry TTL); later pages are listed as `readdir`
    /// reaches them.
    pub async fn opendir(&self, ino: u64) -> Result<u64, FsError> {
        let dir = self.dir(ino)?;
        let parent = self.inodes.get(dir.parent).unwrap_or_else(|| dir.clone());
        let mut head = vec![
            Listed {
                name: ".".into(),
                kind: Kind::Dir,
                key: dir.key.clone(),
                meta: Meta::default(),
            },
            Listed {
                name: "..".into(),
                kind: Kind::Dir,
                key: parent.key,
                meta: Meta::default(),
            },
        ];
        for local in self.inodes.local_children(ino) {
            head.push(Listed {
                name: local.name,
                kind: local.kind,
                key: local.key,
                meta: local.meta,
            });
        }
        let mut stream = DirStream::new(
            &self.config.bucket,
            &dir.key,
            head,
            self.listings.generation(),
        )
        .with_meta(self.config.posix_metadata);
        match self.listings.get(&dir.key) {
            Some(cached) => stream = stream.from_cache(&cached),
            None => stream.fill_to(self.data.as_ref(), stream.len() + 1).await?,
        }
        Ok(self.add_handle(Handle::Dir(Arc::new(AsyncMutex::new(stream)))))
    }

    /// Up to a batch of entries from index `offset`. With `plus` (the
    /// kernel's READDIRPLUS) every entry gets an inode, which the caller
    /// must count as looked up or release with [`Self::forget`]`(ino, 0)`;
    /// without it, names not in the table get a stable stand-in number
    /// and no inode (the kernel looks them up when it needs one).
    pub async fn readdir(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        plus: bool,
    ) -> Result<Vec<DirEntry>, FsError> {
        let Handle::Dir(stream) = self.handle(fh)? else {
            return Err(FsError::BadHandle);
        };
        let mut stream = stream.lock().await;
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(READDIR_BATCH);
        stream.fill_to(self.data.as_ref(), end).await?;
        self.complete_user_meta(&mut stream, start..end).await?;
        // Also a listing opendir finished: `ls` then reading the files
        // in order finds their names (and the prefetch its order) here.
        if stream.is_done() && !stream.cached {
            stream.cached = true;
            let dir_key = self.dir(ino)?.key;
            self.listings.put(
                &dir_key,
                stream.generation,
                stream.listed_at,
                stream.listed.clone(),
            );
        }
        let at = stream.listed_at;
        let mut out = Vec::new();
        for i in start..end.min(stream.len()) {
            let Some(entry) = stream.get(i) else { break };
            let node = match entry.name.as_str() {
                "." => self.node(ino)?,
                ".." => {
                    let dir = self.node(ino)?;
                    self.inodes.get(dir.parent).unwrap_or(dir)
                }
                _ if plus => self.inodes.upsert_at(
                    ino,
                    &entry.name,
                    entry.kind,
                    entry.key.clone(),
                    entry.meta.clone(),
                    at,
                ),
                _ => match self.inodes.child(ino, &entry.name) {
                    Some(node) => node,
                    None => Inode::transient(ino, entry),
                },
            };
            out.push(DirEntry {
                name: entry.name.clone(),
                node,
                offset: i as u64 + 1,
            });
        }
        Ok(out)
    }

    /// Gives the entries `range` their user metadata (a listing has
    /// none): the kernel must learn an entry's type, mode and owner with
    /// the entry, since a type changing later makes its inode unusable.
    async fn complete_user_meta(
        &self,
        stream: &mut DirStream,
        range: std::ops::Range<usize>,
    ) -> Result<(), FsError> {
        use futures::StreamExt as _;
        let wanted: Vec<(usize, Listed)> = range
            .filter_map(|i| stream.get(i).map(|e| (i, e)))
            .filter(|(_, e)| e.meta.user.is_none() && e.name != "." && e.name != "..")
            .map(|(i, e)| (i, e.clone()))
            .collect();
        let found: Vec<_> = futures::stream::iter(wanted.into_iter().map(|(i, e)| async move {
            let meta = self.with_user_meta(e.kind, &e.key, e.meta.clone()).await;
            (i, meta)
        }))
        .buffered(STATS_IN_FLIGHT)
        .collect()
        .await;
        for (i, meta) in found {
            let meta = match meta {
                Ok(m) => m,
                // Deleted since the listing: shown as listed until looked up.
                Err(FsError::NotFound) => continue,
                Err(e) => return Err(e),
            };
            if let Some(entry) = stream.get_mut(i) {
                entry.meta = meta;
            }
        }
        Ok(())
    }

    /// Every entry of a directory, as `ls` reads it (tests and tools).
    pub async fn list_dir(&self, ino: u64) -> Result<Vec<DirEntry>, FsError> {
        let fh = self.opendir(ino).await?;
        let mut all: Vec<DirEntry> = Vec::new();
        loop {
            let next = all.last().map_or(0, |e| e.offset);
            let batch = self.readdir(ino, fh, next, false).await;
            match batch {
                Ok(b) if b.is_empty() => break,
                Ok(b) => all.extend(b),
                Err(e) => {
                    self.releasedir(fh);
                    return Err(e);
                }
            }
        }
        self.releasedir(fh);
        Ok(all)
    }

    pub fn releasedir(&self, fh: u64) {
        self.take_handle(fh);
    }

    /// Opens a file; returns the handle and whether the kernel may keep
    /// the pages it cached on an earlier open.
    pub async fn open(&self, ino: u64, flags: i32, pid: u32) -> Result<(u64, bool), FsError> {
        // A staged writer closed just before is released just after.
        self.await_closed_writer_release(ino).await;
        let node = self.node(ino)?;
        if node.kind == Kind::Dir {
            return Err(FsError::IsDir);
        }
        let access = flags & libc::O_ACCMODE;
        let replaces = flags & libc::O_TRUNC != 0 || node.meta.size == 0;
        if access != libc::O_RDONLY && replaces {
            let previous = Some(node.meta.clone());
            let owner = tgid_of(pid).await;
            let opened = self.open_for_write(node, flags, owner, previous)?;
            // The inode shows the new file now: no old bytes may land in
            // the page cache the kernel truncates after this reply.
            self.kernel_cache.settle(ino).await;
            return Ok(opened);
        }
        // Without O_TRUNC the object is read as usual and copied to a
        // spool on its first change (fio's verify pass only reads).
        let updating = access != libc::O_RDONLY;
        if node.writer.is_some() && !updating {
            return Err(FsError::Busy("the file is being written"));
        }
        let mut node = self.getattr(ino).await?;
        if node.meta.etag.is_none() {
            node = self.revalidate(ino).await?;
        }
        let etag = node.meta.etag.clone().ok_or(FsError::NotFound)?;
        let keep_cache = node.page_cache_etag.as_deref() == Some(etag.as_str());
        self.inodes
            .update(ino, |n| n.page_cache_etag = Some(etag.clone()));
        if !keep_cache {
            // The kernel drops the inode's pages after this reply: a store
            // of another version's bytes must not land after that.
            self.kernel_cache.settle(ino).await;
        }
        let uri = self.uri(&node.key)?;
        // Only a mount with a tier fetches objects whole, hence pushes:
        // without one, opens (a thousand a second for small files) skip
        // the registration.
        let push_key = self
            .completer
            .is_some()
            .then(|| (uri.to_string(), etag.clone()));
        if let (Some(plans), false) = (&self.tier_plans, updating) {
            if plans.any() {
                plans.note(&uri.to_string(), None);
            }
        }
        let mut reader = self
            .object_reader(uri, etag, node.meta.size, !updating)
            .await;
        if !updating && self.prefetch.enabled() {
            let listing = self
                .inodes
                .get(node.parent)
                .and_then(|dir| self.listings.get(&dir.key));
            let etag = reader.etag().to_string();
            if let Some(prefetched) = self.prefetch.on_open(
                node.parent,
                listing,
                &node.name,
                &node.key,
                &etag,
                node.meta.size,
            ) {
                reader = reader.with_prefetched(prefetched);
            }
        }
        if updating {
            return Ok((self.open_update(ino, pid, reader).await?, false));
        }
        let fh = self.add_handle(Handle::Read {
            reader: Arc::new(AsyncMutex::new(reader)),
            ino,
        });
        if let Some((uri, etag)) = push_key {
            self.kernel_cache.opened(fh, ino, &uri, &etag);
        }
        Ok((fh, keep_cache))
    }

    /// A reader of `uri` at `etag` as an open makes one: the node-local
    /// tier first, then the workers with read-ahead, the tier copy filled
    /// and completed by the mount's rules (`reading`: not an open for
    /// update, so `--local-cache-whole` applies).
    pub(crate) async fn object_reader(
        &self,
        uri: ObjectUri,
        etag: String,
        size: u64,
        reading: bool,
    ) -> FileReader {
        let tier_object = self.tier_object(&uri, &etag, size).await;
        let whole = reading && self.config.tier_whole_for(uri.key());
        let mut reader = FileReader::new(
            self.data.clone(),
            uri,
            etag,
            size,
            ReadaheadPolicy {
                initial: self.config.readahead_initial,
                max: self.config.readahead_max,
                chunk: self.config.readahead_chunk,
            },
            self.memory.clone(),
        )
        .with_tier(tier_object, self.completer.clone())
        // An object larger than the tier can never be whole there.
        .whole_on_random(
            self.tier
                .as_ref()
                .map_or(self.config.random_whole_max, |t| {
                    self.config.random_whole_max.min(t.capacity())
                }),
        );
        if whole {
            reader.ask_whole();
        }
        reader
    }

    /// Whether this mount serves `uri`: its bucket, under its prefix.
    pub(crate) fn serves(&self, uri: &ObjectUri) -> bool {
        uri.bucket() == self.config.bucket && uri.key().starts_with(&self.config.prefix)
    }

    pub(crate) fn bucket_and_prefix(&self) -> (&str, &str) {
        (&self.config.bucket, &self.config.prefix)
    }

    /// A reader for another process on the node (the tier socket): the
    /// size comes from the tier's copy, or from the workers, whose
    /// version must still be `etag`.
    pub(crate) async fn client_reader(
        &self,
        uri: ObjectUri,
        etag: &str,
    ) -> Result<FileReader, FsError> {
        let held = self
            .tier
            .as_ref()
            .and_then(|t| t.get(&uri.to_string(), etag));
        let size = match held {
            Some(object) => object.size(),
            None => match self.data.stat(&uri).await {
                Ok(stat) if stat.etag == etag => stat.size,
                Ok(_) => return Err(FsError::Stale),
                Err(DataError::NotFound) => return Err(FsError::NotFound),
                Err(e) => return Err(FsError::DataPlane(e)),
            },
        };
        Ok(self.object_reader(uri, etag.to_string(), size, true).await)
    }

    /// `previous`: the metadata to restore if the upload fails.
    fn check_writable(&self, uri: &ObjectUri) -> Result<(), FsError> {
        match &self.config.write_scopes {
            Some(scopes) if !lakecache_protocol::token::scope_covers(scopes, &uri.to_string()) => {
                Err(FsError::AccessDenied(format!(
                    "the mount's token does not allow writing {uri}"
                )))
            }
            _ => Ok(()),
        }
    }

    fn open_for_write(
        &self,
        node: Inode,
        flags: i32,
        owner_tgid: Option<u32>,
        previous: Option<Meta>,
    ) -> Result<(u64, bool), FsError> {
        if flags & libc::O_TRUNC == 0 && node.meta.size > 0 {
            return Err(FsError::NotPermitted(
                "existing objects can only be replaced whole: open with O_TRUNC",
            ));
        }
        let uri = self.uri(&node.key)?;
        self.check_writable(&uri)?;
        // Claim the inode atomically: of two concurrent opens for
        // writing, exactly one wins and the other gets EBUSY.
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let user = self.rewritten_meta(&node);
        let claimed = self.inodes.update(node.ino, |n| {
            if n.writer.is_some() {
                return false;
            }
            n.writer = Some(fh);
            n.meta = Meta {
                size: 0,
                etag: None,
                mtime_ms: now_ms(),
                user: Some(user.clone()),
            };
            n.meta_dirty = false;
            n.page_cache_etag = None;
            true
        });
        match claimed {
            Some(true) => {}
            Some(false) => return Err(FsError::Busy("the file is already open for writing")),
            None => return Err(FsError::NotFound),
        }
        let writer = FileWriter::new(
            self.data.clone(),
            uri,
            self.config.upload_limits(),
            self.memory.clone(),
            self.config.write_mode_for(&node.key),
            user,
        )
        .with_spool(self.config.spool_dir.join("resend"));
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles.insert(
            fh,
            Handle::Write {
                writer: Arc::new(AsyncMutex::new(writer)),
                ino: node.ino,
                owner_tgid,
                previous,
                discarded: Arc::default(),
            },
        );
        Ok((fh, false))
    }

    /// Creates a file that exists locally until its upload completes;
    /// opened read-only, it is stored empty at once.
    pub async fn create(
        &self,
        parent: u64,
        name: &str,
        pid: u32,
        who: Creator,
        flags: i32,
    ) -> Result<(Inode, u64), FsError> {
        let p = self.dir(parent)?;
        let user = self.new_object_meta(&p, crate::posix::FileType::Regular, who, 0);
        if flags & libc::O_ACCMODE == libc::O_RDONLY {
            let key = self.child_key(&p, name, Kind::File)?;
            self.check_writable(&self.uri(&key)?)?;
            let stat = self.put_object(&key, Bytes::new(), &user).await?;
            self.dir_changed(parent);
            let node = self
                .inodes
                .upsert(parent, name, Kind::File, key, meta_of(&stat));
            self.inodes.add_lookup(node.ino);
            let (fh, _) = self.open(node.ino, libc::O_RDONLY, pid).await?;
            return Ok((self.node(node.ino)?, fh));
        }
        let owner = tgid_of(pid).await;
        let key = self.child_key(&p, name, Kind::File)?;
        self.check_writable(&self.uri(&key)?)?;
        if let Some(existing) = self.inodes.child(parent, name) {
            self.await_closed_writer_release(existing.ino).await;
            let existing = self.node(existing.ino)?;
            if existing.writer.is_some() {
                return Err(FsError::Busy("the file is already open for writing"));
            }
        }
        let node = self.inodes.upsert(
            parent,
            name,
            Kind::File,
            key,
            Meta {
                size: 0,
                etag: None,
                mtime_ms: now_ms(),
                user: Some(user),
            },
        );
        // A create that did not replace anything has nothing to restore.
        let (fh, _) =
            self.open_for_write(node.clone(), libc::O_WRONLY | libc::O_TRUNC, owner, None)?;
        self.inodes.add_lookup(node.ino);
        let node = self.node(node.ino)?;
        Ok((node, fh))
    }

    /// A read the node-local tier, fetched read-ahead or a worker on this
    /// host that has the bytes cached serves at once, on the calling
    /// thread (see [`FileReader::read_tier_now`],
    /// [`FileReader::read_buffered_now`] and
    /// [`FileReader::read_cached_now`]); `None`: use [`Self::read`].
    /// Never waits on another read: a handle busy with one is left to it.
    /// `may_ask_worker`: the worker may be asked (the calling thread may
    /// wait on it).
    pub fn read_now(&self, fh: u64, offset: u64, len: u32, may_ask_worker: bool) -> Option<Bytes> {
        match self.handle(fh).ok()? {
            Handle::Read { reader, .. } => {
                let mut reader = reader.try_lock().ok()?;
                if let Some(bytes) = self.planned_bytes(&reader, offset, len.into()) {
                    return Some(bytes);
                }
                reader
                    .read_tier_now(offset, len.into())
                    .or_else(|| reader.read_buffered_now(offset, len.into()))
                    .or_else(|| {
                        may_ask_worker
                            .then(|| reader.read_cached_now(offset, len.into()))
                            .flatten()
                    })
            }
            _ => None,
        }
    }

    /// The bytes a plan had fetched into memory for this read, if any.
    fn planned_bytes(&self, reader: &FileReader, offset: u64, len: u64) -> Option<Bytes> {
        let ranges = self.tier_plans.as_ref()?.ranges()?;
        if ranges.held_bytes() == 0 || offset >= reader.size() {
            return None;
        }
        let len = len.min(reader.size() - offset);
        ranges.take(&reader.uri().to_string(), reader.etag(), offset, len)
    }

    pub async fn read(&self, fh: u64, offset: u64, len: u32) -> Result<Bytes, FsError> {
        match self.handle(fh)? {
            Handle::Read { reader, ino } => {
                let mut reader = reader.lock().await;
                if let Some(bytes) = self.planned_bytes(&reader, offset, len.into()) {
                    return Ok(bytes);
                }
                match reader.read(offset, len as u64).await {
                    // The version this handle was opened with (a listing's
                    // ETag) was replaced before any byte of it was served:
                    // read the current one. Later, a change is an error.
                    Err(FsError::Stale) if !reader.has_served() => {
                        let node = self.revalidate(ino).await?;
                        let etag = node.meta.etag.clone().ok_or(FsError::NotFound)?;
                        tracing::debug!(uri = %reader.uri(), %etag, "object replaced before the first read; reading the current version");
                        reader.switch_version(etag.clone(), node.meta.size);
                        self.inodes.update(ino, |n| n.page_cache_etag = Some(etag));
                        reader.read(offset, len as u64).await
                    }
                    other => other,
                }
            }
            Handle::Write { .. } => Err(FsError::NotPermitted(
                "a file open for writing cannot be read until it is closed",
            )),
            Handle::Update(u) => self.update_read(&u, offset, len).await,
            Handle::Dir(_) => Err(FsError::IsDir),
        }
    }

    pub async fn write(&self, fh: u64, offset: u64, data: Bytes) -> Result<u32, FsError> {
        let (writer, ino) = match self.handle(fh)? {
            Handle::Write { writer, ino, .. } => (writer, ino),
            Handle::Read { .. } => return Err(FsError::BadHandle),
            Handle::Update(u) => return self.update_write(fh, &u, offset, data).await,
            Handle::Dir(_) => return Err(FsError::BadHandle),
        };
        let mut w = writer.lock().await;
        if w.written() == 0 {
            self.writer_wrote(ino);
        }
        // Used if this write starts the upload.
        if let Some(user) = self.touch_written(ino) {
            w.set_meta(user);
        }
        let n = w.write(offset, data).await.inspect_err(|e| {
            tracing::warn!(uri = %w.uri, offset, error = %e, "write refused");
        })?;
        let size = w.size();
        self.inodes.update(ino, |node| node.meta.size = size);
        Ok(n)
    }

    /// Completes the upload if `pid` belongs to the process that opened
    /// the file (a forked child closing its copy commits nothing).
    pub async fn flush(&self, fh: u64, pid: u32) -> Result<(), FsError> {
        match self.handle(fh)? {
            Handle::Write {
                owner_tgid,
                writer,
                ino,
                ..
            } => {
                self.staged_flushed(ino);
                if owner_tgid.is_some() && tgid_of(pid).await != owner_tgid {
                    return Ok(());
                }
                // Shells open, dup2 and close the original descriptor before
                // writing (`echo x > f`): a flush before any data is not the
                // end of the file. Release uploads an empty file.
                if writer.lock().await.written() == 0 {
                    self.empty_writer_closed(ino);
                    return Ok(());
                }
                self.commit(fh).await
            }
            Handle::Update(u) => {
                if u.owner_tgid.is_some() && tgid_of(pid).await != u.owner_tgid {
                    return Ok(());
                }
                self.update_commit(fh, &u).await
            }
            _ => Ok(()),
        }
    }

    pub async fn fsync(&self, fh: u64) -> Result<(), FsError> {
        match self.handle(fh)? {
            Handle::Write { ino, .. } => {
                self.commit(fh).await?;
                self.store_metadata(ino).await
            }
            Handle::Read { ino, .. } => self.store_metadata(ino).await,
            Handle::Update(u) => {
                self.update_commit(fh, &u).await?;
                self.store_metadata(u.ino).await
            }
            Handle::Dir(_) => self.sync_metadata().await,
        }
    }

    pub async fn release(&self, fh: u64) -> Result<(), FsError> {
        self.kernel_cache.closed(fh);
        let result = match self.handle(fh) {
            Ok(Handle::Write { .. }) => self.commit(fh).await,
            Ok(Handle::Update(u)) => self.update_release(fh, &u).await,
            _ => Ok(()),
        };
        if let Some(Handle::Write { ino, .. }) = self.take_handle(fh) {
            // Free the inode before waking the opens that wait on this
            // release: woken first, they would see the writer and refuse.
            self.writer_released(ino, fh);
            self.forget_staged(ino);
        }
        result
    }

    /// Stores what a writing handle of either kind holds.
    async fn commit_any(&self, fh: u64) -> Result<(), FsError> {
        match self.handle(fh)? {
            Handle::Update(u) => self.update_commit(fh, &u).await,
            _ => self.commit(fh).await,
        }
    }

    /// Finishes the handle's upload; the inode shows S3's answer after.
    async fn commit(&self, fh: u64) -> Result<(), FsError> {
        let Handle::Write {
            writer,
            ino,
            previous,
            discarded,
            ..
        } = self.handle(fh)?
        else {
            return Err(FsError::BadHandle);
        };
        let mut w = writer.lock().await;
        if discarded.load(Ordering::SeqCst) {
            w.abandon();
            return Ok(());
        }
        let first = !w.is_finished();
        // The metadata set while the file was open goes with it.
        let wanted = self.inodes.get(ino).and_then(|n| n.meta.user);
        if first {
            if let Some(user) = &wanted {
                w.set_meta(user.clone());
            }
        }
        let explicit = w.meta_set_explicitly();
        // A staged file keeps its inode claimed until it is closed: the
        // kernel writes into it without asking, and may go on after this.
        let staged = w.is_staged();
        let result = w.finish().await;
        if !first {
            return result.map(|_| ());
        }
        match &result {
            Ok(stat) => {
                let meta = meta_of(stat);
                let parent = self.inodes.update(ino, |n| {
                    n.meta = meta;
                    n.validated = std::time::Instant::now();
                    if !staged {
                        n.writer = None;
                    }
                    n.parent
                });
                // Set explicitly after the upload had started: stored by
                // a copy. (Times moved by writes alone are not worth one.)
                if explicit {
                    self.keep_newer_meta(ino, wanted, &stat.meta);
                }
                if let Some(parent) = parent {
                    self.dir_changed(parent);
                }
                tracing::debug!(uri = %w.uri, size = stat.size, "upload committed");
            }
            Err(e) => {
                tracing::error!(uri = %w.uri, error = %e, "upload failed; the data written to this file is not in S3");
                let node = self.inodes.update(ino, |n| {
                    n.writer = None;
                    if let Some(prev) = &previous {
                        n.meta = prev.clone();
                    }
                    n.clone()
                });
                if let (Some(node), None) = (node, previous) {
                    self.inodes.unlink(node.parent, &node.name);
                }
            }
        }
        result.map(|_| ())
    }

    pub async fn mkdir(&self, parent: u64, name: &str, who: Creator) -> Result<Inode, FsError> {
        let p = self.dir(parent)?;
        let key = self.child_key(&p, name, Kind::Dir)?;
        match self.resolve(parent, name).await {
            Ok(_) => return Err(FsError::Exists),
            Err(FsError::NotFound) => {}
            Err(e) => return Err(e),
        }
        let user = self.new_object_meta(&p, crate::posix::FileType::Directory, who, 0);
        self.put_object(&key, Bytes::new(), &user).await?;
        self.dir_changed(parent);
        let meta = Meta {
            user: Some(user),
            ..Meta::default()
        };
        let node = self.inodes.upsert(parent, name, Kind::Dir, key, meta);
        self.inodes.add_lookup(node.ino);
        Ok(node)
    }

    pub async fn unlink(&self, parent: u64, name: &str) -> Result<(), FsError> {
        let node = self.resolve(parent, name).await?;
        if node.kind == Kind::Dir {
            return Err(FsError::IsDir);
        }
        // Closed just before, its data is stored: a delete, not a discard.
        self.await_closed_writer_release(node.ino).await;
        let _turn = self.object_locks.lock(node.ino).await;
        // Resolved again under the lock: a rename may have moved it.
        let node = self.resolve(parent, name).await?;
        if let Some(Ok(Handle::Update(u))) = node.writer.map(|fh| self.handle(fh)) {
            // Changed in place and now unlinked: the changes are dropped.
            u.discard().await;
            self.inodes.update(node.ino, |n| n.writer = None);
        }
        if let Some(fh) = node.writer {
            // Unlinked while open for writing (`creat` then `unlink`, a
            // temp file): its data is never stored; an object it was
            // replacing goes too.
            if let Ok(Handle::Write {
                discarded,
                previous,
                ..
            }) = self.handle(fh)
            {
                // The object it replaces goes first: an unlink that fails
                // leaves the writer to store its data at close, as if the
                // unlink had never been asked for.
                if previous.is_some_and(|p| p.etag.is_some()) {
                    match self.data.delete(&self.uri(&node.key)?).await {
                        Ok(()) | Err(DataError::NotFound) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                discarded.store(true, Ordering::SeqCst);
                self.inodes.update(node.ino, |n| n.writer = None);
                self.dir_changed(parent);
                self.inodes.unlink(parent, name);
                return Ok(());
            }
        }
        // Still open here: its handles go on reading a local copy, once
        // the delete has gone through.
        let kept = self.copy_for_open_handles(&node).await;
        self.data.delete(&self.uri(&node.key)?).await?;
        if let Some(kept) = kept {
            self.attach_kept(kept).await;
        }
        self.dir_changed(parent);
        self.inodes.unlink(parent, name);
        Ok(())
    }

    /// True when nothing but the directory's own marker is under it.
    async fn is_empty_dir(&self, dir: &Inode) -> Result<bool, FsError> {
        if !self.inodes.local_children(dir.ino).is_empty() {
            return Ok(false);
        }
        let page = self
            .data
            .list(&self.config.bucket, &dir.key, None, None, Some(2))
            .await?;
        Ok(page.objects.iter().all(|o| o.key == dir.key))
    }

    pub async fn rmdir(&self, parent: u64, name: &str) -> Result<(), FsError> {
        let node = self.resolve(parent, name).await?;
        if node.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        if !self.is_empty_dir(&node).await? {
            return Err(FsError::NotEmpty);
        }
        self.data.delete(&self.uri(&node.key)?).await?;
        self.dir_changed(parent);
        self.inodes.unlink(parent, name);
        Ok(())
    }

    pub async fn rename(
        &self,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        no_replace: bool,
        pid: u32,
    ) -> Result<(), FsError> {
        // The source's turn (see object_locks); an error resolving it is
        // rename_objects' to report.
        let src_ino = self.resolve(parent, name).await.map(|n| n.ino).ok();
        // Staged writers closed just before are released first: their
        // files are stored, not still being written.
        if let Some(ino) = src_ino {
            self.await_closed_writer_release(ino).await;
        }
        if let Some(dst) = self.inodes.child(new_parent, new_name) {
            self.await_closed_writer_release(dst.ino).await;
        }
        let _turn = match src_ino {
            Some(ino) => Some(self.object_locks.lock(ino).await),
            None => None,
        };
        let result = self
            .rename_objects(parent, name, new_parent, new_name, no_replace, pid)
            .await;
        // Whatever happened, both listings may have changed, and one
        // taken while the objects moved may have seen half of it.
        self.dir_changed(parent);
        self.dir_changed(new_parent);
        result
    }

    async fn rename_objects(
        &self,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        no_replace: bool,
        pid: u32,
    ) -> Result<(), FsError> {
        let src = self.resolve(parent, name).await?;
        let np = self.dir(new_parent)?;
        self.dir_changed(parent);
        self.dir_changed(new_parent);
        let dst = match self.resolve(new_parent, new_name).await {
            Ok(n) => Some(n),
            Err(FsError::NotFound) => None,
            Err(e) => return Err(e),
        };
        if dst.as_ref().is_some_and(|d| d.ino == src.ino) {
            return Ok(());
        }
        if no_replace && dst.is_some() {
            return Err(FsError::Exists);
        }
        match src.kind {
            Kind::File => {
                if dst.as_ref().is_some_and(|d| d.kind == Kind::Dir) {
                    return Err(FsError::IsDir);
                }
                // Its writer's commit would later overwrite the moved file.
                if dst.as_ref().is_some_and(|d| d.writer.is_some()) {
                    return Err(FsError::Busy("the target file is being written"));
                }
                // Renaming a file still open for writing (safetensors
                // renames before close) commits what was written first.
                // Another process renaming it must not publish a
                // half-written file: only the writer's own process may.
                let src = match src.writer {
                    Some(fh) => {
                        if let Ok(Handle::Write {
                            owner_tgid: Some(owner),
                            ..
                        }) = self.handle(fh)
                        {
                            if tgid_of(pid).await != Some(owner) {
                                return Err(FsError::Busy(
                                    "the file is being written by another process",
                                ));
                            }
                        }
                        match self.commit_any(fh).await {
                            // Released since it was resolved: release
                            // stored it.
                            Err(FsError::BadHandle) => {}
                            other => other?,
                        }
                        self.node(src.ino)?
                    }
                    None => src,
                };
                let new_key = self.child_key(&np, new_name, Kind::File)?;
                let (from, to) = (self.uri(&src.key)?, self.uri(&new_key)?);
                // The copy carries the attributes as this mount has them
                // (a chmod not stored yet included).
                let user = src.meta.user.clone();
                // Handles open on the file it replaces go on reading it, as
                // on a local file system: a local copy, taken before the
                // copy overwrites it. Handles open on the moved file read
                // the copy: it is the same file, under its new name.
                let kept = match &dst {
                    Some(d) => self.copy_for_open_handles(d).await,
                    None => None,
                };
                let stat = self.data.copy(&from, None, &to, user.as_ref()).await?;
                if let Some(kept) = kept {
                    self.attach_kept(kept).await;
                }
                if let Some(old) = &src.meta.etag {
                    for reader in self.readers_of(src.ino) {
                        reader.lock().await.follow_move(old, to.clone(), &stat.etag);
                    }
                }
                self.data.delete(&from).await?;
                self.inodes
                    .rename(src.ino, new_parent, new_name, new_key, meta_of(&stat));
                self.inodes.update(src.ino, |n| n.meta_dirty = false);
            }
            Kind::Dir => {
                if let Some(d) = &dst {
                    if d.kind == Kind::File {
                        return Err(FsError::NotDir);
                    }
                    if !self.is_empty_dir(d).await? {
                        return Err(FsError::NotEmpty);
                    }
                }
                let new_key = self.child_key(&np, new_name, Kind::Dir)?;
                if !self.is_empty_dir(&src).await? {
                    self.move_tree(&src, &new_key).await?;
                }
                let user = src.meta.user.clone().unwrap_or_default();
                self.put_object(&new_key, Bytes::new(), &user).await?;
                match self.data.delete(&self.uri(&src.key)?).await {
                    // A directory without a marker has none to delete.
                    Ok(()) | Err(DataError::NotFound) => {}
                    Err(e) => return Err(e.into()),
                }
                let meta = Meta {
                    user: Some(user),
                    ..Meta::default()
                };
                self.inodes
                    .rename(src.ino, new_parent, new_name, new_key, meta);
                self.inodes.update(src.ino, |n| n.meta_dirty = false);
            }
        }
        Ok(())
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A failure that says nothing about the object: nobody could be asked.
fn unreachable(e: &DataError) -> bool {
    matches!(
        e,
        DataError::StoreUnavailable(_) | DataError::Backend { .. }
    )
}

fn store_down<T>(r: &Result<T, DataError>) -> bool {
    matches!(r, Err(DataError::StoreUnavailable(_)))
}
