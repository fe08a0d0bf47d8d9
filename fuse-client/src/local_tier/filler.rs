//! Fills of the local tier run on one low-priority thread, apart from
//! the reads that produced their bytes: on a node whose CPUs are busy
//! serving a cold read, writing the copy must not slow that read down.
//! A fill that finds the queue full, or the mount's memory spent, is
//! dropped: its blocks stay missing and are fetched (and filled) by a
//! later read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bytes::Bytes;

use super::TierObject;
use crate::memory::Reservation;

/// Fills waiting at most, and their bytes at most (each also holds its
/// bytes' share of the mount's memory budget).
const QUEUE_DEPTH: usize = 256;
const QUEUE_BYTES: u64 = 64 << 20;

/// [`QUEUE_BYTES`], or `LAKECACHE_TIER_FILL_QUEUE_BYTES` (tests force a
/// tiny queue to show that dropped fills are completed later).
fn queue_bytes() -> u64 {
    static BYTES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        std::env::var("LAKECACHE_TIER_FILL_QUEUE_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(QUEUE_BYTES)
    })
}

struct Job {
    object: Arc<TierObject>,
    offset: u64,
    bytes: Bytes,
    _memory: Reservation,
}

#[derive(Default)]
pub struct FillStats {
    pub filled_bytes: AtomicU64,
    pub dropped_bytes: AtomicU64,
    /// Bytes of fills queued or being written (fills are never empty).
    pending: Mutex<u64>,
    idle: Condvar,
}

#[derive(Clone)]
pub(crate) struct FillQueue {
    tx: SyncSender<Job>,
    stats: Arc<FillStats>,
}

impl FillQueue {
    /// Starts the fill thread; it ends once every queue handle is gone.
    pub fn start() -> Self {
        let (tx, rx) = sync_channel(QUEUE_DEPTH);
        let stats = Arc::new(FillStats::default());
        let worker_stats = stats.clone();
        let spawned = std::thread::Builder::new()
            .name("lakecache-tier-fill".into())
            .spawn(move || run(rx, worker_stats));
        if let Err(e) = spawned {
            // Without the thread every fill is dropped; reads still work.
            tracing::warn!(error = %e, "starting the local tier fill thread failed");
        }
        Self { tx, stats }
    }

    pub fn stats(&self) -> &FillStats {
        &self.stats
    }

    /// Queues a fill, or drops it when the filler is behind.
    pub fn submit(&self, object: Arc<TierObject>, offset: u64, bytes: Bytes, memory: Reservation) {
        let len = bytes.len() as u64;
        {
            let mut pending = lock(&self.stats.pending);
            if *pending > 0 && *pending + len > queue_bytes() {
                self.stats.dropped_bytes.fetch_add(len, Ordering::Relaxed);
                return;
            }
            *pending += len;
        }
        let job = Job {
            object,
            offset,
            bytes,
            _memory: memory,
        };
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.dropped_bytes.fetch_add(len, Ordering::Relaxed);
                self.stats.finish_one(len);
            }
        }
    }

    /// Waits until queued fills are written (at most `limit`).
    pub fn drain(&self, limit: Duration) -> bool {
        let pending = lock(&self.stats.pending);
        let (pending, timeout) = self
            .stats
            .idle
            .wait_timeout_while(pending, limit, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        drop(pending);
        !timeout.timed_out()
    }
}

impl FillStats {
    fn finish_one(&self, len: u64) {
        let mut pending = lock(&self.pending);
        *pending = pending.saturating_sub(len);
        if *pending == 0 {
            self.idle.notify_all();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(rx: Receiver<Job>, stats: Arc<FillStats>) {
    lower_priority();
    while let Ok(job) = rx.recv() {
        match job.object.fill(job.offset, &job.bytes) {
            Ok(_) => {
                stats
                    .filled_bytes
                    .fetch_add(job.bytes.len() as u64, Ordering::Relaxed);
            }
            Err(e) => super::Damage::of(&e).note(
                job.object.id(),
                &e,
                "left as a hole, fetched again when read or completed",
            ),
        }
        let len = job.bytes.len() as u64;
        drop(job);
        stats.finish_one(len);
    }
}

/// Runs this thread behind the read path: `LAKECACHE_FILL_NICE` (default
/// 10), or `idle` for CPU time nothing else wants.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let setting = std::env::var("LAKECACHE_FILL_NICE").unwrap_or_else(|_| "10".into());
        let rc = if setting == "idle" {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: changes the scheduling policy of the calling thread only.
            unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) }
        } else {
            let nice = setting.parse::<i32>().unwrap_or(10).clamp(0, 19);
            // SAFETY: with PRIO_PROCESS and this thread's id, setpriority
            // changes this thread's nice value only.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, nice)
            }
        };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "lowering the fill thread's priority failed");
        }
    }
}
