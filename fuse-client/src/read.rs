//! Reads of one open file: sequential readers get a growing read-ahead
//! window of parallel requests; random readers get exactly what they ask.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use lakecache_protocol::ObjectUri;
use lakecache_registry::ClusterClient;
use tokio::task::JoinHandle;

use crate::error::FsError;

/// How far behind the last read a request may land and still count as
/// the same stream (the kernel issues read-ahead out of order).
const REORDER_SLACK: u64 = 2 << 20;

#[derive(Debug, Clone, Copy)]
pub struct ReadaheadPolicy {
    pub initial: u64,
    pub max: u64,
    pub chunk: u64,
}

struct Chunk {
    range: Range<u64>,
    fetch: Option<JoinHandle<Result<Bytes, FsError>>>,
    data: Option<Bytes>,
}

impl Chunk {
    async fn bytes(&mut self) -> Result<Bytes, FsError> {
        if let Some(task) = self.fetch.take() {
            let got = task
                .await
                .map_err(|e| FsError::Cluster(format!("read-ahead task failed: {e}")))??;
            self.data = Some(got);
        }
        self.data
            .clone()
            .ok_or_else(|| FsError::Cluster("read-ahead chunk lost".into()))
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Some(task) = self.fetch.take() {
            task.abort();
        }
    }
}

pub struct FileReader {
    cluster: Arc<ClusterClient>,
    uri: ObjectUri,
    etag: String,
    size: u64,
    policy: ReadaheadPolicy,
    /// Where the last read ended.
    next_offset: u64,
    window: u64,
    /// Contiguous prefetched ranges, in order.
    chunks: VecDeque<Chunk>,
}

impl FileReader {
    pub fn new(
        cluster: Arc<ClusterClient>,
        uri: ObjectUri,
        etag: String,
        size: u64,
        policy: ReadaheadPolicy,
    ) -> Self {
        Self {
            cluster,
            uri,
            etag,
            size,
            policy,
            next_offset: 0,
            window: 0,
            chunks: VecDeque::new(),
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes `[offset, offset + len)`, short at end of file.
    pub async fn read(&mut self, offset: u64, len: u64) -> Result<Bytes, FsError> {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return Ok(Bytes::new());
        }
        let buffered = match (self.chunks.front(), self.chunks.back()) {
            (Some(f), Some(b)) => f.range.start <= offset && offset < b.range.end,
            _ => false,
        };
        let forward = offset >= self.next_offset
            && offset - self.next_offset <= self.window.max(REORDER_SLACK);
        let sequential = buffered || (forward && (offset == 0 || self.next_offset > 0));
        if !sequential {
            let behind = offset < self.next_offset && self.next_offset - offset <= REORDER_SLACK;
            if !behind {
                // Random access: drop the stream and its read-ahead.
                self.chunks.clear();
                self.window = 0;
                self.next_offset = end;
            }
            return self.fetch(offset..end).await;
        }
        self.window = if self.window == 0 {
            self.policy.initial
        } else {
            (self.window * 2).min(self.policy.max)
        };
        self.next_offset = self.next_offset.max(end);
        // Drop what the reader has passed.
        while self.chunks.front().is_some_and(|c| c.range.end <= offset) {
            self.chunks.pop_front();
        }
        if self.chunks.front().is_some_and(|c| c.range.start > offset) {
            self.chunks.clear();
        }
        self.schedule(offset, end.saturating_add(self.window).min(self.size));
        let mut pieces = Vec::new();
        for chunk in self.chunks.iter_mut() {
            if chunk.range.start >= end {
                break;
            }
            if chunk.range.end <= offset {
                continue;
            }
            let bytes = chunk.bytes().await?;
            let from = (offset.max(chunk.range.start) - chunk.range.start) as usize;
            let to = (end.min(chunk.range.end) - chunk.range.start) as usize;
            if to > bytes.len() {
                return Err(FsError::Cluster(format!(
                    "short read-ahead chunk for {}: {} of {} bytes",
                    self.uri,
                    bytes.len(),
                    chunk.range.end - chunk.range.start
                )));
            }
            pieces.push(bytes.slice(from..to));
        }
        // Most reads fall inside one chunk: hand its bytes over uncopied.
        if pieces.len() == 1 {
            return Ok(pieces.remove(0));
        }
        let mut out = BytesMut::with_capacity((end - offset) as usize);
        for piece in pieces {
            out.extend_from_slice(&piece);
        }
        Ok(out.freeze())
    }

    /// Starts fetches so that chunks cover `[from, until)`.
    fn schedule(&mut self, from: u64, until: u64) {
        let mut pos = self.chunks.back().map_or(from, |c| c.range.end);
        while pos < until {
            // Align chunk ends so that a stream's requests line up.
            let chunk = self.policy.chunk.max(1);
            let end = ((pos / chunk + 1) * chunk).min(self.size);
            let range = pos..end;
            let cluster = self.cluster.clone();
            let uri = self.uri.clone();
            let etag = self.etag.clone();
            let r = range.clone();
            let fetch = tokio::spawn(async move {
                cluster
                    .read(&uri, r, Some(&etag))
                    .await
                    .map_err(FsError::from)
            });
            self.chunks.push_back(Chunk {
                range,
                fetch: Some(fetch),
                data: None,
            });
            pos = end;
        }
    }

    async fn fetch(&self, range: Range<u64>) -> Result<Bytes, FsError> {
        let want = range.end - range.start;
        let bytes = self
            .cluster
            .read(&self.uri, range, Some(&self.etag))
            .await?;
        if bytes.len() as u64 != want {
            return Err(FsError::Cluster(format!(
                "short read of {}: {} of {want} bytes",
                self.uri,
                bytes.len()
            )));
        }
        Ok(bytes)
    }
}
