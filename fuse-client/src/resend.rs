//! What an upload has sent, kept until the write is acknowledged, so a
//! write whose worker stalls can be sent again, whole, to the next worker
//! of the ring. Kept in memory, within the mount's budget while that
//! leaves a quarter of it for writers; beyond that, in a spool file on the
//! node's disk (`--spool-dir`, unlinked from the start, so nothing is left
//! behind). Only when the spool cannot be written either is nothing more
//! kept, and the upload fails on a stall as it would without this.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::data_plane::{ByteStream, DataError};
use crate::memory::{MemoryBudget, Reservation};

enum Kept {
    /// The bytes, and their share of the memory budget (held until the
    /// write is acknowledged).
    Memory { bytes: Bytes, _held: Reservation },
    /// `len` bytes at `at` in the spool file.
    Spooled { at: u64, len: usize },
}

/// The spool file of one upload, created on first use.
struct Spool {
    dir: PathBuf,
    file: Option<File>,
    len: u64,
}

impl Spool {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<u64> {
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(tempfile_in(&self.dir)?),
        };
        let at = self.len;
        file.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(at)
    }

    fn read(&self, at: u64, len: usize) -> std::io::Result<Bytes> {
        let file = self
            .file
            .as_ref()
            .ok_or_else(|| std::io::Error::other("no spool file"))?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, at)?;
        Ok(Bytes::from(buf))
    }
}

/// An anonymous temp file in `dir` (gone when closed, even after a crash).
pub(crate) fn tempfile_in(dir: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(dir)
}

pub struct Resend {
    rx: mpsc::Receiver<(Bytes, Reservation)>,
    kept: Vec<Kept>,
    /// False once a piece could not be kept: the write cannot be resent.
    whole: bool,
    budget: Arc<MemoryBudget>,
    /// Where pieces go once the memory budget runs low; None: nowhere.
    spool: Option<Spool>,
    /// How much of `kept` the current attempt has sent.
    replayed: usize,
}

impl Resend {
    pub fn new(
        rx: mpsc::Receiver<(Bytes, Reservation)>,
        budget: Arc<MemoryBudget>,
        spool_dir: Option<PathBuf>,
    ) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Self {
            rx,
            kept: Vec::new(),
            whole: true,
            budget,
            spool: spool_dir.map(|dir| Spool {
                dir,
                file: None,
                len: 0,
            }),
            replayed: 0,
        }))
    }

    fn lock(this: &Mutex<Self>) -> MutexGuard<'_, Self> {
        this.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The body of the next attempt: everything kept, then what the
    /// writer sends next.
    pub fn attempt(this: &Arc<Mutex<Self>>) -> ByteStream {
        Self::lock(this).replayed = 0;
        let this = this.clone();
        Box::pin(futures::stream::poll_fn(move |cx| {
            Self::lock(&this).poll_piece(cx)
        }))
    }

    /// Whether everything sent so far is kept.
    pub fn whole(this: &Mutex<Self>) -> bool {
        Self::lock(this).whole
    }

    /// Bytes kept for a resend: in memory, and in the spool file.
    pub fn kept_bytes(this: &Mutex<Self>) -> (u64, u64) {
        let me = Self::lock(this);
        me.kept.iter().fold((0, 0), |(mem, disk), k| match k {
            Kept::Memory { bytes, .. } => (mem + bytes.len() as u64, disk),
            Kept::Spooled { len, .. } => (mem, disk + *len as u64),
        })
    }

    /// No more pieces are taken: the writer's next send fails (those
    /// already queued can still be drained by [`Self::copy_into`]).
    pub fn close(this: &Mutex<Self>) {
        Self::lock(this).rx.close();
    }

    /// Writes everything the writer sent, in order, at the start of
    /// `file`: what was kept, then what is still queued. Only once the
    /// upload is over and its sender dropped. `Ok(None)`: not everything
    /// was kept. Blocking.
    pub fn copy_into(this: &Mutex<Self>, file: &File) -> std::io::Result<Option<u64>> {
        let mut me = Self::lock(this);
        if !me.whole {
            return Ok(None);
        }
        let mut at = 0u64;
        for kept in &me.kept {
            let piece = match kept {
                Kept::Memory { bytes, .. } => bytes.clone(),
                Kept::Spooled { at, len } => match &me.spool {
                    Some(spool) => spool.read(*at, *len)?,
                    None => return Ok(None),
                },
            };
            file.write_all_at(&piece, at)?;
            at += piece.len() as u64;
        }
        while let Ok((piece, _reservation)) = me.rx.try_recv() {
            file.write_all_at(&piece, at)?;
            at += piece.len() as u64;
        }
        me.kept.clear();
        me.spool = None;
        Ok(Some(at))
    }

    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, DataError>>> {
        if let Some(kept) = self.kept.get(self.replayed) {
            self.replayed += 1;
            // A resend reads its spooled pieces back here, on the runtime:
            // rare, and from a file just written (the page cache, usually).
            let piece = match kept {
                Kept::Memory { bytes, .. } => Ok(bytes.clone()),
                Kept::Spooled { at, len } => match &self.spool {
                    Some(spool) => spool
                        .read(*at, *len)
                        .map_err(|e| DataError::Spool(e.to_string())),
                    None => Err(DataError::Spool("no spool".into())),
                },
            };
            return Poll::Ready(Some(piece));
        }
        let Some((bytes, reservation)) = ready!(self.rx.poll_recv(cx)) else {
            return Poll::Ready(None);
        };
        if self.whole {
            // The piece's reservation is already taken: keep it in memory
            // only while a quarter of the budget stays free for writers.
            if self.budget.available() >= self.budget.limit() / 4 {
                self.kept.push(Kept::Memory {
                    bytes: bytes.clone(),
                    _held: reservation,
                });
                self.replayed += 1;
            } else if let Some(spool) = &mut self.spool {
                match spool.append(&bytes) {
                    Ok(at) => {
                        self.kept.push(Kept::Spooled {
                            at,
                            len: bytes.len(),
                        });
                        self.replayed += 1;
                    }
                    Err(e) => {
                        tracing::warn!(dir = %spool.dir.display(), error = %e, "cannot spool this upload for a resend; a stall will fail it");
                        self.give_up_keeping();
                    }
                }
            } else {
                tracing::debug!(
                    kept = self.kept.len(),
                    "memory budget low: this upload is no longer kept for a resend"
                );
                self.give_up_keeping();
            }
        }
        Poll::Ready(Some(Ok(bytes)))
    }

    fn give_up_keeping(&mut self) {
        self.whole = false;
        self.kept.clear();
        self.spool = None;
        self.replayed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    async fn next(stream: &mut ByteStream) -> Bytes {
        stream.next().await.unwrap().unwrap()
    }

    #[tokio::test]
    async fn a_second_attempt_replays_what_the_first_sent_then_goes_on() {
        let budget = MemoryBudget::new(64 << 20);
        let (tx, rx) = mpsc::channel(4);
        let resend = Resend::new(rx, budget.clone(), None);
        for piece in [&b"ab"[..], b"cd"] {
            let r = budget.reserve(2).await;
            tx.send((Bytes::from_static(piece), r)).await.unwrap();
        }
        let mut first = Resend::attempt(&resend);
        assert_eq!(next(&mut first).await, "ab");
        assert_eq!(next(&mut first).await, "cd");
        drop(first);
        let r = budget.reserve(2).await;
        tx.send((Bytes::from_static(b"ef"), r)).await.unwrap();
        drop(tx);
        let second: Vec<Bytes> = Resend::attempt(&resend)
            .map(|piece| piece.unwrap())
            .collect()
            .await;
        assert_eq!(second, ["ab", "cd", "ef"]);
        assert!(Resend::whole(&resend));
        assert_eq!(Resend::kept_bytes(&resend), (6, 0));
        assert!(
            budget.available() < budget.limit(),
            "kept bytes are accounted"
        );
        drop(resend);
        assert_eq!(budget.available(), budget.limit());
    }

    #[tokio::test]
    async fn without_a_spool_an_upload_that_would_leave_writers_short_is_no_longer_kept() {
        let budget = MemoryBudget::new(16 << 20);
        let (tx, rx) = mpsc::channel(4);
        let resend = Resend::new(rx, budget.clone(), None);
        let big = Bytes::from(vec![7u8; 13 << 20]);
        let r = budget.reserve(big.len() as u64).await;
        tx.send((big, r)).await.unwrap();
        drop(tx);
        let sent: Vec<Bytes> = Resend::attempt(&resend)
            .map(|piece| piece.unwrap())
            .collect()
            .await;
        assert_eq!(sent.len(), 1);
        assert!(!Resend::whole(&resend));
        assert_eq!(budget.available(), budget.limit(), "nothing held");
    }

    /// Beyond the memory budget, pieces go to the spool file and free
    /// their memory; a resend replays memory and spool in order.
    #[tokio::test]
    async fn beyond_the_budget_pieces_are_spooled_and_a_resend_replays_them_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let budget = MemoryBudget::new(16 << 20);
        let (tx, rx) = mpsc::channel(4);
        let resend = Resend::new(rx, budget.clone(), Some(dir.path().join("spool")));
        let pieces: Vec<Bytes> = (0..10u8).map(|i| Bytes::from(vec![i; 3 << 20])).collect();
        let mut first = Resend::attempt(&resend);
        for piece in &pieces {
            let r = budget.reserve(piece.len() as u64).await;
            tx.send((piece.clone(), r)).await.unwrap();
            assert_eq!(&next(&mut first).await, piece);
        }
        drop(first);
        drop(tx);
        assert!(Resend::whole(&resend));
        let (memory, disk) = Resend::kept_bytes(&resend);
        assert_eq!(memory + disk, 30 << 20);
        assert!(
            disk > 0 && memory <= 12 << 20,
            "{memory} in memory, {disk} spooled"
        );
        assert!(
            budget.available() >= budget.limit() / 4,
            "spooled pieces hold no memory"
        );
        let second: Vec<Bytes> = Resend::attempt(&resend)
            .map(|piece| piece.unwrap())
            .collect()
            .await;
        assert_eq!(second, pieces);
        // The spool file is unlinked from the start: nothing in the dir.
        assert_eq!(
            std::fs::read_dir(dir.path().join("spool")).unwrap().count(),
            0
        );
        drop(resend);
        assert_eq!(budget.available(), budget.limit());
    }
}
