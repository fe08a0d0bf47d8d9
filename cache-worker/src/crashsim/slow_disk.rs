//! A slow disk, for tests: every sync of a file with a given name under a
//! given directory takes a set time longer. Independent of the power-loss
//! simulation, and inert unless [`slow_syncs`] was called.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

static ON: AtomicBool = AtomicBool::new(false);
static RULE: Mutex<Option<(PathBuf, String, Duration)>> = Mutex::new(None);
static UNDER_WAY: AtomicU64 = AtomicU64::new(0);

/// Syncs of files named `file_name` under `root` take `delay` longer.
pub fn slow_syncs(root: &Path, file_name: &str, delay: Duration) {
    *rule() = Some((root.to_path_buf(), file_name.to_string(), delay));
    ON.store(true, Ordering::SeqCst);
}

/// Syncs are fast again.
pub fn fast_syncs() {
    ON.store(false, Ordering::SeqCst);
    *rule() = None;
}

/// Slowed syncs going on now.
pub fn under_way() -> u64 {
    UNDER_WAY.load(Ordering::SeqCst)
}

fn rule() -> std::sync::MutexGuard<'static, Option<(PathBuf, String, Duration)>> {
    RULE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts a slowed sync as under way until dropped.
pub(crate) struct Slowed;

impl Drop for Slowed {
    fn drop(&mut self) {
        UNDER_WAY.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits the rule's delay if it covers `path` (before its sync).
pub(crate) fn enter(path: &Path) -> Option<Slowed> {
    if !ON.load(Ordering::Relaxed) {
        return None;
    }
    let delay = rule().as_ref().and_then(|(root, name, delay)| {
        let named = path.file_name().is_some_and(|n| *n == **name);
        (named && path.starts_with(root)).then_some(*delay)
    })?;
    UNDER_WAY.fetch_add(1, Ordering::SeqCst);
    let slowed = Slowed;
    std::thread::sleep(delay);
    Some(slowed)
}
