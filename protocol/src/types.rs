use serde::{Deserialize, Serialize};

/// The current version of an object (`GET /v1/version/...`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectVersion {
    pub size: u64,
    pub etag: String,
    pub last_modified_ms: i64,
    /// None when the bucket is not versioned.
    pub version_id: Option<String>,
}

/// Metadata of one object as the worker sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectStat {
    pub uri: String,
    pub size: u64,
    /// Unquoted ETag from the object store.
    pub etag: String,
    /// Last-Modified in milliseconds since the Unix epoch.
    pub last_modified_ms: i64,
    /// The cache version (`lc-...`) these bytes had before write-back
    /// uploaded them under `etag`, when the worker remembers it: a client
    /// holding them under that version may keep them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_as: Option<String>,
    /// The object's user metadata (`x-amz-meta-*`), names lowercase.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub meta: crate::UserMeta,
    /// On the answer to a write-back copy: the ring address of the worker
    /// that holds it, which the sender checks against the one it chose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListEntry {
    pub key: String,
    pub size: u64,
    pub etag: String,
    pub last_modified_ms: i64,
    /// The object's user metadata, when the listing was asked for it
    /// (S3's own listings never carry it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<crate::UserMeta>,
}

/// One page of a listing (prefix + delimiter, like ListObjectsV2).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListResponse {
    pub objects: Vec<ListEntry>,
    pub common_prefixes: Vec<String>,
    /// Present when more entries follow; pass back as `continuation-token`.
    pub next_token: Option<String>,
}

/// Stable error codes: scripts match on these, not on messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    InvalidPath,
    InvalidRange,
    RangeNotSatisfiable,
    NotFound,
    RouteNotFound,
    MethodNotAllowed,
    UriTooLong,
    BodyTooLarge,
    HeadersTooLarge,
    PreconditionFailed,
    /// The name is taken by something else (a load job with another spec).
    Conflict,
    /// A server-side copy of an object larger than S3's CopyObject limit.
    CopyTooLarge,
    AccessDenied,
    /// No token, or something that is not a lakecache token.
    Unauthenticated,
    /// A token that does not grant the request: forged, signed with an
    /// unknown key, expired, or scoped elsewhere; or an object outside
    /// the worker's allow-list.
    OutOfScope,
    /// The tenant has as many requests in flight as the worker allows it.
    TooManyRequests,
    /// The client stopped sending a request body.
    BodyTimeout,
    UpstreamThrottled,
    UpstreamUnavailable,
    /// A write-back body whose checksum does not match what the client sent.
    ChecksumMismatch,
    /// The worker was paused longer than the client waits after the
    /// client sent the write, and did not store it (the client may have
    /// sent it elsewhere); the client may send it again.
    WriteFenced,
    /// Write-back staging stayed full for longer than the stall timeout.
    StagingFull,
    /// Fewer workers than `--write-replicas` could take a copy of a
    /// write-back body; nothing was acknowledged.
    ReplicasUnavailable,
    UpstreamError,
    Internal,
    /// A code this client version does not know.
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest
            | ErrorCode::InvalidPath
            | ErrorCode::InvalidRange
            | ErrorCode::CopyTooLarge
            | ErrorCode::ChecksumMismatch => 400,
            ErrorCode::StagingFull => 507,
            ErrorCode::ReplicasUnavailable => 503,
            ErrorCode::RangeNotSatisfiable => 416,
            ErrorCode::NotFound | ErrorCode::RouteNotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::UriTooLong => 414,
            ErrorCode::BodyTooLarge => 413,
            ErrorCode::HeadersTooLarge => 431,
            ErrorCode::PreconditionFailed => 412,
            ErrorCode::Conflict | ErrorCode::WriteFenced => 409,
            ErrorCode::AccessDenied | ErrorCode::OutOfScope => 403,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::TooManyRequests => 429,
            ErrorCode::BodyTimeout => 408,
            ErrorCode::UpstreamThrottled => 503,
            ErrorCode::UpstreamUnavailable => 502,
            ErrorCode::UpstreamError => 502,
            ErrorCode::Internal | ErrorCode::Unknown => 500,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    pub message: String,
}

/// The last JSON of a watched write's answer (see
/// [`crate::KEEPALIVE_HEADER`]): the stored object, or why it was not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WriteOutcome {
    Failed(ErrorBody),
    Stored(ObjectStat),
}

/// The JSON body of every error response: `{"error":{"code":..,"message":..}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                code,
                message: message.into(),
            },
        }
    }
}

/// `GET /v1/health`: liveness and cache usage of one worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
    pub cache_used_bytes: u64,
    pub cache_capacity_bytes: u64,
    pub page_size: u64,
    /// Bytes served from local pages since the worker started.
    pub hit_bytes: u64,
    /// Bytes that had to come from S3 since the worker started.
    pub miss_bytes: u64,
    /// Bytes of pages under pin policies (part of `cache_used_bytes`).
    #[serde(default)]
    pub pinned_bytes: u64,
    /// The same two counts by bucket (absent from workers before 0.1.1).
    #[serde(default)]
    pub buckets: std::collections::BTreeMap<String, BucketTraffic>,
    /// Cache use by tenant (tenants with pages, pending data or a quota).
    #[serde(default)]
    pub tenants: std::collections::BTreeMap<String, TenantUsage>,
    /// The write path's deadlines (absent from older workers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadlines: Option<WorkerDeadlines>,
    /// How many workers this worker's ring view holds; absent when it
    /// knows no ring (started without a registry). Such a worker cannot
    /// order its write-backs with other workers' versions of an object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring_workers: Option<u64>,
}

/// How long a worker waits on the write path before giving up.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerDeadlines {
    /// An upload whose client sends nothing for this long is aborted.
    pub body_idle_ms: u64,
    /// An upload to S3 not done within this plus a second per MiB is sent
    /// again on a new connection.
    #[serde(default)]
    pub s3_stall_ms: u64,
    /// A write-back copy whose replica takes nothing for this long (and
    /// then fails a probe) goes to the next worker; None without write-back.
    pub replica_progress_ms: Option<u64>,
    /// A write-back body waits this long for staging room before failing.
    pub staging_stall_ms: Option<u64>,
}

/// One tenant's share of a worker's cache.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantUsage {
    /// Bytes of pages its requests fetched.
    pub cache_bytes: u64,
    /// Its acknowledged write-back data not yet in S3 (never evicted).
    pub pending_bytes: u64,
    /// The most it may hold, when the worker sets one.
    pub quota_bytes: Option<u64>,
}

/// Bytes one worker served for one bucket from its pages (`hit_bytes`:
/// S3 egress saved) and from S3 (`miss_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketTraffic {
    pub hit_bytes: u64,
    pub miss_bytes: u64,
}
