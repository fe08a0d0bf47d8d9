//! The filesystem's side of staged writes (see `staged.rs`): which
//! handles have the kernel write into a staged file, and the size `stat`
//! shows for them (the mount sees none of those writes). Also which
//! writers were closed but keep their inode until their release comes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Fs, Handle};

/// Staged files of inodes open for writing, by inode, and the inodes
/// whose writer was closed (flush) but not released yet.
#[derive(Default)]
pub(super) struct StagedInodes {
    files: Mutex<HashMap<u64, Arc<std::fs::File>>>,
    closed: Mutex<HashSet<u64>>,
    released: tokio::sync::Notify,
}

impl StagedInodes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<std::fs::File>>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn closed(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.closed.lock().unwrap_or_else(|p| p.into_inner())
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
        self.staged.lock().insert(ino, file.clone());
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
        let file = self.staged.lock().get(&ino).cloned();
        if let Some(size) = file.and_then(|f| f.metadata().ok()).map(|m| m.len()) {
            self.inodes.update(ino, |n| n.meta.size = size);
        }
    }

    /// A descriptor of `ino`'s staged file was closed.
    pub(super) fn staged_flushed(&self, ino: u64) {
        if self.staged.lock().contains_key(&ino) {
            self.staged.closed().insert(ino);
        }
    }

    /// `ino`'s writer was closed before anything was written: the empty
    /// file is stored when the release comes (see `flush`).
    pub(super) fn empty_writer_closed(&self, ino: u64) {
        self.staged.closed().insert(ino);
    }

    /// `ino`'s writer wrote after a close (through a duplicated
    /// descriptor, as `echo x > f` does): it is not about to be released.
    pub(super) fn writer_wrote(&self, ino: u64) {
        self.staged.closed().remove(&ino);
    }

    /// `ino`'s writer was released.
    pub(super) fn forget_staged(&self, ino: u64) {
        let was_staged = self.staged.lock().remove(&ino).is_some();
        if self.staged.closed().remove(&ino) || was_staged {
            self.staged.released.notify_waiters();
        }
    }

    /// Waits, up to `release_wait` (see the config), until a writer of
    /// `ino` that was closed is released (one still open is not waited
    /// for).
    pub(super) async fn await_closed_writer_release(&self, ino: u64) {
        let deadline = Instant::now() + self.config.release_wait;
        loop {
            let released = self.staged.released.notified();
            if !self.staged.closed().contains(&ino) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || tokio::time::timeout(left, released).await.is_err() {
                return;
            }
        }
    }
}
