//! The real data plane: the cache cluster's failover client.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use lakecache_protocol::{
    BoxError, ClientError, ErrorCode, ListResponse, ObjectStat, ObjectUri, ReadKind, UserMeta,
    WriteMode,
};
use lakecache_registry::{ClusterClient, ClusterError};
use lakecache_store::StoreError;

use super::{ByteStream, DataError, DataPlane, UploadLimits};

impl From<ClusterError> for DataError {
    fn from(e: ClusterError) -> Self {
        match &e {
            ClusterError::Worker(ClientError::Api { code, .. }) => match code {
                ErrorCode::NotFound => return DataError::NotFound,
                ErrorCode::PreconditionFailed => {
                    return DataError::Changed {
                        expected: None,
                        found: None,
                    }
                }
                ErrorCode::CopyTooLarge => return DataError::CopyTooLarge,
                ErrorCode::UpstreamUnavailable | ErrorCode::UpstreamThrottled => {
                    return DataError::StoreUnavailable(e.to_string())
                }
                ErrorCode::Unauthenticated | ErrorCode::OutOfScope => {
                    if let ClusterError::Worker(ClientError::Api { message, .. }) = &e {
                        return DataError::Denied(message.clone());
                    }
                }
                _ => {}
            },
            ClusterError::Worker(ClientError::ShortBody { expected, got }) => {
                return DataError::ShortBody {
                    expected: *expected,
                    got: *got,
                }
            }
            ClusterError::Unavailable(ClientError::Api {
                code: ErrorCode::UpstreamUnavailable | ErrorCode::UpstreamThrottled,
                ..
            }) => return DataError::StoreUnavailable(e.to_string()),
            ClusterError::S3(StoreError::NotFound) => return DataError::NotFound,
            ClusterError::S3(StoreError::Unavailable(_) | StoreError::Throttled(_)) => {
                return DataError::StoreUnavailable(e.to_string())
            }
            ClusterError::S3(StoreError::PreconditionFailed) => {
                return DataError::Changed {
                    expected: None,
                    found: None,
                }
            }
            ClusterError::Changed { expected, got } => {
                return DataError::Changed {
                    expected: Some(expected.clone()),
                    found: Some(got.clone()),
                }
            }
            _ => {}
        }
        DataError::backend("cache cluster request failed", e)
    }
}

/// A write's answer from `worker`: a worker silent past `progress`, one
/// that paused past it and refused to store the write (fenced), or one
/// that cannot be reached, is as good as stalled, and the write goes
/// elsewhere.
fn write_answer(
    answer: Result<ObjectStat, ClientError>,
    worker: &str,
    progress: Duration,
) -> Result<ObjectStat, DataError> {
    let stalled = || DataError::Stalled {
        worker: worker.to_string(),
        after: progress,
    };
    match answer {
        Ok(stat) => Ok(stat),
        Err(ClientError::Timeout { .. }) => {
            crate::metrics::global().write_stall();
            Err(stalled())
        }
        Err(ClientError::Api {
            code: ErrorCode::WriteFenced,
            ..
        }) => Err(stalled()),
        // A worker that cannot be reached (killed, its host gone)
        // acknowledged nothing: the write goes to the next one, as after
        // a stall (not counted as one: nothing was waited for).
        Err(ClientError::Transport { .. }) => Err(stalled()),
        Err(e) => Err(DataError::from(ClusterError::Worker(e))),
    }
}

#[async_trait::async_trait]
impl DataPlane for ClusterClient {
    async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, DataError> {
        Ok(ClusterClient::stat(self, uri).await?)
    }

    async fn read(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, DataError> {
        Ok(ClusterClient::read(self, uri, range, Some(etag)).await?)
    }

    async fn read_as(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
        kind: ReadKind,
    ) -> Result<Bytes, DataError> {
        Ok(ClusterClient::read_as(self, uri, range, Some(etag), kind).await?)
    }

    fn read_cached_now(&self, uri: &ObjectUri, range: Range<u64>, etag: &str) -> Option<Bytes> {
        ClusterClient::read_cached_now(self, uri, range, etag)
    }

    async fn read_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, DataError> {
        Ok(ClusterClient::read_version(self, uri, range, version_id, etag).await?)
    }

    async fn warm(&self, uri: &ObjectUri, etag: &str, size: u64) -> Result<(), DataError> {
        Ok(self.warm_object(uri, etag, size).await?)
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        Ok(ClusterClient::list(self, bucket, prefix, delimiter, token, max_keys).await?)
    }

    async fn list_with_meta(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, DataError> {
        Ok(ClusterClient::list_with_meta(self, bucket, prefix, delimiter, token, max_keys).await?)
    }

    async fn put(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
    ) -> Result<ObjectStat, DataError> {
        Ok(ClusterClient::put_with_meta(self, uri, data, meta).await?)
    }

    async fn upload(
        &self,
        uri: &ObjectUri,
        body: ByteStream,
        limits: UploadLimits,
        mode: WriteMode,
        meta: &UserMeta,
        avoid: &[String],
    ) -> Result<ObjectStat, DataError> {
        // One worker takes the stream; a resend (the caller kept the
        // bytes) goes to the next one that has not stalled on it.
        let worker = match self.writer_avoiding(uri, avoid) {
            Ok(w) => w.with_timeout(limits.total),
            // No other worker to take it: the stall is the answer.
            Err(_) if !avoid.is_empty() => {
                return Err(DataError::Stalled {
                    worker: avoid.join(", "),
                    after: limits.progress,
                })
            }
            Err(e) => return Err(e.into()),
        };
        let stalled = || DataError::Stalled {
            worker: worker.base_url().to_string(),
            after: limits.progress,
        };
        // The body goes through a one-piece hand-off, so a worker that
        // takes nothing while a piece waits shows as a wait here. `None`
        // marks the body's end: a hand-off dropped without it (the write
        // given up) fails the request body instead of ending it cleanly,
        // so the worker never stores a truncated object.
        let (tx, rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(1);
        let handoff = Arc::new(Handoff::default());
        let probe = worker.clone();
        let watched = handoff.clone();
        let pump = async move {
            let mut body = body;
            loop {
                let piece = match body.next().await {
                    Some(Ok(piece)) => Some(piece),
                    None => None,
                    // Dropping the hand-off without its end fails the
                    // request body: the worker stores nothing.
                    Some(Err(e)) => {
                        tracing::warn!(%uri, error = %e, "the write's body failed; the upload is abandoned");
                        drop(tx);
                        return std::future::pending().await;
                    }
                };
                let last = piece.is_none();
                // A piece waiting its turn: while the worker takes nothing,
                // ask it (on a connection of its own) whether it is there
                // at all. A worker busy with slow S3 part uploads answers
                // and is waited for; a hung one does not.
                let slot = loop {
                    match tokio::time::timeout(limits.progress, tx.reserve()).await {
                        Ok(Ok(slot)) => break slot,
                        // The request ended by itself; its result says how.
                        Ok(Err(_)) => return std::future::pending().await,
                        Err(_) if probe.answers_within(limits.progress).await => {}
                        Err(_) => return,
                    }
                };
                slot.send(piece);
                if last {
                    break;
                }
            }
            // All handed over, but the connection may still hold the tail
            // (a file that fits in its buffers): the same watch until the
            // end is taken, then the request's own watch goes on.
            loop {
                if watched.ended.load(Ordering::Acquire) {
                    return std::future::pending().await;
                }
                let idle = watched.idle();
                if idle < limits.progress {
                    tokio::time::sleep(limits.progress - idle).await;
                } else if probe.answers_within(limits.progress).await {
                    tokio::time::sleep(limits.progress).await;
                } else {
                    return;
                }
            }
        };
        let frames = futures::stream::unfold(Some(rx), move |rx| {
            let handoff = handoff.clone();
            async move {
                let mut rx = rx?;
                let piece = rx.recv().await;
                handoff.taken();
                match piece {
                    Some(Some(piece)) => Some((Ok(piece), Some(rx))),
                    Some(None) => {
                        handoff.ended.store(true, Ordering::Release);
                        None
                    }
                    None => Some((Err(BoxError::from("the write was given up")), None)),
                }
            }
        });
        let put = worker.put_checked(uri, frames, mode, &[], meta, Some(limits.progress));
        let result = tokio::select! {
            result = put => result,
            () = pump => {
                crate::metrics::global().write_stall();
                return Err(stalled());
            }
        };
        let stat = write_answer(result, worker.base_url(), limits.progress)?;
        self.note_written(uri, worker.base_url(), &stat);
        Ok(stat)
    }

    async fn prepare_write_back(&self) {
        ClusterClient::prepare_write_back(self).await;
    }

    fn commits_locally(&self, uri: &ObjectUri) -> bool {
        self.writer_for(uri).is_ok_and(|w| w.may_commit_locally())
    }

    async fn commit_local(
        &self,
        uri: &ObjectUri,
        file: Arc<std::fs::File>,
        size: u64,
        meta: &UserMeta,
        progress: Duration,
    ) -> Option<Result<ObjectStat, DataError>> {
        let worker = self.writer_for(uri).ok()?;
        let answer = worker.commit_local(uri, file, size, meta, progress).await?;
        let stat = write_answer(answer, worker.base_url(), progress);
        if let Ok(stat) = &stat {
            self.note_written(uri, worker.base_url(), stat);
        }
        Some(stat)
    }

    async fn follow_local(
        &self,
        uri: &ObjectUri,
        file: Arc<std::fs::File>,
        meta: &UserMeta,
        progress: Duration,
    ) -> Option<super::LocalFollow> {
        let worker = self.writer_for(uri).ok()?;
        let following = worker.follow_local(uri, file, meta, progress).await?;
        Some(super::LocalFollow {
            following,
            worker: worker.base_url().to_string(),
        })
    }

    async fn seal_local(
        &self,
        uri: &ObjectUri,
        follow: super::LocalFollow,
        size: u64,
        meta: &UserMeta,
    ) -> Option<Result<ObjectStat, DataError>> {
        let super::LocalFollow { following, worker } = follow;
        // The ring changed meanwhile: the new owner takes the write
        // (dropping the follow ends it unrecorded).
        let client = self
            .writer_for(uri)
            .ok()
            .filter(|c| c.base_url() == worker)?;
        let progress = following.progress();
        let answer = client.seal_local(uri, following, size, meta).await?;
        let stat = write_answer(answer, &worker, progress);
        if let Ok(stat) = &stat {
            self.note_written(uri, &worker, stat);
        }
        Some(stat)
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), DataError> {
        Ok(ClusterClient::delete(self, uri).await?)
    }

    async fn copy(
        &self,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectStat, DataError> {
        Ok(ClusterClient::copy(self, from, etag, to, meta).await?)
    }
}

/// How far the connection has taken an upload's body: when it last took
/// a piece, and whether it took the end.
struct Handoff {
    last: Mutex<Instant>,
    ended: AtomicBool,
}

impl Default for Handoff {
    fn default() -> Self {
        Self {
            last: Mutex::new(Instant::now()),
            ended: AtomicBool::new(false),
        }
    }
}

impl Handoff {
    fn taken(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }
}
