//! Write-back state of one worker: the journal of acknowledged objects
//! not yet in S3, the dirty pages that hold their bytes, and the overlay
//! that lets stat, read and list see them before S3 does.
//!
//! Dirty pages live in `<cache>/writeback/`, apart from clean pages: they
//! are never evicted, and a restart that discards clean pages (another
//! page size or format) leaves them alone. They become clean pages, keyed
//! by the S3 ETag, once their object is uploaded (`upload.rs`).

mod copies;
mod give_way;
mod landing;
mod page_crcs;
mod replica;
mod spare_fill;
mod stage;
mod upload;
mod visible;

pub(crate) use lakecache_protocol::is_cache_version;
pub use page_crcs::PageCrcs;
pub(crate) use replica::replica_watcher;
pub(crate) use spare_fill::spare_filler;
pub use stage::{BodyMeta, Staging, WriteRole};
pub(crate) use upload::uploader;
pub(crate) use visible::split_list_token;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lakecache_protocol::{EntryState, UriWrite, WriteBackStatus};
use tokio::sync::Notify;

use crate::journal::{Journal, JournalError, PendingObject, ReplicaOf};
use crate::pages::{mkdir_private, PageId, PageKey, PageStore};

/// Versions the cache gives acknowledged objects start with this, so
/// they can never be mistaken for an S3 ETag.
pub const VERSION_PREFIX: &str = lakecache_protocol::CACHE_VERSION_PREFIX;
/// Uploaded versions remembered so readers holding one find the ETag.
const MAX_ALIASES: usize = 65_536;
/// The product default for `WriteBackConfig::spare_most`: room for a few
/// checkpoint bursts of the size this project's benches write.
pub const DEFAULT_SPARE_MOST: u64 = 2 << 30;

#[derive(Debug, Clone)]
pub struct WriteBackConfig {
    /// Dirty bytes held before new writes wait for uploads.
    pub staging_limit: u64,
    /// A write waiting longer than this for staging space fails.
    pub stall_timeout: Duration,
    /// Parts uploaded at once per object.
    pub parts_in_flight: usize,
    /// Workers that hold an object before its write is acknowledged
    /// (this one and the next ones on the ring). `None`: 2 when the ring
    /// has at least 2 workers, else 1.
    pub replicas: Option<usize>,
    /// How long a worker that stops answering may hold up uploads that
    /// must follow its earlier writes (once per outage).
    pub peer_order_wait: Duration,
    /// A copy's worker that makes no progress this long, and then does
    /// not answer a probe, is given up on (the next candidate takes it).
    pub replica_progress: Duration,
    /// How often a replica asks the primaries of the copies it holds
    /// about them; a copy younger than this is not asked about (its
    /// primary may still be syncing its own pages).
    pub replica_check: Duration,
    /// The worker joins a ring after it starts: uploads wait until it
    /// knows its peers, or a restarted worker's first uploads would skip
    /// the order checks against them.
    pub await_ring: bool,
    /// How long an upload part may wait while write-back bodies are being
    /// taken (see `give_way.rs`); zero: uploads never wait for writes.
    pub upload_give_way: Duration,
    /// How long bodies must have made no progress for uploads to go.
    pub upload_quiet: Duration,
    /// Bytes of spare page files kept at most for bodies' pages to be
    /// written over (see `spares.rs`); 0: none.
    pub spare_most: u64,
}

impl Default for WriteBackConfig {
    fn default() -> Self {
        Self {
            staging_limit: 16 << 30,
            stall_timeout: Duration::from_secs(600),
            parts_in_flight: 4,
            replicas: None,
            peer_order_wait: Duration::from_secs(30),
            replica_progress: Duration::from_secs(10),
            replica_check: Duration::from_secs(2),
            await_ring: false,
            upload_give_way: give_way::DEFAULT_MOST,
            upload_quiet: give_way::QUIET,
            spare_most: DEFAULT_SPARE_MOST,
        }
    }
}

/// The newest acknowledged state of one object that S3 does not have yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pending {
    Written {
        seq: u64,
        version: String,
        size: u64,
        acked_ms: i64,
        page_size: u64,
        user: lakecache_protocol::UserMeta,
    },
    Deleted {
        seq: u64,
    },
}

/// The entry [`WriteBack::pending`] shows for an object.
#[derive(Debug, Clone)]
struct Shown {
    pending: Pending,
    /// A copy of another worker's write (not this worker's own).
    copy: bool,
}

#[derive(Default)]
struct Overlay {
    latest: HashMap<String, Shown>,
    /// uri → how many journal entries of it are pending (own and copies):
    /// when the shown one goes while others remain, the newest of those
    /// is shown instead.
    entries: HashMap<String, usize>,
    /// (uri, cache version) → S3 ETag, for uploaded objects.
    aliases: HashMap<(String, String), String>,
    /// uri → (S3 ETag, cache version) of its latest upload.
    written_as: HashMap<String, (String, String)>,
    /// uri → the last write or delete of it this worker put in S3: a
    /// peer holding an older version must not land it after this one.
    landed: HashMap<String, UriWrite>,
}

/// Locks, when more than one is held, are taken in this order:
/// `in_flight`, `taken_over`, `journal`, `overlay`, `last_error`
/// (`silent_peers` is only ever held alone). Two paths that took
/// `journal` and `taken_over` in opposite orders deadlocked a worker.
pub struct WriteBack {
    pub(crate) config: WriteBackConfig,
    /// The identity of this directory (and its journal).
    pub(crate) id: String,
    /// `<cache_dir>/writeback`.
    dir: PathBuf,
    /// (uri, version) of bodies being taken: a replica asking about one
    /// must hear "pending", not "settled", before its record is written.
    in_flight: Mutex<HashSet<(String, String)>>,
    /// Journals of primaries whose disk is gone: their replica entries
    /// here are uploaded here.
    taken_over: Mutex<HashSet<String>>,
    /// Peers that stopped answering the uploader's order checks, since when.
    silent_peers: Mutex<HashMap<String, std::time::Instant>>,
    /// The store refused a conditional write as not implemented: uploads
    /// go without conditions from then on (said once).
    pub(crate) unconditional_only: std::sync::atomic::AtomicBool,
    pub(crate) pages: PageStore,
    journal: Mutex<Journal>,
    overlay: Mutex<Overlay>,
    /// Dirty bytes held (pending objects plus bodies being staged).
    dirty: AtomicU64,
    pub(crate) wake: Notify,
    /// Signalled after every upload, for writers waiting for space.
    pub(crate) drained: Notify,
    /// Bodies waiting for staging room now: the uploader stops holding
    /// uploads for a silent peer's order while any wait.
    room_waiters: std::sync::atomic::AtomicUsize,
    /// The uploader waits, for order, on a peer that does not answer.
    pub(crate) waits_on_silent_peer: std::sync::atomic::AtomicBool,
    uploaded: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// When a body being taken last started, staged a page or ended.
    take_activity: give_way::TakeActivity,
    /// Spare page files for bodies' pages, once kept (see [`Self::keep_spares`]).
    spares: std::sync::OnceLock<Arc<crate::spares::Spares>>,
}

/// A body counted as waiting for staging room (see [`WriteBack::wait_for_room`]).
pub(crate) struct RoomWait<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for RoomWait<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The directory's identity, made once: the journal is tied to it, so a
/// journal copied into another worker's directory is refused.
fn identity(dir: &Path) -> std::io::Result<String> {
    let path = dir.join("ID");
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => Ok(id.trim().to_string()),
        _ => {
            let id = uuid::Uuid::new_v4().simple().to_string();
            let tmp = dir.join(".ID.tmp");
            let mut file = std::fs::File::create(&tmp)?;
            crate::crashsim::created(&tmp)?;
            std::io::Write::write_all(&mut file, id.as_bytes())?;
            crate::crashsim::sync_file(&tmp, &file, || file.sync_all())?;
            crate::crashsim::rename(&tmp, &path, || std::fs::rename(&tmp, &path))?;
            crate::crashsim::sync_dir(dir, || std::fs::File::open(dir)?.sync_all())?;
            Ok(id)
        }
    }
}

impl WriteBack {
    /// Opens `<cache_dir>/writeback` and replays its journal.
    pub fn open(cache_dir: &Path, config: WriteBackConfig) -> Result<Self, JournalError> {
        let dir = cache_dir.join("writeback");
        let io = |source| JournalError::Io {
            path: dir.clone(),
            source,
        };
        mkdir_private(&dir).map_err(io)?;
        let id = identity(&dir).map_err(io)?;
        let journal = Journal::open(&dir, &id)?;
        let pages = PageStore::open(&dir).map_err(io)?;
        // `pages/` and `writeback/` themselves must survive a power loss
        // before the first write is acknowledged.
        for d in [&dir, cache_dir] {
            crate::crashsim::sync_dir(d, || std::fs::File::open(d)?.sync_all()).map_err(io)?;
        }
        let mut overlay = Overlay::default();
        let mut dirty = 0;
        for p in journal.pending() {
            overlay.show(p);
            dirty += p.size;
        }
        remove_orphans(&pages, &journal);
        if journal.pending().next().is_some() {
            tracing::info!(
                objects = journal.pending().count(),
                bytes = dirty,
                "write-back journal has pending uploads; resuming them"
            );
        }
        Ok(Self {
            config,
            id,
            dir,
            in_flight: Mutex::default(),
            taken_over: Mutex::default(),
            silent_peers: Mutex::default(),
            unconditional_only: Default::default(),
            pages,
            journal: Mutex::new(journal),
            overlay: Mutex::new(overlay),
            dirty: AtomicU64::new(dirty),
            room_waiters: Default::default(),
            waits_on_silent_peer: Default::default(),
            wake: Notify::new(),
            drained: Notify::new(),
            uploaded: AtomicU64::new(0),
            last_error: Mutex::new(None),
            take_activity: Default::default(),
            spares: Default::default(),
        })
    }

    /// The pending state of `uri`, if S3 is behind what was acknowledged.
    pub fn pending(&self, uri: &str) -> Option<Pending> {
        lock(&self.overlay)
            .latest
            .get(uri)
            .map(|s| s.pending.clone())
    }

    /// The S3 ETag an uploaded cache version became.
    pub fn alias(&self, uri: &str, version: &str) -> Option<String> {
        lock(&self.overlay)
            .aliases
            .get(&(uri.to_string(), version.to_string()))
            .cloned()
    }

    /// The cache version whose upload became `etag` of `uri`, if known.
    pub fn written_as(&self, uri: &str, etag: &str) -> Option<String> {
        lock(&self.overlay)
            .written_as
            .get(uri)
            .filter(|(e, _)| e == etag)
            .map(|(_, version)| version.clone())
    }

    /// Pending writes under `prefix` (an `s3://bucket/...` string), for
    /// listings: (uri, state).
    pub fn pending_under(&self, prefix: &str) -> Vec<(String, Pending)> {
        lock(&self.overlay)
            .latest
            .iter()
            .filter(|(uri, _)| uri.starts_with(prefix))
            .map(|(u, s)| (u.clone(), s.pending.clone()))
            .collect()
    }

    /// Records an acknowledged write or delete; returns once the journal
    /// has it on disk. Blocking.
    pub(crate) fn record(&self, object: PendingObject) -> Result<u64, JournalError> {
        let mut journal = lock(&self.journal);
        let uri = object.uri.clone();
        let seq = journal.add_pending(object.clone())?;
        let mut object = object;
        object.seq = seq;
        debug_assert_eq!(object.uri, uri);
        lock(&self.overlay).show(&object);
        drop(journal);
        self.wake.notify_one();
        Ok(seq)
    }

    /// The oldest pending entry this worker uploads, which the uploader
    /// handles next: its own, and copies of primaries that lost their disk.
    pub(crate) fn next_pending(&self) -> Option<PendingObject> {
        let taken_over = lock(&self.taken_over);
        lock(&self.journal)
            .pending()
            .find(|p| !held_for_primary(p, &taken_over))
            .cloned()
    }

    /// Copies of other workers' writes this worker is holding (not taken
    /// over).
    pub(crate) fn replica_entries(&self) -> Vec<PendingObject> {
        let taken_over = lock(&self.taken_over);
        lock(&self.journal)
            .pending()
            .filter(|p| held_for_primary(p, &taken_over))
            .cloned()
            .collect()
    }

    /// The primary with journal `journal_id` lost it: its copies here are
    /// uploaded here, in the order they arrived.
    pub(crate) fn take_over(&self, primary: &ReplicaOf) {
        if lock(&self.taken_over).insert(primary.journal_id.clone()) {
            tracing::warn!(
                primary = %primary.addr,
                journal = %primary.journal_id,
                "a primary's write-back journal is gone; uploading the copies of its writes held here"
            );
            self.wake.notify_one();
        }
    }

    pub(crate) fn silent_peers(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, std::time::Instant>> {
        lock(&self.silent_peers)
    }

    /// Where the newest pending write of `uri` (taken here as primary)
    /// has its copies.
    pub(crate) fn replicas_of_pending(&self, uri: &str) -> Vec<String> {
        lock(&self.journal)
            .pending()
            .filter(|p| p.uri == uri && !p.delete && p.replica_of.is_none())
            .last()
            .map(|p| p.replicas.clone())
            .unwrap_or_default()
    }

    /// Whether `copy` is a replica entry this worker now uploads.
    pub(crate) fn is_taken_over(&self, copy: &PendingObject) -> bool {
        copy.replica_of
            .as_ref()
            .is_some_and(|r| lock(&self.taken_over).contains(&r.journal_id))
    }

    /// Marks a body as being taken until the returned guard drops.
    pub(crate) fn taking(self: &Arc<Self>, uri: &str, version: &str) -> InFlight {
        let key = (uri.to_string(), version.to_string());
        lock(&self.in_flight).insert(key.clone());
        self.take_activity.note();
        InFlight {
            wb: self.clone(),
            key,
        }
    }

    /// What this worker knows of `version` of `uri`, for a replica.
    pub fn entry_state(&self, uri: &str, version: &str) -> EntryState {
        let key = (uri.to_string(), version.to_string());
        if lock(&self.in_flight).contains(&key) {
            return EntryState::Pending;
        }
        let journal = lock(&self.journal);
        let pending = journal
            .pending()
            .any(|p| p.uri == uri && p.version == version && p.replica_of.is_none());
        if pending {
            EntryState::Pending
        } else {
            EntryState::Settled
        }
    }

    /// Records that the primary confirmed this worker's copy of `version`
    /// of `uri`; false where no such copy is held. Blocking.
    pub(crate) fn confirm_copy(&self, uri: &str, version: &str) -> Result<bool, JournalError> {
        let mut journal = lock(&self.journal);
        let copy = journal
            .pending()
            .find(|p| p.uri == uri && p.version == version && p.replica_of.is_some())
            .cloned();
        let Some(mut copy) = copy else {
            return Ok(false);
        };
        journal.confirm(copy.seq)?;
        // Acknowledged now: readers here may see it.
        copy.unconfirmed = false;
        lock(&self.overlay).show_if_newer(&copy);
        Ok(true)
    }

    /// The replica entry for `version` of `uri`, if this worker holds one.
    pub(crate) fn replica_entry(&self, uri: &str, version: &str) -> Option<PendingObject> {
        lock(&self.journal)
            .pending()
            .find(|p| p.uri == uri && p.version == version && p.replica_of.is_some())
            .cloned()
    }

    /// Whether a later acknowledged entry of the same object replaces
    /// this one (its upload can be skipped: S3 ends the same).
    /// A copy of another worker's write never supersedes: it may never be
    /// confirmed (its write failed), and its primary uploads it in order.
    pub(crate) fn superseded(&self, object: &PendingObject) -> bool {
        lock(&self.overlay)
            .latest
            .get(&object.uri)
            .is_some_and(|s| !s.copy && s.pending.seq() > object.seq)
    }

    /// The writes of `uri` this worker uploads (pending) or last put in
    /// S3, for a peer about to upload its own version of `uri`. Copies
    /// held for a live primary are its primary's to report, and a copy
    /// never confirmed was never acknowledged.
    pub fn writes_of(&self, uri: &str) -> Vec<UriWrite> {
        // Lock order (see `WriteBack`): taken_over, journal, overlay.
        let taken_over = lock(&self.taken_over);
        let journal = lock(&self.journal);
        let mut writes: Vec<UriWrite> = journal
            .pending()
            .filter(|p| p.uri == uri && !held_for_primary(p, &taken_over))
            .filter(|p| !(p.replica_of.is_some() && p.unconfirmed))
            .map(|p| self.stamp(p, true))
            .collect();
        writes.extend(lock(&self.overlay).landed.get(uri).cloned());
        writes
    }

    fn stamp(&self, p: &PendingObject, pending: bool) -> UriWrite {
        UriWrite {
            acked_ms: p.acked_ms,
            journal_id: self.id.clone(),
            version: p.version.clone(),
            pending,
        }
    }

    /// S3 has the entry (`etag` empty for deletes and skipped entries;
    /// `landed`: this worker put it there, not skipped it). Blocking.
    pub(crate) fn finished(
        &self,
        object: &PendingObject,
        etag: &str,
        landed: bool,
    ) -> Result<(), JournalError> {
        // The journal stays locked until the overlay says where the entry
        // went: a peer asking in between would otherwise find neither.
        let mut journal = lock(&self.journal);
        journal.mark_uploaded(object.seq, etag)?;
        let mut overlay = lock(&self.overlay);
        if landed {
            if overlay.landed.len() >= MAX_ALIASES {
                overlay.landed.clear();
            }
            let stamp = self.stamp(object, false);
            let newest = overlay
                .landed
                .entry(object.uri.clone())
                .or_insert_with(|| stamp.clone());
            if stamp.stamp() > newest.stamp() {
                *newest = stamp;
            }
        }
        let remaining = match overlay.entries.get_mut(&object.uri) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => 0,
        };
        if remaining == 0 {
            overlay.entries.remove(&object.uri);
        }
        if overlay
            .latest
            .get(&object.uri)
            .is_some_and(|s| s.pending.seq() == object.seq)
        {
            overlay.latest.remove(&object.uri);
            // Another entry of the object is still pending here (this
            // worker's own write beside a copy that was just dropped):
            // it is what readers see now.
            if remaining > 0 {
                let newest = journal
                    .pending()
                    .filter(|p| p.uri == object.uri && p.seq != object.seq)
                    .max_by_key(|p| p.seq)
                    .cloned();
                if let Some(p) = newest {
                    overlay.latest.insert(
                        p.uri.clone(),
                        Shown {
                            pending: Pending::from_record(&p),
                            copy: p.replica_of.is_some(),
                        },
                    );
                }
            }
        }
        if !object.delete && !etag.is_empty() {
            if overlay.aliases.len() >= MAX_ALIASES {
                overlay.aliases.clear();
                overlay.written_as.clear();
            }
            overlay.written_as.insert(
                object.uri.clone(),
                (etag.to_string(), object.version.clone()),
            );
            overlay
                .aliases
                .insert((object.uri.clone(), object.version.clone()), etag.into());
        }
        drop(overlay);
        drop(journal);
        // A dropped copy is not an upload of this worker's.
        if !held_for_primary(object, &lock(&self.taken_over)) {
            self.uploaded.fetch_add(1, Ordering::Relaxed);
            *lock(&self.last_error) = None;
        }
        Ok(())
    }

    pub(crate) fn set_error(&self, error: Option<String>) {
        *lock(&self.last_error) = error;
    }

    /// Counts `len` dirty bytes if they fit under the staging limit.
    pub(crate) fn try_reserve(&self, len: u64) -> bool {
        self.dirty
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                (d + len <= self.config.staging_limit).then_some(d + len)
            })
            .is_ok()
    }

    pub(crate) fn release(&self, len: u64) {
        let _ = self
            .dirty
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                Some(d.saturating_sub(len))
            });
        self.drained.notify_waiters();
    }

    /// Counts a body waiting for staging room until the guard drops.
    pub(crate) fn wait_for_room(&self) -> RoomWait<'_> {
        self.room_waiters.fetch_add(1, Ordering::AcqRel);
        RoomWait(&self.room_waiters)
    }

    /// Whether some body is waiting for staging room now.
    pub(crate) fn writers_wait_for_room(&self) -> bool {
        self.room_waiters.load(Ordering::Acquire) > 0
    }

    pub fn dirty_bytes(&self) -> u64 {
        self.dirty.load(Ordering::Relaxed)
    }

    /// Backlog under `prefix` (all of it when empty).
    pub fn status(&self, prefix: &str) -> WriteBackStatus {
        // Lock order (see `WriteBack`): taken_over before journal.
        let taken_over = lock(&self.taken_over);
        let journal = lock(&self.journal);
        let now = now_ms();
        let mut status = WriteBackStatus {
            staging_limit_bytes: self.config.staging_limit,
            staging_used_bytes: self.dirty_bytes(),
            spare_bytes: self.spares.get().map_or(0, |s| s.bytes()),
            uploaded_objects: self.uploaded.load(Ordering::Relaxed),
            last_error: lock(&self.last_error).clone(),
            ..Default::default()
        };
        status.journal_id = self.id.clone();
        status.next_upload_waits_on_silent_peer = self.waits_on_silent_peer.load(Ordering::Acquire);
        for p in journal.pending().filter(|p| p.uri.starts_with(prefix)) {
            let held_for_primary = held_for_primary(p, &taken_over);
            if !held_for_primary && status.next_upload_acked_ms.is_none() {
                status.next_upload_acked_ms = Some(p.acked_ms);
            }
            if held_for_primary {
                status.replica_objects += 1;
                status.replica_bytes += p.size;
                continue;
            }
            status.pending_objects += 1;
            status.pending_bytes += p.size;
            let age = now.saturating_sub(p.acked_ms).max(0) as u64;
            status.oldest_pending_ms = status.oldest_pending_ms.max(age);
        }
        status
    }

    /// Bytes `tenant` wrote that are acknowledged and not yet in S3.
    pub fn pending_bytes_of_tenant(&self, tenant: &str) -> u64 {
        let journal = lock(&self.journal);
        journal
            .pending()
            .filter(|p| p.replica_of.is_none() && p.tenant.as_deref() == Some(tenant))
            .map(|p| p.size)
            .sum()
    }

    /// [`Self::pending_bytes_of_tenant`] for every tenant with some.
    pub fn pending_bytes_by_tenant(&self) -> Vec<(String, u64)> {
        let journal = lock(&self.journal);
        let mut by: std::collections::BTreeMap<String, u64> = Default::default();
        for p in journal.pending().filter(|p| p.replica_of.is_none()) {
            if let Some(t) = &p.tenant {
                *by.entry(t.clone()).or_default() += p.size;
            }
        }
        by.into_iter().collect()
    }

    /// Where dirty page `index` of a pending version lives.
    pub(crate) fn page_key(uri: &str, version: &str, index: u64) -> PageKey {
        PageKey::new(uri, version, index)
    }

    pub(crate) fn page_id(object: &PendingObject, index: u64) -> PageId {
        PageId::new(
            &object.uri,
            &object.version,
            index,
            object.page_size,
            object.size,
        )
    }

    pub fn dir(cache_dir: &Path) -> PathBuf {
        cache_dir.join("writeback")
    }
}

/// A copy of another worker's write that this worker only holds (its
/// primary uploads it): not taken over.
fn held_for_primary(p: &PendingObject, taken_over: &HashSet<String>) -> bool {
    p.replica_of
        .as_ref()
        .is_some_and(|r| !taken_over.contains(&r.journal_id))
}

/// Dirty pages no pending entry names: a write that crashed before its
/// journal record (never acknowledged), or an upload that finished
/// before its pages moved. Removed at start.
fn remove_orphans(pages: &PageStore, journal: &Journal) {
    let wanted: std::collections::HashSet<PathBuf> = journal
        .pending()
        .filter(|p| !p.delete)
        .flat_map(|p| {
            (0..p.size.div_ceil(p.page_size.max(1)))
                .map(move |i| pages.path(&WriteBack::page_key(&p.uri, &p.version, i)))
        })
        .collect();
    let mut removed = 0u64;
    for path in pages.all_pages() {
        if !wanted.contains(&path) && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(
            pages = removed,
            "removed dirty pages no pending write names"
        );
    }
}

impl Overlay {
    /// Counts a newly pending entry and shows it, unless it is a copy of
    /// another worker's write that must not hide the entry shown: one not
    /// confirmed yet (its write may still fail, as one the client gave up
    /// on and its primary then fenced), or one older than a write shown.
    fn show(&mut self, p: &PendingObject) {
        *self.entries.entry(p.uri.clone()).or_default() += 1;
        self.show_if_newer(p);
    }

    /// [`Self::show`] without counting: for a copy now confirmed.
    fn show_if_newer(&mut self, p: &PendingObject) {
        let copy = p.replica_of.is_some();
        if copy {
            match self.latest.get(&p.uri) {
                None => {}
                Some(_) if p.unconfirmed => return,
                Some(Shown {
                    pending: Pending::Written { acked_ms, .. },
                    ..
                }) if *acked_ms > p.acked_ms => return,
                Some(_) => {}
            }
        }
        self.latest.insert(
            p.uri.clone(),
            Shown {
                pending: Pending::from_record(p),
                copy,
            },
        );
    }
}

impl Pending {
    fn from_record(p: &PendingObject) -> Self {
        if p.delete {
            Pending::Deleted { seq: p.seq }
        } else {
            Pending::Written {
                seq: p.seq,
                version: p.version.clone(),
                size: p.size,
                acked_ms: p.acked_ms,
                page_size: p.page_size,
                user: p.meta.clone(),
            }
        }
    }

    pub fn seq(&self) -> u64 {
        match self {
            Pending::Written { seq, .. } | Pending::Deleted { seq } => *seq,
        }
    }
}

/// A body being taken (see [`WriteBack::taking`]).
pub(crate) struct InFlight {
    wb: Arc<WriteBack>,
    key: (String, String),
}

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.wb.in_flight).remove(&self.key);
        self.wb.take_activity.note();
    }
}

/// Shared handle, as the cache holds it.
pub type SharedWriteBack = Arc<WriteBack>;

#[cfg(test)]
mod lock_order_tests {
    use super::*;

    fn entry(uri: &str, replica_of: Option<ReplicaOf>) -> PendingObject {
        PendingObject {
            seq: 0,
            uri: uri.into(),
            version: format!("{VERSION_PREFIX}{uri}"),
            size: 1,
            part_size: 8 << 20,
            part_crcs: vec![0],
            acked_ms: 1,
            page_size: 4 << 20,
            delete: false,
            replica_of,
            unconfirmed: false,
            replicas: Vec::new(),
            meta: Default::default(),
            tenant: None,
        }
    }

    /// What a peer about to upload its own version of an object hears:
    /// this worker's own pending writes of it, then its last upload, and
    /// never a copy held for a live primary (that primary reports it).
    #[test]
    fn writes_of_an_object_name_own_writes_and_the_last_upload_only() {
        let dir = tempfile::tempdir().unwrap();
        let wb = WriteBack::open(dir.path(), WriteBackConfig::default()).unwrap();
        let primary = ReplicaOf {
            journal_id: "elsewhere".into(),
            addr: "127.0.0.1:1".into(),
        };
        let mut copy = entry("s3://b/k", Some(primary));
        copy.version = format!("{VERSION_PREFIX}copy");
        wb.record(copy).unwrap();
        assert_eq!(wb.writes_of("s3://b/k"), Vec::new());
        let mut own = entry("s3://b/k", None);
        own.acked_ms = 7;
        let seq = wb.record(own.clone()).unwrap();
        own.seq = seq;
        let pending = wb.writes_of("s3://b/k");
        assert_eq!(pending.len(), 1);
        assert!(pending[0].pending && pending[0].acked_ms == 7 && pending[0].journal_id == wb.id);
        assert_eq!(wb.writes_of("s3://b/other"), Vec::new());
        wb.finished(&own, "etag-1", true).unwrap();
        let landed = wb.writes_of("s3://b/k");
        assert_eq!(landed.len(), 1);
        assert!(!landed[0].pending && landed[0].version == own.version);
        // An entry skipped as superseded did not land: nothing to report.
        let mut skipped = entry("s3://b/s", None);
        skipped.seq = wb.record(skipped.clone()).unwrap();
        wb.finished(&skipped, "", false).unwrap();
        assert_eq!(wb.writes_of("s3://b/s"), Vec::new());
    }

    /// A copy of another worker's write of an object this worker also
    /// holds its own acknowledged write of (the client gave up on the
    /// other worker, which then sent its copy late, and will drop it):
    /// an older copy never hides the own write, no copy makes the own
    /// write count as superseded (it would never be uploaded once the
    /// copy is dropped), and dropping a shown copy shows the own write
    /// again rather than nothing.
    #[test]
    fn a_copy_never_hides_or_supersedes_this_workers_own_write() {
        let dir = tempfile::tempdir().unwrap();
        let wb = WriteBack::open(dir.path(), WriteBackConfig::default()).unwrap();
        let primary = ReplicaOf {
            journal_id: "elsewhere".into(),
            addr: "127.0.0.1:1".into(),
        };
        let shown = |wb: &WriteBack| match wb.pending("s3://b/k") {
            Some(Pending::Written { version, .. }) => Some(version),
            _ => None,
        };
        let mut own = entry("s3://b/k", None);
        own.version = format!("{VERSION_PREFIX}own");
        own.acked_ms = 2_000;
        own.seq = wb.record(own.clone()).unwrap();
        for (acked_ms, name) in [(1_000, "older"), (3_000, "newer")] {
            let mut copy = entry("s3://b/k", Some(primary.clone()));
            copy.version = format!("{VERSION_PREFIX}{name}");
            copy.acked_ms = acked_ms;
            copy.unconfirmed = true;
            copy.seq = wb.record(copy.clone()).unwrap();
            // Not acknowledged yet: it hides nothing.
            assert_eq!(
                shown(&wb),
                Some(own.version.clone()),
                "{name} copy recorded"
            );
            assert!(wb.confirm_copy("s3://b/k", &copy.version).unwrap());
            let want = if acked_ms > own.acked_ms {
                &copy.version
            } else {
                &own.version
            };
            assert_eq!(shown(&wb).as_ref(), Some(want), "{name} copy confirmed");
            assert!(!wb.superseded(&own), "{name} copy superseded the own write");
            // What drop_replica does with a copy never confirmed.
            wb.finished(&copy, "", false).unwrap();
            assert_eq!(shown(&wb), Some(own.version.clone()), "{name} copy dropped");
        }
        // A newer own write does supersede, and once both are done
        // nothing is shown.
        let mut newer = entry("s3://b/k", None);
        newer.version = format!("{VERSION_PREFIX}own-2");
        newer.acked_ms = 4_000;
        newer.seq = wb.record(newer.clone()).unwrap();
        assert!(wb.superseded(&own));
        wb.finished(&own, "", false).unwrap();
        assert_eq!(shown(&wb), Some(newer.version.clone()));
        wb.finished(&newer, "etag", true).unwrap();
        assert_eq!(shown(&wb), None);
    }

    /// A peer's `GET /v1/writeback` (status) runs on one thread while the
    /// uploader looks for its next entry on another. Both take the journal
    /// and the taken-over set; taken in opposite orders, the two threads
    /// deadlocked, and with them the runtime threads every later request
    /// waited on (a worker that answered nothing, seen under load in the
    /// disk-loss test of cli/tests/mount/writeback.rs).
    #[test]
    fn status_and_the_uploader_never_deadlock() {
        let dir = tempfile::tempdir().unwrap();
        let wb = Arc::new(WriteBack::open(dir.path(), WriteBackConfig::default()).unwrap());
        let primary = ReplicaOf {
            journal_id: "gone".into(),
            addr: "127.0.0.1:1".into(),
        };
        wb.record(entry("s3://b/own", None)).unwrap();
        wb.record(entry("s3://b/copy", Some(primary.clone())))
            .unwrap();
        wb.take_over(&primary);
        let rounds = 200_000;
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let status_side = {
            let (wb, done) = (wb.clone(), done_tx.clone());
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    std::hint::black_box(wb.status(""));
                }
                let _ = done.send("status");
            })
        };
        let uploader_side = {
            let wb = wb.clone();
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    std::hint::black_box(wb.next_pending());
                    std::hint::black_box(wb.replica_entries());
                }
                let _ = done_tx.send("uploader");
            })
        };
        // Both sides together finished in 1.1 s (debug build, 2 cores
        // beside a CPU and disk hog); a deadlock never does.
        for _ in 0..2 {
            let finished = done_rx.recv_timeout(Duration::from_secs(60));
            assert!(
                finished.is_ok(),
                "status and the uploader deadlocked on the write-back locks"
            );
        }
        status_side.join().unwrap();
        uploader_side.join().unwrap();
    }
}
