//! Fencing writes that outlived their client's patience. A mount gives up
//! on a worker that makes no progress for its deadline and sends the
//! write to another worker; if this worker was merely paused (SIGSTOP, a
//! frozen VM, a starved host), it resumes holding a write that is no
//! longer wanted, possibly complete, and must not store it: the
//! application may have written a newer version since.
//!
//! A thread of its own notes every gap in its own running (a paused
//! process runs no thread). Before a write commits (the S3 upload
//! completes, or the write-back record is synced), it is refused when
//! such a pause, at least as long as the client's deadline, happened
//! after the client sent it, or is still being noticed now.

use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::cache::CacheError;

/// How often the watch thread runs; gaps shorter than
/// [`NOTED_PAUSE`] are ordinary scheduling.
const TICK: Duration = Duration::from_millis(50);
const NOTED_PAUSE: Duration = Duration::from_millis(500);
/// Pauses remembered (the newest).
const KEPT_PAUSES: usize = 64;

/// One pause: when it ended (wall clock, ms since the epoch) and how long.
#[derive(Debug, Clone, Copy)]
struct Pause {
    ended_ms: u64,
    len: Duration,
}

struct Watch {
    last_tick: Mutex<Instant>,
    pauses: Mutex<VecDeque<Pause>>,
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn watch() -> &'static Watch {
    static WATCH: OnceLock<&'static Watch> = OnceLock::new();
    WATCH.get_or_init(|| {
        let watch: &'static Watch = Box::leak(Box::new(Watch {
            last_tick: Mutex::new(Instant::now()),
            pauses: Mutex::new(VecDeque::new()),
        }));
        let spawned = std::thread::Builder::new()
            .name("pause-watch".into())
            .spawn(move || loop {
                std::thread::sleep(TICK);
                let now = Instant::now();
                let gap = now.duration_since(std::mem::replace(&mut *lock(&watch.last_tick), now));
                if gap >= NOTED_PAUSE {
                    tracing::warn!(paused_ms = gap.as_millis() as u64, "this worker did not run for a while (stopped, frozen or starved): writes sent before it are fenced");
                    let mut pauses = lock(&watch.pauses);
                    if pauses.len() == KEPT_PAUSES {
                        pauses.pop_front();
                    }
                    pauses.push_back(Pause {
                        ended_ms: wall_ms(),
                        len: gap,
                    });
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "starting the pause watch failed; writes are not fenced");
        }
        watch
    })
}

/// Starts the watch (it must run before a pause to notice it).
pub fn start() {
    watch();
}

/// A write's client: when it sent the write (its wall clock, ms since
/// the epoch) and how long it waits for progress before giving up.
#[derive(Debug, Clone, Copy)]
pub struct ClientPatience {
    pub sent_ms: u64,
    pub deadline: Duration,
}

impl ClientPatience {
    /// Why the client may have given up on this write, if it may have.
    pub fn outlived(&self) -> Option<String> {
        let w = watch();
        let running_gap = lock(&w.last_tick).elapsed();
        if running_gap >= self.deadline.max(NOTED_PAUSE) {
            return Some(format!(
                "this worker is only now resuming from a pause of {running_gap:?}"
            ));
        }
        lock(&w.pauses).iter().rev().find_map(|p| {
            let overlap = p.len.min(Duration::from_millis(
                p.ended_ms.saturating_sub(self.sent_ms),
            ));
            (overlap >= self.deadline).then(|| {
                format!(
                    "this worker was paused for {:?} after the client sent the write",
                    p.len
                )
            })
        })
    }
}

tokio::task_local! {
    static PATIENCE: ClientPatience;
}

/// Runs a write with its client's patience, for [`check`] to consult.
pub async fn scope<F: std::future::Future>(
    patience: Option<ClientPatience>,
    write: F,
) -> F::Output {
    match patience {
        Some(p) => PATIENCE.scope(p, write).await,
        None => write.await,
    }
}

/// Called right before a write commits: refuses it when its client may
/// have given up on it and sent it elsewhere.
pub fn check() -> Result<(), CacheError> {
    let outlived = PATIENCE.try_with(|p| p.outlived()).ok().flatten();
    match outlived {
        Some(why) => Err(CacheError::Fenced(format!(
            "{why}, longer than the client waits ({}): not storing a write the client gave up on",
            PATIENCE
                .try_with(|p| format!("{:?}", p.deadline))
                .unwrap_or_default()
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_after_the_write_was_sent_outlives_a_shorter_patience() {
        start();
        let w = watch();
        let now = wall_ms();
        lock(&w.pauses).push_back(Pause {
            ended_ms: now,
            len: Duration::from_secs(5),
        });
        let sent_before = ClientPatience {
            sent_ms: now - 6_000,
            deadline: Duration::from_secs(2),
        };
        assert!(sent_before.outlived().is_some());
        // Sent 1 s before the pause ended: only 1 s of it counts.
        let sent_late = ClientPatience {
            sent_ms: now - 1_000,
            deadline: Duration::from_secs(2),
        };
        assert!(sent_late.outlived().is_none());
        let patient = ClientPatience {
            sent_ms: now - 6_000,
            deadline: Duration::from_secs(10),
        };
        assert!(patient.outlived().is_none());
        lock(&w.pauses).clear();
    }
}
