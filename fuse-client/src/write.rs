//! One file being written: kernel writes stream, in order, into a single
//! upload through the owning worker; the upload ends on flush/fsync.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;
use lakecache_protocol::{ObjectStat, ObjectUri, UserMeta, WriteMode};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::data_plane::{ByteStream, DataError, DataPlane, UploadLimits};
use crate::error::FsError;
use crate::memory::{MemoryBudget, Reservation};
use crate::resend::Resend;
use crate::staged::StagedFile;

/// Writes buffered towards the worker before `write` waits.
const QUEUED_WRITES: usize = 16;
/// Workers a write is sent to again after the one taking it stalled.
const MAX_RESENDS: usize = 2;
/// A file this small is held until close, so its upload carries the
/// metadata set after the data (`cp -a` sets owner, mode and times on
/// the open file last): one PUT instead of a PUT and a metadata copy.
const HELD_UNTIL_CLOSE: u64 = 1 << 20;

struct Upload {
    /// Each piece travels with its share of the mount's memory budget,
    /// released once the upload stream has handed it on.
    sender: mpsc::Sender<(Bytes, Reservation)>,
    task: JoinHandle<Result<ObjectStat, DataError>>,
    /// What the upload sent, kept for a resend; also what a file moved
    /// to a spool file is rebuilt from (see [`FileWriter::respool`]).
    resend: Arc<std::sync::Mutex<Resend>>,
}

pub struct FileWriter {
    data: Arc<dyn DataPlane>,
    pub uri: ObjectUri,
    limits: UploadLimits,
    written: u64,
    /// Size set by ftruncate before the data arrived (safetensors does
    /// this); the gap past `written` is zeros unless written over.
    fill_to: u64,
    upload: Option<Upload>,
    /// Set once the upload ended; repeated flushes report the same.
    outcome: Option<Result<ObjectStat, DataError>>,
    budget: Arc<MemoryBudget>,
    mode: WriteMode,
    /// User metadata the upload starts with.
    meta: UserMeta,
    /// Data held back while the file is small (see [`HELD_UNTIL_CLOSE`]).
    held: Vec<(Bytes, Reservation)>,
    held_len: u64,
    /// Metadata was set explicitly while open (see `set_meta_explicitly`).
    meta_set: bool,
    /// Where an upload beyond the memory budget is kept for a resend.
    spool_dir: Option<std::path::PathBuf>,
    /// Written into a local file by the kernel (see `staged.rs`).
    staged: Option<StagedFile>,
}

impl FileWriter {
    pub fn new(
        data: Arc<dyn DataPlane>,
        uri: ObjectUri,
        limits: UploadLimits,
        budget: Arc<MemoryBudget>,
        mode: WriteMode,
        meta: UserMeta,
    ) -> Self {
        Self {
            data,
            uri,
            limits,
            budget,
            mode,
            meta,
            held: Vec::new(),
            held_len: 0,
            meta_set: false,
            written: 0,
            fill_to: 0,
            upload: None,
            outcome: None,
            spool_dir: None,
            staged: None,
        }
    }

    /// Has the kernel write this file into a staged file in `dir`
    /// (returned, for the passthrough open) instead of through the mount:
    /// only a write-back of a file nothing was written to yet, whose
    /// worker may take it from a local file.
    pub fn stage(&mut self, dir: &std::path::Path) -> Option<Arc<std::fs::File>> {
        if self.mode != WriteMode::Back
            || self.written > 0
            || self.upload.is_some()
            || !self.held.is_empty()
            || !self.data.commits_locally(&self.uri)
        {
            return None;
        }
        match StagedFile::create(dir) {
            Ok(mut staged) => {
                staged.follow(&self.data, &self.uri, &self.meta, self.limits.progress);
                let file = staged.file().clone();
                self.staged = Some(staged);
                Some(file)
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot create a staged file; writing through the mount");
                None
            }
        }
    }

    /// Back to writing through the mount (the kernel refused the
    /// passthrough open); nothing was written yet.
    pub fn unstage(&mut self) {
        self.staged = None;
    }

    /// The kernel writes this file into a staged file (passthrough); a
    /// file the mount moved to its spool is not (see [`Self::respool`]).
    pub fn is_staged(&self) -> bool {
        self.staged.as_ref().is_some_and(StagedFile::kernel_writes)
    }

    /// Keeps what the upload sent beyond the memory budget in `dir`, so
    /// a stalled write of any size can be sent again.
    pub fn with_spool(mut self, dir: std::path::PathBuf) -> Self {
        self.spool_dir = Some(dir);
        self
    }

    pub fn written(&self) -> u64 {
        match &self.staged {
            Some(staged) => staged.len(),
            None => self.written,
        }
    }

    /// The file's size as `stat` should show it.
    pub fn size(&self) -> u64 {
        match &self.staged {
            Some(staged) => staged.len(),
            None => self.written.max(self.fill_to),
        }
    }

    /// ftruncate on the open file: growing is allowed (zeros, written at
    /// commit unless overwritten); shrinking below what was sent is not.
    pub fn set_len(&mut self, size: u64) -> Result<(), FsError> {
        if let Some(staged) = &self.staged {
            // Committed again at the next flush, if it changed.
            return staged.set_len(size).map_err(|e| {
                FsError::DataPlane(DataError::Spool(format!("truncating the staged file: {e}")))
            });
        }
        if self.outcome.is_some() {
            return Err(FsError::NotPermitted("the file was already committed"));
        }
        if size < self.written {
            return Err(FsError::Unsupported(
                "shrinking a file below what was already written",
            ));
        }
        self.fill_to = size;
        Ok(())
    }

    /// The metadata the upload will carry, while it has not started.
    pub fn set_meta(&mut self, meta: UserMeta) {
        self.meta = meta;
    }

    /// Metadata set by chmod, chown or utimensat while the file is open:
    /// if the upload already started without it, a copy stores it.
    pub fn set_meta_explicitly(&mut self, meta: UserMeta) {
        self.meta = meta;
        self.meta_set = true;
    }

    pub fn meta_set_explicitly(&self) -> bool {
        self.meta_set
    }

    async fn send(&mut self, data: Bytes) -> Result<(), FsError> {
        // Waits while every handle's queued data fills the budget.
        let memory = self.budget.reserve(data.len() as u64).await;
        if self.upload.is_none() {
            if self.held_len + data.len() as u64 <= HELD_UNTIL_CLOSE {
                self.held_len += data.len() as u64;
                self.held.push((data, memory));
                return Ok(());
            }
            self.upload = Some(self.start());
            if !self.release_held().await {
                let err = self.finish().await.err();
                return Err(err.unwrap_or(FsError::UploadFailed(DataError::UploadCut)));
            }
        }
        let upload = self.upload.as_ref().ok_or(FsError::BadHandle)?;
        if upload.sender.send((data, memory)).await.is_err() {
            // The upload ended early; its error is what the caller needs.
            let err = self.finish().await.err();
            return Err(err.unwrap_or(FsError::UploadFailed(DataError::UploadCut)));
        }
        Ok(())
    }

    /// Sends the data held back to the upload just started; false when
    /// the upload ended early (its task's result says why).
    async fn release_held(&mut self) -> bool {
        self.held_len = 0;
        for piece in std::mem::take(&mut self.held) {
            let Some(upload) = self.upload.as_ref() else {
                return false;
            };
            if upload.sender.send(piece).await.is_err() {
                return false;
            }
        }
        true
    }

    /// Drops the upload without storing anything (the file was
    /// unlinked while open); the worker discards what it received.
    pub fn abandon(&mut self) {
        self.held.clear();
        self.staged = None;
        if let Some(upload) = self.upload.take() {
            upload.task.abort();
        }
        self.outcome = Some(Err(DataError::UploadCut));
    }

    pub fn is_finished(&self) -> bool {
        match &self.staged {
            Some(staged) => self.outcome.is_some() && !staged.changed(),
            None => self.outcome.is_some(),
        }
    }

    fn start(&self) -> Upload {
        let (sender, receiver) = mpsc::channel::<(Bytes, Reservation)>(QUEUED_WRITES);
        let resend = Resend::new(receiver, self.budget.clone(), self.spool_dir.clone());
        let kept = resend.clone();
        let (data, uri, limits, mode, meta) = (
            self.data.clone(),
            self.uri.clone(),
            self.limits,
            self.mode,
            self.meta.clone(),
        );
        let task = tokio::spawn(async move {
            let mut avoid = Vec::new();
            loop {
                let body = Resend::attempt(&resend);
                let result = data.upload(&uri, body, limits, mode, &meta, &avoid).await;
                match result {
                    Err(DataError::Stalled { worker, .. })
                        if avoid.len() < MAX_RESENDS && Resend::whole(&resend) =>
                    {
                        tracing::warn!(
                            %uri,
                            %worker,
                            kept = ?Resend::kept_bytes(&resend),
                            "the write's worker stalled; sending the write again to the next worker"
                        );
                        crate::metrics::global().write_resend();
                        avoid.push(worker);
                    }
                    other => {
                        // The writer's queue closes with the upload (the
                        // kept bytes outlive it: see `respool`), so a
                        // write after the end fails instead of waiting.
                        Resend::close(&resend);
                        return other;
                    }
                }
            }
        });
        Upload {
            sender,
            task,
            resend: kept,
        }
    }

    /// A write out of order (np.savez and zipfile seek back to patch
    /// headers, HDF5 writes where it likes): the file moves off its
    /// streamed upload into a spool file holding what was written so
    /// far, which takes writes anywhere and is uploaded whole at flush.
    /// `Ok(false)`: it cannot (no spool directory, or what was sent is no
    /// longer all kept), and the write is refused as before.
    async fn respool(&mut self) -> Result<bool, FsError> {
        let Some(dir) = self.spool_dir.clone() else {
            return Ok(false);
        };
        if self
            .upload
            .as_ref()
            .is_some_and(|u| !Resend::whole(&u.resend))
        {
            return Ok(false);
        }
        let spool_err = |e: std::io::Error| {
            FsError::DataPlane(DataError::Spool(format!(
                "moving a file written out of order to the spool: {e}"
            )))
        };
        let staged = StagedFile::spooled(&dir, self.mode).map_err(spool_err)?;
        let file = staged.file().clone();
        let resend = match self.upload.take() {
            Some(Upload {
                sender,
                task,
                resend,
            }) => {
                // Ended unfinished before its sender closes the body: a
                // body that never ends is stored nowhere.
                task.abort();
                let _ = task.await;
                drop(sender);
                Some(resend)
            }
            None => None,
        };
        let held: Vec<Bytes> = self.held.drain(..).map(|(b, _)| b).collect();
        self.held_len = 0;
        let (written, fill_to) = (self.written, self.fill_to);
        let copied = tokio::task::spawn_blocking(move || -> std::io::Result<Option<u64>> {
            let mut at = match &resend {
                Some(r) => match Resend::copy_into(r, &file)? {
                    Some(n) => n,
                    None => return Ok(None),
                },
                None => 0,
            };
            for piece in held {
                file.write_all_at(&piece, at)?;
                at += piece.len() as u64;
            }
            file.set_len(at.max(fill_to))?;
            Ok(Some(at))
        })
        .await
        .map_err(FsError::Task)?
        .map_err(spool_err)?;
        match copied {
            Some(n) if n == written => {}
            other => {
                // The upload is gone and the file cannot be rebuilt.
                let err = DataError::Spool(format!(
                    "a file written out of order could not be rebuilt ({other:?} of {written} bytes kept)"
                ));
                self.outcome = Some(Err(err.clone()));
                return Err(FsError::UploadFailed(err));
            }
        }
        tracing::debug!(uri = %self.uri, written, "written out of order; the file moved to the spool");
        crate::metrics::global().write_respooled();
        self.staged = Some(staged);
        Ok(true)
    }

    pub async fn write(&mut self, offset: u64, data: Bytes) -> Result<u32, FsError> {
        if self.staged.is_none() && self.outcome.is_none() && offset != self.written {
            // Unless it cannot move, the staged branch below takes it.
            self.respool().await?;
        }
        if let Some(staged) = &self.staged {
            let f = staged.file().clone();
            let len = data.len();
            tokio::task::spawn_blocking(move || f.write_all_at(&data, offset))
                .await
                .map_err(FsError::Task)?
                .map_err(|e| {
                    FsError::DataPlane(DataError::Spool(format!("the staged file: {e}")))
                })?;
            return Ok(len as u32);
        }
        if self.outcome.is_some() {
            return Err(FsError::NotPermitted(
                "the file was already committed by flush or fsync; reopen it with O_TRUNC",
            ));
        }
        if offset != self.written {
            return Err(FsError::OutOfOrderWrite {
                offset,
                expected: self.written,
            });
        }
        if data.is_empty() {
            return Ok(0);
        }
        let len = data.len();
        self.send(data).await?;
        self.written += len as u64;
        Ok(len as u32)
    }

    /// Ends the upload and waits until the object is in S3.
    pub async fn finish(&mut self) -> Result<ObjectStat, FsError> {
        if let Some(staged) = &mut self.staged {
            if let (Some(outcome), false) = (&self.outcome, staged.changed()) {
                return outcome.clone().map_err(FsError::UploadFailed);
            }
            let started = std::time::Instant::now();
            let result = staged
                .commit(&self.data, &self.uri, self.limits, &self.meta, MAX_RESENDS)
                .await;
            if let Ok(stat) = &result {
                crate::metrics::global().upload(stat.size, started.elapsed());
            }
            self.outcome = Some(result.clone());
            return result.map_err(FsError::UploadFailed);
        }
        if let Some(outcome) = &self.outcome {
            return outcome.clone().map_err(FsError::UploadFailed);
        }
        let started = std::time::Instant::now();
        // Data held back, and zeros for a size set by ftruncate and
        // never written over.
        if (self.written < self.fill_to || !self.held.is_empty()) && self.upload.is_none() {
            self.upload = Some(self.start());
            // On failure the task's result below explains it.
            self.release_held().await;
        }
        while self.written < self.fill_to {
            let n = (self.fill_to - self.written).min(1 << 20) as usize;
            let Some(upload) = &self.upload else { break };
            let zeros = (Bytes::from(vec![0u8; n]), Reservation::none());
            if upload.sender.send(zeros).await.is_err() {
                break; // the task's error explains it
            }
            self.written += n as u64;
        }
        let result = match self.upload.take() {
            Some(Upload { sender, task, .. }) => {
                drop(sender);
                match task.await {
                    Ok(r) => r,
                    Err(e) => Err(DataError::backend("upload task failed", e)),
                }
            }
            // Nothing written: the object is empty.
            None if self.mode == WriteMode::Back => {
                let empty: ByteStream = Box::pin(futures::stream::empty());
                self.data
                    .upload(&self.uri, empty, self.limits, self.mode, &self.meta, &[])
                    .await
            }
            None => self.data.put(&self.uri, Bytes::new(), &self.meta).await,
        };
        let result = result.and_then(|stat| {
            if stat.size == self.written {
                Ok(stat)
            } else {
                Err(DataError::SizeMismatch {
                    stored: stat.size,
                    sent: self.written,
                })
            }
        });
        if let Ok(stat) = &result {
            crate::metrics::global().upload(stat.size, started.elapsed());
        }
        self.outcome = Some(result.clone());
        result.map_err(FsError::UploadFailed)
    }
}
