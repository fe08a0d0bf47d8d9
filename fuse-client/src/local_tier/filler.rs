//! Fills of the local tier run on threads of their own, apart from the
//! reads that produced their bytes, in two lanes:
//! - **background**: one low-priority thread, so that on a node whose
//!   CPUs are busy serving a cold read, writing the copy does not slow
//!   that read down. A fill that finds this lane full, or the mount's
//!   memory spent, is dropped: its blocks stay missing and are fetched
//!   (and filled) by a later read or by completion.
//! - **kept**: for objects a reader wants whole. Dropping their fills cost
//!   a second fetch of the same bytes, and under a training loader's
//!   load it left half of each object missing until epochs later (DLIO's
//!   UNet3D: the objects were not whole before the third epoch). A fill
//!   here waits for room instead (back-pressure on the reader, bounded
//!   by [`KEPT_WAIT`]), and the thread runs at normal priority, since
//!   readers may be waiting on it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::TierObject;
use crate::memory::{MemoryBudget, Reservation};

/// Fills waiting at most per lane (more on the kept lane, whose fills are
/// never dropped for their count alone), and their bytes at most (each
/// also holds its bytes' share of the mount's memory budget).
const QUEUE_DEPTH: usize = 256;
const KEPT_QUEUE_DEPTH: usize = 4096;
const QUEUE_BYTES: u64 = 64 << 20;
/// The longest a kept fill waits for room before it is dropped after all
/// (the object is then completed later): a bound on what a stalled disk
/// costs a reader.
pub const KEPT_WAIT: Duration = Duration::from_secs(5);

/// [`QUEUE_BYTES`], or `LAKECACHE_TIER_FILL_QUEUE_BYTES` (tests force a
/// tiny queue to show that dropped fills are completed later; 0 turns
/// the background lane off, so that every fill there is dropped however
/// fast the disk: a tiny queue still takes each fill that finds it
/// empty, and on a fast machine that can be all of them).
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
    /// Counted in the object's kept bytes in flight until written.
    kept: bool,
}

#[derive(Default)]
pub struct FillStats {
    pub filled_bytes: AtomicU64,
    pub dropped_bytes: AtomicU64,
    /// Bytes of kept fills that waited for room in their lane.
    pub kept_waited_bytes: AtomicU64,
}

/// Bytes queued or being written on one lane (fills are never empty).
#[derive(Default)]
struct Pending {
    bytes: Mutex<u64>,
    idle: Condvar,
    room: tokio::sync::Notify,
}

impl Pending {
    /// Counts `len` in, when the lane is empty or it fits.
    fn try_add(&self, len: u64) -> bool {
        let mut pending = lock(&self.bytes);
        if *pending > 0 && *pending + len > queue_bytes() {
            return false;
        }
        *pending += len;
        true
    }

    fn finish(&self, len: u64) {
        let mut pending = lock(&self.bytes);
        *pending = pending.saturating_sub(len);
        if *pending == 0 {
            self.idle.notify_all();
        }
        drop(pending);
        self.room.notify_waiters();
    }

    fn wait_idle(&self, deadline: Instant) -> bool {
        let pending = lock(&self.bytes);
        let limit = deadline.saturating_duration_since(Instant::now());
        let (pending, timeout) = self
            .idle
            .wait_timeout_while(pending, limit, |n| *n > 0)
            .unwrap_or_else(|e| e.into_inner());
        drop(pending);
        !timeout.timed_out()
    }
}

#[derive(Clone)]
struct Lane {
    tx: SyncSender<Job>,
    pending: Arc<Pending>,
}

impl Lane {
    fn start(name: &str, low_priority: bool, stats: Arc<FillStats>) -> Self {
        let (tx, rx) = sync_channel(if low_priority {
            QUEUE_DEPTH
        } else {
            KEPT_QUEUE_DEPTH
        });
        let pending = Arc::new(Pending::default());
        let thread_pending = pending.clone();
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(rx, stats, thread_pending, low_priority));
        if let Err(e) = spawned {
            // Without the thread every fill is dropped; reads still work.
            tracing::warn!(error = %e, lane = name, "starting a local tier fill thread failed");
        }
        Self { tx, pending }
    }

    /// Sends a job whose bytes `try_add` counted in; false if dropped.
    fn send(&self, job: Job) -> bool {
        let len = job.bytes.len() as u64;
        match self.tx.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.pending.finish(len);
                false
            }
        }
    }
}

#[derive(Clone)]
pub(crate) struct FillQueue {
    background: Lane,
    kept: Lane,
    stats: Arc<FillStats>,
}

impl FillQueue {
    /// Starts the fill threads; they end once every queue handle is gone.
    pub fn start() -> Self {
        let stats = Arc::new(FillStats::default());
        Self {
            background: Lane::start("lakecache-tier-fill", true, stats.clone()),
            kept: Lane::start("lakecache-tier-keep", false, stats.clone()),
            stats,
        }
    }

    pub fn stats(&self) -> &FillStats {
        &self.stats
    }

    fn dropped(&self, len: u64) {
        self.stats.dropped_bytes.fetch_add(len, Ordering::Relaxed);
    }

    /// Queues a background fill, or drops it when the filler is behind.
    pub fn submit(&self, object: Arc<TierObject>, offset: u64, bytes: Bytes, memory: Reservation) {
        let len = bytes.len() as u64;
        if queue_bytes() == 0 || !self.background.pending.try_add(len) {
            return self.dropped(len);
        }
        let job = Job {
            object,
            offset,
            bytes,
            _memory: memory,
            kept: false,
        };
        if !self.background.send(job) {
            self.dropped(len);
        }
    }

    /// Queues a kept fill, waiting (at most [`KEPT_WAIT`]) for room in the
    /// lane; dropped only past that. Its share of `budget` is taken when
    /// free, never waited for.
    pub async fn submit_kept(
        &self,
        object: Arc<TierObject>,
        offset: u64,
        bytes: Bytes,
        budget: &MemoryBudget,
    ) {
        let len = bytes.len() as u64;
        let deadline = tokio::time::Instant::now() + KEPT_WAIT;
        let mut waited = false;
        let pending = &self.kept.pending;
        loop {
            let room = pending.room.notified();
            tokio::pin!(room);
            // Registered before the check, so a finish between the check
            // and the wait still wakes it.
            room.as_mut().enable();
            if pending.try_add(len) {
                break;
            }
            waited = true;
            if tokio::time::timeout_at(deadline, room).await.is_err() {
                return self.dropped(len);
            }
        }
        // Never a wait for memory: the budget is often all held by read
        // buffers whose tasks wait on this very fill (S3 10 ms away, the
        // read-ahead of TensorFlow's TFRecord readers: 5 s stalls, cold
        // ResNet-50 AU 11% against 38% without a tier). The bytes are the
        // reader's buffer, shared, and the lane bounds what outlives it.
        let memory = budget.try_reserve(len).unwrap_or_else(Reservation::none);
        if waited {
            self.stats
                .kept_waited_bytes
                .fetch_add(len, Ordering::Relaxed);
        }
        object.kept_in_flight(len as i64);
        let job = Job {
            object: object.clone(),
            offset,
            bytes,
            _memory: memory,
            kept: true,
        };
        if !self.kept.send(job) {
            object.kept_in_flight(-(len as i64));
            self.dropped(len);
        }
    }

    /// Waits until queued fills are written (at most `limit`).
    pub fn drain(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        self.kept.pending.wait_idle(deadline) && self.background.pending.wait_idle(deadline)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(rx: Receiver<Job>, stats: Arc<FillStats>, pending: Arc<Pending>, low_priority: bool) {
    if low_priority {
        lower_priority();
    }
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
        if job.kept {
            job.object.kept_in_flight(-(len as i64));
        }
        drop(job);
        pending.finish(len);
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
