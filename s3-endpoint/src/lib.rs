//! An S3-compatible endpoint that ships inside lakecache.
//!
//! Built on the `s3s` protocol crates (real SigV4 over HTTP) with its own
//! storage: a RocksDB index over blob files, so directory markers, ETags in
//! listings and HEAD on prefix-only keys behave like S3. Tests, benches and
//! the quick start use it; production points lakecache at real S3.

mod db;
mod faults;
mod part_copy;
mod s3api;
mod server;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

pub use faults::{Fault, FaultInjector, S3Op};

/// How to run an embedded endpoint.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    pub root: PathBuf,
    pub listen: SocketAddr,
    pub access_key: String,
    pub secret_key: String,
    /// Buckets to create at start (existing ones are kept).
    pub buckets: Vec<String>,
    /// Behave like S3-compatible stores whose ListObjectsV2 entries carry
    /// no ETag (for testing clients against that quirk).
    pub list_without_etags: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("cannot open storage under {root}: {source}")]
    Storage { root: PathBuf, source: db::DbError },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("invalid bucket name {0:?}")]
    InvalidBucket(String),
}

/// A running endpoint; dropping it without `shutdown` aborts the server.
pub struct RunningEndpoint {
    addr: SocketAddr,
    faults: Arc<FaultInjector>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningEndpoint {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, what clients use as endpoint URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Per-operation counters and fault rules of this endpoint.
    pub fn faults(&self) -> &Arc<FaultInjector> {
        &self.faults
    }

    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for RunningEndpoint {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.task.abort();
        }
    }
}

/// S3's bucket naming rules (the subset that matters for path-style use).
pub fn valid_bucket_name(name: &str) -> bool {
    (3..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
        && !name.contains("..")
}

/// Opens storage, creates the configured buckets and starts serving.
pub async fn start(config: EndpointConfig) -> Result<RunningEndpoint, EndpointError> {
    for b in &config.buckets {
        if !valid_bucket_name(b) {
            return Err(EndpointError::InvalidBucket(b.clone()));
        }
    }
    let root = config.root.clone();
    let opened = tokio::task::spawn_blocking(move || db::ObjectDb::open(&root))
        .await
        .map_err(|e| EndpointError::Storage {
            root: config.root.clone(),
            source: db::DbError::Io {
                path: config.root.clone(),
                source: std::io::Error::other(e),
            },
        })?;
    let db = Arc::new(opened.map_err(|source| EndpointError::Storage {
        root: config.root.clone(),
        source,
    })?);
    for b in &config.buckets {
        db.create_bucket(b)
            .map_err(|source| EndpointError::Storage {
                root: config.root.clone(),
                source,
            })?;
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| EndpointError::Listen {
            addr: config.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| EndpointError::Listen {
            addr: config.listen,
            source,
        })?;
    let faults = Arc::new(FaultInjector::default());
    let mut builder = s3s::service::S3ServiceBuilder::new(s3api::EmbeddedS3::new(
        db,
        config.list_without_etags,
        faults.clone(),
    ));
    builder.set_auth(s3s::auth::SimpleAuth::from_single(
        config.access_key.clone(),
        config.secret_key.clone(),
    ));
    let service = builder.build();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server::serve(
        listener,
        service,
        faults.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    tracing::info!(%addr, root = %config.root.display(), "embedded s3 endpoint listening");
    Ok(RunningEndpoint {
        addr,
        faults,
        stop: Some(stop_tx),
        task,
    })
}
