use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use lakecache_protocol::{ListResponse, ObjectUri, UserMeta};

use crate::{CopyRange, ObjectMeta, ObjectStore, PartReceipt, StoreError, WriteIf};

/// A fault the next matching call returns instead of reaching the store.
#[derive(Debug, Clone)]
pub enum StoreFault {
    /// The next `get_range` fails with this error.
    FailGet(StoreError),
    /// The next `head` fails with this error.
    FailHead(StoreError),
    /// The next `put`/`upload_part`/`complete_multipart` fails.
    FailWrite(StoreError),
}

/// Wraps a store and injects queued faults: for unit tests of the layers
/// above the store (integration tests inject at the HTTP endpoint).
pub struct FaultyStore<S> {
    inner: S,
    faults: Arc<Mutex<VecDeque<StoreFault>>>,
}

impl<S: ObjectStore> FaultyStore<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    /// Handle to queue faults after the store was moved into the cache.
    pub fn handle(&self) -> Arc<Mutex<VecDeque<StoreFault>>> {
        self.faults.clone()
    }

    fn take(&self, pick: impl Fn(&StoreFault) -> Option<StoreError>) -> Option<StoreError> {
        let mut q = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        let idx = q.iter().position(|f| pick(f).is_some())?;
        q.remove(idx).and_then(|f| pick(&f))
    }

    fn take_write(&self) -> Option<StoreError> {
        self.take(|f| match f {
            StoreFault::FailWrite(e) => Some(e.clone()),
            _ => None,
        })
    }
}

#[async_trait::async_trait]
impl<S: ObjectStore> ObjectStore for FaultyStore<S> {
    async fn head(&self, uri: &ObjectUri) -> Result<ObjectMeta, StoreError> {
        if let Some(e) = self.take(|f| match f {
            StoreFault::FailHead(e) => Some(e.clone()),
            _ => None,
        }) {
            return Err(e);
        }
        self.inner.head(uri).await
    }

    async fn get_range(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        if let Some(e) = self.take(|f| match f {
            StoreFault::FailGet(e) => Some(e.clone()),
            _ => None,
        }) {
            return Err(e);
        }
        self.inner.get_range(uri, range, etag).await
    }

    async fn current_version(
        &self,
        uri: &ObjectUri,
    ) -> Result<(ObjectMeta, Option<String>), StoreError> {
        self.inner.current_version(uri).await
    }

    async fn get_range_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        self.inner
            .get_range_version(uri, range, version_id, etag)
            .await
    }

    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: u32,
    ) -> Result<ListResponse, StoreError> {
        self.inner
            .list(bucket, prefix, delimiter, token, max_keys)
            .await
    }

    async fn put_if(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &UserMeta,
        condition: &WriteIf,
    ) -> Result<String, StoreError> {
        if let Some(e) = self.take_write() {
            return Err(e);
        }
        self.inner.put_if(uri, data, meta, condition).await
    }

    async fn create_multipart(
        &self,
        uri: &ObjectUri,
        meta: &UserMeta,
    ) -> Result<String, StoreError> {
        self.inner.create_multipart(uri, meta).await
    }

    async fn upload_part(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        data: Bytes,
    ) -> Result<PartReceipt, StoreError> {
        if let Some(e) = self.take_write() {
            return Err(e);
        }
        self.inner
            .upload_part(uri, upload_id, part_number, data)
            .await
    }

    async fn complete_multipart_if(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        parts: Vec<(i32, PartReceipt)>,
        condition: &WriteIf,
    ) -> Result<String, StoreError> {
        if let Some(e) = self.take_write() {
            return Err(e);
        }
        self.inner
            .complete_multipart_if(uri, upload_id, parts, condition)
            .await
    }

    async fn abort_multipart(&self, uri: &ObjectUri, upload_id: &str) -> Result<(), StoreError> {
        self.inner.abort_multipart(uri, upload_id).await
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), StoreError> {
        self.inner.delete(uri).await
    }

    async fn upload_part_copy(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        source: &CopyRange<'_>,
    ) -> Result<PartReceipt, StoreError> {
        if let Some(e) = self.take_write() {
            return Err(e);
        }
        self.inner
            .upload_part_copy(uri, upload_id, part_number, source)
            .await
    }

    async fn copy(
        &self,
        from: &ObjectUri,
        etag: &str,
        to: &ObjectUri,
        meta: Option<&UserMeta>,
    ) -> Result<ObjectMeta, StoreError> {
        self.inner.copy(from, etag, to, meta).await
    }
}
