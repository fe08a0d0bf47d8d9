//! Simulated power loss, for tests: what a worker writes under a chosen
//! directory is tracked, and at a chosen sync call the "power goes out":
//! everything not yet synced is undone the way a power loss would lose it,
//! and every later tracked operation fails, as on a dead machine.
//!
//! A SIGKILL leaves the page cache intact and cannot show a missing
//! `fsync`; this can. The model is the conservative POSIX one:
//! - a file's bytes are durable up to the length it had at its last
//!   `fsync`/`fdatasync` (bytes written since are cut off; a file never
//!   synced is emptied);
//! - creating a file or directory, or renaming onto a name, is durable
//!   once the directory holding the new name is synced; until then it is
//!   undone (a rename moves back, a creation disappears).
//!
//! Inert unless [`arm`] was called: every hook then returns at once.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static ARMED: AtomicBool = AtomicBool::new(false);
static SIM: Mutex<Option<Sim>> = Mutex::new(None);

enum Op {
    Create(PathBuf),
    Mkdir(PathBuf),
    Rename { from: PathBuf, to: PathBuf },
}

struct Pending {
    op: Op,
    /// The directory whose sync makes the operation durable.
    dir: PathBuf,
}

struct Sim {
    root: PathBuf,
    /// The sync call (1-based) at which the power goes out.
    cut_at: u64,
    syncs: u64,
    dead: bool,
    /// Inode → length at its last sync.
    synced_len: HashMap<u64, u64>,
    pending: Vec<Pending>,
}

fn lock() -> std::sync::MutexGuard<'static, Option<Sim>> {
    SIM.lock().unwrap_or_else(|p| p.into_inner())
}

fn dead() -> io::Error {
    io::Error::other("simulated power loss: this machine is off")
}

/// Tracks everything written under `root`; the `cut_at`-th sync under it
/// cuts the power.
pub fn arm(root: &Path, cut_at: u64) {
    *lock() = Some(Sim {
        root: root.to_path_buf(),
        cut_at,
        syncs: 0,
        dead: false,
        synced_len: HashMap::new(),
        pending: Vec::new(),
    });
    ARMED.store(true, Ordering::SeqCst);
}

/// Moves the cut to the `more`-th sync from now, keeping what is tracked.
pub fn cut_after(more: u64) {
    if let Some(s) = lock().as_mut() {
        s.cut_at = s.syncs.saturating_add(more);
    }
}

/// Stops tracking; returns whether the power was cut.
pub fn disarm() -> bool {
    ARMED.store(false, Ordering::SeqCst);
    lock().take().is_some_and(|s| s.dead)
}

/// Runs `f` with the simulation for `path`, when armed and `path` is
/// under its root.
fn with<T>(path: &Path, f: impl FnOnce(&mut Sim) -> T) -> Option<T> {
    if !ARMED.load(Ordering::Relaxed) {
        return None;
    }
    let mut guard = lock();
    let sim = guard.as_mut()?;
    path.starts_with(&sim.root).then(|| f(sim))
}

fn ino(path: &Path) -> Option<u64> {
    fs::symlink_metadata(path).ok().map(|m| m.ino())
}

fn parent(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Fails once the power is out (call before writing under `path`).
pub(crate) fn alive(path: &Path) -> io::Result<()> {
    match with(path, |s| s.dead) {
        Some(true) => Err(dead()),
        _ => Ok(()),
    }
}

/// A file now exists at `path` whose bytes have all been durable so far
/// (an existing journal): later appends count as unsynced.
pub(crate) fn existing(path: &Path) {
    with(path, |s| {
        if let Ok(m) = fs::metadata(path) {
            s.synced_len.insert(m.ino(), m.len());
        }
    });
}

/// `path` was just created (empty, not yet durable in its directory).
pub(crate) fn created(path: &Path) -> io::Result<()> {
    with(path, |s| {
        if s.dead {
            return Err(dead());
        }
        if let Some(i) = ino(path) {
            s.synced_len.insert(i, 0);
        }
        s.pending.push(Pending {
            op: Op::Create(path.to_path_buf()),
            dir: parent(path),
        });
        Ok(())
    })
    .unwrap_or(Ok(()))
}

/// Creates `path` and its missing parents with `make`, recording the
/// topmost directory it created.
pub(crate) fn mkdir(path: &Path, make: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
    let first_missing = with(path, |s| {
        if s.dead {
            return Err(dead());
        }
        let mut first = None;
        let mut at = Some(path);
        while let Some(p) = at {
            // The root itself is the disk: it is there.
            if !p.starts_with(&s.root) || p == s.root || p.exists() {
                break;
            }
            first = Some(p.to_path_buf());
            at = p.parent();
        }
        Ok(first)
    })
    .transpose()?
    .flatten();
    make()?;
    if let Some(created) = first_missing {
        with(&created, |s| {
            s.pending.push(Pending {
                dir: parent(&created),
                op: Op::Mkdir(created.clone()),
            })
        });
    }
    Ok(())
}

/// Renames with `rename`; the new name is durable once its directory is
/// synced.
pub(crate) fn rename(
    from: &Path,
    to: &Path,
    rename: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    alive(to)?;
    rename()?;
    with(to, |s| {
        s.pending.push(Pending {
            op: Op::Rename {
                from: from.to_path_buf(),
                to: to.to_path_buf(),
            },
            dir: parent(to),
        })
    });
    Ok(())
}

/// A sync call: the power may go out here, before it takes effect.
fn sync_point(s: &mut Sim) -> io::Result<()> {
    if s.dead {
        return Err(dead());
    }
    s.syncs += 1;
    if s.syncs == s.cut_at {
        s.cut();
        return Err(dead());
    }
    Ok(())
}

/// Syncs the file at `path` with `sync`, recording its durable length.
pub(crate) fn sync_file(
    path: &Path,
    file: &fs::File,
    sync: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    with(path, sync_point).transpose()?;
    let _slowed = slow_disk::enter(path);
    sync()?;
    with(path, |s| {
        if let Ok(m) = file.metadata() {
            s.synced_len.insert(m.ino(), m.len());
        }
    });
    Ok(())
}

/// Syncs the directory `dir` with `sync`: what was created or renamed
/// into it is durable from now on.
pub(crate) fn sync_dir(dir: &Path, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
    with(dir, sync_point).transpose()?;
    sync()?;
    with(dir, |s| s.pending.retain(|p| p.dir != dir));
    Ok(())
}

impl Sim {
    /// Undoes what a power loss would lose, newest first.
    fn cut(&mut self) {
        self.dead = true;
        for pending in self.pending.drain(..).rev() {
            let undone = match &pending.op {
                Op::Rename { from, to } => fs::rename(to, from),
                Op::Create(path) => fs::remove_file(path),
                Op::Mkdir(path) => fs::remove_dir_all(path),
            };
            if let Err(e) = undone {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(error = %e, "simulated power loss: undoing an operation failed");
                }
            }
        }
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let Ok(meta) = fs::symlink_metadata(&path) else {
                    continue;
                };
                if meta.is_dir() {
                    stack.push(path);
                } else if let Some(len) = self.synced_len.get(&meta.ino()) {
                    if meta.len() > *len {
                        let _ = fs::OpenOptions::new()
                            .write(true)
                            .open(&path)
                            .and_then(|f| f.set_len(*len));
                    }
                }
            }
        }
        tracing::warn!(root = %self.root.display(), sync = self.syncs, "simulated power loss");
    }
}

/// A slow disk, for tests: every sync of a file with a given name under a
/// given directory takes a set time longer. Independent of the power-loss
/// simulation, and inert unless [`slow_disk::slow_syncs`] was called.
pub mod slow_disk {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Mutex;
    use std::time::Duration;

    static ON: AtomicBool = AtomicBool::new(false);
    static RULE: Mutex<Option<(PathBuf, String, Duration)>> = Mutex::new(None);
    static UNDER_WAY: AtomicU64 = AtomicU64::new(0);

    /// Syncs of files named `file_name` under `root` take `delay` longer.
    pub fn slow_syncs(root: &Path, file_name: &str, delay: Duration) {
        *rule() = Some((root.to_path_buf(), file_name.to_string(), delay));
        ON.store(true, Ordering::SeqCst);
    }

    /// Syncs are fast again.
    pub fn fast_syncs() {
        ON.store(false, Ordering::SeqCst);
        *rule() = None;
    }

    /// Slowed syncs going on now.
    pub fn under_way() -> u64 {
        UNDER_WAY.load(Ordering::SeqCst)
    }

    fn rule() -> std::sync::MutexGuard<'static, Option<(PathBuf, String, Duration)>> {
        RULE.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a slowed sync as under way until dropped.
    pub(crate) struct Slowed;

    impl Drop for Slowed {
        fn drop(&mut self) {
            UNDER_WAY.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Waits the rule's delay if it covers `path` (before its sync).
    pub(crate) fn enter(path: &Path) -> Option<Slowed> {
        if !ON.load(Ordering::Relaxed) {
            return None;
        }
        let delay = rule().as_ref().and_then(|(root, name, delay)| {
            let named = path.file_name().is_some_and(|n| *n == **name);
            (named && path.starts_with(root)).then_some(*delay)
        })?;
        UNDER_WAY.fetch_add(1, Ordering::SeqCst);
        let slowed = Slowed;
        std::thread::sleep(delay);
        Some(slowed)
    }
}
