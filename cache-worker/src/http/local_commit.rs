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
use lakecache_protocol::local_read::{CommitRequest, LocalAnswer};
use lakecache_protocol::{buffer_pool, ErrorCode, ObjectStat, ObjectUri};

use super::AppState;
use crate::cache::CacheError;
use crate::writeback::{Staging, WriteRole};

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

pub(super) async fn start(
    state: &AppState,
    commit: CommitRequest,
    fd: Option<OwnedFd>,
) -> Result<Started, LocalAnswer> {
    let access = state
        .access
        .authenticate_token(commit.token.as_deref())
        .map_err(|r| refusal(r.code, r.message))?;
    let uri = commit
        .uri
        .parse::<ObjectUri>()
        .map_err(|e| refusal(ErrorCode::InvalidPath, e.to_string()))?;
    access
        .may_write(&uri)
        .map_err(|r| refusal(r.code, r.message))?;
    let Some(fd) = fd else {
        return Err(refusal(
            ErrorCode::BadRequest,
            "a commit must carry the file's descriptor",
        ));
    };
    let limit = state.limits.max_body_bytes;
    if commit.size > limit {
        return Err(refusal(
            ErrorCode::BodyTooLarge,
            format!("body of {} bytes exceeds the limit of {limit}", commit.size),
        ));
    }
    let file = std::fs::File::from(fd);
    let held = file
        .metadata()
        .map_err(|e| refusal(ErrorCode::BadRequest, format!("the passed file: {e}")))?;
    if !held.is_file() || held.len() < commit.size {
        return Err(refusal(
            ErrorCode::BadRequest,
            format!(
                "the passed file holds {} bytes; the commit names {}",
                held.len(),
                commit.size
            ),
        ));
    }
    let taken = Arc::new(AtomicU64::new(0));
    let body = file_body(
        Arc::new(file),
        commit.size,
        state.cache.config.page_size as usize,
        taken.clone(),
    );
    let patience = (commit.deadline_ms > 0).then_some(crate::fence::ClientPatience {
        deadline: Duration::from_millis(commit.deadline_ms),
        sent_ms: commit.sent_ms,
    });
    let tenant = access.tenant().map(Arc::<str>::from);
    let (cache, task_uri, user) = (state.cache.clone(), uri.clone(), commit.meta);
    // Nothing travelled between the mount and here to be checked: the
    // pages, the upload and later reads carry CRCs taken from the file.
    let no_trailer = Arc::new(OnceLock::new());
    let task = tokio::spawn(crate::tenant::scope(
        tenant,
        crate::fence::scope(patience, async move {
            cache
                .write_back_staged(
                    &task_uri,
                    body,
                    no_trailer,
                    WriteRole::Primary,
                    user,
                    Staging::Buffered,
                )
                .await
        }),
    ));
    Ok((task, taken, uri))
}

/// The first `size` bytes of `file`, a page at a time, each read into a
/// pooled aligned buffer that goes to disk as it is (`O_DIRECT`).
fn file_body(
    file: Arc<std::fs::File>,
    size: u64,
    page: usize,
    taken: Arc<AtomicU64>,
) -> std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes, CacheError>> + Send>> {
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
            tracing::warn!(%uri, error = %e, "local commit failed; nothing was acknowledged");
            refusal(super::response::cache_error_code(&e), e.to_string())
        }
        Err(e) => refusal(ErrorCode::Internal, format!("the commit task failed: {e}")),
    }
}
