//! The mount's data plane: the few calls the filesystem core makes to
//! the outside world. The real one is the cache cluster
//! ([`lakecache_registry::ClusterClient`]); tests use [`MemoryDataPlane`],
//! optionally behind [`FaultyDataPlane`].

mod cluster;
mod faulty;
mod memory;
mod snapshot;

use std::error::Error as StdError;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use lakecache_protocol::{ListResponse, ObjectStat, ObjectUri, ReadKind, UserMeta, WriteMode};

pub use faulty::{DataFault, DataOp, FaultyDataPlane};
pub use memory::{MemoryDataPlane, Quirks};
pub use snapshot::{load_manifest, ManifestError, SnapshotDataPlane};

/// The body of a streaming upload: chunks in file order. An error item
/// (the mount could not read back what it spooled) fails the upload: the
/// body never just ends short.
/// A file the worker on this host is taking as it is written (see
/// [`DataPlane::follow_local`]), and which worker that is.
#[derive(Debug)]
pub struct LocalFollow {
    pub following: lakecache_protocol::local_read::Following,
    pub worker: String,
}

pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, DataError>> + Send + Sync>>;

/// How long an upload may take: in all, and without progress (no byte
/// taken while bytes wait, or no answer byte once the body is sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadLimits {
    pub total: Duration,
    pub progress: Duration,
}

/// A lower-level failure kept whole, so logs show its cause chain.
pub type Cause = Arc<dyn StdError + Send + Sync>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum DataError {
    #[error("no such object")]
    NotFound,
    /// The object is no longer the version the caller named.
    #[error("the object changed (expected ETag {expected:?}, found {found:?})")]
    Changed {
        expected: Option<String>,
        found: Option<String>,
    },
    /// The worker refused the caller's token (missing, expired, or not
    /// covering the object).
    #[error("access denied by the cache: {0}")]
    Denied(String),
    #[error("range {start}..{end} is outside the object")]
    InvalidRange { start: u64, end: u64 },
    #[error("object larger than a server-side copy allows")]
    CopyTooLarge,
    /// A body that ended early (a worker or store cut it).
    #[error("short body: expected {expected} bytes, got {got}")]
    ShortBody { expected: u64, got: u64 },
    /// The store kept a different number of bytes than were sent.
    #[error("the store holds {stored} bytes but {sent} were sent")]
    SizeMismatch { stored: u64, sent: u64 },
    /// S3 (behind the workers, or directly) cannot be reached or is
    /// throttling: the answer is unknown, not "no".
    #[error("the object store is unavailable: {0}")]
    StoreUnavailable(String),
    /// A mount pinned to a snapshot met an object that changed since.
    #[error("{key} changed since the snapshot: the snapshot pins ETag {pinned}, S3 now has {current}; the pinned version is not readable")]
    SnapshotMismatch {
        key: String,
        pinned: String,
        current: String,
    },
    /// An upload whose body the store stopped reading before the end.
    #[error("the upload ended before all its data was sent")]
    UploadCut,
    /// What the mount spooled to disk for a resend could not be read back.
    #[error("the write's spool file failed: {0}")]
    Spool(String),
    /// The worker taking an upload made no progress for the deadline:
    /// hung, or cut off without the connection saying so.
    #[error("worker {worker} made no progress on the write for {after:?} (--write-progress-timeout); the write was given up")]
    Stalled { worker: String, after: Duration },
    /// Anything else, with the failure that caused it.
    #[error("{context}")]
    Backend {
        context: &'static str,
        #[source]
        source: Cause,
    },
}

impl DataError {
    pub fn backend(context: &'static str, source: impl StdError + Send + Sync + 'static) -> Self {
        DataError::Backend {
            context,
            source: Arc::new(source),
        }
    }
}

/// What the filesystem core needs from the cache cluster and S3.
#[async_trait::async_trait]
pub trait DataPlane: Send + Sync + 'static {
    /// Size and version of one object.
    async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, DataError>;

    /// Exactly the bytes of `range` of the version tagged `etag`.
    async fn read(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, DataError>;

    /// [`Self::read`] of bytes the mount reads ahead of what a reader
    /// asked (`ReadKind::Ahead`), which the workers' plans count apart
    /// from demand reads; planes without plans read them alike.
    async fn read_as(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
        kind: ReadKind,
    ) -> Result<Bytes, DataError> {
        let _ = kind;
        self.read(uri, range, etag).await
    }

    /// Exactly `range` of version `etag`, read on the calling thread where
    /// the plane holds those bytes close at hand now (a worker on this
    /// host that has them cached), without waiting on a fetch: the mount
    /// answers such a read on its kernel-request thread. `None`: read
    /// with [`Self::read`] (planes without such a path always answer so).
    fn read_cached_now(&self, uri: &ObjectUri, range: Range<u64>, etag: &str) -> Option<Bytes> {
        let _ = (uri, range, etag);
        None
    }

    /// Exactly `range` of S3 version `version_id`, which must carry
    /// `etag`: an object version that is no longer the current one.
    async fn read_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, DataError> {
        let _ = (uri, range, version_id, etag);
        Err(DataError::StoreUnavailable(
            "this data plane cannot read object versions".into(),
        ))
    }

    /// Has the cache fetch version `etag` of the object whole, in the
    /// background (a random reader of it without a node-local tier);
    /// planes without a cache of their own do nothing.
    async fn warm(&self, uri: &ObjectUri, etag: &str, size: u64) -> Result<(), DataError> {
        let _ = (uri, etag, size);
        Ok(())
    }

    /// One page of a ListObjectsV2-style listing.
    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError>;

    /// [`Self::list`] with each object's user metadata where the plane
    /// can give it (entries without it are completed by a stat).
    async fn list_with_meta(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        self.list(bucket, prefix, delimiter, token, max_keys).await
    }

    /// Stores `data` as the object's whole content, with `meta` as its
    /// user metadata.
    async fn put(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
    ) -> Result<ObjectStat, DataError>;

    /// Streams the object's new content; returns once it is stored (in
    /// S3 for `through`, durable in the cache for `back`). `avoid` names
    /// workers (as [`DataError::Stalled`] does) that stalled on earlier
    /// attempts of this write: the upload goes to another.
    async fn upload(
        &self,
        uri: &ObjectUri,
        body: ByteStream,
        limits: UploadLimits,
        mode: WriteMode,
        meta: &UserMeta,
        avoid: &[String],
    ) -> Result<ObjectStat, DataError>;

    /// This mount writes back: the worker on this host, if any, is told
    /// so it prepares for the first burst (spare page files) before it
    /// comes. Best effort; nothing depends on it.
    async fn prepare_write_back(&self) {}

    /// Whether a write of `uri` may be committed from a local file by a
    /// worker on this host ([`Self::commit_local`]); known without I/O.
    fn commits_locally(&self, uri: &ObjectUri) -> bool {
        let _ = uri;
        false
    }

    /// Commits the first `size` bytes of `file` as `uri`'s new content,
    /// written back, through the worker on this host that takes writes
    /// of `uri`, which reads the file itself. `None`: no such worker (the
    /// caller streams the file with [`Self::upload`]).
    async fn commit_local(
        &self,
        uri: &ObjectUri,
        file: Arc<std::fs::File>,
        size: u64,
        meta: &UserMeta,
        progress: Duration,
    ) -> Option<Result<ObjectStat, DataError>> {
        let _ = (uri, file, size, meta, progress);
        None
    }

    /// Starts [`Self::commit_local`] of `file` while it is still being
    /// written: the worker takes the bytes as they come, and
    /// [`Self::seal_local`] commits them. `None`: not possible (the
    /// caller commits the file whole at the end).
    async fn follow_local(
        &self,
        uri: &ObjectUri,
        file: Arc<std::fs::File>,
        meta: &UserMeta,
        progress: Duration,
    ) -> Option<LocalFollow> {
        let _ = (uri, file, meta, progress);
        None
    }

    /// Commits a followed file at `size` bytes. `None`: the worker is
    /// gone from the local socket (the caller commits another way).
    async fn seal_local(
        &self,
        uri: &ObjectUri,
        follow: LocalFollow,
        size: u64,
        meta: &UserMeta,
    ) -> Option<Result<ObjectStat, DataError>> {
        let _ = (uri, follow, size, meta);
        None
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), DataError>;

    /// Server-side copy (of version `etag`, when given); the copy keeps
    /// the source's user metadata, or gets `meta` instead.
    async fn copy(
        &self,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectStat, DataError>;
}

/// `read`, checked to have returned exactly the bytes asked for.
pub async fn read_exact(
    data: &dyn DataPlane,
    uri: &ObjectUri,
    range: Range<u64>,
    etag: &str,
) -> Result<Bytes, DataError> {
    read_exact_as(data, uri, range, etag, ReadKind::Demand).await
}

/// [`read_exact`] of a demand read or a read-ahead.
pub async fn read_exact_as(
    data: &dyn DataPlane,
    uri: &ObjectUri,
    range: Range<u64>,
    etag: &str,
    kind: ReadKind,
) -> Result<Bytes, DataError> {
    let want = range.end - range.start;
    let bytes = data.read_as(uri, range, etag, kind).await?;
    if bytes.len() as u64 != want {
        return Err(DataError::ShortBody {
            expected: want,
            got: bytes.len() as u64,
        });
    }
    Ok(bytes)
}
