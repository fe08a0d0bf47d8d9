//! A pooled HTTP/1.1 client for one worker.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};
use hyper::body::Body as _;
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;

mod load;
mod plan;

use crate::buffered::BufferedConnector;
use crate::local_read::{LocalChannel, LocalError};
use crate::tls::ClientTls;
use crate::types::{ErrorBody, ErrorCode, Health, ListResponse, ObjectStat, ObjectVersion};
use crate::uri::ObjectUri;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type RequestBody = BoxBody<Bytes, BoxError>;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("worker answered {status} {code:?}: {message}")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    /// The connection failed; the source says how (kept whole for logs).
    #[error("cannot reach worker {addr}")]
    Transport {
        addr: String,
        #[source]
        source: BoxError,
    },
    /// The TLS handshake failed: wrong CA, wrong name, or a worker that
    /// wants a client certificate. Configuration, not a transient fault.
    #[error("TLS with worker {addr} failed: {message} (check --tls-ca, and --tls-cert/--tls-key where the worker requires client certificates)")]
    Tls { addr: String, message: String },
    #[error("worker {addr} did not answer within {0:?}", .timeout)]
    Timeout { addr: String, timeout: Duration },
    #[error("short body from worker: expected {expected} bytes, got {got}")]
    ShortBody { expected: u64, got: u64 },
    /// The bytes that arrived do not match the CRC32C the worker sent
    /// with them: damaged on the way.
    #[error("bytes from worker {addr} fail their CRC32C (sent {sent:08x}, arrived {arrived:08x})")]
    Damaged {
        addr: String,
        sent: u32,
        arrived: u32,
    },
    #[error("unexpected response from worker: {0}")]
    Decode(String),
    #[error("invalid worker address {0:?}")]
    InvalidAddress(String),
}

impl ClientError {
    /// True when another worker (or S3) might answer where this one failed.
    pub fn is_retryable(&self) -> bool {
        match self {
            // The worker is fine and S3 is not: every other worker (and
            // the client's own S3 fallback) would meet the same S3.
            ClientError::Api {
                code: ErrorCode::UpstreamUnavailable | ErrorCode::UpstreamThrottled,
                ..
            } => false,
            ClientError::Api { status, .. } => *status >= 500,
            ClientError::Transport { .. }
            | ClientError::Timeout { .. }
            | ClientError::ShortBody { .. }
            | ClientError::Damaged { .. } => true,
            ClientError::Decode(_) | ClientError::InvalidAddress(_) | ClientError::Tls { .. } => {
                false
            }
        }
    }
}

/// On a PUT, names the object to copy from (`/v1/objects/{bucket}/{key}`)
/// instead of a body.
pub const COPY_SOURCE_HEADER: &str = "x-lakecache-copy-source";

/// On a page hand-off (`PUT /v1/pages/...`), the object offset of the
/// first byte of the body; the version is named by `If-Match`.
pub const OFFSET_HEADER: &str = "x-lakecache-offset";
/// On a page hand-off, the sending worker's instance id: a worker never
/// takes pages from itself (a ring entry can name it by another address).
pub const FROM_HEADER: &str = "x-lakecache-from";
/// On a read's response: `hit` when the first piece's bytes (up to the
/// end of its page) were cached when the read was issued, `miss` when it
/// waited on S3 or on a fetch in flight. Reads within one page are
/// described whole.
pub const CACHE_HEADER: &str = "x-lakecache-cache";
/// On a read: `1` when the reader asks ahead of what it was asked for
/// (a mount's read-ahead), which plans take for their reader's read only
/// near where that reader is (see [`ReadKind`]).
pub const READ_AHEAD_HEADER: &str = "x-lakecache-read-ahead";

/// Whether a read is one a reader asked for, or a guess ahead of it. A
/// worker moves a plan on by a demand read wherever the plan lists it
/// next, but by a read-ahead only near where its reader is: a mount's
/// guess past a sample is not the plan's read of the page it lands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadKind {
    #[default]
    Demand,
    Ahead,
}

/// Largest response body buffer allocated up front from Content-Length.
const MAX_PRESIZE: u64 = 256 << 20;

/// How long a worker may take before the client gives up on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// TCP connect; short, since a LAN peer answers in microseconds.
    pub connect: Duration,
    /// Reads, stats and listings: longest wait for the response head and
    /// between two pieces of a body. A hung worker (stopped process,
    /// black-holed path) costs this long, then the caller fails over.
    pub progress: Duration,
    /// Whole requests that carry a body (uploads, copies): S3 answers
    /// them only once the object is stored.
    pub request: Duration,
}

impl Deadlines {
    /// One timeout for everything (connect capped at a second).
    pub fn uniform(timeout: Duration) -> Self {
        Self {
            connect: timeout.min(Duration::from_secs(1)),
            progress: timeout,
            request: timeout,
        }
    }
}

/// A watched write's answer (keepalive spaces, then a stat or an error)
/// is small; a longer one is not a worker's.
const MAX_WRITE_ANSWER: usize = 16 << 20;

#[derive(Clone)]
pub struct WorkerClient {
    base: String,
    client: Client<HttpsConnector<BufferedConnector>, RequestBody>,
    deadlines: Deadlines,
    /// `Authorization` value sent with every request (never logged).
    bearer: Option<http::HeaderValue>,
    /// This worker's Unix socket when it runs on this host: ranges of
    /// cached versions are read from its page files (see `local_read`).
    local: Option<Arc<LocalChannel>>,
}

impl std::fmt::Debug for WorkerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerClient")
            .field("base", &self.base)
            .finish()
    }
}

/// The rustls error somewhere in a transport error's chain, if any.
fn tls_failure(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = current {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        // io::Error's source() skips its own payload; look inside it.
        current = match err.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

fn empty() -> RequestBody {
    Empty::new().map_err(|e| match e {}).boxed()
}

impl WorkerClient {
    /// `addr` is `HOST:PORT` or `http://HOST:PORT`.
    pub fn new(addr: &str, timeout: Duration) -> Result<Self, ClientError> {
        Self::with_deadlines(addr, Deadlines::uniform(timeout))
    }

    pub fn with_deadlines(addr: &str, deadlines: Deadlines) -> Result<Self, ClientError> {
        Self::connect(addr, deadlines, None)
    }

    /// With `tls`, the worker is spoken to over HTTPS and must present a
    /// certificate from that CA; `http://` addresses are then refused.
    pub fn connect(
        addr: &str,
        deadlines: Deadlines,
        tls: Option<&ClientTls>,
    ) -> Result<Self, ClientError> {
        let invalid = |why: &str| ClientError::InvalidAddress(format!("{addr} ({why})"));
        let host = addr.trim_end_matches('/');
        let (scheme, rest) = match host.split_once("://") {
            Some((scheme, rest)) => (Some(scheme), rest),
            None => (None, host),
        };
        let base = match (tls.is_some(), scheme) {
            (false, None | Some("http")) => format!("http://{rest}"),
            (true, None | Some("https")) => format!("https://{rest}"),
            (false, Some("https")) => return Err(invalid("an https worker needs --tls-ca")),
            (true, Some("http")) => return Err(invalid("plain http refused: TLS is configured")),
            _ => return Err(invalid("expected HOST:PORT")),
        };
        base.parse::<http::Uri>()
            .ok()
            .filter(|u| u.authority().is_some() && u.path() == "/" || u.path().is_empty())
            .ok_or_else(|| ClientError::InvalidAddress(addr.to_string()))?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.enforce_http(false);
        connector.set_connect_timeout(Some(deadlines.connect));
        // Without TLS settings the connector is never asked for https:
        // such addresses were refused above.
        let tls_config = match tls {
            Some(t) => (*t.config()).clone(),
            None => ClientTls::no_roots(),
        };
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls_config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(BufferedConnector(connector));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Ok(Self {
            base,
            client,
            deadlines,
            bearer: None,
            local: None,
        })
    }

    /// The same client, reading versioned ranges through `channel` (the
    /// worker's local socket) and over HTTP where it declines.
    pub fn with_local(mut self, channel: Option<Arc<LocalChannel>>) -> Self {
        self.local = channel;
        self
    }

    /// This worker's ring address (`host:port`), as the local socket's
    /// worker is matched against it.
    fn member(&self) -> &str {
        self.base
            .split_once("://")
            .map_or(self.base.as_str(), |(_, rest)| rest)
    }

    /// A local-socket call's outcome for a caller that falls back to
    /// HTTP on `None`: a refusal is the worker's answer, as over HTTP; a
    /// silent worker is a timeout; any other failure goes over HTTP.
    fn local_outcome<T>(
        &self,
        uri: &ObjectUri,
        what: &'static str,
        got: Result<Result<T, LocalError>, tokio::task::JoinError>,
    ) -> Option<Result<T, ClientError>> {
        match got {
            Ok(Ok(value)) => Some(Ok(value)),
            Ok(Err(LocalError::Refused { code, message })) => Some(Err(ClientError::Api {
                status: code.http_status(),
                code,
                message,
            })),
            Ok(Err(LocalError::Stalled(after))) => Some(Err(self.timed_out(after))),
            Ok(Err(LocalError::Unavailable(why))) => {
                tracing::trace!(%uri, %why, what, "over HTTP instead");
                None
            }
            Ok(Err(e)) => {
                // A damaged page file: HTTP reads it too, finds the damage
                // and fetches the page again.
                tracing::warn!(%uri, error = %e, what, "local socket failed; over HTTP instead");
                None
            }
            Err(e) => {
                tracing::warn!(%uri, error = %e, what, "local socket task failed; over HTTP instead");
                None
            }
        }
    }

    /// `range` at `etag` through the local socket. `None`: read over
    /// HTTP (no socket, the worker declined, or the socket failed).
    async fn read_local(
        &self,
        uri: &ObjectUri,
        range: &Range<u64>,
        etag: &str,
        kind: ReadKind,
    ) -> Option<Result<Bytes, ClientError>> {
        let local = self.local.as_ref()?;
        if range.is_empty() || !local.worth_asking(self.member()) {
            return None;
        }
        let (local, member) = (local.clone(), self.member().to_string());
        let (uri_c, range_c, etag_c) = (uri.clone(), range.clone(), etag.to_string());
        let got = tokio::task::spawn_blocking(move || {
            local.read(&member, &uri_c, &etag_c, range_c, kind)
        })
        .await;
        self.local_outcome(uri, "read", got)
    }

    /// A reader's read of `range` at `etag` through the local socket, on
    /// the calling thread, where the worker holds every byte now (see
    /// [`LocalChannel::read_cached`]). `None`: not served this way (no
    /// socket, bytes the worker would fetch first, any failure); read with
    /// [`Self::read_checked_as`], which settles every such case.
    pub fn read_cached_local_now(
        &self,
        uri: &ObjectUri,
        range: &Range<u64>,
        etag: &str,
    ) -> Option<Bytes> {
        let local = self.local.as_ref()?;
        if range.is_empty() || !local.worth_asking(self.member()) {
            return None;
        }
        match local.read_cached(self.member(), uri, etag, range.clone()) {
            Ok(bytes) if bytes.len() as u64 == range.end - range.start => Some(bytes),
            Ok(bytes) => {
                tracing::debug!(%uri, ?range, got = bytes.len(), "a cached-only read came back short; reading again");
                None
            }
            Err(e) => {
                tracing::trace!(%uri, ?range, error = %e, "not a cached-only read");
                None
            }
        }
    }

    /// Whether [`Self::commit_local`] may be worth trying (no I/O: a
    /// socket whose worker is not yet known counts).
    pub fn may_commit_locally(&self) -> bool {
        self.local
            .as_ref()
            .is_some_and(|l| l.worth_asking(self.member()))
    }

    /// This worker's local socket and member name, for a commit or a
    /// follow through it; `None` when there is none worth asking.
    fn local_for_writes(&self) -> Option<(Arc<LocalChannel>, String)> {
        let local = self.local.as_ref()?;
        if !local.worth_asking(self.member()) {
            return None;
        }
        Some((local.clone(), self.member().to_string()))
    }

    /// Commits `file` (its first `size` bytes) as the new content of
    /// `uri`, written back, through this worker's local socket: the
    /// worker reads the file itself, and the bytes never cross TCP.
    /// `None`: this worker has no local socket here (write over HTTP).
    /// A worker silent for `progress` answers [`ClientError::Timeout`].
    pub async fn commit_local(
        &self,
        uri: &ObjectUri,
        file: Arc<std::fs::File>,
        size: u64,
        meta: &crate::UserMeta,
        progress: Duration,
    ) -> Option<Result<ObjectStat, ClientError>> {
        let (local, member) = self.local_for_writes()?;
        let (uri_c, meta_c) = (uri.clone(), meta.clone());
        let got = tokio::task::spawn_blocking(move || {
            local.commit(&member, &uri_c, &file, size, &meta_c, progress)
        })
        .await;
        self.local_outcome(uri, "commit", got)
    }

    /// Starts handing `file` to this worker through its local socket
    /// while the application writes it (see [`LocalChannel::follow`]).
    /// `None`: not possible here (no socket, another worker, a socket
    /// that failed); the file is then committed whole at the end.
    pub async fn follow_local(
        &self,
        uri: &ObjectUri,
        file: Arc<std::fs::File>,
        meta: &crate::UserMeta,
        progress: Duration,
    ) -> Option<crate::local_read::Following> {
        let (local, member) = self.local_for_writes()?;
        let (uri_c, meta_c) = (uri.clone(), meta.clone());
        let got = tokio::task::spawn_blocking(move || {
            local.follow(&member, &uri_c, &file, &meta_c, progress)
        })
        .await;
        match got {
            Ok(Ok(following)) => Some(following),
            Ok(Err(e)) => {
                tracing::debug!(%uri, error = %e, "not followed; committed whole at the end");
                None
            }
            Err(e) => {
                tracing::warn!(%uri, error = %e, "the follow task failed; committed whole at the end");
                None
            }
        }
    }

    /// Seals a followed file at `size` bytes: the commit's answer, as
    /// [`Self::commit_local`] gives it.
    pub async fn seal_local(
        &self,
        uri: &ObjectUri,
        following: crate::local_read::Following,
        size: u64,
        meta: &crate::UserMeta,
    ) -> Option<Result<ObjectStat, ClientError>> {
        let meta_c = meta.clone();
        let got = tokio::task::spawn_blocking(move || following.seal(size, &meta_c)).await;
        self.local_outcome(uri, "sealed commit", got)
    }

    /// The same client, sending `token` as `Authorization: Bearer` on
    /// every request.
    pub fn with_token(mut self, token: Option<&str>) -> Result<Self, ClientError> {
        self.bearer = match token {
            None => None,
            Some(t) => {
                let mut value = http::HeaderValue::try_from(format!("Bearer {}", t.trim()))
                    .map_err(|_| ClientError::Decode("the token has invalid characters".into()))?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(self)
    }

    /// The same pooled client with another whole-request timeout (uploads
    /// of large bodies need longer than reads).
    pub fn with_timeout(&self, timeout: Duration) -> Self {
        let mut deadlines = self.deadlines;
        deadlines.request = timeout;
        Self {
            deadlines,
            ..self.clone()
        }
    }

    pub fn deadlines(&self) -> Deadlines {
        self.deadlines
    }

    fn timed_out(&self, timeout: Duration) -> ClientError {
        ClientError::Timeout {
            addr: self.base.clone(),
            timeout,
        }
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn transport(&self, e: impl std::error::Error + Send + Sync + 'static) -> ClientError {
        if let Some(message) = tls_failure(&e) {
            return ClientError::Tls {
                addr: self.base.clone(),
                message,
            };
        }
        ClientError::Transport {
            addr: self.base.clone(),
            source: Box::new(e),
        }
    }

    /// Sends a request that carries a body and returns the response head
    /// with its streaming body; non-2xx answers become [`ClientError::Api`].
    pub async fn send(
        &self,
        req: http::Request<RequestBody>,
    ) -> Result<http::Response<Incoming>, ClientError> {
        self.send_within(req, self.deadlines.request).await
    }

    /// Like [`Self::send`] for requests without a body: the head must come
    /// within the progress deadline.
    async fn send_quick(
        &self,
        req: http::Request<RequestBody>,
    ) -> Result<http::Response<Incoming>, ClientError> {
        self.send_within(req, self.deadlines.progress).await
    }

    async fn send_within(
        &self,
        req: http::Request<RequestBody>,
        head_within: Duration,
    ) -> Result<http::Response<Incoming>, ClientError> {
        let fut = self.client.request(req);
        let resp = tokio::time::timeout(head_within, fut)
            .await
            .map_err(|_| self.timed_out(head_within))?
            .map_err(|e| self.transport(e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body = self.collect(resp.into_body()).await.unwrap_or_default();
        let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(b) => (b.error.code, b.error.message),
            Err(_) => (
                ErrorCode::Unknown,
                String::from_utf8_lossy(&body).chars().take(200).collect(),
            ),
        };
        Err(ClientError::Api {
            status,
            code,
            message,
        })
    }

    /// The whole body; every piece must come within the progress deadline
    /// of the one before it.
    async fn collect(&self, body: Incoming) -> Result<Bytes, ClientError> {
        self.collect_within(body, self.deadlines.progress).await
    }

    /// A watched write's answer: keepalive bytes, then the outcome. A gap
    /// longer than `progress` is a hang only if the worker does not answer
    /// a probe either.
    async fn collect_watched(
        &self,
        mut body: Incoming,
        progress: Duration,
    ) -> Result<Bytes, ClientError> {
        let mut out = Vec::new();
        loop {
            let frame = match tokio::time::timeout(progress, body.frame()).await {
                Ok(frame) => frame,
                Err(_) if self.answers_within(progress).await => continue,
                Err(_) => return Err(self.timed_out(progress)),
            };
            match frame {
                None => return Ok(Bytes::from(out)),
                Some(Err(e)) => return Err(self.transport(e)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if out.len() + data.len() > MAX_WRITE_ANSWER {
                            return Err(ClientError::Decode(format!(
                                "a write's answer over {MAX_WRITE_ANSWER} bytes"
                            )));
                        }
                        out.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// A body whose pieces come at most `progress` apart.
    async fn collect_within(
        &self,
        body: Incoming,
        progress: Duration,
    ) -> Result<Bytes, ClientError> {
        let hint = body.size_hint();
        let capacity = hint.exact().unwrap_or(hint.lower());
        self.collect_with_trailers(body, progress, capacity)
            .await
            .map(|(bytes, _)| bytes)
    }

    /// A body and its trailers; `capacity` is the expected length.
    async fn collect_with_trailers(
        &self,
        mut body: Incoming,
        progress: Duration,
        capacity: u64,
    ) -> Result<(Bytes, Option<http::HeaderMap>), ClientError> {
        // Sized once from the expected length: growing by doubling would
        // copy multi-MiB ranges several times into freshly mapped pages.
        let capacity = capacity.min(MAX_PRESIZE) as usize;
        // A body of one frame is handed over as it is; the buffer is
        // taken only once a second frame comes.
        let mut first: Option<Bytes> = None;
        let mut out: Option<crate::buffer_pool::PoolBuf> = None;
        let mut trailers = None;
        loop {
            let frame = tokio::time::timeout(progress, body.frame())
                .await
                .map_err(|_| self.timed_out(progress))?;
            match frame {
                None => break,
                Some(Err(e)) => return Err(self.transport(e)),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if out.is_none() && first.is_none() => first = Some(data),
                    Ok(data) => out
                        .get_or_insert_with(|| {
                            let mut buf = crate::buffer_pool::take(capacity);
                            if let Some(f) = first.take() {
                                buf.extend_from_slice(&f);
                            }
                            buf
                        })
                        .extend_from_slice(&data),
                    Err(frame) => trailers = frame.into_trailers().ok(),
                },
            }
        }
        let bytes = match out {
            Some(buf) => crate::buffer_pool::freeze(buf),
            None => first.unwrap_or_default(),
        };
        Ok((bytes, trailers))
    }

    fn request(&self, method: http::Method, path: &str) -> http::request::Builder {
        let mut builder = http::Request::builder()
            .method(method)
            .uri(format!("{}{}", self.base, path));
        if let Some(parent) = crate::trace_context::current() {
            builder = builder.header("traceparent", parent);
        }
        match &self.bearer {
            Some(value) => builder.header(http::header::AUTHORIZATION, value.clone()),
            None => builder,
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let req = self
            .request(http::Method::GET, path)
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        let body = self.collect(resp.into_body()).await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    pub async fn health(&self) -> Result<Health, ClientError> {
        self.get_json("/v1/health").await
    }

    /// Whether the worker's server answers at all within `within`, on a
    /// connection of its own: any HTTP answer counts (a refusal too), so
    /// a busy worker reads as alive and a stopped one does not.
    pub async fn answers_within(&self, within: Duration) -> bool {
        let Ok(req) = self.request(http::Method::GET, "/v1/health").body(empty()) else {
            return false;
        };
        match tokio::time::timeout(within, self.client.request(req)).await {
            Ok(Ok(_)) => true,
            Ok(Err(_)) | Err(_) => false,
        }
    }

    pub async fn stat(&self, uri: &ObjectUri) -> Result<ObjectStat, ClientError> {
        self.get_json(&uri.api_path("stat")).await
    }

    /// The object's current version (its S3 VersionId when versioned).
    pub async fn current_version(&self, uri: &ObjectUri) -> Result<ObjectVersion, ClientError> {
        self.get_json(&uri.api_path("version")).await
    }

    /// Exactly `range` of version `version_id`, which must carry `etag`;
    /// read through from S3 by the worker.
    pub async fn read_version(
        &self,
        uri: &ObjectUri,
        range: Range<u64>,
        version_id: &str,
        etag: &str,
    ) -> Result<Bytes, ClientError> {
        let enc = |v: &str| {
            percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        let path = format!(
            "{}?version_id={}&etag={}&start={}&end={}",
            uri.api_path("version"),
            enc(version_id),
            enc(etag),
            range.start,
            range.end
        );
        let req = self
            .request(http::Method::GET, &path)
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        let body = self.collect(resp.into_body()).await?;
        let want = range.end - range.start;
        if body.len() as u64 != want {
            return Err(ClientError::Decode(format!(
                "version read returned {} bytes, expected {want}",
                body.len()
            )));
        }
        Ok(body)
    }

    pub async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, ClientError> {
        self.list_inner(bucket, prefix, delimiter, token, max_keys, false)
            .await
    }

    /// [`Self::list`] with every object's user metadata: the worker adds
    /// what it knows and asks S3 (HEAD, in parallel) for the rest.
    pub async fn list_with_meta(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
    ) -> Result<ListResponse, ClientError> {
        self.list_inner(bucket, prefix, delimiter, token, max_keys, true)
            .await
    }

    async fn list_inner(
        &self,
        bucket: &str,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        max_keys: Option<u32>,
        with_meta: bool,
    ) -> Result<ListResponse, ClientError> {
        let mut query = form_urlencoded(&[("prefix", prefix)]);
        if let Some(d) = delimiter {
            query.push_str(&format!("&{}", form_urlencoded(&[("delimiter", d)])));
        }
        if let Some(t) = token {
            query.push_str(&format!(
                "&{}",
                form_urlencoded(&[("continuation-token", t)])
            ));
        }
        if let Some(m) = max_keys {
            query.push_str(&format!("&max-keys={m}"));
        }
        if with_meta {
            query.push_str("&metadata=true");
        }
        self.get_json(&format!("/v1/list/{bucket}?{query}")).await
    }

    /// Starts a read; the caller streams the body. `range` is half-open.
    pub async fn read_stream(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
    ) -> Result<http::Response<Incoming>, ClientError> {
        self.read_stream_if(uri, range, None).await
    }

    /// Like [`Self::read_stream`]; with `etag`, the worker answers 412
    /// unless the object still has that ETag.
    pub async fn read_stream_if(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
        etag: Option<&str>,
    ) -> Result<http::Response<Incoming>, ClientError> {
        self.get_object(uri, range, etag, false, ReadKind::Demand)
            .await
    }

    /// A GET of the object; with `crc_trailer`, the worker sends the
    /// body's CRC32C as a trailer ([`crate::LENGTH_HEADER`] then carries
    /// the length).
    async fn get_object(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
        etag: Option<&str>,
        crc_trailer: bool,
        kind: ReadKind,
    ) -> Result<http::Response<Incoming>, ClientError> {
        let mut builder = self.request(http::Method::GET, &uri.api_path("objects"));
        if crc_trailer {
            builder = builder.header(http::header::TE, "trailers");
        }
        if kind == ReadKind::Ahead {
            builder = builder.header(READ_AHEAD_HEADER, "1");
        }
        if let Some(tag) = etag {
            builder = builder.header(http::header::IF_MATCH, format!("\"{tag}\""));
        }
        if let Some(r) = &range {
            if r.is_empty() {
                return Err(ClientError::Decode("empty range".into()));
            }
            builder = builder.header(
                http::header::RANGE,
                format!("bytes={}-{}", r.start, r.end - 1),
            );
        }
        let req = builder
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        self.send_quick(req).await
    }

    /// Reads a whole range into memory, checking it arrived complete.
    pub async fn read(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
    ) -> Result<Bytes, ClientError> {
        self.read_checked(uri, range, None)
            .await
            .map(|(bytes, _)| bytes)
    }

    /// Reads a range (of version `etag`, if given) and returns the bytes
    /// with the ETag the worker served them under.
    pub async fn read_checked(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
        etag: Option<&str>,
    ) -> Result<(Bytes, Option<String>), ClientError> {
        self.read_checked_as(uri, range, etag, ReadKind::Demand)
            .await
    }

    /// [`Self::read_checked`], saying whether the reader asked for these
    /// bytes or reads ahead of what it was asked.
    pub async fn read_checked_as(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
        etag: Option<&str>,
        kind: ReadKind,
    ) -> Result<(Bytes, Option<String>), ClientError> {
        if let (Some(r), Some(e)) = (&range, etag) {
            if let Some(local) = self.read_local(uri, r, e, kind).await {
                return local.map(|bytes| (bytes, Some(e.to_string())));
            }
        }
        // Damage on the way is read again once from this worker; a second
        // damaged answer goes back to the caller, which asks a replica.
        match self.read_over_http(uri, range.clone(), etag, kind).await {
            Err(ClientError::Damaged { sent, arrived, .. }) => {
                tracing::warn!(worker = %self.base, %uri, ?range, sent, arrived, "a read arrived damaged (CRC32C mismatch); reading it again");
                self.read_over_http(uri, range, etag, kind).await
            }
            other => other,
        }
    }

    /// One GET, its bytes checked against the worker's CRC32C trailer
    /// where the worker sends one.
    async fn read_over_http(
        &self,
        uri: &ObjectUri,
        range: Option<Range<u64>>,
        etag: Option<&str>,
        kind: ReadKind,
    ) -> Result<(Bytes, Option<String>), ClientError> {
        let resp = self.get_object(uri, range, etag, true, kind).await?;
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let served_etag =
            header(http::header::ETAG.as_str()).map(|v| v.trim_matches('"').to_string());
        let expected = header(http::header::CONTENT_LENGTH.as_str())
            .or_else(|| header(crate::LENGTH_HEADER))
            .and_then(|v| v.parse::<u64>().ok());
        let crc_declared = crate::header_lists(
            resp.headers(),
            http::header::TRAILER,
            crate::BODY_CRC32C_TRAILER,
        );
        let progress = self.deadlines.progress;
        let (body, trailers) = self
            .collect_with_trailers(resp.into_body(), progress, expected.unwrap_or(0))
            .await
            .map_err(|e| match e {
                ClientError::Transport { .. } => ClientError::ShortBody {
                    expected: expected.unwrap_or(0),
                    got: 0,
                },
                other => other,
            })?;
        if let Some(expected) = expected {
            if body.len() as u64 != expected {
                return Err(ClientError::ShortBody {
                    expected,
                    got: body.len() as u64,
                });
            }
        }
        if crc_declared {
            let sent = trailers
                .as_ref()
                .and_then(|t| t.get(crate::BODY_CRC32C_TRAILER))
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u32>().ok())
                .ok_or_else(|| {
                    ClientError::Decode(format!(
                        "the worker declared a {} trailer and sent none (or not a number)",
                        crate::BODY_CRC32C_TRAILER
                    ))
                })?;
            let arrived = crc32c::crc32c(&body);
            if arrived != sent {
                return Err(ClientError::Damaged {
                    addr: self.base.clone(),
                    sent,
                    arrived,
                });
            }
        }
        Ok((body, served_etag))
    }

    /// Uploads `body` as the object's new content; returns once it is in S3.
    pub async fn put(
        &self,
        uri: &ObjectUri,
        body: RequestBody,
        meta: &crate::UserMeta,
    ) -> Result<ObjectStat, ClientError> {
        let req = crate::with_user_meta(
            self.request(http::Method::PUT, &uri.api_path("objects")),
            meta,
        )
        .body(body)
        .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send(req).await?;
        let body = self.collect(resp.into_body()).await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Writes `body` back: returns once the object is durable in the
    /// worker's cache (S3 gets it later). The body's CRC32C follows it as
    /// a trailer; the worker refuses the write if its bytes differ.
    pub async fn put_back<S>(
        &self,
        uri: &ObjectUri,
        body: S,
        meta: &crate::UserMeta,
    ) -> Result<ObjectStat, ClientError>
    where
        S: futures::Stream<Item = Bytes> + Send + Sync + 'static,
    {
        use futures::StreamExt as _;
        self.put_back_with(uri, body.map(Ok), &[], meta).await
    }

    /// A worker's copy of a write-back body to a replica: same version,
    /// and the primary's journal identity and address. An error item
    /// aborts the body, so the replica records nothing.
    pub async fn put_replica<S>(
        &self,
        uri: &ObjectUri,
        version: &str,
        replica_of: &str,
        body: S,
        meta: &crate::UserMeta,
        watch: Option<Duration>,
    ) -> Result<ObjectStat, ClientError>
    where
        S: futures::Stream<Item = Result<Bytes, BoxError>> + Send + Sync + 'static,
    {
        let headers = [
            (crate::VERSION_HEADER, version),
            (crate::REPLICA_OF_HEADER, replica_of),
            (crate::CONFIRM_HEADER, "1"),
        ];
        self.put_checked(uri, body, crate::WriteMode::Back, &headers, meta, watch)
            .await
    }

    /// A copy of a delete the sending worker (the primary) journaled
    /// behind a pending write whose copy this worker holds.
    pub async fn put_replica_delete(
        &self,
        uri: &ObjectUri,
        version: &str,
        replica_of: &str,
    ) -> Result<(), ClientError> {
        let path = format!(
            "{}?{}",
            uri.api_path("replica"),
            form_urlencoded(&[("version", version)])
        );
        let req = self
            .request(http::Method::POST, &path)
            .header(crate::REPLICA_OF_HEADER, replica_of)
            .header(crate::CONFIRM_HEADER, "1")
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        self.collect(resp.into_body()).await.map(|_| ())
    }

    /// What this worker (a primary) knows of `version` of `uri`.
    pub async fn pending_entry(
        &self,
        uri: &ObjectUri,
        version: &str,
    ) -> Result<crate::WriteBackEntry, ClientError> {
        let path = format!(
            "{}?{}",
            uri.api_path("pending"),
            form_urlencoded(&[("version", version)])
        );
        self.get_json(&path).await
    }

    /// Tells this worker (a replica) that the primary's journal now holds
    /// `version` of `uri`: the copy is of an acknowledged write. Fails
    /// where this worker holds no such copy.
    pub async fn confirm_replica(&self, uri: &ObjectUri, version: &str) -> Result<(), ClientError> {
        let path = format!(
            "{}?{}",
            uri.api_path("confirm"),
            form_urlencoded(&[("version", version)])
        );
        let req = self
            .request(http::Method::POST, &path)
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        self.collect(resp.into_body()).await.map(|_| ())
    }

    /// Tells this worker (a replica) that `version` of `uri` is settled:
    /// it may drop its copy.
    pub async fn drop_replica(&self, uri: &ObjectUri, version: &str) -> Result<(), ClientError> {
        let path = format!(
            "{}?{}",
            uri.api_path("replica"),
            form_urlencoded(&[("version", version)])
        );
        let req = self
            .request(http::Method::DELETE, &path)
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        self.collect(resp.into_body()).await.map(|_| ())
    }

    async fn put_back_with<S>(
        &self,
        uri: &ObjectUri,
        body: S,
        headers: &[(&str, &str)],
        meta: &crate::UserMeta,
    ) -> Result<ObjectStat, ClientError>
    where
        S: futures::Stream<Item = Result<Bytes, BoxError>> + Send + Sync + 'static,
    {
        self.put_checked(uri, body, crate::WriteMode::Back, headers, meta, None)
            .await
    }

    /// Streams `body` as the object's new content, its CRC32C following
    /// as a trailer (the worker refuses the write if its bytes differ or
    /// the trailer is missing). With `watch`, the worker keeps answering
    /// while it stores the object (see [`crate::KEEPALIVE_HEADER`]), and a
    /// worker silent for that long once the body is sent, or between two
    /// bytes of its answer, fails the call with [`ClientError::Timeout`]:
    /// the call is bounded by progress, not by a total. The caller bounds
    /// the body's own progress (it knows when it has bytes waiting).
    pub async fn put_checked<S>(
        &self,
        uri: &ObjectUri,
        body: S,
        mode: crate::WriteMode,
        headers: &[(&str, &str)],
        meta: &crate::UserMeta,
        watch: Option<Duration>,
    ) -> Result<ObjectStat, ClientError>
    where
        S: futures::Stream<Item = Result<Bytes, BoxError>> + Send + Sync + 'static,
    {
        use futures::StreamExt as _;
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::Arc;
        let crc = Arc::new(AtomicU32::new(0));
        let running = crc.clone();
        let data = body.map(move |b| {
            let b = b?;
            let now = crc32c::crc32c_append(running.load(Ordering::Relaxed), &b);
            running.store(now, Ordering::Relaxed);
            Ok::<_, BoxError>(hyper::body::Frame::data(b))
        });
        // Fires once the whole body, trailer included, is handed to the
        // connection: from then on the worker owes an answer.
        let (sent_tx, sent_rx) = tokio::sync::oneshot::channel::<()>();
        let trailer = futures::stream::once(async move {
            let mut trailers = http::HeaderMap::new();
            let value = crc.load(Ordering::Relaxed).to_string();
            if let Ok(v) = http::HeaderValue::from_str(&value) {
                trailers.insert(crate::BODY_CRC32C_TRAILER, v);
            }
            let _ = sent_tx.send(());
            Ok::<_, BoxError>(hyper::body::Frame::trailers(trailers))
        });
        let body: RequestBody =
            BodyExt::boxed(http_body_util::StreamBody::new(data.chain(trailer)));
        let mut req = crate::with_user_meta(
            self.request(http::Method::PUT, &uri.api_path("objects")),
            meta,
        )
        .header(http::header::TRAILER, crate::BODY_CRC32C_TRAILER);
        if mode == crate::WriteMode::Back {
            req = req.header(crate::WRITE_MODE_HEADER, "back");
        }
        if let Some(progress) = watch {
            let sent_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            req = req
                .header(crate::KEEPALIVE_HEADER, progress.as_millis().to_string())
                .header(crate::SENT_AT_HEADER, sent_ms.to_string());
        }
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req
            .body(body)
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let Some(progress) = watch else {
            let resp = self.send(req).await?;
            let body = self.collect(resp.into_body()).await?;
            return serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()));
        };
        let probe = self.clone();
        let silent_after_body = async move {
            if sent_rx.await.is_err() {
                // The body was dropped unsent: the request fails by itself.
                std::future::pending::<()>().await;
            }
            // Silence alone is not a hang: a worker still reading the
            // last bytes from its socket (its disk or S3 busy) answers a
            // probe on a connection of its own; a stopped one does not.
            loop {
                tokio::time::sleep(progress).await;
                if !probe.answers_within(progress).await {
                    return;
                }
            }
        };
        let resp = tokio::select! {
            resp = self.send(req) => resp?,
            () = silent_after_body => return Err(self.timed_out(progress)),
        };
        let body = self.collect_watched(resp.into_body(), progress).await?;
        let text = body.trim_ascii_start();
        match serde_json::from_slice::<crate::WriteOutcome>(text) {
            Ok(crate::WriteOutcome::Stored(stat)) => Ok(stat),
            Ok(crate::WriteOutcome::Failed(e)) => Err(ClientError::Api {
                status: e.error.code.http_status(),
                code: e.error.code,
                message: e.error.message,
            }),
            Err(e) => Err(ClientError::Decode(format!("write outcome: {e}"))),
        }
    }

    /// One worker's write-back backlog (under `prefix`, an
    /// `s3://bucket/prefix` URI, when given).
    pub async fn writeback_status(
        &self,
        prefix: Option<&str>,
    ) -> Result<crate::WriteBackStatus, ClientError> {
        let path = match prefix {
            Some(p) => format!("/v1/writeback?{}", form_urlencoded(&[("prefix", p)])),
            None => "/v1/writeback".to_string(),
        };
        self.get_json(&path).await
    }

    /// [`Self::writeback_status`] under `prefix`, with the writes of the
    /// one object `uri` this worker uploads or last uploaded (a peer's
    /// question before it uploads its own version of `uri`).
    pub async fn writeback_status_of(
        &self,
        prefix: &str,
        uri: &str,
    ) -> Result<crate::WriteBackStatus, ClientError> {
        let path = format!(
            "/v1/writeback?{}",
            form_urlencoded(&[("prefix", prefix), ("uri", uri)])
        );
        self.get_json(&path).await
    }

    pub async fn put_bytes(&self, uri: &ObjectUri, data: Bytes) -> Result<ObjectStat, ClientError> {
        self.put_bytes_with(uri, data, &crate::UserMeta::new())
            .await
    }

    /// [`Self::put_bytes`] with the object's user metadata.
    pub async fn put_bytes_with(
        &self,
        uri: &ObjectUri,
        data: Bytes,
        meta: &crate::UserMeta,
    ) -> Result<ObjectStat, ClientError> {
        let body = Full::new(data).map_err(|e| match e {}).boxed();
        self.put(uri, body, meta).await
    }

    /// Server-side copy of `from` (only if its ETag is `etag`, when given)
    /// to `to`; returns once the copy is in S3. With `meta`, the copy
    /// gets that user metadata instead of the source's (a copy onto
    /// itself with new metadata is how an object's metadata changes).
    pub async fn copy(
        &self,
        from: &ObjectUri,
        etag: Option<&str>,
        to: &ObjectUri,
        meta: Option<&crate::UserMeta>,
    ) -> Result<ObjectStat, ClientError> {
        let mut req = self
            .request(http::Method::PUT, &to.api_path("objects"))
            .header(COPY_SOURCE_HEADER, from.api_path("objects"));
        if let Some(meta) = meta {
            req = crate::with_user_meta(req, meta)
                .header(crate::METADATA_DIRECTIVE_HEADER, "replace");
        }
        if let Some(etag) = etag {
            req = req.header(http::header::IF_MATCH, format!("\"{etag}\""));
        }
        let req = req
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send(req).await?;
        let body = self.collect(resp.into_body()).await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Hands `len` bytes of one object version, starting at `offset`, to
    /// this worker's cache (worker to worker, after a write): the worker
    /// keeps them as pages without asking S3 for them.
    pub async fn put_pages(
        &self,
        uri: &ObjectUri,
        etag: &str,
        offset: u64,
        len: u64,
        from: &str,
        body: RequestBody,
    ) -> Result<(), ClientError> {
        let req = self
            .request(http::Method::PUT, &uri.api_path("pages"))
            .header(http::header::IF_MATCH, format!("\"{etag}\""))
            .header(OFFSET_HEADER, offset.to_string())
            .header(FROM_HEADER, from)
            .header(http::header::CONTENT_LENGTH, len)
            .body(body)
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send(req).await?;
        self.collect(resp.into_body()).await.map(|_| ())
    }

    pub async fn delete(&self, uri: &ObjectUri) -> Result<(), ClientError> {
        let req = self
            .request(http::Method::DELETE, &uri.api_path("objects"))
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        self.send(req).await.map(|_| ())
    }

    /// The worker's Prometheus text.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        let req = self
            .request(http::Method::GET, "/metrics")
            .body(empty())
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let resp = self.send_quick(req).await?;
        let body = self.collect(resp.into_body()).await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

fn form_urlencoded(pairs: &[(&str, &str)]) -> String {
    use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={}", utf8_percent_encode(v, NON_ALPHANUMERIC)))
        .collect::<Vec<_>>()
        .join("&")
}
