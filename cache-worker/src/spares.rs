//! Spare page files: written once with zeros and kept, so a write-back
//! body's pages are written over blocks the filesystem already holds as
//! written. A direct write into new blocks on ext4 allocates them as
//! unwritten extents and converts them when the write completes; on this
//! project's VM that held direct writes at 1.4 GiB/s against 2.3 GiB/s
//! over written blocks (fio, 2 MiB writes, 16 in flight), below a
//! checkpoint writer's 1.9 GB/s. The same reason has databases recycle
//! their log segments.
//!
//! How many are kept follows the demand: the most bytes of pages staged
//! in one burst (between two quiet spells of the bodies being taken),
//! capped by `WriteBackConfig::spare_most`. A mount on this host that
//! writes back through the worker says so when it starts
//! ([`Spares::prepare`]), and the whole cap is kept from then on, so
//! the first burst after a new worker starts finds its spares too;
//! otherwise a worker that never takes a write-back body writes no
//! spare. Spares are written only while no body is being taken
//! ([`crate::writeback`]'s filler), and one left by a crash is as good
//! as any other: the page written over it is synced before it counts,
//! like a new file.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use lakecache_protocol::{buffer_pool, direct_io};

use crate::pages::{mkdir_private, HEADER_LEN};

pub struct Spares {
    dir: PathBuf,
    /// Length of every spare: a whole page with its header's room.
    len: u64,
    /// Bytes of spares kept at most.
    most: u64,
    ready: Mutex<Vec<PathBuf>>,
    /// Bytes of pages asked for since the bodies were last quiet.
    burst: AtomicU64,
    /// The largest burst seen (what the filler keeps, up to `most`).
    peak: AtomicU64,
    pub(crate) wanted: tokio::sync::Notify,
}

impl Spares {
    /// Uses `dir` (created 0700); spares of another length (a restart
    /// with another page size) and anything else there are removed.
    pub fn open(dir: &Path, page_size: u64, most: u64) -> io::Result<Self> {
        mkdir_private(dir)?;
        let len = HEADER_LEN + page_size;
        let mut ready = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let fits = entry
                .metadata()
                .is_ok_and(|m| m.is_file() && m.size() == len);
            if fits && ready.len() as u64 * len < most {
                ready.push(path);
            } else {
                let _ = fs::remove_file(&path);
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            len,
            most,
            // Spares found at start are the demand a past run saw.
            peak: AtomicU64::new(ready.len() as u64 * len),
            ready: Mutex::new(ready),
            burst: AtomicU64::new(0),
            wanted: tokio::sync::Notify::new(),
        })
    }

    /// Moves a spare to `to`, for a page; false when none is left (the
    /// page is written into a new file). Either way the page counts
    /// toward the burst's demand.
    pub fn take_to(&self, to: &Path) -> bool {
        self.burst.fetch_add(self.len, Ordering::Relaxed);
        self.wanted.notify_one();
        loop {
            let Some(spare) = lock(&self.ready).pop() else {
                return false;
            };
            if fs::rename(&spare, to).is_ok() {
                return true;
            }
            // Gone from under us (removed by hand): try the next one.
        }
    }

    /// Ends a burst (the bodies went quiet): its bytes count toward how
    /// many spares are kept.
    pub fn burst_ended(&self) {
        let burst = self.burst.swap(0, Ordering::Relaxed);
        self.peak.fetch_max(burst, Ordering::Relaxed);
    }

    /// A writer of bursts announced itself: keep the whole cap from now
    /// on. Returns the cap in bytes.
    pub fn prepare(&self) -> u64 {
        self.peak.fetch_max(self.most, Ordering::Relaxed);
        self.wanted.notify_one();
        self.most
    }

    /// How many more spares the demand seen asks for.
    pub fn missing(&self) -> usize {
        let goal = self.peak.load(Ordering::Relaxed).min(self.most) / self.len;
        (goal as usize).saturating_sub(lock(&self.ready).len())
    }

    /// Length of every spare file (a page and its header's room).
    pub fn file_len(&self) -> u64 {
        self.len
    }

    /// Bytes of spares ready now.
    pub fn bytes(&self) -> u64 {
        lock(&self.ready).len() as u64 * self.len
    }

    #[cfg(test)]
    fn count(&self) -> usize {
        lock(&self.ready).len()
    }

    /// Writes one more spare (zeros, `O_DIRECT`). Ok(false): the
    /// filesystem refuses direct I/O, and spares would not help.
    pub fn fill_one(&self) -> io::Result<bool> {
        let path = self.dir.join(format!(".{}", uuid::Uuid::new_v4().simple()));
        let Some(file) = direct_io::open_direct(&path, true) else {
            return Ok(false);
        };
        let mut zeros = buffer_pool::take(ZEROS_LEN);
        for _ in 0..ZEROS_LEN / ZERO_BLOCK.len() {
            zeros.extend_from_slice(&ZERO_BLOCK);
        }
        let mut written = Ok(());
        let mut at = 0;
        while at < self.len && written.is_ok() {
            let n = (self.len - at).min(ZEROS_LEN as u64) as usize;
            written = direct_io::write_direct(&file, &zeros[..n], at);
            at += n as u64;
        }
        // Named only once whole, so a crash leaves no short spare under
        // a spare's name (the dot-named file is removed at the next open).
        let named = written.and_then(|()| {
            let name = self.dir.join(uuid::Uuid::new_v4().simple().to_string());
            fs::rename(&path, &name).map(|()| name)
        });
        match named {
            Ok(name) => {
                lock(&self.ready).push(name);
                Ok(true)
            }
            Err(e) => {
                let _ = fs::remove_file(&path);
                if e.raw_os_error() == Some(libc::EINVAL) {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }
}

/// Zeros written at a time when filling a spare.
const ZEROS_LEN: usize = 1 << 20;
static ZERO_BLOCK: [u8; 64 << 10] = [0; 64 << 10];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spares_follow_the_largest_burst_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let page = 64 << 10;
        let spares = Spares::open(dir.path(), page, 3 * (HEADER_LEN + page)).unwrap();
        assert_eq!(spares.missing(), 0, "no demand seen, no spare wanted");
        let pages = tempfile::tempdir().unwrap();
        let to = pages.path().join("page");
        assert!(!spares.take_to(&to), "none to take yet");
        assert!(!spares.take_to(&to));
        spares.burst_ended();
        assert_eq!(spares.missing(), 2, "two pages asked for in the burst");
        while spares.missing() > 0 {
            assert!(spares.fill_one().unwrap());
        }
        assert!(spares.take_to(&to));
        assert_eq!(fs::metadata(&to).unwrap().len(), HEADER_LEN + page);
        // A larger burst, capped at three spares.
        for _ in 0..5 {
            spares.take_to(&to);
        }
        spares.burst_ended();
        assert_eq!(spares.missing(), 3);
        spares.fill_one().unwrap();
        spares.fill_one().unwrap();
        // Restarted with another page size: the old spares go, and so
        // does anything that is not a spare.
        fs::write(dir.path().join(".half-written"), b"x").unwrap();
        let again = Spares::open(dir.path(), page, 3 * (HEADER_LEN + page)).unwrap();
        assert_eq!(again.count(), 2, "spares kept over a restart");
        assert!(!dir.path().join(".half-written").exists());
        let other = Spares::open(dir.path(), 2 * page, 1 << 30).unwrap();
        assert_eq!(other.count(), 0);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_prepared_worker_keeps_the_whole_cap_before_any_burst() {
        let dir = tempfile::tempdir().unwrap();
        let page = 64 << 10;
        let len = HEADER_LEN + page;
        // A cap that is not a whole number of spares.
        let spares = Spares::open(dir.path(), page, 3 * len + len / 2).unwrap();
        assert_eq!(spares.missing(), 0);
        assert_eq!(spares.prepare(), 3 * len + len / 2);
        assert_eq!(spares.missing(), 3, "the whole cap, with no page asked for");
        while spares.missing() > 0 {
            assert!(spares.fill_one().unwrap());
        }
        assert_eq!(spares.bytes(), 3 * len);
        // A smaller burst afterwards does not lower the goal.
        let to = dir.path().join("page");
        assert!(spares.take_to(&to));
        spares.burst_ended();
        assert_eq!(spares.missing(), 1);
    }
}
