//! Wire types of write-back: the mode a write asks for, the end-to-end
//! checksum it carries, and what a worker reports about its backlog.

use serde::{Deserialize, Serialize};

/// On a PUT, `back` asks the worker to acknowledge once the object is
/// durable in its cache (S3 gets it later); `through` (the default)
/// acknowledges once S3 has it.
pub const WRITE_MODE_HEADER: &str = "x-lakecache-write-mode";
/// Trailer of a write-back PUT: CRC32C (decimal) of the whole body as the
/// client computed it; the worker refuses a body that does not match.
pub const BODY_CRC32C_TRAILER: &str = "x-lakecache-crc32c";

/// The ETag-like version a worker gives a written-back object until S3
/// names it starts with this; no S3 ETag does (they are hex digests).
pub const CACHE_VERSION_PREFIX: &str = "lc-";

/// Whether `etag` is a cache version (the object may not be in S3 yet;
/// only the worker that took the write holds its bytes).
pub fn is_cache_version(etag: &str) -> bool {
    etag.starts_with(CACHE_VERSION_PREFIX)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteMode {
    /// close returns once S3 has the object.
    #[default]
    Through,
    /// close returns once the object is durable in the cache.
    Back,
}

impl WriteMode {
    pub fn as_str(self) -> &'static str {
        match self {
            WriteMode::Through => "through",
            WriteMode::Back => "back",
        }
    }
}

impl std::fmt::Display for WriteMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WriteMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "through" => Ok(WriteMode::Through),
            "back" => Ok(WriteMode::Back),
            other => Err(format!("write mode {other:?} is not one of: through, back")),
        }
    }
}

/// `GET /v1/writeback[?prefix=s3://bucket/prefix]`: one worker's backlog
/// of acknowledged objects not yet in S3 (under the prefix, when given).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteBackStatus {
    pub pending_objects: u64,
    pub pending_bytes: u64,
    /// Age of the oldest pending acknowledgement; 0 when none is pending.
    pub oldest_pending_ms: u64,
    /// Bytes of dirty pages this worker may hold before writes wait.
    pub staging_limit_bytes: u64,
    /// Objects uploaded since the worker started.
    pub uploaded_objects: u64,
    /// The last upload failure, while uploads keep failing.
    pub last_error: Option<String>,
}
