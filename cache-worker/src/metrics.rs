//! OpenTelemetry instruments, exported as Prometheus text on `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lakecache_telemetry::{counter, seconds_histogram as seconds, MetricsRegistry};
use opentelemetry::metrics::{Counter, Histogram};
use opentelemetry::KeyValue;

/// S3's list price for data transfer out to the internet (first 10 TB
/// tier, us-east-1), in dollars per GB.
pub const DEFAULT_EGRESS_PRICE_PER_GB: f64 = 0.09;

pub struct Metrics {
    registry: MetricsRegistry,
    requests: Counter<u64>,
    request_seconds: Histogram<f64>,
    served_bytes: Counter<u64>,
    fresh_bytes: Counter<u64>,
    local_bytes: Counter<u64>,
    inline_bytes: Counter<u64>,
    hit_bytes: Counter<u64>,
    miss_bytes: Counter<u64>,
    egress_saved_dollars: Counter<f64>,
    quota_evicted_bytes: Counter<u64>,
    egress_price_per_gb: AtomicU64,
    s3_requests: Counter<u64>,
    s3_bytes: Counter<u64>,
    s3_seconds: Histogram<f64>,
    s3_retries: Counter<u64>,
    evicted_pages: Counter<u64>,
    evicted_bytes: Counter<u64>,
    corrupt_pages: Counter<u64>,
    plan_prefetched_bytes: Counter<u64>,
    plan_staged_bytes: Counter<u64>,
    discarded_pages: Counter<u64>,
    handed_off_pages: Counter<u64>,
    writeback_uploaded_objects: Counter<u64>,
    writeback_uploaded_bytes: Counter<u64>,
    writeback_failures: Counter<u64>,
    writeback_gave_way_ms: Counter<u64>,
    /// The write-back state the backlog gauges read, once the cache opened.
    pub writeback: Arc<std::sync::OnceLock<std::sync::Weak<crate::writeback::WriteBack>>>,
    /// The cache the per-tenant gauges read, once it opened.
    pub cache: Arc<std::sync::OnceLock<std::sync::Weak<crate::cache::Cache>>>,
    /// Read by the gauges at scrape time.
    pub cache_used_bytes: Arc<AtomicU64>,
    pub cache_capacity_bytes: Arc<AtomicU64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    pub fn new() -> Result<Self, String> {
        let registry = MetricsRegistry::new();
        let meter = registry.meter("lakecache");
        let cache_used_bytes = Arc::new(AtomicU64::new(0));
        let cache_capacity_bytes = Arc::new(AtomicU64::new(0));
        let used = cache_used_bytes.clone();
        meter
            .u64_observable_gauge("lakecache_cache_used")
            .with_unit("By")
            .with_description("Bytes of pages on local disk")
            .with_callback(move |o| o.observe(used.load(Ordering::Relaxed), &[]))
            .build();
        let cap = cache_capacity_bytes.clone();
        meter
            .u64_observable_gauge("lakecache_cache_capacity")
            .with_unit("By")
            .with_description("Configured cache size")
            .with_callback(move |o| o.observe(cap.load(Ordering::Relaxed), &[]))
            .build();
        let writeback: Arc<std::sync::OnceLock<std::sync::Weak<crate::writeback::WriteBack>>> =
            Arc::default();
        type Pick = fn(&lakecache_protocol::WriteBackStatus) -> u64;
        let backlog: [(&'static str, &'static str, &'static str, Pick); 8] = [
            (
                "lakecache_writeback_pending_objects",
                "",
                "Acknowledged objects (and deletes) not yet in S3",
                |s| s.pending_objects,
            ),
            (
                "lakecache_writeback_pending",
                "By",
                "Bytes acknowledged and not yet in S3",
                |s| s.pending_bytes,
            ),
            (
                "lakecache_writeback_oldest_pending_age",
                "ms",
                "Age of the oldest acknowledgement not yet in S3",
                |s| s.oldest_pending_ms,
            ),
            (
                "lakecache_writeback_staging_limit",
                "By",
                "Dirty bytes held before writes wait",
                |s| s.staging_limit_bytes,
            ),
            (
                "lakecache_writeback_staging_used",
                "By",
                "Dirty bytes held now: pending objects and bodies being taken",
                |s| s.staging_used_bytes,
            ),
            (
                "lakecache_writeback_spare",
                "By",
                "Spare page files kept for write-back pages to be written over",
                |s| s.spare_bytes,
            ),
            (
                "lakecache_writeback_replica_objects",
                "",
                "Copies of other workers' pending writes held here",
                |s| s.replica_objects,
            ),
            (
                "lakecache_writeback_replica",
                "By",
                "Bytes of copies of other workers' pending writes held here",
                |s| s.replica_bytes,
            ),
        ];
        for (name, unit, help, pick) in backlog {
            let wb = writeback.clone();
            meter
                .u64_observable_gauge(name)
                .with_unit(unit)
                .with_description(help)
                .with_callback(move |o| {
                    if let Some(wb) = wb.get().and_then(std::sync::Weak::upgrade) {
                        o.observe(pick(&wb.status("")), &[]);
                    }
                })
                .build();
        }
        let cache: Arc<std::sync::OnceLock<std::sync::Weak<crate::cache::Cache>>> = Arc::default();
        type PickTenant = fn(&lakecache_protocol::TenantUsage) -> Option<u64>;
        let per_tenant: [(&'static str, &'static str, PickTenant); 3] = [
            (
                "lakecache_tenant_cache_used",
                "Bytes of pages fetched for each tenant",
                |t| Some(t.cache_bytes),
            ),
            (
                "lakecache_tenant_writeback_pending",
                "Each tenant's write-back bytes not yet in S3",
                |t| Some(t.pending_bytes),
            ),
            ("lakecache_tenant_quota", "Each tenant's cache quota", |t| {
                t.quota_bytes
            }),
        ];
        for (name, help, pick) in per_tenant {
            let cache = cache.clone();
            meter
                .u64_observable_gauge(name)
                .with_unit("By")
                .with_description(help)
                .with_callback(move |o| {
                    if let Some(c) = cache.get().and_then(std::sync::Weak::upgrade) {
                        for (tenant, usage) in c.tenant_usage() {
                            if let Some(v) = pick(&usage) {
                                o.observe(v, &[KeyValue::new("tenant", tenant)]);
                            }
                        }
                    }
                })
                .build();
        }
        let writing = cache.clone();
        meter
            .u64_observable_gauge("lakecache_page_writes_in_flight")
            .with_description("Fetched pages served from memory while their files are written")
            .with_callback(move |o| {
                if let Some(c) = writing.get().and_then(std::sync::Weak::upgrade) {
                    o.observe(c.page_writes_in_flight(), &[]);
                }
            })
            .build();
        let metrics = Self {
            cache,
            writeback,
            writeback_uploaded_objects: counter(
                &meter,
                "lakecache_writeback_uploaded_objects",
                "",
                "Write-back entries that reached S3",
            ),
            writeback_uploaded_bytes: counter(
                &meter,
                "lakecache_writeback_uploaded",
                "By",
                "Write-back bytes that reached S3",
            ),
            writeback_failures: counter(
                &meter,
                "lakecache_writeback_upload_failures",
                "",
                "Write-back upload attempts that failed (each is retried)",
            ),
            writeback_gave_way_ms: counter(
                &meter,
                "lakecache_writeback_upload_gave_way",
                "ms",
                "Time upload parts waited for write-back writes being taken on this worker",
            ),
            requests: counter(
                &meter,
                "lakecache_requests",
                "",
                "HTTP API requests by op and status",
            ),
            request_seconds: seconds(
                &meter,
                "lakecache_request_duration",
                "HTTP API latency by op",
            ),
            served_bytes: counter(
                &meter,
                "lakecache_served",
                "By",
                "Object bytes sent to clients",
            ),
            fresh_bytes: counter(
                &meter,
                "lakecache_fresh_served",
                "By",
                "Bytes served from pages just fetched whole, still in memory (no page file read)",
            ),
            local_bytes: counter(
                &meter,
                "lakecache_local_served",
                "By",
                "Object bytes granted to readers on this host as page-file descriptors (local socket)",
            ),
            inline_bytes: counter(
                &meter,
                "lakecache_local_inline_served",
                "By",
                "Object bytes sent to readers on this host over the local socket, without TLS, TCP or HTTP (also counted in lakecache_served)",
            ),
            hit_bytes: counter(
                &meter,
                "lakecache_cache_hit",
                "By",
                "Bytes served from local pages by bucket (S3 egress saved)",
            ),
            miss_bytes: counter(
                &meter,
                "lakecache_cache_miss",
                "By",
                "Bytes that had to come from S3 by bucket",
            ),
            s3_requests: counter(
                &meter,
                "lakecache_s3_requests",
                "",
                "S3 requests by op and outcome",
            ),
            s3_bytes: counter(
                &meter,
                "lakecache_s3_transferred",
                "By",
                "Bytes moved to or from S3 by op",
            ),
            s3_seconds: seconds(
                &meter,
                "lakecache_s3_request_duration",
                "S3 latency by op, retries included",
            ),
            s3_retries: counter(
                &meter,
                "lakecache_s3_retries",
                "",
                "S3 retries (SDK attempts and body resumes) by op",
            ),
            evicted_pages: counter(&meter, "lakecache_evicted_pages", "", "Pages evicted"),
            evicted_bytes: counter(&meter, "lakecache_evicted", "By", "Bytes evicted"),
            plan_prefetched_bytes: counter(
                &meter,
                "lakecache_plan_prefetched",
                "By",
                "Bytes fetched ahead of readers in the order their published plans give",
            ),
            plan_staged_bytes: counter(
                &meter,
                "lakecache_plan_staged",
                "By",
                "Cached bytes read from page files into memory just ahead of the readers whose plans read them",
            ),
            corrupt_pages: counter(
                &meter,
                "lakecache_corrupt_pages",
                "",
                "Pages that failed their header or CRC checks and were refetched",
            ),
            discarded_pages: counter(
                &meter,
                "lakecache_discarded_pages",
                "",
                "Pages dropped at start because the cache directory had another format or page size",
            ),
            handed_off_pages: counter(
                &meter,
                "lakecache_handed_off_pages",
                "",
                "Pages of written objects handed to the worker owning their segment",
            ),
            egress_saved_dollars: meter
                .f64_counter("lakecache_egress_saved_dollars")
                .with_description(
                    "S3 egress not paid for bytes served from pages, at the configured $/GB",
                )
                .build(),
            egress_price_per_gb: AtomicU64::new(DEFAULT_EGRESS_PRICE_PER_GB.to_bits()),
            quota_evicted_bytes: counter(
                &meter,
                "lakecache_tenant_quota_evicted",
                "By",
                "Bytes of a tenant's pages evicted because it was over its quota",
            ),
            cache_used_bytes,
            cache_capacity_bytes,
            registry,
        };
        // Present from the start, at 0: a scrape before the first upload
        // finds the write-back counters instead of missing them.
        for c in [
            &metrics.writeback_uploaded_objects,
            &metrics.writeback_uploaded_bytes,
            &metrics.writeback_failures,
            &metrics.writeback_gave_way_ms,
        ] {
            c.add(0, &[]);
        }
        Ok(metrics)
    }

    pub fn request(&self, op: &'static str, status: u16, elapsed: Duration) {
        let op_kv = KeyValue::new("op", op);
        self.requests.add(
            1,
            &[op_kv.clone(), KeyValue::new("status", i64::from(status))],
        );
        self.request_seconds.record(elapsed.as_secs_f64(), &[op_kv]);
    }

    pub fn served(&self, bytes: u64) {
        self.served_bytes.add(bytes, &[]);
    }

    pub fn served_local(&self, bytes: u64) {
        self.local_bytes.add(bytes, &[]);
    }

    pub fn served_inline(&self, bytes: u64) {
        self.inline_bytes.add(bytes, &[]);
    }

    pub fn served_fresh(&self, bytes: u64) {
        self.fresh_bytes.add(bytes, &[]);
    }

    /// Bytes of `bucket` served from pages (`hit`) and fetched from S3
    /// (`miss`); hits are S3 egress saved.
    pub fn traffic(&self, bucket: &str, hit: u64, miss: u64) {
        let labels = [KeyValue::new("bucket", bucket.to_string())];
        if hit > 0 {
            self.hit_bytes.add(hit, &labels);
            let price = f64::from_bits(self.egress_price_per_gb.load(Ordering::Relaxed));
            self.egress_saved_dollars
                .add(hit as f64 / 1e9 * price, &labels);
        }
        if miss > 0 {
            self.miss_bytes.add(miss, &labels);
        }
    }

    /// Bytes evicted because `tenant` was over its quota.
    pub fn quota_evicted(&self, tenant: &str, bytes: u64) {
        self.quota_evicted_bytes
            .add(bytes, &[KeyValue::new("tenant", tenant.to_string())]);
    }

    /// The $/GB that `lakecache_egress_saved_dollars_total` counts at.
    pub fn set_egress_price_per_gb(&self, price: f64) {
        self.egress_price_per_gb
            .store(price.to_bits(), Ordering::Relaxed);
    }

    fn record_s3_request(
        &self,
        op: &'static str,
        outcome: &'static str,
        elapsed: Duration,
        bytes: u64,
    ) {
        let op_kv = KeyValue::new("op", op);
        self.s3_requests
            .add(1, &[op_kv.clone(), KeyValue::new("outcome", outcome)]);
        self.s3_seconds
            .record(elapsed.as_secs_f64(), std::slice::from_ref(&op_kv));
        if bytes > 0 {
            self.s3_bytes.add(bytes, &[op_kv]);
        }
    }

    fn record_s3_retry(&self, op: &str) {
        self.s3_retries
            .add(1, &[KeyValue::new("op", op.to_string())]);
    }

    pub fn evicted(&self, pages: u64, bytes: u64) {
        self.evicted_pages.add(pages, &[]);
        self.evicted_bytes.add(bytes, &[]);
    }

    pub fn discarded_pages(&self, pages: u64) {
        self.discarded_pages.add(pages, &[]);
    }

    pub fn handed_off_pages(&self, pages: u64) {
        self.handed_off_pages.add(pages, &[]);
    }

    pub fn upload_gave_way(&self, waited: std::time::Duration) {
        self.writeback_gave_way_ms
            .add(waited.as_millis() as u64, &[]);
    }

    pub fn writeback_uploaded(&self, bytes: u64) {
        self.writeback_uploaded_objects.add(1, &[]);
        self.writeback_uploaded_bytes.add(bytes, &[]);
    }

    pub fn writeback_failure(&self) {
        self.writeback_failures.add(1, &[]);
    }

    pub fn plan_prefetched(&self, bytes: u64) {
        self.plan_prefetched_bytes.add(bytes, &[]);
    }

    pub fn plan_staged(&self, bytes: u64) {
        self.plan_staged_bytes.add(bytes, &[]);
    }

    pub fn corrupt_page(&self) {
        self.corrupt_pages.add(1, &[]);
    }

    /// Prometheus text exposition of every instrument.
    pub fn render(&self) -> String {
        self.registry.render()
    }
}

impl lakecache_store::StoreMetrics for Metrics {
    fn s3_request(&self, op: &'static str, outcome: &'static str, elapsed: Duration, bytes: u64) {
        self.record_s3_request(op, outcome, elapsed, bytes);
    }

    fn s3_retry(&self, op: &str) {
        self.record_s3_retry(op);
    }
}
