//! Uploads give way to write-back bodies being taken. A writer waits for
//! its body's pages and syncs (a checkpoint's `close` returns only once
//! they are durable); nobody waits for the upload to S3. On a node whose
//! disk and cores serve both, an upload running beside a checkpoint burst
//! takes their bandwidth from the writer: reading dirty pages back,
//! checksumming and sending them. So an upload part waits while a body
//! is making progress, and goes once bodies have been quiet for
//! `upload_quiet` ([`QUIET`]).
//!
//! The wait is bounded, so a writer that never pauses still sees its
//! data reach S3: at most `upload_give_way` per part, and not at all
//! while a writer waits for staging room, staging is more than half
//! full, or the worker is closing (the backlog drains before it stops).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

// tokio's clock, so tests can drive the waits with paused time.
use tokio::time::Instant;

use super::WriteBack;

/// The product default for `WriteBackConfig::upload_give_way`.
pub(crate) const DEFAULT_MOST: Duration = Duration::from_secs(2);
/// The product default for `WriteBackConfig::upload_quiet`: how long
/// bodies must have made no progress before uploads go. A checkpoint
/// writer opens its next file within milliseconds of closing the last.
pub(crate) const QUIET: Duration = Duration::from_millis(200);

/// When a body being taken last started, staged a page or ended, and
/// how many of its pages are being written now: a body that is open but
/// idle (a log file held open for hours) stops counting once it has been
/// quiet, one whose pages wait on a busy disk does not.
#[derive(Debug)]
pub(crate) struct TakeActivity {
    epoch: Instant,
    /// Milliseconds since `epoch`, plus one; zero: never.
    last_ms: AtomicU64,
    pages_writing: AtomicUsize,
}

impl Default for TakeActivity {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
            pages_writing: AtomicUsize::new(0),
        }
    }
}

/// A body's page being written to disk (see [`WriteBack::page_writing`]).
pub(crate) struct PageWriting(Arc<WriteBack>);

impl Drop for PageWriting {
    fn drop(&mut self) {
        let activity = &self.0.take_activity;
        activity.note();
        activity.pages_writing.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TakeActivity {
    pub(crate) fn note(&self) {
        let now = self.epoch.elapsed().as_millis() as u64 + 1;
        self.last_ms.fetch_max(now, Ordering::Relaxed);
    }

    /// Time since the last activity; `None`: none ever.
    pub(crate) fn since(&self) -> Option<Duration> {
        match self.last_ms.load(Ordering::Relaxed) {
            0 => None,
            last => Some(
                self.epoch
                    .elapsed()
                    .saturating_sub(Duration::from_millis(last - 1)),
            ),
        }
    }
}

impl WriteBack {
    /// Notes that a body being taken staged a page.
    pub(crate) fn note_take_progress(&self) {
        self.take_activity.note();
    }

    /// Counts a body's page as being written until the guard drops.
    pub(crate) fn page_writing(self: &Arc<Self>) -> PageWriting {
        self.take_activity
            .pages_writing
            .fetch_add(1, Ordering::AcqRel);
        PageWriting(self.clone())
    }

    /// Waits (see the module docs) until bodies being taken have been
    /// quiet for `upload_quiet`, at most `upload_give_way`. Returns how
    /// long it waited.
    pub(crate) async fn give_way_to_writes(
        &self,
        closing: &tokio::sync::watch::Sender<bool>,
    ) -> Duration {
        let (most, quiet) = (self.config.upload_give_way, self.config.upload_quiet);
        let started = Instant::now();
        loop {
            let waited = started.elapsed();
            if waited >= most || *closing.borrow() || self.must_not_wait() {
                return waited;
            }
            let writing = self.take_activity.pages_writing.load(Ordering::Acquire) > 0;
            let since = self.take_activity.since();
            let left = match since.filter(|s| *s < quiet) {
                Some(since) => quiet - since,
                // A page still on its way to disk: look again shortly.
                None if writing => quiet.min(Duration::from_millis(50)),
                None => return waited,
            };
            tokio::time::sleep(left.min(most - waited)).await;
        }
    }

    /// Whether no body has staged a page within `upload_quiet` and none
    /// is being written.
    pub(super) fn bodies_quiet(&self) -> bool {
        let quiet = self.config.upload_quiet;
        self.take_activity.since().is_none_or(|s| s >= quiet)
            && self.take_activity.pages_writing.load(Ordering::Acquire) == 0
    }

    /// Staging needs the uploads now.
    fn must_not_wait(&self) -> bool {
        self.writers_wait_for_room() || self.dirty_bytes() > self.config.staging_limit / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writeback::WriteBackConfig;

    const MOST: Duration = Duration::from_secs(2);

    fn write_back(dir: &std::path::Path) -> WriteBack {
        let config = WriteBackConfig {
            staging_limit: 64 << 20,
            upload_give_way: MOST,
            ..WriteBackConfig::default()
        };
        WriteBack::open(dir, config).expect("write-back opens")
    }

    fn open() -> (
        tempfile::TempDir,
        WriteBack,
        tokio::sync::watch::Sender<bool>,
    ) {
        let dir = tempfile::tempdir().expect("temp dir");
        let wb = write_back(dir.path());
        (dir, wb, tokio::sync::watch::Sender::new(false))
    }

    #[tokio::test(start_paused = true)]
    async fn with_no_body_taken_an_upload_goes_at_once() {
        let (_dir, wb, closing) = open();
        assert_eq!(wb.give_way_to_writes(&closing).await, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upload_waits_until_bodies_have_been_quiet() {
        let (_dir, wb, closing) = open();
        wb.note_take_progress();
        tokio::time::advance(Duration::from_millis(150)).await;
        wb.note_take_progress();
        // Quiet from here on: the wait ends one quiet period after the
        // last page, 150 ms + QUIET after the first.
        let waited = wb.give_way_to_writes(&closing).await;
        assert_eq!(waited, QUIET, "{waited:?}");
        // A body quiet for longer than that is an idle open file.
        tokio::time::advance(QUIET).await;
        assert_eq!(wb.give_way_to_writes(&closing).await, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_never_pauses_holds_an_upload_at_most_upload_give_way() {
        let (_dir, wb, closing) = open();
        let wb = std::sync::Arc::new(wb);
        let writer = {
            let wb = wb.clone();
            tokio::spawn(async move {
                loop {
                    wb.note_take_progress();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(wb.give_way_to_writes(&closing).await, MOST);
        writer.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_page_on_its_way_to_a_slow_disk_keeps_its_body_active() {
        let (_dir, wb, closing) = open();
        let wb = std::sync::Arc::new(wb);
        wb.note_take_progress();
        let page = wb.page_writing();
        // The page takes 1 s to reach the disk, far past the quiet time.
        let slow = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(page);
        });
        let waited = wb.give_way_to_writes(&closing).await;
        assert_eq!(waited, Duration::from_secs(1) + QUIET, "{waited:?}");
        slow.await.expect("the page write ends");
    }

    #[tokio::test(start_paused = true)]
    async fn staging_that_needs_the_uploads_is_never_held_up() {
        let (_dir, wb, closing) = open();
        wb.note_take_progress();
        {
            let _waiting = wb.wait_for_room();
            assert_eq!(wb.give_way_to_writes(&closing).await, Duration::ZERO);
        }
        assert!(wb.try_reserve(40 << 20), "room for 40 of 64 MiB");
        assert_eq!(wb.give_way_to_writes(&closing).await, Duration::ZERO);
        wb.release(40 << 20);
        closing.send_replace(true);
        assert_eq!(wb.give_way_to_writes(&closing).await, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn zero_turns_the_wait_off() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = WriteBackConfig {
            upload_give_way: Duration::ZERO,
            ..WriteBackConfig::default()
        };
        let wb = WriteBack::open(dir.path(), config).expect("write-back opens");
        wb.note_take_progress();
        let closing = tokio::sync::watch::Sender::new(false);
        assert_eq!(wb.give_way_to_writes(&closing).await, Duration::ZERO);
    }
}
