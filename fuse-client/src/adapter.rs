//! The kernel side: a thin `fuser::Filesystem` that runs each request on
//! the tokio runtime against [`Fs`] and maps typed errors to errno.

use std::ffi::OsStr;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use fuser::{
    AccessFlags, BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::error::{Chain, FsError};
use crate::fs::{Creator, Fs, SetAttr};
use crate::inode::Inode;
use crate::passthrough::Passthrough;
use crate::posix::FileType as PosixType;

/// Largest single read or write the kernel sends.
pub const MAX_IO_BYTES: u32 = 1 << 20;
/// `st_blksize` while a writer has the file open: stdio and Python then
/// buffer this much per write, and each write is one FUSE request.
const WRITE_BLOCK_SIZE: u32 = 1 << 20;
/// `st_blksize` otherwise: 4 KiB, what local disks report. Reads are
/// cheap at any size here (the kernel's page cache and read-ahead, or
/// passthrough from the tier), and programs size their buffers by it:
/// Python 3.11's BufferedReader takes `st_blksize` when above its 8 KiB
/// default, and serves each read larger than its buffer partly by filling
/// the buffer and copying out of it. NumPy's NPZ reader (DLIO's UNet3D)
/// asks for 256 KiB at a time: at a 128 KiB hint its loaders made 23-35%
/// more user-space copies than from local disk (perf, warm epochs).
const READ_BLOCK_SIZE: u32 = 4 << 10;

#[derive(Clone)]
pub struct KernelAdapter {
    fs: Arc<Fs>,
    runtime: tokio::runtime::Handle,
    passthrough: Arc<Passthrough>,
    worker_waits: Arc<WaitSlots>,
}

/// How many kernel-request threads may wait on this host's worker at
/// once (see [`Fs::read_now`]): all but one, so that a slow worker never
/// holds every thread and other requests (other files, `getattr`) are
/// still taken.
struct WaitSlots(Arc<tokio::sync::Semaphore>);

impl WaitSlots {
    fn new(threads: usize) -> Self {
        Self(Arc::new(tokio::sync::Semaphore::new(
            threads.saturating_sub(1),
        )))
    }

    /// A slot while the permit lives; `None` when all are taken.
    fn try_take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.clone().try_acquire_owned().ok()
    }
}

fn errno(e: &FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn name_str(name: &OsStr) -> Result<&str, FsError> {
    name.to_str()
        .ok_or_else(|| FsError::InvalidName("names must be UTF-8 (S3 keys are)".into()))
}

fn log_refusal(op: &'static str, e: &FsError) {
    match e {
        FsError::NotFound | FsError::Exists | FsError::NotEmpty | FsError::NameTooLong => {
            tracing::debug!(op, error = %e, "fuse op failed")
        }
        FsError::UploadFailed(_) | FsError::DataPlane(_) | FsError::Task(_) | FsError::Stale => {
            tracing::error!(op, error = %Chain(e), "fuse op failed")
        }
        _ => tracing::warn!(op, error = %Chain(e), "fuse op refused"),
    }
}

impl KernelAdapter {
    /// `threads`: the kernel-request threads serving it.
    pub fn new(fs: Arc<Fs>, runtime: tokio::runtime::Handle, threads: usize) -> Self {
        runtime.spawn(Fs::housekeeping(Arc::downgrade(&fs)));
        runtime.spawn(store_metadata_changes(Arc::downgrade(&fs)));
        // Passthrough hands the kernel the local tier's whole objects,
        // and staged files for write-back (see `staged.rs`).
        let passthrough = Arc::new(Passthrough::new(true, Arc::downgrade(&fs)));
        Self {
            fs,
            runtime,
            passthrough,
            worker_waits: Arc::new(WaitSlots::new(threads)),
        }
    }

    fn attr(&self, node: &Inode) -> FileAttr {
        let a = self.fs.attrs(node);
        let nlink = if a.kind == PosixType::Directory { 2 } else { 1 };
        let size = if a.kind == PosixType::Directory {
            0
        } else {
            node.meta.size
        };
        FileAttr {
            ino: INodeNo(node.ino),
            size,
            blocks: size.div_ceil(512),
            atime: a.atime,
            mtime: a.mtime,
            ctime: a.ctime,
            crtime: a.mtime,
            kind: kernel_type(a.kind),
            perm: (a.perm & 0o7777) as u16,
            nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            blksize: if node.writer.is_some() {
                WRITE_BLOCK_SIZE
            } else {
                READ_BLOCK_SIZE
            },
            flags: 0,
        }
    }

    /// Runs `op` on the runtime with a span; `reply` gets its result.
    fn spawn<T, Fut>(
        &self,
        op: &'static str,
        ino: u64,
        fut: impl FnOnce(Arc<Fs>) -> Fut + Send + 'static,
        reply: impl FnOnce(Result<T, FsError>) + Send + 'static,
    ) where
        Fut: Future<Output = Result<T, FsError>> + Send + 'static,
        T: Send + 'static,
    {
        self.spawn_at(op, ino, None, fut, reply)
    }

    /// [`Self::spawn`] for an operation at `(offset, size)` of a file;
    /// every operation is timed, counted by errno, and listed in the
    /// in-flight table while it runs.
    fn spawn_at<T, Fut>(
        &self,
        op: &'static str,
        ino: u64,
        at: Option<(u64, u64)>,
        fut: impl FnOnce(Arc<Fs>) -> Fut + Send + 'static,
        reply: impl FnOnce(Result<T, FsError>) + Send + 'static,
    ) where
        Fut: Future<Output = Result<T, FsError>> + Send + 'static,
        T: Send + 'static,
    {
        let path = self.fs.key_of(ino);
        self.spawn_op(op, ino, path, at, fut, reply)
    }

    /// [`Self::spawn`] for an operation on `name` in directory `parent`:
    /// the in-flight table shows the child's path, not the directory's.
    fn spawn_child<T, Fut>(
        &self,
        op: &'static str,
        parent: u64,
        name: &str,
        fut: impl FnOnce(Arc<Fs>) -> Fut + Send + 'static,
        reply: impl FnOnce(Result<T, FsError>) + Send + 'static,
    ) where
        Fut: Future<Output = Result<T, FsError>> + Send + 'static,
        T: Send + 'static,
    {
        let dir = self.fs.key_of(parent);
        let path = if dir.is_empty() || dir.ends_with('/') {
            format!("{dir}{name}")
        } else {
            format!("{dir}/{name}")
        };
        self.spawn_op(op, parent, path, None, fut, reply)
    }

    fn spawn_op<T, Fut>(
        &self,
        op: &'static str,
        ino: u64,
        path: String,
        at: Option<(u64, u64)>,
        fut: impl FnOnce(Arc<Fs>) -> Fut + Send + 'static,
        reply: impl FnOnce(Result<T, FsError>) + Send + 'static,
    ) where
        Fut: Future<Output = Result<T, FsError>> + Send + 'static,
        T: Send + 'static,
    {
        let fs = self.fs.clone();
        let span = tracing::debug_span!("fuse", op, ino);
        let metrics = crate::metrics::global();
        let guard = metrics.inflight.start(
            op,
            path,
            at.map(|(offset, _)| offset),
            at.map(|(_, size)| size),
        );
        let started = std::time::Instant::now();
        self.runtime.spawn(tracing::Instrument::instrument(
            async move {
                let result = guard.op().scope(fut(fs)).await;
                let failed = result.as_ref().err().map(FsError::errno);
                metrics.op(op, started.elapsed(), failed);
                if let Err(e) = &result {
                    log_refusal(op, e);
                }
                drop(guard);
                reply(result);
            },
            span,
        ));
    }

    /// A read the node-local tier, fetched read-ahead or this host's
    /// worker's cache holds, served on this kernel-request thread: no hop
    /// to the runtime and back (a random reader of a whole tier copy, a
    /// cold stream once its read-ahead is ahead, and a sample reader of
    /// cached data are bound by that hop).
    fn read_ready_now(&self, ino: u64, fh: u64, offset: u64, size: u32) -> Option<bytes::Bytes> {
        let span = tracing::debug_span!("fuse", op = "read", ino);
        let _in_span = span.enter();
        let _in_runtime = self.runtime.enter();
        let started = std::time::Instant::now();
        let may_wait = self.worker_waits.try_take();
        let bytes = self.fs.read_now(fh, offset, size, may_wait.is_some())?;
        drop(may_wait);
        let metrics = crate::metrics::global();
        metrics.op("read", started.elapsed(), None);
        metrics.read(bytes.len() as u64);
        Some(bytes)
    }

    fn refuse(&self, op: &'static str, e: FsError) -> Errno {
        log_refusal(op, &e);
        errno(&e)
    }
}

impl Filesystem for KernelAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let wanted = InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_AUTO_INVAL_DATA;
        for flag in wanted.iter() {
            if config.add_capabilities(flag).is_err() {
                tracing::info!(?flag, "kernel lacks a FUSE capability");
            }
        }
        if self.passthrough.enabled() {
            // Depth 2: the tier's files may sit on overlayfs (containers).
            let granted = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(2).is_ok();
            if !granted {
                self.passthrough
                    .disable("the kernel does not offer FUSE_PASSTHROUGH");
            }
        }
        let _ = config.set_max_write(MAX_IO_BYTES);
        let _ = config.set_max_readahead(MAX_IO_BYTES);
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = match name_str(name) {
            Ok(n) => n.to_string(),
            Err(e) => return reply.error(self.refuse("lookup", e)),
        };
        let ttl = self.fs.config().entry_ttl;
        let this = self.clone();
        self.spawn_child(
            "lookup",
            parent.0,
            &name.clone(),
            move |fs| async move { fs.lookup(parent.0, &name).await },
            move |r| match r {
                Ok(node) => reply.entry(&ttl, &this.attr(&node), Generation(0)),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let ttl = self.fs.config().attr_ttl;
        // Answered on this kernel-request thread where nothing need be
        // asked: a reader's every open after a read of the file sends one
        // (the kernel drops its cached atime on each passthrough read),
        // and the hop to the runtime is most of its wait on a busy node.
        let started = std::time::Instant::now();
        if let Some(node) = self.fs.getattr_now(ino.0) {
            let _in_span = tracing::debug_span!("fuse", op = "getattr", ino = ino.0).entered();
            crate::metrics::global().op("getattr", started.elapsed(), None);
            return reply.attr(&ttl, &self.attr(&node));
        }
        let this = self.clone();
        self.spawn(
            "getattr",
            ino.0,
            move |fs| async move { fs.getattr_asking(ino.0).await },
            move |r| match r {
                Ok(node) => reply.attr(&ttl, &this.attr(&node)),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let ttl = self.fs.config().attr_ttl;
        let this = self.clone();
        let when = |t: TimeOrNow| match t {
            TimeOrNow::SpecificTime(t) => t,
            TimeOrNow::Now => SystemTime::now(),
        };
        let change = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(when),
            mtime: mtime.map(when),
            fh: fh.map(|f| f.0),
        };
        self.spawn(
            "setattr",
            ino.0,
            move |fs| async move { fs.setattr(ino.0, change).await },
            move |r| match r {
                Ok(node) => reply.attr(&ttl, &this.attr(&node)),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let name = match name_str(name) {
            Ok(n) => n.to_string(),
            Err(e) => return reply.error(self.refuse("mknod", e)),
        };
        let who = creator(req, mode);
        let this = self.clone();
        self.spawn(
            "mknod",
            parent.0,
            move |fs| async move { fs.mknod(parent.0, &name, mode, rdev, who).await },
            move |r| this.reply_entry(reply, r),
        );
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.spawn(
            "readlink",
            ino.0,
            move |fs| async move { fs.readlink(ino.0).await },
            move |r| match r {
                Ok(target) => reply.data(target.as_bytes()),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let name = match name_str(name) {
            Ok(n) => n.to_string(),
            Err(e) => return reply.error(self.refuse("mkdir", e)),
        };
        let who = creator(req, mode);
        let this = self.clone();
        self.spawn(
            "mkdir",
            parent.0,
            move |fs| async move { fs.mkdir(parent.0, &name, who).await },
            move |r| this.reply_entry(reply, r),
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = match name_str(name) {
            Ok(n) => n.to_string(),
            Err(e) => return reply.error(self.refuse("unlink", e)),
        };
        self.spawn(
            "unlink",
            parent.0,
            move |fs| async move { fs.unlink(parent.0, &name).await },
            move |r| empty_reply(reply, r),
        );
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = match name_str(name) {
            Ok(n) => n.to_string(),
            Err(e) => return reply.error(self.refuse("rmdir", e)),
        };
        self.spawn(
            "rmdir",
            parent.0,
            move |fs| async move { fs.rmdir(parent.0, &name).await },
            move |r| empty_reply(reply, r),
        );
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let names = name_str(link_name).and_then(|n| {
            let t = target
                .to_str()
                .ok_or_else(|| FsError::InvalidName("link targets must be UTF-8".into()))?;
            Ok((n.to_string(), t.to_string()))
        });
        let (name, target) = match names {
            Ok(n) => n,
            Err(e) => return reply.error(self.refuse("symlink", e)),
        };
        let who = creator(req, 0o777);
        let this = self.clone();
        self.spawn(
            "symlink",
            parent.0,
            move |fs| async move { fs.symlink(parent.0, &name, &target, who).await },
            move |r| this.reply_entry(reply, r),
        );
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let names =
            name_str(name).and_then(|a| Ok((a.to_string(), name_str(newname)?.to_string())));
        let (name, newname) = match names {
            Ok(n) => n,
            Err(e) => return reply.error(self.refuse("rename", e)),
        };
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return reply.error(self.refuse(
                "rename",
                FsError::Unsupported("RENAME_EXCHANGE and RENAME_WHITEOUT"),
            ));
        }
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let pid = req.pid();
        self.spawn(
            "rename",
            parent.0,
            move |fs| async move {
                fs.rename(parent.0, &name, newparent.0, &newname, no_replace, pid)
                    .await
            },
            move |r| empty_reply(reply, r),
        );
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(self.refuse(
            "link",
            FsError::NotPermitted("hard links cannot be stored in S3"),
        ));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let pid = req.pid();
        let passthrough = self.passthrough.clone();
        let read_only = flags.0 & libc::O_ACCMODE == libc::O_RDONLY;
        let wants_file = passthrough.enabled() && read_only;
        let staging = passthrough.enabled() && !read_only;
        let fs = self.fs.clone();
        self.spawn(
            "open",
            ino.0,
            move |fs| async move {
                let (fh, keep_cache) = fs.open(ino.0, flags.0, pid).await?;
                let file = if wants_file {
                    fs.passthrough_file(fh).await
                } else {
                    None
                };
                let staged = match staging {
                    true => fs.stage_writes(fh).await,
                    false => None,
                };
                Ok((fh, keep_cache, file, staged))
            },
            move |r| match r {
                Ok((fh, _, _, Some(staged))) => {
                    let backing = passthrough.stage(ino.0, fh, &staged, |f| reply.open_backing(f));
                    match backing {
                        Some(id) => {
                            reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id)
                        }
                        None => {
                            fs.unstage(fh);
                            passthrough.reply_open(reply, ino.0, fh, FopenFlags::empty(), None)
                        }
                    }
                }
                Ok((fh, keep_cache, file, None)) => {
                    let mut flags = if keep_cache {
                        FopenFlags::FOPEN_KEEP_CACHE
                    } else {
                        FopenFlags::empty()
                    };
                    // A read handle's flush does nothing here (no locks are
                    // held by the mount), so its close need not wait for
                    // one: a round trip less per file a loader reads.
                    if read_only {
                        flags |= FopenFlags::FOPEN_NOFLUSH;
                    }
                    passthrough.reply_open(reply, ino.0, fh, flags, file)
                }
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        tracing::trace!(ino = ino.0, offset, size, "fuse read");
        if let Some(bytes) = self.read_ready_now(ino.0, fh.0, offset, size) {
            return reply.data(&bytes);
        }
        self.spawn_at(
            "read",
            ino.0,
            Some((offset, u64::from(size))),
            move |fs| async move { fs.read(fh.0, offset, size).await },
            move |r| match r {
                Ok(bytes) => {
                    crate::metrics::global().read(bytes.len() as u64);
                    reply.data(&bytes)
                }
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // The one copy: the kernel's buffer is only borrowed for this call.
        // Into a pooled buffer: a fresh 1 MiB allocation per request would
        // fault in (and later unmap) 256 pages every time.
        let data = {
            let mut buf = lakecache_protocol::buffer_pool::take(data.len());
            buf.extend_from_slice(data);
            lakecache_protocol::buffer_pool::freeze(buf)
        };
        let size = data.len() as u64;
        self.spawn_at(
            "write",
            ino.0,
            Some((offset, size)),
            move |fs| async move { fs.write(fh.0, offset, data).await },
            move |r| match r {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let pid = req.pid();
        self.spawn(
            "flush",
            ino.0,
            move |fs| async move { fs.flush(fh.0, pid).await },
            move |r| empty_reply(reply, r),
        );
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        tracing::trace!(ino = ino.0, fh = fh.0, "fuse release");
        self.passthrough.released(fh.0);
        self.spawn(
            "release",
            ino.0,
            move |fs| async move { fs.release(fh.0).await },
            move |r| empty_reply(reply, r),
        );
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn(
            "fsync",
            ino.0,
            move |fs| async move { fs.fsync(fh.0).await },
            move |r| empty_reply(reply, r),
        );
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.spawn(
            "opendir",
            ino.0,
            move |fs| async move { fs.opendir(ino.0).await },
            move |r| match r {
                Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let this = self.clone();
        self.spawn(
            "readdir",
            ino.0,
            move |fs| async move { fs.readdir(ino.0, fh.0, offset, false).await },
            move |r| {
                let entries = match r {
                    Ok(e) => e,
                    Err(e) => return reply.error(errno(&e)),
                };
                for entry in &entries {
                    let kind = kernel_type(this.fs.attrs(&entry.node).kind);
                    let next = entry.offset;
                    if reply.add(INodeNo(entry.node.ino), next, kind, &entry.name) {
                        break;
                    }
                }
                reply.ok();
            },
        );
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let this = self.clone();
        self.spawn(
            "readdirplus",
            ino.0,
            move |fs| async move { fs.readdir(ino.0, fh.0, offset, true).await },
            move |r| {
                let entries = match r {
                    Ok(e) => e,
                    Err(e) => return reply.error(errno(&e)),
                };
                let ttl = this.fs.config().entry_ttl;
                let mut full = false;
                for entry in &entries {
                    let counted = entry.name != "." && entry.name != "..";
                    let next = entry.offset;
                    full = full
                        || reply.add(
                            INodeNo(entry.node.ino),
                            next,
                            &entry.name,
                            &ttl,
                            &this.attr(&entry.node),
                            Generation(0),
                        );
                    // The kernel counts a lookup for every entry it took
                    // but `.` and `..`; inodes made for entries that did
                    // not fit are released at once.
                    if counted {
                        if full {
                            this.fs.forget(entry.node.ino, 0);
                        } else {
                            this.fs.add_lookup(entry.node.ino);
                        }
                    }
                }
                reply.ok();
            },
        );
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Names are in S3 when their call returns; metadata changes may
        // wait for the coalescing window: store them now.
        self.spawn(
            "fsyncdir",
            0,
            move |fs| async move { fs.sync_metadata().await },
            move |r| empty_reply(reply, r),
        );
    }

    fn destroy(&mut self) {
        // fuser may call this from inside the runtime (an unmount during
        // shutdown): block on a thread of its own, never on a runtime one.
        if !self.fs.has_unstored_metadata() {
            return;
        }
        let (fs, runtime) = (self.fs.clone(), self.runtime.clone());
        let stored = std::thread::spawn(move || runtime.block_on(fs.sync_metadata())).join();
        match stored {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!(error = %Chain(&e), "metadata changes could not be stored at unmount")
            }
            Err(_) => tracing::error!("storing metadata changes at unmount failed"),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // S3 has no capacity; report plenty so tools do not refuse to write.
        const BLOCKS: u64 = 1 << 40;
        reply.statfs(BLOCKS, BLOCKS, BLOCKS, 1 << 32, 1 << 32, 4096, 255, 4096);
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(self.refuse("setxattr", FsError::Unsupported("extended attributes")));
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        // ENOSYS once makes the kernel answer EOPNOTSUPP itself from then
        // on: `ls -l` asks for ACL and security labels on every entry, and
        // 100,000 round trips to the daemon cost seconds.
        reply.error(Errno::from_i32(libc::ENOSYS));
    }

    #[allow(clippy::too_many_arguments)]
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        // Tools probe every file they open (isatty's TCGETS, FS_IOC_*):
        // "not a terminal / no such control", quietly, as a plain file says.
        tracing::trace!(cmd, "ioctl");
        reply.error(Errno::from_i32(libc::ENOTTY));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: ReplyXattr) {
        reply.error(Errno::from_i32(libc::ENOSYS));
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(self.refuse("removexattr", FsError::Unsupported("extended attributes")));
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // default_permissions: the kernel checks modes itself.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let name = match name_str(name) {
            Ok(n) => n.to_string(),
            Err(e) => return reply.error(self.refuse("create", e)),
        };
        let pid = req.pid();
        let who = creator(req, mode);
        let ttl = self.fs.config().entry_ttl;
        let this = self.clone();
        let staging = self.passthrough.enabled();
        self.spawn(
            "create",
            parent.0,
            move |fs| async move {
                let (node, fh) = fs.create(parent.0, &name, pid, who, flags).await?;
                let staged = match staging {
                    true => fs.stage_writes(fh).await,
                    false => None,
                };
                Ok((node, fh, staged))
            },
            move |r| match r {
                Ok((node, fh, staged)) => {
                    let attr = this.attr(&node);
                    if let Some(file) = staged {
                        let backing = this
                            .passthrough
                            .stage(node.ino, fh, &file, |f| reply.open_backing(f));
                        if let Some(id) = backing {
                            return reply.created_passthrough(
                                &ttl,
                                &attr,
                                Generation(0),
                                FileHandle(fh),
                                FopenFlags::empty(),
                                &id,
                            );
                        }
                        this.fs.unstage(fh);
                    }
                    reply.created(
                        &ttl,
                        &attr,
                        Generation(0),
                        FileHandle(fh),
                        FopenFlags::empty(),
                    )
                }
                Err(e) => reply.error(errno(&e)),
            },
        );
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(self.refuse(
            "fallocate",
            FsError::Unsupported("preallocation (objects are written sequentially)"),
        ));
    }
}

impl KernelAdapter {
    fn reply_entry(&self, reply: ReplyEntry, r: Result<Inode, FsError>) {
        match r {
            Ok(node) => reply.entry(
                &self.fs.config().entry_ttl,
                &self.attr(&node),
                Generation(0),
            ),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

/// The caller of a creating request, and the mode it asked for (the
/// kernel has applied the umask).
fn creator(req: &Request, mode: u32) -> Creator {
    Creator {
        uid: req.uid(),
        gid: req.gid(),
        perm: mode & 0o7777,
    }
}

fn kernel_type(kind: PosixType) -> FileType {
    match kind {
        PosixType::Regular => FileType::RegularFile,
        PosixType::Directory => FileType::Directory,
        PosixType::Symlink => FileType::Symlink,
        PosixType::Fifo => FileType::NamedPipe,
        PosixType::Socket => FileType::Socket,
        PosixType::CharDevice => FileType::CharDevice,
        PosixType::BlockDevice => FileType::BlockDevice,
    }
}

/// Stores metadata changes once their coalescing window has passed,
/// while the mount lives.
async fn store_metadata_changes(fs: std::sync::Weak<Fs>) {
    loop {
        tokio::time::sleep(crate::fs::METADATA_DELAY / 2).await;
        let Some(fs) = fs.upgrade() else { return };
        fs.store_due_metadata().await;
    }
}

fn empty_reply(reply: ReplyEmpty, r: Result<(), FsError>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_kernel_request_thread_is_always_left_free_of_worker_waits() {
        let slots = Arc::new(WaitSlots::new(4));
        let taken: Vec<_> = (0..3).map(|_| slots.try_take().unwrap()).collect();
        assert!(slots.try_take().is_none(), "a fourth thread would wait too");
        drop(taken);
        let again = slots.try_take();
        assert!(again.is_some(), "slots come back when the waits end");
        // One thread: it never waits on the worker.
        assert!(Arc::new(WaitSlots::new(1)).try_take().is_none());
    }
}
