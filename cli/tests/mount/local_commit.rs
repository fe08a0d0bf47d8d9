//! The co-located write path through the kernel: a write-back mount
//! beside the worker that owns a file has the kernel write the file into
//! a staged file (FUSE passthrough) and the worker commit it from there
//! through its local socket. The bytes arrive whole in S3; `stat` shows
//! the size while the file is written; a file changed after an fsync is
//! committed again; a file patched at its start after the worker took it
//! is committed whole; a stopped local worker does not hold the commit up;
//! a file opens for reading the moment it is closed; the worker writes
//! its spare page files as soon as the mount says it writes back.

use super::*;

const PROGRESS: &str = "2s";

fn metric(port: u16, name: &str) -> f64 {
    let text = reqwest_like_get(port, "/metrics");
    common::metric(&text, name, &[]).unwrap_or_else(|e| panic!("mount: {e}"))
}

/// Mounts in write-back with worker 0's local socket and a metrics
/// listener; returns the metrics port.
fn mount_beside_worker_0(env: &mut Env) -> u16 {
    let socket = env.dir.path().join("cache-0").join("local.sock");
    assert!(
        socket.exists(),
        "no socket at {}\n{}",
        socket.display(),
        env.worker_logs()
    );
    let socket = socket.to_str().unwrap().to_string();
    env.mount_with(&[
        "--write-mode",
        "back",
        "--write-progress-timeout",
        PROGRESS,
        "--metrics-listen",
        "127.0.0.1:0",
        "--local-worker-socket",
        &socket,
    ]);
    env.mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30))
}

/// A key under `prefix` whose first segment worker `index` owns.
fn key_owned_by(env: &Env, prefix: &str, index: usize) -> String {
    (0..1000)
        .map(|i| format!("{prefix}/ckpt-{i}.bin"))
        .find(|k| env.owner_index(k, 0) == index)
        .expect("some key lands on the worker")
}

#[test]
fn a_write_back_beside_its_worker_is_committed_from_a_staged_file() {
    let mut env = Env::start(1);
    let port = mount_beside_worker_0(&mut env);
    // The mount told its worker it writes back: the worker's spare page
    // files (up to --write-spare, in whole pages) are written before
    // anything is, for the first burst to be written over.
    let worker_port = env.workers[0].0;
    let spare = || {
        let text = reqwest_like_get(worker_port, "/metrics");
        common::metric(&text, "lakecache_writeback_spare_bytes", &[])
            .unwrap_or_else(|e| panic!("worker: {e}"))
    };
    common::wait_until(
        "the worker's spares, before any write",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || (48 << 20) as f64 <= spare(),
    );
    assert!(
        spare() <= (64 << 20) as f64,
        "more spares than --write-spare"
    );
    let path = env.mountpoint().join("staged/model.bin");
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let first = pattern((24 << 20) + 4321, 61);
    let more = pattern((3 << 20) + 17, 62);

    let mut f = File::create(&path).unwrap();
    f.write_all(&first).unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        first.len() as u64,
        "stat shows the bytes written so far"
    );
    f.sync_all().unwrap();
    assert_eq!(
        metric(port, "lakecache_fuse_local_commits_total"),
        1.0,
        "{}",
        env.log()
    );
    assert_eq!(
        metric(port, "lakecache_fuse_followed_commits_total"),
        1.0,
        "the worker took the file as it was written\n{}",
        env.log()
    );
    // Written after the fsync, on the same descriptor: committed again
    // at close, not lost.
    f.write_all(&more).unwrap();
    drop(f);
    assert_eq!(
        metric(port, "lakecache_fuse_local_commits_total"),
        2.0,
        "{}",
        env.log()
    );
    assert_eq!(metric(port, "lakecache_fuse_write_resends_total"), 0.0);

    let mut want = first.clone();
    want.extend_from_slice(&more);
    assert!(
        fs::read(&path).unwrap() == want,
        "the mount reads back other bytes"
    );
    env.sync_bucket(120);
    assert!(
        env.s3_get("staged/model.bin").as_deref() == Some(&want[..]),
        "S3 holds other bytes\n{}",
        env.worker_logs()
    );

    // Shrunk on the open file, then closed: the shorter file is stored.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.write_all(&first).unwrap();
    f.set_len(1000).unwrap();
    drop(f);
    assert!(
        fs::read(&path).unwrap() == first[..1000],
        "the truncated file reads back other bytes"
    );
    env.sync_bucket(120);
    assert!(env.s3_get("staged/model.bin").as_deref() == Some(&first[..1000]));

    // A header patched at the start once the rest is written (as some
    // checkpoint formats do), possibly after the worker took that page:
    // the stored file holds the patch.
    let patched = env.mountpoint().join("staged/patched.bin");
    let mut want = pattern(20 << 20, 63);
    let mut f = File::create(&patched).unwrap();
    f.write_all(&want).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"PATCHED HEADER", 0).unwrap();
    drop(f);
    want[..14].copy_from_slice(b"PATCHED HEADER");
    assert!(
        fs::read(&patched).unwrap() == want,
        "the patched file reads back other bytes"
    );
    env.sync_bucket(120);
    assert!(
        env.s3_get("staged/patched.bin").as_deref() == Some(&want[..]),
        "S3 holds the file without its patch\n{}",
        env.log()
    );

    // Closed, then at once renamed into place or unlinked (the kernel
    // releases the file just after close returns): the rename moves the
    // stored file, the unlink deletes it.
    let tmp = env.mountpoint().join("staged/manifest.json.tmp");
    fs::write(&tmp, &more).unwrap();
    fs::rename(&tmp, env.mountpoint().join("staged/manifest.json"))
        .unwrap_or_else(|e| panic!("rename right after close: {e}\n{}", env.log()));
    let gone = env.mountpoint().join("staged/scratch.bin");
    fs::write(&gone, &more).unwrap();
    fs::remove_file(&gone)
        .unwrap_or_else(|e| panic!("unlink right after close: {e}\n{}", env.log()));
    env.sync_bucket(120);
    assert!(env.s3_get("staged/manifest.json").as_deref() == Some(&more[..]));
    assert!(env.s3_get("staged/manifest.json.tmp").is_none());
    assert!(
        env.s3_get("staged/scratch.bin").is_none(),
        "an unlinked file stayed in S3"
    );
}

// Three workers: with the owner gone, the next one takes the commit and
// still finds a live worker for the second write-back copy (two workers
// and one down fail the write by design: too few copies).
#[test]
fn a_stopped_local_worker_does_not_hold_up_a_staged_commit() {
    let mut env = Env::start(3);
    let port = mount_beside_worker_0(&mut env);
    let key = key_owned_by(&env, "hung", 0);
    let path = env.mountpoint().join(&key);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let data = pattern((16 << 20) + 99, 63);
    let mut f = File::create(&path).unwrap();
    f.write_all(&data).unwrap();

    let pid = env.workers[0].1.id().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let started = Instant::now();
    let synced = f.sync_all();
    let took = started.elapsed();
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    synced.unwrap_or_else(|e| {
        panic!(
            "fsync failed with the local worker stopped: {e}\n{}",
            env.log()
        )
    });
    drop(f);
    assert!(
        took < common::scaled(Duration::from_secs(30)),
        "the commit waited {took:?} on a stopped worker"
    );
    assert_eq!(metric(port, "lakecache_fuse_local_commits_total"), 0.0);
    assert!(
        metric(port, "lakecache_fuse_write_resends_total") >= 1.0,
        "{}",
        env.log()
    );
    assert!(
        fs::read(&path).unwrap() == data,
        "the file reads back other bytes"
    );
    env.sync_bucket(120);
    assert!(
        env.s3_get(&key).as_deref() == Some(&data[..]),
        "S3 holds other bytes\n{}",
        env.worker_logs()
    );
}

#[test]
fn a_killed_local_worker_does_not_lose_a_staged_commit() {
    let mut env = Env::start(3);
    let port = mount_beside_worker_0(&mut env);
    let key = key_owned_by(&env, "killed", 0);
    let path = env.mountpoint().join(&key);
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let data = pattern((16 << 20) + 77, 64);
    let mut f = File::create(&path).unwrap();
    f.write_all(&data).unwrap();

    // kill -9 of the owner while the file is written (followed): the
    // commit goes to the next worker, and the fsync succeeds.
    let worker_port = env.workers[0].0;
    env.workers[0].1.kill9();
    f.sync_all().unwrap_or_else(|e| {
        panic!(
            "fsync failed with the local worker killed: {e}\n{}",
            env.log()
        )
    });
    drop(f);
    assert!(
        metric(port, "lakecache_fuse_write_resends_total") >= 1.0,
        "{}",
        env.log()
    );
    // The owner back (same port, same cache): the write, taken by the
    // other worker, reads back and reaches S3.
    let restarted = env.spawn_worker(0, worker_port, &[]);
    env.workers[0].1 = restarted;
    assert!(
        fs::read(&path).unwrap() == data,
        "the file reads back other bytes\n{}",
        env.log()
    );
    env.sync_bucket(120);
    assert!(
        env.s3_get(&key).as_deref() == Some(&data[..]),
        "S3 holds other bytes\n{}",
        env.worker_logs()
    );
}

/// `cp` then `cat`: each file written into a staged file is read back
/// the moment it is closed. The kernel sends the release after close
/// returns, so the open races it; it must wait for it, never answer
/// EBUSY (the CI run of 8cfafcc saw one).
#[test]
fn a_staged_file_opens_for_reading_the_moment_it_is_closed() {
    let mut env = Env::start(1);
    let port = mount_beside_worker_0(&mut env);
    let dir = env.mountpoint().join("copied");
    fs::create_dir_all(&dir).unwrap();
    let files = 24;
    for i in 0..files {
        let path = dir.join(format!("part-{i}.bin"));
        let data = pattern((1 << 20) + i * 37, 80 + i as u64);
        let mut f = File::create(&path).unwrap();
        f.write_all(&data).unwrap();
        drop(f);
        let back = fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "reading {} right after its close: {e}\n{}",
                path.display(),
                env.log()
            )
        });
        assert!(back == data, "{} reads back other bytes", path.display());
    }
    assert_eq!(
        metric(port, "lakecache_fuse_local_commits_total"),
        files as f64,
        "not every file went through a staged file, so this test shows less\n{}",
        env.log()
    );
}

/// A writer that patches the start of its file after writing the rest
/// (zip as `np.savez` writes it, HDF5's superblock): the pages the worker
/// took early no longer match at the seal, the followed commit is refused,
/// and the mount commits the file whole. S3 holds the patched bytes, and
/// the worker logs the refusal as the expected event it is, not a warning.
#[test]
fn a_file_patched_at_its_start_after_it_was_taken_lands_whole() {
    let mut env = Env::start(1);
    let port = mount_beside_worker_0(&mut env);
    let worker = env.workers[0].0;
    let path = env.mountpoint().join("staged/archive.npz");
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut want = pattern((24 << 20) + 99, 71);
    let f = File::create(&path).unwrap();
    f.write_all_at(&want, 0).unwrap();
    common::wait_until(
        "the worker took the file's first pages",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || {
            let scrape = reqwest_like_get(worker, "/metrics");
            common::metric(&scrape, "lakecache_writeback_staging_used_bytes", &[])
                .is_ok_and(|used| used >= (8 << 20) as f64)
        },
    );
    let header = b"PK\x03\x04 the local header, with sizes and CRC";
    f.write_all_at(header, 0).unwrap();
    want[..header.len()].copy_from_slice(header);
    drop(f);

    assert!(
        fs::read(&path).unwrap() == want,
        "the mount reads back other bytes"
    );
    env.sync_bucket(120);
    assert!(
        env.s3_get("staged/archive.npz").as_deref() == Some(&want[..]),
        "S3 holds other bytes\n{}",
        env.worker_logs()
    );
    assert_eq!(
        metric(port, "lakecache_fuse_followed_commits_total"),
        0.0,
        "the patched file counted as a followed commit\n{}",
        env.log()
    );
    let logs = env.worker_logs();
    assert!(
        logs.contains("local commit of a followed file refused"),
        "the follow was never refused, so this test shows nothing\n{logs}"
    );
    assert!(
        !logs
            .lines()
            .any(|l| l.contains("WARN") && l.contains("archive.npz")),
        "the expected refusal was logged as a warning\n{logs}"
    );
}
