//! The lakecache cache worker: reads S3 on demand, keeps fixed-size pages
//! on local disk with a RocksDB index, and serves byte ranges over HTTP.

mod admission;
pub mod cache;
mod cache_dir;
#[doc(hidden)]
pub mod crashsim;
mod crc_combine;
pub mod fence;
mod flight;
mod fresh;
pub mod http;
mod index;
pub mod journal;
mod lru;
pub mod metrics;
mod outage;
pub mod pages;
mod peer_health;
mod placement;
pub mod plan_order;
pub mod policy;
pub mod preload;
mod spares;
pub mod tenant;
mod tenant_rate;
mod write;
pub mod writeback;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use cache::{Cache, CacheConfig, CacheError};
pub use http::{AccessPolicy, HttpLimits};
/// The object store seam lives in its own crate so clients need not link
/// the worker; re-exported under its old path.
pub use lakecache_store as store;
pub use metrics::Metrics;
pub use placement::Placement;
pub use store::{ObjectStore, S3Config, S3Store};

/// Everything a worker needs besides its object store.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub listen: SocketAddr,
    pub cache_dir: PathBuf,
    pub cache: CacheConfig,
    pub limits: HttpLimits,
    pub access: AccessPolicy,
    /// Serve HTTPS with this config; `None` is plain HTTP, which the CLI
    /// only allows when asked for.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// How this worker verifies peers in page hand-offs (HTTPS clusters).
    pub peer_tls: Option<lakecache_protocol::tls::ClientTls>,
    /// Unix socket for short-circuit reads by mounts on this host
    /// (`lakecache_protocol::local_read`); `None`: HTTP only.
    pub local_socket: Option<PathBuf>,
    /// The S3 store's stall timeout (`S3Config::stall_timeout`), shown in
    /// the health answer beside the other write-path deadlines.
    pub s3_stall_timeout: std::time::Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot open cache in {dir}: {source}")]
    Cache { dir: PathBuf, source: CacheError },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot create the local socket {path}: {source} (set another path with --local-socket, or turn it off with --no-local-socket)")]
    LocalSocket {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The aws-sdk-s3 store with request metrics.
pub async fn s3_store(config: &S3Config, metrics: Arc<Metrics>) -> Arc<dyn ObjectStore> {
    let s3 = S3Store::new(config, metrics.clone()).await;
    Arc::new(store::MeteredStore::new(s3, metrics))
}

pub struct RunningWorker {
    addr: SocketAddr,
    cache: Arc<Cache>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    local: Option<tokio::task::JoinHandle<()>>,
}

impl RunningWorker {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn cache(&self) -> &Arc<Cache> {
        &self.cache
    }

    /// Waits (up to `limit`, or until `give_up` resolves) for this
    /// worker's write-back journal to reach S3, still serving requests;
    /// returns the backlog left. What is left stays in the journal and
    /// resumes at the next start.
    pub async fn drain_writeback(
        &self,
        limit: Duration,
        give_up: impl std::future::Future<Output = ()>,
    ) -> lakecache_protocol::WriteBackStatus {
        let Some(wb) = self.cache.writeback.clone() else {
            return Default::default();
        };
        let deadline = tokio::time::Instant::now() + limit;
        let mut give_up = std::pin::pin!(give_up);
        let mut said = false;
        loop {
            let status = wb.status("");
            if status.pending_objects == 0 || tokio::time::Instant::now() >= deadline {
                return status;
            }
            if !said {
                tracing::info!(
                    objects = status.pending_objects,
                    bytes = status.pending_bytes,
                    "uploading the write-back backlog before stopping (signal again to stop now)"
                );
                said = true;
            }
            tokio::select! {
                () = &mut give_up => return wb.status(""),
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Stops accepting, drains requests in flight, and waits until the
    /// cache (and its RocksDB lock) is released so a new worker can open
    /// the same directory.
    pub async fn shutdown(mut self) {
        // Uploads in progress abort first (their multipart uploads too),
        // so the server's drain does not wait on bodies that never end.
        self.cache.begin_shutdown();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(local) = self.local.take() {
            local.abort();
            let _ = local.await;
        }
        let _ = (&mut self.task).await;
        let weak = Arc::downgrade(&self.cache);
        drop(self);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while weak.strong_count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for RunningWorker {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.task.abort();
        }
        if let Some(local) = &self.local {
            local.abort();
        }
    }
}

/// Opens the cache and starts serving the HTTP API.
pub async fn start_worker(
    options: WorkerOptions,
    store: Arc<dyn ObjectStore>,
    metrics: Arc<Metrics>,
) -> Result<RunningWorker, WorkerError> {
    fence::start();
    let store: Arc<dyn ObjectStore> = if options.cache.tenant_s3_rps.is_empty() {
        store
    } else {
        Arc::new(tenant_rate::TenantRateLimited::new(
            store,
            &options.cache.tenant_s3_rps,
        ))
    };
    let cache = Cache::open(
        &options.cache_dir,
        options.cache.clone(),
        store,
        metrics.clone(),
    )
    .map_err(|source| WorkerError::Cache {
        dir: options.cache_dir.clone(),
        source,
    })?;
    let listener = tokio::net::TcpListener::bind(options.listen)
        .await
        .map_err(|source| WorkerError::Listen {
            addr: options.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| WorkerError::Listen {
            addr: options.listen,
            source,
        })?;
    if let Some(keys) = &options.access.keys {
        cache.set_peer_key(keys.current().clone());
    }
    if let Some(tls) = &options.peer_tls {
        cache.set_peer_tls(tls.clone());
    }
    let state = Arc::new(http::AppState {
        cache: cache.clone(),
        metrics,
        limits: options.limits,
        s3_stall_timeout: options.s3_stall_timeout,
        tenants: http::TenantLimiter::new(
            options.limits.max_requests_per_tenant,
            options.limits.tenant_wait,
        ),
        access: options.access.clone(),
    });
    let local = match &options.local_socket {
        Some(path) => {
            let socket = http::local::bind(path).map_err(|source| WorkerError::LocalSocket {
                path: path.clone(),
                source,
            })?;
            tracing::info!(socket = %path.display(), "short-circuit reads for mounts on this host");
            Some(tokio::spawn(http::local::serve(
                socket,
                path.clone(),
                state.clone(),
                addr.to_string(),
            )))
        }
        None => None,
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let acceptor = options.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let task = tokio::spawn(http::serve(listener, acceptor, state, async move {
        let _ = stop_rx.await;
    }));
    tracing::info!(%addr, cache_dir = %options.cache_dir.display(), "worker listening");
    Ok(RunningWorker {
        addr,
        cache,
        stop: Some(stop_tx),
        task,
        local,
    })
}
