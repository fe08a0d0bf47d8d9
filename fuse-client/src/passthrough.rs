//! FUSE passthrough for objects that are whole in the node-local tier
//! (the kernel reads the tier's file directly and no READ reaches us),
//! and for files written back through a staged file (`staged.rs`).
//!
//! The kernel keeps one I/O mode per inode while it is open, so an inode
//! with a handle served by us gets no passthrough handle beside it, and
//! all passthrough handles of an inode share one backing id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use fuser::{BackingId, FileHandle, FopenFlags, ReplyOpen};

enum Mode {
    Passthrough { id: Arc<BackingId>, open: usize },
    Served { open: usize },
}

#[derive(Default)]
struct Modes {
    inodes: HashMap<u64, Mode>,
    handles: HashMap<u64, u64>,
}

pub(crate) struct Passthrough {
    /// Off after the kernel refused once (old kernel, no privilege).
    enabled: AtomicBool,
    modes: Mutex<Modes>,
    /// Pins an inode to its version while it is in passthrough mode.
    fs: Weak<crate::Fs>,
}

impl Passthrough {
    pub fn new(enabled: bool, fs: Weak<crate::Fs>) -> Self {
        Self {
            enabled: AtomicBool::new(enabled),
            modes: Mutex::default(),
            fs,
        }
    }

    fn pin(&self, ino: u64, pinned: bool) {
        if let Some(fs) = self.fs.upgrade() {
            fs.pin_version(ino, pinned);
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub fn disable(&self, why: &str) {
        if self.enabled.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                why,
                "FUSE passthrough unavailable; local tier hits are served by the mount, and written-back files are written through it"
            );
        }
    }

    /// Answers an open of `ino` (handle `fh`): passthrough when the inode
    /// is already in that mode, or when `file` is given and no handle of
    /// the inode is served by the mount; a normal open otherwise. `flags`
    /// go with either answer, but for `FOPEN_KEEP_CACHE`, which a
    /// passthrough open may not carry.
    pub fn reply_open(
        &self,
        reply: ReplyOpen,
        ino: u64,
        fh: u64,
        flags: FopenFlags,
        file: Option<std::fs::File>,
    ) {
        let passthrough_flags = flags & FopenFlags::FOPEN_NOFLUSH;
        let mut modes = self.modes.lock().unwrap_or_else(|e| e.into_inner());
        modes.handles.insert(fh, ino);
        match modes.inodes.get_mut(&ino) {
            Some(Mode::Passthrough { id, open }) => {
                *open += 1;
                return reply.opened_passthrough(FileHandle(fh), passthrough_flags, id);
            }
            Some(Mode::Served { open }) => {
                *open += 1;
                return reply.opened(FileHandle(fh), flags);
            }
            None => {}
        }
        let backing = match file.filter(|_| self.enabled()) {
            Some(file) => match reply.open_backing(&file) {
                Ok(id) => Some(Arc::new(id)),
                Err(e) => {
                    self.disable(&e.to_string());
                    None
                }
            },
            None => None,
        };
        match backing {
            // No FOPEN_KEEP_CACHE here, even where the inode's pages are
            // current: the kernel (6.18) fails such an open with EIO, and
            // drops the pages served opens left instead.
            Some(id) => {
                tracing::debug!(ino, "opened with passthrough");
                reply.opened_passthrough(FileHandle(fh), passthrough_flags, &id);
                modes.inodes.insert(ino, Mode::Passthrough { id, open: 1 });
                self.pin(ino, true);
            }
            None => {
                reply.opened(FileHandle(fh), flags);
                modes.inodes.insert(ino, Mode::Served { open: 1 });
            }
        }
    }

    /// Takes a passthrough mode for a file being written into `file`
    /// (see `staged.rs`), through `open_backing`: the backing id, or
    /// `None` when the inode already has handles in either mode or the
    /// kernel refuses (the caller then writes through the mount).
    pub fn stage(
        &self,
        ino: u64,
        fh: u64,
        file: &std::fs::File,
        open_backing: impl FnOnce(&std::fs::File) -> std::io::Result<BackingId>,
    ) -> Option<Arc<BackingId>> {
        if !self.enabled() {
            return None;
        }
        let mut modes = self.modes.lock().unwrap_or_else(|e| e.into_inner());
        if modes.inodes.contains_key(&ino) {
            return None;
        }
        let id = match open_backing(file) {
            Ok(id) => Arc::new(id),
            Err(e) => {
                self.disable(&e.to_string());
                return None;
            }
        };
        modes.handles.insert(fh, ino);
        modes.inodes.insert(
            ino,
            Mode::Passthrough {
                id: id.clone(),
                open: 1,
            },
        );
        Some(id)
    }

    /// A handle closed; the inode's mode ends with its last handle.
    pub fn released(&self, fh: u64) {
        let mut modes = self.modes.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ino) = modes.handles.remove(&fh) else {
            return;
        };
        let last = match modes.inodes.get_mut(&ino) {
            Some(Mode::Passthrough { open, .. } | Mode::Served { open }) => {
                *open = open.saturating_sub(1);
                *open == 0
            }
            None => false,
        };
        if last {
            if let Some(Mode::Passthrough { .. }) = modes.inodes.remove(&ino) {
                self.pin(ino, false);
            }
        }
    }
}
