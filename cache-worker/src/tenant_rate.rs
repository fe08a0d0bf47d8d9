//! S3 requests per second per tenant: a token bucket for each tenant
//! that has a limit, in front of the object store. Work for a tenant over
//! its rate waits (back-pressure on that tenant's clients only); other
//! tenants and the worker's own background work are not slowed.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use lakecache_protocol::{ListResponse, ObjectUri, UserMeta};
use lakecache_store::{CopyRange, ObjectMeta, ObjectStore, PartReceipt, StoreError, WriteIf};

struct Bucket {
    rate: f64,
    tokens: f64,
    last: Instant,
}

/// The token buckets, one per tenant with a limit.
pub struct TenantRates {
    buckets: BTreeMap<String, Mutex<Bucket>>,
}

impl TenantRates {
    /// `rps`: requests per second by tenant; bursts of up to one second's
    /// worth pass at once.
    pub fn new(rps: &BTreeMap<String, u32>) -> Self {
        let buckets = rps
            .iter()
            .map(|(tenant, &rate)| {
                let rate = f64::from(rate.max(1));
                let bucket = Bucket {
                    rate,
                    tokens: rate,
                    last: Instant::now(),
                };
                (tenant.clone(), Mutex::new(bucket))
            })
            .collect();
        Self { buckets }
    }

    /// Waits until the current tenant may make one more S3 request.
    pub async fn admit(&self) {
        let Some(tenant) = crate::tenant::current() else {
            return;
        };
        let Some(bucket) = self.buckets.get(&*tenant) else {
            return;
        };
        loop {
            let wait = {
                let mut b = bucket.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let refill = now.duration_since(b.last).as_secs_f64() * b.rate;
                b.tokens = (b.tokens + refill).min(b.rate);
                b.last = now;
                if b.tokens >= 1.0 {
                    b.tokens -= 1.0;
                    return;
                }
                Duration::from_secs_f64((1.0 - b.tokens) / b.rate)
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// The object store, with each call admitted by [`TenantRates`] first.
pub struct TenantRateLimited {
    inner: Arc<dyn ObjectStore>,
    rates: TenantRates,
}

impl TenantRateLimited {
    pub fn new(inner: Arc<dyn ObjectStore>, rps: &BTreeMap<String, u32>) -> Self {
        Self {
            inner,
            rates: TenantRates::new(rps),
        }
    }

    async fn admit(&self) {
        self.rates.admit().await
    }
}

#[async_trait::async_trait]
impl ObjectStore for TenantRateLimited {
    async fn head(&self, uri: &ObjectUri) -> Result<ObjectMeta, StoreError> {
        self.admit().await;
        self.inner.head(uri).await
    }

    async fn get_range(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        self.admit().await;
        self.inner.get_range(uri, range, etag).await
    }

    async fn current_version(
        &self,
        uri: &ObjectUri,
    ) -> Result<(ObjectMeta, Option<String>), StoreError> {
        self.admit().await;
        self.inner.current_version(uri).await
    }

    async fn get_range_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, StoreError> {
        self.admit().await;
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
        self.admit().await;
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
        self.admit().await;
        self.inner.put_if(uri, data, meta, condition).await
    }

    async fn create_multipart(
        &self,
        uri: &ObjectUri,
        meta: &UserMeta,
    ) -> Result<String, StoreError> {
        self.admit().await;
        self.inner.create_multipart(uri, meta).await
    }

    async fn upload_part(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        data: Bytes,
    ) -> Result<PartReceipt, StoreError> {
        self.admit().await;
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
        self.admit().await;
        self.inner
            .complete_multipart_if(uri, upload_id, parts, condition)
            .await
    }

    async fn abort_multipart(&self, uri: &ObjectUri, upload_id: &str) -> Result<(), StoreError> {
        // Cleanup is never held back.
        self.inner.abort_multipart(uri, upload_id).await
    }

    async fn delete(&self, uri: &ObjectUri) -> Result<(), StoreError> {
        self.admit().await;
        self.inner.delete(uri).await
    }

    async fn upload_part_copy(
        &self,
        uri: &ObjectUri,
        upload_id: &str,
        part_number: i32,
        source: &CopyRange<'_>,
    ) -> Result<PartReceipt, StoreError> {
        self.admit().await;
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
        self.admit().await;
        self.inner.copy(from, etag, to, meta).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_limited_tenant_waits_and_others_do_not() {
        let limited = TenantRates::new(&[("slow".to_string(), 20)].into());
        let started = Instant::now();
        crate::tenant::scope(Some("slow".into()), async {
            for _ in 0..40 {
                limited.admit().await;
            }
        })
        .await;
        // 20 at once (the burst), then 20 more at 20/s.
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(900), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        let started = Instant::now();
        crate::tenant::scope(Some("other".into()), async {
            for _ in 0..1000 {
                limited.admit().await;
            }
        })
        .await;
        for _ in 0..1000 {
            limited.admit().await; // the worker's own work
        }
        assert!(started.elapsed() < Duration::from_millis(200));
    }
}
