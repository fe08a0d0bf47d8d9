//! The body of a followed commit: a file the mount's application is still
//! writing (through FUSE passthrough), taken a page at a time as it grows
//! so that the commit at close has only the tail and the syncs left.
//!
//! The worker sees no writes, only the file's length, so a page taken
//! early may be written again before the seal (a writer that seeks back
//! to patch a header). After the seal every early page is read again and
//! its CRC32C compared with the one the stage wrote it with
//! ([`PageCrcs`]): a file that changed after it was taken fails the
//! commit ([`CacheError::FollowedFileChanged`]), and the mount commits it
//! whole.
//!
//! Reads run ahead of the pages being staged (a few in flight), and the
//! check of the early pages runs beside the taking of the tail: a commit
//! at close waits for the device, not for copies done one after another.

use std::collections::VecDeque;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_protocol::buffer_pool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::local_commit::{Body, Seal};
use crate::cache::CacheError;
use crate::writeback::PageCrcs;

/// How soon a growing file is looked at again, at first and at most.
const FIRST_LOOK: Duration = Duration::from_millis(5);
const LAST_LOOK: Duration = Duration::from_millis(200);

/// Pages read ahead of the one being handed on.
const READS_AHEAD: usize = 3;

type Check = JoinHandle<Result<(), CacheError>>;

/// A page asked for, being read.
type Ahead = JoinHandle<Result<Bytes, CacheError>>;

struct Following {
    file: Arc<std::fs::File>,
    page: u64,
    limit: u64,
    taken: Arc<AtomicU64>,
    sealed: watch::Receiver<Seal>,
    /// Bytes asked for so far (read or being read).
    asked: u64,
    /// Reads in flight or done, oldest first, not handed on yet.
    reads: VecDeque<Ahead>,
    /// Whole pages taken before the seal (the first ones).
    early: u64,
    /// The CRC32C each page was written with.
    crcs: Arc<PageCrcs>,
    /// The check of the early pages, started once the seal came.
    check: Option<Check>,
    look: Duration,
}

/// The followed file's bytes, as [`Seal`] says when they are complete.
pub(super) fn followed_body(
    file: Arc<std::fs::File>,
    page: usize,
    limit: u64,
    taken: Arc<AtomicU64>,
    sealed: watch::Receiver<Seal>,
    crcs: Arc<PageCrcs>,
) -> Body {
    let state = Following {
        file,
        page: page.max(4096) as u64,
        limit,
        taken,
        sealed,
        asked: 0,
        reads: VecDeque::new(),
        early: 0,
        crcs,
        check: None,
        look: FIRST_LOOK,
    };
    Box::pin(futures::stream::try_unfold(state, |mut f| async move {
        loop {
            let seal = *f.sealed.borrow();
            match seal {
                Seal::At(size) => {
                    if f.asked > size {
                        return Err(CacheError::Invalid(format!(
                            "the followed file was sealed at {size} bytes after {} were taken",
                            f.asked
                        )));
                    }
                    if f.check.is_none() {
                        f.start_check();
                    }
                    while f.asked < size && f.reads.len() < READS_AHEAD {
                        let n = f.page.min(size - f.asked);
                        f.ask(n, false)?;
                    }
                    if let Some(piece) = f.next_read().await? {
                        return Ok(Some((piece, f)));
                    }
                    if let Some(check) = f.check.take() {
                        check.await.map_err(crate::cache::join_failed)??;
                    }
                    return Ok(None);
                }
                Seal::Open => {
                    let len = f.file.metadata().map_or(0, |m| m.len());
                    while len >= f.asked + f.page && f.reads.len() < READS_AHEAD {
                        f.ask(f.page, true)?;
                    }
                    if let Some(piece) = f.next_read().await? {
                        f.look = FIRST_LOOK;
                        return Ok(Some((piece, f)));
                    }
                    tokio::select! {
                        changed = f.sealed.changed() => if changed.is_err() {
                            return Err(CacheError::Invalid(
                                "the mount ended a followed commit before sealing it; nothing was recorded".into(),
                            ));
                        },
                        () = tokio::time::sleep(f.look) => f.look = (f.look * 2).min(LAST_LOOK),
                    }
                }
            }
        }
    }))
}

impl Following {
    /// Starts reading the next `n` bytes of the file, a whole page to be
    /// checked after the seal when taken `early`.
    fn ask(&mut self, n: u64, early: bool) -> Result<(), CacheError> {
        if self.asked + n > self.limit {
            return Err(CacheError::BodyTooLarge(self.limit));
        }
        let (file, at) = (self.file.clone(), self.asked);
        self.reads.push_back(tokio::task::spawn_blocking(move || {
            buffer_pool::read_at(&file, at, n as usize).map_err(|e| {
                CacheError::Invalid(format!(
                    "reading the followed file at {at}: {e} (truncated while written?)"
                ))
            })
        }));
        self.asked += n;
        self.early += u64::from(early);
        Ok(())
    }

    /// The oldest read's bytes, counted as taken; `None` when none is
    /// in flight.
    async fn next_read(&mut self) -> Result<Option<Bytes>, CacheError> {
        let Some(read) = self.reads.pop_front() else {
            return Ok(None);
        };
        let piece = read.await.map_err(crate::cache::join_failed)??;
        self.taken.fetch_add(piece.len() as u64, Ordering::Relaxed);
        Ok(Some(piece))
    }

    /// Once sealed: checks in the background that every early page
    /// still holds what was written.
    fn start_check(&mut self) {
        let (file, page, early, crcs) =
            (self.file.clone(), self.page, self.early, self.crcs.clone());
        self.check = Some(tokio::task::spawn_blocking(move || {
            check_early(&file, page, early, &crcs)
        }));
    }
}

/// Bytes read at a time by the check: small enough that the CRC32C pass
/// finds them still in the CPU's cache.
const CHECK_CHUNK: usize = 512 << 10;
/// Threads that check a sealed file's early pages at most.
const CHECK_THREADS: usize = 2;

/// Every page taken before the seal still holds what was taken. The
/// writer waits for this in its close, so the pages are read in small
/// chunks, each summed while it is still in the CPU's cache, on up to
/// [`CHECK_THREADS`] threads. On this project's test VM the check of a
/// 375 MiB file's early pages took 111 ms read one 8 MiB page at a
/// time, as long as the tail taken beside it, and 32 ms this way.
fn check_early(
    file: &std::fs::File,
    page: u64,
    early: u64,
    crcs: &PageCrcs,
) -> Result<(), CacheError> {
    let threads = CHECK_THREADS.min(early as usize);
    let failed = AtomicBool::new(false);
    if threads <= 1 {
        return check_pages(file, page, (early, crcs), (0, 1), &failed);
    }
    std::thread::scope(|scope| {
        let checks: Vec<_> = (0..threads)
            .map(|first| {
                let failed = &failed;
                scope.spawn(move || {
                    let checked = check_pages(file, page, (early, crcs), (first, threads), failed);
                    if checked.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    checked
                })
            })
            .collect();
        // A change found by one thread stops the others; the first
        // thread's failure (in thread order) is the answer.
        let mut outcome = Ok(());
        for check in checks {
            let got = check.join().unwrap_or_else(|_| {
                Err(CacheError::Invalid(
                    "the check of a followed file panicked".into(),
                ))
            });
            if outcome.is_ok() {
                outcome = got;
            }
        }
        outcome
    })
}

/// Checks early pages `first`, `first + step`, ... (`(first, step)`) of
/// the first `early`, until one fails or `failed` says another thread
/// found one. A page's CRC is summed before its written CRC is waited
/// for: the last pages taken may still be being written.
fn check_pages(
    file: &std::fs::File,
    page: u64,
    (early, crcs): (u64, &PageCrcs),
    (first, step): (usize, usize),
    failed: &AtomicBool,
) -> Result<(), CacheError> {
    let mut buf = vec![0u8; CHECK_CHUNK.min(page as usize)];
    for index in (0..early).skip(first).step_by(step) {
        if failed.load(Ordering::Relaxed) {
            return Ok(());
        }
        let at = index * page;
        let mut crc = 0u32;
        let mut done = 0u64;
        while done < page {
            let chunk = &mut buf[..CHECK_CHUNK.min((page - done) as usize)];
            file.read_exact_at(chunk, at + done).map_err(|e| {
                CacheError::Invalid(format!("checking the followed file at {}: {e}", at + done))
            })?;
            crc = crc32c::crc32c_append(crc, chunk);
            done += chunk.len() as u64;
        }
        if crc != crcs.wait(index)? {
            return Err(CacheError::FollowedFileChanged(format!(
                "the followed file changed at bytes {at}..{} after they were taken; nothing was recorded",
                at + page
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `pages` pages of `page` bytes, and each page's CRC32C
    /// as a stage would have written it.
    fn pages(page: u64, pages: u64) -> (std::fs::File, PageCrcs) {
        let body: Vec<u8> = (0..page * pages).map(|i| (i * 31 % 251) as u8).collect();
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&body, 0).unwrap();
        let crcs = PageCrcs::default();
        for (i, chunk) in body.chunks(page as usize).enumerate() {
            crcs.set(i as u64, crc32c::crc32c(chunk));
        }
        (file, crcs)
    }

    #[test]
    fn the_check_finds_a_change_in_any_page_whatever_thread_reads_it() {
        // A page that is not a whole number of check chunks.
        let page = CHECK_CHUNK as u64 + (CHECK_CHUNK as u64) / 2 + 4096;
        let (file, crcs) = pages(page, 5);
        check_early(&file, page, 5, &crcs).expect("an unchanged file passes");
        check_early(&file, page, 1, &crcs).expect("one page, checked alone");
        // Every page: its first byte, and one in its last (partial) chunk.
        let changes = (0..5).flat_map(|p| [(p * page, p), ((p + 1) * page - 1, p)]);
        for (at, in_page) in changes {
            let (file, crcs) = pages(page, 5);
            file.write_all_at(b"\xff", at).unwrap();
            match check_early(&file, page, 5, &crcs) {
                Err(CacheError::FollowedFileChanged(why)) => assert!(
                    why.contains(&format!("bytes {}..", in_page * page)),
                    "a change at {at} reported as {why}"
                ),
                other => panic!("a change at {at} passed the check: {other:?}"),
            }
        }
    }

    #[test]
    fn a_page_the_stage_never_wrote_fails_the_check_once_the_stage_ends() {
        let page = 64 << 10;
        let (file, _) = pages(page, 3);
        let crcs = std::sync::Arc::new(PageCrcs::default());
        crcs.set(0, 0);
        let ended = crcs.clone();
        let stage = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            ended.close();
        });
        match check_early(&file, page, 3, &crcs) {
            Err(CacheError::FollowedFileChanged(_) | CacheError::Invalid(_)) => {}
            other => panic!("pages never written passed the check: {other:?}"),
        }
        stage.join().unwrap();
    }

    #[test]
    fn a_file_cut_short_after_the_seal_fails_the_check() {
        let page = 64 << 10;
        let (file, crcs) = pages(page, 4);
        file.set_len(3 * page - 100).unwrap();
        match check_early(&file, page, 4, &crcs) {
            Err(CacheError::Invalid(why)) => {
                assert!(why.contains("checking the followed file"), "{why}")
            }
            other => panic!("a shortened file passed the check: {other:?}"),
        }
    }
}
