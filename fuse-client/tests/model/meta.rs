//! The model's metadata, link, reader-handle and fault operations:
//! setattr (mode, owner, times, size up and down), symlink and readlink,
//! files open for reading while unlinked or renamed, and operations run
//! over a faulty data plane.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lakecache_fuse::data_plane::{DataError, DataFault, DataOp, FaultyDataPlane, MemoryDataPlane};
use lakecache_fuse::{Fs, Kind, SetAttr};
use proptest::prelude::*;

use super::{errno, join, open_for_read, slice, walk, Answer, Entry, Model, Op, Outcome, NAMES};

/// Targets symlinks point at (never followed by these operations).
const TARGETS: [&str; 3] = ["a", "../b/c", "/etc/hostname"];

/// Attributes the model knows of an entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Attr {
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    /// Set by utimens and unchanged since; None where a write or a
    /// truncate made it "now".
    pub mtime: Option<i64>,
}

impl Attr {
    pub fn new(perm: u32) -> Self {
        Self {
            perm,
            uid: 0,
            gid: 0,
            mtime: None,
        }
    }
}

/// A handle open for reading and what it opened.
#[derive(Debug, Clone)]
pub struct Reader {
    pub fh: u64,
    pub content: Vec<u8>,
    /// The name of the file it reads, until it is unlinked or replaced: a
    /// truncate through the name changes what the reader sees.
    pub path: Option<String>,
}

#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Every call of the data plane waits first.
    Slow,
    /// Every call fails as S3's 500 does behind the workers.
    S3Error,
    /// Every call fails as a worker that went away does.
    WorkerGone,
}

pub fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        Just(Fault::Slow),
        Just(Fault::S3Error),
        Just(Fault::WorkerGone)
    ]
}

pub fn op() -> impl Strategy<Value = Op> {
    let name = 0..NAMES.len();
    let dir = 0usize..8;
    let handle = 0usize..3;
    prop_oneof![
        3 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Stat { dir, name }),
        1 => (dir.clone(), name.clone(), prop_oneof![Just(0o600u32), Just(0o755), Just(0o4711), Just(0)])
            .prop_map(|(dir, name, mode)| Op::Chmod { dir, name, mode }),
        1 => (dir.clone(), name.clone(), prop_oneof![Just(0u32), Just(1000)], prop_oneof![Just(0u32), Just(1000)])
            .prop_map(|(dir, name, uid, gid)| Op::Chown { dir, name, uid, gid }),
        1 => (dir.clone(), name.clone(), prop_oneof![Just(1_000_000_000i64), Just(1_700_000_000)])
            .prop_map(|(dir, name, secs)| Op::Utimens { dir, name, secs }),
        2 => (dir.clone(), name.clone(), 0u64..200)
            .prop_map(|(dir, name, size)| Op::Truncate { dir, name, size }),
        1 => (dir.clone(), name.clone(), 0..TARGETS.len())
            .prop_map(|(dir, name, target)| Op::Symlink { dir, name, target }),
        1 => (dir.clone(), name.clone()).prop_map(|(dir, name)| Op::Readlink { dir, name }),
        2 => (dir, name).prop_map(|(dir, name)| Op::OpenRead { dir, name }),
        3 => (handle.clone(), 0u64..160, 1u64..80)
            .prop_map(|(handle, offset, len)| Op::ReadHandle { handle, offset, len }),
        1 => handle.prop_map(|handle| Op::CloseRead { handle }),
    ]
}

/// Injects `fault` into every call of the data plane until healed.
pub fn inject(data: &FaultyDataPlane<MemoryDataPlane>, fault: Fault) {
    let f = match fault {
        Fault::Slow => DataFault::Delay(Duration::from_millis(1)),
        Fault::S3Error => DataFault::Fail(DataError::StoreUnavailable(
            "S3 answered 500 InternalError".into(),
        )),
        Fault::WorkerGone => DataFault::Fail(DataError::backend(
            "the worker went away",
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        )),
    };
    for op in [
        DataOp::Stat,
        DataOp::Read,
        DataOp::List,
        DataOp::Put,
        DataOp::Upload,
        DataOp::Delete,
        DataOp::Copy,
    ] {
        data.inject(op, 0, u64::MAX, f.clone());
    }
}

fn secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A path as the kernel resolves it for a call that follows links:
/// `None` where it names a link (these tests do not follow them).
fn unless_link(model: &Model, path: &str) -> Option<()> {
    (!model.links.contains(path)).then_some(())
}

async fn setattr_at(fs: &Fs, parent: &str, name: &str, change: SetAttr) -> Outcome {
    let p = walk(fs, parent).await?;
    let node = fs.lookup(p, name).await.map_err(errno)?;
    fs.setattr(node.ino, change).await.map_err(errno)?;
    Ok(Answer::Done)
}

fn no_change() -> SetAttr {
    SetAttr {
        mode: None,
        uid: None,
        gid: None,
        size: None,
        atime: None,
        mtime: None,
        fh: None,
    }
}

/// Runs one of this module's operations; None where it is skipped.
pub(super) async fn step(
    fs: &Fs,
    model: &mut Model,
    op: &Op,
    parent: String,
    pid: u32,
) -> Option<(Outcome, Outcome)> {
    let named = |name: &usize| NAMES[*name];
    Some(match op {
        Op::Stat { name, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            let expected = match model.entries.get(&path) {
                None => Err(libc::ENOENT),
                Some(e) => {
                    let a = model.attrs.get(&path).cloned().unwrap_or(Attr::new(0o644));
                    let kind = if *e == Entry::Dir {
                        1
                    } else if model.links.contains(&path) {
                        2
                    } else {
                        0
                    };
                    Ok(Answer::Stat {
                        kind,
                        size: if kind == 1 { 0 } else { model.size_of(&path) },
                        perm: a.perm,
                        uid: a.uid,
                        gid: a.gid,
                        mtime: a.mtime,
                    })
                }
            };
            let want_mtime = matches!(&expected, Ok(Answer::Stat { mtime: Some(_), .. }));
            let actual = async {
                let p = walk(fs, &parent).await?;
                let node = fs.lookup(p, name).await.map_err(errno)?;
                let attrs = fs.attrs(&node);
                let kind = match attrs.kind {
                    lakecache_fuse::posix::FileType::Directory => 1,
                    lakecache_fuse::posix::FileType::Symlink => 2,
                    _ => 0,
                };
                Ok(Answer::Stat {
                    kind,
                    size: if node.kind == Kind::Dir {
                        0
                    } else {
                        node.meta.size
                    },
                    perm: attrs.perm,
                    uid: attrs.uid,
                    gid: attrs.gid,
                    mtime: want_mtime.then(|| secs(attrs.mtime)),
                })
            }
            .await;
            (expected, actual)
        }
        Op::Chmod { name, mode, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            unless_link(model, &path)?;
            let expected = if model.entries.contains_key(&path) {
                model.attrs.entry(path).or_insert(Attr::new(0o644)).perm = *mode;
                Ok(Answer::Done)
            } else {
                Err(libc::ENOENT)
            };
            let change = SetAttr {
                mode: Some(*mode),
                ..no_change()
            };
            (expected, setattr_at(fs, &parent, name, change).await)
        }
        Op::Chown { name, uid, gid, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            unless_link(model, &path)?;
            let expected = if model.entries.contains_key(&path) {
                let a = model.attrs.entry(path).or_insert(Attr::new(0o644));
                (a.uid, a.gid) = (*uid, *gid);
                Ok(Answer::Done)
            } else {
                Err(libc::ENOENT)
            };
            let change = SetAttr {
                uid: Some(*uid),
                gid: Some(*gid),
                ..no_change()
            };
            (expected, setattr_at(fs, &parent, name, change).await)
        }
        Op::Utimens { name, secs: at, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            unless_link(model, &path)?;
            let expected = if model.entries.contains_key(&path) {
                model.attrs.entry(path).or_insert(Attr::new(0o644)).mtime = Some(*at);
                Ok(Answer::Done)
            } else {
                Err(libc::ENOENT)
            };
            let t = UNIX_EPOCH + Duration::from_secs(*at as u64);
            let change = SetAttr {
                atime: Some(t),
                mtime: Some(t),
                ..no_change()
            };
            (expected, setattr_at(fs, &parent, name, change).await)
        }
        Op::Truncate { name, size, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            unless_link(model, &path)?;
            let expected = model.truncate(&path, *size);
            let change = SetAttr {
                size: Some(*size),
                ..no_change()
            };
            (expected, setattr_at(fs, &parent, name, change).await)
        }
        Op::Symlink { name, target, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            let target = TARGETS[*target];
            let expected = if model.entries.contains_key(&path) {
                Err(libc::EEXIST)
            } else {
                model.entries.insert(
                    path.clone(),
                    Entry::File {
                        stored: Some(target.as_bytes().to_vec()),
                        writer: None,
                    },
                );
                model.links.insert(path.clone());
                model.attrs.insert(path, Attr::new(0o777));
                Ok(Answer::Done)
            };
            let actual = async {
                let p = walk(fs, &parent).await?;
                fs.symlink(p, name, target, super::WHO)
                    .await
                    .map_err(errno)?;
                Ok(Answer::Done)
            }
            .await;
            (expected, actual)
        }
        Op::Readlink { name, .. } => {
            let name = named(name);
            let path = join(&parent, name);
            let expected = match model.entries.get(&path) {
                None => Err(libc::ENOENT),
                Some(Entry::File {
                    stored: Some(t), ..
                }) if model.links.contains(&path) => {
                    Ok(Answer::Link(String::from_utf8_lossy(t).into_owned()))
                }
                Some(_) => Err(libc::EINVAL),
            };
            let actual = async {
                let p = walk(fs, &parent).await?;
                let node = fs.lookup(p, name).await.map_err(errno)?;
                fs.readlink(node.ino).await.map(Answer::Link).map_err(errno)
            }
            .await;
            (expected, actual)
        }
        Op::OpenRead { name, .. } => {
            if model.readers.len() >= 3 {
                return None;
            }
            let name = named(name);
            let path = join(&parent, name);
            unless_link(model, &path)?;
            let expected = model.readable(&path);
            let actual = open_for_read(fs, &parent, name, pid).await;
            if let (Ok(content), Ok(fh)) = (&expected, &actual) {
                model.readers.push(Reader {
                    fh: *fh,
                    content: content.clone(),
                    path: Some(path.clone()),
                });
            } else if let Ok(fh) = actual {
                // Opened where the model says it cannot be: close it.
                let _ = fs.release(fh).await;
            }
            (expected.map(|_| Answer::Done), actual.map(|_| Answer::Done))
        }
        Op::ReadHandle {
            handle,
            offset,
            len,
        } => {
            if model.readers.is_empty() {
                return None;
            }
            let r = &model.readers[handle % model.readers.len()];
            let expected = Ok(Answer::Bytes(vec![slice(&r.content, *offset, *len)]));
            let actual = fs
                .read(r.fh, *offset, *len as u32)
                .await
                .map(|b| Answer::Bytes(vec![b.to_vec()]))
                .map_err(errno);
            (expected, actual)
        }
        Op::CloseRead { handle } => {
            if model.readers.is_empty() {
                return None;
            }
            let r = model.readers.remove(handle % model.readers.len());
            let actual = fs.release(r.fh).await.map(|()| Answer::Done).map_err(errno);
            (Ok(Answer::Done), actual)
        }
        _ => return None,
    })
}

impl Model {
    /// `truncate(path, size)` as POSIX says, with the mount's one limit:
    /// a file still being written cannot shrink below what was written.
    fn truncate(&mut self, path: &str, size: u64) -> Outcome {
        let writer = match self.entries.get_mut(path) {
            None => return Err(libc::ENOENT),
            Some(Entry::Dir) => return Err(libc::EISDIR),
            Some(Entry::File {
                writer: Some(id), ..
            }) => Some(*id),
            Some(Entry::File { stored, .. }) => {
                let mut content = stored.take().unwrap_or_default();
                content.resize(size as usize, 0);
                // Readers of the file see it too: it is the same file.
                for r in &mut self.readers {
                    if r.path.as_deref() == Some(path) {
                        r.content = content.clone();
                    }
                }
                *stored = Some(content);
                None
            }
        };
        if let Some(id) = writer {
            let w = self
                .writers
                .iter_mut()
                .find(|w| w.id == id)
                .expect("model: writer of an open file");
            if size < w.data.len() as u64 {
                return Err(libc::EOPNOTSUPP);
            }
            w.fill_to = size;
        }
        if let Some(a) = self.attrs.get_mut(path) {
            a.mtime = None;
        }
        Ok(Answer::Done)
    }
}

/// Whether `actual` is a data-plane failure an operation may answer
/// under an injected fault.
pub(super) fn is_fault_errno(actual: &Outcome) -> bool {
    matches!(actual, Err(e) if *e == libc::EIO)
}
