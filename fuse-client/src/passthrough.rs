//! FUSE passthrough for objects that are whole in the node-local tier:
//! the kernel reads the tier's file directly and no READ reaches us.
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
                "FUSE passthrough unavailable; local tier hits are served by the mount"
            );
        }
    }

    /// Answers an open of `ino` (handle `fh`): passthrough when the inode
    /// is already in that mode, or when `file` is given and no handle of
    /// the inode is served by the mount; a normal open otherwise.
    pub fn reply_open(
        &self,
        reply: ReplyOpen,
        ino: u64,
        fh: u64,
        flags: FopenFlags,
        file: Option<std::fs::File>,
    ) {
        let mut modes = self.modes.lock().unwrap_or_else(|e| e.into_inner());
        modes.handles.insert(fh, ino);
        match modes.inodes.get_mut(&ino) {
            Some(Mode::Passthrough { id, open }) => {
                *open += 1;
                return reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), id);
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
            Some(id) => {
                tracing::debug!(ino, "opened with passthrough");
                reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
                modes.inodes.insert(ino, Mode::Passthrough { id, open: 1 });
                self.pin(ino, true);
            }
            None => {
                reply.opened(FileHandle(fh), flags);
                modes.inodes.insert(ino, Mode::Served { open: 1 });
            }
        }
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
