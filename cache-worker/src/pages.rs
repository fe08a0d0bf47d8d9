//! Page files on local disk: one file per page, named by a hash of
//! (URI, ETag, page index). Every file starts with a header that says
//! what it holds (see [`PageId`]) and which of its blocks are filled, with
//! a CRC32C per block; a read checks all of it against what the reader
//! expects, so a file that belongs to another object, version, page size
//! or format is never served.

use std::fs;
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// Granularity of CRC checks and of partial fills.
pub const CHECK_BLOCK: u64 = 256 * 1024;
/// Version of the page file layout; bumped on any change to it.
pub const PAGE_FORMAT: u32 = 2;
/// Data starts here, so it stays block-aligned in the file.
pub(crate) const HEADER_LEN: u64 = 4096;
const MAGIC: &[u8; 8] = b"LKCPAGE\n";
/// Fixed fields before the per-block CRCs (see `encode_header`).
const FIXED_LEN: usize = 120;
/// 64 MiB pages of 256 KiB blocks; the header has room for this many.
pub const MAX_BLOCKS: usize = 256;

/// Identity of one page; SHA-256 over explicit bytes, stable everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey(pub [u8; 32]);

impl PageKey {
    pub fn new(uri: &str, etag: &str, index: u64) -> Self {
        let mut h = Sha256::new();
        h.update((uri.len() as u64).to_be_bytes());
        h.update(uri.as_bytes());
        h.update((etag.len() as u64).to_be_bytes());
        h.update(etag.as_bytes());
        h.update(index.to_be_bytes());
        Self(h.finalize().into())
    }

    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

/// What a page file must hold, written into its header and compared on
/// every read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageId {
    pub uri_hash: [u8; 32],
    pub etag_hash: [u8; 32],
    pub index: u64,
    /// Offset of the page in the object.
    pub offset: u64,
    /// Bytes of the object in this page (the last page may be short).
    pub len: u64,
    pub page_size: u64,
}

impl PageId {
    pub fn new(uri: &str, etag: &str, index: u64, page_size: u64, object_size: u64) -> Self {
        let offset = index.saturating_mul(page_size);
        Self {
            uri_hash: Sha256::digest(uri.as_bytes()).into(),
            etag_hash: Sha256::digest(etag.as_bytes()).into(),
            index,
            offset,
            len: object_size.saturating_sub(offset).min(page_size),
            page_size,
        }
    }

    fn blocks(&self) -> usize {
        self.len.div_ceil(CHECK_BLOCK) as usize
    }
}

/// Which blocks of a page file hold their bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FilledBlocks([u64; MAX_BLOCKS / 64]);

impl FilledBlocks {
    fn of(valid: &[bool]) -> Self {
        Self::of_blocks(
            valid
                .iter()
                .enumerate()
                .filter(|(_, v)| **v)
                .map(|(b, _)| b),
        )
    }

    /// The blocks in `blocks` (those below [`MAX_BLOCKS`]).
    pub fn of_range(blocks: Range<usize>) -> Self {
        Self::of_blocks(blocks)
    }

    fn of_blocks(blocks: impl Iterator<Item = usize>) -> Self {
        let mut set = Self::default();
        for b in blocks.take_while(|b| *b < MAX_BLOCKS) {
            set.0[b / 64] |= 1 << (b % 64);
        }
        set
    }

    fn has(&self, block: usize) -> bool {
        block < MAX_BLOCKS && self.0[block / 64] & (1 << (block % 64)) != 0
    }

    /// Whether every block in `blocks` is filled.
    pub fn covers(&self, blocks: Range<usize>) -> bool {
        blocks.into_iter().all(|b| self.has(b))
    }

    /// Whether page `id` is filled whole.
    pub fn whole(&self, id: &PageId) -> bool {
        self.covers(0..id.blocks())
    }

    /// Bytes of page `id` its filled blocks hold.
    pub fn bytes(&self, id: &PageId) -> u64 {
        (0..id.blocks())
            .filter(|b| self.has(*b))
            .map(|b| CHECK_BLOCK.min(id.len - b as u64 * CHECK_BLOCK))
            .sum()
    }
}

/// The blocks of a page that `range` (page-relative) touches.
pub fn blocks_of(range: &Range<u64>) -> Range<usize> {
    (range.start / CHECK_BLOCK) as usize..range.end.div_ceil(CHECK_BLOCK) as usize
}

#[derive(Debug, thiserror::Error)]
pub enum PageReadError {
    #[error("page file missing")]
    Missing,
    /// A partly filled page lacks some of the blocks asked for.
    #[error("page blocks {0:?} not filled yet")]
    Unfilled(Range<usize>),
    #[error("page file rejected: {0}")]
    Corrupt(String),
    #[error("page i/o: {0}")]
    Io(#[from] io::Error),
}

/// Header state of one page file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    id: PageId,
    crcs: Vec<u32>,
    valid: Vec<bool>,
}

impl Header {
    fn empty(id: PageId) -> Self {
        let n = id.blocks();
        Self {
            id,
            crcs: vec![0; n],
            valid: vec![false; n],
        }
    }

    fn encode(&self) -> Vec<u8> {
        let n = self.crcs.len();
        let mut out = Vec::with_capacity(HEADER_LEN as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&PAGE_FORMAT.to_le_bytes());
        out.extend_from_slice(&(CHECK_BLOCK as u32).to_le_bytes());
        out.extend_from_slice(&self.id.uri_hash);
        out.extend_from_slice(&self.id.etag_hash);
        for v in [
            self.id.index,
            self.id.offset,
            self.id.len,
            self.id.page_size,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(n as u32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        debug_assert_eq!(out.len(), FIXED_LEN);
        for crc in &self.crcs {
            out.extend_from_slice(&crc.to_le_bytes());
        }
        let mut bitmap = vec![0u8; n.div_ceil(8)];
        for (i, _) in self.valid.iter().enumerate().filter(|(_, v)| **v) {
            bitmap[i / 8] |= 1 << (i % 8);
        }
        out.extend_from_slice(&bitmap);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out.resize(HEADER_LEN as usize, 0);
        out
    }

    /// Parses a header and checks it describes `want`.
    fn decode(raw: &[u8], want: &PageId) -> Result<Self, PageReadError> {
        let bad = |why: &str| PageReadError::Corrupt(why.to_string());
        if raw.len() < FIXED_LEN || &raw[..8] != MAGIC {
            return Err(bad("no page header"));
        }
        let u32_at = |at: usize| u32::from_le_bytes(raw[at..at + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |at: usize| u64::from_le_bytes(raw[at..at + 8].try_into().unwrap_or([0; 8]));
        if u32_at(8) != PAGE_FORMAT {
            return Err(bad("page format version differs"));
        }
        if u64::from(u32_at(12)) != CHECK_BLOCK {
            return Err(bad("block size differs"));
        }
        let n = u32_at(112) as usize;
        if n > MAX_BLOCKS {
            return Err(bad("block count out of bounds"));
        }
        let crc_end = FIXED_LEN + 4 * n;
        let end = crc_end + n.div_ceil(8);
        if raw.len() < end + 4 || u32_at(end) != crc32c::crc32c(&raw[..end]) {
            return Err(bad("header checksum mismatch"));
        }
        let id = PageId {
            uri_hash: raw[16..48].try_into().unwrap_or([0; 32]),
            etag_hash: raw[48..80].try_into().unwrap_or([0; 32]),
            index: u64_at(80),
            offset: u64_at(88),
            len: u64_at(96),
            page_size: u64_at(104),
        };
        if id != *want {
            return Err(bad("header names another page"));
        }
        if n != id.blocks() {
            return Err(bad("block count does not match the page length"));
        }
        let crcs = (0..n).map(|i| u32_at(FIXED_LEN + 4 * i)).collect();
        let valid = (0..n)
            .map(|i| raw[crc_end + i / 8] & (1 << (i % 8)) != 0)
            .collect();
        Ok(Self { id, crcs, valid })
    }
}

/// CRC32C of each [`CHECK_BLOCK`] of `data`.
pub fn block_crcs(data: &[u8]) -> Vec<u32> {
    data.chunks(CHECK_BLOCK as usize)
        .map(crc32c::crc32c)
        .collect()
}

/// An opened page file and where the checked blocks of a range lie in it.
#[derive(Debug)]
pub struct CheckedFile {
    pub file: fs::File,
    pub file_offset: u64,
    pub read_len: u64,
    pub block: u64,
    pub crcs: Vec<u32>,
    /// Where the range starts within the blocks read.
    pub skip: u64,
}

/// CRC32C of a whole run of blocks, from each block's CRC and length
/// (no pass over the bytes).
pub fn combine_crcs(blocks: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    blocks.into_iter().fold(0, |acc, (crc, len)| {
        crate::crc_combine::combine(acc, crc, len)
    })
}

/// A page's bytes in a temp file, not yet labelled or visible.
#[derive(Debug)]
pub struct Staged {
    path: PathBuf,
    crcs: Vec<u32>,
    pub len: u64,
    /// [`Self::crc`], combined once: a followed body's check and the
    /// part CRCs both ask for it.
    whole: std::sync::OnceLock<u32>,
}

impl Staged {
    /// CRC32C of the page's bytes, from its block CRCs.
    pub fn crc(&self) -> u32 {
        *self.whole.get_or_init(|| {
            let blocks = self.crcs.len() as u64;
            combine_crcs(self.crcs.iter().enumerate().map(|(i, crc)| {
                let len = if i as u64 + 1 == blocks {
                    self.len - CHECK_BLOCK * (blocks - 1)
                } else {
                    CHECK_BLOCK
                };
                (*crc, len)
            }))
        })
    }
}

/// Serialises header updates of partial fills (read-modify-write).
const FILL_LOCKS: usize = 64;

pub struct PageStore {
    pages: PathBuf,
    tmp: PathBuf,
    fill_locks: Vec<Mutex<()>>,
    /// Whether fetched pages are staged with `O_DIRECT` (until the
    /// filesystem refuses it).
    direct: AtomicBool,
    /// Files pages are staged over, where kept (write-back pages).
    spares: std::sync::OnceLock<std::sync::Arc<crate::spares::Spares>>,
}

pub(crate) fn mkdir_private(path: &Path) -> io::Result<()> {
    crate::crashsim::mkdir(path, || {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
    })
}

impl PageStore {
    /// Uses `<dir>/pages` and `<dir>/tmp` (created 0700); temp files left
    /// by a crash are removed. The caller holds the directory's lock.
    pub fn open(dir: &Path) -> io::Result<Self> {
        let pages = dir.join("pages");
        let tmp = dir.join("tmp");
        mkdir_private(&pages)?;
        match fs::remove_dir_all(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        mkdir_private(&tmp)?;
        Ok(Self {
            pages,
            tmp,
            fill_locks: (0..FILL_LOCKS).map(|_| Mutex::new(())).collect(),
            direct: AtomicBool::new(true),
            spares: Default::default(),
        })
    }

    /// Stages direct pages over `spares` from now on, while any are left.
    pub(crate) fn use_spares(&self, spares: std::sync::Arc<crate::spares::Spares>) {
        let _ = self.spares.set(spares);
    }

    pub fn path(&self, key: &PageKey) -> PathBuf {
        let hex = key.hex();
        self.pages.join(&hex[..2]).join(hex)
    }

    /// Writes a complete page's bytes to a temp file, leaving room for the
    /// header; `commit` labels it (the ETag of an upload is known only
    /// once S3 has it) and moves it into place.
    pub fn stage(&self, data: &[u8]) -> io::Result<Staged> {
        self.stage_with(data, false, true)
    }

    fn stage_with(&self, data: &[u8], start_writeback: bool, direct: bool) -> io::Result<Staged> {
        if data.len() as u64 > MAX_BLOCKS as u64 * CHECK_BLOCK {
            return Err(io::Error::other("page larger than the header can describe"));
        }
        let path = self.tmp.join(uuid::Uuid::new_v4().simple().to_string());
        if direct && self.direct.load(Ordering::Relaxed) {
            match self.stage_direct(&path, data) {
                Ok(true) => {
                    return Ok(Staged {
                        path,
                        crcs: block_crcs(data),
                        len: data.len() as u64,
                        whole: Default::default(),
                    })
                }
                Ok(false) => {
                    tracing::info!(dir = %self.tmp.display(), "the cache directory refuses O_DIRECT; pages are written through the page cache");
                    self.direct.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let written = fs::File::create(&path).and_then(|mut f| {
            crate::crashsim::created(&path)?;
            f.write_all(&[0u8; HEADER_LEN as usize])?;
            f.write_all(data)?;
            if start_writeback {
                use std::os::fd::AsRawFd;
                // SAFETY: a plain syscall on a descriptor `f` owns; its
                // failure only loses the head start.
                unsafe {
                    libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
                }
            }
            Ok(())
        });
        if let Err(e) = written {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
        Ok(Staged {
            path,
            crcs: block_crcs(data),
            len: data.len() as u64,
            whole: Default::default(),
        })
    }

    /// Writes `data` after the header's room with `O_DIRECT`, leaving the
    /// header a hole (zeros, as the buffered path writes). A fetched page
    /// is read back soon at most once, and then from disk or from
    /// memory ([`crate::cache`]'s fresh pages), so a page-cache copy of it
    /// would only cost CPU. Written over a spare file where one is left
    /// (see `spares.rs`), then cut to the page's length: the header's room
    /// then holds the spare's zeros. Ok(false): the filesystem refuses
    /// direct I/O (nothing is left behind).
    fn stage_direct(&self, path: &Path, data: &[u8]) -> io::Result<bool> {
        // The length of the spare written over, if one was left.
        let spare = self
            .spares
            .get()
            .filter(|s| s.take_to(path))
            .map(|s| s.file_len());
        let Some(file) = lakecache_protocol::direct_io::open_direct(path, spare.is_none()) else {
            let _ = fs::remove_file(path);
            return Ok(false);
        };
        let written = crate::crashsim::created(path)
            .and_then(|()| lakecache_protocol::direct_io::write_direct(&file, data, HEADER_LEN))
            .and_then(|()| {
                // The last block went out padded with zeros; a spare may
                // be longer than the page.
                let len = HEADER_LEN + data.len() as u64;
                let aligned = len.is_multiple_of(lakecache_protocol::direct_io::DIRECT_ALIGN);
                match spare {
                    Some(spare) if spare == len => Ok(()),
                    None if aligned => Ok(()),
                    _ => file.set_len(len),
                }
            });
        match written {
            Ok(()) => Ok(true),
            Err(e) => {
                let _ = fs::remove_file(path);
                // EINVAL: an alignment this device does not take.
                if e.raw_os_error() == Some(libc::EINVAL) {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Like `stage`, and starts writing the bytes to the disk now (without
    /// waiting), so the sync before the acknowledgement finds little left
    /// to do. For pages that will be synced (write-back).
    pub fn stage_for_sync(&self, data: &[u8]) -> io::Result<Staged> {
        self.stage_with(data, true, true)
    }

    /// [`Self::stage_for_sync`] through the page cache even where
    /// `O_DIRECT` works: the kernel's writeback streams a large body to
    /// the device faster than direct writes of one page at a time, at the
    /// cost of a copy, which pays where the CPU is not the limit.
    pub fn stage_buffered_for_sync(&self, data: &[u8]) -> io::Result<Staged> {
        self.stage_with(data, true, false)
    }

    /// Writes the header of a staged page and moves it into place; on
    /// error the staged file is removed.
    pub fn commit(&self, staged: Staged, key: &PageKey, id: &PageId) -> io::Result<()> {
        let done = self.label_and_move(&staged, key, id, false);
        if done.is_err() {
            self.discard_staged(staged);
        }
        done
    }

    /// Writes the header, syncs the file when asked (data and header in
    /// one sync), and renames it into place.
    fn label_and_move(
        &self,
        staged: &Staged,
        key: &PageKey,
        id: &PageId,
        sync: bool,
    ) -> io::Result<()> {
        if staged.len != id.len {
            return Err(io::Error::other(format!(
                "page {} holds {} bytes, expected {}",
                id.index, staged.len, id.len
            )));
        }
        let header = Header {
            id: *id,
            crcs: staged.crcs.clone(),
            valid: vec![true; staged.crcs.len()],
        };
        crate::crashsim::alive(&staged.path)?;
        let file = fs::OpenOptions::new().write(true).open(&staged.path)?;
        file.write_all_at(&header.encode(), 0)?;
        if sync {
            crate::crashsim::sync_file(&staged.path, &file, || file.sync_data())?;
        }
        let dest = self.path(key);
        if let Some(parent) = dest.parent() {
            mkdir_private(parent)?;
        }
        crate::crashsim::rename(&staged.path, &dest, || fs::rename(&staged.path, &dest))
    }

    /// Like `commit`, with the page's bytes and header synced before the
    /// rename; returns the directory the page landed in, which the caller
    /// syncs (once for many pages) before calling the page durable.
    pub fn commit_synced(&self, staged: Staged, key: &PageKey, id: &PageId) -> io::Result<PathBuf> {
        match self.label_and_move(&staged, key, id, true) {
            Ok(()) => Ok(self
                .path(key)
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default()),
            Err(e) => {
                self.discard_staged(staged);
                Err(e)
            }
        }
    }

    /// Labels, syncs and moves a page into place, and syncs the directory
    /// it lands in, while the rest of its body is still being taken: the
    /// commit at the body's end then has only its last pages and the
    /// store's root left to sync. `staged` is left as it was (its CRCs
    /// still count; its file is gone once this succeeds). On an error
    /// the caller discards the staged file and removes the page.
    pub fn place_synced(&self, staged: &Staged, key: &PageKey, id: &PageId) -> io::Result<()> {
        self.label_and_move(staged, key, id, true)?;
        let dest = self.path(key);
        let dir = dest.parent().unwrap_or(&self.pages);
        crate::crashsim::sync_dir(dir, || fs::File::open(dir)?.sync_all())
    }

    /// Syncs page directories (and the store's root, which may have
    /// gained them), so renames into them survive a power loss.
    pub fn sync_dirs<'a>(&self, dirs: impl IntoIterator<Item = &'a PathBuf>) -> io::Result<()> {
        for dir in dirs {
            crate::crashsim::sync_dir(dir, || fs::File::open(dir)?.sync_all())?;
        }
        crate::crashsim::sync_dir(&self.pages, || fs::File::open(&self.pages)?.sync_all())
    }

    /// Moves a whole page into `to` under a new identity (a written
    /// object's page once S3 named its version): the header is checked
    /// against `from_id`, rewritten for `to_id`, and the file renamed.
    pub fn move_to(
        &self,
        from_key: &PageKey,
        from_id: &PageId,
        to: &PageStore,
        to_key: &PageKey,
        to_id: &PageId,
    ) -> Result<(), PageReadError> {
        let path = self.path(from_key);
        let file = match fs::OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(PageReadError::Missing),
            Err(e) => return Err(e.into()),
        };
        let mut raw = vec![0u8; HEADER_LEN as usize];
        read_exact(&file, &mut raw, 0)?;
        let mut header = Header::decode(&raw, from_id)?;
        if to_id.len != from_id.len {
            return Err(PageReadError::Corrupt("page length differs".into()));
        }
        header.id = *to_id;
        let encoded = header.encode();
        crate::crashsim::cut_point(&path)?;
        crate::crashsim::overwriting(&path, &file, 0, encoded.len())?;
        file.write_all_at(&encoded, 0)?;
        let dest = to.path(to_key);
        if let Some(parent) = dest.parent() {
            mkdir_private(parent)?;
        }
        crate::crashsim::rename(&path, &dest, || fs::rename(&path, &dest))?;
        Ok(())
    }

    /// Every page file's path (dirty pages left by writes never acknowledged).
    pub fn all_pages(&self) -> Vec<PathBuf> {
        let Ok(shards) = fs::read_dir(&self.pages) else {
            return Vec::new();
        };
        shards
            .flatten()
            .filter_map(|s| fs::read_dir(s.path()).ok())
            .flat_map(|files| files.flatten().map(|f| f.path()))
            .collect()
    }

    /// Stage + commit: the page appears whole or not at all.
    pub fn write(&self, key: &PageKey, id: &PageId, data: &[u8]) -> io::Result<()> {
        let staged = self.stage(data)?;
        self.commit(staged, key, id)
    }

    /// Writes `data` as the blocks from `first` on of page `id`'s file
    /// (created partly filled if absent; `data` ends on a block boundary
    /// or at the end of the page); returns which blocks the file holds
    /// now.
    pub fn fill(
        &self,
        key: &PageKey,
        id: &PageId,
        first: usize,
        data: &[u8],
    ) -> io::Result<FilledBlocks> {
        self.fill_then(key, id, first, data, |filled| filled)
    }

    /// [`Self::fill`], handing which blocks the file holds to `then`
    /// before another fill of the page can start: fills of one page that
    /// record what they left in order, so an earlier fill's view (fewer
    /// blocks) never lands after a later one's.
    pub fn fill_then<T>(
        &self,
        key: &PageKey,
        id: &PageId,
        first: usize,
        data: &[u8],
        then: impl FnOnce(FilledBlocks) -> T,
    ) -> io::Result<T> {
        let start = first as u64 * CHECK_BLOCK;
        let end = start + data.len() as u64;
        if id.blocks() > MAX_BLOCKS
            || end > id.len
            || (!end.is_multiple_of(CHECK_BLOCK) && end != id.len)
            || data.is_empty()
        {
            return Err(io::Error::other(
                "fill is not block-aligned within the page",
            ));
        }
        crate::crashsim::alive(&self.pages)?;
        let stripe = key.0[0] as usize % FILL_LOCKS;
        let _guard = self.fill_locks[stripe]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let path = self.path(key);
        if let Some(parent) = path.parent() {
            mkdir_private(parent)?;
        }
        let (file, direct) = self.open_for_fill(&path)?;
        let mut header = if direct {
            let mut raw = lakecache_protocol::buffer_pool::take(HEADER_LEN as usize);
            match read_aligned(&file, &mut raw, HEADER_LEN as usize, 0) {
                Ok(()) => Header::decode(&raw, id).unwrap_or_else(|_| Header::empty(*id)),
                // A new (empty) file.
                Err(PageReadError::Corrupt(_)) => Header::empty(*id),
                Err(PageReadError::Io(e)) => return Err(e),
                Err(e) => return Err(io::Error::other(e.to_string())),
            }
        } else {
            let mut raw = vec![0u8; HEADER_LEN as usize];
            match file.read_exact_at(&mut raw, 0) {
                Ok(()) => Header::decode(&raw, id).unwrap_or_else(|_| Header::empty(*id)),
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Header::empty(*id),
                Err(e) => return Err(e),
            }
        };
        // Data before header: a crash in between leaves blocks unmarked.
        if direct {
            lakecache_protocol::direct_io::write_direct(&file, data, HEADER_LEN + start)?;
            // The page's last block went out padded with zeros.
            if end == id.len
                && !(HEADER_LEN + end).is_multiple_of(lakecache_protocol::direct_io::DIRECT_ALIGN)
            {
                file.set_len(HEADER_LEN + end)?;
            }
        } else {
            file.write_all_at(data, HEADER_LEN + start)?;
        }
        for (i, crc) in block_crcs(data).into_iter().enumerate() {
            header.crcs[first + i] = crc;
            header.valid[first + i] = true;
        }
        let encoded = header.encode();
        if direct {
            lakecache_protocol::direct_io::write_direct(&file, &encoded, 0)?;
        } else {
            file.write_all_at(&encoded, 0)?;
        }
        Ok(then(FilledBlocks::of(&header.valid)))
    }

    /// A page file opened (created if absent) for a partial fill, with
    /// `O_DIRECT` where allowed (`true`), as whole pages are written: a
    /// fill through the page cache cost a copy into it, the kernel's
    /// writeback later, and a flush whenever a direct read of the file
    /// came first (a plan's reads fill every sample's blocks so).
    fn open_for_fill(&self, path: &Path) -> io::Result<(fs::File, bool)> {
        let mut options = fs::OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        self.open_page_file(path, &options)
    }

    /// Reads `range` (page-relative) of the page `id`, checking the header
    /// and the CRC of every block it touches.
    pub fn read(
        &self,
        key: &PageKey,
        id: &PageId,
        range: Range<u64>,
    ) -> Result<Bytes, PageReadError> {
        let len = range.end.saturating_sub(range.start);
        let opened = self.open_checked(key, id, range)?;
        let first = (opened.file_offset - HEADER_LEN) / CHECK_BLOCK;
        // A reused buffer: a fresh multi-MiB one costs a page fault and
        // a page clear per 4 KiB before the read even starts.
        let mut buf = lakecache_protocol::buffer_pool::take(opened.read_len as usize);
        read_aligned(
            &opened.file,
            &mut buf,
            opened.read_len as usize,
            opened.file_offset,
        )?;
        for (i, (chunk, crc)) in buf
            .chunks(CHECK_BLOCK as usize)
            .zip(&opened.crcs)
            .enumerate()
        {
            if *crc != crc32c::crc32c(chunk) {
                return Err(PageReadError::Corrupt(format!(
                    "CRC mismatch in block {}",
                    first + i as u64
                )));
            }
        }
        let buf = lakecache_protocol::buffer_pool::freeze(buf);
        Ok(buf.slice(opened.skip as usize..(opened.skip + len) as usize))
    }

    /// The page file of `id` opened for a reader on this host, after
    /// checking its header and that every block `range` touches is
    /// filled: the file, where those blocks start in it, and their CRCs.
    /// The reader reads and checks the blocks itself.
    pub fn open_checked(
        &self,
        key: &PageKey,
        id: &PageId,
        range: Range<u64>,
    ) -> Result<CheckedFile, PageReadError> {
        if range.end > id.len || range.start >= range.end {
            return Err(PageReadError::Corrupt(format!(
                "range {range:?} outside a page of {} bytes",
                id.len
            )));
        }
        let file = match self.open_for_read(&self.path(key)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(PageReadError::Missing),
            Err(e) => return Err(e.into()),
        };
        let first = (range.start / CHECK_BLOCK) as usize;
        let last = range.end.div_ceil(CHECK_BLOCK) as usize;
        let mut raw = lakecache_protocol::buffer_pool::take(HEADER_LEN as usize);
        read_aligned(&file, &mut raw, HEADER_LEN as usize, 0)?;
        let header = Header::decode(&raw, id)?;
        if let Some(missing) = (first..last).find(|b| !header.valid[*b]) {
            let upto = (missing..last).find(|b| header.valid[*b]).unwrap_or(last);
            return Err(PageReadError::Unfilled(missing..upto));
        }
        let start = first as u64 * CHECK_BLOCK;
        Ok(CheckedFile {
            file,
            file_offset: HEADER_LEN + start,
            read_len: (last as u64 * CHECK_BLOCK).min(id.len) - start,
            block: CHECK_BLOCK,
            crcs: header.crcs[first..last].to_vec(),
            skip: range.start - start,
        })
    }

    /// A page file opened for reading, with `O_DIRECT` where allowed:
    /// pages are written around the page cache, so a read through it
    /// would only add a copy and a cached page nobody reads again.
    fn open_for_read(&self, path: &Path) -> io::Result<fs::File> {
        let mut options = fs::OpenOptions::new();
        options.read(true);
        self.open_page_file(path, &options).map(|(file, _)| file)
    }

    /// Opens `path` with `options`, and `O_DIRECT` (`true`) until the
    /// filesystem refuses it: every later open then goes through the page
    /// cache, not through a failed open first.
    fn open_page_file(
        &self,
        path: &Path,
        options: &fs::OpenOptions,
    ) -> io::Result<(fs::File, bool)> {
        if self.direct.load(Ordering::Relaxed) {
            use std::os::unix::fs::OpenOptionsExt;
            match options.clone().custom_flags(libc::O_DIRECT).open(path) {
                Ok(file) => return Ok((file, true)),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        Ok((options.open(path)?, false))
    }

    pub fn remove(&self, key: &PageKey) {
        let path = self.path(key);
        // A machine whose power went out (in a test) removes nothing.
        if crate::crashsim::alive(&path).is_err() {
            return;
        }
        if let Err(e) = crate::crashsim::remove(&path, || fs::remove_file(&path)) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(page = %key.hex(), error = %e, "removing page file failed");
            }
        }
    }

    pub fn discard_staged(&self, staged: Staged) {
        self.discard_staged_path(&staged);
    }

    /// [`Self::discard_staged`] for a page whose CRCs are still wanted.
    pub fn discard_staged_path(&self, staged: &Staged) {
        if crate::crashsim::alive(&staged.path).is_err() {
            return;
        }
        let _ = fs::remove_file(&staged.path);
    }
}

/// Reads `len` bytes at `at` (aligned) into `buf`, asking for whole 4 KiB
/// blocks as `O_DIRECT` requires; the file may end within the last one.
/// A short file is a corrupt page, not an I/O failure.
fn read_aligned(
    file: &fs::File,
    buf: &mut lakecache_protocol::buffer_pool::PoolBuf,
    len: usize,
    at: u64,
) -> Result<(), PageReadError> {
    buf.set_len(len.next_multiple_of(lakecache_protocol::buffer_pool::ALIGN));
    let mut got = 0;
    while got < len {
        match file.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    if got < len {
        return Err(PageReadError::Corrupt(
            "page file shorter than its header says".into(),
        ));
    }
    buf.set_len(len);
    Ok(())
}

/// A short file is a corrupt page, not an I/O failure.
fn read_exact(file: &fs::File, buf: &mut [u8], at: u64) -> Result<(), PageReadError> {
    file.read_exact_at(buf, at).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            PageReadError::Corrupt("page file shorter than its header says".into())
        } else {
            e.into()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_keys_are_stable_and_distinct() {
        let a = PageKey::new("s3://b/k", "e1", 0);
        assert_eq!(a, PageKey::new("s3://b/k", "e1", 0));
        assert_ne!(a, PageKey::new("s3://b/k", "e2", 0));
        assert_ne!(a, PageKey::new("s3://b/k", "e1", 1));
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        assert_ne!(PageKey::new("ab", "c", 0), PageKey::new("a", "bc", 0));
        // Pinned value: placement of files must not change across builds.
        assert_eq!(
            &PageKey::new("s3://bucket/key", "etag", 7).hex()[..16],
            &PAGE_KEY_PIN[..16]
        );
    }

    const PAGE_KEY_PIN: &str = include_str!("../testdata/page_key_pin.txt");

    fn sample(len: u64) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn reads_verify_header_and_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let store = PageStore::open(dir.path()).unwrap();
        let key = PageKey::new("s3://b/k", "e", 0);
        let data = sample(CHECK_BLOCK * 2 + 100);
        let id = PageId::new("s3://b/k", "e", 0, 4 << 20, data.len() as u64);
        store.write(&key, &id, &data).unwrap();
        let got = store.read(&key, &id, 10..CHECK_BLOCK + 5).unwrap();
        assert_eq!(&got[..], &data[10..CHECK_BLOCK as usize + 5]);
        // Written around the page cache where allowed: the last block went
        // out padded, and the file still ends where the page does.
        let path = store.path(&key);
        assert_eq!(
            fs::metadata(&path).unwrap().len(),
            HEADER_LEN + data.len() as u64
        );
        let tail = store.read(&key, &id, data.len() as u64 - 150..data.len() as u64);
        assert_eq!(&tail.unwrap()[..], &data[data.len() - 150..]);
        // The same file read as another page size, ETag or index is refused.
        for other in [
            PageId::new("s3://b/k", "e", 0, 8 << 20, data.len() as u64),
            PageId::new("s3://b/k", "f", 0, 4 << 20, data.len() as u64),
            PageId::new("s3://b/j", "e", 0, 4 << 20, data.len() as u64),
        ] {
            assert!(matches!(
                store.read(&key, &other, 0..10),
                Err(PageReadError::Corrupt(_))
            ));
        }
        // A file cut short in its last block is refused.
        let mut raw = fs::read(&path).unwrap();
        fs::write(&path, &raw[..raw.len() - 1]).unwrap();
        assert!(matches!(
            store.read(&key, &id, 0..data.len() as u64),
            Err(PageReadError::Corrupt(_))
        ));
        // Flip one byte in the second block: only reads touching it fail.
        raw[(HEADER_LEN + CHECK_BLOCK + 1) as usize] ^= 0xff;
        fs::write(&path, &raw).unwrap();
        assert!(store.read(&key, &id, 0..10).is_ok());
        assert!(matches!(
            store.read(&key, &id, 0..CHECK_BLOCK + 2),
            Err(PageReadError::Corrupt(_))
        ));
        // A damaged header is refused outright.
        raw[20] ^= 1;
        fs::write(&path, &raw).unwrap();
        assert!(matches!(
            store.read(&key, &id, 0..10),
            Err(PageReadError::Corrupt(_))
        ));
        store.remove(&key);
        assert!(matches!(
            store.read(&key, &id, 0..1),
            Err(PageReadError::Missing)
        ));
    }

    #[test]
    fn partial_fills_serve_only_filled_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let store = PageStore::open(dir.path()).unwrap();
        let key = PageKey::new("s3://b/p", "e", 3);
        let data = sample(CHECK_BLOCK * 4 - 7);
        let id = PageId::new(
            "s3://b/p",
            "e",
            3,
            CHECK_BLOCK * 4,
            3 * CHECK_BLOCK * 4 + data.len() as u64,
        );
        assert_eq!(id.len, data.len() as u64);
        let b = CHECK_BLOCK as usize;
        let filled = store.fill(&key, &id, 2, &data[2 * b..3 * b]).unwrap();
        assert!(!filled.whole(&id) && filled.covers(2..3) && !filled.covers(1..3));
        assert_eq!(filled.bytes(&id), CHECK_BLOCK);
        let got = store
            .read(&key, &id, 2 * CHECK_BLOCK + 5..2 * CHECK_BLOCK + 9)
            .unwrap();
        assert_eq!(&got[..], &data[2 * b + 5..2 * b + 9]);
        assert!(matches!(
            store.read(&key, &id, 0..10),
            Err(PageReadError::Unfilled(r)) if r == (0..1)
        ));
        assert!(matches!(
            store.read(&key, &id, 0..CHECK_BLOCK * 4 - 7),
            Err(PageReadError::Unfilled(r)) if r == (0..2)
        ));
        // Misaligned fills are refused.
        assert!(store.fill(&key, &id, 0, &data[..10]).is_err());
        assert!(!store.fill(&key, &id, 0, &data[..2 * b]).unwrap().whole(&id));
        // The last block is short: the page's bytes, not four blocks'.
        let filled = store.fill(&key, &id, 3, &data[3 * b..]).unwrap();
        assert!(filled.whole(&id));
        assert_eq!(filled.bytes(&id), id.len);
        // A direct fill writes the short block padded; the file ends
        // where the page does.
        let file_len = fs::metadata(store.path(&key)).unwrap().len();
        assert_eq!(file_len, HEADER_LEN + id.len);
        let all = store.read(&key, &id, 0..data.len() as u64).unwrap();
        assert_eq!(&all[..], &data[..]);
    }

    #[test]
    fn concurrent_fills_of_a_page_record_what_they_left_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(PageStore::open(dir.path()).unwrap());
        const BLOCKS: u64 = 16;
        let key = PageKey::new("s3://b/p", "e", 0);
        let id = PageId::new(
            "s3://b/p",
            "e",
            0,
            CHECK_BLOCK * BLOCKS,
            CHECK_BLOCK * BLOCKS,
        );
        let data = std::sync::Arc::new(sample(CHECK_BLOCK * BLOCKS));
        // What each fill recorded, in the order recorded (as the cache
        // records it for its accounting).
        let recorded = std::sync::Arc::new(Mutex::new(Vec::new()));
        let fills: Vec<_> = (0..BLOCKS as usize)
            .map(|b| {
                let (store, data, recorded) = (store.clone(), data.clone(), recorded.clone());
                std::thread::spawn(move || {
                    let c = CHECK_BLOCK as usize;
                    store
                        .fill_then(&key, &id, b, &data[b * c..(b + 1) * c], |filled| {
                            recorded.lock().unwrap().push(filled.bytes(&id));
                        })
                        .unwrap();
                })
            })
            .collect();
        for f in fills {
            f.join().unwrap();
        }
        let recorded = recorded.lock().unwrap().clone();
        // Each fill adds a block: recorded in order, each view holds one
        // block more than the one before, and the last is the whole page.
        let want: Vec<u64> = (1..=BLOCKS).map(|n| n * CHECK_BLOCK).collect();
        assert_eq!(recorded, want);
    }

    #[test]
    fn a_pages_crc_from_its_block_crcs_is_the_crc_of_its_bytes() {
        for len in [
            1usize,
            4096,
            CHECK_BLOCK as usize,
            1 << 20,
            (1 << 20) - 7,
            700_001,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
            let staged = Staged {
                path: PathBuf::new(),
                crcs: block_crcs(&data),
                len: len as u64,
                whole: Default::default(),
            };
            assert_eq!(staged.crc(), crc32c::crc32c(&data), "{len} bytes");
        }
        let (a, b) = (b"checkpoint ".to_vec(), b"bytes".to_vec());
        let joined = [a.clone(), b.clone()].concat();
        assert_eq!(
            combine_crcs([
                (crc32c::crc32c(&a), a.len() as u64),
                (crc32c::crc32c(&b), b.len() as u64)
            ]),
            crc32c::crc32c(&joined)
        );
    }
}
