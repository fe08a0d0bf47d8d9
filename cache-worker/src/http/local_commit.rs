//! The co-located write path: a mount on this host hands over, through
//! the local socket, the descriptor of a file its application wrote
//! (through FUSE passthrough, so no byte crossed the mount), and this
//! worker takes the file's bytes as a write-back, exactly as if they had
//! arrived over HTTP: pages staged and synced, the journal record synced,
//! copies made, before the answer. While it works it reports progress
//! every second, so the mount can tell a slow commit from a hung worker.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::local_read::{CommitRequest, FollowRequest, LocalAnswer};
use lakecache_protocol::{buffer_pool, ErrorCode, ObjectStat, ObjectUri};
use tokio::sync::watch;

use super::AppState;
use crate::cache::CacheError;
use crate::writeback::{BodyMeta, PageCrcs, Staging, WriteRole};

/// How often a commit in progress says so.
pub(super) const PROGRESS_EVERY: Duration = Duration::from_secs(1);

fn refusal(code: ErrorCode, message: impl Into<String>) -> LocalAnswer {
    LocalAnswer::Error {
        code,
        message: message.into(),
    }
}

/// The commit as a task, and how many bytes it has taken so far; or the
/// answer at once when the request is refused.
pub(super) type Started = (
    tokio::task::JoinHandle<Result<crate::store::ObjectMeta, CacheError>>,
    Arc<AtomicU64>,
    ObjectUri,
);

/// What the connection tells a followed body (see [`start_follow`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seal {
    /// The mount is still writing the file.
    Open,
    /// The file is complete at this many bytes.
    At(u64),
}

/// The checks a commit and a follow share: who asks, for which object,
/// and the file they pass.
struct Admitted<'a> {
    access: crate::http::auth::Access<'a>,
    uri: ObjectUri,
    file: std::fs::File,
}

fn admit<'a>(
    state: &'a AppState,
    token: Option<&str>,
    uri: &str,
    fd: Option<OwnedFd>,
) -> Result<Admitted<'a>, Box<LocalAnswer>> {
    let access = state
        .access
        .authenticate_token(token)
        .map_err(|r| Box::new(refusal(r.code, r.message)))?;
    let uri = uri
        .parse::<ObjectUri>()
        .map_err(|e| Box::new(refusal(ErrorCode::InvalidPath, e.to_string())))?;
    access
        .may_write(&uri)
        .map_err(|r| Box::new(refusal(r.code, r.message)))?;
    let Some(fd) = fd else {
        return Err(Box::new(refusal(
            ErrorCode::BadRequest,
            "a commit must carry the file's descriptor",
        )));
    };
    let file = std::fs::File::from(fd);
    match file.metadata() {
        Ok(m) if m.is_file() => Ok(Admitted { access, uri, file }),
        Ok(_) => Err(Box::new(refusal(
            ErrorCode::BadRequest,
            "the passed descriptor is not a regular file",
        ))),
        Err(e) => Err(Box::new(refusal(
            ErrorCode::BadRequest,
            format!("the passed file: {e}"),
        ))),
    }
}

pub(super) async fn start(
    state: &AppState,
    commit: CommitRequest,
    fd: Option<OwnedFd>,
) -> Result<Started, LocalAnswer> {
    let admitted = admit(state, commit.token.as_deref(), &commit.uri, fd).map_err(|e| *e)?;
    let limit = state.limits.max_body_bytes;
    if commit.size > limit {
        return Err(refusal(
            ErrorCode::BodyTooLarge,
            format!("body of {} bytes exceeds the limit of {limit}", commit.size),
        ));
    }
    let held = admitted.file.metadata().map_or(0, |m| m.len());
    if held < commit.size {
        return Err(refusal(
            ErrorCode::BadRequest,
            format!(
                "the passed file holds {held} bytes; the commit names {}",
                commit.size
            ),
        ));
    }
    let taken = Arc::new(AtomicU64::new(0));
    let body = file_body(
        Arc::new(admitted.file),
        commit.size,
        state.cache.config.page_size as usize,
        taken.clone(),
    );
    let patience = patience(commit.deadline_ms, commit.sent_ms);
    let task = spawn(
        state,
        &admitted.access,
        &admitted.uri,
        body,
        patience,
        (commit.meta.into(), Staging::Buffered),
    );
    Ok((task, taken, admitted.uri))
}

/// Starts taking a file the mount is still writing: its bytes are taken
/// a page at a time as the file grows, until `sealed` gives its final
/// size; then the rest is taken, and the pages taken early are checked
/// against what the file holds now. The write is recorded with the
/// seal's metadata (`late_meta`, set before the seal is sent).
pub(super) async fn start_follow(
    state: &AppState,
    follow: FollowRequest,
    fd: Option<OwnedFd>,
    sealed: watch::Receiver<Seal>,
    late_meta: Arc<OnceLock<lakecache_protocol::UserMeta>>,
) -> Result<Started, LocalAnswer> {
    let admitted = admit(state, follow.token.as_deref(), &follow.uri, fd).map_err(|e| *e)?;
    let taken = Arc::new(AtomicU64::new(0));
    let crcs = Arc::new(PageCrcs::default());
    let body = super::local_follow::followed_body(
        Arc::new(admitted.file),
        state.cache.config.page_size as usize,
        state.limits.max_body_bytes,
        taken.clone(),
        sealed,
        crcs.clone(),
    );
    let patience = patience(follow.deadline_ms, follow.sent_ms);
    // Taken while the application writes, the pages go to disk with
    // O_DIRECT: no second page-cache copy of the file, whose fresh pages
    // cost the writer as much as the copy itself.
    let meta = BodyMeta {
        user: follow.meta,
        late: Some(late_meta),
        page_crcs: Some(crcs),
    };
    let task = spawn(
        state,
        &admitted.access,
        &admitted.uri,
        body,
        patience,
        (meta, Staging::Direct),
    );
    Ok((task, taken, admitted.uri))
}

fn patience(deadline_ms: u64, sent_ms: u64) -> Option<crate::fence::ClientPatience> {
    (deadline_ms > 0).then_some(crate::fence::ClientPatience {
        deadline: Duration::from_millis(deadline_ms),
        sent_ms,
    })
}

pub(super) type Body =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes, CacheError>> + Send>>;

fn spawn(
    state: &AppState,
    access: &crate::http::auth::Access<'_>,
    uri: &ObjectUri,
    body: Body,
    patience: Option<crate::fence::ClientPatience>,
    (meta, io): (BodyMeta, Staging),
) -> tokio::task::JoinHandle<Result<crate::store::ObjectMeta, CacheError>> {
    let tenant = access.tenant().map(Arc::<str>::from);
    let (cache, task_uri) = (state.cache.clone(), uri.clone());
    // Nothing travelled between the mount and here to be checked: the
    // pages, the upload and later reads carry CRCs taken from the file.
    let no_trailer = Arc::new(OnceLock::new());
    tokio::spawn(crate::tenant::scope(
        tenant,
        crate::fence::scope(patience, async move {
            cache
                .write_back_staged(&task_uri, body, no_trailer, WriteRole::Primary, meta, io)
                .await
        }),
    ))
}

/// The first `size` bytes of `file`, a page at a time, each read into a
/// pooled aligned buffer that goes to disk as it is (`O_DIRECT`).
fn file_body(file: Arc<std::fs::File>, size: u64, page: usize, taken: Arc<AtomicU64>) -> Body {
    let page = page.max(4096) as u64;
    Box::pin(futures::stream::try_unfold(0u64, move |at| {
        let (file, taken) = (file.clone(), taken.clone());
        async move {
            if at >= size {
                return Ok(None);
            }
            let n = page.min(size - at) as usize;
            let piece = tokio::task::spawn_blocking(move || buffer_pool::read_at(&file, at, n))
                .await
                .map_err(crate::cache::join_failed)?
                .map_err(|e| {
                    CacheError::Invalid(format!(
                        "reading the committed file at {at}: {e} (changed while committed?)"
                    ))
                })?;
            taken.fetch_add(n as u64, Ordering::Relaxed);
            Ok(Some((piece, at + n as u64)))
        }
    }))
}

/// The final answer for a finished commit.
pub(super) fn answer(
    uri: &ObjectUri,
    done: Result<Result<crate::store::ObjectMeta, CacheError>, tokio::task::JoinError>,
) -> LocalAnswer {
    match done {
        Ok(Ok(meta)) => LocalAnswer::Committed(ObjectStat {
            held_by: None,
            ..super::routes::stat_body(uri, &meta)
        }),
        Ok(Err(e)) => {
            if matches!(e, CacheError::FollowedFileChanged(_)) {
                tracing::info!(%uri, error = %e, "local commit of a followed file refused; nothing was acknowledged");
            } else {
                tracing::warn!(%uri, error = %e, "local commit failed; nothing was acknowledged");
            }
            refusal(super::response::cache_error_code(&e), e.to_string())
        }
        Err(e) => refusal(ErrorCode::Internal, format!("the commit task failed: {e}")),
    }
}
