//! Attributes kept in S3 user metadata: `stat` fields from it, `chmod`,
//! `chown`, `utimensat` and `truncate` into it, symbolic links and
//! special files as small objects, and the coalesced copies that store
//! metadata changes of committed objects.

use std::collections::HashMap;
use std::time::{Instant, SystemTime};

use lakecache_protocol::UserMeta;

use super::{meta_of, now_ms, Fs, Handle};
use crate::data_plane::{ByteStream, DataError};
use crate::error::FsError;
use crate::inode::{Inode, Kind, Meta};
use crate::posix::{self, Attrs, Defaults, FileType};

/// Metadata changes to a committed object made within this window are
/// stored with one copy (`rsync` and `tar` chown, chmod and set times
/// one after another). Like a local file system's journal commit
/// interval; `fsync` stores them at once.
pub const METADATA_DELAY: std::time::Duration = std::time::Duration::from_millis(50);
/// Longest symbolic link target (Linux's PATH_MAX less the NUL).
const MAX_LINK_BYTES: usize = 4095;
/// Piece size of a truncate's rewrite.
const REWRITE_CHUNK: u64 = 4 << 20;

/// What `setattr` was asked to change.
#[derive(Debug, Default, Clone)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SystemTime>,
    pub mtime: Option<SystemTime>,
    /// The handle of an `ftruncate`, when the kernel names one.
    pub fh: Option<u64>,
}

/// Who creates a file: its owner, and the mode bits asked for (after
/// the umask, which the kernel applies).
#[derive(Debug, Clone, Copy)]
pub struct Creator {
    pub uid: u32,
    pub gid: u32,
    pub perm: u32,
}

/// Inodes whose metadata changed here and when it first did.
#[derive(Default)]
pub(super) struct DirtyMeta(std::sync::Mutex<HashMap<u64, Instant>>);

impl DirtyMeta {
    fn mark(&self, ino: u64) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(ino).or_insert_with(Instant::now);
    }

    /// Inodes changed at least `age` ago (all with a zero age).
    fn due(&self, age: std::time::Duration) -> Vec<u64> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.iter()
            .filter(|(_, at)| at.elapsed() >= age)
            .map(|(ino, _)| *ino)
            .collect()
    }

    fn clear(&self, ino: u64) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ino);
    }
}

impl Fs {
    fn defaults(&self) -> Defaults {
        Defaults {
            uid: self.config.uid,
            gid: self.config.gid,
            file_mode: self.config.file_mode,
            dir_mode: self.config.dir_mode,
        }
    }

    /// The attributes `stat` shows for `node`.
    pub fn attrs(&self, node: &Inode) -> Attrs {
        let empty = UserMeta::new();
        let user = node.meta.user.as_ref().unwrap_or(&empty);
        posix::decode(user, node.kind, node.meta.mtime_ms, &self.defaults())
    }

    /// User metadata of a new object made by `who` in `parent`: a
    /// directory with the set-group-id bit passes its group on (and, to
    /// subdirectories, the bit), as on Linux file systems.
    pub(super) fn new_object_meta(
        &self,
        parent: &Inode,
        kind: FileType,
        who: Creator,
        rdev: u32,
    ) -> UserMeta {
        let parent_attrs = self.attrs(parent);
        let inherit = parent_attrs.perm & libc::S_ISGID != 0;
        let mut perm = who.perm & 0o7777;
        if inherit && kind == FileType::Directory {
            perm |= libc::S_ISGID;
        }
        let now = SystemTime::now();
        let attrs = Attrs {
            kind,
            perm,
            uid: who.uid,
            gid: if inherit { parent_attrs.gid } else { who.gid },
            rdev,
            atime: now,
            mtime: now,
            ctime: now,
        };
        let mut user = UserMeta::new();
        posix::encode(&attrs, &mut user);
        user
    }

    /// The object's metadata with its user metadata known: a listing's
    /// entry is completed by a stat (of the directory marker, for a
    /// directory; one without a marker has none).
    pub(super) async fn with_user_meta(
        &self,
        kind: Kind,
        key: &str,
        listed: Meta,
    ) -> Result<Meta, FsError> {
        if listed.user.is_some() {
            return Ok(listed);
        }
        if !self.config.posix_metadata || key.is_empty() {
            return Ok(Meta {
                user: Some(UserMeta::new()),
                ..listed
            });
        }
        let stat = self.data.stat(&self.uri(key)?).await;
        match (kind, stat) {
            (Kind::File, Ok(stat)) => Ok(meta_of(&stat)),
            (Kind::Dir, Ok(stat)) => Ok(Meta {
                user: Some(stat.meta),
                ..listed
            }),
            (Kind::Dir, Err(DataError::NotFound)) => Ok(Meta {
                user: Some(UserMeta::new()),
                ..listed
            }),
            (_, Err(e)) => Err(e.into()),
        }
    }

    pub async fn setattr(&self, ino: u64, change: SetAttr) -> Result<Inode, FsError> {
        let mut node = self.getattr(ino).await?;
        if let Some(size) = change.size {
            node = self.truncate(node, size, change.fh).await?;
        }
        let mut attrs = self.attrs(&node);
        let before = attrs;
        if let Some(mode) = change.mode {
            attrs.perm = mode & 0o7777;
        }
        if let Some(uid) = change.uid {
            attrs.uid = uid;
        }
        if let Some(gid) = change.gid {
            attrs.gid = gid;
        }
        if let Some(t) = change.atime {
            attrs.atime = t;
        }
        if let Some(t) = change.mtime {
            attrs.mtime = t;
        }
        let touched = change.mode.is_some()
            || change.uid.is_some()
            || change.gid.is_some()
            || change.atime.is_some()
            || change.mtime.is_some();
        if !touched || (attrs == before && change.size.is_some()) {
            return Ok(node);
        }
        attrs.ctime = SystemTime::now();
        self.set_attrs(&node, &attrs).await
    }

    /// A writing handle let go of `ino`: attributes changed after its
    /// upload finished, while the handle still held the inode, are now
    /// stored by a copy (the store skips an inode with a writer).
    pub(super) fn writer_released(&self, ino: u64, fh: u64) {
        let dirty = self.inodes.update(ino, |n| {
            if n.writer == Some(fh) {
                n.writer = None;
            }
            n.writer.is_none() && n.meta_dirty
        });
        if dirty == Some(true) {
            self.dirty_meta.mark(ino);
        }
    }

    /// Makes `attrs` the node's attributes here at once; S3 gets them
    /// with the open upload's commit, or by a coalesced copy.
    pub(super) async fn set_attrs(&self, node: &Inode, attrs: &Attrs) -> Result<Inode, FsError> {
        let mut user = node.meta.user.clone().unwrap_or_default();
        posix::encode(attrs, &mut user);
        // An upload still to finish carries the attributes. One that has
        // finished (closed, its handle not yet released) does not: they
        // are stored by a copy, like any closed file's.
        let mut writing = false;
        if let Some(fh) = node.writer {
            if let Ok(Handle::Write { writer, .. }) = self.handle(fh) {
                let mut w = writer.lock().await;
                if !w.is_finished() {
                    w.set_meta_explicitly(user.clone());
                    writing = true;
                }
            }
        }
        let updated = self
            .inodes
            .update(node.ino, |n| {
                n.meta.user = Some(user);
                n.validated = Instant::now();
                if !writing {
                    n.meta_dirty = true;
                }
                n.clone()
            })
            .ok_or(FsError::NotFound)?;
        if !writing {
            self.dirty_meta.mark(node.ino);
        }
        // A listing taken before this change would show the old modes.
        self.dir_changed(node.parent);
        Ok(updated)
    }

    /// Sets the size of a committed object (or of the open upload) by
    /// rewriting it whole through the cache, up to the configured size.
    async fn truncate(&self, node: Inode, size: u64, fh: Option<u64>) -> Result<Inode, FsError> {
        if node.kind == Kind::Dir {
            return Err(FsError::IsDir);
        }
        if self.attrs(&node).kind != FileType::Regular {
            return Err(FsError::InvalidName(
                "only regular files can be truncated".into(),
            ));
        }
        // The object is about to change: nothing more is pushed into the
        // kernel's page cache for the old version (see `kernel_cache`).
        self.inodes.update(node.ino, |n| n.page_cache_etag = None);
        self.kernel_cache().settle(node.ino).await;
        // A handle changing the file in place takes the new size.
        for candidate in [fh, node.writer].into_iter().flatten() {
            if let Ok(Handle::Update(u)) = self.handle(candidate) {
                self.update_set_len(candidate, &u, size).await?;
                return self.node(node.ino);
            }
        }
        if let Some(fh) = node.writer {
            if let Ok(Handle::Write { writer, .. }) = self.handle(fh) {
                let mut w = writer.lock().await;
                w.set_len(size)?;
                let shown = w.size();
                return self
                    .inodes
                    .update(node.ino, |n| {
                        n.meta.size = shown;
                        n.clone()
                    })
                    .ok_or(FsError::NotFound);
            }
        }
        let old = node.meta.size;
        if size != 0 && size.max(old) > self.config.truncate_rewrite_max {
            return Err(FsError::Unsupported(
                "truncating an object larger than --truncate-rewrite-max (it is rewritten whole)",
            ));
        }
        let mut user = node.meta.user.clone().unwrap_or_default();
        let mut attrs = self.attrs(&node);
        let now = SystemTime::now();
        (attrs.mtime, attrs.ctime) = (now, now);
        posix::encode(&attrs, &mut user);
        let uri = self.uri(&node.key)?;
        let keep = size.min(old);
        let stat = if keep == 0 && size == 0 {
            self.put_object(&node.key, bytes::Bytes::new(), &user)
                .await?
        } else {
            let etag = node.meta.etag.clone().ok_or(FsError::NotFound)?;
            // Fed by a task: the kept bytes, read piece by piece, then
            // zeros. A failed read ends the body early; the size check
            // below refuses the short object.
            let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(2);
            let (data, read_uri) = (self.data.clone(), uri.clone());
            let feeder = tokio::spawn(async move {
                let mut at = 0;
                while at < size {
                    let end = (at + REWRITE_CHUNK).min(size);
                    let piece = if at < keep {
                        let end = end.min(keep);
                        crate::data_plane::read_exact(data.as_ref(), &read_uri, at..end, &etag)
                            .await?
                    } else {
                        bytes::Bytes::from(vec![0u8; (end - at) as usize])
                    };
                    at += piece.len() as u64;
                    if tx.send(piece).await.is_err() {
                        break;
                    }
                }
                Ok::<(), DataError>(())
            });
            let body: ByteStream = Box::pin(futures::stream::poll_fn(move |cx| {
                rx.poll_recv(cx).map(|piece| piece.map(Ok))
            }));
            let mode = self.config.write_mode_for(&node.key);
            let stored = self
                .data
                .upload(&uri, body, self.config.upload_limits(), mode, &user, &[])
                .await;
            match feeder.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(FsError::from(e)),
                Err(e) => return Err(FsError::Task(e)),
            }
            let stat = stored?;
            if stat.size != size {
                return Err(FsError::UploadFailed(DataError::SizeMismatch {
                    stored: stat.size,
                    sent: size,
                }));
            }
            stat
        };
        let meta = meta_of(&stat);
        self.dir_changed(node.parent);
        // Handles open for reading see the new size, as on a local file
        // system (it is the same file).
        self.readers_switch(node.ino, &stat.etag, stat.size).await;
        self.inodes
            .update(node.ino, |n| {
                n.meta = meta;
                n.meta_dirty = false;
                n.validated = Instant::now();
                n.page_cache_etag = None;
                n.clone()
            })
            .ok_or(FsError::NotFound)
    }

    /// Stores the metadata changes older than the coalescing window.
    pub async fn store_due_metadata(&self) {
        for ino in self.dirty_meta.due(METADATA_DELAY) {
            if let Err(e) = self.store_metadata(ino).await {
                tracing::warn!(ino, error = %crate::error::Chain(&e), "storing changed metadata failed; retrying");
            }
        }
    }

    /// True while metadata changes wait to be stored in S3.
    pub fn has_unstored_metadata(&self) -> bool {
        !self.dirty_meta.due(std::time::Duration::ZERO).is_empty()
    }

    /// Stores every pending metadata change now (fsync of a directory,
    /// unmount).
    pub async fn sync_metadata(&self) -> Result<(), FsError> {
        let mut first_error = None;
        for ino in self.dirty_meta.due(std::time::Duration::ZERO) {
            if let Err(e) = self.store_metadata(ino).await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Copies the object onto itself with its new user metadata (a
    /// directory without a marker gets one).
    pub(super) async fn store_metadata(&self, ino: u64) -> Result<(), FsError> {
        // Read under the lock: a rename that ran first changed the key.
        let _turn = self.object_locks.lock(ino).await;
        let Some(node) = self.inodes.get(ino) else {
            self.dirty_meta.clear(ino);
            return Ok(());
        };
        if !node.meta_dirty || node.writer.is_some() {
            self.dirty_meta.clear(ino);
            return Ok(());
        }
        let user = node.meta.user.clone().unwrap_or_default();
        let stored = if node.key.is_empty() {
            // The bucket's root has no object to carry metadata.
            Ok(None)
        } else {
            let uri = self.uri(&node.key)?;
            match self
                .data
                .copy(&uri, node.meta.etag.as_deref(), &uri, Some(&user))
                .await
            {
                Ok(stat) => Ok(Some(stat)),
                Err(DataError::NotFound) if node.kind == Kind::Dir => self
                    .put_object(&node.key, bytes::Bytes::new(), &user)
                    .await
                    .map(Some),
                Err(e) => Err(FsError::from(e)),
            }
        };
        let stat = match stored {
            Ok(stat) => stat,
            // Gone or replaced meanwhile: the newer object wins.
            Err(FsError::NotFound | FsError::Stale) => {
                tracing::debug!(key = %node.key, "object gone or replaced before its metadata was stored");
                None
            }
            Err(e) => return Err(e),
        };
        self.inodes.update(ino, |n| {
            if n.meta.user.as_ref() == Some(&user) {
                n.meta_dirty = false;
            }
            // What was asked of S3 before this store is older than it.
            n.validated = Instant::now();
            if let (Some(stat), Kind::File) = (&stat, n.kind) {
                n.meta.etag = Some(stat.etag.clone());
                n.meta.size = stat.size;
                n.meta.mtime_ms = stat.last_modified_ms;
            }
        });
        if let (Some(stat), Kind::File, Some(old)) = (&stat, node.kind, &node.meta.etag) {
            if stat.size == node.meta.size {
                self.readers_follow_copy(ino, old, &stat.etag).await;
            }
        }
        if !self.inodes.get(ino).is_some_and(|n| n.meta_dirty) {
            self.dirty_meta.clear(ino);
        }
        // Freed now if the kernel forgot it while it was dirty.
        self.inodes.forget(ino, 0);
        Ok(())
    }

    /// Handles reading `ino` read version `etag` (of `size` bytes) from
    /// now on: the file was rewritten in place (a truncate).
    async fn readers_switch(&self, ino: u64, etag: &str, size: u64) {
        for reader in self.readers_of(ino) {
            reader.lock().await.switch_version(etag.to_string(), size);
        }
    }

    pub(super) fn readers_of(
        &self,
        ino: u64,
    ) -> Vec<std::sync::Arc<tokio::sync::Mutex<crate::read::FileReader>>> {
        let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        handles
            .values()
            .filter_map(|h| match h {
                Handle::Read { reader, ino: i } if *i == ino => Some(reader.clone()),
                _ => None,
            })
            .collect()
    }

    /// Handles reading `ino` at version `from` read `etag` from now on:
    /// a copy in place that changed only metadata (a chmod stored while
    /// the file is open for reading).
    async fn readers_follow_copy(&self, ino: u64, from: &str, etag: &str) {
        for reader in self.readers_of(ino) {
            reader.lock().await.follow_copy(from, etag);
        }
    }

    /// An object with `data` and `meta` in the key's write mode.
    pub(super) async fn put_object(
        &self,
        key: &str,
        data: bytes::Bytes,
        meta: &UserMeta,
    ) -> Result<lakecache_protocol::ObjectStat, FsError> {
        let uri = self.uri(key)?;
        let stat = match self.config.write_mode_for(key) {
            lakecache_protocol::WriteMode::Back => {
                let body: ByteStream = Box::pin(futures::stream::iter([Ok(data)]));
                self.data
                    .upload(
                        &uri,
                        body,
                        self.config.upload_limits(),
                        lakecache_protocol::WriteMode::Back,
                        meta,
                        &[],
                    )
                    .await?
            }
            lakecache_protocol::WriteMode::Through => self.data.put(&uri, data, meta).await?,
        };
        Ok(stat)
    }

    /// Fails with EEXIST when `parent/name` exists.
    async fn check_absent(&self, parent: u64, name: &str) -> Result<(), FsError> {
        match self.resolve(parent, name).await {
            Ok(_) => Err(FsError::Exists),
            Err(FsError::NotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A new non-directory object holding `data`, with its metadata.
    async fn create_object(
        &self,
        parent: u64,
        name: &str,
        data: bytes::Bytes,
        user: UserMeta,
    ) -> Result<Inode, FsError> {
        let p = self.dir(parent)?;
        let key = self.child_key(&p, name, Kind::File)?;
        self.check_writable(&self.uri(&key)?)?;
        self.check_absent(parent, name).await?;
        let stat = self.put_object(&key, data, &user).await?;
        self.dir_changed(parent);
        let node = self
            .inodes
            .upsert(parent, name, Kind::File, key, meta_of(&stat));
        self.inodes.add_lookup(node.ino);
        Ok(node)
    }

    pub async fn symlink(
        &self,
        parent: u64,
        name: &str,
        target: &str,
        who: Creator,
    ) -> Result<Inode, FsError> {
        if target.is_empty() {
            return Err(FsError::NotFound);
        }
        if target.len() > MAX_LINK_BYTES {
            return Err(FsError::NameTooLong);
        }
        let p = self.dir(parent)?;
        let who = Creator { perm: 0o777, ..who };
        let user = self.new_object_meta(&p, FileType::Symlink, who, 0);
        let body = bytes::Bytes::copy_from_slice(target.as_bytes());
        let node = self.create_object(parent, name, body, user).await?;
        Ok(self
            .inodes
            .update(node.ino, |n| {
                n.link_target = Some(target.to_string());
                n.clone()
            })
            .unwrap_or(node))
    }

    pub async fn readlink(&self, ino: u64) -> Result<String, FsError> {
        let node = self.getattr(ino).await?;
        if self.attrs(&node).kind != FileType::Symlink {
            return Err(FsError::InvalidName("not a symbolic link".into()));
        }
        if let Some(target) = node.link_target {
            return Ok(target);
        }
        let etag = node.meta.etag.clone().ok_or(FsError::NotFound)?;
        if node.meta.size as usize > MAX_LINK_BYTES {
            return Err(FsError::NameTooLong);
        }
        let uri = self.uri(&node.key)?;
        let body =
            crate::data_plane::read_exact(self.data.as_ref(), &uri, 0..node.meta.size, &etag)
                .await?;
        let target = String::from_utf8(body.to_vec())
            .map_err(|_| FsError::InvalidName("link target is not UTF-8".into()))?;
        self.inodes
            .update(ino, |n| n.link_target = Some(target.clone()));
        Ok(target)
    }

    /// A FIFO, socket, device node or empty regular file: an empty
    /// object whose metadata says what it is (the mount is `nodev`).
    pub async fn mknod(
        &self,
        parent: u64,
        name: &str,
        mode: u32,
        rdev: u32,
        who: Creator,
    ) -> Result<Inode, FsError> {
        let kind = match FileType::from_mode(mode) {
            Some(FileType::Directory | FileType::Symlink) | None => {
                return Err(FsError::InvalidName(
                    "mknod makes files, FIFOs, sockets and devices".into(),
                ))
            }
            Some(k) => k,
        };
        let p = self.dir(parent)?;
        let rdev = if matches!(kind, FileType::CharDevice | FileType::BlockDevice) {
            rdev
        } else {
            0
        };
        let user = self.new_object_meta(
            &p,
            kind,
            Creator {
                perm: mode & 0o7777,
                ..who
            },
            rdev,
        );
        self.create_object(parent, name, bytes::Bytes::new(), user)
            .await
    }

    /// Metadata a committed upload must still get (set while its upload
    /// was already streaming): stored by a copy soon.
    pub(super) fn keep_newer_meta(&self, ino: u64, wanted: Option<UserMeta>, stored: &UserMeta) {
        let Some(wanted) = wanted.filter(|w| w != stored) else {
            return;
        };
        self.inodes.update(ino, |n| {
            n.meta.user = Some(wanted);
            n.meta_dirty = true;
        });
        self.dirty_meta.mark(ino);
    }

    /// User metadata for a file being replaced by an open with O_TRUNC:
    /// its owner and mode stay, its times become now.
    pub(super) fn rewritten_meta(&self, node: &Inode) -> UserMeta {
        let mut attrs = self.attrs(node);
        let now = SystemTime::now();
        (attrs.mtime, attrs.ctime) = (now, now);
        let mut user = node.meta.user.clone().unwrap_or_default();
        posix::encode(&attrs, &mut user);
        user
    }

    /// A write changed the file: its mtime and ctime are now. (A large
    /// file's upload starts with the times of its first megabyte; only
    /// times set explicitly while it is open cost a copy after it.)
    pub(super) fn touch_written(&self, ino: u64) -> Option<UserMeta> {
        let now = posix::format_time(SystemTime::now());
        self.inodes.update(ino, |n| {
            n.meta.mtime_ms = now_ms();
            let user = n.meta.user.get_or_insert_with(UserMeta::new);
            user.insert(posix::MTIME.into(), now.clone());
            user.insert(posix::CTIME.into(), now);
            user.clone()
        })
    }
}
