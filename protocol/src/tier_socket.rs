//! Other readers on a node share the mount's node-local tier through the
//! mount: the tier has one owner (the mount holds its `LOCK`), so a
//! second process never fills or evicts it. The mount listens on a Unix
//! socket in the tier's directory ([`TIER_SOCKET_NAME`], mode 0600, its
//! own user or root only); a reader asks it for a range of an object's
//! version:
//!
//! - the tier holds the version whole and checked: the answer is
//!   [`TierAnswer::File`] with a read-only descriptor of the tier's file,
//!   which the reader keeps and reads itself from then on (as the kernel
//!   does for a FUSE passthrough open);
//! - otherwise the mount reads the range as its own FUSE reads do (tier
//!   first, then the workers, filling the tier and completing it whole
//!   by the same rules) and sends the bytes inline ([`TierAnswer::Inline`]).
//!
//! So an object read by both a Python loader and the mount is fetched
//! from the workers once. Wire format as in [`crate::local_read`]: a
//! 4-byte little-endian length, then JSON; a descriptor rides on the
//! answer's first byte; inline bytes follow their answer.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::local_read::{recv_message, send_message};

/// Version of this socket's protocol; the mount answers `hello` with it.
pub const TIER_PROTOCOL: u32 = 1;

/// The socket's name inside the tier directory (`--local-cache`).
pub const TIER_SOCKET_NAME: &str = "clients.sock";

/// One inline answer carries at most this much; a longer read is asked
/// for in parts.
pub const MAX_TIER_INLINE: u64 = 16 << 20;

/// A request is at most this long (a plan's is the long one).
pub const MAX_TIER_MESSAGE: usize = 16 << 20;

/// A plan sent to the mount lists at most this many entries: the first
/// ones of the epoch (the mount's prefetch looks a few seconds ahead).
pub const MAX_TIER_PLAN_ENTRIES: usize = 1 << 18;

/// How long one call may take before the reader gives up on the mount.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// After the socket fails, reads go to the workers this long before it
/// is tried again (a mount restarting).
const BACKOFF: Duration = Duration::from_secs(5);

/// Tier files a reader keeps open (each an object it was handed whole).
const MAX_FILES: usize = 256;

const MAX_IDLE: usize = 16;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TierRequest {
    Hello,
    /// Bytes `offset..offset + len` of `uri` at version `etag`.
    Read {
        uri: String,
        etag: String,
        offset: u64,
        len: u64,
    },
    /// This rank's reads for the coming epoch, in order, for the mount's
    /// tier to fetch ahead of (`order`: `[object, start, end]`, `object`
    /// an index into `objects`). Replaces an earlier plan of that name.
    Plan {
        name: String,
        ttl_s: u64,
        objects: Vec<String>,
        order: Vec<(u32, u64, u64)>,
    },
    /// The reader is at `offset` of `uri` (it reads a file it was handed,
    /// which the mount does not see): where a plan's reader is.
    Note {
        uri: String,
        offset: u64,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TierAnswer {
    /// The mount's protocol, and the bucket and key prefix it serves.
    Hello {
        protocol: u32,
        bucket: String,
        prefix: String,
    },
    /// The whole version, `size` bytes, is in the descriptor that rides
    /// on this answer; read it directly from now on.
    File {
        size: u64,
    },
    /// `len` bytes from the requested offset follow this answer.
    Inline {
        len: u64,
    },
    /// Not served here (outside the mount's bucket, no tier room, ...):
    /// read from the workers.
    Unavailable {
        reason: String,
    },
    /// A definite answer about the object, as the workers would give it.
    Error {
        kind: TierErrorKind,
        message: String,
    },
    /// A plan was taken: `entries` of it.
    PlanTaken {
        entries: usize,
    },
    Noted,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TierErrorKind {
    NotFound,
    /// The object is no longer the version asked for.
    Changed,
    InvalidRange,
    BadRequest,
}

#[derive(Debug, thiserror::Error)]
pub enum TierClientError {
    #[error("node-local tier socket {path}: {source} (is a lakecache mount with --local-cache {dir} running, as this user or root?)", dir = path.parent().map(|p| p.display().to_string()).unwrap_or_default())]
    Connect { path: PathBuf, source: io::Error },
    #[error("node-local tier socket {path}: {why}")]
    Protocol { path: PathBuf, why: String },
    #[error("the mount answered {kind:?}: {message}")]
    Refused {
        kind: TierErrorKind,
        message: String,
    },
}

/// What a read through the tier did.
#[derive(Debug, PartialEq, Eq)]
pub enum TierRead {
    /// The whole range is in the caller's buffer.
    Done,
    /// The mount could not serve it (the reason is given): read it from
    /// the workers.
    Unavailable(String),
}

/// Bytes a [`TierChannel`] served, by path.
#[derive(Debug, Default)]
pub struct TierStats {
    /// Read by the reader itself from tier files it was handed.
    pub file_bytes: AtomicU64,
    /// Sent by the mount (its tier, or the workers through it).
    pub inline_bytes: AtomicU64,
    /// Reads the mount could not serve (the caller went to the workers).
    pub unavailable: AtomicU64,
}

/// A reader's end of the tier socket: blocking calls, pooled
/// connections, and the tier files it was handed, by version.
pub struct TierChannel {
    path: PathBuf,
    /// Idle connections, with the process that opened them: a forked
    /// child (a DataLoader worker) must not share its parent's.
    idle: Mutex<(u32, Vec<UnixStream>)>,
    files: Mutex<VecDeque<HeldFile>>,
    down_until: Mutex<Option<Instant>>,
    stats: Arc<TierStats>,
    /// What the mount serves, from its hello.
    bucket: String,
    prefix: String,
    /// A plan was sent: reads of held files are noted to the mount
    /// (the object last noted, so each is noted once per switch).
    planned: std::sync::atomic::AtomicBool,
    last_noted: Mutex<String>,
}

struct HeldFile {
    uri: String,
    etag: String,
    size: u64,
    file: Arc<File>,
}

impl TierChannel {
    /// Connects to the mount serving the tier at `dir` and checks that it
    /// speaks this protocol.
    pub fn connect(dir: &Path) -> Result<Self, TierClientError> {
        let mut channel = Self {
            path: dir.join(TIER_SOCKET_NAME),
            idle: Mutex::new((std::process::id(), Vec::new())),
            files: Mutex::default(),
            down_until: Mutex::default(),
            stats: Arc::default(),
            bucket: String::new(),
            prefix: String::new(),
            planned: Default::default(),
            last_noted: Mutex::default(),
        };
        let c = channel.open()?;
        let answer = channel
            .call(&c, &TierRequest::Hello)
            .map_err(|e| channel.broken(e))?;
        match answer {
            (
                TierAnswer::Hello {
                    protocol: TIER_PROTOCOL,
                    bucket,
                    prefix,
                },
                _,
            ) => {
                channel.put_back(c);
                (channel.bucket, channel.prefix) = (bucket, prefix);
                Ok(channel)
            }
            (other, _) => Err(channel.broken(format!(
                "expected a hello of protocol {TIER_PROTOCOL}, got {other:?}"
            ))),
        }
    }

    /// Whether the mount serves `key` of `bucket` (its bucket, under its
    /// prefix); other objects are read from the workers without asking.
    pub fn serves(&self, bucket: &str, key: &str) -> bool {
        bucket == self.bucket && key.starts_with(&self.prefix)
    }

    pub fn stats(&self) -> &Arc<TierStats> {
        &self.stats
    }

    /// Fills `out` with the bytes of `uri` at `etag` from `offset`.
    pub fn read_into(
        &self,
        uri: &str,
        etag: &str,
        offset: u64,
        out: &mut [u8],
    ) -> Result<TierRead, TierClientError> {
        // SAFETY: the same memory seen as possibly uninitialised; what
        // `read_into_uninit` writes there is always initialised bytes.
        let out = unsafe { &mut *(out as *mut [u8] as *mut [MaybeUninit<u8>]) };
        self.read_into_uninit(uri, etag, offset, out)
    }

    /// [`Self::read_into`] into memory not initialised yet (a new Python
    /// `bytes` of 146 MB is not zeroed first only to be overwritten). On
    /// [`TierRead::Done`] every byte of `out` is written.
    pub fn read_into_uninit(
        &self,
        uri: &str,
        etag: &str,
        offset: u64,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<TierRead, TierClientError> {
        if let Some((file, size)) = self.held(uri, etag) {
            self.note(uri, offset);
            return self.read_file(uri, etag, &file, size, offset, out);
        }
        if self.is_down() {
            return Ok(self.unavailable("the tier socket failed a moment ago".into()));
        }
        let mut at = 0usize;
        while at < out.len() {
            let want = ((out.len() - at) as u64).min(MAX_TIER_INLINE);
            let request = TierRequest::Read {
                uri: uri.to_string(),
                etag: etag.to_string(),
                offset: offset + at as u64,
                len: want,
            };
            let (c, answer, fd) = match self.exchange(&request) {
                Ok(a) => a,
                Err(why) => return Ok(self.failed(why)),
            };
            match answer {
                TierAnswer::File { size } => {
                    let Some(fd) = fd else {
                        return Ok(self.failed("a file answer came without its descriptor".into()));
                    };
                    self.put_back(c);
                    let file = Arc::new(File::from(fd));
                    self.hold(uri, etag, size, file.clone());
                    return self.read_file(
                        uri,
                        etag,
                        &file,
                        size,
                        offset + at as u64,
                        &mut out[at..],
                    );
                }
                TierAnswer::Inline { len } if len == want => {
                    if let Err(e) = read_exact_raw(&c, &mut out[at..at + len as usize]) {
                        return Ok(self.failed(format!("inline bytes: {e}")));
                    }
                    self.put_back(c);
                    self.stats.inline_bytes.fetch_add(len, Ordering::Relaxed);
                    at += len as usize;
                }
                TierAnswer::Unavailable { reason } => {
                    self.put_back(c);
                    return Ok(self.unavailable(reason));
                }
                TierAnswer::Error { kind, message } => {
                    self.put_back(c);
                    return Err(TierClientError::Refused { kind, message });
                }
                other => return Ok(self.failed(format!("a read answered {other:?}"))),
            }
        }
        Ok(TierRead::Done)
    }

    /// A read of a tier file this reader holds; one that fails (a disk
    /// error) lets go of the file and sends the read to the workers.
    /// Sends plan `name` (this rank's reads, in order) to the mount, whose
    /// tier then fetches ahead of them; entries outside the mount are left
    /// out, and at most [`MAX_TIER_PLAN_ENTRIES`] are sent. Returns the
    /// entries the mount took.
    pub fn publish_plan(
        &self,
        name: &str,
        ttl_s: u64,
        entries: &[(crate::ObjectUri, std::ops::Range<u64>)],
    ) -> Result<usize, TierClientError> {
        let mut objects: Vec<String> = Vec::new();
        let mut index: std::collections::HashMap<&crate::ObjectUri, u32> = Default::default();
        let mut order = Vec::new();
        for (uri, range) in entries
            .iter()
            .filter(|(u, _)| self.serves(u.bucket(), u.key()))
            .take(MAX_TIER_PLAN_ENTRIES)
        {
            let i = *index.entry(uri).or_insert_with(|| {
                objects.push(uri.to_string());
                (objects.len() - 1) as u32
            });
            order.push((i, range.start, range.end));
        }
        let request = TierRequest::Plan {
            name: name.to_string(),
            ttl_s,
            objects,
            order,
        };
        let body = serde_json::to_vec(&request).map_err(|e| self.broken(e.to_string()))?;
        if body.len() > MAX_TIER_MESSAGE {
            return Err(self.broken(format!(
                "a plan of {} bytes is longer than the {MAX_TIER_MESSAGE} a request may be",
                body.len()
            )));
        }
        // Framed here: a plan is longer than `send_message` allows.
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&body);
        let send = |c: &UnixStream| -> Result<Vec<u8>, String> {
            let mut w = c;
            std::io::Write::write_all(&mut w, &frame)
                .map_err(|e| format!("sending a plan: {e}"))?;
            let (reply, _) = recv_message(c.as_raw_fd()).map_err(|e| format!("receiving: {e}"))?;
            Ok(reply)
        };
        let (c, pooled) = self.take()?;
        let (c, reply) = match send(&c) {
            Ok(reply) => (c, reply),
            // An idle connection may have outlived the mount that took it.
            Err(_) if pooled => {
                self.drop_idle();
                let c = self.open()?;
                let reply = send(&c).map_err(|e| self.broken(e))?;
                (c, reply)
            }
            Err(e) => return Err(self.broken(e)),
        };
        match serde_json::from_slice(&reply) {
            Ok(TierAnswer::PlanTaken { entries }) => {
                self.put_back(c);
                self.planned.store(true, Ordering::Relaxed);
                Ok(entries)
            }
            Ok(TierAnswer::Error { kind, message }) => {
                self.put_back(c);
                Err(TierClientError::Refused { kind, message })
            }
            other => Err(self.broken(format!("a plan answered {other:?}"))),
        }
    }

    /// Tells the mount where a planned reader is, once per object switch.
    fn note(&self, uri: &str, offset: u64) {
        if !self.planned.load(Ordering::Relaxed) || self.is_down() {
            return;
        }
        {
            let mut last = self.last_noted.lock().unwrap_or_else(|p| p.into_inner());
            if *last == uri {
                return;
            }
            uri.clone_into(&mut last);
        }
        let request = TierRequest::Note {
            uri: uri.to_string(),
            offset,
        };
        if let Ok((c, TierAnswer::Noted, _)) = self.exchange(&request) {
            self.put_back(c);
        }
    }

    fn read_file(
        &self,
        uri: &str,
        etag: &str,
        file: &File,
        size: u64,
        offset: u64,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<TierRead, TierClientError> {
        let end = offset.saturating_add(out.len() as u64);
        if end > size {
            return Err(TierClientError::Refused {
                kind: TierErrorKind::InvalidRange,
                message: format!("range {offset}..{end} is outside the {size}-byte object"),
            });
        }
        if let Err(e) = pread_exact_raw(file, out, offset) {
            self.files
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|h| !(h.uri == uri && h.etag == etag));
            return Ok(self.unavailable(format!("reading a tier file: {e}")));
        }
        self.stats
            .file_bytes
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(TierRead::Done)
    }

    fn held(&self, uri: &str, etag: &str) -> Option<(Arc<File>, u64)> {
        let files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files
            .iter()
            .find(|h| h.uri == uri && h.etag == etag)
            .map(|h| (h.file.clone(), h.size))
    }

    fn hold(&self, uri: &str, etag: &str, size: u64, file: Arc<File>) {
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files.retain(|h| !(h.uri == uri && h.etag == etag));
        if files.len() >= MAX_FILES {
            files.pop_front();
        }
        files.push_back(HeldFile {
            uri: uri.to_string(),
            etag: etag.to_string(),
            size,
            file,
        });
    }

    fn open(&self) -> Result<UnixStream, TierClientError> {
        let c = UnixStream::connect(&self.path).map_err(|source| TierClientError::Connect {
            path: self.path.clone(),
            source,
        })?;
        let timeouts = c
            .set_read_timeout(Some(CALL_TIMEOUT))
            .and_then(|()| c.set_write_timeout(Some(CALL_TIMEOUT)));
        timeouts.map_err(|source| TierClientError::Connect {
            path: self.path.clone(),
            source,
        })?;
        Ok(c)
    }

    /// A connection, and whether it came from the idle pool (where it
    /// may have outlived the mount that accepted it).
    fn take(&self) -> Result<(UnixStream, bool), TierClientError> {
        {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let me = std::process::id();
            if idle.0 != me {
                // Forked: the parent's connections are the parent's.
                idle.1.clear();
                idle.0 = me;
            }
            if let Some(c) = idle.1.pop() {
                return Ok((c, true));
            }
        }
        Ok((self.open()?, false))
    }

    /// Lets go of every idle connection: one failed, so the mount that
    /// accepted them is gone (a restarted mount listens anew).
    fn drop_idle(&self) {
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clear();
    }

    /// One request and its answer, on a connection the caller puts back
    /// when it is done with it. A failure on an idle connection is tried
    /// once more on a new one, so a mount restarted since costs nothing.
    fn exchange(
        &self,
        request: &TierRequest,
    ) -> Result<(UnixStream, TierAnswer, Option<std::os::fd::OwnedFd>), String> {
        let (c, pooled) = self.take().map_err(|e| e.to_string())?;
        match self.call(&c, request) {
            Ok((answer, fd)) => Ok((c, answer, fd)),
            Err(_) if pooled => {
                self.drop_idle();
                let c = self.open().map_err(|e| e.to_string())?;
                let (answer, fd) = self.call(&c, request)?;
                Ok((c, answer, fd))
            }
            Err(why) => Err(why),
        }
    }

    fn put_back(&self, c: UnixStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.0 == std::process::id() && idle.1.len() < MAX_IDLE {
            idle.1.push(c);
        }
    }

    fn call(
        &self,
        c: &UnixStream,
        request: &TierRequest,
    ) -> Result<(TierAnswer, Option<std::os::fd::OwnedFd>), String> {
        let body = serde_json::to_vec(request).map_err(|e| e.to_string())?;
        send_message(c.as_raw_fd(), &body, None).map_err(|e| format!("sending: {e}"))?;
        let (reply, fd) = recv_message(c.as_raw_fd()).map_err(|e| format!("receiving: {e}"))?;
        let answer = serde_json::from_slice(&reply).map_err(|e| format!("bad answer: {e}"))?;
        Ok((answer, fd))
    }

    fn is_down(&self) -> bool {
        let down = self.down_until.lock().unwrap_or_else(|p| p.into_inner());
        down.is_some_and(|until| Instant::now() < until)
    }

    fn unavailable(&self, reason: String) -> TierRead {
        self.stats.unavailable.fetch_add(1, Ordering::Relaxed);
        TierRead::Unavailable(reason)
    }

    /// The socket failed: reads go to the workers for a while.
    fn failed(&self, why: String) -> TierRead {
        self.drop_idle();
        *self.down_until.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + BACKOFF);
        self.unavailable(format!(
            "node-local tier socket {}: {why}",
            self.path.display()
        ))
    }

    fn broken(&self, why: impl Into<String>) -> TierClientError {
        TierClientError::Protocol {
            path: self.path.clone(),
            why: why.into(),
        }
    }
}

/// Fills `out` from the socket (a read timeout set on it applies).
fn read_exact_raw(c: &UnixStream, out: &mut [MaybeUninit<u8>]) -> io::Result<()> {
    // SAFETY: reads at most `len` bytes to `to`, which `fill_raw` points
    // into memory borrowed mutably, from a descriptor `c` keeps open.
    fill_raw(out, |to, len, _| unsafe {
        libc::read(c.as_raw_fd(), to, len)
    })
}

/// Fills `out` from `file` at `offset`; a file that ends first is an error.
fn pread_exact_raw(file: &File, out: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
    fill_raw(out, |to, len, at| {
        let at = (offset + at as u64) as libc::off_t;
        // SAFETY: as in `read_exact_raw`, from a file we borrow.
        unsafe { libc::pread(file.as_raw_fd(), to, len, at) }
    })
}

/// Calls `read(to, len, at)` (a read(2)-like call) until `out` is full.
fn fill_raw(
    out: &mut [MaybeUninit<u8>],
    mut read: impl FnMut(*mut libc::c_void, usize, usize) -> isize,
) -> io::Result<()> {
    let mut at = 0;
    while at < out.len() {
        let rest = &mut out[at..];
        match read(rest.as_mut_ptr().cast(), rest.len(), at) {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => at += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
