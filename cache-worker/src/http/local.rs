//! The worker's end of short-circuit reads (`lakecache_protocol::local_read`):
//! a Unix socket, reachable only by this host's processes of the worker's
//! own user (or root), where a mount asks for page files by version and
//! gets their descriptors. The token and scope checks are the HTTP ones.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt as _;
use lakecache_protocol::local_read::{
    frame, sendmsg_with_fd, LocalAnswer, LocalRequest, PageGrant, LOCAL_PROTOCOL, MAX_INLINE,
    MAX_MESSAGE,
};
use lakecache_protocol::{ErrorCode, ObjectUri, ReadKind};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use super::{local_commit, AppState};
use crate::cache::CacheError;

/// Binds the socket at `path` (a stale one is replaced), mode 0600.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    lakecache_protocol::unix_server::bind_private(path)
}

/// Serves connections until the task is aborted; removes the socket file
/// when dropped.
pub async fn serve(listener: UnixListener, path: PathBuf, state: Arc<AppState>, listen: String) {
    let _remove = RemoveOnDrop(path);
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "local socket accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Err(why) = same_user(&stream) {
            tracing::warn!(%why, "local socket: refused a connection");
            continue;
        }
        let (state, listen) = (state.clone(), listen.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &state, &listen).await {
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    tracing::debug!(error = %e, "local socket connection ended");
                }
            }
        });
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn same_user(stream: &UnixStream) -> Result<(), String> {
    lakecache_protocol::unix_server::same_user(stream, "worker")
}

async fn read_request(stream: &mut UnixStream) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    lakecache_protocol::unix_server::read_request(stream, MAX_MESSAGE).await
}

async fn connection(mut stream: UnixStream, state: &AppState, listen: &str) -> io::Result<()> {
    loop {
        let (body, fd) = read_request(&mut stream).await?;
        let (answer, sent_with) = match serde_json::from_slice::<LocalRequest>(&body) {
            Ok(LocalRequest::Hello) => (
                LocalAnswer::Hello {
                    listen: listen.to_string(),
                    protocol: LOCAL_PROTOCOL,
                },
                SentWith::Nothing,
            ),
            Ok(LocalRequest::Page {
                token,
                uri,
                etag,
                offset,
                len,
                inline,
                read_ahead,
                cached_only,
            }) => {
                let asked = Asked {
                    uri: &uri,
                    etag: &etag,
                    offset,
                    len,
                    inline,
                    cached_only,
                    kind: if read_ahead {
                        ReadKind::Ahead
                    } else {
                        ReadKind::Demand
                    },
                };
                page(state, token.as_deref(), asked).await
            }
            Ok(LocalRequest::Commit(commit)) => {
                let started = local_commit::start(state, commit, fd).await;
                (
                    commit_answer(&mut stream, started).await?,
                    SentWith::Nothing,
                )
            }
            Ok(LocalRequest::Follow(follow)) => (
                follow_answer(&mut stream, state, follow, fd).await?,
                SentWith::Nothing,
            ),
            Ok(LocalRequest::PrepareWriteBack { token }) => (
                prepare_write_back(state, token.as_deref()),
                SentWith::Nothing,
            ),
            Ok(LocalRequest::Seal(_)) => (
                refusal(
                    ErrorCode::BadRequest,
                    "a seal must come on the connection of its follow request".into(),
                ),
                SentWith::Nothing,
            ),
            Err(e) => (
                refusal(
                    ErrorCode::BadRequest,
                    format!("not a local-socket request: {e}"),
                ),
                SentWith::Nothing,
            ),
        };
        let reply = serde_json::to_vec(&answer).map_err(io::Error::other)?;
        let reply = frame(&reply)?;
        let fd = match &sent_with {
            SentWith::File(f) => Some(f.as_raw_fd()),
            _ => None,
        };
        let raw = stream.as_raw_fd();
        let sent = stream
            .async_io(Interest::WRITABLE, || sendmsg_with_fd(raw, &reply, fd))
            .await?;
        stream.write_all(&reply[sent..]).await?;
        if let SentWith::Stream(inline) = sent_with {
            send_inline(&mut stream, inline, state).await?;
        }
    }
}

/// Runs a commit, telling the mount every second that it goes on;
/// returns its final answer.
async fn commit_answer(
    stream: &mut UnixStream,
    started: Result<local_commit::Started, LocalAnswer>,
) -> io::Result<LocalAnswer> {
    let (mut task, taken, uri) = match started {
        Ok(started) => started,
        Err(answer) => return Ok(answer),
    };
    loop {
        tokio::select! {
            done = &mut task => return Ok(local_commit::answer(&uri, done)),
            () = tokio::time::sleep(local_commit::PROGRESS_EVERY) => {
                let progress = LocalAnswer::Progress { taken: taken.load(std::sync::atomic::Ordering::Relaxed) };
                let frame = frame(&serde_json::to_vec(&progress).map_err(io::Error::other)?)?;
                // A mount that gave up ends the connection here; its
                // deadline fences the write, and the task ends on its own.
                stream.write_all(&frame).await?;
            }
        }
    }
}

/// Takes a file as the mount writes it, until its seal on this
/// connection; then answers as a commit does. A connection that ends
/// before the seal, or brings anything else, ends the write unrecorded.
async fn follow_answer(
    stream: &mut UnixStream,
    state: &AppState,
    follow: lakecache_protocol::local_read::FollowRequest,
    fd: Option<OwnedFd>,
) -> io::Result<LocalAnswer> {
    let (sealed, seal_rx) = tokio::sync::watch::channel(local_commit::Seal::Open);
    let late_meta = Arc::new(std::sync::OnceLock::new());
    let started = local_commit::start_follow(state, follow, fd, seal_rx, late_meta.clone()).await;
    let (mut task, taken, uri) = match started {
        Ok(started) => started,
        Err(answer) => return Ok(answer),
    };
    let request = tokio::select! {
        request = read_request(stream) => request,
        // Failed before the seal (too large, the file unreadable): the
        // mount reads this answer after sending its seal.
        done = &mut task => return Ok(local_commit::answer(&uri, done)),
    };
    let (body, _) = request?;
    match serde_json::from_slice::<LocalRequest>(&body) {
        Ok(LocalRequest::Seal(seal)) => {
            let _ = late_meta.set(seal.meta);
            let _ = sealed.send(local_commit::Seal::At(seal.size));
        }
        // Dropping `sealed` ends the body with an error: nothing is
        // recorded.
        Ok(_) => {
            return Ok(refusal(
                ErrorCode::BadRequest,
                "a follow request must be followed by its seal".into(),
            ))
        }
        Err(e) => {
            return Ok(refusal(
                ErrorCode::BadRequest,
                format!("not a local-socket request: {e}"),
            ))
        }
    }
    commit_answer(stream, Ok((task, taken, uri))).await
}

/// Writes the bytes an inline answer promised, as the cache produces
/// them. A failure part way ends the connection: the reader sees it
/// short and reads the range over HTTP.
async fn send_inline(stream: &mut UnixStream, inline: Inline, state: &AppState) -> io::Result<()> {
    let Inline {
        mut pieces,
        len,
        _slot,
    } = inline;
    let mut sent = 0u64;
    while sent < len {
        let piece = match pieces.next().await {
            Some(Ok(piece)) if sent + piece.len() as u64 <= len && !piece.is_empty() => piece,
            Some(Ok(piece)) => {
                return Err(io::Error::other(format!(
                    "a piece of {} bytes at {sent} of {len}",
                    piece.len()
                )))
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "inline read failed part way; the reader goes over HTTP");
                return Err(io::Error::other(e.to_string()));
            }
            None => return Err(io::Error::other(format!("{sent} of {len} bytes"))),
        };
        // Counted before the reader can have the bytes: a reader that
        // checks the metric after its read must find them counted.
        state.metrics.served_inline(piece.len() as u64);
        stream.write_all(&piece).await?;
        sent += piece.len() as u64;
    }
    Ok(())
}

type Pieces = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<bytes::Bytes, CacheError>> + Send + 'static>,
>;

/// Bytes promised inline: `len` of them, from `pieces`, with the
/// tenant's request slot held until they are sent.
struct Inline {
    pieces: Pieces,
    len: u64,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// What follows an answer: a page file's descriptor, or inline bytes.
enum SentWith {
    Nothing,
    File(std::fs::File),
    Stream(Inline),
}

/// A page request's fields.
struct Asked<'a> {
    uri: &'a str,
    etag: &'a str,
    offset: u64,
    len: u64,
    /// The caller takes inline bytes.
    inline: bool,
    /// Only bytes held now (see `LocalRequest::Page`).
    cached_only: bool,
    kind: ReadKind,
}

/// How a granted request is served.
enum Found {
    File(crate::pages::CheckedFile),
    /// `len` bytes from the request's offset, as HTTP would send them.
    Stream(Pieces, u64),
    Elsewhere,
    /// A cached-only request for bytes the cache would fetch first.
    NotHeld,
}

fn refusal(code: ErrorCode, message: String) -> LocalAnswer {
    LocalAnswer::Error { code, message }
}

async fn page(state: &AppState, token: Option<&str>, asked: Asked<'_>) -> (LocalAnswer, SentWith) {
    let access = match state.access.authenticate_token(token) {
        Ok(a) => a,
        Err(r) => return (refusal(r.code, r.message), SentWith::Nothing),
    };
    let uri = match asked.uri.parse::<ObjectUri>() {
        Ok(u) => u,
        Err(e) => {
            return (
                refusal(ErrorCode::InvalidPath, e.to_string()),
                SentWith::Nothing,
            )
        }
    };
    if let Err(r) = access.may_read(&uri) {
        return (refusal(r.code, r.message), SentWith::Nothing);
    }
    let unavailable = |reason: &str| {
        (
            LocalAnswer::Unavailable {
                reason: reason.to_string(),
            },
            SentWith::Nothing,
        )
    };
    let slot = match state
        .tenants
        .admit(access.tenant().unwrap_or("anonymous"))
        .await
    {
        Ok(slot) => slot,
        Err(_) => return unavailable("the tenant has too many requests in flight"),
    };
    let tenant = access.tenant().map(Arc::<str>::from);
    let cache = state.cache.clone();
    let (offset, len) = (asked.offset, asked.len);
    let found = crate::tenant::scope(tenant, async {
        let meta = cache.stat(&uri).await?;
        let end = offset.saturating_add(len).min(meta.size);
        if meta.etag != asked.etag || offset >= end {
            // HTTP settles versions (uploads renamed, stale metadata) and
            // answers ranges past the end.
            return Ok(Found::Elsewhere);
        }
        if let Some(file) = cache
            .local_page(&uri, &meta, offset, end, asked.kind)
            .await?
        {
            return Ok(Found::File(file));
        }
        if !asked.inline {
            return Ok(Found::Elsewhere);
        }
        // One read of the whole range, as one HTTP request would be: the
        // worker's read-ahead follows a reader by where its reads start.
        let end = end.min(offset.saturating_add(MAX_INLINE));
        if asked.cached_only && !cache.holds_now(&uri, &meta, offset..end) {
            return Ok(Found::NotHeld);
        }
        let (pieces, _) = cache.read(&uri, &meta, offset..end, asked.kind).await?;
        Ok(Found::Stream(Box::pin(pieces), end - offset))
    })
    .await;
    match found {
        Ok(Found::File(f)) => {
            let grant = PageGrant {
                file_offset: f.file_offset,
                read_len: f.read_len,
                block: f.block,
                crcs: f.crcs,
                skip: f.skip,
                len: (f.read_len - f.skip).min(len),
            };
            (LocalAnswer::Granted(grant), SentWith::File(f.file))
        }
        Ok(Found::Stream(pieces, len)) => (
            LocalAnswer::Inline { len },
            SentWith::Stream(Inline {
                pieces,
                len,
                _slot: slot,
            }),
        ),
        Ok(Found::Elsewhere) => unavailable("not served from page files"),
        Ok(Found::NotHeld) => unavailable("not all of the range is cached now"),
        Err(CacheError::Store(lakecache_store::StoreError::PreconditionFailed)) => {
            unavailable("the object changed")
        }
        Err(e) => (
            refusal(super::response::cache_error_code(&e), e.to_string()),
            SentWith::Nothing,
        ),
    }
}

/// A write-back mount on this host announced itself: spares are written
/// for its first burst (see [`crate::spares`]).
fn prepare_write_back(state: &AppState, token: Option<&str>) -> LocalAnswer {
    let access = match state.access.authenticate_token(token) {
        Ok(a) => a,
        Err(r) => return refusal(r.code, r.message),
    };
    if let Err(r) = access.may_write_somewhere() {
        return refusal(r.code, r.message);
    }
    LocalAnswer::Prepared {
        spare_bytes: state.cache.prepare_write_back(),
    }
}
