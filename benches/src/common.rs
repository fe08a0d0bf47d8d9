//! Setup shared by the benchmarks: an embedded S3 endpoint with its
//! client config, and worker options.

// Each benchmark binary uses a part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use lakecache_s3_endpoint::{EndpointConfig, RunningEndpoint};
use lakecache_worker::store::ObjectStore;
use lakecache_worker::{CacheConfig, HttpLimits, Metrics, S3Config, WorkerOptions};

pub const MIB: u64 = 1 << 20;

pub struct BenchS3 {
    pub endpoint: RunningEndpoint,
    pub config: S3Config,
    /// aws-sdk-s3 straight to the endpoint, bypassing any worker.
    pub direct: Arc<dyn ObjectStore>,
}

pub async fn start_s3(root: PathBuf, bucket: &str) -> Result<BenchS3> {
    let endpoint = lakecache_s3_endpoint::start(EndpointConfig {
        root,
        listen: "127.0.0.1:0".parse()?,
        access_key: "bench".into(),
        secret_key: "bench-secret".into(),
        buckets: vec![bucket.into()],
        list_without_etags: false,
    })
    .await?;
    let config = S3Config {
        endpoint: Some(endpoint.url()),
        path_style: true,
        static_credentials: Some(("bench".into(), "bench-secret".into())),
        ..S3Config::default()
    };
    let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
    let direct = lakecache_worker::s3_store(&config, metrics).await;
    Ok(BenchS3 {
        endpoint,
        config,
        direct,
    })
}

/// 4 MiB pages, read-ahead 4, long metadata TTL.
pub fn worker_options(cache_dir: PathBuf, capacity: u64) -> Result<WorkerOptions> {
    Ok(WorkerOptions {
        s3_stall_timeout: std::time::Duration::from_secs(10),
        listen: "127.0.0.1:0".parse()?,
        cache_dir,
        cache: CacheConfig {
            page_size: 4 * MIB,
            capacity,
            high_watermark: 0.95,
            low_watermark: 0.85,
            metadata_ttl: Duration::from_secs(600),
            readahead_pages: 4,
            fetch_concurrency: 32,
            part_size: 16 * MIB,
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
    })
}

/// A `lakecache mount` a bench started: unmounted and stopped when dropped.
pub struct BenchMount {
    pub child: std::process::Child,
    pub path: PathBuf,
}

impl BenchMount {
    /// Spawns `cmd` (a `lakecache mount ... PATH`) and waits until `path`
    /// is mounted; a mount that exits or takes over 30 s is an error.
    pub fn start(cmd: &mut std::process::Command, path: &std::path::Path) -> Result<Self> {
        std::fs::create_dir_all(path)?;
        // The mount table names it by its absolute path.
        let path = &std::fs::canonicalize(path)?;
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {cmd:?}: {e}"))?;
        let mut mount = BenchMount {
            child,
            path: path.to_path_buf(),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !is_mounted(path) {
            if let Some(status) = mount.child.try_wait()? {
                anyhow::bail!("the mount at {} exited ({status})", path.display());
            }
            if std::time::Instant::now() > deadline {
                anyhow::bail!("the mount at {} did not come up in 30 s", path.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(mount)
    }
}

impl Drop for BenchMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg(&self.path)
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `path` is a mount point (as this process's mount table says).
pub fn is_mounted(path: &std::path::Path) -> bool {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| m.lines().any(|l| l.split(' ').nth(4) == Some(&*want)))
        .unwrap_or(false)
}
