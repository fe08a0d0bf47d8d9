use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::{ObjectUri, WorkerClient};
use lakecache_s3_endpoint::{EndpointConfig, FaultInjector, RunningEndpoint, S3Op};
use lakecache_worker::store::{ObjectStore, RetryMode};
use lakecache_worker::{CacheConfig, HttpLimits, Metrics, RunningWorker, S3Config, WorkerOptions};
use sha2::{Digest, Sha256};

pub const BUCKET: &str = "data";
/// A second bucket, for copies across buckets.
pub const OTHER_BUCKET: &str = "other";
pub const MIB: u64 = 1 << 20;

pub struct Harness {
    _dir: tempfile::TempDir,
    pub s3: RunningEndpoint,
    pub s3_config: S3Config,
    pub options: WorkerOptions,
    pub worker: Option<RunningWorker>,
    pub metrics: Arc<Metrics>,
    pub client: WorkerClient,
    /// Direct S3 access that bypasses the worker (for setup and checks).
    pub direct: Arc<dyn ObjectStore>,
}

pub fn default_options(cache_dir: PathBuf) -> WorkerOptions {
    WorkerOptions {
        s3_stall_timeout: std::time::Duration::from_secs(10),
        listen: "127.0.0.1:0".parse().unwrap(),
        cache_dir,
        cache: CacheConfig {
            page_size: MIB,
            capacity: 256 * MIB,
            high_watermark: 0.95,
            low_watermark: 0.85,
            metadata_ttl: Duration::from_secs(60),
            readahead_pages: 0,
            fetch_concurrency: 16,
            part_size: 5 * MIB,
            copy_part_limit: lakecache_worker::store::MAX_COPY_BYTES,
            segment_size: None,
            writeback: Default::default(),
            memory_limit: 1 << 30,
            policies: Default::default(),
            egress_price_per_gb: lakecache_worker::metrics::DEFAULT_EGRESS_PRICE_PER_GB,
            tenant_quotas: Default::default(),
            tenant_s3_rps: Default::default(),
            plan_prefetch: Default::default(),
        },
        limits: HttpLimits::default(),
        access: Default::default(),
        local_socket: None,
        tls: None,
        peer_tls: None,
    }
}

#[path = "../../../testing/ports.rs"]
mod ports;

/// `options` listening on a port a restart can bind again (see
/// `ports::unused_port`) where they name port 0.
fn restartable(mut options: WorkerOptions) -> WorkerOptions {
    if options.listen.port() == 0 {
        options.listen.set_port(ports::unused_port());
    }
    options
}

impl Harness {
    pub async fn start() -> Self {
        Self::with(|_| {}).await
    }

    pub async fn with(tune: impl FnOnce(&mut WorkerOptions)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let s3 = lakecache_s3_endpoint::start(EndpointConfig {
            root: dir.path().join("s3"),
            listen: "127.0.0.1:0".parse().unwrap(),
            access_key: "test-access".into(),
            secret_key: "test-secret-key".into(),
            buckets: vec![BUCKET.into(), OTHER_BUCKET.into()],
            list_without_etags: false,
        })
        .await
        .unwrap();
        let s3_config = S3Config {
            endpoint: Some(s3.url()),
            path_style: true,
            retry_mode: RetryMode::Standard,
            max_attempts: 4,
            static_credentials: Some(("test-access".into(), "test-secret-key".into())),
            ..S3Config::default()
        };
        let mut options = default_options(dir.path().join("cache"));
        tune(&mut options);
        let metrics = Arc::new(Metrics::new().unwrap());
        let direct =
            lakecache_worker::s3_store(&s3_config, Arc::new(Metrics::new().unwrap())).await;
        let worker =
            Self::spawn_worker(&restartable(options.clone()), &s3_config, metrics.clone()).await;
        let client =
            WorkerClient::new(&worker.addr().to_string(), Duration::from_secs(60)).unwrap();
        Self {
            _dir: dir,
            s3,
            s3_config,
            options,
            worker: Some(worker),
            metrics,
            client,
            direct,
        }
    }

    async fn spawn_worker(
        options: &WorkerOptions,
        s3: &S3Config,
        metrics: Arc<Metrics>,
    ) -> RunningWorker {
        let store = lakecache_worker::s3_store(s3, metrics.clone()).await;
        lakecache_worker::start_worker(options.clone(), store, metrics)
            .await
            .unwrap()
    }

    /// Where the embedded endpoint keeps objects and pending uploads.
    pub fn s3_root(&self) -> PathBuf {
        self._dir.path().join("s3")
    }

    pub fn addr(&self) -> SocketAddr {
        self.worker.as_ref().unwrap().addr()
    }

    pub fn faults(&self) -> &Arc<FaultInjector> {
        self.s3.faults()
    }

    pub fn gets(&self) -> u64 {
        self.faults().count(S3Op::GetObject)
    }

    pub fn heads(&self) -> u64 {
        self.faults().count(S3Op::HeadObject)
    }

    /// Stops the worker and starts a fresh process-equivalent over the
    /// same cache directory (same address is not kept).
    pub async fn restart_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            w.shutdown().await;
        }
        self.metrics = Arc::new(Metrics::new().unwrap());
        let worker = Self::spawn_worker(&self.options, &self.s3_config, self.metrics.clone()).await;
        self.client =
            WorkerClient::new(&worker.addr().to_string(), Duration::from_secs(60)).unwrap();
        self.worker = Some(worker);
    }

    /// Another worker on the same S3, with its cache in `dir`, listening
    /// on `listen` (an address a worker had before) or a port from the OS.
    pub async fn start_another(
        &self,
        dir: &std::path::Path,
        listen: Option<&str>,
    ) -> lakecache_worker::RunningWorker {
        let mut options = restartable(self.options.clone());
        options.cache_dir = dir.to_path_buf();
        if let Some(addr) = listen {
            options.listen = addr.parse().unwrap();
        }
        let metrics = Arc::new(Metrics::new().unwrap());
        let store = lakecache_worker::s3_store(&self.s3_config, metrics.clone()).await;
        lakecache_worker::start_worker(options, store, metrics)
            .await
            .unwrap_or_else(|e| panic!("starting a worker over {}: {e}", dir.display()))
    }

    /// What S3 itself holds at `key` (read past the workers), if anything.
    pub async fn s3_bytes(&self, key: &str) -> Option<Vec<u8>> {
        let meta = self.direct.head(&uri(key)).await.ok()?;
        let body = self
            .direct
            .get_range(&uri(key), 0..meta.size, &meta.etag)
            .await
            .ok()?;
        Some(body.to_vec())
    }

    pub async fn put_direct(&self, key: &str, data: &[u8]) -> String {
        self.direct
            .put(&uri(key), Bytes::copy_from_slice(data), &Default::default())
            .await
            .unwrap()
    }

    /// The page files once no fetched page is still being written (its
    /// bytes are served from memory meanwhile): waits, with a deadline,
    /// for `lakecache_page_writes_in_flight` to read 0.
    pub async fn settled_page_files(&self) -> Vec<PathBuf> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let metrics = self.client.metrics().await.unwrap();
            if metric_value(&metrics, "lakecache_page_writes_in_flight") == 0.0 {
                return self.page_files();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "page writes still in flight after 30 s:\n{metrics}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    pub fn page_files(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let root = self.options.cache_dir.join("pages");
        for shard in std::fs::read_dir(root).unwrap() {
            for f in std::fs::read_dir(shard.unwrap().path()).unwrap() {
                out.push(f.unwrap().path());
            }
        }
        out
    }
}

pub fn uri(key: &str) -> ObjectUri {
    ObjectUri::new(BUCKET, key).unwrap()
}

/// Deterministic pseudo-random bytes (xorshift), distinct per seed.
pub fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub fn sha(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Sends raw bytes on a new connection; returns the status code and the
/// rest of the response as text.
pub async fn raw_request(addr: SocketAddr, request: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = conn.into_split();
    // Write concurrently: the server may answer (and stop reading) before
    // a large body is fully sent.
    let request = request.to_vec();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&request).await;
        wr
    });
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut buf)).await;
    writer.abort();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// Sum of every sample of a metric in Prometheus text. A metric with no
/// sample fails the test: a renamed metric must not read as 0.
pub fn metric_value(text: &str, name: &str) -> f64 {
    let mut found = None;
    for l in text.lines().filter(|l| l.starts_with(name)) {
        let v = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        *found.get_or_insert(0.0) += v.unwrap_or_else(|| panic!("unreadable metric line {l:?}"));
    }
    found.unwrap_or_else(|| panic!("no metric named {name} in:\n{text}"))
}

/// `d` multiplied by `LAKECACHE_TEST_TIME_SCALE` (a positive number,
/// default 1): every deadline in these tests goes through it.
pub fn scaled(d: Duration) -> Duration {
    let factor = match std::env::var("LAKECACHE_TEST_TIME_SCALE") {
        Err(_) => 1.0,
        Ok(s) => match s.trim().parse::<f64>() {
            Ok(f) if f.is_finite() && f > 0.0 => f,
            _ => panic!("LAKECACHE_TEST_TIME_SCALE={s:?} is not a positive number"),
        },
    };
    d.mul_f64(factor)
}

/// Polls `check` every 20 ms until it holds; fails with `what` after
/// `limit` (scaled).
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let limit = scaled(limit);
    let start = std::time::Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fails unless `err` is the worker's answer with error `code`.
#[track_caller]
pub fn assert_api_error(
    err: &lakecache_protocol::ClientError,
    code: lakecache_protocol::ErrorCode,
) {
    assert!(
        matches!(err, lakecache_protocol::ClientError::Api { code: c, .. } if *c == code),
        "expected the worker's {code:?} error, got {err:?}"
    );
}

/// `body` put through `client` in `mode`, sent in 256 KiB pieces with its
/// CRC32C trailer and watched (keepalive answers) with `watch`.
pub async fn put_watched(
    client: &WorkerClient,
    key: &str,
    body: &[u8],
    mode: lakecache_protocol::WriteMode,
    watch: Duration,
) -> Result<lakecache_protocol::ObjectStat, lakecache_protocol::ClientError> {
    let pieces: Vec<Result<Bytes, lakecache_protocol::BoxError>> = body
        .chunks(256 << 10)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    client
        .put_checked(
            &uri(key),
            futures::stream::iter(pieces),
            mode,
            &[],
            &Default::default(),
            Some(watch),
        )
        .await
}
