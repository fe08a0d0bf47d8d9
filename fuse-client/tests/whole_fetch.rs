//! A random reader's object fetched whole into the node-local tier, and
//! that object replaced in S3 while the fetch runs: the fetch stops, and
//! no read mixes bytes of two versions.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lakecache_fuse::data_plane::{DataFault, DataOp, FaultyDataPlane, MemoryDataPlane};
use lakecache_fuse::local_tier::LocalTier;
use lakecache_fuse::{Fs, FsConfig, FsError, ROOT_INO};

const BUCKET: &str = "data";
const MIB: usize = 1 << 20;

fn body(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 12) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_replaced_during_its_whole_fetch_ends_the_fetch_and_no_read_mixes_versions() {
    let len = 24 * MIB;
    let (old, new) = (body(len, 1), body(len, 2));
    let plane = Arc::new(FaultyDataPlane::new(MemoryDataPlane::new()));
    plane.inner().insert(BUCKET, "shard.bin", old.clone());
    let dir = tempfile::tempdir().unwrap();
    let tier = Arc::new(LocalTier::open(dir.path(), 256 * MIB as u64).unwrap());
    let mut config = FsConfig::new(BUCKET, "");
    // Every open asks S3 for the current version.
    config.attr_ttl = Duration::ZERO;
    config.entry_ttl = Duration::ZERO;
    let fs = Fs::new(plane.clone(), config).with_local_tier(tier.clone());
    let node = fs.lookup(ROOT_INO, "shard.bin").await.unwrap();
    let (fh, _) = fs
        .open(node.ino, libc::O_RDONLY, std::process::id())
        .await
        .unwrap();
    // A distant store: the whole fetch takes a while.
    plane.inject(
        DataOp::Read,
        0,
        u64::MAX,
        DataFault::Delay(Duration::from_millis(300)),
    );
    let offsets = [
        17 * MIB,
        3 * MIB + 4096,
        11 * MIB,
        22 * MIB,
        5 * MIB,
        19 * MIB,
    ];
    let completer = fs.completer().expect("a tier has completion").clone();
    // The object is replaced the moment its whole fetch is asked for,
    // while the fetch's first requests are on their way.
    let replace = {
        let (plane, completer, new) = (plane.clone(), completer.clone(), new.clone());
        tokio::spawn(async move {
            while completer.stats().asked.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            plane.inner().insert(BUCKET, "shard.bin", new);
        })
    };
    // The third jump asks for the object whole.
    let read_old_or_stale = |at: usize, got: Result<bytes::Bytes, FsError>| match got {
        Ok(got) => assert!(
            got[..] == old[at..at + 4096],
            "read at {at} is not the old version"
        ),
        Err(FsError::Stale) => {}
        Err(e) => panic!("read at {at}: {e}"),
    };
    for &at in &offsets[..3] {
        read_old_or_stale(at, fs.read(fh, at as u64, 4096).await);
    }
    replace.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while completer.stats().abandoned.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < deadline,
            "the whole fetch went on after the object was replaced: {:?}",
            completer.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(completer.stats().completed.load(Ordering::Relaxed), 0);
    // The open handle reads its own version, or learns it is gone.
    for &at in &offsets {
        read_old_or_stale(at, fs.read(fh, at as u64, 4096).await);
    }
    fs.release(fh).await.unwrap();
    plane.heal();
    // A new open reads the new version, whole and only it.
    let node = fs.lookup(ROOT_INO, "shard.bin").await.unwrap();
    let (fh, _) = fs
        .open(node.ino, libc::O_RDONLY, std::process::id())
        .await
        .unwrap();
    let mut got = Vec::with_capacity(len);
    while got.len() < len {
        let piece = fs.read(fh, got.len() as u64, 1 << 20).await.unwrap();
        assert!(!piece.is_empty());
        got.extend_from_slice(&piece);
    }
    assert!(got == new, "the new version read back wrong");
    fs.release(fh).await.unwrap();
}
