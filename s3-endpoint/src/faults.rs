//! Request counting and fault injection in front of the S3 service: the
//! layer tests use to make the endpoint misbehave the way S3 does.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The S3 operation a request names, as far as routing needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum S3Op {
    GetObject,
    HeadObject,
    PutObject,
    DeleteObject,
    ListObjects,
    CreateMultipartUpload,
    UploadPart,
    CompleteMultipartUpload,
    AbortMultipartUpload,
    Bucket,
}

impl S3Op {
    /// Classifies a path-style request by method, path and query.
    pub fn classify(method: &http::Method, uri: &http::Uri) -> Self {
        let path = uri.path().trim_start_matches('/');
        let has_key = path.split_once('/').is_some_and(|(_, k)| !k.is_empty());
        let query = uri.query().unwrap_or("");
        let has = |name: &str| {
            query
                .split('&')
                .any(|p| p == name || p.starts_with(&format!("{name}=")))
        };
        if !has_key {
            // GET /bucket lists it (v2 with list-type=2, v1 without);
            // other bucket subresources (?location, ?uploads) do not.
            let lists = has("list-type")
                || query.is_empty()
                || ["prefix", "marker", "delimiter", "max-keys"]
                    .iter()
                    .any(|q| has(q));
            return if method == http::Method::GET && !path.is_empty() && lists {
                S3Op::ListObjects
            } else {
                S3Op::Bucket
            };
        }
        match *method {
            http::Method::GET => S3Op::GetObject,
            http::Method::HEAD => S3Op::HeadObject,
            http::Method::PUT if has("uploadId") => S3Op::UploadPart,
            http::Method::PUT => S3Op::PutObject,
            http::Method::POST if has("uploads") => S3Op::CreateMultipartUpload,
            http::Method::POST => S3Op::CompleteMultipartUpload,
            http::Method::DELETE if has("uploadId") => S3Op::AbortMultipartUpload,
            http::Method::DELETE => S3Op::DeleteObject,
            _ => S3Op::Bucket,
        }
    }
}

/// What to do to a matching request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer 503 SlowDown without touching storage.
    SlowDown,
    /// Answer 500 InternalError without touching storage.
    InternalError,
    /// Serve the response but cut the body after this many bytes.
    TruncateBody { after: usize },
    /// Flip a bit of the request body on its way in (a NIC or proxy that
    /// damages data): a checksum the client sent must catch it.
    CorruptRequestBody,
    /// Answer normally after this many milliseconds (a far-away lake).
    Delay { ms: u64 },
    /// Answer 501 NotImplemented to a write that carries `If-Match` or
    /// `If-None-Match` (a store without conditional writes); serve the
    /// request otherwise.
    RefuseConditionalWrites,
    /// Serve the request at once and hold the answer this many
    /// milliseconds: the client gets the store as it was when the request
    /// arrived, late (a listing that describes a moment already past).
    DelayResponse { ms: u64 },
}

#[derive(Debug)]
struct Rule {
    op: S3Op,
    fault: Fault,
    remaining: u32,
}

/// Counts requests per operation and body bytes sent, and hands out
/// injected faults.
#[derive(Debug, Default)]
pub struct FaultInjector {
    counts: Mutex<HashMap<S3Op, u64>>,
    sent_bytes: AtomicU64,
    checksums_verified: AtomicU64,
    rules: Mutex<Vec<Rule>>,
}

impl FaultInjector {
    /// Makes the next `times` requests of `op` fail with `fault`.
    pub fn inject(&self, op: S3Op, fault: Fault, times: u32) {
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        rules.push(Rule {
            op,
            fault,
            remaining: times,
        });
    }

    pub fn clear(&self) {
        self.rules.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Requests of `op` seen so far, faulted ones included.
    pub fn count(&self, op: S3Op) -> u64 {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(&op).copied().unwrap_or(0)
    }

    /// Response body bytes sent so far (object data of GETs, listings).
    pub fn sent_bytes(&self) -> u64 {
        self.sent_bytes.load(Ordering::Relaxed)
    }

    /// Request bodies whose `x-amz-checksum-crc32c` was checked and matched.
    pub fn checksums_verified(&self) -> u64 {
        self.checksums_verified.load(Ordering::Relaxed)
    }

    pub(crate) fn checksum_verified(&self) {
        self.checksums_verified.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_sent(&self, n: usize) {
        self.sent_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The counters in Prometheus' text format, for `GET /_lakecache/stats`
    /// (no bucket name can start with `_`, so no S3 request has this path).
    pub fn render(&self) -> String {
        let mut out = String::from("# TYPE lakecache_s3_endpoint_requests_total counter\n");
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let mut ops: Vec<_> = counts.iter().collect();
        ops.sort_by_key(|(op, _)| format!("{op:?}"));
        for (op, n) in ops {
            let _ = writeln!(
                out,
                "lakecache_s3_endpoint_requests_total{{op=\"{op:?}\"}} {n}"
            );
        }
        let _ = write!(
            out,
            "# TYPE lakecache_s3_endpoint_sent_bytes_total counter\n\
             lakecache_s3_endpoint_sent_bytes_total {}\n\
             # TYPE lakecache_s3_endpoint_checksums_verified_total counter\n\
             lakecache_s3_endpoint_checksums_verified_total {}\n",
            self.sent_bytes(),
            self.checksums_verified()
        );
        out
    }

    pub fn reset_counts(&self) {
        self.sent_bytes.store(0, Ordering::Relaxed);
        self.counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Records a request and returns the fault it should suffer, if any.
    pub(crate) fn on_request(&self, op: S3Op) -> Option<Fault> {
        *self
            .counts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(op)
            .or_default() += 1;
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let idx = rules.iter().position(|r| r.op == op && r.remaining > 0)?;
        let rule = &mut rules[idx];
        rule.remaining -= 1;
        let fault = rule.fault;
        if rule.remaining == 0 {
            rules.remove(idx);
        }
        Some(fault)
    }
}
