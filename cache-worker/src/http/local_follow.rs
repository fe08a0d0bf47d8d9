//! The body of a followed commit: a file the mount's application is still
//! writing (through FUSE passthrough), taken a page at a time as it grows
//! so that the commit at close has only the tail and the syncs left.
//!
//! The worker sees no writes, only the file's length, so a page taken
//! early may be written again before the seal (a writer that seeks back
//! to patch a header). Each early page's CRC32C is kept, and at the seal
//! every early page is read again and compared: a file that changed
//! after it was taken fails the commit ([`CacheError::FollowedFileChanged`]),
//! and the mount commits it whole.

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::buffer_pool;
use tokio::sync::watch;

use super::local_commit::{Body, Seal};
use crate::cache::CacheError;

/// How soon a growing file is looked at again, at first and at most.
const FIRST_LOOK: Duration = Duration::from_millis(5);
const LAST_LOOK: Duration = Duration::from_millis(200);

struct Following {
    file: Arc<std::fs::File>,
    page: u64,
    limit: u64,
    taken: Arc<AtomicU64>,
    sealed: watch::Receiver<Seal>,
    /// Bytes taken so far.
    at: u64,
    /// CRC32C of each whole page taken before the seal, in order.
    early: Vec<u32>,
    look: Duration,
}

/// The followed file's bytes, as [`Seal`] says when they are complete.
pub(super) fn followed_body(
    file: Arc<std::fs::File>,
    page: usize,
    limit: u64,
    taken: Arc<AtomicU64>,
    sealed: watch::Receiver<Seal>,
) -> Body {
    let state = Following {
        file,
        page: page.max(4096) as u64,
        limit,
        taken,
        sealed,
        at: 0,
        early: Vec::new(),
        look: FIRST_LOOK,
    };
    Box::pin(futures::stream::try_unfold(state, |mut f| async move {
        loop {
            let seal = *f.sealed.borrow();
            match seal {
                Seal::At(size) if f.at >= size => {
                    if f.at > size {
                        return Err(CacheError::Invalid(format!(
                            "the followed file was sealed at {size} bytes after {} were taken",
                            f.at
                        )));
                    }
                    f.check_early().await?;
                    return Ok(None);
                }
                Seal::At(size) => {
                    let n = f.page.min(size - f.at);
                    let piece = f.take(n, false).await?;
                    return Ok(Some((piece, f)));
                }
                Seal::Open => {
                    let len = f.file.metadata().map_or(0, |m| m.len());
                    if len >= f.at + f.page {
                        f.look = FIRST_LOOK;
                        let piece = f.take(f.page, true).await?;
                        return Ok(Some((piece, f)));
                    }
                    tokio::select! {
                        changed = f.sealed.changed() => if changed.is_err() {
                            return Err(CacheError::Invalid(
                                "the mount ended a followed commit before sealing it; nothing was recorded".into(),
                            ));
                        },
                        () = tokio::time::sleep(f.look) => f.look = (f.look * 2).min(LAST_LOOK),
                    }
                }
            }
        }
    }))
}

impl Following {
    /// The next `n` bytes of the file, remembered for the check at the
    /// seal when taken `early`.
    async fn take(&mut self, n: u64, early: bool) -> Result<Bytes, CacheError> {
        if self.at + n > self.limit {
            return Err(CacheError::BodyTooLarge(self.limit));
        }
        let (file, at) = (self.file.clone(), self.at);
        let piece = tokio::task::spawn_blocking(move || {
            buffer_pool::read_at(&file, at, n as usize).map(|b| {
                let crc = early.then(|| crc32c::crc32c(&b));
                (b, crc)
            })
        })
        .await
        .map_err(crate::cache::join_failed)?
        .map_err(|e| {
            CacheError::Invalid(format!(
                "reading the followed file at {at}: {e} (truncated while written?)"
            ))
        })?;
        let (piece, crc) = piece;
        self.early.extend(crc);
        self.at += n;
        self.taken.fetch_add(n, Ordering::Relaxed);
        Ok(piece)
    }

    /// Every page taken before the seal still holds what was taken.
    async fn check_early(&mut self) -> Result<(), CacheError> {
        let (file, page, early) = (
            self.file.clone(),
            self.page,
            std::mem::take(&mut self.early),
        );
        tokio::task::spawn_blocking(move || -> Result<(), CacheError> {
            let mut buf = vec![0u8; page as usize];
            for (index, want) in early.into_iter().enumerate() {
                let at = index as u64 * page;
                file.read_exact_at(&mut buf, at).map_err(|e| {
                    CacheError::Invalid(format!("checking the followed file at {at}: {e}"))
                })?;
                if crc32c::crc32c(&buf) != want {
                    return Err(CacheError::FollowedFileChanged(format!(
                        "the followed file changed at bytes {at}..{} after they were taken; nothing was recorded",
                        at + page
                    )));
                }
            }
            Ok(())
        })
        .await
        .map_err(crate::cache::join_failed)?
    }
}
