//! Short-circuit reads from a worker on the same host. Instead of sending
//! a cached page through TLS, TCP and HTTP (copied and encrypted by the
//! worker, copied and decrypted again by the mount), the worker checks
//! the caller's token as for HTTP, makes sure the page is cached, and
//! passes a read-only descriptor of its page file over a Unix socket
//! (`SCM_RIGHTS`). The mount reads the bytes itself and checks every
//! block against the CRC32C the worker sends with the descriptor.
//!
//! Wire format, both ways: a 4-byte little-endian length, then that many
//! bytes of JSON ([`LocalRequest`] in, [`LocalAnswer`] out); a granted
//! page's descriptor rides on the answer's first byte.
//!
//! Bytes that are not in a page file yet (a page being fetched from S3,
//! one just fetched and still in the worker's memory, a pending write, a
//! partly filled page, a skip-cache prefix) come back inline instead, to
//! a caller that said it takes them: an
//! [`LocalAnswer::Inline`] answer followed by that many raw bytes on the
//! same connection, the whole request (up to [`MAX_INLINE`]) read by the
//! worker as one HTTP request would be. They are the bytes HTTP would
//! have sent, minus the TLS, TCP and HTTP framing around them. A worker
//! whose read fails part way closes the connection; the caller then
//! reads the range over HTTP. A caller that takes no inline bytes, or a
//! version the worker does not have, is answered
//! [`LocalAnswer::Unavailable`] and reads over HTTP, which handles every
//! such case.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::buffer_pool::{self, ALIGN};
use crate::{ErrorCode, ObjectUri};

/// Version of the socket protocol; a worker answers `hello` with its own.
pub const LOCAL_PROTOCOL: u32 = 1;

/// Messages longer than this are refused (a page's CRC list is ~1 KiB).
pub const MAX_MESSAGE: usize = 64 * 1024;

/// How long a socket call may take before the read goes over HTTP.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a [`LocalChannel::read_cached`] call may wait on the worker:
/// its caller holds a kernel-request thread of the mount meanwhile.
const CACHED_TIMEOUT: Duration = Duration::from_secs(2);
const CACHED_TIMED_OUT: &str = "no answer to a cached-only read within";

/// After the socket itself fails, reads go over HTTP this long before
/// it is tried again (a restarting worker, a removed socket file).
const BACKOFF: Duration = Duration::from_secs(5);

/// Idle connections kept per channel.
const MAX_IDLE: usize = 16;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LocalRequest {
    /// Who is listening: the worker's HTTP address and protocol version.
    Hello,
    /// A descriptor for bytes `offset..offset + len` of `uri` at `etag`,
    /// within one page of the worker's.
    Page {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        uri: String,
        etag: String,
        offset: u64,
        len: u64,
        /// The caller takes [`LocalAnswer::Inline`] bytes (older mounts
        /// do not send it, and get `Unavailable` instead).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        inline: bool,
        /// The caller reads ahead of what its reader asked (see
        /// [`crate::ReadKind`]); older mounts do not send it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        read_ahead: bool,
        /// Answer only from what the worker holds now: a range it would
        /// have to fetch (from S3, or wait on a fetch in flight) is
        /// answered [`LocalAnswer::Unavailable`] at once. The caller reads
        /// on a thread it must not hold long (see
        /// [`LocalChannel::read_cached`]). Older workers ignore it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cached_only: bool,
    },
    /// Take the file whose descriptor rides on this request as the new
    /// content of a URI, written back: the co-located write path (see
    /// [`LocalChannel::commit`]).
    Commit(CommitRequest),
    /// Start taking the file whose descriptor rides on this request
    /// while it is still being written; its size comes with the
    /// [`LocalRequest::Seal`] that follows on the same connection (see
    /// [`LocalChannel::follow`]).
    Follow(FollowRequest),
    /// The followed file is complete: commit its first `size` bytes.
    Seal(SealRequest),
    /// A mount on this host writes back through this worker: prepare for
    /// its bursts now, before the first one comes (see
    /// [`LocalChannel::prepare_write_back`]).
    PrepareWriteBack {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
    },
}

/// A followed commit: `uri`'s new content is the passed file, whose
/// length is not final yet.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FollowRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    pub uri: String,
    #[serde(default)]
    pub meta: crate::UserMeta,
    /// As in [`CommitRequest`]: the fence counts from the follow's start.
    pub deadline_ms: u64,
    pub sent_ms: u64,
}

/// The end of a followed file. `meta` must be the follow's: a file whose
/// metadata changed meanwhile is committed anew instead.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SealRequest {
    pub size: u64,
    #[serde(default)]
    pub meta: crate::UserMeta,
}

/// A commit: the first `size` bytes of the passed file as `uri`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CommitRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    pub uri: String,
    pub size: u64,
    #[serde(default)]
    pub meta: crate::UserMeta,
    /// The caller's progress deadline and when it sent this (ms since
    /// the epoch): a worker paused past it must not record the write.
    pub deadline_ms: u64,
    pub sent_ms: u64,
}

/// Inline answers are at most this long; a longer request is answered in
/// parts, each asked for anew.
pub const MAX_INLINE: u64 = 64 << 20;

/// Where a granted range lies in the passed file and how to check it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PageGrant {
    /// Offset in the file of the first checked block (block-aligned).
    pub file_offset: u64,
    /// Bytes to read from `file_offset`: whole blocks, the last one may
    /// end with the page.
    pub read_len: u64,
    /// Size of a checked block.
    pub block: u64,
    /// CRC32C of each block read, in order.
    pub crcs: Vec<u32>,
    /// Where the bytes asked for start within what was read.
    pub skip: u64,
    /// The bytes granted from `skip`: the request's, up to the end of
    /// the page holding its start (the next request goes on from there).
    pub len: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LocalAnswer {
    Hello {
        listen: String,
        protocol: u32,
    },
    /// The page file's descriptor accompanies this answer.
    Granted(PageGrant),
    /// `len` bytes from the requested offset follow this answer on the
    /// connection (at most [`MAX_INLINE`], never past the request).
    Inline {
        len: u64,
    },
    /// A commit goes on: `taken` bytes of it are in so far. Sent at least
    /// once a second, so a silent worker stands out.
    Progress {
        taken: u64,
    },
    /// A commit is durable as the write-back path acknowledges it.
    Committed(crate::ObjectStat),
    /// [`LocalRequest::PrepareWriteBack`] taken: the worker keeps up to
    /// `spare_bytes` of spare page files for write-back pages (0: none).
    Prepared {
        spare_bytes: u64,
    },
    /// Not served here; read over HTTP.
    Unavailable {
        reason: String,
    },
    /// A definite refusal, as HTTP would give it.
    Error {
        code: ErrorCode,
        message: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("local worker socket: {0}")]
    Io(#[from] io::Error),
    #[error("local worker socket: bad message: {0}")]
    Protocol(String),
    /// Not served over the socket; read over HTTP.
    #[error("not served over the local socket: {0}")]
    Unavailable(String),
    #[error("worker answered {code:?}: {message}")]
    Refused { code: ErrorCode, message: String },
    /// The worker said nothing for this long during a commit.
    #[error("local worker socket: the worker was silent for {0:?} during a commit")]
    Stalled(Duration),
    /// The bytes read from the page file fail their block CRC.
    #[error("page file bytes fail their CRC32C (block {block})")]
    Corrupt { block: usize },
}

/// `body` with its length in front.
pub fn frame(body: &[u8]) -> io::Result<Vec<u8>> {
    if body.len() > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "message too long",
        ));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    Ok(frame)
}

/// Writes one message, with `fd` attached when given.
pub fn send_message(sock: RawFd, body: &[u8], fd: Option<RawFd>) -> io::Result<()> {
    let frame = frame(body)?;
    let sent = sendmsg_with_fd(sock, &frame, fd)?;
    // The rest, if the socket took only part (the descriptor went first).
    let mut stream = BorrowedSock(sock);
    stream.write_all(&frame[sent..])
}

/// Reads one message and the descriptor sent with it, if any.
pub fn recv_message(sock: RawFd) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut len = [0u8; 4];
    let (got, fd) = recvmsg_fd(sock, &mut len)?;
    if got == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    let mut stream = BorrowedSock(sock);
    stream.read_exact(&mut len[got..])?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "message too long",
        ));
    }
    let mut body = vec![0u8; n];
    stream.read_exact(&mut body)?;
    Ok((body, fd))
}

/// A socket we do not own, for `Read`/`Write` on it.
struct BorrowedSock(RawFd);

impl Read for BorrowedSock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: reads into `buf`, which we borrow mutably, from a
        // descriptor the caller keeps open.
        let n = unsafe { libc::read(self.0, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl Write for BorrowedSock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: writes from `buf` to a descriptor the caller keeps open.
        let n = unsafe { libc::write(self.0, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

const CMSG_SPACE: usize = 64;

#[repr(C, align(8))]
struct CmsgBuf([u8; CMSG_SPACE]);

/// One `sendmsg` of `data` with `fd` attached: how much was sent (the
/// descriptor went with the first byte). A non-blocking socket that is
/// full answers `WouldBlock` having sent nothing.
pub fn sendmsg_with_fd(sock: RawFd, data: &[u8], fd: Option<RawFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut cmsg = CmsgBuf([0; CMSG_SPACE]);
    // SAFETY: msghdr is plain data; every pointer set below outlives the
    // sendmsg call, and CMSG_* stay within `cmsg` (sized for one fd).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
            msg.msg_control = cmsg.0.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<RawFd>(), fd);
        }
        loop {
            let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// One `recvmsg` into `buf`, with the descriptor that rode on it.
pub fn recvmsg_fd(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cmsg = CmsgBuf([0; CMSG_SPACE]);
    // SAFETY: as in sendmsg_fd; a received descriptor is owned by us from
    // here on (MSG_CMSG_CLOEXEC keeps it from leaking into children).
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.0.as_mut_ptr().cast();
        msg.msg_controllen = CMSG_SPACE as _;
        let n = loop {
            let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut fds = Vec::new();
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(header);
                let bytes = (*header).cmsg_len as usize - (data as usize - header as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
        // More than one descriptor is not our protocol: the extras close.
        Ok((n, fds.into_iter().next()))
    }
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn send_commit(
    c: &UnixStream,
    request: &LocalRequest,
    fd: Option<RawFd>,
    progress: Duration,
) -> Result<(), LocalError> {
    let body = serde_json::to_vec(request).map_err(|e| LocalError::Protocol(e.to_string()))?;
    match send_message(c.as_raw_fd(), &body, fd) {
        Err(e) if timed_out(&e) => Err(LocalError::Stalled(progress)),
        sent => Ok(sent?),
    }
}

/// Reads a commit's answers until the final one, through its progress
/// reports.
fn await_commit(c: &UnixStream, progress: Duration) -> Result<crate::ObjectStat, LocalError> {
    loop {
        let (reply, _) = match recv_message(c.as_raw_fd()) {
            Ok(r) => r,
            Err(e) if timed_out(&e) => return Err(LocalError::Stalled(progress)),
            Err(e) => return Err(e.into()),
        };
        let answer: LocalAnswer =
            serde_json::from_slice(&reply).map_err(|e| LocalError::Protocol(e.to_string()))?;
        match answer {
            LocalAnswer::Progress { .. } => continue,
            LocalAnswer::Committed(stat) => return Ok(stat),
            LocalAnswer::Unavailable { reason } => return Err(LocalError::Unavailable(reason)),
            LocalAnswer::Error { code, message } => {
                return Err(LocalError::Refused { code, message })
            }
            other => return Err(LocalError::Protocol(format!("a commit answered {other:?}"))),
        }
    }
}

/// A file the worker is taking while it is written (see
/// [`LocalChannel::follow`]). Dropped without a seal, the worker drops
/// what it took.
#[derive(Debug)]
pub struct Following {
    c: UnixStream,
    progress: Duration,
}

impl Following {
    /// The silence from the worker after which the seal gives up.
    pub fn progress(&self) -> Duration {
        self.progress
    }

    /// The file is complete at `size` bytes, with `meta` (which must be
    /// the follow's): answers once the write is durable, as
    /// [`LocalChannel::commit`] does.
    pub fn seal(self, size: u64, meta: &crate::UserMeta) -> Result<crate::ObjectStat, LocalError> {
        let request = LocalRequest::Seal(SealRequest {
            size,
            meta: meta.clone(),
        });
        send_commit(&self.c, &request, None, self.progress)?;
        await_commit(&self.c, self.progress)
    }
}

/// The client side: connections to one worker's socket, used from
/// blocking threads.
pub struct LocalChannel {
    path: PathBuf,
    token: Option<String>,
    idle: Mutex<Vec<UnixStream>>,
    listen: Mutex<Option<SocketAddr>>,
    failed_at: Mutex<Option<Instant>>,
    /// When a cached-only read last went unanswered in time: cached-only
    /// reads are declined without asking for [`BACKOFF`] after it, so a
    /// busy worker does not hold its callers' threads each time.
    cached_timed_out_at: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for LocalChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalChannel")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl LocalChannel {
    pub fn new(path: &Path, token: Option<String>) -> Self {
        Self {
            path: path.to_path_buf(),
            token,
            idle: Mutex::new(Vec::new()),
            listen: Mutex::new(None),
            failed_at: Mutex::new(None),
            cached_timed_out_at: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn connection(&self) -> io::Result<UnixStream> {
        if let Some(c) = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(c);
        }
        let c = UnixStream::connect(&self.path)?;
        c.set_read_timeout(Some(SOCKET_TIMEOUT))?;
        c.set_write_timeout(Some(SOCKET_TIMEOUT))?;
        Ok(c)
    }

    fn done(&self, c: UnixStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(c);
        }
    }

    fn call(&self, request: &LocalRequest) -> Result<(LocalAnswer, Option<OwnedFd>), LocalError> {
        let c = self.connection()?;
        let answer = call_on(&c, request)?;
        self.done(c);
        Ok(answer)
    }

    /// The HTTP address of the worker behind the socket (asked once).
    pub fn worker_listen(&self) -> Result<SocketAddr, LocalError> {
        if let Some(addr) = *self.listen.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(addr);
        }
        match self.call(&LocalRequest::Hello)? {
            (LocalAnswer::Hello { listen, protocol }, _) => {
                if protocol != LOCAL_PROTOCOL {
                    return Err(LocalError::Unavailable(format!(
                        "worker speaks local protocol {protocol}, this mount {LOCAL_PROTOCOL}"
                    )));
                }
                let addr: SocketAddr = listen
                    .parse()
                    .map_err(|_| LocalError::Protocol(format!("bad listen address {listen:?}")))?;
                *self.listen.lock().unwrap_or_else(|p| p.into_inner()) = Some(addr);
                Ok(addr)
            }
            (other, _) => Err(LocalError::Protocol(format!("hello answered {other:?}"))),
        }
    }

    /// Whether this socket's worker is the member at `address`
    /// (`host:port` as the ring names it). A worker listening on an
    /// unspecified address matches any host on its port.
    pub fn serves(&self, address: &str) -> bool {
        self.worker_listen()
            .is_ok_and(|listen| is_member(listen, address))
    }

    /// Whether a read for `member` may use the socket, known without I/O:
    /// not while backing off after a failure, nor for a member the
    /// worker's (already learnt) address rules out. Reads of other
    /// workers' segments then skip the blocking pool altogether.
    pub fn worth_asking(&self, member: &str) -> bool {
        let backing_off = self
            .failed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|t| t.elapsed() < BACKOFF);
        let listen = *self.listen.lock().unwrap_or_else(|p| p.into_inner());
        !backing_off && listen.is_none_or(|l| is_member(l, member))
    }

    /// Bytes `range` of `uri` at `etag`, read from the page files of the
    /// worker at `member` when this socket is that worker's. A failure
    /// of the socket itself (not a refusal or a damaged page) sends reads
    /// over HTTP for a few seconds, logged once.
    pub fn read(
        &self,
        member: &str,
        uri: &ObjectUri,
        etag: &str,
        range: Range<u64>,
        kind: crate::ReadKind,
    ) -> Result<Bytes, LocalError> {
        self.read_as(member, uri, etag, range, kind, false)
    }

    /// A reader's own read of `range` (see [`Self::read`]) that the worker
    /// answers only from what it holds now (memory or page files), within
    /// [`CACHED_TIMEOUT`]: a mount serves it on the kernel-request thread
    /// that brought it, with no hop through its runtime and back (on a
    /// busy node each hop is a wait for a core). Anything else, a range
    /// the worker would fetch first included, is
    /// [`LocalError::Unavailable`], and the caller reads as usual.
    pub fn read_cached(
        &self,
        member: &str,
        uri: &ObjectUri,
        etag: &str,
        range: Range<u64>,
    ) -> Result<Bytes, LocalError> {
        let quiet = self
            .cached_timed_out_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|t| t.elapsed() < BACKOFF);
        if quiet {
            return Err(LocalError::Unavailable(
                "a cached-only read timed out recently".into(),
            ));
        }
        self.read_as(member, uri, etag, range, crate::ReadKind::Demand, true)
    }

    fn read_as(
        &self,
        member: &str,
        uri: &ObjectUri,
        etag: &str,
        range: Range<u64>,
        kind: crate::ReadKind,
        cached_only: bool,
    ) -> Result<Bytes, LocalError> {
        let mut failed_at = self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
        if failed_at.is_some_and(|t| t.elapsed() < BACKOFF) {
            return Err(LocalError::Unavailable(
                "the local socket failed recently".into(),
            ));
        }
        *failed_at = None;
        drop(failed_at);
        let got = match self.worker_listen() {
            Ok(listen) if !is_member(listen, member) => {
                return Err(LocalError::Unavailable(format!(
                    "{member} is another worker"
                )))
            }
            Ok(_) => self.read_pages(uri, etag, range, kind, cached_only),
            Err(e) => Err(e),
        };
        if let Err(e @ (LocalError::Io(_) | LocalError::Protocol(_))) = &got {
            tracing::warn!(socket = %self.path.display(), error = %e, "local worker socket failed; reading over HTTP for {BACKOFF:?}");
            *self.failed_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            return Err(LocalError::Unavailable(e.to_string()));
        }
        got
    }

    /// Hands `file` (its first `size` bytes) to the worker at `member`
    /// as the new content of `uri`, written back: the worker reads it and
    /// answers once the write is durable as an HTTP write-back would be.
    /// `progress`: the longest silence allowed from the worker (it
    /// reports progress every second), after which the commit is given
    /// up as [`LocalError::Stalled`].
    pub fn commit(
        &self,
        member: &str,
        uri: &ObjectUri,
        file: &std::fs::File,
        size: u64,
        meta: &crate::UserMeta,
        progress: Duration,
    ) -> Result<crate::ObjectStat, LocalError> {
        let c = self.commit_connection(member, progress)?;
        let request = LocalRequest::Commit(CommitRequest {
            token: self.token.clone(),
            uri: uri.to_string(),
            size,
            meta: meta.clone(),
            deadline_ms: progress.as_millis() as u64,
            sent_ms: wall_ms(),
        });
        send_commit(&c, &request, Some(file.as_raw_fd()), progress)?;
        await_commit(&c, progress)
    }

    /// Hands `file` to the worker at `member` while the application is
    /// still writing it: the worker takes its bytes as they arrive, so
    /// that [`Following::seal`] at close has little left to do. The
    /// worker checks at the seal that what it took early is still what
    /// the file holds.
    pub fn follow(
        &self,
        member: &str,
        uri: &ObjectUri,
        file: &std::fs::File,
        meta: &crate::UserMeta,
        progress: Duration,
    ) -> Result<Following, LocalError> {
        let c = self.commit_connection(member, progress)?;
        let request = LocalRequest::Follow(FollowRequest {
            token: self.token.clone(),
            uri: uri.to_string(),
            meta: meta.clone(),
            deadline_ms: progress.as_millis() as u64,
            sent_ms: wall_ms(),
        });
        send_commit(&c, &request, Some(file.as_raw_fd()), progress)?;
        Ok(Following { c, progress })
    }

    /// Tells the worker that a mount on this host writes back through
    /// it, so it prepares for the first burst (spare page files written
    /// while nothing is being written back) instead of learning from it.
    /// Returns the bytes of spares the worker keeps at most.
    pub fn prepare_write_back(&self) -> Result<u64, LocalError> {
        let request = LocalRequest::PrepareWriteBack {
            token: self.token.clone(),
        };
        match self.call(&request)? {
            (LocalAnswer::Prepared { spare_bytes }, _) => Ok(spare_bytes),
            (LocalAnswer::Error { code, message }, _) => Err(LocalError::Refused { code, message }),
            (other, _) => Err(LocalError::Protocol(format!(
                "prepare_write_back answered {other:?}"
            ))),
        }
    }

    /// A connection of its own for a commit, under the caller's deadline
    /// from the first byte (a stopped worker accepts, then says nothing);
    /// it is given up, not reused, if the worker falls silent.
    fn commit_connection(
        &self,
        member: &str,
        progress: Duration,
    ) -> Result<UnixStream, LocalError> {
        let c = UnixStream::connect(&self.path)?;
        c.set_write_timeout(Some(progress))?;
        c.set_read_timeout(Some(progress))?;
        let known = *self.listen.lock().unwrap_or_else(|p| p.into_inner());
        let listen = match known {
            Some(listen) => listen,
            None => match call_on(&c, &LocalRequest::Hello) {
                Ok((LocalAnswer::Hello { listen, protocol }, _)) if protocol == LOCAL_PROTOCOL => {
                    let addr: SocketAddr = listen.parse().map_err(|_| {
                        LocalError::Protocol(format!("bad listen address {listen:?}"))
                    })?;
                    *self.listen.lock().unwrap_or_else(|p| p.into_inner()) = Some(addr);
                    addr
                }
                Ok((other, _)) => {
                    return Err(LocalError::Unavailable(format!("hello answered {other:?}")))
                }
                Err(LocalError::Io(e)) if timed_out(&e) => {
                    return Err(LocalError::Stalled(progress))
                }
                Err(e) => return Err(e),
            },
        };
        if !is_member(listen, member) {
            return Err(LocalError::Unavailable(format!(
                "{member} is another worker"
            )));
        }
        Ok(c)
    }

    fn read_pages(
        &self,
        uri: &ObjectUri,
        etag: &str,
        range: Range<u64>,
        kind: crate::ReadKind,
        cached_only: bool,
    ) -> Result<Bytes, LocalError> {
        let want = range.end.saturating_sub(range.start) as usize;
        let mut pieces: Vec<Bytes> = Vec::new();
        let mut pos = range.start;
        // Pooled connections wait the usual time again (a call that timed
        // out leaves its connection unpooled).
        let pool = |c: UnixStream| {
            if cached_only && c.set_read_timeout(Some(SOCKET_TIMEOUT)).is_err() {
                return;
            }
            self.done(c);
        };
        while pos < range.end {
            let request = LocalRequest::Page {
                token: self.token.clone(),
                uri: uri.to_string(),
                etag: etag.to_string(),
                offset: pos,
                len: range.end - pos,
                inline: true,
                read_ahead: kind == crate::ReadKind::Ahead,
                cached_only,
            };
            let c = self.connection()?;
            if cached_only {
                c.set_read_timeout(Some(CACHED_TIMEOUT))?;
            }
            let answered = call_on(&c, &request).map_err(|e| match e {
                // A busy worker, not a broken socket: this read goes the
                // usual way, and the socket stays in use.
                LocalError::Io(io) if cached_only && timed_out(&io) => {
                    *self
                        .cached_timed_out_at
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                    LocalError::Unavailable(format!("{CACHED_TIMED_OUT} {CACHED_TIMEOUT:?}"))
                }
                other => other,
            });
            let grant = match answered? {
                (LocalAnswer::Inline { len }, None) => {
                    if len == 0 || len > range.end - pos || len > MAX_INLINE {
                        return Err(LocalError::Protocol(format!(
                            "inline bytes outside the request: {len} at {pos}"
                        )));
                    }
                    // Cut short: the worker's read failed part way. HTTP
                    // reads the range (and reports its error); the socket
                    // itself is not suspect, so no back-off.
                    let bytes = read_inline(&c, len as usize).map_err(|e| {
                        LocalError::Unavailable(format!("inline bytes broke off: {e}"))
                    })?;
                    pool(c);
                    pos += len;
                    pieces.push(bytes);
                    continue;
                }
                (LocalAnswer::Granted(g), Some(fd)) => {
                    pool(c);
                    (g, fd)
                }
                (LocalAnswer::Granted(_), None) => {
                    return Err(LocalError::Protocol(
                        "a grant came without a descriptor".into(),
                    ))
                }
                (LocalAnswer::Unavailable { reason }, None) => {
                    pool(c);
                    return Err(LocalError::Unavailable(reason));
                }
                (LocalAnswer::Error { code, message }, None) => {
                    pool(c);
                    return Err(LocalError::Refused { code, message });
                }
                (other, _) => return Err(LocalError::Protocol(format!("page answered {other:?}"))),
            };
            let (g, fd) = grant;
            if g.len == 0 || g.len > range.end - pos || g.skip + g.len > g.read_len {
                return Err(LocalError::Protocol(format!(
                    "a grant outside the request: {g:?}"
                )));
            }
            let bytes = read_checked(fd, &g)?;
            pos += g.len;
            pieces.push(bytes);
        }
        if pieces.len() == 1 {
            return Ok(pieces.remove(0));
        }
        let mut out = bytes::BytesMut::with_capacity(want);
        for p in pieces {
            out.extend_from_slice(&p);
        }
        Ok(out.freeze())
    }
}

/// One request and its answer on connection `c`.
fn call_on(
    c: &UnixStream,
    request: &LocalRequest,
) -> Result<(LocalAnswer, Option<OwnedFd>), LocalError> {
    let body = serde_json::to_vec(request).map_err(|e| LocalError::Protocol(e.to_string()))?;
    send_message(c.as_raw_fd(), &body, None)?;
    let (reply, fd) = recv_message(c.as_raw_fd())?;
    let answer: LocalAnswer =
        serde_json::from_slice(&reply).map_err(|e| LocalError::Protocol(e.to_string()))?;
    Ok((answer, fd))
}

/// The `len` raw bytes that follow an inline answer.
fn read_inline(mut c: &UnixStream, len: usize) -> Result<Bytes, LocalError> {
    let mut buf = buffer_pool::take(len);
    buf.set_len(len);
    c.read_exact(&mut buf)?;
    Ok(buffer_pool::freeze(buf))
}

/// Whether the member at `address` (`host:port`) is the worker
/// listening on `listen`.
fn is_member(listen: SocketAddr, address: &str) -> bool {
    let Ok(member) = address.parse::<SocketAddr>() else {
        // A name: the port must match and the name be this host's.
        return address
            .rsplit_once(':')
            .is_some_and(|(host, port)| port.parse() == Ok(listen.port()) && host == "localhost");
    };
    member.port() == listen.port() && (member.ip() == listen.ip() || listen.ip().is_unspecified())
}

/// Reads a grant's blocks from `fd` (opened by the worker, perhaps with
/// `O_DIRECT`: aligned offsets, aligned buffer, whole 4 KiB units) and
/// checks each block's CRC32C.
fn read_checked(fd: OwnedFd, g: &PageGrant) -> Result<Bytes, LocalError> {
    let file = std::fs::File::from(fd);
    if g.block == 0 || g.crcs.len() as u64 != g.read_len.div_ceil(g.block) {
        return Err(LocalError::Protocol(format!(
            "a grant with bad blocks: {g:?}"
        )));
    }
    let len = g.read_len as usize;
    let mut buf = buffer_pool::take(len.next_multiple_of(ALIGN));
    buf.set_len(len.next_multiple_of(ALIGN));
    let mut got = 0;
    while got < len {
        match file.read_at(&mut buf[got..], g.file_offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    if got < len {
        return Err(LocalError::Corrupt {
            block: got / g.block as usize,
        });
    }
    buf.set_len(len);
    for (i, (chunk, crc)) in buf.chunks(g.block as usize).zip(&g.crcs).enumerate() {
        if crc32c::crc32c(chunk) != *crc {
            return Err(LocalError::Corrupt { block: i });
        }
    }
    let bytes = buffer_pool::freeze(buf);
    Ok(bytes.slice(g.skip as usize..(g.skip + g.len) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_travels_with_its_message() {
        let (a, b) = UnixStream::pair().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"page bytes").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        send_message(a.as_raw_fd(), b"{\"x\":1}", Some(file.as_raw_fd())).unwrap();
        send_message(a.as_raw_fd(), b"second", None).unwrap();
        let (body, fd) = recv_message(b.as_raw_fd()).unwrap();
        assert_eq!(body, b"{\"x\":1}");
        let got = std::fs::File::from(fd.expect("a descriptor"));
        let mut text = String::new();
        (&got).read_to_string(&mut text).unwrap();
        assert_eq!(text, "page bytes");
        let (body, fd) = recv_message(b.as_raw_fd()).unwrap();
        assert_eq!(body, b"second");
        assert!(fd.is_none());
    }

    /// A fake worker on a real socket: answers hello, then each page
    /// request with `answer(connection number, offset, len)`: the answer,
    /// the bytes that follow it, and whether to close the connection
    /// after them.
    fn fake_worker(
        dir: &Path,
        answer: impl Fn(usize, u64, u64) -> (LocalAnswer, Vec<u8>, bool) + Send + 'static,
    ) -> PathBuf {
        let path = dir.join("w.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().enumerate() {
                let Ok(mut conn) = conn else { return };
                while let Ok((body, _)) = recv_message(conn.as_raw_fd()) {
                    let (reply, bytes, close) = match serde_json::from_slice(&body).unwrap() {
                        LocalRequest::Hello => (
                            LocalAnswer::Hello {
                                listen: "127.0.0.1:7000".into(),
                                protocol: LOCAL_PROTOCOL,
                            },
                            Vec::new(),
                            false,
                        ),
                        LocalRequest::Page {
                            offset,
                            len,
                            inline,
                            ..
                        } => {
                            assert!(inline, "this client takes inline bytes");
                            answer(n, offset, len)
                        }
                        // A commit's descriptor came along: its size is
                        // passed to `answer` as the length.
                        LocalRequest::Commit(CommitRequest { size, .. }) => {
                            let progress = serde_json::to_vec(&LocalAnswer::Progress { taken: 0 });
                            send_message(conn.as_raw_fd(), &progress.unwrap(), None).unwrap();
                            answer(n, u64::MAX, size)
                        }
                        LocalRequest::PrepareWriteBack { .. } => (
                            LocalAnswer::Prepared {
                                spare_bytes: 3 << 30,
                            },
                            Vec::new(),
                            false,
                        ),
                        // A follow is answered once its seal comes.
                        LocalRequest::Follow(_) => continue,
                        LocalRequest::Seal(SealRequest { size, .. }) => {
                            let progress = serde_json::to_vec(&LocalAnswer::Progress { taken: 0 });
                            send_message(conn.as_raw_fd(), &progress.unwrap(), None).unwrap();
                            answer(n, u64::MAX - 1, size)
                        }
                    };
                    let reply = serde_json::to_vec(&reply).unwrap();
                    send_message(conn.as_raw_fd(), &reply, None).unwrap();
                    conn.write_all(&bytes).unwrap();
                    if close {
                        break;
                    }
                }
            }
        });
        path
    }

    fn stat(size: u64) -> crate::ObjectStat {
        crate::ObjectStat {
            uri: "s3://bucket/k".into(),
            size,
            etag: "lc-1".into(),
            last_modified_ms: 0,
            written_as: None,
            meta: Default::default(),
            held_by: None,
        }
    }

    #[test]
    fn a_write_back_mount_is_announced_and_the_workers_cap_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_worker(dir.path(), |_, _, _| unreachable!("no page is asked for"));
        let channel = LocalChannel::new(&path, Some("t".into()));
        assert_eq!(channel.prepare_write_back().unwrap(), 3 << 30);
        // The request on the wire: its op, and the token when there is one.
        let wire = serde_json::to_value(LocalRequest::PrepareWriteBack {
            token: Some("t".into()),
        })
        .unwrap();
        assert_eq!(
            wire,
            serde_json::json!({"op": "prepare_write_back", "token": "t"})
        );
    }

    #[test]
    fn a_commit_sends_the_file_and_waits_through_progress_for_the_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_worker(dir.path(), |_, offset, size| {
            assert_eq!(offset, u64::MAX, "a commit, not a page request");
            (LocalAnswer::Committed(stat(size)), Vec::new(), false)
        });
        let file = tempfile::tempfile().unwrap();
        let channel = LocalChannel::new(&path, None);
        let uri: ObjectUri = "s3://bucket/k".parse().unwrap();
        let got = channel
            .commit(
                "127.0.0.1:7000",
                &uri,
                &file,
                12,
                &Default::default(),
                Duration::from_secs(5),
            )
            .unwrap();
        assert_eq!(got.size, 12);
        let other = channel.commit(
            "127.0.0.1:7001",
            &uri,
            &file,
            12,
            &Default::default(),
            Duration::from_secs(5),
        );
        assert!(
            matches!(other, Err(LocalError::Unavailable(_))),
            "{other:?}"
        );
    }

    #[test]
    fn a_follow_sends_the_file_first_and_its_size_at_the_seal() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_worker(dir.path(), |_, offset, size| {
            assert_eq!(offset, u64::MAX - 1, "a seal, not a commit or a page");
            (LocalAnswer::Committed(stat(size)), Vec::new(), false)
        });
        let file = tempfile::tempfile().unwrap();
        let channel = LocalChannel::new(&path, None);
        let uri: ObjectUri = "s3://bucket/k".parse().unwrap();
        let meta = crate::UserMeta::default();
        let following = channel
            .follow("127.0.0.1:7000", &uri, &file, &meta, Duration::from_secs(5))
            .unwrap();
        let got = following.seal(4321, &meta).unwrap();
        assert_eq!(got.size, 4321);
        // Another worker's write is not followed here.
        let other = channel.follow("10.0.0.9:7000", &uri, &file, &meta, Duration::from_secs(5));
        assert!(
            matches!(other, Err(LocalError::Unavailable(_))),
            "{other:?}"
        );
    }

    #[test]
    fn a_silent_worker_stalls_a_commit_within_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("silent.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // Accepts (as a stopped process's socket does, from its backlog)
        // and never answers.
        let _held = std::thread::spawn(move || {
            let conns: Vec<_> = listener.incoming().take(2).collect();
            std::thread::sleep(Duration::from_secs(5));
            drop(conns);
        });
        let file = tempfile::tempfile().unwrap();
        let channel = LocalChannel::new(&path, None);
        let uri: ObjectUri = "s3://bucket/k".parse().unwrap();
        let started = Instant::now();
        let got = channel.commit(
            "127.0.0.1:7000",
            &uri,
            &file,
            0,
            &Default::default(),
            Duration::from_millis(200),
        );
        assert!(matches!(got, Err(LocalError::Stalled(_))), "{got:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn inline_pieces_are_joined_and_a_piece_past_the_request_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let object: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let served = object.clone();
        // 1 MiB pieces at most, as the worker sends them.
        let path = fake_worker(dir.path(), move |_, offset, len| {
            let n = len.min(1 << 20);
            let bytes = served[offset as usize..(offset + n) as usize].to_vec();
            (LocalAnswer::Inline { len: n }, bytes, false)
        });
        let channel = LocalChannel::new(&path, None);
        let uri: ObjectUri = "s3://bucket/k".parse().unwrap();
        let got = channel
            .read(
                "127.0.0.1:7000",
                &uri,
                "e",
                10..2_500_000,
                crate::ReadKind::Demand,
            )
            .unwrap();
        assert_eq!(&got[..], &object[10..2_500_000]);

        let dir = tempfile::tempdir().unwrap();
        let path = fake_worker(dir.path(), |_, _, len| {
            let bytes = vec![0; len as usize + 1];
            (LocalAnswer::Inline { len: len + 1 }, bytes, false)
        });
        let channel = LocalChannel::new(&path, None);
        let e = channel
            .read("127.0.0.1:7000", &uri, "e", 0..100, crate::ReadKind::Demand)
            .unwrap_err();
        // Refused, then HTTP for a while: never bytes past the request.
        assert!(matches!(e, LocalError::Unavailable(_)), "{e:?}");
    }

    #[test]
    fn inline_bytes_cut_short_send_that_read_to_http_without_backing_off() {
        let dir = tempfile::tempdir().unwrap();
        // The first connection's read fails part way; the next one's is
        // whole.
        let path = fake_worker(dir.path(), |n, _, len| {
            let whole = if n == 0 { 10 } else { len as usize };
            (LocalAnswer::Inline { len }, vec![5u8; whole], n == 0)
        });
        let channel = LocalChannel::new(&path, None);
        let uri: ObjectUri = "s3://bucket/k".parse().unwrap();
        let e = channel
            .read("127.0.0.1:7000", &uri, "e", 0..100, crate::ReadKind::Demand)
            .unwrap_err();
        assert!(
            matches!(&e, LocalError::Unavailable(why) if why.contains("broke off")),
            "{e:?}"
        );
        assert!(channel.worth_asking("127.0.0.1:7000"), "no back-off");
        let got = channel
            .read("127.0.0.1:7000", &uri, "e", 0..100, crate::ReadKind::Demand)
            .unwrap();
        assert_eq!(&got[..], &[5u8; 100][..]);
    }

    #[test]
    fn a_cached_only_read_a_worker_leaves_unanswered_is_declined_then_not_asked_for_a_while() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("busy.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let pages_asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let asked = pages_asked.clone();
        // A worker that answers `hello` and then never a page request.
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let asked = asked.clone();
                std::thread::spawn(move || {
                    while let Ok((body, _)) = recv_message(conn.as_raw_fd()) {
                        match serde_json::from_slice(&body).unwrap() {
                            LocalRequest::Hello => {
                                let hello = LocalAnswer::Hello {
                                    listen: "127.0.0.1:7000".into(),
                                    protocol: LOCAL_PROTOCOL,
                                };
                                let reply = serde_json::to_vec(&hello).unwrap();
                                send_message(conn.as_raw_fd(), &reply, None).unwrap();
                            }
                            LocalRequest::Page { cached_only, .. } => {
                                assert!(cached_only);
                                asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            other => panic!("unexpected {other:?}"),
                        }
                    }
                });
            }
        });
        let channel = LocalChannel::new(&path, None);
        let uri: ObjectUri = "s3://bucket/k".parse().unwrap();
        let started = Instant::now();
        let e = channel
            .read_cached("127.0.0.1:7000", &uri, "e", 0..100)
            .unwrap_err();
        assert!(
            matches!(&e, LocalError::Unavailable(why) if why.starts_with(CACHED_TIMED_OUT)),
            "{e:?}"
        );
        assert!(started.elapsed() >= CACHED_TIMEOUT);
        assert!(started.elapsed() < SOCKET_TIMEOUT);
        assert_eq!(pages_asked.load(std::sync::atomic::Ordering::SeqCst), 1);
        // The socket itself is fine: no back-off for ordinary reads...
        assert!(channel.worth_asking("127.0.0.1:7000"));
        // ...but cached-only reads are declined without asking for a while.
        let started = Instant::now();
        let e = channel
            .read_cached("127.0.0.1:7000", &uri, "e", 0..100)
            .unwrap_err();
        assert!(
            matches!(&e, LocalError::Unavailable(why) if why.contains("recently")),
            "{e:?}"
        );
        assert!(started.elapsed() < Duration::from_millis(500));
        assert_eq!(pages_asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn a_read_ahead_is_said_on_the_wire_and_older_requests_are_demand_reads() {
        let page = |read_ahead| LocalRequest::Page {
            token: None,
            uri: "s3://bucket/k".into(),
            etag: "e".into(),
            offset: 0,
            len: 10,
            inline: true,
            read_ahead,
            cached_only: false,
        };
        let sent = serde_json::to_string(&page(true)).unwrap();
        assert!(sent.contains("\"read_ahead\":true"), "{sent}");
        let demand = serde_json::to_string(&page(false)).unwrap();
        assert!(!demand.contains("read_ahead"), "{demand}");
        assert!(!demand.contains("cached_only"), "{demand}");
        let mut cached_only = page(false);
        if let LocalRequest::Page { cached_only: c, .. } = &mut cached_only {
            *c = true;
        }
        let sent = serde_json::to_string(&cached_only).unwrap();
        assert!(sent.contains("\"cached_only\":true"), "{sent}");
        assert_eq!(
            serde_json::from_str::<LocalRequest>(&sent).unwrap(),
            cached_only
        );
        // What a mount before read-ahead marking sends.
        let older =
            r#"{"op":"page","uri":"s3://bucket/k","etag":"e","offset":0,"len":10,"inline":true}"#;
        assert_eq!(
            serde_json::from_str::<LocalRequest>(older).unwrap(),
            page(false)
        );
    }

    #[test]
    fn an_oversized_message_is_refused_not_allocated() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&(u32::MAX).to_le_bytes()).unwrap();
        let e = recv_message(b.as_raw_fd()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn bytes_that_fail_their_crc_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p");
        let data = vec![7u8; 10_000];
        std::fs::write(&path, &data).unwrap();
        let grant = |crcs: Vec<u32>| PageGrant {
            file_offset: 0,
            read_len: 10_000,
            block: 4096,
            crcs,
            skip: 100,
            len: 50,
        };
        let good: Vec<u32> = data.chunks(4096).map(crc32c::crc32c).collect();
        let open = || OwnedFd::from(std::fs::File::open(&path).unwrap());
        let got = read_checked(open(), &grant(good.clone())).unwrap();
        assert_eq!(&got[..], &data[100..150]);
        let mut bad = good;
        bad[2] ^= 1;
        assert!(matches!(
            read_checked(open(), &grant(bad)),
            Err(LocalError::Corrupt { block: 2 })
        ));
    }
}
