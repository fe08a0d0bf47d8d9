//! Pushes the bytes of an object a random reader wants whole into the
//! kernel's page cache for its inode (FUSE_NOTIFY_STORE), as the
//! background fetch brings them. The reader's later reads of those pages
//! are then answered by the kernel without a request to this process: a
//! shuffling loader reads a 2 GiB shard at page-cache speed once it has
//! arrived, where a FUSE round trip per 4 KiB read held it to ~45,000
//! IOPS on 2 cores.
//!
//! Pushing is an optimisation, never needed for a correct read: a piece
//! that finds the queue full is dropped, and the kernel asks for what it
//! lacks as usual. What must never happen is bytes of one version landing
//! in the page cache of an inode that shows other bytes. A push happens
//! only while the inode's `page_cache_etag` and `meta.etag` are the
//! pushed version and no writer holds it (checked under the inode table's
//! lock, which also marks the inode as being stored to); whoever takes
//! the inode away from that version (a writer claiming it, a truncation)
//! first changes those fields, then calls [`KernelCache::settle`] to wait
//! for a store already under way, before the kernel is answered and
//! drops its cached pages.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::inode::{Inode, InodeTable};
use crate::memory::Reservation;

/// Bytes per store: the kernel copies them with the connection's lock
/// free, page by page; small enough that a writer waiting in
/// [`KernelCache::settle`] waits a fraction of a millisecond.
const STORE_CHUNK: usize = 256 << 10;
/// Pieces waiting to be pushed at most, in bytes and in number.
const QUEUE_BYTES: u64 = 64 << 20;
const QUEUE_DEPTH: usize = 64;
/// A writer gives up waiting for a store after this long (a store only
/// waits for a page the kernel is reading from this process, which is
/// answered without it).
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// Where stores go: the kernel's FUSE connection, or a recorder in tests.
pub trait PageCacheStore: Send + Sync {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> std::io::Result<()>;
}

impl PageCacheStore for fuser::Notifier {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> std::io::Result<()> {
        fuser::Notifier::store(self, fuser::INodeNo(ino), offset, data)
    }
}

struct Piece {
    key: String,
    etag: String,
    offset: u64,
    bytes: Bytes,
    _memory: Reservation,
}

#[derive(Default)]
struct Readers {
    /// Open read handles by version ("uri\netag"): handle -> inode.
    by_version: HashMap<String, HashMap<u64, u64>>,
    /// Each registered handle's version key.
    by_handle: HashMap<u64, String>,
}

#[derive(Default)]
pub struct PushStats {
    pub pushed_bytes: AtomicU64,
    pub dropped_bytes: AtomicU64,
}

pub struct KernelCache {
    enabled: bool,
    inodes: Arc<InodeTable>,
    store: OnceLock<Box<dyn PageCacheStore>>,
    readers: Mutex<Readers>,
    /// The inode a store is being made to now (one push thread).
    storing: Mutex<Option<u64>>,
    queued: Mutex<u64>,
    queue: OnceLock<SyncSender<Piece>>,
    /// Set when the kernel refused a store: pushing stops for the mount.
    refused: AtomicBool,
    stats: PushStats,
}

fn version_key(uri: &str, etag: &str) -> String {
    format!("{uri}\n{etag}")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KernelCache {
    pub fn new(inodes: Arc<InodeTable>, enabled: bool) -> Arc<Self> {
        Arc::new(Self {
            enabled,
            inodes,
            store: OnceLock::new(),
            readers: Mutex::default(),
            storing: Mutex::new(None),
            queued: Mutex::new(0),
            queue: OnceLock::new(),
            refused: AtomicBool::new(false),
            stats: PushStats::default(),
        })
    }

    /// Connects the pusher to the kernel (or a test's store) and starts
    /// its thread. Without a connection nothing is pushed.
    pub fn connect(self: &Arc<Self>, store: Box<dyn PageCacheStore>) {
        if !self.enabled || self.store.set(store).is_err() {
            return;
        }
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let this = self.clone();
        let spawned = std::thread::Builder::new()
            .name("lakecache-page-push".into())
            .spawn(move || this.run(rx));
        match spawned {
            Ok(_) => {
                let _ = self.queue.set(tx);
            }
            Err(e) => tracing::warn!(error = %e, "starting the page cache pusher failed"),
        }
    }

    pub fn stats(&self) -> &PushStats {
        &self.stats
    }

    /// A read handle `fh` of inode `ino` opened version `etag` of `uri`.
    pub fn opened(&self, fh: u64, ino: u64, uri: &str, etag: &str) {
        if !self.enabled {
            return;
        }
        let key = version_key(uri, etag);
        let mut readers = lock(&self.readers);
        readers
            .by_version
            .entry(key.clone())
            .or_default()
            .insert(fh, ino);
        readers.by_handle.insert(fh, key);
    }

    /// Handle `fh` was released.
    pub fn closed(&self, fh: u64) {
        let mut readers = lock(&self.readers);
        let Some(key) = readers.by_handle.remove(&fh) else {
            return;
        };
        if let Some(handles) = readers.by_version.get_mut(&key) {
            handles.remove(&fh);
            if handles.is_empty() {
                readers.by_version.remove(&key);
            }
        }
    }

    /// Offers bytes of version `etag` of `uri` at `offset`: queued for
    /// the inodes reading that version, or dropped when none is, or the
    /// pusher is behind. `memory` is held until the bytes are pushed.
    pub fn offer(&self, uri: &str, etag: &str, offset: u64, bytes: Bytes, memory: Reservation) {
        let Some(queue) = self.queue.get() else {
            return;
        };
        if self.refused.load(Ordering::Relaxed) || bytes.is_empty() {
            return;
        }
        let key = version_key(uri, etag);
        if !lock(&self.readers).by_version.contains_key(&key) {
            return;
        }
        let len = bytes.len() as u64;
        {
            let mut queued = lock(&self.queued);
            if *queued > 0 && *queued + len > QUEUE_BYTES {
                self.stats.dropped_bytes.fetch_add(len, Ordering::Relaxed);
                return;
            }
            *queued += len;
        }
        let piece = Piece {
            key,
            etag: etag.to_string(),
            offset,
            bytes,
            _memory: memory,
        };
        if queue.try_send(piece).is_err() {
            self.stats.dropped_bytes.fetch_add(len, Ordering::Relaxed);
            self.dequeued(len);
        }
    }

    fn dequeued(&self, len: u64) {
        let mut queued = lock(&self.queued);
        *queued = queued.saturating_sub(len);
    }

    /// Waits until no store to `ino` is under way. Call after taking the
    /// inode away from the version it showed (see the module's notes).
    pub async fn settle(&self, ino: u64) {
        let started = Instant::now();
        while *lock(&self.storing) == Some(ino) {
            if started.elapsed() > SETTLE_LIMIT {
                tracing::warn!(ino, "a page cache store is taking long; going on");
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn run(self: Arc<Self>, rx: Receiver<Piece>) {
        while let Ok(piece) = rx.recv() {
            let len = piece.bytes.len() as u64;
            if !self.refused.load(Ordering::Relaxed) {
                self.push(&piece);
            }
            self.dequeued(len);
        }
    }

    fn push(&self, piece: &Piece) {
        let Some(store) = self.store.get() else {
            return;
        };
        let inodes: Vec<u64> = {
            let readers = lock(&self.readers);
            let Some(handles) = readers.by_version.get(&piece.key) else {
                return;
            };
            let mut inos: Vec<u64> = handles.values().copied().collect();
            inos.sort_unstable();
            inos.dedup();
            inos
        };
        for ino in inodes {
            let mut at = piece.offset;
            for chunk in piece.bytes.chunks(STORE_CHUNK) {
                let end = at + chunk.len() as u64;
                let open = self.inodes.update(ino, |n| {
                    let open = shows_version(n, &piece.etag, end);
                    if open {
                        *lock(&self.storing) = Some(ino);
                    }
                    open
                });
                if open != Some(true) {
                    break;
                }
                let stored = store.store(ino, at, chunk);
                *lock(&self.storing) = None;
                if let Err(e) = stored {
                    // Pushing is only ever a shortcut: a kernel that will
                    // not take stores is asked nothing more.
                    tracing::info!(error = %e, ino, "the kernel refused a page cache store; pushing stops");
                    self.refused.store(true, Ordering::Relaxed);
                    return;
                }
                self.stats
                    .pushed_bytes
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                at = end;
            }
        }
    }
}

/// Whether the kernel may hold `etag`'s bytes up to `end` for `node`:
/// the version it shows and caches, with no writer changing it.
fn shows_version(node: &Inode, etag: &str, end: u64) -> bool {
    node.writer.is_none()
        && node.meta.etag.as_deref() == Some(etag)
        && node.page_cache_etag.as_deref() == Some(etag)
        && end <= node.meta.size
}

#[cfg(test)]
mod tests;
