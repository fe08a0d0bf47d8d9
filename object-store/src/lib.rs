//! The object store under the cache: one trait, the aws-sdk-s3
//! implementation, a metering wrapper and a fault-injecting wrapper.
//!
//! A crate of its own so that clients (the cluster client's S3 fallback,
//! the mount) share it without linking the worker and RocksDB.

mod faulty;
mod metered;
mod multipart_copy;
mod s3;

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{ListResponse, ObjectUri, UserMeta};

pub use faulty::{FaultyStore, StoreFault};
pub use metered::MeteredStore;
pub use multipart_copy::multipart_copy;
pub use s3::{RetryMode, S3Config, S3Store};

/// Where the store wrappers report requests; the worker's metrics
/// implement it, tests may use [`NoMetrics`].
pub trait StoreMetrics: Send + Sync + std::fmt::Debug + 'static {
    /// One finished S3 call: operation, outcome label, latency, bytes moved.
    fn s3_request(&self, op: &'static str, outcome: &'static str, elapsed: Duration, bytes: u64);
    /// One retry (SDK attempt after the first, or a resumed body).
    fn s3_retry(&self, op: &str);
}

/// Records nothing.
#[derive(Debug, Default)]
pub struct NoMetrics;

impl StoreMetrics for NoMetrics {
    fn s3_request(&self, _: &'static str, _: &'static str, _: Duration, _: u64) {}
    fn s3_retry(&self, _: &str) {}
}

/// Metadata of one object version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub size: u64,
    /// Unquoted.
    pub etag: String,
    pub last_modified_ms: i64,
    /// User metadata (`x-amz-meta-*`), names lowercase.
    pub user: UserMeta,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("object not found")]
    NotFound,
    #[error("object changed: its ETag no longer matches")]
    PreconditionFailed,
    #[error("object store is throttling requests: {0}")]
    Throttled(String),
    #[error("object store unavailable: {0}")]
    Unavailable(String),
    #[error("access denied: {0}")]
    AccessDenied(String),
    #[error("invalid response from object store: {0}")]
    InvalidResponse(String),
    #[error("object store does not implement this request: {0}")]
    Unsupported(String),
    #[error("object store error: {0}")]
    Other(String),
}

/// What the store must hold for a write to land: S3's conditional
/// writes (`If-None-Match: *`, `If-Match`). A write that lands only over
/// what its writer last saw cannot bury one that came in between.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum WriteIf {
    #[default]
    Always,
    /// No object under the key.
    Absent,
    /// The object tagged with this ETag (unquoted).
    Matches(String),
}

/// One call per S3 operation the cache needs. Implementations are real
/// (S3) or wrappers (metering, fault injection).
/// What the store returned for one uploaded part: what completing the
/// upload must name again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartReceipt {
    pub etag: String,
    /// The part's CRC32C (base64, big-endian), when it was sent with one.
    pub crc32c: Option<String>,
}

/// CRC32C of `data` as S3's `x-amz-checksum-crc32c` header carries it.
pub fn crc32c_header(data: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(crc32c::crc32c(data).to_be_bytes())
}

#[async_trait::async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    async fn head(&self, uri: &ObjectUri) -> Result<ObjectMeta, StoreError>;

    /// Exactly the bytes of `range` of the version tagged `etag`; a body
    /// that breaks mid-stream is resumed, a changed object is
    /// [`StoreError::PreconditionFailed`].
    async fn get_range(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, StoreError>;

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: u32,
    ) -> Result<ListResponse, StoreError>;

    /// HEAD with the version id of the object's current version, when the
    /// bucket is versioned (None otherwise, and from stores without
    /// versions).
    async fn current_version(
        &self,
        uri: &ObjectUri,
    ) -> Result<(ObjectMeta, Option<String>), StoreError> {
        Ok((self.head(uri).await?, None))
    }

    /// Exactly the bytes of `range` of version `version_id`, which must
    /// carry `etag` ([`StoreError::PreconditionFailed`] otherwise): a
    /// version that is no longer the current one.
    async fn get_range_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        let _ = (uri, range, version_id, etag);
        Err(StoreError::Other(
            "this object store cannot read object versions".into(),
        ))
    }

    /// Single-request upload with its user metadata; returns the new ETag.
    async fn put(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
    ) -> Result<String, StoreError> {
        self.put_if(uri, data, meta, &WriteIf::Always).await
    }

    /// [`Self::put`] that lands only while `condition` holds in the store
    /// ([`StoreError::PreconditionFailed`], or [`StoreError::NotFound`]
    /// for [`WriteIf::Matches`] on a missing object, otherwise).
    async fn put_if(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
        condition: &WriteIf,
    ) -> Result<String, StoreError>;

    /// Starts an upload whose object gets `meta` as its user metadata.
    async fn create_multipart(
        &self,
        uri: &ObjectUri,
        meta: &UserMeta,
    ) -> Result<String, StoreError>;

    async fn upload_part(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        data: Bytes,
    ) -> Result<PartReceipt, StoreError>;

    /// Completes an upload from its parts' receipts in order; returns the
    /// ETag.
    async fn complete_multipart(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        parts: Vec<(i32, PartReceipt)>,
    ) -> Result<String, StoreError> {
        self.complete_multipart_if(uri, upload_id, parts, &WriteIf::Always)
            .await
    }

    /// [`Self::complete_multipart`] under `condition`, as [`Self::put_if`];
    /// an upload whose condition failed is still open (complete it again
    /// or abort it).
    async fn complete_multipart_if(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        parts: Vec<(i32, PartReceipt)>,
        condition: &WriteIf,
    ) -> Result<String, StoreError>;

    async fn abort_multipart(&self, uri: &ObjectUri, upload_id: &str) -> Result<(), StoreError>;

    async fn delete(&self, uri: &ObjectUri) -> Result<(), StoreError>;

    /// Part `part_number` of upload `upload_id` copied server-side from a
    /// byte range of one version of another object (UploadPartCopy).
    async fn upload_part_copy(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        source: &CopyRange<'_>,
    ) -> Result<PartReceipt, StoreError>;

    /// Server-side copy of the version tagged `etag` (CopyObject, so at
    /// most [`MAX_COPY_BYTES`]); returns the new object's metadata. The
    /// copy keeps the source's user metadata, or gets `meta` instead.
    async fn copy(
        &self,
        from: &ObjectUri,
        etag: &str,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectMeta, StoreError>;
}

/// S3's limit for a single-request CopyObject, and for one copied part.
pub const MAX_COPY_BYTES: u64 = 5 << 30;

/// A byte range of one version of an object, as UploadPartCopy reads it.
#[derive(Debug, Clone)]
pub struct CopyRange<'a> {
    pub from: &'a ObjectUri,
    pub etag: &'a str,
    pub range: std::ops::Range<u64>,
}

/// S3 ETags arrive quoted; the cache keeps them bare.
pub fn unquote_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}
