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
/// On a GET answered with the CRC32C trailer (the client sent
/// `TE: trailers`): the body's length, which a chunked body cannot carry
/// in Content-Length.
pub const LENGTH_HEADER: &str = "x-lakecache-length";

/// Whether the comma-separated list in header `name` (as `Trailer` and
/// `TE` carry) holds `token`, in any case.
pub fn header_lists(
    headers: &http::HeaderMap,
    name: http::header::HeaderName,
    token: &str,
) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// On a PUT: the client watches the write's progress. The worker answers
/// `200` as soon as the body is in, then a space every 500 ms while it
/// stores the object, then the outcome as JSON ([`crate::WriteOutcome`]):
/// a client can tell a worker that is working from one that went silent,
/// without a total timeout. With the body's CRC32C trailer declared, the
/// worker refuses a body whose trailer is missing or does not match.
/// Its value: how long the client waits for progress, in milliseconds.
pub const KEEPALIVE_HEADER: &str = "x-lakecache-keepalive";
/// With [`KEEPALIVE_HEADER`]: when the client sent the write (its wall
/// clock, ms since the Unix epoch). A worker that was paused longer than
/// the client waits, after that, does not store the write: the client
/// has given up on it and may have sent it, or a newer one, elsewhere.
pub const SENT_AT_HEADER: &str = "x-lakecache-sent-at";

/// On a write-back PUT from one worker to another: this copy is a replica
/// of a write the sender (the primary) takes. Value: the primary's journal
/// identity, a space, and the primary's ring address.
pub const REPLICA_OF_HEADER: &str = "x-lakecache-replica-of";
/// On a replica PUT: the cache version the primary gave the object, so
/// both copies answer reads of it.
pub const VERSION_HEADER: &str = "x-lakecache-version";
/// On a replica PUT or delete: the primary will confirm the copy once its
/// own journal holds the write (`POST /v1/confirm/...`), and only then
/// acknowledge it. A copy never confirmed was never acknowledged: a
/// replica that takes over a lost primary's copies drops it.
pub const CONFIRM_HEADER: &str = "x-lakecache-confirm";

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
    /// Bytes of that held now: pending objects and bodies being taken.
    #[serde(default)]
    pub staging_used_bytes: u64,
    /// Bytes of spare page files kept for write-back pages to be
    /// written over (faster than new files on ext4).
    #[serde(default)]
    pub spare_bytes: u64,
    /// Objects uploaded since the worker started.
    pub uploaded_objects: u64,
    /// The last upload failure, while uploads keep failing.
    pub last_error: Option<String>,
    /// Copies this worker holds of other workers' pending writes (kept
    /// until their primary's upload is done, uploaded here if the
    /// primary's disk is lost).
    #[serde(default)]
    pub replica_objects: u64,
    #[serde(default)]
    pub replica_bytes: u64,
    /// The identity of this worker's write-back journal.
    #[serde(default)]
    pub journal_id: String,
    /// When the entry this worker uploads next (under the prefix) was
    /// acknowledged, in ms since the epoch: other workers upload nothing
    /// acknowledged after it first.
    #[serde(default)]
    pub next_upload_acked_ms: Option<i64>,
    /// That next upload waits, for order, on a worker that does not
    /// answer: a worker whose writes wait for staging room does not wait
    /// for it in turn.
    #[serde(default)]
    pub next_upload_waits_on_silent_peer: bool,
    /// Asked with `?uri=`: the writes of that one object this worker
    /// uploads (pending) or last uploaded, so two workers holding
    /// versions of one object land them in S3 in acknowledgement order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub writes_of_uri: Vec<UriWrite>,
}

/// One acknowledged write (or delete) of an object, as a peer worker
/// asks about it before uploading its own version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UriWrite {
    pub acked_ms: i64,
    /// The journal that acknowledged it: breaks ties of `acked_ms`.
    pub journal_id: String,
    /// The cache version: the same write held on two workers has one.
    pub version: String,
    /// Not yet in S3 (false: the last upload of the object here).
    pub pending: bool,
}

impl UriWrite {
    /// The order every worker computes alike: (acknowledgement time,
    /// journal identity).
    pub fn stamp(&self) -> (i64, &str) {
        (self.acked_ms, self.journal_id.as_str())
    }
}

/// User-metadata key (`x-amz-meta-lakecache-written`) a write-back upload
/// stores its [`UriWrite::stamp`] under, as `ACKED_MS JOURNAL_ID`. S3 then
/// remembers which acknowledged write it holds, past any worker's restart:
/// a worker about to upload an older version of the object skips it.
pub const WRITTEN_STAMP_META: &str = "lakecache-written";

/// The [`WRITTEN_STAMP_META`] value of a write.
pub fn written_stamp(acked_ms: i64, journal_id: &str) -> String {
    format!("{acked_ms} {journal_id}")
}

/// A [`WRITTEN_STAMP_META`] value read back; None when absent or not one
/// (an object written by another tool, or metadata edited by hand).
pub fn parse_written_stamp(value: &str) -> Option<(i64, String)> {
    let (ms, id) = value.trim().split_once(' ')?;
    let ms = ms.parse::<i64>().ok()?;
    (!id.is_empty() && !id.contains(' ')).then(|| (ms, id.to_string()))
}

#[cfg(test)]
mod written_stamp_tests {
    use super::*;

    #[test]
    fn stamps_read_back_and_anything_else_is_none() {
        let v = written_stamp(1_764_000_000_123, "j-abc");
        assert_eq!(
            parse_written_stamp(&v),
            Some((1_764_000_000_123, "j-abc".into()))
        );
        for bad in ["", "123", "x j", "123 ", "1 a b", " 5"] {
            assert_eq!(parse_written_stamp(bad), None, "{bad:?}");
        }
    }
}

/// What a primary knows of one pending version, as a replica asks
/// (`GET /v1/writeback/entry/<bucket>/<key>?version=`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteBackEntry {
    /// The primary's journal identity: another one than the replica
    /// recorded means the primary's disk (and journal) is gone.
    pub journal_id: String,
    pub state: EntryState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryState {
    /// Being taken or acknowledged and not yet in S3.
    Pending,
    /// Neither pending nor being taken: uploaded, replaced, or never
    /// acknowledged. A replica may drop its copy.
    Settled,
}
