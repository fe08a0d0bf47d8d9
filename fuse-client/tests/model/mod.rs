//! The reference model: a namespace of files and directories as a user
//! of the mount sees it, and a driver that runs one operation on both the
//! model and `Fs` (as the kernel would call it) and compares the answers.

pub mod meta;

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use lakecache_fuse::data_plane::{FaultyDataPlane, MemoryDataPlane};
use lakecache_fuse::{Fs, FsError, Kind, ROOT_INO};
use proptest::prelude::*;

/// The caller of creating operations in these tests.
const WHO: lakecache_fuse::Creator = lakecache_fuse::Creator {
    uid: 0,
    gid: 0,
    perm: 0o644,
};

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

#[derive(Debug, Clone)]
pub enum Op {
    Mkdir {
        dir: usize,
        name: usize,
    },
    /// `open(O_CREAT|O_WRONLY|O_TRUNC)`: a new writer handle.
    Create {
        dir: usize,
        name: usize,
    },
    Write {
        handle: usize,
        len: usize,
        seed: u8,
    },
    Flush {
        handle: usize,
    },
    Fsync {
        handle: usize,
    },
    Release {
        handle: usize,
    },
    /// Opens read-only, reads each `(offset, len)`, closes.
    Read {
        dir: usize,
        name: usize,
        reads: Vec<(u64, u64)>,
    },
    Lookup {
        dir: usize,
        name: usize,
    },
    Readdir {
        dir: usize,
    },
    Unlink {
        dir: usize,
        name: usize,
    },
    Rmdir {
        dir: usize,
        name: usize,
    },
    Rename {
        dir: usize,
        name: usize,
        to_dir: usize,
        to_name: usize,
    },
    /// `stat`: kind, size, mode, owner, and the mtime where set.
    Stat {
        dir: usize,
        name: usize,
    },
    Chmod {
        dir: usize,
        name: usize,
        mode: u32,
    },
    Chown {
        dir: usize,
        name: usize,
        uid: u32,
        gid: u32,
    },
    /// `utimens` of atime and mtime to `secs` after the epoch.
    Utimens {
        dir: usize,
        name: usize,
        secs: i64,
    },
    /// `truncate(path, size)`, up or down.
    Truncate {
        dir: usize,
        name: usize,
        size: u64,
    },
    Symlink {
        dir: usize,
        name: usize,
        target: usize,
    },
    Readlink {
        dir: usize,
        name: usize,
    },
    /// `open(O_RDONLY)`, kept open: a reader handle.
    OpenRead {
        dir: usize,
        name: usize,
    },
    /// `pread` through a reader handle.
    ReadHandle {
        handle: usize,
        offset: u64,
        len: u64,
    },
    CloseRead {
        handle: usize,
    },
    /// `op` runs with a fault in every data-plane call: slow, S3's 500,
    /// or the worker gone. It must do what the model says, or fail with
    /// EIO and change nothing.
    Faulty {
        fault: meta::Fault,
        op: Box<Op>,
    },
}

pub fn op() -> impl Strategy<Value = Op> {
    let plain = || prop_oneof![4 => core_op(), 3 => meta::op()];
    prop_oneof![
        6 => plain(),
        1 => (meta::fault(), plain()).prop_map(|(fault, op)| Op::Faulty {
            fault,
            op: Box::new(op),
        }),
    ]
}

fn core_op() -> impl Strategy<Value = Op> {
    let name = 0..NAMES.len();
    let dir = 0usize..8;
    let handle = 0usize..4;
    let reads = proptest::collection::vec((0u64..160, 1u64..80), 1..6);
    prop_oneof![
        2 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Mkdir { dir, name }),
        4 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Create { dir, name }),
        5 => (handle.clone(), 1usize..90, any::<u8>())
            .prop_map(|(handle, len, seed)| Op::Write { handle, len, seed }),
        2 => handle.clone().prop_map(|handle| Op::Flush { handle }),
        1 => handle.clone().prop_map(|handle| Op::Fsync { handle }),
        3 => handle.prop_map(|handle| Op::Release { handle }),
        4 => (dir.clone(), name.clone(), reads)
            .prop_map(|(dir, name, reads)| Op::Read { dir, name, reads }),
        2 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Lookup { dir, name }),
        2 => dir.clone().prop_map(|dir| Op::Readdir { dir }),
        2 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Unlink { dir, name }),
        1 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Rmdir { dir, name }),
        3 => (dir.clone(), name.clone(), dir, name).prop_map(|(dir, name, to_dir, to_name)| {
            Op::Rename { dir, name, to_dir, to_name }
        }),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum Entry {
    Dir,
    File {
        /// What S3 holds, if anything yet.
        stored: Option<Vec<u8>>,
        /// The writer that will replace it on commit.
        writer: Option<usize>,
    },
}

#[derive(Debug, Clone)]
struct Writer {
    id: usize,
    fh: u64,
    path: String,
    data: Vec<u8>,
    committed: bool,
    /// Its file was unlinked while open: nothing of it is stored.
    discarded: bool,
    /// Truncated up to this size while open: zeros follow the data.
    fill_to: u64,
}

#[derive(Debug, Default, Clone)]
struct Model {
    /// Paths relative to the mount root, without a trailing `/`.
    entries: BTreeMap<String, Entry>,
    writers: Vec<Writer>,
    next_writer: usize,
    attrs: BTreeMap<String, meta::Attr>,
    /// Entries that are symbolic links (stored as their target).
    links: BTreeSet<String>,
    readers: Vec<meta::Reader>,
}

/// What an operation answered: compared between model and `Fs`.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Done,
    Wrote(u32),
    Attr {
        dir: bool,
        size: u64,
    },
    Bytes(Vec<Vec<u8>>),
    Names(Vec<(String, bool)>),
    /// kind (0 file, 1 directory, 2 link), size, mode, owner, mtime.
    Stat {
        kind: u8,
        size: u64,
        perm: u32,
        uid: u32,
        gid: u32,
        mtime: Option<i64>,
    },
    Link(String),
}

type Outcome = Result<Answer, i32>;

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

fn parent_of(path: &str) -> &str {
    path.rsplit_once('/').map_or("", |(p, _)| p)
}

fn payload(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

impl Model {
    fn dirs(&self) -> Vec<String> {
        let mut dirs = vec![String::new()];
        dirs.extend(
            self.entries
                .iter()
                .filter(|(_, e)| **e == Entry::Dir)
                .map(|(p, _)| p.clone()),
        );
        dirs
    }

    fn children(&self, dir: &str) -> Vec<(String, bool)> {
        self.entries
            .iter()
            .filter(|(p, _)| parent_of(p) == dir && !p.is_empty())
            .map(|(p, e)| {
                let name = p.rsplit('/').next().unwrap_or(p).to_string();
                (name, *e == Entry::Dir)
            })
            .collect()
    }

    fn commit(&mut self, slot: usize) {
        let w = &mut self.writers[slot];
        if w.committed {
            return;
        }
        w.committed = true;
        if w.discarded {
            return;
        }
        match self.entries.get_mut(&w.path) {
            Some(Entry::File { stored, writer }) if *writer == Some(w.id) => {
                let mut data = std::mem::take(&mut w.data);
                if (data.len() as u64) < w.fill_to {
                    data.resize(w.fill_to as usize, 0);
                }
                *stored = Some(data);
                *writer = None;
            }
            other => panic!("model broken: writer {} commits onto {other:?}", w.path),
        }
    }

    fn size_of(&self, path: &str) -> u64 {
        match self.entries.get(path) {
            Some(Entry::File {
                writer: Some(id), ..
            }) => self
                .writers
                .iter()
                .find(|w| w.id == *id)
                .map_or(0, |w| (w.data.len() as u64).max(w.fill_to)),
            Some(Entry::File { stored, .. }) => stored.as_ref().map_or(0, |s| s.len() as u64),
            _ => 0,
        }
    }
}

/// Moves what the model keeps beside entries (attributes, link marks)
/// from `src` (and below it) to `dst`.
fn move_beside(model: &mut Model, src: &str, dst: &str) {
    let under = format!("{src}/");
    let moved: Vec<String> = model
        .attrs
        .keys()
        .chain(model.links.iter())
        .filter(|p| *p == src || p.starts_with(&under))
        .cloned()
        .collect();
    let mut attrs = Vec::new();
    let mut links = Vec::new();
    for p in moved {
        let to = format!("{dst}{}", &p[src.len()..]);
        if let Some(a) = model.attrs.remove(&p) {
            attrs.push((to.clone(), a));
        }
        if model.links.remove(&p) {
            links.push(to);
        }
    }
    // What the destination held goes (a rename replaces it): its readers
    // keep what they had; the source's readers follow it.
    model.attrs.remove(dst);
    model.links.remove(dst);
    for r in &mut model.readers {
        let Some(p) = r.path.clone() else { continue };
        if p == dst {
            r.path = None;
        } else if p == src || p.starts_with(&under) {
            r.path = Some(format!("{dst}{}", &p[src.len()..]));
        }
    }
    model.attrs.extend(attrs);
    model.links.extend(links);
}

impl Model {
    /// What an `open(O_RDONLY)` of `path` would read, or its errno.
    fn readable(&self, path: &str) -> Result<Vec<u8>, i32> {
        match self.entries.get(path) {
            None => Err(libc::ENOENT),
            Some(Entry::Dir) => Err(libc::EISDIR),
            Some(Entry::File {
                writer: Some(_), ..
            }) => Err(libc::EBUSY),
            Some(Entry::File { stored, .. }) => Ok(stored.clone().unwrap_or_default()),
        }
    }
}

/// `len` bytes of `content` at `off`, as a read returns them.
fn slice(content: &[u8], off: u64, len: u64) -> Vec<u8> {
    let start = (off as usize).min(content.len());
    let end = ((off + len) as usize).min(content.len()).max(start);
    content[start..end].to_vec()
}

/// LOOKUP then OPEN(O_RDONLY), as the kernel does it: the handle.
async fn open_for_read(fs: &Fs, parent: &str, name: &str, pid: u32) -> Result<u64, i32> {
    let p = walk(fs, parent).await?;
    let node = fs.lookup(p, name).await.map_err(errno)?;
    if node.kind == Kind::Dir {
        return Err(libc::EISDIR);
    }
    fs.open(node.ino, libc::O_RDONLY, pid)
        .await
        .map(|(fh, _)| fh)
        .map_err(errno)
}

fn errno(e: FsError) -> i32 {
    e.errno()
}

/// Resolves a path the way the kernel walks it: one LOOKUP per name.
async fn walk(fs: &Fs, path: &str) -> Result<u64, i32> {
    let mut ino = ROOT_INO;
    for name in path.split('/').filter(|n| !n.is_empty()) {
        ino = fs.lookup(ino, name).await.map_err(errno)?.ino;
    }
    Ok(ino)
}

/// Runs one operation on the model and on `fs`: what each answered, or
/// None where the operation does not apply (as the kernel would not send it).
async fn one(fs: &Fs, model: &mut Model, op: &Op, pid: u32) -> Option<(Outcome, Outcome)> {
    let dirs = model.dirs();
    let pick = |i: usize| dirs[i % dirs.len()].clone();
    let (expected, actual): (Outcome, Outcome) = match op {
        Op::Mkdir { dir, name } => {
            let (parent, name) = (pick(*dir), NAMES[*name]);
            let path = join(&parent, name);
            let expected = match model.entries.entry(path) {
                std::collections::btree_map::Entry::Occupied(_) => Err(libc::EEXIST),
                std::collections::btree_map::Entry::Vacant(v) => {
                    let path = v.key().clone();
                    v.insert(Entry::Dir);
                    model.attrs.insert(path, meta::Attr::new(WHO.perm));
                    Ok(Answer::Done)
                }
            };
            let actual = async {
                let p = walk(fs, &parent).await?;
                fs.mkdir(p, name, WHO).await.map_err(errno)?;
                Ok(Answer::Done)
            }
            .await;
            (expected, actual)
        }
        Op::Create { dir, name } => {
            let (parent, name) = (pick(*dir), NAMES[*name]);
            let path = join(&parent, name);
            if model.links.contains(&path) {
                // The kernel opens what the link points at.
                return None;
            }
            if model
                .readers
                .iter()
                .any(|r| r.path.as_deref() == Some(path.as_str()))
            {
                // O_TRUNC of a file open for reading: not modelled (the
                // reader would see the file emptied, then rewritten).
                return None;
            }
            let id = model.next_writer;
            let expected = match model.entries.get_mut(&path) {
                Some(Entry::Dir) => Err(libc::EISDIR),
                Some(Entry::File {
                    writer: Some(_), ..
                }) => Err(libc::EBUSY),
                Some(Entry::File { writer, .. }) => {
                    *writer = Some(id);
                    if let Some(a) = model.attrs.get_mut(&path) {
                        a.mtime = None;
                    }
                    Ok(Answer::Done)
                }
                None => {
                    model.entries.insert(
                        path.clone(),
                        Entry::File {
                            stored: None,
                            writer: Some(id),
                        },
                    );
                    model.attrs.insert(path.clone(), meta::Attr::new(WHO.perm));
                    Ok(Answer::Done)
                }
            };
            // As the kernel does it: LOOKUP, then OPEN(O_TRUNC) or CREATE.
            let actual: Result<u64, i32> = async {
                let p = walk(fs, &parent).await?;
                match fs.lookup(p, name).await {
                    Ok(node) if node.kind == Kind::Dir => Err(libc::EISDIR),
                    Ok(node) => fs
                        .open(node.ino, libc::O_WRONLY | libc::O_TRUNC, pid)
                        .await
                        .map(|(fh, _)| fh)
                        .map_err(errno),
                    Err(FsError::NotFound) => fs
                        .create(p, name, pid, WHO, libc::O_WRONLY)
                        .await
                        .map(|(_, fh)| fh)
                        .map_err(errno),
                    Err(e) => Err(errno(e)),
                }
            }
            .await;
            if let (Ok(_), Ok(fh)) = (&expected, &actual) {
                model.next_writer += 1;
                model.writers.push(Writer {
                    id,
                    fh: *fh,
                    path,
                    data: Vec::new(),
                    committed: false,
                    discarded: false,
                    fill_to: 0,
                });
            }
            (expected, actual.map(|_| Answer::Done))
        }
        Op::Write { handle, len, seed } => {
            if model.writers.is_empty() {
                return None;
            }
            let slot = handle % model.writers.len();
            let bytes = payload(*len, *seed);
            let w = &mut model.writers[slot];
            let offset = w.data.len() as u64;
            let fh = w.fh;
            let expected = if w.committed {
                Err(libc::EPERM)
            } else {
                w.data.extend_from_slice(&bytes);
                Ok(Answer::Wrote(*len as u32))
            };
            if expected.is_ok() && !w.discarded {
                let path = w.path.clone();
                if let Some(a) = model.attrs.get_mut(&path) {
                    a.mtime = None;
                }
            } else if expected.is_err() {
                // A write refused through a committed handle (EPERM) may
                // still stamp the mtime of the file it was renamed to,
                // which the model does not follow: times are unknown
                // from here (a gap, noted).
                for a in model.attrs.values_mut() {
                    a.mtime = None;
                }
            }
            let actual = fs
                .write(fh, offset, Bytes::from(bytes))
                .await
                .map(Answer::Wrote)
                .map_err(errno);
            (expected, actual)
        }
        Op::Flush { handle } | Op::Fsync { handle } | Op::Release { handle } => {
            if model.writers.is_empty() {
                return None;
            }
            let slot = handle % model.writers.len();
            let fh = model.writers[slot].fh;
            let actual = match op {
                Op::Flush { .. } => fs.flush(fh, pid).await,
                Op::Fsync { .. } => fs.fsync(fh).await,
                _ => fs.release(fh).await,
            };
            // A flush before any data is not the end of the file.
            let empty_flush = matches!(op, Op::Flush { .. }) && model.writers[slot].data.is_empty();
            if !empty_flush {
                model.commit(slot);
            }
            if matches!(op, Op::Release { .. }) {
                model.writers.remove(slot);
            }
            (
                Ok(Answer::Done),
                actual.map(|_| Answer::Done).map_err(errno),
            )
        }
        Op::Read { dir, name, reads } => {
            let (parent, name) = (pick(*dir), NAMES[*name]);
            let path = join(&parent, name);
            if model.links.contains(&path) {
                return None;
            }
            let expected = model.readable(&path).map(|content| {
                Answer::Bytes(
                    reads
                        .iter()
                        .map(|&(off, len)| slice(&content, off, len))
                        .collect(),
                )
            });
            let actual = async {
                let fh = open_for_read(fs, &parent, name, pid).await?;
                let mut got = Vec::new();
                let mut failed = None;
                for &(off, len) in reads {
                    match fs.read(fh, off, len as u32).await {
                        Ok(b) => got.push(b.to_vec()),
                        Err(e) => {
                            failed = Some(errno(e));
                            break;
                        }
                    }
                }
                fs.release(fh).await.map_err(errno)?;
                match failed {
                    Some(e) => Err(e),
                    None => Ok(Answer::Bytes(got)),
                }
            }
            .await;
            (expected, actual)
        }
        Op::Lookup { dir, name } => {
            let (parent, name) = (pick(*dir), NAMES[*name]);
            let path = join(&parent, name);
            let expected = match model.entries.get(&path) {
                None => Err(libc::ENOENT),
                Some(e) => Ok(Answer::Attr {
                    dir: *e == Entry::Dir,
                    size: model.size_of(&path),
                }),
            };
            let actual = async {
                let p = walk(fs, &parent).await?;
                let node = fs.lookup(p, name).await.map_err(errno)?;
                Ok(Answer::Attr {
                    dir: node.kind == Kind::Dir,
                    size: node.meta.size,
                })
            }
            .await;
            (expected, actual)
        }
        Op::Readdir { dir } => {
            let parent = pick(*dir);
            let expected = Ok(Answer::Names(model.children(&parent)));
            let actual = async {
                let p = walk(fs, &parent).await?;
                let entries = fs.list_dir(p).await.map_err(errno)?;
                let mut names: Vec<(String, bool)> = entries
                    .into_iter()
                    .filter(|e| e.name != "." && e.name != "..")
                    .map(|e| (e.name, e.node.kind == Kind::Dir))
                    .collect();
                names.sort();
                Ok(Answer::Names(names))
            }
            .await;
            (expected, actual)
        }
        Op::Unlink { dir, name } | Op::Rmdir { dir, name } => {
            let (parent, name) = (pick(*dir), NAMES[*name]);
            let path = join(&parent, name);
            let rmdir = matches!(op, Op::Rmdir { .. });
            let expected = match (model.entries.get(&path), rmdir) {
                (None, _) => Err(libc::ENOENT),
                (Some(Entry::Dir), false) => Err(libc::EISDIR),
                (Some(Entry::File { .. }), true) => Err(libc::ENOTDIR),
                // Unlinked while being written: the name goes, the
                // writer's data is never stored (POSIX unlink).
                (
                    Some(Entry::File {
                        writer: Some(id), ..
                    }),
                    false,
                ) => {
                    let id = *id;
                    model.entries.remove(&path);
                    model.attrs.remove(&path);
                    if let Some(w) = model.writers.iter_mut().find(|w| w.id == id) {
                        w.discarded = true;
                    }
                    Ok(Answer::Done)
                }
                (Some(Entry::Dir), true) if !model.children(&path).is_empty() => {
                    Err(libc::ENOTEMPTY)
                }
                _ => {
                    model.entries.remove(&path);
                    model.attrs.remove(&path);
                    model.links.remove(&path);
                    for r in &mut model.readers {
                        if r.path.as_deref() == Some(path.as_str()) {
                            r.path = None;
                        }
                    }
                    Ok(Answer::Done)
                }
            };
            let actual = async {
                let p = walk(fs, &parent).await?;
                if rmdir {
                    fs.rmdir(p, name).await.map_err(errno)?;
                } else {
                    fs.unlink(p, name).await.map_err(errno)?;
                }
                Ok(Answer::Done)
            }
            .await;
            (expected, actual)
        }
        Op::Rename {
            dir,
            name,
            to_dir,
            to_name,
        } => {
            let (from_dir, to_dir) = (pick(*dir), pick(*to_dir));
            let (name, to_name) = (NAMES[*name], NAMES[*to_name]);
            let (src, dst) = (join(&from_dir, name), join(&to_dir, to_name));
            // The kernel refuses moving a directory into itself before
            // the filesystem hears of it, and a rename onto itself is a
            // no-op there too.
            if dst.starts_with(&format!("{src}/")) || src == dst {
                return None;
            }
            let expected = model_rename(model, &src, &dst);
            let actual = async {
                let p = walk(fs, &from_dir).await?;
                let q = walk(fs, &to_dir).await?;
                fs.rename(p, name, q, to_name, false, pid)
                    .await
                    .map_err(errno)?;
                Ok(Answer::Done)
            }
            .await;
            (expected, actual)
        }
        _ => return meta::step(fs, model, op, pick(op_dir(op)), pid).await,
    };
    Some((expected, actual))
}

/// The directory index an operation names (0 where it names none).
fn op_dir(op: &Op) -> usize {
    match op {
        Op::Stat { dir, .. }
        | Op::Chmod { dir, .. }
        | Op::Chown { dir, .. }
        | Op::Utimens { dir, .. }
        | Op::Truncate { dir, .. }
        | Op::Symlink { dir, .. }
        | Op::Readlink { dir, .. }
        | Op::OpenRead { dir, .. } => *dir,
        _ => 0,
    }
}

/// Runs `ops` on `fs` and the model; the first disagreement is an error
/// naming the step. Ends by checking the store holds what the model says.
pub async fn run_case(
    fs: &Fs,
    data: &FaultyDataPlane<MemoryDataPlane>,
    bucket: &str,
    prefix: &str,
    ops: &[Op],
) -> Result<(), String> {
    let mut model = Model::default();
    let pid = std::process::id();
    for (step, op) in ops.iter().enumerate() {
        let (expected, actual) = match op {
            Op::Faulty { fault, op: inner } => {
                // A handle's writes and closes are not retried by the
                // kernel: their faults are the upload tests' business.
                let handle_op = matches!(
                    **inner,
                    Op::Write { .. }
                        | Op::Flush { .. }
                        | Op::Fsync { .. }
                        | Op::Release { .. }
                        | Op::CloseRead { .. }
                );
                // A rename commits a file still being written; a commit
                // that fails leaves the upload failed, which the close
                // then reports (EIO): not "nothing changed".
                let commits = match &**inner {
                    Op::Rename { dir, name, .. } => {
                        let dirs = model.dirs();
                        let src = join(&dirs[dir % dirs.len()], NAMES[*name]);
                        matches!(
                            model.entries.get(&src),
                            Some(Entry::File {
                                writer: Some(_),
                                ..
                            })
                        )
                    }
                    _ => false,
                };
                let before = model.clone();
                if !handle_op && !commits {
                    meta::inject(data, *fault);
                }
                let answered = one(fs, &mut model, inner, pid).await;
                data.heal();
                let Some((expected, actual)) = answered else {
                    continue;
                };
                let failed_cleanly = !matches!(fault, meta::Fault::Slow)
                    && expected != actual
                    && meta::is_fault_errno(&actual);
                if failed_cleanly {
                    model = before;
                    continue;
                }
                (expected, actual)
            }
            _ => match one(fs, &mut model, op, pid).await {
                Some(answers) => answers,
                None => continue,
            },
        };
        if expected != actual {
            return Err(format!(
                "step {step} {op:?}: model says {expected:?}, fs says {actual:?}\nmodel: {:?}",
                model.entries
            ));
        }
    }
    // Close what is still open, then the store must hold the model.
    while !model.writers.is_empty() {
        let fh = model.writers[0].fh;
        fs.release(fh)
            .await
            .map_err(|e| format!("final release: {e}"))?;
        model.commit(0);
        model.writers.remove(0);
    }
    for r in std::mem::take(&mut model.readers) {
        fs.release(r.fh)
            .await
            .map_err(|e| format!("final release of a reader: {e}"))?;
    }
    let data = data.inner();
    let mut want: Vec<(String, Vec<u8>)> = model
        .entries
        .iter()
        .map(|(path, e)| match e {
            Entry::Dir => (format!("{prefix}{path}/"), Vec::new()),
            Entry::File { stored, .. } => (
                format!("{prefix}{path}"),
                stored.clone().unwrap_or_default(),
            ),
        })
        .collect();
    want.sort();
    let got: Vec<(String, Vec<u8>)> = data
        .keys(bucket)
        .into_iter()
        .map(|k| {
            let v = data.get(bucket, &k).unwrap_or_default().to_vec();
            (k, v)
        })
        .collect();
    if want != got {
        return Err(format!(
            "store differs from the model after {} ops:\nmodel: {want:?}\nstore: {got:?}",
            ops.len()
        ));
    }
    Ok(())
}

fn model_rename(model: &mut Model, src: &str, dst: &str) -> Outcome {
    let Some(from) = model.entries.get(src).cloned() else {
        return Err(libc::ENOENT);
    };
    let to = model.entries.get(dst).cloned();
    match from {
        Entry::File { writer, .. } => {
            match to {
                Some(Entry::Dir) => return Err(libc::EISDIR),
                // Its writer would later overwrite what was moved there.
                Some(Entry::File {
                    writer: Some(_), ..
                }) => return Err(libc::EBUSY),
                _ => {}
            }
            // A file still being written is committed, then moved.
            if let Some(id) = writer {
                let slot = model
                    .writers
                    .iter()
                    .position(|w| w.id == id)
                    .expect("model: writer of an open file");
                model.commit(slot);
            }
            let moved = model.entries.remove(src).expect("model: source exists");
            model.entries.insert(dst.to_string(), moved);
            move_beside(model, src, dst);
        }
        Entry::Dir => {
            match to {
                Some(Entry::File { .. }) => return Err(libc::ENOTDIR),
                Some(Entry::Dir) if !model.children(dst).is_empty() => return Err(libc::ENOTEMPTY),
                _ => {}
            }
            // A tree moves whole (object by object), unless a file in it
            // is being written.
            let under = format!("{src}/");
            let inside: Vec<String> = model
                .entries
                .keys()
                .filter(|p| p.starts_with(&under))
                .cloned()
                .collect();
            let writing = inside.iter().any(|p| {
                matches!(
                    model.entries.get(p),
                    Some(Entry::File {
                        writer: Some(_),
                        ..
                    })
                )
            });
            if writing {
                return Err(libc::EBUSY);
            }
            if let Some(Entry::Dir) = to {
                model.entries.remove(dst);
            }
            for path in inside {
                let entry = model.entries.remove(&path).expect("model: listed above");
                model
                    .entries
                    .insert(format!("{dst}/{}", &path[under.len()..]), entry);
            }
            model.entries.remove(src);
            model.entries.insert(dst.to_string(), Entry::Dir);
            move_beside(model, src, dst);
        }
    }
    Ok(Answer::Done)
}
