//! Directories and inodes in the filesystem core: listings are streamed
//! page by page, reused within the entry TTL, dropped when this mount
//! changes the directory, and inodes go away when the kernel forgets them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use lakecache_fuse::data_plane::{DataOp, FaultyDataPlane, MemoryDataPlane, Quirks};
use lakecache_fuse::{Fs, FsConfig, FsError, ROOT_INO};

/// The caller of creating operations in these tests.
const WHO: lakecache_fuse::Creator = lakecache_fuse::Creator {
    uid: 0,
    gid: 0,
    perm: 0o644,
};

const BUCKET: &str = "data";

fn setup(files: usize, ttl: Duration) -> (Arc<Fs>, Arc<FaultyDataPlane<MemoryDataPlane>>) {
    setup_with(files, ttl, true)
}

fn setup_with(
    files: usize,
    ttl: Duration,
    posix_metadata: bool,
) -> (Arc<Fs>, Arc<FaultyDataPlane<MemoryDataPlane>>) {
    let memory = MemoryDataPlane::with_quirks(Quirks::default());
    for i in 0..files {
        memory.insert(BUCKET, &format!("big/f{i:07}"), vec![b'x'; i % 7]);
    }
    let plane = Arc::new(FaultyDataPlane::new(memory));
    let mut config = FsConfig::new(BUCKET, "");
    config.entry_ttl = ttl;
    config.attr_ttl = ttl;
    config.posix_metadata = posix_metadata;
    (Arc::new(Fs::new(plane.clone(), config)), plane)
}

fn pid() -> u32 {
    std::process::id()
}

/// Reads a directory as the kernel does with READDIRPLUS: batches from
/// growing offsets, every entry counted as looked up.
async fn readdirplus_all(fs: &Fs, ino: u64) -> Vec<(String, u64)> {
    let fh = fs.opendir(ino).await.unwrap();
    let mut out = Vec::new();
    loop {
        let batch = fs.readdir(ino, fh, out.len() as u64, true).await.unwrap();
        if batch.is_empty() {
            break;
        }
        for e in batch {
            if e.name != "." && e.name != ".." {
                fs.add_lookup(e.node.ino);
            }
            out.push((e.name, e.node.ino));
        }
    }
    fs.releasedir(fh);
    out
}

#[tokio::test]
async fn opendir_lists_one_page_and_readdir_the_rest_on_demand() {
    let (fs, plane) = setup(5_000, Duration::from_secs(60));
    let big = fs.lookup(ROOT_INO, "big").await.unwrap().ino;
    let lists = plane.calls(DataOp::List);
    let fh = fs.opendir(big).await.unwrap();
    assert_eq!(
        plane.calls(DataOp::List) - lists,
        1,
        "one page before the first entry"
    );
    let first = fs.readdir(big, fh, 0, false).await.unwrap();
    assert!(first.len() > 2 && first.len() <= 1000, "{}", first.len());
    assert_eq!(plane.calls(DataOp::List) - lists, 1);
    let mut seen = first.len();
    loop {
        let batch = fs.readdir(big, fh, seen as u64, false).await.unwrap();
        if batch.is_empty() {
            break;
        }
        // Each call prepares a bounded batch, never the whole remainder.
        assert!(batch.len() <= 512);
        seen += batch.len();
    }
    fs.releasedir(fh);
    assert_eq!(seen, 5_000 + 2);
    assert_eq!(
        plane.calls(DataOp::List) - lists,
        5,
        "5,000 names in five pages"
    );
    // Plain readdir made no inodes for the names.
    assert!(fs.inode_count() < 10, "{} inodes", fs.inode_count());
}

#[tokio::test]
async fn a_second_listing_within_the_ttl_costs_no_list_and_own_writes_show_at_once() {
    let (fs, plane) = setup(2_500, Duration::from_secs(60));
    let big = fs.lookup(ROOT_INO, "big").await.unwrap().ino;
    let cold = fs.list_dir(big).await.unwrap();
    let lists = plane.calls(DataOp::List);
    let warm = fs.list_dir(big).await.unwrap();
    assert_eq!(
        plane.calls(DataOp::List),
        lists,
        "warm listing from the cache"
    );
    assert_eq!(cold.len(), warm.len());

    // A file written through this mount is in the next listing.
    let (_, fh) = fs
        .create(big, "new.bin", pid(), WHO, libc::O_WRONLY)
        .await
        .unwrap();
    fs.write(fh, 0, Bytes::from_static(b"abc")).await.unwrap();
    fs.release(fh).await.unwrap();
    let after = fs.list_dir(big).await.unwrap();
    assert!(after.iter().any(|e| e.name == "new.bin"));
    assert_eq!(after.len(), cold.len() + 1);
    // And a deleted one is gone from it.
    fs.unlink(big, "f0000001").await.unwrap();
    let after = fs.list_dir(big).await.unwrap();
    assert!(!after.iter().any(|e| e.name == "f0000001"));
}

#[tokio::test]
async fn inodes_the_kernel_forgets_are_freed() {
    let (fs, _plane) = setup(20_000, Duration::ZERO);
    let idle = fs.inode_count();
    let big = fs.lookup(ROOT_INO, "big").await.unwrap().ino;
    let entries = readdirplus_all(&fs, big).await;
    assert_eq!(entries.len(), 20_000 + 2);
    assert!(fs.inode_count() >= 20_000);
    // The kernel drops its cache (echo 2 > /proc/sys/vm/drop_caches).
    for (name, ino) in &entries {
        if name != "." && name != ".." {
            fs.forget(*ino, 1);
        }
    }
    fs.forget(big, 1);
    assert_eq!(fs.inode_count(), idle, "every forgotten inode is freed");

    // An unlinked name's inode goes once the kernel forgets it too.
    let node = fs.lookup(ROOT_INO, "big").await.unwrap();
    let victim = fs.lookup(node.ino, "f0000003").await.unwrap();
    fs.unlink(node.ino, "f0000003").await.unwrap();
    fs.forget(victim.ino, 1);
    fs.forget(node.ino, 1);
    assert_eq!(fs.inode_count(), idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_opens_for_writing_one_name_exactly_one_wins() {
    let (fs, plane) = setup(0, Duration::from_secs(60));
    plane.inner().insert(BUCKET, "shared.bin", b"old".to_vec());
    let node = fs.lookup(ROOT_INO, "shared.bin").await.unwrap();
    for _ in 0..50 {
        let flags = libc::O_WRONLY | libc::O_TRUNC;
        let (a, b) = tokio::join!(
            {
                let fs = fs.clone();
                tokio::spawn(async move { fs.open(node.ino, flags, pid()).await })
            },
            {
                let fs = fs.clone();
                tokio::spawn(async move { fs.open(node.ino, flags, pid()).await })
            },
        );
        let results = [a.unwrap(), b.unwrap()];
        let won: Vec<u64> = results
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|(fh, _)| *fh))
            .collect();
        assert_eq!(won.len(), 1, "{results:?}");
        let lost = results.iter().find_map(|r| r.as_ref().err()).unwrap();
        assert!(matches!(lost, FsError::Busy(_)), "{lost:?}");
        assert_eq!(lost.errno(), libc::EBUSY);
        fs.write(won[0], 0, Bytes::from_static(b"new"))
            .await
            .unwrap();
        fs.release(won[0]).await.unwrap();
    }
}

#[tokio::test]
async fn names_looked_up_one_by_one_are_answered_from_a_background_listing() {
    // With the objects' own metadata off: the listing answers everything.
    let (fs, plane) = setup_with(3_000, Duration::from_secs(60), false);
    let big = fs.lookup(ROOT_INO, "big").await.unwrap().ino;
    // Two lookups by name (as `fio` or a data loader stat each file)...
    for name in ["f0000000", "f0000001"] {
        fs.lookup(big, name).await.unwrap();
    }
    // ...start a listing of the directory; wait for it to finish.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while plane.calls(DataOp::List) < 2 + 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (stats, lists) = (plane.calls(DataOp::Stat), plane.calls(DataOp::List));
    for i in 2..3_000 {
        let node = fs.lookup(big, &format!("f{i:07}")).await.unwrap();
        assert_eq!(node.meta.size, (i % 7) as u64);
        assert!(node.meta.etag.is_some());
    }
    assert_eq!(plane.calls(DataOp::Stat), stats, "no HEAD per name");
    assert_eq!(plane.calls(DataOp::List), lists);

    // A name the listing does not have is still asked for: an object
    // created elsewhere after the listing is found...
    plane.inner().insert(BUCKET, "big/late", b"late".to_vec());
    assert_eq!(fs.lookup(big, "late").await.unwrap().meta.size, 4);
    assert!(matches!(
        fs.lookup(big, "never").await,
        Err(FsError::NotFound)
    ));
    // ...and one this mount deleted is gone, not served from the listing.
    fs.unlink(big, "f0000005").await.unwrap();
    assert!(matches!(
        fs.lookup(big, "f0000005").await,
        Err(FsError::NotFound)
    ));
}

#[tokio::test]
async fn with_posix_metadata_listings_carry_it_and_lookups_ask_nothing_more() {
    let (fs, plane) = setup(300, Duration::from_secs(60));
    let big = fs.lookup(ROOT_INO, "big").await.unwrap().ino;
    // A full READDIRPLUS gives every entry its metadata with the listing
    // (the worker adds it), not a stat per entry...
    let stats = plane.calls(DataOp::Stat);
    let listed = readdirplus_all(&fs, big).await;
    assert_eq!(listed.len(), 302);
    assert_eq!(plane.calls(DataOp::Stat), stats);
    let (stats, lists) = (plane.calls(DataOp::Stat), plane.calls(DataOp::List));
    // ...so lookups and getattrs after it ask nothing more.
    for i in 0..300 {
        let node = fs.lookup(big, &format!("f{i:07}")).await.unwrap();
        assert!(node.meta.user.is_some());
        fs.getattr(node.ino).await.unwrap();
    }
    assert_eq!(plane.calls(DataOp::Stat), stats);
    assert_eq!(plane.calls(DataOp::List), lists);
}
