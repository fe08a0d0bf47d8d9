//! Simulated power loss, for tests: what a worker writes under a chosen
//! directory is tracked, and at a chosen cut point (every sync call, and
//! a few marked places without one) the "power goes out": everything not
//! yet synced is undone the way a power loss would lose it, and every
//! later tracked operation fails, as on a dead machine.
//!
//! A SIGKILL leaves the page cache intact and cannot show a missing
//! `fsync`; this can. Two models of what is lost:
//! - conservative (the default): a file's bytes are durable up to the
//!   length it had at its last `fsync`/`fdatasync` (bytes written since
//!   are cut off; a file never synced is emptied); creating a file or
//!   directory, renaming onto a name, or unlinking a file, is durable
//!   once the directory holding the name is synced, and undone until then;
//! - torn ([`tear`], seeded): only what fsync and directory fsync promise
//!   holds. Of the unsynced bytes a file gained, a random prefix of whole
//!   512-byte sectors survives, sometimes with a sector range inside it
//!   zeroed (a later write reached the disk, an earlier one did not); an
//!   unsynced overwrite in place survives sector by sector at random; of
//!   each directory's unsynced creations and renames, a random prefix
//!   survives (in the order made, as a journaling filesystem commits).
//!
//! Inert unless [`arm`] was called: every hook then returns at once.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

mod cut;
pub mod slow_disk;

static ARMED: AtomicBool = AtomicBool::new(false);
static SIM: Mutex<Option<Sim>> = Mutex::new(None);
/// Journal compaction threshold set by a test (0: the journal's own).
static COMPACT_AFTER: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// What the thread is doing, for naming cut points (innermost last).
    static SITE: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
}

enum Op {
    Create(PathBuf),
    Mkdir(PathBuf),
    Rename {
        from: PathBuf,
        to: PathBuf,
        /// A hard link to the file the rename replaced, restored if the
        /// rename is undone.
        replaced: Option<PathBuf>,
    },
    /// A file unlinked; `kept` is a hard link to it, put back if undone.
    Remove {
        path: PathBuf,
        kept: PathBuf,
    },
}

struct Pending {
    op: Op,
    /// The directory whose sync makes the operation durable.
    dir: PathBuf,
}

/// Bytes overwritten in place and not yet synced, as they were before.
struct Overwrite {
    ino: u64,
    offset: u64,
    old: Vec<u8>,
}

struct Sim {
    root: PathBuf,
    /// Where replaced files are kept until their replacement is durable
    /// (beside `root`, on the same filesystem, outside what is tracked).
    backups: PathBuf,
    backup_count: u64,
    /// The cut point (1-based) at which the power goes out.
    cut_at: u64,
    points: u64,
    dead: bool,
    /// Where the power went out.
    cut_site: Option<&'static str>,
    /// Inode → length at its last sync.
    synced_len: HashMap<u64, u64>,
    pending: Vec<Pending>,
    overwrites: Vec<Overwrite>,
    /// Seeded choices of the torn model; `None`: the conservative one.
    tear: Option<cut::Rng>,
}

fn lock() -> std::sync::MutexGuard<'static, Option<Sim>> {
    SIM.lock().unwrap_or_else(|p| p.into_inner())
}

fn dead() -> io::Error {
    io::Error::other("simulated power loss: this machine is off")
}

/// Tracks everything written under `root`; the `cut_at`-th cut point
/// under it cuts the power (conservative model until [`tear`]).
pub fn arm(root: &Path, cut_at: u64) {
    let name = root.file_name().map(|n| n.to_string_lossy().into_owned());
    let backups = root.with_file_name(format!(".{}.crashsim", name.unwrap_or_default()));
    *lock() = Some(Sim {
        root: root.to_path_buf(),
        backups,
        backup_count: 0,
        cut_at,
        points: 0,
        dead: false,
        cut_site: None,
        synced_len: HashMap::new(),
        pending: Vec::new(),
        overwrites: Vec::new(),
        tear: None,
    });
    ARMED.store(true, Ordering::SeqCst);
}

/// Loses only what fsync does not promise, with choices drawn from `seed`
/// (the same seed and the same operations lose the same bytes).
pub fn tear(seed: u64) {
    if let Some(s) = lock().as_mut() {
        s.tear = Some(cut::Rng::new(seed));
    }
}

/// Moves the cut to the `more`-th cut point from now, keeping what is
/// tracked.
pub fn cut_after(more: u64) {
    if let Some(s) = lock().as_mut() {
        s.cut_at = s.points.saturating_add(more);
    }
}

/// Whether the power has gone out (tracking still on).
pub fn power_is_out() -> bool {
    lock().as_ref().is_some_and(|s| s.dead)
}

/// Cut points reached since [`arm`].
pub fn points_reached() -> u64 {
    lock().as_ref().map_or(0, |s| s.points)
}

/// Stops tracking; returns whether the power was cut.
pub fn disarm() -> bool {
    disarm_site().is_some()
}

/// Stops tracking; returns where the power was cut, if it was.
pub fn disarm_site() -> Option<&'static str> {
    ARMED.store(false, Ordering::SeqCst);
    let sim = lock().take()?;
    let _ = fs::remove_dir_all(&sim.backups);
    sim.cut_site
}

/// Makes journals under the armed root compact once `bytes` of finished
/// records pile up, so that a short test reaches compaction (0: the
/// journal's own limit).
pub fn compact_journals_after(bytes: u64) {
    COMPACT_AFTER.store(bytes, Ordering::SeqCst);
}

/// The compaction threshold of the journal at `path`: a test's where the
/// journal is tracked, else `default`.
pub(crate) fn compact_after(path: &Path, default: u64) -> u64 {
    match COMPACT_AFTER.load(Ordering::Relaxed) {
        0 => default,
        set if with(path, |_| ()).is_some() => set,
        _ => default,
    }
}

/// Names the cut points this thread reaches until dropped.
pub(crate) struct SiteGuard;

impl Drop for SiteGuard {
    fn drop(&mut self) {
        SITE.with(|s| s.borrow_mut().pop());
    }
}

/// Cut points reached on this thread until the guard drops are `site`'s.
pub(crate) fn site(name: &'static str) -> SiteGuard {
    SITE.with(|s| s.borrow_mut().push(name));
    SiteGuard
}

/// The name of a cut point at `path`: the thread's site, else what the
/// path is.
fn site_of(path: &Path) -> &'static str {
    if let Some(named) = SITE.with(|s| s.borrow().last().copied()) {
        return named;
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    if name.ends_with(".journal") {
        "write: journal record"
    } else if path.parent().and_then(Path::file_name) == Some("tmp".as_ref()) {
        "write: page file"
    } else if path.is_dir() {
        "write: directory"
    } else {
        "other"
    }
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
/// synced. A file it replaces comes back if the rename is undone.
pub(crate) fn rename(
    from: &Path,
    to: &Path,
    rename: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    alive(to)?;
    let replaced = with(to, |s| s.keep_old(to)).flatten();
    if let Err(e) = rename() {
        if let Some(kept) = &replaced {
            let _ = fs::remove_file(kept);
        }
        return Err(e);
    }
    with(to, |s| {
        s.pending.push(Pending {
            op: Op::Rename {
                from: from.to_path_buf(),
                to: to.to_path_buf(),
                replaced,
            },
            dir: parent(to),
        })
    });
    Ok(())
}

/// Unlinks the file at `path` with `remove`; until its directory is
/// synced the file may come back after a power loss.
pub(crate) fn remove(path: &Path, remove: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
    alive(path)?;
    let kept = with(path, |s| s.keep_old(path)).flatten();
    if let Err(e) = remove() {
        if let Some(kept) = &kept {
            let _ = fs::remove_file(kept);
        }
        return Err(e);
    }
    if let Some(kept) = kept {
        with(path, |s| {
            s.pending.push(Pending {
                op: Op::Remove {
                    path: path.to_path_buf(),
                    kept,
                },
                dir: parent(path),
            })
        });
    }
    Ok(())
}

/// `len` bytes of `file` (at `path`) at `offset` are about to be
/// overwritten in place: what they were is kept until the file is synced.
pub(crate) fn overwriting(path: &Path, file: &fs::File, offset: u64, len: usize) -> io::Result<()> {
    with(path, |s| {
        if s.dead {
            return Err(dead());
        }
        let mut old = vec![0u8; len];
        let got = file.read_at(&mut old, offset)?;
        old.truncate(got);
        if let Ok(m) = file.metadata() {
            s.overwrites.push(Overwrite {
                ino: m.ino(),
                offset,
                old,
            });
        }
        Ok(())
    })
    .unwrap_or(Ok(()))
}

/// A place where the power may go out though nothing is synced there.
pub(crate) fn cut_point(path: &Path) -> io::Result<()> {
    with(path, |s| s.point(path)).transpose()?;
    Ok(())
}

/// Syncs the file at `path` with `sync`, recording its durable length.
pub(crate) fn sync_file(
    path: &Path,
    file: &fs::File,
    sync: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    with(path, |s| s.point(path)).transpose()?;
    let _slowed = slow_disk::enter(path);
    sync()?;
    with(path, |s| {
        if let Ok(m) = file.metadata() {
            s.synced_len.insert(m.ino(), m.len());
            s.overwrites.retain(|o| o.ino != m.ino());
        }
    });
    Ok(())
}

/// Syncs the directory `dir` with `sync`: what was created or renamed
/// into it is durable from now on.
pub(crate) fn sync_dir(dir: &Path, sync: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
    with(dir, |s| s.point(dir)).transpose()?;
    sync()?;
    with(dir, |s| {
        let (durable, still): (Vec<_>, Vec<_>) =
            s.pending.drain(..).partition(|p| p.dir.as_path() == dir);
        s.pending = still;
        for p in durable {
            match p.op {
                Op::Rename {
                    replaced: Some(kept),
                    ..
                }
                | Op::Remove { kept, .. } => {
                    let _ = fs::remove_file(kept);
                }
                _ => {}
            }
        }
    });
    Ok(())
}

impl Sim {
    /// A cut point: the power may go out here, before what follows.
    fn point(&mut self, path: &Path) -> io::Result<()> {
        if self.dead {
            return Err(dead());
        }
        self.points += 1;
        if self.points == self.cut_at {
            self.cut_site = Some(site_of(path));
            self.cut();
            return Err(dead());
        }
        Ok(())
    }

    /// Hard-links the file at `to` (about to be replaced) aside.
    fn keep_old(&mut self, to: &Path) -> Option<PathBuf> {
        if !fs::symlink_metadata(to).is_ok_and(|m| m.is_file()) {
            return None;
        }
        fs::create_dir_all(&self.backups).ok()?;
        self.backup_count += 1;
        let kept = self.backups.join(self.backup_count.to_string());
        fs::hard_link(to, &kept).ok().map(|()| kept)
    }
}
