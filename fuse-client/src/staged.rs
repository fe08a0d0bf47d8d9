//! Write-back files written into a local file (the staged file) instead
//! of through the mount: the kernel writes the application's bytes into
//! it directly (FUSE passthrough), so no byte crosses FUSE, the mount or
//! a socket while the file is written. At flush, fsync or close the file
//! is committed:
//! - by the worker on this host that takes the object's writes, which
//!   reads the file through a descriptor passed over its local socket
//!   and answers once the write is durable (pages and journal synced,
//!   copies made), exactly as for a write sent over HTTP;
//! - otherwise (no such worker, or it stalled) by streaming the file to
//!   the owning worker over HTTP, and again to the next one if that one
//!   stalls: the file is what a resend needs, kept until the answer.
//!
//! The mount sees none of the writes, so it tells a changed file by its
//! size and times: a file changed after a commit is committed again.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use bytes::Bytes;
use lakecache_protocol::{buffer_pool, ObjectStat, ObjectUri, UserMeta, WriteMode};

use crate::data_plane::{ByteStream, DataError, DataPlane, LocalFollow, UploadLimits};

/// Piece size when the file is streamed over HTTP.
const PIECE: u64 = 1 << 20;

/// What a file looked like when it was committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

pub(crate) struct StagedFile {
    file: Arc<File>,
    /// Write-back, or write-through for a file moved here by the mount
    /// (see [`Self::spooled`]): only write-back may be committed by the
    /// local worker.
    mode: WriteMode,
    /// The kernel writes it (passthrough), not the mount.
    kernel_writes: bool,
    committed: Option<Stamp>,
    /// The local worker taking the file while it is written, once the
    /// handover is made (see [`Self::follow`]).
    follow: Option<tokio::task::JoinHandle<Option<LocalFollow>>>,
}

impl StagedFile {
    /// An anonymous file in `dir`, gone once closed.
    pub fn create(dir: &std::path::Path) -> std::io::Result<Self> {
        Ok(Self {
            kernel_writes: true,
            ..Self::spooled(dir, WriteMode::Back)?
        })
    }

    /// An anonymous file in `dir` the mount itself writes (a file
    /// written out of order, moved off its streamed upload), committed
    /// in `mode`.
    pub fn spooled(dir: &std::path::Path, mode: WriteMode) -> std::io::Result<Self> {
        Ok(Self {
            file: Arc::new(crate::resend::tempfile_in(dir)?),
            mode,
            kernel_writes: false,
            committed: None,
            follow: None,
        })
    }

    /// Hands the file to the worker on this host that takes `uri`'s
    /// writes while the application writes it, so the first commit has
    /// only the tail left to take (the worker checks at the commit that
    /// what it took early is unchanged). Done in the background: the
    /// open is not held up by it.
    pub fn follow(
        &mut self,
        data: &Arc<dyn DataPlane>,
        uri: &ObjectUri,
        meta: &UserMeta,
        progress: std::time::Duration,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (data, uri, meta, file) = (data.clone(), uri.clone(), meta.clone(), self.file.clone());
        self.follow = Some(
            runtime.spawn(async move { data.follow_local(&uri, file, &meta, progress).await }),
        );
    }

    /// Written by the kernel through passthrough (see [`Self::create`]).
    pub fn kernel_writes(&self) -> bool {
        self.kernel_writes
    }

    pub fn file(&self) -> &Arc<File> {
        &self.file
    }

    fn stamp(&self) -> std::io::Result<Stamp> {
        let m = self.file.metadata()?;
        Ok(Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }

    /// The file's length (0 when it cannot be read: commit says why).
    pub fn len(&self) -> u64 {
        self.file.metadata().map_or(0, |m| m.len())
    }

    /// Changed since its last commit (or never committed).
    pub fn changed(&self) -> bool {
        match (self.committed, self.stamp()) {
            (Some(then), Ok(now)) => then != now,
            _ => true,
        }
    }

    pub fn set_len(&self, size: u64) -> std::io::Result<()> {
        self.file.set_len(size)
    }

    /// Commits the file as it is now (see the module docs).
    pub async fn commit(
        &mut self,
        data: &Arc<dyn DataPlane>,
        uri: &ObjectUri,
        limits: UploadLimits,
        meta: &UserMeta,
        resends: usize,
    ) -> Result<ObjectStat, DataError> {
        let stamp = self
            .stamp()
            .map_err(|e| DataError::Spool(format!("the staged file: {e}")))?;
        let size = stamp.len;
        let mut avoid = Vec::new();
        let local = match self.sealed(data, uri, size, meta).await {
            Some(Ok(stat)) => Some(Ok(stat)),
            stalled @ Some(Err(DataError::Stalled { .. })) => stalled,
            // A local commit is a write-back.
            _ if self.mode != WriteMode::Back => None,
            _ => {
                data.commit_local(uri, self.file.clone(), size, meta, limits.progress)
                    .await
            }
        };
        let result = match local {
            Some(Ok(stat)) => {
                crate::metrics::global().local_commit(size);
                Ok(stat)
            }
            Some(Err(DataError::Stalled { worker, .. })) => {
                tracing::warn!(%uri, %worker, "the local worker stalled on the commit; sending the file to the next worker");
                crate::metrics::global().write_resend();
                avoid.push(worker);
                self.stream(data, uri, limits, meta, &mut avoid, resends)
                    .await
            }
            Some(Err(e)) => Err(e),
            None => {
                self.stream(data, uri, limits, meta, &mut avoid, resends)
                    .await
            }
        };
        let result = result.and_then(|stat| {
            if stat.size == size {
                Ok(stat)
            } else {
                Err(DataError::SizeMismatch {
                    stored: stat.size,
                    sent: size,
                })
            }
        });
        if result.is_ok() {
            self.committed = Some(stamp);
        }
        result
    }

    /// The commit of a followed file, sealed at `size`. `None`: it was
    /// not followed. An error other than a stall: committed whole instead
    /// (a file changed after the worker took it, metadata changed under
    /// copies, a worker that restarted meanwhile).
    async fn sealed(
        &mut self,
        data: &Arc<dyn DataPlane>,
        uri: &ObjectUri,
        size: u64,
        meta: &UserMeta,
    ) -> Option<Result<ObjectStat, DataError>> {
        let follow = self.follow.take()?.await.ok().flatten()?;
        let sealed = data.seal_local(uri, follow, size, meta).await;
        match &sealed {
            Some(Ok(_)) => crate::metrics::global().followed_commit(),
            Some(Err(DataError::Stalled { .. })) => {}
            Some(Err(e)) => {
                tracing::info!(%uri, error = %e, "the followed commit failed; committing the file whole")
            }
            None => {}
        }
        sealed
    }

    /// Streams the file over HTTP, to the next worker after each stall.
    async fn stream(
        &self,
        data: &Arc<dyn DataPlane>,
        uri: &ObjectUri,
        limits: UploadLimits,
        meta: &UserMeta,
        avoid: &mut Vec<String>,
        resends: usize,
    ) -> Result<ObjectStat, DataError> {
        loop {
            let body = file_stream(self.file.clone(), self.len());
            match data.upload(uri, body, limits, self.mode, meta, avoid).await {
                Err(DataError::Stalled { worker, .. }) if avoid.len() < resends => {
                    tracing::warn!(%uri, %worker, "the write's worker stalled; sending the staged file to the next worker");
                    crate::metrics::global().write_resend();
                    avoid.push(worker);
                }
                other => return other,
            }
        }
    }
}

/// The first `size` bytes of `file`, in pooled pieces.
fn file_stream(file: Arc<File>, size: u64) -> ByteStream {
    Box::pin(futures::stream::try_unfold(0u64, move |at| {
        let file = file.clone();
        async move {
            if at >= size {
                return Ok(None);
            }
            let n = PIECE.min(size - at) as usize;
            let piece: Bytes =
                tokio::task::spawn_blocking(move || buffer_pool::read_at(&file, at, n))
                    .await
                    .map_err(|e| DataError::backend("reading the staged file", e))?
                    .map_err(|e| {
                        DataError::Spool(format!("reading the staged file at {at}: {e}"))
                    })?;
            Ok(Some((piece, at + n as u64)))
        }
    }))
}
