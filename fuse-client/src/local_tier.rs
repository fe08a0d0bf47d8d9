//! The node-local cache tier (L1): whole objects on the training node's
//! own disk, keyed by (URI, ETag), filled as they are read from the
//! workers.
//!
//! Each object is two files: `<id>.data` holds exactly the object's
//! bytes at their own offsets, so a complete one can back a FUSE
//! passthrough open as it is; `<id>.meta` describes it (format, URI,
//! ETag, size, block size, a CRC32C per filled block) and carries its own
//! checksum. Reads check the CRC of every block they touch; a block that
//! fails is forgotten and fetched again. Metadata is written when an
//! object completes and when the tier is flushed, so after a crash an
//! object's unrecorded blocks are simply absent.
//!
//! Blocking file I/O: callers on the async runtime use `spawn_blocking`.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use lakecache_protocol::direct_io;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub mod damage;
pub(crate) mod filler;
mod guard;
pub mod report;
pub use damage::Damage;
use filler::FillQueue;
pub use filler::FillStats;

const FORMAT: &str = "lakecache-local-tier-v1";
/// Filled and checked in blocks of this size (the last may be shorter).
pub const BLOCK: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("local tier {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "local cache {path} holds a tier of format {found:?}, which this lakecache ({FORMAT}) cannot read: use the lakecache that wrote it, or move the directory away"
    )]
    Format { path: PathBuf, found: String },
    #[error("local cache {0}: its parent directory does not exist (is its disk mounted?); create the parent or pick another --local-cache")]
    NoParent(PathBuf),
    #[error("local cache {0} is not a directory; pick a directory for --local-cache")]
    NotADirectory(PathBuf),
    #[error("local cache {0} is not empty and holds no lakecache tier (no FORMAT file); its files would be deleted as strays, so pick an empty or new directory for --local-cache")]
    Foreign(PathBuf),
    #[error("local cache {path} is not writable ({source}); make it writable or pick another --local-cache")]
    NotWritable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--local-cache-size {capacity} bytes is larger than the filesystem of {path} ({disk} bytes); give a smaller size")]
    LargerThanDisk {
        path: PathBuf,
        capacity: u64,
        disk: u64,
    },
    #[error("local cache {path} is in use by another lakecache mount ({holder}); give each mount its own --local-cache")]
    InUse { path: PathBuf, holder: String },
    #[error("{size} bytes do not fit in a local tier of {capacity} bytes")]
    TooLarge { size: u64, capacity: u64 },
    #[error("a fill at {offset} of {len} bytes is outside a {size}-byte object")]
    OutOfRange { offset: u64, len: u64, size: u64 },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> TierError + '_ {
    move |source| TierError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Meta {
    format: String,
    uri: String,
    etag: String,
    size: u64,
    block: u64,
    /// CRC32C of each block; `None` where the block was never filled.
    crcs: Vec<Option<u32>>,
    /// The data file as it was when every block was known to match its
    /// CRC (synced to disk first): while it still looks the same, a new
    /// mount may hand it to the kernel without reading it all again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checked_as: Option<FileStamp>,
    /// A reader showed the whole object will be wanted: its missing
    /// blocks are fetched in the background, also after a remount.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    wanted_whole: bool,
}

/// What changes when anyone writes a file: its inode, length, and
/// modification and change times.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
struct FileStamp {
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(file: &File) -> std::io::Result<Self> {
        Ok(Self::from(&file.metadata()?))
    }

    /// By path: checking a stamp needs no descriptor.
    fn of_path(path: &Path) -> std::io::Result<Self> {
        Ok(Self::from(&std::fs::metadata(path)?))
    }

    fn from(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Self {
            ino: m.ino(),
            len: m.len(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct MetaFile {
    meta: Meta,
    /// CRC32C of `meta` serialized as JSON.
    crc: u32,
}

fn blocks(size: u64) -> usize {
    size.div_ceil(BLOCK) as usize
}

/// File name stem of an object: hashing keeps any URI a safe name.
fn object_id(uri: &str, etag: &str) -> String {
    let mut h = Sha256::new();
    h.update(uri.as_bytes());
    h.update([0]);
    h.update(etag.as_bytes());
    hex::encode(&h.finalize()[..16])
}

/// One object in the tier.
pub struct TierObject {
    id: String,
    data_path: PathBuf,
    meta_path: PathBuf,
    /// The data file, open while the object is in use (a tier of many
    /// small objects must not hold a descriptor for each).
    files: Mutex<Option<OpenFiles>>,
    /// Whether the filesystem refused `O_DIRECT`.
    no_direct: std::sync::atomic::AtomicBool,
    /// Objects of the tier with files open.
    open_count: Arc<std::sync::atomic::AtomicUsize>,
    meta: Mutex<Meta>,
    /// Byte ranges filled so far in blocks not yet whole (not persisted:
    /// after a restart they are simply fetched again).
    partial: Mutex<HashMap<usize, Vec<std::ops::Range<u64>>>>,
    fills: FillQueue,
    /// One metadata write at a time: concurrent writers would share the
    /// temporary file, and an older snapshot could land last.
    persisting: Mutex<()>,
    /// When a reader last read this object ([`clock_ms`]): completion
    /// leaves an object alone while readers stream it (they fill it).
    last_read_ms: std::sync::atomic::AtomicU64,
    /// A random reader wants it whole: completion does not wait for the
    /// object to go unread (not persisted: a remount resumes it as usual).
    wanted_now: std::sync::atomic::AtomicBool,
    /// A reader asked for the object whole: fills are not dropped.
    fills_kept: std::sync::atomic::AtomicBool,
    /// Bytes of kept fills queued or being written.
    kept_pending: std::sync::atomic::AtomicI64,
}

/// Milliseconds on a monotonic clock that starts with the process.
fn clock_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// Gives a new data file its length with its blocks allocated up front.
/// Fills arrive out of order from concurrent segment fetches, and direct
/// writes into a sparse file allocate as they land: 146 MiB objects
/// ended in 12-19 extents each (2-3 when preallocated; local disk's
/// copies 3-13), though they are read back as one sequential scan.
/// Allocating first keeps a file contiguous where the disk allows, and a
/// full disk fails the creation (the reader is then served by the
/// workers) rather than a fill half-way. A filesystem that cannot
/// preallocate gets a sparse file.
fn reserve(file: &File, size: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(size).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    if len == 0 {
        return Ok(());
    }
    // SAFETY: fallocate on our own open fd; no memory is passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS) => file.set_len(size),
        _ => Err(e),
    }
}

/// An object's data file, opened for reads and buffered writes, and with
/// `O_DIRECT` for the aligned middle of fills where allowed.
struct OpenFiles {
    file: Arc<File>,
    direct: Option<Arc<File>>,
}

/// Adds `new` to sorted, disjoint `ranges`, merging what touches.
fn add_range(ranges: &mut Vec<std::ops::Range<u64>>, new: std::ops::Range<u64>) {
    ranges.push(new);
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<std::ops::Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges.drain(..) {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    *ranges = merged;
}

impl std::fmt::Debug for TierObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierObject").field("id", &self.id).finish()
    }
}

impl TierObject {
    /// The object's name in the tier (its files' stem).
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn size(&self) -> u64 {
        self.lock().size
    }

    pub fn etag(&self) -> String {
        self.lock().etag.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The data file; once [`Self::is_complete`], it holds the whole object.
    pub fn backing_path(&self) -> &Path {
        &self.data_path
    }

    pub fn is_complete(&self) -> bool {
        self.lock().crcs.iter().all(Option::is_some)
    }

    /// Bytes of filled blocks.
    pub fn filled_bytes(&self) -> u64 {
        let meta = self.lock();
        (0..meta.crcs.len())
            .filter(|i| meta.crcs[*i].is_some())
            .map(|i| block_len(meta.size, i))
            .sum()
    }

    /// Bytes of blocks not filled yet.
    pub fn missing_bytes(&self) -> u64 {
        self.size() - self.filled_bytes()
    }

    /// The object's S3 URI (as text) and ETag.
    pub fn uri_and_etag(&self) -> (String, String) {
        let meta = self.lock();
        (meta.uri.clone(), meta.etag.clone())
    }

    /// The unfilled blocks as byte ranges, adjacent ones merged within
    /// aligned stretches of `max` bytes (rounded down to whole blocks, at
    /// least one): two ranges never share a stretch, so concurrent
    /// requests never ask a worker for the same page twice.
    pub fn missing_ranges(&self, max: u64) -> Vec<std::ops::Range<u64>> {
        let meta = self.lock();
        let per_range = (max / BLOCK).max(1) as usize;
        let mut out: Vec<std::ops::Range<u64>> = Vec::new();
        let mut open = false;
        for (i, crc) in meta.crcs.iter().enumerate() {
            if crc.is_some() {
                open = false;
                continue;
            }
            let start = i as u64 * BLOCK;
            let end = start + block_len(meta.size, i);
            match out.last_mut() {
                Some(last) if open && i % per_range != 0 => last.end = end,
                _ => out.push(start..end),
            }
            open = true;
        }
        out
    }

    /// The unfilled blocks inside `range` as one block-aligned span (from
    /// the first missing block to the last); `None` when all are filled.
    pub fn missing_within(&self, range: std::ops::Range<u64>) -> Option<std::ops::Range<u64>> {
        let meta = self.lock();
        let end = range.end.min(meta.size);
        if range.start >= end {
            return None;
        }
        let blocks = (range.start / BLOCK) as usize..=((end - 1) / BLOCK) as usize;
        let mut missing = blocks.filter(|i| meta.crcs[*i].is_none());
        let first = missing.next()?;
        let last = missing.next_back().unwrap_or(first);
        Some(first as u64 * BLOCK..last as u64 * BLOCK + block_len(meta.size, last))
    }

    /// A random reader wants the whole object: see [`Self::wanted_now`].
    pub fn want_now(&self) {
        self.wanted_now
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether completion should fetch without waiting for readers.
    pub fn wanted_now(&self) -> bool {
        self.wanted_now.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records that a reader read this object now.
    pub fn note_read(&self) {
        self.last_read_ms
            .store(clock_ms(), std::sync::atomic::Ordering::Relaxed);
    }

    /// How long since a reader last read this object (since the process
    /// started if none has).
    pub fn idle_for(&self) -> std::time::Duration {
        let last = self.last_read_ms.load(std::sync::atomic::Ordering::Relaxed);
        std::time::Duration::from_millis(clock_ms().saturating_sub(last))
    }

    /// Forgets every block (the data file was found damaged): later
    /// reads fetch and fill them again.
    pub fn forget_blocks(&self) {
        let mut meta = self.lock();
        meta.crcs.iter_mut().for_each(|c| *c = None);
        meta.checked_as = None;
        drop(meta);
        self.partial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.close_files();
    }

    pub fn wanted_whole(&self) -> bool {
        self.lock().wanted_whole
    }

    /// Records that the whole object is wanted (persisted, so a remount
    /// goes on completing it); false when it already was, or is whole.
    pub fn mark_wanted_whole(&self) -> Result<bool, TierError> {
        {
            let mut meta = self.lock();
            if meta.wanted_whole || meta.crcs.iter().all(Option::is_some) {
                return Ok(false);
            }
            meta.wanted_whole = true;
        }
        self.persist()?;
        Ok(true)
    }

    /// Whether every block `offset..offset+len` touches is filled (no
    /// I/O: lets a reader skip the blocking read of a miss).
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        let meta = self.lock();
        let end = (offset.saturating_add(len)).min(meta.size);
        if offset >= end {
            return true;
        }
        let first = (offset / BLOCK) as usize;
        let last = ((end - 1) / BLOCK) as usize;
        meta.crcs[first..=last].iter().all(Option::is_some)
    }

    /// `offset..offset+len` if every block it touches is filled and
    /// checks out; `None` when some block is missing or failed its CRC
    /// (a failed block is forgotten, so the next fill replaces it).
    pub fn read(&self, offset: u64, len: u64) -> Result<Option<Bytes>, TierError> {
        self.read_checked(offset, len, &mut CheckedBlocks::default())
    }

    /// [`Self::read`] for a reader that remembers which blocks it has
    /// checked: those are read as asked, without the whole block and its
    /// CRC again (each open checks what it reads once).
    pub fn read_checked(
        &self,
        offset: u64,
        len: u64,
        checked: &mut CheckedBlocks,
    ) -> Result<Option<Bytes>, TierError> {
        let (size, wanted) = {
            let meta = self.lock();
            let end = (offset + len).min(meta.size);
            if offset >= end {
                return Ok(Some(Bytes::new()));
            }
            let first = (offset / BLOCK) as usize;
            let last = ((end - 1) / BLOCK) as usize;
            let mut wanted = Vec::with_capacity(last - first + 1);
            for i in first..=last {
                match meta.crcs[i] {
                    Some(crc) => wanted.push((i, crc)),
                    None => return Ok(None),
                }
            }
            (meta.size, wanted)
        };
        let end = (offset + len).min(size);
        let mut out = BytesMut::zeroed((end - offset) as usize);
        for (i, crc) in wanted {
            let start = i as u64 * BLOCK;
            let from = offset.max(start);
            let to = end.min(start + block_len(size, i));
            let dest = &mut out[(from - offset) as usize..(to - offset) as usize];
            if checked.contains(i) {
                self.file()?
                    .read_exact_at(dest, from)
                    .map_err(io(&self.data_path))?;
                continue;
            }
            let mut buf = vec![0u8; block_len(size, i) as usize];
            self.file()?
                .read_exact_at(&mut buf, start)
                .map_err(io(&self.data_path))?;
            if crc32c::crc32c(&buf) != crc {
                Damage::Corrupt.note(
                    &self.id,
                    &format_args!("block {i} failed its CRC"),
                    "fetching it again",
                );
                self.lock().crcs[i] = None;
                return Ok(None);
            }
            checked.insert(i);
            dest.copy_from_slice(&buf[(from - start) as usize..(to - start) as usize]);
        }
        Ok(Some(out.freeze()))
    }

    /// Queues `data` for [`Self::fill`] on a fill thread, holding its
    /// share of `budget` until written. For an object whose fills are
    /// kept ([`Self::keep_fills`]) this waits while the filler is behind;
    /// otherwise the fill is dropped then (and fetched again by a later
    /// read), as it is when no memory is free.
    pub async fn fill_soon(
        self: &Arc<Self>,
        offset: u64,
        data: Bytes,
        budget: &crate::memory::MemoryBudget,
    ) {
        // Nothing to queue for bytes already there (prefetches of a file
        // read before, concurrent readers of one object).
        let len = data.len() as u64;
        if data.is_empty() || self.covers(offset, len) {
            return;
        }
        if self.fills_kept() {
            self.fills
                .submit_kept(self.clone(), offset, data, budget)
                .await;
        } else if let Some(memory) = budget.try_reserve(len) {
            self.fills.submit(self.clone(), offset, data, memory);
        }
    }

    /// A reader wants this object whole: its fills wait for the filler
    /// instead of being dropped (see the `filler` module).
    pub fn keep_fills(&self) {
        self.fills_kept
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn fills_kept(&self) -> bool {
        self.fills_kept.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts bytes of kept fills queued (positive) or written (negative).
    pub(crate) fn kept_in_flight(&self, delta: i64) {
        self.kept_pending
            .fetch_add(delta, std::sync::atomic::Ordering::AcqRel);
    }

    /// Whether kept fills of this object are queued or being written:
    /// completion waits for them instead of fetching their bytes again.
    pub fn kept_fills_pending(&self) -> bool {
        self.kept_pending.load(std::sync::atomic::Ordering::Acquire) > 0
    }

    /// Stores `data` at `offset` (any range inside the object). A block
    /// counts as filled, with its CRC taken from what is on disk, once
    /// fills have covered all of it; returns whether the object is now
    /// complete, in which case its metadata is recorded at once.
    pub fn fill(&self, offset: u64, data: &[u8]) -> Result<bool, TierError> {
        let size = self.size();
        let len = data.len() as u64;
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(TierError::OutOfRange { offset, len, size });
        }
        if self.covers(offset, len) {
            // Already there: rewriting it would only change the file's
            // times (and cost a full check at the next mount).
            return Ok(self.is_complete());
        }
        self.write_data(offset, data).map_err(io(&self.data_path))?;
        let end = offset + len;
        let mut covered_now = Vec::new();
        let mut whole = Vec::new();
        {
            let mut partial = self.partial.lock().unwrap_or_else(|e| e.into_inner());
            let meta = self.lock();
            for i in (offset / BLOCK) as usize..=((end - 1) / BLOCK) as usize {
                if meta.crcs[i].is_some() {
                    continue;
                }
                let start = i as u64 * BLOCK;
                let block_end = start + block_len(size, i);
                if offset <= start && block_end <= end {
                    // The whole block is in this fill: its CRC comes from
                    // memory, with no read back.
                    partial.remove(&i);
                    let piece = &data[(start - offset) as usize..(block_end - offset) as usize];
                    whole.push((i, crc32c::crc32c(piece)));
                    continue;
                }
                let ranges = partial.entry(i).or_default();
                add_range(ranges, offset.max(start)..end.min(block_end));
                if ranges.len() == 1 && ranges[0] == (start..block_end) {
                    partial.remove(&i);
                    covered_now.push(i);
                }
            }
        }
        // Blocks assembled from pieces: CRCs of what is on disk, computed
        // outside the locks.
        let mut crcs = whole;
        for i in covered_now {
            let mut buf = vec![0u8; block_len(size, i) as usize];
            self.file()?
                .read_exact_at(&mut buf, i as u64 * BLOCK)
                .map_err(io(&self.data_path))?;
            crcs.push((i, crc32c::crc32c(&buf)));
        }
        let complete = {
            let mut meta = self.lock();
            for (i, crc) in crcs {
                meta.crcs[i] = Some(crc);
            }
            meta.crcs.iter().all(Option::is_some)
        };
        if complete {
            // The data reaches the disk before the metadata that vouches
            // for it: a later mount trusts the stamp instead of re-reading.
            let file = self.file()?;
            file.sync_data().map_err(io(&self.data_path))?;
            let stamp = FileStamp::of(&file).map_err(io(&self.data_path))?;
            self.lock().checked_as = Some(stamp);
            self.persist()?;
        }
        Ok(complete)
    }

    /// Writes the aligned middle of `data` with `O_DIRECT` and its ends
    /// through the page cache; all of it through the page cache where
    /// direct I/O is refused.
    fn write_data(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let end = offset + data.len() as u64;
        let (a0, a1) = (
            offset.next_multiple_of(direct_io::DIRECT_ALIGN),
            end / direct_io::DIRECT_ALIGN * direct_io::DIRECT_ALIGN,
        );
        let (file, direct) = self.open_files()?;
        // A random reader reads these bytes back soon, each block checked
        // whole at its first touch: they stay in the page cache (from
        // disk, first touches held a 2 GiB object's reader at 50-1,600
        // IOPS for 5 s after it was whole).
        let Some(fd) = direct.filter(|_| a1 > a0 && !self.wanted_now()) else {
            return file.write_all_at(data, offset);
        };
        let middle = &data[(a0 - offset) as usize..(a1 - offset) as usize];
        if let Err(e) = direct_io::write_direct(&fd, middle, a0) {
            tracing::debug!(error = %e, "direct writes refused; the local tier writes through the page cache");
            self.no_direct
                .store(true, std::sync::atomic::Ordering::Relaxed);
            return file.write_all_at(data, offset);
        }
        file.write_all_at(&data[..(a0 - offset) as usize], offset)?;
        file.write_all_at(&data[(a1 - offset) as usize..], a1)
    }

    /// The data file, opened if it is not.
    fn file(&self) -> Result<Arc<File>, TierError> {
        self.open_files()
            .map(|(file, _)| file)
            .map_err(io(&self.data_path))
    }

    fn open_files(&self) -> std::io::Result<(Arc<File>, Option<Arc<File>>)> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if files.is_none() {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.data_path)?;
            let direct = direct_io::open_direct(&self.data_path, false);
            *files = Some(OpenFiles {
                file: Arc::new(file),
                direct: direct.map(Arc::new),
            });
            self.open_count
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let open = files.as_ref().expect("opened above");
        let direct = open
            .direct
            .clone()
            .filter(|_| !self.no_direct.load(std::sync::atomic::Ordering::Relaxed));
        Ok((open.file.clone(), direct))
    }

    /// Closes the data file (reopened on the next use).
    fn close_files(&self) {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if files.take().is_some() {
            self.open_count
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Reads every block and checks its CRC (before handing the file to
    /// the kernel, which reads it unchecked). Failed blocks are forgotten.
    pub fn verify(&self) -> Result<bool, TierError> {
        let n = self.lock().crcs.len();
        let size = self.size();
        let mut ok = true;
        let mut buf = vec![0u8; BLOCK as usize];
        for i in 0..n {
            let Some(crc) = self.lock().crcs[i] else {
                ok = false;
                continue;
            };
            let len = block_len(size, i) as usize;
            self.file()?
                .read_exact_at(&mut buf[..len], i as u64 * BLOCK)
                .map_err(io(&self.data_path))?;
            if crc32c::crc32c(&buf[..len]) != crc {
                Damage::Corrupt.note(
                    &self.id,
                    &format_args!("block {i} failed its CRC"),
                    "fetching it again",
                );
                self.lock().crcs[i] = None;
                ok = false;
            }
        }
        let stamp = FileStamp::of(&*self.file()?).map_err(io(&self.data_path))?;
        self.lock().checked_as = ok.then_some(stamp);
        self.persist()?;
        Ok(ok)
    }

    /// Complete and known to match its CRCs: the kernel reads a
    /// passthrough file without them. A file untouched since it was last
    /// known good (same inode, length and times) is not read again; any
    /// other is checked end to end first.
    pub fn ready_for_passthrough(&self) -> Result<bool, TierError> {
        if !self.is_complete() {
            return Ok(false);
        }
        let stamp = FileStamp::of_path(&self.data_path).map_err(io(&self.data_path))?;
        if self.lock().checked_as == Some(stamp) {
            return Ok(true);
        }
        tracing::debug!(object = %self.id, "checking a tier object end to end before the kernel reads it");
        let ok = self.verify()?;
        // The check read the whole file; leave the page cache as it was
        // rather than filling it with an object nobody asked for yet.
        // SAFETY: fadvise only drops clean cached pages of our own fd.
        unsafe {
            use std::os::fd::AsRawFd;
            libc::posix_fadvise(self.file()?.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
        Ok(ok)
    }

    /// Writes the metadata file (atomically: temp file, then rename).
    pub fn persist(&self) -> Result<(), TierError> {
        let _one_writer = self.persisting.lock().unwrap_or_else(|p| p.into_inner());
        let meta = self.lock().clone();
        let body = serde_json::to_vec(&meta).unwrap_or_default();
        let file = MetaFile {
            crc: crc32c::crc32c(&body),
            meta,
        };
        let text = serde_json::to_vec(&file).unwrap_or_default();
        let tmp = self.meta_path.with_extension("meta.tmp");
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&text).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, &self.meta_path).map_err(io(&self.meta_path))
    }
}

/// Blocks one reader has checked against their CRCs.
#[derive(Debug, Default, Clone)]
pub struct CheckedBlocks(Vec<u64>);

impl CheckedBlocks {
    fn contains(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Whether every block `[offset, end)` touches was checked (a read of
    /// them reads only its own bytes). An empty range is covered.
    pub fn cover(&self, offset: u64, end: u64) -> bool {
        offset >= end || (offset / BLOCK..=(end - 1) / BLOCK).all(|i| self.contains(i as usize))
    }

    fn insert(&mut self, i: usize) {
        if self.0.len() <= i / 64 {
            self.0.resize(i / 64 + 1, 0);
        }
        self.0[i / 64] |= 1 << (i % 64);
    }
}

fn block_len(size: u64, i: usize) -> u64 {
    (size - i as u64 * BLOCK).min(BLOCK)
}

/// See [`LocalTier::summary`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierSummary {
    pub whole: u64,
    pub partial: u64,
    pub missing_bytes: u64,
}

struct Slot {
    object: Arc<TierObject>,
    last_use: u64,
}

struct State {
    slots: HashMap<String, Slot>,
    /// URIs held under a cache version (written back, not yet named by
    /// S3), and that version: every open asks, so it must not scan.
    cache_versions: HashMap<String, String>,
    /// Sizes of every object held (reserved in full at creation).
    used: u64,
    clock: u64,
}

/// The tier: a directory of objects within a byte budget, least recently
/// used first out.
pub struct LocalTier {
    /// Held while the tier is in use: one mount per directory.
    _lock: guard::TierLock,
    dir: PathBuf,
    capacity: u64,
    state: Mutex<State>,
    creating: Mutex<()>,
    fills: FillQueue,
    /// Objects with their data file open, across the tier.
    open_count: Arc<std::sync::atomic::AtomicUsize>,
    /// Plans whose next reads decide what is evicted.
    plans: Mutex<Option<std::sync::Weak<dyn NextUse>>>,
}

/// When the held plans read an object again.
pub trait NextUse: Send + Sync {
    /// Whether any plan is held: without one, eviction asks nothing.
    fn active(&self) -> bool {
        true
    }

    /// Bytes of planned reads before `uri` is read again; `None` when no
    /// plan reads it again.
    fn next_use(&self, uri: &str) -> Option<u64>;
}

impl std::fmt::Debug for LocalTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTier")
            .field("dir", &self.dir)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl State {
    fn insert_slot(&mut self, id: String, slot: Slot) {
        let (uri, etag) = slot.object.uri_and_etag();
        if lakecache_protocol::is_cache_version(&etag) {
            self.cache_versions.insert(uri, etag);
        }
        self.slots.insert(id, slot);
    }

    fn remove_slot(&mut self, id: &str) -> Option<Slot> {
        let slot = self.slots.remove(id)?;
        let (uri, etag) = slot.object.uri_and_etag();
        if self.cache_versions.get(&uri) == Some(&etag) {
            self.cache_versions.remove(&uri);
        }
        Some(slot)
    }
}

/// Objects whose files stay open beyond those in use: past it, files of
/// objects nobody holds are closed.
const MAX_OPEN_OBJECTS: usize = 256;

impl LocalTier {
    /// Opens (or creates) the tier in `dir` and takes stock of what a
    /// previous mount left: objects whose metadata checks out are kept;
    /// anything else is deleted.
    pub fn open(dir: &Path, capacity: u64) -> Result<Self, TierError> {
        guard::prepare(dir)?;
        guard::check_capacity(dir, capacity)?;
        let lock = guard::lock(dir)?;
        let tier = Self {
            _lock: lock,
            dir: dir.to_path_buf(),
            capacity,
            state: Mutex::new(State {
                slots: HashMap::new(),
                cache_versions: HashMap::new(),
                used: 0,
                clock: 0,
            }),
            creating: Mutex::new(()),
            fills: FillQueue::start(),
            open_count: Default::default(),
            plans: Mutex::default(),
        };
        tier.recover()?;
        Ok(tier)
    }

    fn recover(&self) -> Result<(), TierError> {
        let entries = std::fs::read_dir(&self.dir).map_err(io(&self.dir))?;
        let mut state = self.lock();
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if name == "FORMAT" || name == "LOCK" {
                continue;
            }
            let Some(id) = name.strip_suffix(".meta") else {
                // Data files are adopted through their metadata below;
                // temp files and strays go.
                if !name.ends_with(".data") {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            };
            match self.load(id) {
                Some(object) => {
                    state.used += object.size();
                    state.clock += 1;
                    let last_use = state.clock;
                    state.insert_slot(id.to_string(), Slot { object, last_use });
                }
                None => {
                    tracing::info!(
                        object = id,
                        "dropping a local tier object whose metadata does not check out"
                    );
                    let _ = std::fs::remove_file(&path);
                    let _ = std::fs::remove_file(self.dir.join(format!("{id}.data")));
                }
            }
        }
        // Data files nobody describes.
        for entry in std::fs::read_dir(&self.dir)
            .map_err(io(&self.dir))?
            .flatten()
        {
            let path = entry.path();
            if let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".data"))
            {
                if !state.slots.contains_key(id) {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        drop(state);
        self.evict_to(0);
        Ok(())
    }

    fn load(&self, id: &str) -> Option<Arc<TierObject>> {
        let meta_path = self.dir.join(format!("{id}.meta"));
        let data_path = self.dir.join(format!("{id}.data"));
        let file: MetaFile = serde_json::from_slice(&std::fs::read(&meta_path).ok()?).ok()?;
        let body = serde_json::to_vec(&file.meta).ok()?;
        let meta = file.meta;
        let sane = crc32c::crc32c(&body) == file.crc
            && meta.format == FORMAT
            && meta.block == BLOCK
            && meta.crcs.len() == blocks(meta.size)
            && object_id(&meta.uri, &meta.etag) == id;
        if !sane || std::fs::metadata(&data_path).ok()?.len() != meta.size {
            return None;
        }
        Some(Arc::new(TierObject {
            files: Mutex::new(None),
            no_direct: Default::default(),
            open_count: self.open_count.clone(),
            id: id.to_string(),
            data_path,
            meta_path,
            meta: Mutex::new(meta),
            partial: Mutex::default(),
            fills: self.fills.clone(),
            persisting: Mutex::default(),
            last_read_ms: Default::default(),
            wanted_now: Default::default(),
            fills_kept: Default::default(),
            kept_pending: Default::default(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the tier holds this version (a look that is not a use).
    pub fn contains(&self, uri: &str, etag: &str) -> bool {
        self.lock().slots.contains_key(&object_id(uri, etag))
    }

    /// The object for this version, if the tier holds it.
    pub fn get(&self, uri: &str, etag: &str) -> Option<Arc<TierObject>> {
        let id = object_id(uri, etag);
        let mut state = self.lock();
        state.clock += 1;
        let now = state.clock;
        let slot = state.slots.get_mut(&id)?;
        slot.last_use = now;
        let object = slot.object.clone();
        drop(state);
        self.close_idle_files();
        Some(object)
    }

    /// Past [`MAX_OPEN_OBJECTS`] open, closes the files of objects that
    /// nobody but the tier holds.
    fn close_idle_files(&self) {
        use std::sync::atomic::Ordering;
        if self.open_count.load(Ordering::Relaxed) <= MAX_OPEN_OBJECTS {
            return;
        }
        let idle: Vec<Arc<TierObject>> = self
            .lock()
            .slots
            .values()
            .filter(|s| Arc::strong_count(&s.object) == 1)
            .map(|s| s.object.clone())
            .collect();
        for object in idle {
            object.close_files();
        }
    }

    /// The object for this version, created empty (its size reserved on
    /// disk, see [`reserve`]) when absent. Older versions of the same URI
    /// are dropped, and least recently used objects make room.
    pub fn get_or_create(
        &self,
        uri: &str,
        etag: &str,
        size: u64,
    ) -> Result<Arc<TierObject>, TierError> {
        // One creation at a time: two opens of a new file must end up
        // with the same object, not one each.
        let _creating = self.creating.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(object) = self.get(uri, etag) {
            return Ok(object);
        }
        if size > self.capacity {
            return Err(TierError::TooLarge {
                size,
                capacity: self.capacity,
            });
        }
        self.forget_other_versions(uri, etag);
        self.evict_to(size);
        let id = object_id(uri, etag);
        let data_path = self.dir.join(format!("{id}.data"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&data_path)
            .map_err(io(&data_path))?;
        if let Err(e) = reserve(&file, size) {
            drop(file);
            let _ = std::fs::remove_file(&data_path);
            return Err(io(&data_path)(e));
        }
        drop(file);
        let object = Arc::new(TierObject {
            files: Mutex::new(None),
            no_direct: Default::default(),
            open_count: self.open_count.clone(),
            id: id.clone(),
            meta_path: self.dir.join(format!("{id}.meta")),
            data_path,
            meta: Mutex::new(Meta {
                format: FORMAT.into(),
                uri: uri.into(),
                etag: etag.into(),
                size,
                block: BLOCK,
                crcs: vec![None; blocks(size)],
                checked_as: None,
                wanted_whole: false,
            }),
            partial: Mutex::default(),
            fills: self.fills.clone(),
            persisting: Mutex::default(),
            last_read_ms: Default::default(),
            wanted_now: Default::default(),
            fills_kept: Default::default(),
            kept_pending: Default::default(),
        });
        if size == 0 {
            object.persist()?;
        }
        let mut state = self.lock();
        state.clock += 1;
        let last_use = state.clock;
        state.used += size;
        state.insert_slot(
            id,
            Slot {
                object: object.clone(),
                last_use,
            },
        );
        drop(state);
        self.close_idle_files();
        Ok(object)
    }

    /// The version of `uri` the tier holds that is a cache version
    /// (written back, not yet known under an S3 ETag), if any.
    pub fn cache_version_of(&self, uri: &str) -> Option<String> {
        self.lock().cache_versions.get(uri).cloned()
    }

    /// The bytes the tier holds as version `from` of `uri` are version
    /// `to` now (a written-back object S3 has named): the object is kept
    /// under `to` instead of being read again. False when it is absent or
    /// in use.
    pub fn rekey(&self, uri: &str, from: &str, to: &str) -> Result<bool, TierError> {
        let _creating = self.creating.lock().unwrap_or_else(|e| e.into_inner());
        let (from_id, to_id) = (object_id(uri, from), object_id(uri, to));
        let old = {
            let state = self.lock();
            match state.slots.get(&from_id) {
                // Held by the tier only (and this clone).
                Some(slot) if Arc::strong_count(&slot.object) == 1 => slot.object.clone(),
                _ => return Ok(false),
            }
        };
        old.close_files();
        let mut meta = old.lock().clone();
        meta.etag = to.to_string();
        let data_path = self.dir.join(format!("{to_id}.data"));
        std::fs::rename(&old.data_path, &data_path).map_err(io(&data_path))?;
        let object = Arc::new(TierObject {
            files: Mutex::new(None),
            no_direct: Default::default(),
            open_count: self.open_count.clone(),
            id: to_id.clone(),
            meta_path: self.dir.join(format!("{to_id}.meta")),
            data_path,
            meta: Mutex::new(meta),
            partial: Mutex::default(),
            fills: self.fills.clone(),
            persisting: Mutex::default(),
            last_read_ms: Default::default(),
            wanted_now: Default::default(),
            fills_kept: Default::default(),
            kept_pending: Default::default(),
        });
        object.persist()?;
        let _ = std::fs::remove_file(&old.meta_path);
        let mut state = self.lock();
        if let Some(slot) = state.remove_slot(&from_id) {
            state.insert_slot(
                to_id,
                Slot {
                    object,
                    last_use: slot.last_use,
                },
            );
        }
        Ok(true)
    }

    /// Objects a previous reader wanted whole that are not yet: a new
    /// mount goes on completing them.
    pub fn wanted_incomplete(&self) -> Vec<Arc<TierObject>> {
        self.lock()
            .slots
            .values()
            .filter(|s| s.object.wanted_whole() && !s.object.is_complete())
            .map(|s| s.object.clone())
            .collect()
    }

    /// Whether `object` is still held (not evicted nor replaced).
    pub fn holds(&self, object: &TierObject) -> bool {
        self.lock().slots.contains_key(&object.id)
    }

    /// Every object held (cloned out, so no lock is held while they are
    /// looked at).
    fn objects(&self) -> Vec<Arc<TierObject>> {
        self.lock()
            .slots
            .values()
            .map(|s| s.object.clone())
            .collect()
    }

    /// Objects held: how many are whole, how many partial, and the bytes
    /// the partial ones miss.
    pub fn summary(&self) -> TierSummary {
        let objects = self.objects();
        let mut summary = TierSummary::default();
        for object in objects {
            let missing = object.missing_bytes();
            if missing == 0 {
                summary.whole += 1;
            } else {
                summary.partial += 1;
                summary.missing_bytes += missing;
            }
        }
        summary
    }

    /// Drops version `etag` of `uri` (S3 no longer has it).
    pub fn forget_version(&self, uri: &str, etag: &str) {
        self.remove(&object_id(uri, etag));
    }

    /// Drops every version of `uri` (its object changed in S3).
    pub fn forget_uri(&self, uri: &str) {
        self.forget_other_versions(uri, "");
    }

    /// Drops the versions of `uri` other than `etag`.
    fn forget_other_versions(&self, uri: &str, etag: &str) {
        let doomed: Vec<String> = self
            .lock()
            .slots
            .iter()
            .filter(|(_, s)| {
                let meta = s.object.lock();
                meta.uri == uri && meta.etag != etag
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in doomed {
            self.remove(&id);
        }
    }

    fn remove(&self, id: &str) {
        let removed = self.lock().remove_slot(id);
        if let Some(slot) = removed {
            self.lock().used -= slot.object.size();
            let _ = std::fs::remove_file(&slot.object.meta_path);
            let _ = std::fs::remove_file(&slot.object.data_path);
        }
    }

    /// Evicts least recently used objects until `incoming` more bytes
    /// fit. An object someone still holds may go too: its open file stays
    /// readable until dropped, and its files are already unlinked.
    fn evict_to(&self, incoming: u64) {
        loop {
            let victim = {
                let state = self.lock();
                if state.used + incoming <= self.capacity {
                    return;
                }
                let plans = self.plans.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let plans = plans.and_then(|p| p.upgrade()).filter(|p| p.active());
                // Objects in use last; then those no plan reads again
                // (least recently used first); then the one a plan reads
                // again furthest ahead (Belady's rule).
                state
                    .slots
                    .iter()
                    .min_by_key(|(_, s)| {
                        let next = plans
                            .as_ref()
                            .and_then(|p| p.next_use(&s.object.uri_and_etag().0));
                        let in_use = Arc::strong_count(&s.object) > 1;
                        (in_use, next.is_some(), std::cmp::Reverse(next), s.last_use)
                    })
                    .map(|(id, _)| id.clone())
            };
            match victim {
                Some(id) => self.remove(&id),
                None => return,
            }
        }
    }

    /// Evicts by `plans` from now on (see [`NextUse`]).
    pub fn evict_by(&self, plans: std::sync::Weak<dyn NextUse>) {
        *self.plans.lock().unwrap_or_else(|e| e.into_inner()) = Some(plans);
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes reserved by the objects held.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// Bytes written by the fill thread, and dropped because it was behind.
    pub fn fill_stats(&self) -> &FillStats {
        self.fills.stats()
    }

    /// Waits (at most `limit`) for queued fills to reach the disk.
    pub fn drain_fills(&self, limit: std::time::Duration) -> bool {
        self.fills.drain(limit)
    }

    /// Writes queued fills, then records the filled blocks of every
    /// partial object (complete ones were recorded when they completed).
    pub fn flush(&self) -> Result<(), TierError> {
        if !self.drain_fills(std::time::Duration::from_secs(30)) {
            tracing::warn!(
                "local tier fills still queued at flush; their blocks will be fetched again"
            );
        }
        let objects = self.objects();
        for object in objects {
            if !object.is_complete() {
                object.persist()?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
