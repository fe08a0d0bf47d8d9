use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use lakecache_protocol::{ListResponse, ObjectUri, UserMeta};
use tracing::Instrument as _;

use crate::{CopyRange, ObjectMeta, ObjectStore, PartReceipt, StoreError, StoreMetrics, WriteIf};

/// Records requests, bytes and latency of every call to the inner store.
pub struct MeteredStore<S> {
    inner: S,
    metrics: Arc<dyn StoreMetrics>,
}

impl<S: ObjectStore> MeteredStore<S> {
    pub fn new(inner: S, metrics: Arc<dyn StoreMetrics>) -> Self {
        Self { inner, metrics }
    }

    fn record<T>(
        &self,
        op: &'static str,
        started: Instant,
        bytes: u64,
        result: &Result<T, StoreError>,
    ) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(StoreError::NotFound) => "not_found",
            Err(StoreError::PreconditionFailed) => "precondition_failed",
            Err(StoreError::Throttled(_)) => "throttled",
            Err(StoreError::Unsupported(_)) => "unsupported",
            Err(_) => "error",
        };
        self.metrics
            .s3_request(op, outcome, started.elapsed(), bytes);
    }
}

#[async_trait::async_trait]
impl<S: ObjectStore> ObjectStore for MeteredStore<S> {
    async fn head(&self, uri: &ObjectUri) -> Result<ObjectMeta, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .head(uri)
            .instrument(tracing::info_span!("s3", op = "head_object"))
            .await;
        self.record("head_object", t, 0, &r);
        r
    }

    async fn get_range(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .get_range(uri, range, etag)
            .instrument(tracing::info_span!("s3", op = "get_object"))
            .await;
        let n = r.as_ref().map(|b| b.len() as u64).unwrap_or(0);
        self.record("get_object", t, n, &r);
        r
    }

    async fn current_version(
        &self,
        uri: &ObjectUri,
    ) -> Result<(ObjectMeta, Option<String>), StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .current_version(uri)
            .instrument(tracing::info_span!("s3", op = "head_object"))
            .await;
        self.record("head_object", t, 0, &r);
        r
    }

    async fn get_range_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .get_range_version(uri, range, version_id, etag)
            .instrument(tracing::info_span!("s3", op = "get_object_version"))
            .await;
        let n = r.as_ref().map(|b| b.len() as u64).unwrap_or(0);
        self.record("get_object", t, n, &r);
        r
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: u32,
    ) -> Result<ListResponse, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .list(bucket, prefix, delimiter, token, max_keys)
            .await;
        self.record("list_objects_v2", t, 0, &r);
        r
    }

    async fn put_if(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
        condition: &WriteIf,
    ) -> Result<String, StoreError> {
        let (t, n) = (Instant::now(), data.len() as u64);
        let r = self
            .inner
            .put_if(uri, data, meta, condition)
            .instrument(tracing::info_span!("s3", op = "put_object"))
            .await;
        self.record("put_object", t, n, &r);
        r
    }

    async fn create_multipart(
        &self,
        uri: &ObjectUri,
        meta: &UserMeta,
    ) -> Result<String, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .create_multipart(uri, meta)
            .instrument(tracing::info_span!("s3", op = "create_multipart_upload"))
            .await;
        self.record("create_multipart_upload", t, 0, &r);
        r
    }

    async fn upload_part(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        data: Bytes,
    ) -> Result<PartReceipt, StoreError> {
        let (t, n) = (Instant::now(), data.len() as u64);
        let r = self
            .inner
            .upload_part(uri, upload_id, part_number, data)
            .await;
        self.record("upload_part", t, n, &r);
        r
    }

    async fn complete_multipart_if(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        parts: Vec<(i32, PartReceipt)>,
        condition: &WriteIf,
    ) -> Result<String, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .complete_multipart_if(uri, upload_id, parts, condition)
            .instrument(tracing::info_span!("s3", op = "complete_multipart_upload"))
            .await;
        self.record("complete_multipart_upload", t, 0, &r);
        r
    }

    async fn abort_multipart(&self, uri: &ObjectUri, upload_id: &str) -> Result<(), StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .abort_multipart(uri, upload_id)
            .instrument(tracing::info_span!("s3", op = "abort_multipart_upload"))
            .await;
        self.record("abort_multipart_upload", t, 0, &r);
        r
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .delete(uri)
            .instrument(tracing::info_span!("s3", op = "delete_object"))
            .await;
        self.record("delete_object", t, 0, &r);
        r
    }

    async fn upload_part_copy(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        source: &CopyRange<'_>,
    ) -> Result<PartReceipt, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .upload_part_copy(uri, upload_id, part_number, source)
            .await;
        self.record("upload_part_copy", t, 0, &r);
        r
    }

    async fn copy(
        &self,
        from: &ObjectUri,
        etag: &str,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectMeta, StoreError> {
        let t = Instant::now();
        let r = self
            .inner
            .copy(from, etag, to, meta)
            .instrument(tracing::info_span!("s3", op = "copy_object"))
            .await;
        self.record("copy_object", t, 0, &r);
        r
    }
}
