//! The worker's end of short-circuit reads (`lakecache_protocol::local_read`):
//! a Unix socket, reachable only by this host's processes of the worker's
//! own user (or root), where a mount asks for page files by version and
//! gets their descriptors. The token and scope checks are the HTTP ones.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lakecache_protocol::local_read::{
    frame, sendmsg_with_fd, LocalAnswer, LocalRequest, PageGrant, LOCAL_PROTOCOL, MAX_MESSAGE,
};
use lakecache_protocol::{ErrorCode, ObjectUri};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use super::AppState;
use crate::cache::CacheError;

/// Binds the socket at `path` (a stale one from an earlier run is
/// replaced) with mode 0600.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
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

/// The file mode keeps others out; this keeps out a process that was
/// handed a connected socket by someone else, too.
fn same_user(stream: &UnixStream) -> Result<(), String> {
    let cred = stream.peer_cred().map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if cred.uid() == me || cred.uid() == 0 {
        Ok(())
    } else {
        Err(format!("uid {} is not the worker's user {me}", cred.uid()))
    }
}

async fn connection(mut stream: UnixStream, state: &AppState, listen: &str) -> io::Result<()> {
    loop {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await?;
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_MESSAGE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request too long",
            ));
        }
        let mut body = vec![0u8; n];
        stream.read_exact(&mut body).await?;
        let (answer, file) = match serde_json::from_slice::<LocalRequest>(&body) {
            Ok(LocalRequest::Hello) => (
                LocalAnswer::Hello {
                    listen: listen.to_string(),
                    protocol: LOCAL_PROTOCOL,
                },
                None,
            ),
            Ok(LocalRequest::Page {
                token,
                uri,
                etag,
                offset,
                len,
            }) => page(state, token.as_deref(), &uri, &etag, offset, len).await,
            Err(e) => (
                refusal(
                    ErrorCode::BadRequest,
                    format!("not a local-socket request: {e}"),
                ),
                None,
            ),
        };
        let reply = serde_json::to_vec(&answer).map_err(io::Error::other)?;
        let reply = frame(&reply)?;
        let fd = file.as_ref().map(|f| f.as_raw_fd());
        let raw = stream.as_raw_fd();
        let sent = stream
            .async_io(Interest::WRITABLE, || sendmsg_with_fd(raw, &reply, fd))
            .await?;
        stream.write_all(&reply[sent..]).await?;
    }
}

fn refusal(code: ErrorCode, message: String) -> LocalAnswer {
    LocalAnswer::Error { code, message }
}

async fn page(
    state: &AppState,
    token: Option<&str>,
    uri: &str,
    etag: &str,
    offset: u64,
    len: u64,
) -> (LocalAnswer, Option<std::fs::File>) {
    let access = match state.access.authenticate_token(token) {
        Ok(a) => a,
        Err(r) => return (refusal(r.code, r.message), None),
    };
    let uri = match uri.parse::<ObjectUri>() {
        Ok(u) => u,
        Err(e) => return (refusal(ErrorCode::InvalidPath, e.to_string()), None),
    };
    if let Err(r) = access.may_read(&uri) {
        return (refusal(r.code, r.message), None);
    }
    let unavailable = |reason: &str| {
        (
            LocalAnswer::Unavailable {
                reason: reason.to_string(),
            },
            None,
        )
    };
    let _slot = match state
        .tenants
        .admit(access.tenant().unwrap_or("anonymous"))
        .await
    {
        Ok(slot) => slot,
        Err(_) => return unavailable("the tenant has too many requests in flight"),
    };
    let tenant = access.tenant().map(Arc::<str>::from);
    let cache = state.cache.clone();
    let found = crate::tenant::scope(tenant, async {
        let meta = cache.stat(&uri).await?;
        if meta.etag != etag {
            // HTTP settles versions (uploads renamed, stale metadata).
            return Ok(None);
        }
        let end = offset.saturating_add(len).min(meta.size);
        cache.local_page(&uri, &meta, offset, end).await
    })
    .await;
    match found {
        Ok(Some(f)) => {
            let grant = PageGrant {
                file_offset: f.file_offset,
                read_len: f.read_len,
                block: f.block,
                crcs: f.crcs,
                skip: f.skip,
                len: (f.read_len - f.skip).min(len),
            };
            (LocalAnswer::Granted(grant), Some(f.file))
        }
        Ok(None) => unavailable("not served from page files"),
        Err(CacheError::Store(lakecache_store::StoreError::PreconditionFailed)) => {
            unavailable("the object changed")
        }
        Err(e) => (
            refusal(super::response::cache_error_code(&e), e.to_string()),
            None,
        ),
    }
}
