//! The filesystem's side of staged writes (see `staged.rs`): which
//! handles have the kernel write into a staged file, and the size `stat`
//! shows for them (the mount sees none of those writes).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Fs, Handle};

/// How long an operation on a file whose staged writer was just closed
/// waits for that writer's release: the kernel sends it just after
/// `close` returns, and `close(); open()`, `close(); rename()` or
/// `close(); unlink()` must find the file closed, not still written.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

struct Staged {
    file: Arc<std::fs::File>,
    /// A descriptor of it was closed (flush): its release may follow.
    flushed: bool,
}

/// Staged files of inodes open for writing, by inode.
#[derive(Default)]
pub(super) struct StagedInodes {
    files: Mutex<HashMap<u64, Staged>>,
    released: tokio::sync::Notify,
}

impl StagedInodes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Staged>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Fs {
    /// For a handle just opened for writing: the staged file the kernel
    /// is to write into, when this write may go that way.
    pub async fn stage_writes(&self, fh: u64) -> Option<Arc<std::fs::File>> {
        if !self.config.staged_writes {
            return None;
        }
        let Ok(Handle::Write { writer, ino, .. }) = self.handle(fh) else {
            return None;
        };
        let dir = self.config.spool_dir.join("staged");
        let file = writer.lock().await.stage(&dir)?;
        self.staged.lock().insert(
            ino,
            Staged {
                file: file.clone(),
                flushed: false,
            },
        );
        Some(file)
    }

    /// The kernel refused the passthrough open: the handle writes through
    /// the mount. Called before the open is answered, so nothing was
    /// written and nothing else holds the writer.
    pub fn unstage(&self, fh: u64) {
        let Ok(Handle::Write { writer, ino, .. }) = self.handle(fh) else {
            return;
        };
        self.staged.lock().remove(&ino);
        let unstaged = match writer.try_lock() {
            Ok(mut w) => {
                w.unstage();
                true
            }
            Err(_) => false,
        };
        if !unstaged {
            tracing::error!(fh, "a staged writer was busy before its open was answered");
        }
    }

    /// The inode's size as its staged file has it, brought into the inode.
    pub(super) fn refresh_staged_size(&self, ino: u64) {
        let file = self.staged.lock().get(&ino).map(|s| s.file.clone());
        if let Some(size) = file.and_then(|f| f.metadata().ok()).map(|m| m.len()) {
            self.inodes.update(ino, |n| n.meta.size = size);
        }
    }

    /// A descriptor of `ino`'s staged file was closed.
    pub(super) fn staged_flushed(&self, ino: u64) {
        if let Some(staged) = self.staged.lock().get_mut(&ino) {
            staged.flushed = true;
        }
    }

    pub(super) fn forget_staged(&self, ino: u64) {
        if self.staged.lock().remove(&ino).is_some() {
            self.staged.released.notify_waiters();
        }
    }

    /// Waits, up to [`RELEASE_WAIT`], until a staged writer of `ino`
    /// that was closed is released (one still open is not waited for).
    pub(super) async fn await_staged_release(&self, ino: u64) {
        let deadline = Instant::now() + RELEASE_WAIT;
        loop {
            let released = self.staged.released.notified();
            if !self.staged.lock().get(&ino).is_some_and(|s| s.flushed) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, released).await.is_err() {
                return;
            }
        }
    }
}
