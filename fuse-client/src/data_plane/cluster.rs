//! The real data plane: the cache cluster's failover client.

use std::ops::Range;

use bytes::Bytes;
use futures::StreamExt;
use lakecache_protocol::{
    BoxError, ClientError, ErrorCode, ListResponse, ObjectStat, ObjectUri, UserMeta, WriteMode,
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
    ) -> Result<ObjectStat, DataError> {
        // A stream cannot be replayed on a replica: one worker takes it.
        let worker = self.writer_for(uri)?.with_timeout(limits.total);
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
        let pump = async move {
            let mut body = body;
            loop {
                let piece = body.next().await;
                let last = piece.is_none();
                match tokio::time::timeout(limits.progress, tx.send(piece)).await {
                    Ok(Ok(())) if !last => {}
                    // Handed over whole, or the request ended by itself:
                    // its own watch and result take it from here.
                    Ok(_) => return std::future::pending().await,
                    Err(_) => return,
                }
            }
        };
        let frames = futures::stream::unfold(Some(rx), |rx| async move {
            let mut rx = rx?;
            match rx.recv().await {
                Some(Some(piece)) => Some((Ok(piece), Some(rx))),
                Some(None) => None,
                None => Some((Err(BoxError::from("the write was given up")), None)),
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
        match result {
            Ok(stat) => Ok(stat),
            Err(ClientError::Timeout { .. }) => {
                crate::metrics::global().write_stall();
                Err(stalled())
            }
            Err(e) => Err(DataError::from(ClusterError::Worker(e))),
        }
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
