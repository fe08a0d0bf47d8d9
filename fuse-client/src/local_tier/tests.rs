use super::*;

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

const MIB: usize = 1 << 20;

#[test]
fn filled_blocks_read_back_and_missing_ones_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    let body = data(2 * MIB + 1000, 1);
    let o = tier
        .get_or_create("s3://b/k", "e1", body.len() as u64)
        .unwrap();
    assert_eq!(o.read(0, 10).unwrap(), None, "nothing filled yet");
    assert!(!o.fill(0, &body[..MIB]).unwrap());
    assert_eq!(o.read(5, 100).unwrap().unwrap(), &body[5..105]);
    assert_eq!(
        o.read(MIB as u64 - 10, 20).unwrap(),
        None,
        "spans a missing block"
    );
    assert!(
        !o.fill(2 * MIB as u64, &body[2 * MIB..]).unwrap(),
        "the short last block"
    );
    assert!(o.fill(MIB as u64, &body[MIB..2 * MIB]).unwrap(), "complete");
    assert!(o.is_complete());
    assert_eq!(
        o.read(0, body.len() as u64 + 50).unwrap().unwrap(),
        &body[..]
    );
    assert_eq!(
        std::fs::read(o.backing_path()).unwrap(),
        body,
        "the data file is the object"
    );
    assert!(o.verify().unwrap());
}

#[test]
fn a_new_object_has_its_blocks_allocated_before_any_fill() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    let size = 8 * MIB as u64 + 123;
    let o = tier.get_or_create("s3://b/k", "e1", size).unwrap();
    let meta = std::fs::metadata(o.backing_path()).unwrap();
    assert_eq!(meta.len(), size);
    // A sparse file would hold no blocks; st_blocks counts 512-byte units.
    assert!(
        meta.blocks() * 512 >= size,
        "{} bytes allocated for a {size}-byte object",
        meta.blocks() * 512
    );
    assert_eq!(o.read(0, 10).unwrap(), None, "allocated is not filled");
}

#[test]
fn pieces_complete_a_block_once_they_cover_it() {
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    let body = data(MIB + 10, 9);
    let o = tier
        .get_or_create("s3://b/k", "e1", body.len() as u64)
        .unwrap();
    // Overlapping, out-of-order pieces, as read-ahead chunks arrive.
    o.fill(300_000, &body[300_000..700_000]).unwrap();
    o.fill(0, &body[..400_000]).unwrap();
    assert_eq!(o.read(0, 10).unwrap(), None, "block 0 is not whole yet");
    assert!(!o.fill(650_000, &body[650_000..MIB]).unwrap());
    assert_eq!(o.read(0, MIB as u64).unwrap().unwrap(), &body[..MIB]);
    assert!(o.fill(MIB as u64, &body[MIB..]).unwrap(), "complete");
    assert!(o.verify().unwrap());
    for (offset, len) in [(MIB as u64, 11usize), (0, 0), (u64::MAX, 1)] {
        assert!(matches!(
            o.fill(offset, &vec![0; len]),
            Err(TierError::OutOfRange { .. })
        ));
    }
    assert!(matches!(
        tier.get_or_create("s3://b/huge", "e", 65 << 20),
        Err(TierError::TooLarge { .. })
    ));
}

#[test]
fn a_flipped_byte_is_caught_and_the_block_refilled() {
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    let body = data(2 * MIB, 2);
    let o = tier
        .get_or_create("s3://b/k", "e1", body.len() as u64)
        .unwrap();
    o.fill(0, &body).unwrap();
    let f = OpenOptions::new()
        .write(true)
        .open(o.backing_path())
        .unwrap();
    f.write_all_at(&[body[MIB + 7] ^ 0xff], MIB as u64 + 7)
        .unwrap();
    assert_eq!(
        o.read(0, 10).unwrap().unwrap(),
        &body[..10],
        "the other block is fine"
    );
    assert_eq!(
        o.read(MIB as u64, 10).unwrap(),
        None,
        "the bad block is not served"
    );
    assert!(!o.is_complete(), "and is forgotten");
    o.fill(MIB as u64, &body[MIB..]).unwrap();
    assert_eq!(o.read(0, body.len() as u64).unwrap().unwrap(), &body[..]);
    // verify() finds corruption before a passthrough open would.
    f.write_all_at(&[body[3] ^ 0xff], 3).unwrap();
    assert!(!o.verify().unwrap());
    assert!(!o.is_complete());
}

#[test]
fn objects_survive_a_remount_and_damaged_ones_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let body = data(3 * MIB, 3);
    {
        let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
        tier.get_or_create("s3://b/done", "e1", body.len() as u64)
            .unwrap()
            .fill(0, &body)
            .unwrap();
        let partial = tier
            .get_or_create("s3://b/partial", "e1", body.len() as u64)
            .unwrap();
        partial.fill(MIB as u64, &body[MIB..2 * MIB]).unwrap();
        tier.get_or_create("s3://b/meta-bad", "e1", MIB as u64)
            .unwrap()
            .fill(0, &body[..MIB])
            .unwrap();
        tier.get_or_create("s3://b/short", "e1", MIB as u64)
            .unwrap()
            .fill(0, &body[..MIB])
            .unwrap();
        let never = tier
            .get_or_create("s3://b/unflushed", "e1", MIB as u64)
            .unwrap();
        drop(never);
        tier.flush().unwrap();
        // Damage two of them behind the tier's back.
        let bad = tier.get("s3://b/meta-bad", "e1").unwrap();
        let meta = bad.meta_path.clone();
        let text = std::fs::read_to_string(&meta)
            .unwrap()
            .replace("\"size\":1048576", "\"size\":1048577");
        std::fs::write(&meta, text).unwrap();
        let short = tier.get("s3://b/short", "e1").unwrap();
        OpenOptions::new()
            .write(true)
            .open(short.backing_path())
            .unwrap()
            .set_len(10)
            .unwrap();
    }
    std::fs::write(dir.path().join("stray.tmp"), b"x").unwrap();
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    let done = tier.get("s3://b/done", "e1").unwrap();
    assert!(done.is_complete());
    assert_eq!(done.read(0, body.len() as u64).unwrap().unwrap(), &body[..]);
    let partial = tier.get("s3://b/partial", "e1").unwrap();
    assert_eq!(partial.filled_bytes(), MIB as u64);
    assert_eq!(
        partial.read(MIB as u64, 5).unwrap().unwrap(),
        &body[MIB..MIB + 5]
    );
    assert!(
        tier.get("s3://b/meta-bad", "e1").is_none(),
        "metadata checksum failed"
    );
    assert!(
        tier.get("s3://b/short", "e1").is_none(),
        "data file of the wrong length"
    );
    assert!(
        tier.get("s3://b/done", "e2").is_none(),
        "another version is another object"
    );
    assert!(!dir.path().join("stray.tmp").exists());
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(
        files,
        2 + 2 * 3,
        "FORMAT, LOCK and two files per object kept"
    );
    assert_eq!(tier.used(), 2 * body.len() as u64 + MIB as u64);
}

#[test]
fn a_new_version_replaces_the_old_and_eviction_keeps_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 4 * MIB as u64).unwrap();
    let v1 = data(MIB, 4);
    let v2 = data(MIB, 5);
    tier.get_or_create("s3://b/k", "e1", MIB as u64)
        .unwrap()
        .fill(0, &v1)
        .unwrap();
    let new = tier.get_or_create("s3://b/k", "e2", MIB as u64).unwrap();
    assert!(
        tier.get("s3://b/k", "e1").is_none(),
        "the old version is gone"
    );
    new.fill(0, &v2).unwrap();
    assert_eq!(new.read(0, 4).unwrap().unwrap(), &v2[..4]);
    drop(new);
    for i in 0..5 {
        let o = tier
            .get_or_create(&format!("s3://b/o{i}"), "e", MIB as u64)
            .unwrap();
        o.fill(0, &data(MIB, i)).unwrap();
        assert!(tier.used() <= 4 * MIB as u64);
    }
    assert!(
        tier.get("s3://b/k", "e2").is_none(),
        "least recently used went first"
    );
    assert!(tier.get("s3://b/o4", "e").is_some());
    assert_eq!(
        tier.get("s3://b/o3", "e")
            .unwrap()
            .read(0, 8)
            .unwrap()
            .unwrap(),
        &data(MIB, 3)[..8]
    );
}

#[test]
fn a_directory_of_another_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("FORMAT"), "something-else\n").unwrap();
    assert!(matches!(
        LocalTier::open(dir.path(), 1 << 30),
        Err(TierError::Format { .. })
    ));
}

#[test]
fn a_directory_with_other_files_is_refused_and_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let precious = dir.path().join("notes.txt");
    std::fs::write(&precious, "mine").unwrap();
    let err = LocalTier::open(dir.path(), 1 << 30).unwrap_err();
    assert!(matches!(err, TierError::Foreign(_)), "{err}");
    assert!(err.to_string().contains("pick an empty or new directory"));
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "mine");
}

#[test]
fn a_missing_parent_a_file_and_an_oversized_capacity_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = LocalTier::open(&dir.path().join("absent/tier"), 1 << 30).unwrap_err();
    assert!(matches!(err, TierError::NoParent(_)), "{err}");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let err = LocalTier::open(&file, 1 << 30).unwrap_err();
    assert!(matches!(err, TierError::NotADirectory(_)), "{err}");
    let err = LocalTier::open(&dir.path().join("tier"), u64::MAX / 2).unwrap_err();
    assert!(matches!(err, TierError::LargerThanDisk { .. }), "{err}");
}

#[test]
fn a_second_open_of_a_tier_in_use_is_refused_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let first = LocalTier::open(dir.path(), 1 << 30).unwrap();
    let err = LocalTier::open(dir.path(), 1 << 30).unwrap_err();
    assert!(matches!(err, TierError::InUse { .. }), "{err}");
    assert!(err
        .to_string()
        .contains(&format!("pid {}", std::process::id())));
    drop(first);
    LocalTier::open(dir.path(), 1 << 30).unwrap();
}

#[test]
fn concurrent_opens_of_a_new_file_share_one_object() {
    let dir = tempfile::tempdir().unwrap();
    let tier = Arc::new(LocalTier::open(dir.path(), 64 << 20).unwrap());
    let objects: Vec<Arc<TierObject>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let tier = tier.clone();
                scope.spawn(move || {
                    tier.get_or_create("s3://b/new", "e1", 2 * MIB as u64)
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(objects.iter().all(|o| Arc::ptr_eq(o, &objects[0])));
    let body = data(2 * MIB, 6);
    assert!(objects[3].fill(0, &body).unwrap());
    assert!(
        objects[0].backing_path().exists(),
        "nobody unlinked the shared files"
    );
    assert_eq!(
        tier.get("s3://b/new", "e1")
            .unwrap()
            .read(0, 8)
            .unwrap()
            .unwrap(),
        &body[..8]
    );
}

#[test]
fn a_remounted_whole_object_is_trusted_only_while_its_file_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let body = data(3 * MIB + 7, 9);
    let path = {
        let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
        let o = tier
            .get_or_create("s3://b/k", "e1", body.len() as u64)
            .unwrap();
        assert!(o.fill(0, &body).unwrap());
        assert!(o.ready_for_passthrough().unwrap());
        // A repeated fill of what is there writes nothing.
        let before = std::fs::metadata(o.backing_path())
            .unwrap()
            .modified()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(o.fill(MIB as u64, &body[MIB..2 * MIB]).unwrap());
        let after = std::fs::metadata(o.backing_path())
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(before, after, "a duplicate fill rewrote the file");
        o.backing_path().to_path_buf()
    };
    // Untouched: the next mount trusts the stamp.
    {
        let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
        let o = tier.get("s3://b/k", "e1").unwrap();
        assert!(o.ready_for_passthrough().unwrap());
    }
    // Written behind our back (same bytes or not, the times change): the
    // next mount checks it end to end and finds the damage.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[body[2 * MIB + 5] ^ 1], 2 * MIB as u64 + 5)
        .unwrap();
    drop(f);
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    let o = tier.get("s3://b/k", "e1").unwrap();
    assert!(!o.ready_for_passthrough().unwrap(), "damage went unnoticed");
    assert!(!o.is_complete(), "the damaged block is forgotten");
    assert_eq!(o.read(0, MIB as u64).unwrap().unwrap(), &body[..MIB]);
}

#[test]
fn a_tier_of_many_objects_keeps_few_files_open() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let n = 3 * MAX_OPEN_OBJECTS;
    {
        let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
        for i in 0..n {
            let o = tier
                .get_or_create(&format!("s3://b/small-{i}"), "e", 1000)
                .unwrap();
            assert!(o.fill(0, &data(1000, i as u8)).unwrap());
            assert!(tier.open_count.load(Ordering::Relaxed) <= MAX_OPEN_OBJECTS + 1);
        }
    }
    // A remount over all of them opens none until they are read.
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    assert_eq!(tier.open_count.load(Ordering::Relaxed), 0);
    let o = tier.get("s3://b/small-7", "e").unwrap();
    assert_eq!(o.read(0, 1000).unwrap().unwrap(), data(1000, 7));
    assert_eq!(tier.open_count.load(Ordering::Relaxed), 1);
}

#[test]
fn a_remount_with_a_smaller_size_evicts_down_to_it() {
    let dir = tempfile::tempdir().unwrap();
    {
        let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
        for i in 0..4u8 {
            let o = tier
                .get_or_create(&format!("s3://b/k{i}"), "e", MIB as u64)
                .unwrap();
            assert!(o.fill(0, &data(MIB, i)).unwrap());
        }
        assert_eq!(tier.used(), 4 * MIB as u64);
    }
    // Restarted with --local-cache-size lowered below what is held.
    let tier = LocalTier::open(dir.path(), 2 * MIB as u64).unwrap();
    assert!(tier.used() <= 2 * MIB as u64, "holds {}", tier.used());
    let kept: Vec<u8> = (0..4u8)
        .filter(|i| tier.get(&format!("s3://b/k{i}"), "e").is_some())
        .collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    for i in kept {
        let o = tier.get(&format!("s3://b/k{i}"), "e").unwrap();
        assert_eq!(o.read(0, MIB as u64).unwrap().unwrap(), data(MIB, i));
    }
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(
        files,
        2 + 2 * 2,
        "FORMAT, LOCK and two objects' files remain"
    );
}

#[test]
fn the_cache_version_held_for_a_uri_follows_creation_rekey_remount_and_removal() {
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    for i in 0..50 {
        tier.get_or_create(&format!("s3://b/other-{i}"), "e", 10)
            .unwrap();
    }
    assert_eq!(tier.cache_version_of("s3://b/ckpt"), None);
    let body = data(1000, 9);
    let o = tier.get_or_create("s3://b/ckpt", "lc-1", 1000).unwrap();
    o.fill(0, &body).unwrap();
    drop(o);
    assert_eq!(
        tier.cache_version_of("s3://b/ckpt").as_deref(),
        Some("lc-1")
    );
    // S3 named it: the bytes stay, under the ETag, and no cache version
    // is left for the URI.
    assert!(tier.rekey("s3://b/ckpt", "lc-1", "etag-7").unwrap());
    assert_eq!(tier.cache_version_of("s3://b/ckpt"), None);
    assert!(tier.get("s3://b/ckpt", "etag-7").is_some());
    // A remount finds it again; a dropped one is gone from the index.
    let o = tier.get_or_create("s3://b/ckpt2", "lc-2", 10).unwrap();
    o.fill(0, &body[..10]).unwrap();
    drop((o, tier));
    let tier = LocalTier::open(dir.path(), 64 << 20).unwrap();
    assert_eq!(
        tier.cache_version_of("s3://b/ckpt2").as_deref(),
        Some("lc-2")
    );
    tier.forget_version("s3://b/ckpt2", "lc-2");
    assert_eq!(tier.cache_version_of("s3://b/ckpt2"), None);
}

/// A reader that wants the object whole outruns the fill thread many
/// times over: its fills wait for room instead of being dropped, so the
/// object is whole once they are written. The same flood without
/// `keep_fills` may drop (not asserted: it depends on the disk's speed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_fills_wait_for_the_filler_and_are_never_dropped() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let tier = LocalTier::open(dir.path(), 1 << 30).unwrap();
    // Over three times the lane's bytes, in read-ahead-sized pieces.
    let body = Bytes::from(data(200 * MIB + 123, 5));
    let o = tier
        .get_or_create("s3://b/big", "e1", body.len() as u64)
        .unwrap();
    o.keep_fills();
    let budget = crate::memory::MemoryBudget::new(96 << 20);
    let fills = (0..body.len()).step_by(4 * MIB).map(|start| {
        let (o, budget) = (o.clone(), budget.clone());
        let piece = body.slice(start..(start + 4 * MIB).min(body.len()));
        async move { o.fill_soon(start as u64, piece, &budget).await }
    });
    futures::future::join_all(fills).await;
    assert!(tier.drain_fills(std::time::Duration::from_secs(60)));
    let stats = tier.fill_stats();
    assert_eq!(stats.dropped_bytes.load(Ordering::Relaxed), 0);
    assert!(
        stats.kept_waited_bytes.load(Ordering::Relaxed) > 0,
        "50 fills of 4 MiB at once do not fit the lane: some waited"
    );
    assert!(o.is_complete(), "every kept fill was written");
    assert!(o.verify().unwrap());
    assert_eq!(budget.available(), 96 << 20, "the fills' memory came back");
}
