//! The worker's HTTP server (hyper 1, HTTP/1.1 with keep-alive).

pub mod auth;
mod body_check;
mod limits;
mod load;
pub mod local;
mod local_commit;
mod local_follow;
mod peer_writeback;
mod plans;
mod range;
mod read_crc;
mod response;
mod routes;
pub mod table;
mod versions;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tracing::Instrument;

pub use auth::AccessPolicy;
pub(crate) use limits::TenantLimiter;
pub use routes::AppState;

/// Request limits; anything over them gets a 4xx and the worker goes on.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_uri_bytes: usize,
    /// Bytes of request line plus headers (hyper answers 431 beyond it).
    pub max_header_bytes: usize,
    pub max_body_bytes: u64,
    /// Open client connections at most; beyond it new connections wait
    /// in the kernel's accept queue.
    pub max_connections: usize,
    /// Requests in flight per tenant; more wait `tenant_wait`, then 429.
    pub max_requests_per_tenant: usize,
    pub tenant_wait: Duration,
    /// An upload whose client sends nothing for this long is aborted.
    pub body_idle_timeout: Duration,
    /// A client must send its request head within this long (slowloris).
    pub header_read_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_uri_bytes: 8 * 1024,
            max_header_bytes: 64 * 1024,
            max_body_bytes: 5 << 40,
            max_connections: 4096,
            max_requests_per_tenant: 1024,
            tenant_wait: Duration::from_secs(5),
            body_idle_timeout: Duration::from_secs(60),
            header_read_timeout: Duration::from_secs(30),
        }
    }
}

async fn handle(
    state: Arc<AppState>,
    req: http::Request<hyper::body::Incoming>,
) -> Result<response::Response, Infallible> {
    let started = Instant::now();
    let path: String = req.uri().path().chars().take(256).collect();
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        path = %path,
        op = tracing::field::Empty,
        tenant = tracing::field::Empty,
        status = tracing::field::Empty,
    );
    lakecache_telemetry::trace::adopt_remote_parent(&span, req.headers());
    async move {
        let (op, resp) = routes::route(&state, req).await;
        let status = resp.status().as_u16();
        let span = tracing::Span::current();
        span.record("op", op);
        span.record("status", status);
        state.metrics.request(op, status, started.elapsed());
        if status >= 500 {
            tracing::warn!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "request failed"
            );
        } else {
            tracing::debug!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "request done"
            );
        }
        Ok(resp)
    }
    .instrument(span)
    .await
}

/// How long a client may take to complete a TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the API on `listener` (over TLS with `acceptor`) until
/// `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .keep_alive(true)
        .timer(TokioTimer::new())
        .header_read_timeout(state.limits.header_read_timeout)
        // hyper's own hard cap; the exact limit is checked per request.
        .max_buf_size((2 * state.limits.max_header_bytes).max(8192));
    tokio::pin!(shutdown);
    let connections = Arc::new(tokio::sync::Semaphore::new(
        state.limits.max_connections.max(1),
    ));
    loop {
        // A connection slot first: over the cap, accepting waits.
        let slot = tokio::select! {
            slot = connections.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let svc = service_fn(move |req| handle(state.clone(), req));
        let Some(acceptor) = acceptor.clone() else {
            let conn = graceful.watch(builder.serve_connection(TokioIo::new(stream), svc));
            tokio::spawn(async move {
                let _slot = slot;
                if let Err(e) = conn.await {
                    tracing::debug!(%peer, error = %e, "connection ended with error");
                }
            });
            continue;
        };
        // The handshake runs in the connection's task so a slow client
        // never holds up the accept loop.
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _slot = slot;
            // rustls reads at most 4 KiB per call: buffer the socket so an
            // upload costs a system call per many records, not per 4 KiB.
            let stream = tokio::io::BufReader::with_capacity(256 * 1024, stream);
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let conn = watcher.watch(builder.serve_connection(TokioIo::new(tls), svc));
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with error");
            }
        });
    }
    if tokio::time::timeout(Duration::from_secs(10), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 10 s; closing them");
    }
}
