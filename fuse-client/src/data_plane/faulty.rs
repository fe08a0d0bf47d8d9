//! A fault-injecting wrapper: errors, truncated bodies and slow answers
//! after a chosen number of calls, for tests of the layers above.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use lakecache_protocol::{ListResponse, ObjectStat, ObjectUri, ReadKind, UserMeta};

use super::{ByteStream, DataError, DataPlane};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataOp {
    Stat,
    Read,
    List,
    Put,
    Upload,
    Delete,
    Copy,
}

const OPS: usize = 7;

impl DataOp {
    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Clone)]
pub enum DataFault {
    /// The call fails with this error without reaching the inner plane.
    Fail(DataError),
    /// A read returns only its first `keep` bytes; an upload passes only
    /// its first `keep` bytes on and then fails as a cut body does.
    Truncate { keep: usize },
    /// The call waits this long first, then proceeds.
    Delay(Duration),
}

#[derive(Debug)]
struct Rule {
    op: DataOp,
    /// Matching calls to let through before firing.
    skip: u64,
    /// Times left to fire; `u64::MAX` is always.
    remaining: u64,
    fault: DataFault,
}

pub struct FaultyDataPlane<D> {
    inner: D,
    rules: Mutex<Vec<Rule>>,
    calls: Mutex<[u64; OPS]>,
    /// Every range `read` was asked for, and whether as a read-ahead, to
    /// see what a caller requested.
    read_log: Mutex<Vec<(Range<u64>, ReadKind)>>,
}

impl<D: DataPlane> FaultyDataPlane<D> {
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            rules: Mutex::default(),
            calls: Mutex::default(),
            read_log: Mutex::default(),
        }
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// After `after` more calls of `op` succeed, the next `times` calls
    /// get `fault` (`u64::MAX`: every later call).
    pub fn inject(&self, op: DataOp, after: u64, times: u64, fault: DataFault) {
        self.rules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Rule {
                op,
                skip: after,
                remaining: times,
                fault,
            });
    }

    /// Removes every pending fault.
    pub fn heal(&self) {
        self.rules.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Calls of `op` seen so far (faulted ones included).
    pub fn calls(&self, op: DataOp) -> u64 {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())[op.index()]
    }

    /// The ranges read so far, in call order.
    pub fn read_ranges(&self) -> Vec<Range<u64>> {
        self.read_requests().into_iter().map(|(r, _)| r).collect()
    }

    /// The ranges read so far with how each was asked, in call order.
    pub fn read_requests(&self) -> Vec<(Range<u64>, ReadKind)> {
        self.read_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn clear_read_log(&self) {
        self.read_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Counts the call and returns the fault it gets, if any.
    fn next_fault(&self, op: DataOp) -> Option<DataFault> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())[op.index()] += 1;
        let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let mut fired = None;
        for rule in rules.iter_mut().filter(|r| r.op == op && r.remaining > 0) {
            if rule.skip > 0 {
                rule.skip -= 1;
                continue;
            }
            if fired.is_none() {
                if rule.remaining != u64::MAX {
                    rule.remaining -= 1;
                }
                fired = Some(rule.fault.clone());
            }
        }
        rules.retain(|r| r.remaining > 0);
        fired
    }

    /// Applies a delay or failure; returns a truncation for the caller.
    async fn before(&self, op: DataOp) -> Result<Option<usize>, DataError> {
        match self.next_fault(op) {
            None => Ok(None),
            Some(DataFault::Fail(e)) => Err(e),
            Some(DataFault::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(None)
            }
            Some(DataFault::Truncate { keep }) => Ok(Some(keep)),
        }
    }
}

#[async_trait::async_trait]
impl<D: DataPlane> DataPlane for FaultyDataPlane<D> {
    async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, DataError> {
        self.before(DataOp::Stat).await?;
        self.inner.stat(uri).await
    }

    async fn read(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, DataError> {
        self.read_as(uri, range, etag, ReadKind::Demand).await
    }

    /// Answered by the inner plane while no read fault is armed (an
    /// armed one is for the reads that wait, which get it).
    fn read_cached_now(&self, uri: &ObjectUri, range: Range<u64>, etag: &str) -> Option<Bytes> {
        if self
            .rules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|r| r.op == DataOp::Read)
        {
            return None;
        }
        let bytes = self.inner.read_cached_now(uri, range.clone(), etag)?;
        self.read_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((range, ReadKind::Demand));
        Some(bytes)
    }

    async fn read_as(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
        kind: ReadKind,
    ) -> Result<Bytes, DataError> {
        self.read_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((range.clone(), kind));
        let cut = self.before(DataOp::Read).await?;
        let bytes = self.inner.read_as(uri, range, etag, kind).await?;
        Ok(match cut {
            Some(keep) if keep < bytes.len() => bytes.slice(..keep),
            _ => bytes,
        })
    }

    async fn warm(&self, uri: &ObjectUri, etag: &str, size: u64) -> Result<(), DataError> {
        self.inner.warm(uri, etag, size).await
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        self.before(DataOp::List).await?;
        self.inner
            .list(bucket, prefix, delimiter, token, max_keys)
            .await
    }

    async fn list_with_meta(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        self.before(DataOp::List).await?;
        self.inner
            .list_with_meta(bucket, prefix, delimiter, token, max_keys)
            .await
    }

    async fn put(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
    ) -> Result<ObjectStat, DataError> {
        self.before(DataOp::Put).await?;
        self.inner.put(uri, data, meta).await
    }

    async fn upload(
        &self,
        uri: &ObjectUri,
        body: ByteStream,
        limits: super::UploadLimits,
        mode: lakecache_protocol::WriteMode,
        meta: &UserMeta,
        avoid: &[String],
    ) -> Result<ObjectStat, DataError> {
        let Some(keep) = self.before(DataOp::Upload).await? else {
            return self
                .inner
                .upload(uri, body, limits, mode, meta, avoid)
                .await;
        };
        // Read the body up to the cut, then fail as a broken stream does;
        // the inner plane never sees a partial object.
        let mut body = body;
        let mut seen = 0usize;
        while let Some(chunk) = body.next().await {
            seen += chunk?.len();
            if seen > keep {
                break;
            }
        }
        Err(DataError::UploadCut)
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), DataError> {
        self.before(DataOp::Delete).await?;
        self.inner.delete(uri).await
    }

    async fn copy(
        &self,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectStat, DataError> {
        self.before(DataOp::Copy).await?;
        self.inner.copy(from, etag, to, meta).await
    }
}
