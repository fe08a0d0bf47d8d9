//! Directory-order prefetch, driven through `Fs` over the in-memory data
//! plane: which readers get it, its bounds, and when it stops.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lakecache_fuse::data_plane::{DataFault, DataOp, FaultyDataPlane, MemoryDataPlane, Quirks};
use lakecache_fuse::{Fs, FsConfig, FsError, ROOT_INO};

const BUCKET: &str = "data";
const KIB: usize = 1024;

struct Setup {
    fs: Arc<Fs>,
    plane: Arc<FaultyDataPlane<MemoryDataPlane>>,
}

fn body(name: &str, len: usize) -> Vec<u8> {
    let seed = name
        .bytes()
        .fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..len)
        .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
        .collect()
}

impl Setup {
    fn new(quirks: Quirks, window: u64, names: &[String], len: usize) -> Self {
        let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::with_quirks(quirks)));
        for n in names {
            plane
                .inner()
                .insert(BUCKET, &format!("d/{n}"), body(n, len));
        }
        let mut config = FsConfig::new(BUCKET, "");
        config.dir_prefetch_window = window;
        let fs = Arc::new(Fs::new(plane.clone(), config));
        Self { fs, plane }
    }

    /// `ls d`: the listing the window follows.
    async fn list(&self) -> u64 {
        let dir = self.fs.lookup(ROOT_INO, "d").await.expect("lookup d");
        self.fs.list_dir(dir.ino).await.expect("list d");
        dir.ino
    }

    async fn read(&self, dir: u64, name: &str) -> Result<Vec<u8>, FsError> {
        let node = self.fs.lookup(dir, name).await?;
        let (fh, _) = self
            .fs
            .open(node.ino, libc::O_RDONLY, std::process::id())
            .await?;
        let mut out = Vec::new();
        let result = loop {
            match self.fs.read(fh, out.len() as u64, 128 * KIB as u32).await {
                Ok(b) if b.is_empty() => break Ok(out),
                Ok(b) => out.extend_from_slice(&b),
                Err(e) => break Err(e),
            }
        };
        self.fs.release(fh).await?;
        result
    }

    fn stat(
        &self,
        f: impl Fn(&lakecache_fuse::fs::prefetch::PrefetchStats) -> &std::sync::atomic::AtomicU64,
    ) -> u64 {
        f(&self.fs.dir_prefetch().stats).load(Ordering::Relaxed)
    }
}

fn names(n: usize, padded: bool) -> Vec<String> {
    (0..n)
        .map(|i| {
            if padded {
                format!("f{i:04}")
            } else {
                format!("f{i}")
            }
        })
        .collect()
}

/// 40 files read whole in `files`' order after `ls`: at least 35 opens
/// find their file prefetched, each file is fetched exactly once and
/// nothing is dropped unread.
async fn read_forty_in_order(files: &[String]) {
    let s = Setup::new(Quirks::default(), 1 << 20, files, 10 * KIB);
    let dir = s.list().await;
    for n in files {
        assert_eq!(
            s.read(dir, n).await.expect("read"),
            body(n, 10 * KIB),
            "{n}"
        );
    }
    let used = s.stat(|st| &st.used);
    assert!(
        used >= 35,
        "only {used} of 40 opens found their file prefetched"
    );
    assert_eq!(
        s.plane.calls(DataOp::Read),
        40,
        "each file is fetched exactly once"
    );
    assert_eq!(s.stat(|st| &st.wasted), 0);
}

#[tokio::test]
async fn a_reader_in_listing_order_gets_the_next_files_fetched_once_each() {
    read_forty_in_order(&names(40, true)).await;
}

#[tokio::test]
async fn numbered_names_read_in_number_order_are_followed() {
    // Listing order is f0, f1, f10, f11, ...: fio reads f0, f1, f2, ...
    read_forty_in_order(&names(40, false)).await;
}

#[tokio::test]
async fn the_window_stays_within_its_byte_bound() {
    let files = names(60, true);
    let window = 64 * KIB as u64;
    let s = Setup::new(Quirks::default(), window, &files, 10 * KIB);
    // Slow fetches: the window fills before the reader drains it.
    s.plane.inject(
        DataOp::Read,
        0,
        u64::MAX,
        DataFault::Delay(Duration::from_millis(20)),
    );
    let dir = s.list().await;
    for n in &files {
        assert_eq!(s.read(dir, n).await.expect("read"), body(n, 10 * KIB));
        assert!(s.fs.dir_prefetch().held_bytes() <= window);
    }
    let peak = s.stat(|st| &st.peak_window_bytes);
    assert!(
        peak > 0 && peak <= window,
        "peak window {peak} bytes, bound {window}"
    );
    assert!(s.stat(|st| &st.used) >= 50);
}

#[tokio::test]
async fn a_reader_that_stops_has_its_window_dropped() {
    let files = names(100, true);
    let s = Setup::new(Quirks::default(), 1 << 20, &files, 10 * KIB);
    tokio::spawn(Fs::housekeeping(Arc::downgrade(&s.fs)));
    // Fetches that cannot finish while the reader is gone.
    s.plane.inject(
        DataOp::Read,
        0,
        u64::MAX,
        DataFault::Delay(Duration::from_secs(30)),
    );
    let dir = s.list().await;
    s.plane.heal();
    for n in &files[..4] {
        s.read(dir, n).await.expect("read");
    }
    s.plane.inject(
        DataOp::Read,
        0,
        u64::MAX,
        DataFault::Delay(Duration::from_secs(30)),
    );
    s.read(dir, &files[4]).await.expect("read");
    eprintln!(
        "{:?} held {}",
        s.fs.dir_prefetch().stats,
        s.fs.dir_prefetch().held_bytes()
    );
    assert!(s.fs.dir_prefetch().held_bytes() > 0, "the window opened");
    let deadline = Instant::now() + Duration::from_secs(15);
    while s.fs.dir_prefetch().held_bytes() > 0 {
        assert!(
            Instant::now() < deadline,
            "the window outlived its idle reader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(s.stat(|st| &st.wasted) > 0);
}

#[tokio::test]
async fn a_reader_that_jumps_cancels_the_window() {
    let files = names(100, true);
    let s = Setup::new(Quirks::default(), 1 << 20, &files, 10 * KIB);
    let dir = s.list().await;
    for n in &files[..5] {
        s.read(dir, n).await.expect("read");
    }
    let started = s.stat(|st| &st.started);
    assert!(started > 0);
    // A shuffled reader from here on.
    for i in [70, 20, 90, 40] {
        assert_eq!(
            s.read(dir, &files[i]).await.expect("read"),
            body(&files[i], 10 * KIB)
        );
    }
    assert_eq!(
        s.fs.dir_prefetch().held_bytes(),
        0,
        "the window was dropped"
    );
    assert_eq!(
        s.stat(|st| &st.started),
        started,
        "no new window for a shuffled reader"
    );
}

#[tokio::test]
async fn a_file_replaced_after_its_prefetch_reads_whole_from_one_version() {
    let files = names(30, true);
    let s = Setup::new(Quirks::default(), 1 << 20, &files, 10 * KIB);
    let dir = s.list().await;
    for n in &files[..5] {
        s.read(dir, n).await.expect("read");
    }
    let replaced = &files[10];
    let new_body = body("new", 12 * KIB);
    s.plane
        .inner()
        .insert(BUCKET, &format!("d/{replaced}"), new_body.clone());
    for n in &files[5..] {
        let got = s.read(dir, n).await.expect("read");
        if n == replaced {
            assert!(
                got == body(n, 10 * KIB) || got == new_body,
                "{n} mixes versions or sizes ({} bytes)",
                got.len()
            );
        } else {
            assert_eq!(got, body(n, 10 * KIB));
        }
    }
}

#[tokio::test]
async fn failed_prefetches_cost_the_reader_nothing_but_time() {
    let files = names(30, true);
    let s = Setup::new(Quirks::default(), 1 << 20, &files, 10 * KIB);
    let dir = s.list().await;
    for n in &files[..2] {
        s.read(dir, n).await.expect("read");
    }
    // The window's first fetches (started by the third open, and run
    // before its own read) fail; the opens fetch again.
    s.plane.inject(
        DataOp::Read,
        0,
        8,
        DataFault::Fail(lakecache_fuse::DataError::StoreUnavailable("503".into())),
    );
    for n in &files[2..] {
        assert_eq!(
            s.read(dir, n).await.expect("read"),
            body(n, 10 * KIB),
            "{n}"
        );
    }
    // 30 files, and the 8 failed prefetches fetched again by their opens.
    assert_eq!(s.plane.calls(DataOp::Read), 30 + 8);
    assert!(s.stat(|st| &st.used) >= 20);
}

#[tokio::test]
async fn listings_without_etags_or_a_zero_window_prefetch_nothing() {
    let files = names(20, true);
    for (quirks, window) in [
        (
            Quirks {
                list_without_etags: true,
                ..Quirks::default()
            },
            1 << 20,
        ),
        (Quirks::default(), 0),
    ] {
        let s = Setup::new(quirks, window, &files, 10 * KIB);
        let dir = s.list().await;
        for n in &files {
            assert_eq!(s.read(dir, n).await.expect("read"), body(n, 10 * KIB));
        }
        assert_eq!(s.stat(|st| &st.started), 0, "window {window}");
    }
}
