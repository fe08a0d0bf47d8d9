//! The mount's end of the tier socket (`lakecache_protocol::tier_socket`):
//! other processes on the node (the Python client) read through the
//! mount's node-local tier instead of fetching what the mount already
//! holds, and what they fetch lands in the tier for the mount's readers.
//! Reachable only by the mount's own user or root (mode 0600 and a peer
//! check): such a process could read the mount's token anyway.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use lakecache_protocol::local_read::{frame, sendmsg_with_fd};
use lakecache_protocol::tier_socket::{
    TierAnswer, TierErrorKind, TierRequest, MAX_TIER_INLINE, MAX_TIER_MESSAGE, TIER_PROTOCOL,
    TIER_SOCKET_NAME,
};
use lakecache_protocol::ObjectUri;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tracing::Instrument;

use crate::data_plane::DataError;
use crate::error::FsError;
use crate::read::FileReader;
use crate::Fs;

/// Readers kept per connection (a loader thread reads a few files at once).
const READERS_PER_CONNECTION: usize = 8;
/// Inline answers are read from the tier or the workers in pieces of this
/// size, as FUSE reads are.
const PIECE: u64 = 1 << 20;

/// The socket while the mount serves it; dropping it stops the listener
/// and removes the socket file.
pub struct TierClients {
    task: tokio::task::JoinHandle<()>,
    /// Prefetch by the plans published here.
    plans: Option<tokio::task::JoinHandle<()>>,
    path: PathBuf,
}

impl Drop for TierClients {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(plans) = &self.plans {
            plans.abort();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl TierClients {
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

/// Serves the tier socket of `fs`'s node-local tier (or, without one, in
/// `FsConfig::client_socket_dir`) on the current runtime; `None` with
/// neither, or (with a warning) when the socket cannot be made.
pub fn serve(fs: Arc<Fs>) -> Option<TierClients> {
    let dir = match fs.local_tier() {
        Some(tier) => tier.dir().to_path_buf(),
        None => fs.config().client_socket_dir.clone()?,
    };
    let path = dir.join(TIER_SOCKET_NAME);
    if path.as_os_str().len() > 107 {
        tracing::warn!(path = %path.display(), "the tier socket's path is too long for a Unix socket; other readers on this node cannot share the local tier");
        return None;
    }
    let listener = match lakecache_protocol::unix_server::bind_private(&path) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "the tier socket could not be made; other readers on this node cannot share the local tier");
            return None;
        }
    };
    match fs.local_tier() {
        Some(_) => {
            tracing::info!(path = %path.display(), "tier socket: other readers on this node share the local tier")
        }
        None => {
            tracing::info!(path = %path.display(), plan_memory = fs.config().plan_memory, "client socket: other processes on this node send plans here, and the mount holds their next samples in memory")
        }
    }
    let plans = fs.tier_plans().map(|p| tokio::spawn(p.clone().run()));
    let task = tokio::spawn(accept(listener, fs));
    Some(TierClients { task, plans, path })
}

async fn accept(listener: UnixListener, fs: Arc<Fs>) {
    // Connections live in the set, so stopping the listener (the mount
    // ending) ends them too.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "tier socket accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Err(why) = lakecache_protocol::unix_server::same_user(&stream, "mount") {
            tracing::warn!(%why, "tier socket: refused a connection");
            continue;
        }
        let fs = fs.clone();
        connections.spawn(async move {
            let mut readers = VecDeque::new();
            if let Err(e) = connection(stream, &fs, &mut readers).await {
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    tracing::debug!(error = %e, "tier socket connection ended");
                }
            }
        });
    }
}

async fn read_request(stream: &mut UnixStream) -> io::Result<Vec<u8>> {
    // A descriptor sent to us is not our protocol: it closes here.
    let (body, _fd) =
        lakecache_protocol::unix_server::read_request(stream, MAX_TIER_MESSAGE).await?;
    Ok(body)
}

async fn send(
    stream: &mut UnixStream,
    answer: &TierAnswer,
    fd: Option<&OwnedFd>,
) -> io::Result<()> {
    let reply = frame(&serde_json::to_vec(answer).map_err(io::Error::other)?)?;
    let raw = stream.as_raw_fd();
    let fd = fd.map(AsRawFd::as_raw_fd);
    let sent = stream
        .async_io(Interest::WRITABLE, || sendmsg_with_fd(raw, &reply, fd))
        .await?;
    stream.write_all(&reply[sent..]).await
}

async fn connection(
    mut stream: UnixStream,
    fs: &Fs,
    readers: &mut VecDeque<FileReader>,
) -> io::Result<()> {
    loop {
        let body = read_request(&mut stream).await?;
        match serde_json::from_slice::<TierRequest>(&body) {
            Ok(TierRequest::Hello) => {
                let (bucket, prefix) = fs.bucket_and_prefix();
                let hello = TierAnswer::Hello {
                    protocol: TIER_PROTOCOL,
                    bucket: bucket.to_string(),
                    prefix: prefix.to_string(),
                };
                send(&mut stream, &hello, None).await?;
            }
            Ok(TierRequest::Read {
                uri,
                etag,
                offset,
                len,
            }) => {
                let span = tracing::debug_span!("tier_socket_read", %uri, offset, len);
                read(&mut stream, fs, readers, &uri, &etag, offset, len)
                    .instrument(span)
                    .await?;
            }
            Ok(TierRequest::Plan {
                name,
                ttl_s,
                objects,
                order,
            }) => {
                let answer = plan(fs, &name, ttl_s, objects, order);
                send(&mut stream, &answer, None).await?;
            }
            Ok(TierRequest::Note { uri, offset }) => {
                if let Some(plans) = fs.tier_plans() {
                    plans.note(&uri, Some(offset));
                }
                send(&mut stream, &TierAnswer::Noted, None).await?;
            }
            Err(e) => {
                let refusal = error(
                    TierErrorKind::BadRequest,
                    format!("not a tier socket request: {e}"),
                );
                send(&mut stream, &refusal, None).await?;
            }
        }
    }
}

fn plan(
    fs: &Fs,
    name: &str,
    ttl_s: u64,
    objects: Vec<String>,
    order: Vec<(u32, u64, u64)>,
) -> TierAnswer {
    let Some(plans) = fs.tier_plans() else {
        return unavailable(
            "this mount does not prefetch by plan (--local-cache-plan-prefetch 0 with a tier, --plan-memory 0 without)",
        );
    };
    if let Err(why) = lakecache_protocol::validate_plan_name(name) {
        return error(TierErrorKind::BadRequest, why);
    }
    match plans.install(name, ttl_s, objects, order, |u| fs.serves(u)) {
        Ok(entries) => {
            tracing::debug!(plan = name, entries, "tier plan taken");
            TierAnswer::PlanTaken { entries }
        }
        Err(e) => error(TierErrorKind::BadRequest, format!("plan {name}: {e}")),
    }
}

fn error(kind: TierErrorKind, message: String) -> TierAnswer {
    TierAnswer::Error { kind, message }
}

fn unavailable(reason: impl Into<String>) -> TierAnswer {
    TierAnswer::Unavailable {
        reason: reason.into(),
    }
}

/// Serves one read: the tier's whole file, or the bytes inline.
async fn read(
    stream: &mut UnixStream,
    fs: &Fs,
    readers: &mut VecDeque<FileReader>,
    uri_text: &str,
    etag: &str,
    offset: u64,
    len: u64,
) -> io::Result<()> {
    let uri = match uri_text.parse::<ObjectUri>() {
        Ok(u) => u,
        Err(e) => {
            let refusal = error(TierErrorKind::BadRequest, format!("{uri_text:?}: {e}"));
            return send(stream, &refusal, None).await;
        }
    };
    if len == 0 || len > MAX_TIER_INLINE {
        let refusal = error(
            TierErrorKind::BadRequest,
            format!("a read of {len} bytes; ask for 1 to {MAX_TIER_INLINE}"),
        );
        return send(stream, &refusal, None).await;
    }
    if let (Some(plans), true) = (fs.tier_plans().filter(|p| p.any()), fs.serves(&uri)) {
        plans.note(&uri.to_string(), Some(offset));
    }
    if !fs.serves(&uri) {
        let (bucket, prefix) = fs.bucket_and_prefix();
        let why = format!("{uri} is outside this mount (s3://{bucket}/{prefix})");
        return send(stream, &unavailable(why), None).await;
    }
    if let Some((file, size)) = whole_file(fs, &uri, etag).await {
        if offset.saturating_add(len) > size {
            return send(stream, &out_of_range(offset, len, size), None).await;
        }
        crate::metrics::global().tier_socket("file", len);
        return send(stream, &TierAnswer::File { size }, Some(&file)).await;
    }
    let at = readers
        .iter()
        .position(|r| r.uri() == &uri && r.etag() == etag);
    let mut reader = match at.and_then(|i| readers.remove(i)) {
        Some(r) => r,
        None => match fs.client_reader(uri.clone(), etag).await {
            Ok(r) => r,
            Err(e) => return send(stream, &answer_for(&e), None).await,
        },
    };
    let size = reader.size();
    if offset.saturating_add(len) > size {
        return send(stream, &out_of_range(offset, len, size), None).await;
    }
    // The first piece before the answer: a failure is still answered.
    let first = match piece(&mut reader, offset, len.min(PIECE)).await {
        Ok(b) => b,
        Err(e) => return send(stream, &answer_for(&e), None).await,
    };
    send(stream, &TierAnswer::Inline { len }, None).await?;
    stream.write_all(&first).await?;
    let mut sent = first.len() as u64;
    while sent < len {
        let next = piece(&mut reader, offset + sent, (len - sent).min(PIECE))
            .await
            .map_err(|e| io::Error::other(format!("read failed part way: {e}")))?;
        stream.write_all(&next).await?;
        sent += next.len() as u64;
    }
    crate::metrics::global().tier_socket("inline", len);
    if readers.len() >= READERS_PER_CONNECTION {
        readers.pop_front();
    }
    readers.push_back(reader);
    Ok(())
}

/// Exactly `len` bytes at `offset` (the range is inside the object).
async fn piece(reader: &mut FileReader, offset: u64, len: u64) -> Result<bytes::Bytes, FsError> {
    let bytes = reader.read(offset, len).await?;
    if bytes.len() as u64 != len {
        return Err(FsError::DataPlane(DataError::ShortBody {
            expected: len,
            got: bytes.len() as u64,
        }));
    }
    Ok(bytes)
}

/// A read-only descriptor of the tier's copy of this version, when it is
/// whole and checked (as a passthrough open requires).
async fn whole_file(fs: &Fs, uri: &ObjectUri, etag: &str) -> Option<(OwnedFd, u64)> {
    let object = fs.local_tier()?.get(&uri.to_string(), etag)?;
    if !object.is_complete() {
        return None;
    }
    tokio::task::spawn_blocking(move || {
        match object.ready_for_passthrough() {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "tier copy not handed over");
                return None;
            }
        }
        let file = std::fs::File::open(object.backing_path()).ok()?;
        Some((OwnedFd::from(file), object.size()))
    })
    .await
    .ok()
    .flatten()
}

fn out_of_range(offset: u64, len: u64, size: u64) -> TierAnswer {
    error(
        TierErrorKind::InvalidRange,
        format!(
            "range {offset}..{} is outside the {size}-byte object",
            offset.saturating_add(len)
        ),
    )
}

/// Definite answers about the object go back as errors; anything the
/// mount is unsure of (a worker down, its own token refused) sends the
/// reader to the workers, which answer for themselves.
fn answer_for(e: &FsError) -> TierAnswer {
    match e {
        FsError::NotFound | FsError::DataPlane(DataError::NotFound) => {
            error(TierErrorKind::NotFound, "no such object".into())
        }
        FsError::Stale | FsError::DataPlane(DataError::Changed { .. }) => error(
            TierErrorKind::Changed,
            "the object is no longer the version asked for".into(),
        ),
        other => unavailable(format!(
            "the mount could not read it: {}",
            crate::error::Chain(other)
        )),
    }
}
