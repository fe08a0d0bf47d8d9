//! Taking a write-back body: pages to disk, synced, then one journal
//! record. Only after that record is synced does the caller hear "ok".

use std::collections::{BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use lakecache_protocol::{buffer_pool, ObjectUri, UserMeta};
use tokio::task::JoinHandle;

use super::copies::Copies;
use super::page_crcs::{CloseOnDrop, PageCrcs};
use super::{now_ms, WriteBack, VERSION_PREFIX};
use crate::cache::{join_failed, Cache, CacheError};
use crate::journal::{PendingObject, ReplicaOf};
use crate::pages::Staged;
use crate::store::ObjectMeta;
use crate::write::fill_page;

/// S3 allows this many parts in one multipart upload.
const MAX_PARTS: u64 = 10_000;

/// Dirty pages written at once: each goes to disk with O_DIRECT, which
/// waits for the device, so a few in flight keep the body streaming in.
const STAGING_IN_FLIGHT: usize = 4;

/// Written pages being put into place at once, beside the writes.
const PLACING_IN_FLIGHT: usize = 8;

/// Whose write a body is.
#[derive(Debug, Clone)]
pub enum WriteRole {
    /// A client's write: this worker uploads it, after copying it to the
    /// next workers of the ring.
    Primary,
    /// A copy of a write another worker takes as primary; `confirm`: the
    /// primary confirms it once acknowledged (until then it is held as
    /// unconfirmed).
    Replica {
        version: String,
        of: ReplicaOf,
        confirm: bool,
    },
}

/// How a body's pages reach the disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Staging {
    /// `O_DIRECT` from the buffers the body arrives in: no copy, for
    /// bodies streamed over HTTP, where the CPU is the limit.
    #[default]
    Direct,
    /// Through the page cache (see `PageStore::stage_buffered_for_sync`),
    /// for a local file committed by a mount on this host.
    Buffered,
}

/// The user metadata a body is recorded with.
#[derive(Debug, Clone, Default)]
pub struct BodyMeta {
    /// Known when the body starts: sent with its copies.
    pub user: UserMeta,
    /// Set by the time the body ends, for a body that started before
    /// its metadata was final (a followed local commit): recorded
    /// instead of `user`, unless copies already took `user`.
    pub late: Option<Arc<OnceLock<UserMeta>>>,
    /// Told each page's CRC32C as it is written (a followed body checks
    /// the pages it took early against them), and closed when the body's
    /// stage ends.
    pub page_crcs: Option<Arc<PageCrcs>>,
}

impl From<UserMeta> for BodyMeta {
    fn from(user: UserMeta) -> Self {
        Self {
            user,
            late: None,
            page_crcs: None,
        }
    }
}

/// A page of a body on disk: staged, to be labelled, synced and moved
/// into place at the commit, or already `placed` there (a whole page
/// written directly, see [`PageStore::place_synced`]), its staged file
/// gone and only its CRCs kept.
///
/// [`PageStore::place_synced`]: crate::pages::PageStore::place_synced
struct TakenPage {
    staged: Staged,
    index: u64,
    placed: bool,
}

/// The object whose whole pages are placed as they are written.
struct PlaceAs {
    wb: Arc<WriteBack>,
    uri: String,
    version: String,
    page_size: u64,
}

/// What a body holds while it streams in.
#[derive(Default)]
struct Taken {
    io: Staging,
    pages: Vec<TakenPage>,
    /// Pages being written, oldest first (at most [`STAGING_IN_FLIGHT`]).
    staging: VecDeque<JoinHandle<std::io::Result<TakenPage>>>,
    /// The next page's index in the body (pages staged so far).
    next_index: u64,
    /// Set where whole pages go into place as soon as they are written.
    place: Option<Arc<PlaceAs>>,
    /// Written pages being put into place, oldest first (at most
    /// [`PLACING_IN_FLIGHT`]); apart from the writes, whose slots would
    /// otherwise wait for each page's sync.
    placing: VecDeque<JoinHandle<std::io::Result<TakenPage>>>,
    /// Where each written page's CRC32C goes (see [`BodyMeta::page_crcs`]).
    crcs_to: Option<Arc<PageCrcs>>,
    reserved: u64,
    size: u64,
    whole_crc: u32,
    part_crcs: Vec<u32>,
    part_filled: u64,
}

impl Cache {
    pub(crate) fn write_back_state(&self) -> Result<&Arc<WriteBack>, CacheError> {
        self.writeback
            .as_ref()
            .ok_or_else(|| CacheError::Invalid("this worker has write-back turned off".into()))
    }

    /// Takes `body` as the new content of `uri` and returns once it is
    /// durable in this worker's cache: dirty pages synced, journal record
    /// synced. `client_crc` is the trailer the client sent after the body
    /// (CRC32C of all of it), checked before anything is recorded.
    pub async fn write_back<S>(
        self: &Arc<Self>,
        uri: &ObjectUri,
        body: S,
        client_crc: Arc<OnceLock<u32>>,
        role: WriteRole,
        user: UserMeta,
    ) -> Result<ObjectMeta, CacheError>
    where
        S: Stream<Item = Result<Bytes, CacheError>> + Send + Unpin,
    {
        self.write_back_staged(uri, body, client_crc, role, user.into(), Staging::Direct)
            .await
    }

    /// [`Self::write_back`], with the body's pages staged as `io` says.
    pub async fn write_back_staged<S>(
        self: &Arc<Self>,
        uri: &ObjectUri,
        body: S,
        client_crc: Arc<OnceLock<u32>>,
        role: WriteRole,
        meta: BodyMeta,
        io: Staging,
    ) -> Result<ObjectMeta, CacheError>
    where
        S: Stream<Item = Result<Bytes, CacheError>> + Send + Unpin,
    {
        let wb = self.write_back_state()?.clone();
        let (version, replica_of, unconfirmed) = match role {
            WriteRole::Primary => (
                format!("{VERSION_PREFIX}{}", uuid::Uuid::new_v4().simple()),
                None,
                false,
            ),
            WriteRole::Replica {
                version,
                of,
                confirm,
            } => (version, Some(of), confirm),
        };
        // A directly written page is on the disk once written: labelling,
        // syncing and moving it then (not all at the body's end) takes
        // that work off the writer's wait for the commit. A page written
        // through the page cache (a local commit) would wait in its sync
        // for its own writeback; those are synced together at the end.
        let place = (io == Staging::Direct).then(|| {
            Arc::new(PlaceAs {
                wb: wb.clone(),
                uri: uri.to_string(),
                version: version.clone(),
                page_size: self.config.page_size,
            })
        });
        let _crcs_closed = meta.page_crcs.clone().map(CloseOnDrop);
        let mut taken = Taken {
            io,
            place,
            crcs_to: meta.page_crcs.clone(),
            ..Taken::default()
        };
        let _taking = wb.taking(&uri.to_string(), &version);
        let mut copies = match replica_of {
            None => self.start_copies(&wb, uri, &version, &meta.user)?,
            Some(_) => Copies::none(),
        };
        let mut result = self
            .take_body(
                &wb,
                uri,
                &version,
                body,
                &client_crc,
                &mut taken,
                &mut copies,
            )
            .await;
        if let Ok(object) = &mut result {
            object.replica_of = replica_of;
            object.unconfirmed = unconfirmed;
            object.meta = meta.user;
            let late = meta.late.as_ref().and_then(|m| m.get());
            if let Some(late) = late.filter(|late| **late != object.meta) {
                if copies.any() {
                    result = Err(CacheError::Invalid(
                        "the file's metadata changed after its copies started; nothing was recorded".into(),
                    ));
                } else {
                    object.meta = late.clone();
                }
            }
        }
        if result.is_err() {
            copies.abort().await;
        }
        let result = match result {
            Ok(object) => self.make_durable(&wb, object, &mut taken, copies).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(meta) => Ok(meta),
            Err(e) => {
                // Pages still being written or placed are removed with
                // the rest (a page whose placing failed left nothing).
                while let Some(task) = taken.staging.pop_front() {
                    if let Ok(Ok(page)) = task.await {
                        taken.pages.push(page);
                    }
                }
                while let Some(task) = taken.placing.pop_front() {
                    if let Ok(Ok(page)) = task.await {
                        taken.pages.push(page);
                    }
                }
                let pages = std::mem::take(&mut taken.pages);
                let (wb2, key, version) = (wb.clone(), uri.to_string(), version.clone());
                let _ = tokio::task::spawn_blocking(move || {
                    for page in pages {
                        if page.placed {
                            wb2.pages
                                .remove(&WriteBack::page_key(&key, &version, page.index));
                        } else {
                            wb2.pages.discard_staged(page.staged);
                        }
                    }
                })
                .await;
                wb.release(taken.reserved);
                // A refused follow (expected of header-patching writers)
                // is logged once, by the local commit that asked for it.
                if !matches!(e, CacheError::FollowedFileChanged(_)) {
                    tracing::warn!(%uri, error = %e, "write-back failed; nothing was acknowledged");
                }
                Err(e)
            }
        }
    }

    /// Stages the body as dirty pages (not yet synced), forwarding it to
    /// the copies, and checks the client's CRC32C.
    #[allow(clippy::too_many_arguments)]
    async fn take_body<S>(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        uri: &ObjectUri,
        version: &str,
        mut body: S,
        client_crc: &OnceLock<u32>,
        taken: &mut Taken,
        copies: &mut Copies,
    ) -> Result<PendingObject, CacheError>
    where
        S: Stream<Item = Result<Bytes, CacheError>> + Send + Unpin,
    {
        let ps = self.config.page_size as usize;
        let part_size = self.config.part_size.max(5 << 20);
        let deadline = Instant::now() + wb.config.stall_timeout;
        // Pages are assembled in aligned buffers: they go to disk with
        // O_DIRECT straight from there.
        let mut page = buffer_pool::take(ps);
        // Parts of whole pages: their CRCs come from the pages' block
        // CRCs, with no further pass over the bytes.
        let whole_pages_per_part = part_size.is_multiple_of(ps as u64);
        let mut closing = self.closing.subscribe();
        loop {
            let chunk = tokio::select! {
                chunk = body.next() => chunk,
                _ = closing.wait_for(|c| *c) => return Err(CacheError::ShuttingDown),
            };
            let Some(chunk) = chunk else { break };
            let chunk = chunk?;
            if whole_pages_per_part {
                taken.size += chunk.len() as u64;
            } else {
                taken.add_crcs(&chunk, part_size);
            }
            copies
                .send(&chunk, wb.config.replica_progress, self.peers.health())
                .await;
            if taken.size.div_ceil(part_size) > MAX_PARTS {
                return Err(CacheError::Invalid(format!(
                    "write-back holds objects up to {} bytes ({MAX_PARTS} parts of {part_size}); write larger ones through",
                    MAX_PARTS * part_size
                )));
            }
            // A whole aligned page (a local commit reads the file so):
            // to disk as it is, without a copy.
            if page.is_empty()
                && chunk.len() == ps
                && (chunk.as_ptr() as usize).is_multiple_of(buffer_pool::ALIGN)
            {
                self.stage_dirty(wb, chunk, deadline, taken).await?;
                continue;
            }
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                if let Some(full) = fill_page(&mut page, ps, &mut rest) {
                    self.stage_dirty(wb, full, deadline, taken).await?;
                }
            }
        }
        if !page.is_empty() {
            self.stage_dirty(wb, buffer_pool::freeze(page), deadline, taken)
                .await?;
        }
        while !taken.staging.is_empty() {
            taken.settle_oldest().await?;
        }
        while !taken.placing.is_empty() {
            taken.settle_placing().await?;
        }
        taken.pages.sort_unstable_by_key(|page| page.index);
        if whole_pages_per_part {
            taken.crcs_from_pages(part_size);
        }
        if let Some(sent) = client_crc.get() {
            if *sent != taken.whole_crc {
                return Err(CacheError::ChecksumMismatch(format!(
                    "the body's CRC32C is {:08x}, the client sent {sent:08x}; nothing was stored",
                    taken.whole_crc
                )));
            }
        }
        Ok(PendingObject {
            seq: 0,
            uri: uri.to_string(),
            version: version.to_string(),
            size: taken.size,
            part_size,
            part_crcs: std::mem::take(&mut taken.part_crcs),
            acked_ms: now_ms(),
            page_size: self.config.page_size,
            delete: false,
            replica_of: None,
            unconfirmed: false,
            replicas: Vec::new(),
            meta: UserMeta::new(),
            tenant: crate::tenant::current().map(|t| t.to_string()),
        })
    }

    /// Syncs the staged pages, waits for the copies, then records the
    /// object in the journal: the point where the write is acknowledged.
    async fn make_durable(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        mut object: PendingObject,
        taken: &mut Taken,
        copies: Copies,
    ) -> Result<ObjectMeta, CacheError> {
        let pages = std::mem::take(&mut taken.pages);
        let (wb2, record) = (wb.clone(), object.clone());
        tokio::task::spawn_blocking(move || -> Result<(), CacheError> {
            let dirs = commit_pages(&wb2, &record, pages).inspect_err(|_| {
                remove_pages(&wb2, &record, record.size.div_ceil(record.page_size.max(1)));
            })?;
            let synced = wb2
                .pages
                .sync_dirs(&dirs)
                .map_err(|e| CacheError::Local(format!("syncing dirty page directories: {e}")));
            if synced.is_err() {
                remove_pages(&wb2, &record, record.size.div_ceil(record.page_size.max(1)));
            }
            synced
        })
        .await
        .map_err(join_failed)??;
        let unrecorded = |wb: &Arc<WriteBack>, object: &PendingObject| {
            let (wb, object) = (wb.clone(), object.clone());
            tokio::task::spawn_blocking(move || {
                remove_pages(&wb, &object, object.size.div_ceil(object.page_size.max(1)));
            })
        };
        object.replicas = match self.finish_copies(wb, &object, copies).await {
            Ok(held) => held,
            Err(e) => {
                let _ = unrecorded(wb, &object).await;
                return Err(e);
            }
        };
        // The commit: a write its client gave up on is not recorded.
        if let Err(e) = crate::fence::check() {
            let _ = unrecorded(wb, &object).await;
            self.forget_copies(&object, &object.replicas);
            return Err(e);
        }
        let (wb2, record) = (wb.clone(), object.clone());
        let recorded = tokio::task::spawn_blocking(move || wb2.record(record))
            .await
            .map_err(join_failed)?
            .map_err(|e| CacheError::Local(e.to_string()));
        let seq = match recorded {
            Ok(seq) => seq,
            Err(e) => {
                let _ = unrecorded(wb, &object).await;
                self.forget_copies(&object, &object.replicas);
                return Err(e);
            }
        };
        tracing::debug!(uri = %object.uri, seq, size = object.size, "write-back recorded");
        // Only now may the copies count as copies of an acknowledged write.
        self.confirm_copies(&object).await?;
        // The reservation now belongs to the pending object.
        taken.reserved = 0;
        Ok(ObjectMeta {
            size: object.size,
            etag: object.version,
            last_modified_ms: object.acked_ms,
            user: object.meta,
        })
    }

    /// Writes one page of a body to a temp file, once there is room.
    async fn stage_dirty(
        self: &Arc<Self>,
        wb: &Arc<WriteBack>,
        data: Bytes,
        deadline: Instant,
        taken: &mut Taken,
    ) -> Result<(), CacheError> {
        let len = data.len() as u64;
        let mut _counted = None;
        while !wb.try_reserve(len) {
            _counted.get_or_insert_with(|| wb.wait_for_room());
            let waiting = wb.drained.notified();
            if wb.try_reserve(len) {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CacheError::StagingFull(format!(
                    "write-back staging stayed full ({} of {} bytes dirty) for the stall timeout of {:?}; the data acknowledged before stays staged",
                    wb.dirty_bytes(),
                    wb.config.staging_limit,
                    wb.config.stall_timeout
                )));
            }
            let _ =
                tokio::time::timeout(left.min(std::time::Duration::from_secs(1)), waiting).await;
        }
        taken.reserved += len;
        wb.note_take_progress();
        // Pages already written go on to be placed now, not when the
        // queue is full: a slow writer's pages are in place by its close.
        while taken.staging.front().is_some_and(|t| t.is_finished()) {
            taken.settle_oldest().await?;
        }
        if taken.staging.len() >= STAGING_IN_FLIGHT {
            taken.settle_oldest().await?;
        }
        let (wb2, io, index) = (wb.clone(), taken.io, taken.next_index);
        let crcs_to = taken.crcs_to.clone();
        taken.next_index += 1;
        let writing = wb.page_writing();
        taken
            .staging
            .push_back(tokio::task::spawn_blocking(move || {
                let _writing = writing;
                let staged = match io {
                    Staging::Direct => wb2.pages.stage_for_sync(&data),
                    Staging::Buffered => wb2.pages.stage_buffered_for_sync(&data),
                }?;
                if let Some(to) = crcs_to {
                    to.set(index, staged.crc());
                }
                Ok(TakenPage {
                    staged,
                    index,
                    placed: false,
                })
            }));
        Ok(())
    }
}

impl Taken {
    /// Waits for the oldest page being written.
    async fn settle_oldest(&mut self) -> Result<(), CacheError> {
        let Some(task) = self.staging.pop_front() else {
            return Ok(());
        };
        let page = task.await.map_err(join_failed)?.map_err(staging_failed)?;
        match self
            .place
            .clone()
            .filter(|p| page.staged.len == p.page_size)
        {
            Some(place) => {
                if self.placing.len() >= PLACING_IN_FLIGHT {
                    self.settle_placing().await?;
                }
                self.placing.push_back(tokio::task::spawn_blocking(move || {
                    place_page(&place, &page.staged, page.index)?;
                    Ok(TakenPage {
                        placed: true,
                        ..page
                    })
                }));
            }
            None => self.pages.push(page),
        }
        Ok(())
    }

    /// Waits for the oldest page being put into place.
    async fn settle_placing(&mut self) -> Result<(), CacheError> {
        let Some(task) = self.placing.pop_front() else {
            return Ok(());
        };
        let page = task.await.map_err(join_failed)?.map_err(staging_failed)?;
        self.pages.push(page);
        Ok(())
    }
}

impl Taken {
    /// Part and whole CRCs from the staged pages (in order), each part
    /// a whole number of pages.
    fn crcs_from_pages(&mut self, part_size: u64) {
        let mut parts: Vec<(u32, u64)> = Vec::new();
        for TakenPage { staged: page, .. } in &self.pages {
            match parts.last_mut() {
                Some((crc, len)) if *len < part_size => {
                    *crc = crate::crc_combine::combine(*crc, page.crc(), page.len);
                    *len += page.len;
                }
                _ => parts.push((page.crc(), page.len)),
            }
        }
        self.whole_crc = crate::pages::combine_crcs(parts.iter().copied());
        self.part_crcs = parts.into_iter().map(|(crc, _)| crc).collect();
    }

    fn add_crcs(&mut self, chunk: &[u8], part_size: u64) {
        self.whole_crc = crc32c::crc32c_append(self.whole_crc, chunk);
        self.size += chunk.len() as u64;
        let mut rest = chunk;
        while !rest.is_empty() {
            if self.part_filled == 0 || self.part_filled == part_size {
                self.part_crcs.push(0);
                self.part_filled = 0;
            }
            let take = ((part_size - self.part_filled) as usize).min(rest.len());
            if let Some(last) = self.part_crcs.last_mut() {
                *last = crc32c::crc32c_append(*last, &rest[..take]);
            }
            self.part_filled += take as u64;
            rest = &rest[take..];
        }
    }
}

/// Page files synced at once: a sync waits for the disk, and several in
/// flight keep its queue full.
const COMMIT_THREADS: usize = 4;

/// Labels, syncs and moves every staged page not yet in place, a few
/// at a time; returns the directories they landed in. On an error the
/// pages not yet committed are discarded (the caller removes committed
/// ones).
fn commit_pages(
    wb: &WriteBack,
    record: &PendingObject,
    pages: Vec<TakenPage>,
) -> Result<BTreeSet<PathBuf>, CacheError> {
    let mut lanes: Vec<Vec<(u64, Staged)>> = (0..COMMIT_THREADS).map(|_| Vec::new()).collect();
    let staged = pages.into_iter().filter(|p| !p.placed);
    for (i, page) in staged.enumerate() {
        lanes[i % COMMIT_THREADS].push((page.index, page.staged));
    }
    let failed = std::sync::atomic::AtomicBool::new(false);
    let results: Vec<Result<BTreeSet<PathBuf>, String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = lanes
            .into_iter()
            .filter(|lane| !lane.is_empty())
            .map(|lane| {
                let failed = &failed;
                scope.spawn(move || {
                    let mut dirs = BTreeSet::new();
                    let mut error = None;
                    for (index, staged) in lane {
                        if error.is_some() || failed.load(std::sync::atomic::Ordering::Relaxed) {
                            wb.pages.discard_staged(staged);
                            continue;
                        }
                        let key = WriteBack::page_key(&record.uri, &record.version, index);
                        let id = WriteBack::page_id(record, index);
                        match wb.pages.commit_synced(staged, &key, &id) {
                            Ok(dir) => {
                                dirs.insert(dir);
                            }
                            Err(e) => {
                                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                                error = Some(format!("syncing dirty page {index}: {e}"));
                            }
                        }
                    }
                    error.map_or(Ok(dirs), Err)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err("a page commit thread panicked".into()))
            })
            .collect()
    });
    let mut dirs = BTreeSet::new();
    for result in results {
        dirs.extend(result.map_err(CacheError::Local)?);
    }
    Ok(dirs)
}

fn staging_failed(e: std::io::Error) -> CacheError {
    match e.kind() {
        // A full disk is back-pressure the client can act on, not an
        // internal fault.
        std::io::ErrorKind::StorageFull => CacheError::StagingFull(format!(
            "the cache disk is full while staging a write-back page ({e}); nothing of this write was acknowledged"
        )),
        _ => CacheError::Local(format!("staging or placing a dirty page: {e}")),
    }
}

/// Puts a whole page written directly into place (see [`TakenPage`]);
/// on an error nothing of it is left.
fn place_page(place: &PlaceAs, staged: &Staged, index: u64) -> std::io::Result<()> {
    let wb = &place.wb;
    let key = WriteBack::page_key(&place.uri, &place.version, index);
    // A whole page's label does not depend on the object's final size.
    let whole = (index + 1).saturating_mul(place.page_size);
    let id = crate::pages::PageId::new(&place.uri, &place.version, index, place.page_size, whole);
    let placed = wb.pages.place_synced(staged, &key, &id);
    if placed.is_err() {
        wb.pages.discard_staged_path(staged);
        wb.pages.remove(&key);
    }
    placed
}

/// Removes the first `count` committed dirty pages of an object whose
/// write was not acknowledged.
fn remove_pages(wb: &WriteBack, object: &PendingObject, count: u64) {
    for index in 0..count {
        wb.pages
            .remove(&WriteBack::page_key(&object.uri, &object.version, index));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_checksums_cover_fixed_parts_whatever_the_chunking() {
        let data: Vec<u8> = (0..23_456u32).map(|i| (i * 7 % 251) as u8).collect();
        let part = 5_000u64;
        for chunk in [1usize, 999, 5_000, 7_777, 50_000] {
            let mut t = Taken::default();
            for c in data.chunks(chunk) {
                t.add_crcs(c, part);
            }
            let want: Vec<u32> = data.chunks(part as usize).map(crc32c::crc32c).collect();
            assert_eq!(t.part_crcs, want, "chunks of {chunk}");
            assert_eq!(t.whole_crc, crc32c::crc32c(&data));
            assert_eq!(t.size, data.len() as u64);
        }
    }
}
