//! Files opened for writing without `O_TRUNC` (appends, in-place edits,
//! `ftruncate` on an open file): reads stream from the cache as usual
//! until the first change; then the object is copied whole into a spool
//! file on local disk, changed there, and uploaded whole at flush, fsync
//! or close. Objects larger than `--truncate-rewrite-max` are refused.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::Mutex as AsyncMutex;

use super::{meta_of, tgid_of, Fs, Handle};
use crate::data_plane::{ByteStream, DataError};
use crate::error::FsError;
use crate::read::FileReader;

/// Piece size of spool downloads and uploads.
const SPOOL_CHUNK: u64 = 4 << 20;

/// One handle of a file opened for update.
pub(super) struct Update {
    pub ino: u64,
    /// The object as it was when opened, for reads before any change.
    pub reader: Arc<AsyncMutex<FileReader>>,
    /// Thread group that opened the file: only its flush uploads.
    pub owner_tgid: Option<u32>,
    pub state: AsyncMutex<Spool>,
}

#[derive(Default)]
pub(super) struct Spool {
    /// The file's bytes once it was first changed (unlinked temp file).
    pub file: Option<Arc<std::fs::File>>,
    pub len: u64,
    /// Changed since the last upload.
    pub dirty: bool,
}

impl Update {
    /// Forgets the changes (the file was unlinked): nothing is uploaded.
    pub async fn discard(&self) {
        let mut state = self.state.lock().await;
        state.dirty = false;
        state.file = None;
    }
}

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> FsError {
    move |e| FsError::DataPlane(DataError::backend(context, e))
}

impl Fs {
    /// A handle for `O_WRONLY`/`O_RDWR` without `O_TRUNC` on an existing
    /// object; nothing is copied until the first change.
    pub(super) async fn open_update(
        &self,
        ino: u64,
        pid: u32,
        reader: FileReader,
    ) -> Result<u64, FsError> {
        let owner_tgid = tgid_of(pid).await;
        Ok(self.add_handle(Handle::Update(Arc::new(Update {
            ino,
            reader: Arc::new(AsyncMutex::new(reader)),
            owner_tgid,
            state: AsyncMutex::new(Spool::default()),
        }))))
    }

    /// The spool of `update`, made on its first change: claims the inode
    /// for writing and copies the object into a temp file.
    async fn spooled<'a>(
        &self,
        fh: u64,
        update: &'a Update,
    ) -> Result<tokio::sync::MutexGuard<'a, Spool>, FsError> {
        let mut state = update.state.lock().await;
        // Held from the first change until the upload (flush): other
        // writers wait, `stat` shows the local size.
        let claimed = self.inodes.update(update.ino, |n| match n.writer {
            None => {
                n.writer = Some(fh);
                true
            }
            Some(w) => w == fh,
        });
        if claimed != Some(true) {
            return Err(FsError::Busy("the file is already open for writing"));
        }
        // Writes through this handle reach the kernel's page cache too:
        // a store of the old bytes must not land over them.
        self.kernel_cache().settle(update.ino).await;
        if state.file.is_some() {
            return Ok(state);
        }
        let node = self.node(update.ino)?;
        if node.meta.size > self.config.truncate_rewrite_max {
            self.inodes.update(update.ino, |n| {
                if n.writer == Some(fh) {
                    n.writer = None;
                }
            });
            return Err(FsError::Unsupported(
                "changing an object larger than --truncate-rewrite-max in place (it is rewritten whole); open it with O_TRUNC to replace it",
            ));
        }
        let filled = self.fill_spool(&node).await;
        match filled {
            Ok(file) => {
                state.file = Some(Arc::new(file));
                state.len = node.meta.size;
                Ok(state)
            }
            Err(e) => {
                self.inodes.update(update.ino, |n| {
                    if n.writer == Some(fh) {
                        n.writer = None;
                    }
                });
                Err(e)
            }
        }
    }

    /// A temp file holding the object's current bytes.
    async fn fill_spool(&self, node: &crate::inode::Inode) -> Result<std::fs::File, FsError> {
        let dir = self.config.spool_dir.clone();
        let file = tokio::task::spawn_blocking(move || crate::resend::tempfile_in(&dir))
            .await
            .map_err(FsError::Task)?
            .map_err(io("creating a spool file"))?;
        let file = Arc::new(file);
        let size = node.meta.size;
        if size == 0 {
            return Arc::try_unwrap(file).map_err(|_| FsError::BadHandle);
        }
        let etag = node.meta.etag.clone().ok_or(FsError::NotFound)?;
        let uri = self.uri(&node.key)?;
        let mut at = 0;
        while at < size {
            let end = (at + SPOOL_CHUNK).min(size);
            let piece =
                crate::data_plane::read_exact(self.data.as_ref(), &uri, at..end, &etag).await?;
            let f = file.clone();
            tokio::task::spawn_blocking(move || f.write_all_at(&piece, at))
                .await
                .map_err(FsError::Task)?
                .map_err(io("writing a spool file"))?;
            at = end;
        }
        Arc::try_unwrap(file).map_err(|_| FsError::BadHandle)
    }

    pub(super) async fn update_read(
        &self,
        update: &Update,
        offset: u64,
        len: u32,
    ) -> Result<Bytes, FsError> {
        let (file, size) = {
            let state = update.state.lock().await;
            (state.file.clone(), state.len)
        };
        let Some(file) = file else {
            return update
                .reader
                .lock()
                .await
                .read(offset, u64::from(len))
                .await;
        };
        let n = u64::from(len).min(size.saturating_sub(offset)) as usize;
        tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; n];
            file.read_exact_at(&mut buf, offset)
                .map(|_| Bytes::from(buf))
        })
        .await
        .map_err(FsError::Task)?
        .map_err(io("reading a spool file"))
    }

    pub(super) async fn update_write(
        &self,
        fh: u64,
        update: &Update,
        offset: u64,
        data: Bytes,
    ) -> Result<u32, FsError> {
        let mut state = self.spooled(fh, update).await?;
        let file = state.file.clone().ok_or(FsError::BadHandle)?;
        let n = data.len();
        tokio::task::spawn_blocking(move || file.write_all_at(&data, offset))
            .await
            .map_err(FsError::Task)?
            .map_err(io("writing a spool file"))?;
        state.len = state.len.max(offset + n as u64);
        state.dirty = true;
        let len = state.len;
        drop(state);
        self.inodes.update(update.ino, |node| node.meta.size = len);
        self.touch_written(update.ino);
        Ok(n as u32)
    }

    /// `ftruncate` (or `truncate` by path) while this handle changes it.
    pub(super) async fn update_set_len(
        &self,
        fh: u64,
        update: &Update,
        size: u64,
    ) -> Result<(), FsError> {
        let mut state = self.spooled(fh, update).await?;
        let file = state.file.clone().ok_or(FsError::BadHandle)?;
        tokio::task::spawn_blocking(move || file.set_len(size))
            .await
            .map_err(FsError::Task)?
            .map_err(io("resizing a spool file"))?;
        state.len = size;
        state.dirty = true;
        drop(state);
        self.inodes.update(update.ino, |node| node.meta.size = size);
        self.touch_written(update.ino);
        Ok(())
    }

    /// Uploads the spool if it changed; the inode shows S3's answer and
    /// is free for other writers again.
    pub(super) async fn update_commit(&self, fh: u64, update: &Update) -> Result<(), FsError> {
        let mut state = update.state.lock().await;
        let Some(file) = state.file.clone().filter(|_| state.dirty) else {
            return Ok(());
        };
        let node = self.node(update.ino)?;
        let uri = self.uri(&node.key)?;
        let user = node.meta.user.clone().unwrap_or_default();
        let size = state.len;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(2);
        let feeder = tokio::spawn(async move {
            let mut at = 0;
            while at < size {
                let n = (size - at).min(SPOOL_CHUNK) as usize;
                let f = file.clone();
                let piece = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0u8; n];
                    f.read_exact_at(&mut buf, at).map(|_| Bytes::from(buf))
                })
                .await
                .map_err(|e| DataError::backend("spool read task", e))?
                .map_err(|e| DataError::backend("reading a spool file", e))?;
                at += n as u64;
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
            Ok(Err(e)) => return Err(FsError::UploadFailed(e)),
            Err(e) => return Err(FsError::Task(e)),
        }
        let stat = stored.map_err(FsError::UploadFailed)?;
        if stat.size != size {
            return Err(FsError::UploadFailed(DataError::SizeMismatch {
                stored: stat.size,
                sent: size,
            }));
        }
        state.dirty = false;
        let meta = meta_of(&stat);
        let parent = self.inodes.update(update.ino, |n| {
            if n.writer == Some(fh) {
                n.writer = None;
            }
            n.meta = meta;
            n.meta_dirty = false;
            n.validated = std::time::Instant::now();
            n.page_cache_etag = None;
            n.parent
        });
        if let Some(parent) = parent {
            self.dir_changed(parent);
        }
        Ok(())
    }

    /// The handle closed: uploads what changed and lets go of the inode.
    pub(super) async fn update_release(&self, fh: u64, update: &Update) -> Result<(), FsError> {
        let result = self.update_commit(fh, update).await;
        self.inodes.update(update.ino, |n| {
            if n.writer == Some(fh) {
                n.writer = None;
            }
        });
        result
    }
}

/// Most objects a directory rename moves; a bigger tree gets EXDEV, and
/// `mv` copies it itself.
const MAX_TREE_OBJECTS: usize = 10_000;
/// Copies in flight while a directory moves.
const TREE_COPIES_IN_FLIGHT: usize = 16;

impl Fs {
    /// Moves every object under directory `src` to `new_key` (copy, then
    /// delete): S3 has no rename. Not atomic: a failure part way leaves
    /// objects under both names, none lost.
    pub(super) async fn move_tree(
        &self,
        src: &crate::inode::Inode,
        new_key: &str,
    ) -> Result<(), FsError> {
        use futures::StreamExt as _;
        if self.inodes.writer_under(&src.key) {
            return Err(FsError::Busy("a file in the directory is being written"));
        }
        let mut keys = Vec::new();
        // The version each key had when listed (empty where a store's
        // listing leaves ETags out).
        let mut listed = std::collections::HashMap::new();
        let mut token = None;
        loop {
            let page = self
                .data
                .list(
                    &self.config.bucket,
                    &src.key,
                    None,
                    token.as_deref(),
                    Some(1000),
                )
                .await?;
            for o in page.objects {
                listed.insert(o.key.clone(), o.etag);
                keys.push(o.key);
            }
            if keys.len() > MAX_TREE_OBJECTS {
                return Err(FsError::CrossDevice(
                    "directory too large to rename in place",
                ));
            }
            match page.next_token {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        // Attributes changed here and not stored yet go with the copies.
        let pending = self.inodes.pending_meta_under(&src.key);
        let mut moves = Vec::with_capacity(keys.len());
        for key in &keys {
            let to_key = format!("{new_key}{}", &key[src.key.len()..]);
            moves.push((
                self.uri(key)?,
                self.uri(&to_key)?,
                pending.get(key).cloned(),
            ));
        }
        let data = self.data.clone();
        let copies: Vec<Result<lakecache_protocol::ObjectStat, DataError>> =
            futures::stream::iter(moves.clone())
                .map(|(from, to, meta)| {
                    let data = data.clone();
                    async move { data.copy(&from, None, &to, meta.as_ref()).await }
                })
                .buffered(TREE_COPIES_IN_FLIGHT)
                .collect()
                .await;
        // A copy is a new version (its ETag need not be the source's):
        // inodes known here take it, or a later read by version of one
        // of them would find the object changed.
        let mut moved = std::collections::HashMap::with_capacity(keys.len());
        for (key, copied) in keys.iter().zip(copies) {
            moved.insert(key.clone(), super::meta_of(&copied?));
        }
        // Files open for reading under it read the copies from now on, as
        // a local file system's open files survive a rename of their
        // directory.
        self.readers_follow_moves(&src.key, new_key, &listed, &moved)
            .await?;
        let deletes: Vec<Result<(), DataError>> = futures::stream::iter(moves)
            .map(|(from, _, _)| {
                let data = data.clone();
                async move { data.delete(&from).await }
            })
            .buffered(TREE_COPIES_IN_FLIGHT)
            .collect()
            .await;
        for deleted in deletes {
            match deleted {
                Ok(()) | Err(DataError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.inodes.rekey_under(&src.key, new_key, &moved);
        self.listings.invalidate_under(&src.key);
        // The target may be an empty directory that was listed before.
        self.listings.invalidate_under(new_key);
        Ok(())
    }
}

impl Fs {
    /// Readers of objects under `old` (a directory key) that `moved`
    /// copied (old key → the copy's version) read the copies, under
    /// `new`, where they read the version that was copied (`listed`);
    /// a reader of an older version keeps it, as before the move.
    async fn readers_follow_moves(
        &self,
        old: &str,
        new: &str,
        listed: &std::collections::HashMap<String, String>,
        moved: &std::collections::HashMap<String, crate::inode::Meta>,
    ) -> Result<(), FsError> {
        let readers: Vec<_> = {
            let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
            handles
                .values()
                .filter_map(|h| match h {
                    Handle::Read { reader, .. } => Some(reader.clone()),
                    _ => None,
                })
                .collect()
        };
        for reader in readers {
            let mut r = reader.lock().await;
            let key = r.uri().key().to_string();
            let (Some(meta), Some(rest)) = (moved.get(&key), key.strip_prefix(old)) else {
                continue;
            };
            let Some(etag) = meta.etag.clone() else {
                continue;
            };
            let Some(from) = listed.get(&key).filter(|e| !e.is_empty()) else {
                continue;
            };
            r.follow_move(from, self.uri(&format!("{new}{rest}"))?, &etag);
        }
        Ok(())
    }

    /// A file is unlinked while handles here still have it open: they
    /// keep reading its bytes from a local copy (POSIX keeps an unlinked
    /// file readable until its last close), and changes not yet stored
    /// are dropped. Beyond `--truncate-rewrite-max` no copy is made and
    /// those handles fail once S3 no longer has the object.
    ///
    /// The copy is made before the object goes and attached with
    /// [`Self::attach_kept`] once it has gone: an unlink that fails leaves
    /// the handles reading the file as before.
    pub(super) async fn copy_for_open_handles(
        &self,
        node: &crate::inode::Inode,
    ) -> Option<KeptCopy> {
        let open: Vec<(u64, Handle)> = {
            let handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
            handles
                .iter()
                .filter(|(_, h)| match h {
                    Handle::Read { ino, .. } => *ino == node.ino,
                    Handle::Update(u) => u.ino == node.ino,
                    _ => false,
                })
                .map(|(fh, h)| (*fh, h.clone()))
                .collect()
        };
        if open.is_empty() || node.meta.size > self.config.truncate_rewrite_max {
            return None;
        }
        let copy = match self.fill_spool(node).await {
            Ok(file) => Arc::new(file),
            Err(e) => {
                tracing::warn!(key = %node.key, error = %crate::error::Chain(&e), "no local copy of a file unlinked while open; its readers will fail");
                return None;
            }
        };
        Some(KeptCopy {
            ino: node.ino,
            size: node.meta.size,
            open,
            copy,
        })
    }

    pub(super) async fn attach_kept(&self, kept: KeptCopy) {
        let KeptCopy {
            ino: kept_ino,
            size,
            open,
            copy,
        } = kept;
        for (fh, handle) in open {
            let update = match handle {
                Handle::Update(u) => u,
                Handle::Read { reader, ino } => Arc::new(Update {
                    ino,
                    reader,
                    owner_tgid: None,
                    state: AsyncMutex::new(Spool::default()),
                }),
                _ => continue,
            };
            {
                let mut state = update.state.lock().await;
                if state.file.is_none() {
                    state.file = Some(copy.clone());
                    state.len = size;
                }
                state.dirty = false;
            }
            let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
            if handles.contains_key(&fh) {
                handles.insert(fh, Handle::Update(update));
            }
        }
        self.inodes.update(kept_ino, |n| n.writer = None);
    }
}

/// A local copy of a file for the handles open on it (see
/// [`Fs::copy_for_open_handles`]).
pub(super) struct KeptCopy {
    ino: u64,
    size: u64,
    open: Vec<(u64, Handle)>,
    copy: Arc<std::fs::File>,
}
