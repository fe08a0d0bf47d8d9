//! The node-local tier (L1) and the random-read path, through the kernel:
//! fills, passthrough, new versions, damage, eviction, a deleted tier
//! directory, and what a cold random read costs the worker and S3.

use super::*;

/// Mounts with a node-local tier in the test's directory; returns it.
pub(super) fn mount_with_tier(env: &mut Env, extra: &[&str]) -> PathBuf {
    let tier = env.dir.path().join("local-tier");
    let mut flags = vec![
        std::ffi::OsString::from("--local-cache"),
        tier.clone().into(),
    ];
    flags.extend(extra.iter().map(std::ffi::OsString::from));
    env.mount_with(&flags);
    tier
}

/// Waits until the tier records a whole object (fills run off the read
/// path).
fn wait_for_tier(tier: &Path) {
    wait_until("the tier holding a whole file", || {
        tier_objects(tier).iter().any(|o| o.whole)
    });
}

/// An object as the tier's metadata file records it.
#[derive(Debug)]
pub(super) struct RecordedObject {
    pub uri: String,
    pub whole: bool,
    pub wanted_whole: bool,
}

/// Every object whose metadata the tier has written (metadata files are
/// replaced by rename, so each read sees a whole one).
pub(super) fn tier_objects(tier: &Path) -> Vec<RecordedObject> {
    tier_files(tier, "meta")
        .iter()
        .filter_map(|p| fs::read(p).ok())
        .map(|b| {
            let v: serde_json::Value = serde_json::from_slice(&b).expect("tier metadata is JSON");
            let meta = &v["meta"];
            let crcs = meta["crcs"].as_array().expect("tier metadata lists CRCs");
            RecordedObject {
                uri: meta["uri"].as_str().unwrap_or_default().to_string(),
                whole: crcs.iter().all(|c| !c.is_null()),
                wanted_whole: meta["wanted_whole"].as_bool().unwrap_or(false),
            }
        })
        .collect()
}

/// Puts `len` pattern bytes at `key`, mounts with a tier (and `extra`
/// flags); returns the tier, the file's path, its bytes and their sha256.
fn put_and_mount_with_tier(
    env: &mut Env,
    key: &str,
    len: usize,
    seed: u64,
    extra: &[&str],
) -> (PathBuf, PathBuf, Vec<u8>, Vec<u8>) {
    let data = pattern(len, seed);
    let want = Sha256::digest(&data).to_vec();
    env.put(key, Bytes::from(data.clone()));
    let tier = mount_with_tier(env, extra);
    (tier, env.mountpoint().join(key), data, want)
}

#[test]
fn a_second_read_comes_from_the_node_local_tier_with_the_workers_gone() {
    let mut env = Env::start(1);
    let flags = ["--local-cache-size", "1GiB", "--no-s3-fallback"];
    let (tier, file, _, want) =
        put_and_mount_with_tier(&mut env, "shard.bin", (20 << 20) + 4321, 7, &flags);
    assert_eq!(
        sha_file(&file).unwrap().1,
        want,
        "first read, through the worker"
    );
    wait_for_tier(&tier);
    // No worker, no S3 fallback, no page cache: only the node's disk can
    // serve the bytes. (A lookup after the entry TTL, which a loaded
    // machine reaches, asks the dead worker and keeps the known name.)
    env.workers[0].1.kill9();
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    let second = sha_file(&file);
    assert!(
        second.as_ref().is_ok_and(|(_, sha)| *sha == want),
        "second read without workers: {second:?}; mount log:\n{}",
        env.log()
    );
}

#[test]
fn a_file_whole_in_the_local_tier_is_read_by_the_kernel_through_passthrough() {
    let mut env = Env::start(1);
    let flags = ["--log", "lakecache_fuse=trace,info"];
    let (tier, file, _, want) =
        put_and_mount_with_tier(&mut env, "pass.bin", (12 << 20) + 77, 8, &flags);
    assert_eq!(sha_file(&file).unwrap().1, want, "first read, by the mount");
    wait_for_tier(&tier);
    let before = read_by_passthrough(&env, &file, &want, "second read");
    assert!(before > 0, "the first read went through the mount");
}

#[test]
fn closing_a_read_handle_waits_on_no_flush_and_closing_a_written_file_commits_it() {
    let mut env = Env::start(1);
    let data = pattern((6 << 20) + 99, 41);
    let want = Sha256::digest(&data).to_vec();
    env.put("read-only.bin", Bytes::from(data));
    let (tier, port) = super::tier_completion::mount_with_tier_and_metrics(
        &mut env,
        &[("LAKECACHE_LOG", "lakecache_fuse=trace,info")],
    );
    let file = env.mountpoint().join("read-only.bin");
    // Closed after a read the mount served, then after one by passthrough.
    assert_eq!(sha_file(&file).unwrap().1, want, "read by the mount");
    wait_for_tier(&tier);
    read_by_passthrough(&env, &file, &want, "read by passthrough");
    // A written file's close is where it is committed: its FLUSH still
    // comes, and is the only one the mount has seen.
    let body = pattern(300_000, 42);
    fs::write(env.mountpoint().join("written.bin"), &body).unwrap();
    assert_eq!(
        env.s3_get("written.bin").as_deref(),
        Some(&body[..]),
        "the written file reached S3 when it was closed; mount log:\n{}",
        env.log()
    );
    assert_eq!(
        super::tier_completion::mount_ops(port, "flush"),
        1.0,
        "read-only closes sent FLUSH; mount log:\n{}",
        env.log()
    );
}

/// Once the first handle's RELEASE arrived (an inode the mount still
/// serves gets no passthrough handle beside it), reads `file` with the
/// page cache dropped: right bytes, a passthrough open, and no READ
/// reaching the mount. Returns the READs the mount had served before.
pub(super) fn read_by_passthrough(env: &Env, file: &Path, want: &[u8], what: &str) -> usize {
    wait_until("the first handle's RELEASE", || {
        env.log().contains("fuse release")
    });
    let reads = |log: &str| log.matches("fuse read").count();
    let before = reads(&env.log());
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert_eq!(sha_file(file).unwrap().1, want, "{what}");
    let log = env.log();
    assert!(log.contains("opened with passthrough"), "{log}");
    assert_eq!(
        reads(&log),
        before,
        "READs reached the mount on a passthrough handle"
    );
    before
}

/// The tier's files with this extension.
pub(super) fn tier_files(tier: &Path, ext: &str) -> Vec<PathBuf> {
    fs::read_dir(tier)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == ext))
                .collect()
        })
        .unwrap_or_default()
}

fn wait_until(what: &str, done: impl FnMut() -> bool) {
    common::wait_until(
        what,
        Duration::from_secs(20),
        Duration::from_millis(50),
        done,
    );
}

#[test]
fn a_replaced_object_is_read_anew_and_its_old_local_copy_dropped() {
    let mut env = Env::start_full(1, &[], &["--metadata-ttl", "1"]);
    let old = pattern((3 << 20) + 11, 21);
    env.put("model.bin", Bytes::from(old.clone()));
    let tier = mount_with_tier(
        &mut env,
        &[
            "--attr-ttl",
            "1",
            "--entry-ttl",
            "1",
            "--log",
            "lakecache_fuse=trace,info",
        ],
    );
    let file = env.mountpoint().join("model.bin");
    assert_eq!(sha_file(&file).unwrap().1, Sha256::digest(&old).to_vec());
    wait_for_tier(&tier);
    let old_copy = tier_files(&tier, "data");
    assert_eq!(old_copy.len(), 1, "{old_copy:?}");
    wait_until("the first handle's RELEASE", || {
        env.log().contains("fuse release")
    });
    // A passthrough open of the old version, then S3 gets a new one. A
    // handle opened before the change stays open throughout.
    assert_eq!(sha_file(&file).unwrap().1, Sha256::digest(&old).to_vec());
    let mut held = File::open(&file).unwrap();
    let new = pattern((3 << 20) + 5000, 22);
    env.put("model.bin", Bytes::from(new.clone()));
    // Opens after the 1 s TTLs (worker metadata, mount attributes) read the
    // new version; polled rather than slept, so a slow machine only waits.
    wait_until("an open after the TTL reading the new version", || {
        fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
        sha_file(&file).unwrap().1 == Sha256::digest(&new).to_vec()
    });
    wait_until("the old version's local copy is dropped", || {
        !old_copy[0].exists()
    });
    // The early handle reads its own version whole, or ESTALE: never a
    // mix of the two.
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    let mut got = Vec::new();
    match held.read_to_end(&mut got) {
        Ok(_) => assert!(
            got == old,
            "the early handle read {} bytes of neither version whole",
            got.len()
        ),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}"),
    }
    drop(held);
    wait_for_tier(&tier);
    assert_eq!(
        sha_file(&file).unwrap().1,
        Sha256::digest(&new).to_vec(),
        "a later open, from the tier"
    );
}

#[test]
fn a_damaged_local_copy_is_caught_at_open_and_fetched_again() {
    let mut env = Env::start(1);
    let (tier, file, data, want) =
        put_and_mount_with_tier(&mut env, "damaged.bin", (6 << 20) + 99, 31, &[]);
    assert_eq!(sha_file(&file).unwrap().1, want);
    wait_for_tier(&tier);
    env.mount.take().unwrap().term();
    wait_mounted(&env.mountpoint(), false);
    // One flipped byte in the middle of the local copy.
    let copy = tier_files(&tier, "data").remove(0);
    let f = OpenOptions::new().write(true).open(&copy).unwrap();
    let at = (4 << 20) + 12345;
    f.write_all_at(&[data[at] ^ 0x5a], at as u64).unwrap();
    drop(f);
    mount_with_tier(&mut env, &[]);
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert_eq!(sha_file(&file).unwrap().1, want, "read after the damage");
    let log = env.log();
    assert!(
        log.contains("failed its CRC"),
        "damage went unnoticed:\n{log}"
    );
    // The block was fetched again and the copy mended.
    wait_until("the damaged block is filled again", || {
        fs::read(&copy).is_ok_and(|b| b == data)
    });
}

#[test]
fn a_full_local_tier_evicts_and_every_read_stays_right() {
    let mut env = Env::start(1);
    let files: Vec<Vec<u8>> = (0..5).map(|i| pattern(6 << 20, 40 + i)).collect();
    for (i, body) in files.iter().enumerate() {
        env.put(&format!("f{i}"), Bytes::from(body.clone()));
    }
    let tier = mount_with_tier(&mut env, &["--local-cache-size", "16MiB"]);
    for round in 0..3 {
        for (i, body) in files.iter().enumerate() {
            fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
            let got = sha_file(&env.mountpoint().join(format!("f{i}"))).unwrap();
            assert_eq!(got.1, Sha256::digest(body).to_vec(), "round {round}, f{i}");
            let held: u64 = tier_files(&tier, "data")
                .iter()
                .filter_map(|p| p.metadata().ok())
                .map(|m| m.len())
                .sum();
            assert!(held <= 16 << 20, "the tier holds {held} bytes");
        }
    }
}

#[test]
fn reads_go_to_the_workers_when_the_local_tier_directory_is_deleted() {
    let mut env = Env::start(1);
    let a = pattern((2 << 20) + 1, 51);
    let b = pattern((2 << 20) + 2, 52);
    env.put("a.bin", Bytes::from(a.clone()));
    env.put("b.bin", Bytes::from(b.clone()));
    let tier = mount_with_tier(&mut env, &[]);
    let mnt = env.mountpoint();
    assert_eq!(
        sha_file(&mnt.join("a.bin")).unwrap().1,
        Sha256::digest(&a).to_vec()
    );
    wait_for_tier(&tier);
    fs::remove_dir_all(&tier).unwrap();
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    for (name, body) in [("a.bin", &a), ("b.bin", &b), ("a.bin", &a)] {
        let got = sha_file(&mnt.join(name));
        assert!(
            got.as_ref()
                .is_ok_and(|(_, sha)| *sha == Sha256::digest(body).to_vec()),
            "{name} with the tier gone: {got:?}; mount log:\n{}",
            env.log()
        );
    }
}

/// Sums every sample of a Prometheus metric whose line starts with `name`
/// and contains `label`.
/// Sum of the worker's metric lines starting with `name` and containing
/// `label`; fails when there is none, so a renamed metric never reads as 0.
pub(super) fn worker_metric(port: u16, name: &str, label: &str) -> f64 {
    worker_metric_opt(port, name, label)
        .unwrap_or_else(|| panic!("the worker on port {port} exports no {name} with {label:?}"))
}

/// [`worker_metric`] as a baseline before anything could record it: 0
/// when absent. Only for a value a later [`worker_metric`] is compared with.
pub(super) fn worker_metric_baseline(port: u16, name: &str, label: &str) -> f64 {
    worker_metric_opt(port, name, label).unwrap_or(0.0)
}

fn worker_metric_opt(port: u16, name: &str, label: &str) -> Option<f64> {
    let mut sum = None;
    for l in reqwest_like_get(port, "/metrics")
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
    {
        let v = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        *sum.get_or_insert(0.0) += v.unwrap_or_else(|| panic!("unreadable metric line {l:?}"));
    }
    sum
}

/// (body bytes sent, GET requests) as the S3 endpoint counted them. The
/// GET count is absent until the first GET, so it is a baseline-style
/// read (0 when absent); the byte count is always exported.
fn endpoint_stats(s3_port: u16) -> (f64, f64) {
    let text = reqwest_like_get(s3_port, "/_lakecache/stats");
    let sent = common::metric(&text, "lakecache_s3_endpoint_sent_bytes_total", &[])
        .unwrap_or_else(|e| panic!("S3 endpoint stats: {e}"));
    let gets = common::metric(
        &text,
        "lakecache_s3_endpoint_requests_total",
        &[("op", "GetObject")],
    )
    .unwrap_or(0.0);
    (sent, gets)
}

#[test]
fn a_cold_random_read_costs_one_worker_request_and_about_its_own_bytes_from_s3() {
    // Where the whole-object fetch does not apply, a random read costs
    // S3 about its own bytes: the policy off, or the object over it.
    for (flag, key) in [("0", "off.bin"), ("128MiB", "over.bin")] {
        let mut env = Env::start(1);
        let len: u64 = 160 << 20;
        env.put(key, Bytes::from(pattern(len as usize, 61)));
        env.mount_with(&["--random-whole-max", flag]);
        cold_random_reads_cost_their_own_bytes(&env, key, len, flag);
    }
}

fn cold_random_reads_cost_their_own_bytes(env: &Env, key: &str, len: u64, flag: &str) {
    let port = env.workers[0].0;
    let file = File::open(env.mountpoint().join(key)).unwrap();
    let s3_before = worker_metric_baseline(port, "lakecache_s3_transferred", "");
    let endpoint_before = endpoint_stats(env.s3_port);
    let reads_before = worker_metric_baseline(
        port,
        "lakecache_request_duration_seconds_count",
        "op=\"read\"",
    );
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let n = 400;
    let mut buf = vec![0u8; 4096];
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % (len / 4096)) * 4096;
        file.read_exact_at(&mut buf, at).unwrap();
    }
    let asked = (n * 4096) as f64;
    let s3 = worker_metric(port, "lakecache_s3_transferred", "") - s3_before;
    let reads = worker_metric(
        port,
        "lakecache_request_duration_seconds_count",
        "op=\"read\"",
    ) - reads_before;
    let endpoint = endpoint_stats(env.s3_port);
    let (sent, gets) = (
        endpoint.0 - endpoint_before.0,
        endpoint.1 - endpoint_before.1,
    );
    println!(
        "--random-whole-max {flag}: {n} random 4 KiB reads: {reads} worker reads, {s3} S3 bytes ({:.2} x); \
         the endpoint sent {sent} bytes in {gets} GETs",
        s3 / asked
    );
    // The store's own count, not only the worker's: nothing else fetched
    // (measured: 398 GETs and 0.99x the bytes asked for 400 reads). On a
    // loaded machine a stalled GET is resumed by the worker, so a few
    // more GETs than reads may show (seen: 401, with 1.0025x the bytes).
    assert!(
        sent <= 2.0 * asked && gets <= n as f64 + 4.0,
        "the S3 endpoint sent {sent} bytes in {gets} GETs for {asked} bytes read"
    );
    // Alone, 397: three offsets repeat and the kernel's page cache has
    // them. Beside the rest of the suite (tests that drop the page
    // cache, a GET resumed), up to 401 were seen; the same few of slack
    // as for the GETs above.
    assert!(
        reads <= n as f64 + 4.0,
        "{reads} worker reads for {n} random reads"
    );
    assert!(
        s3 <= 2.0 * asked,
        "{s3} S3 bytes for {asked} read ({:.1} x)",
        s3 / asked
    );
}

#[test]
fn small_files_read_once_cost_one_worker_request_each_after_the_listing() {
    let mut env = Env::start(1);
    let n = 300;
    for i in 0..n {
        for dir in ["small", "named"] {
            env.put(
                &format!("{dir}/f{i:04}"),
                Bytes::from(pattern(100 << 10, i)),
            );
        }
    }
    // Names and attributes are trusted for an hour: what is counted is
    // requests after a listing within its TTL, and reading 300 files on a
    // loaded machine took longer than the default 60 s.
    env.mount_with(&["--entry-ttl", "3600", "--attr-ttl", "3600"]);
    let port = env.workers[0].0;
    let dir = env.mountpoint().join("small");
    // `ls -l`: the listing, with attributes (readdirplus).
    let names: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            assert_eq!(e.metadata().unwrap().len(), 100 << 10);
            e.path()
        })
        .collect();
    assert_eq!(names.len(), n as usize);
    // Counts that should stay 0 may be absent, so these read 0 for a
    // missing series; the families themselves are checked to exist below
    // (a read and a GET are counted), so a renamed metric still fails.
    let count = |op: &str| {
        worker_metric_baseline(
            port,
            "lakecache_request_duration_seconds_count",
            &format!("op=\"{op}\""),
        )
    };
    let s3 = |op: &str| {
        worker_metric_baseline(
            port,
            "lakecache_s3_requests",
            &format!("op=\"{op}_object\""),
        )
    };
    let ops = ["read", "head", "stat", "list"];
    let before: Vec<f64> = ops.iter().map(|op| count(op)).collect();
    let s3_heads = s3("head");
    for (i, path) in names.iter().enumerate() {
        let got = fs::read(path).unwrap();
        assert_eq!(got.len(), 100 << 10, "{i}");
    }
    worker_metric(
        port,
        "lakecache_request_duration_seconds_count",
        "op=\"read\"",
    );
    worker_metric(port, "lakecache_s3_requests", "op=\"get_object\"");
    let after: Vec<f64> = ops.iter().map(|op| count(op)).collect();
    let delta: Vec<f64> = before.iter().zip(&after).map(|(b, a)| a - b).collect();
    println!(
        "{n} small files after ls -l: worker requests {ops:?} = {delta:?}, S3 HEADs {}",
        s3("head") - s3_heads
    );
    assert!(
        delta[0] <= n as f64,
        "{} worker reads for {n} files",
        delta[0]
    );
    assert_eq!(
        delta[1] + delta[2],
        0.0,
        "a stat per file after the listing"
    );
    assert_eq!(
        s3("head") - s3_heads,
        0.0,
        "S3 HEADs per file after the listing"
    );
    // isatty() on an opened file (fio, Python and others ask): ENOTTY,
    // and no warning per file in the mount's log.
    let f = File::open(&names[0]).unwrap();
    let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
    // SAFETY: TCGETS writes at most one termios into the buffer given.
    let rc = unsafe {
        use std::os::fd::AsRawFd;
        libc::ioctl(f.as_raw_fd(), libc::TCGETS, termios.as_mut_ptr())
    };
    assert_eq!(rc, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY)
    );
    assert!(!env.log().contains("Not Implemented"), "{}", env.log());

    // Without `ls`: every file looked up by name (as fio and data loaders
    // do) then read. The lookups list the directory once instead of a
    // stat per name.
    let before: Vec<f64> = ops.iter().map(|op| count(op)).collect();
    for i in 0..n {
        let path = env.mountpoint().join(format!("named/f{i:04}"));
        assert_eq!(fs::metadata(&path).unwrap().len(), 100 << 10);
        assert_eq!(fs::read(&path).unwrap(), pattern(100 << 10, i));
    }
    let after: Vec<f64> = ops.iter().map(|op| count(op)).collect();
    let delta: Vec<f64> = before.iter().zip(&after).map(|(b, a)| a - b).collect();
    println!("{n} files looked up by name: worker requests {ops:?} = {delta:?}");
    // Lookups that arrive while the background listing runs still stat
    // one by one, so the count grows with load: measured 17 idle and 23
    // with another test run beside it (a bound of 20 failed then). The
    // point is far below one per name.
    assert!(
        delta[1] + delta[2] <= (n / 5) as f64,
        "{} stats for {n} names looked up",
        delta[1] + delta[2]
    );
}

#[test]
fn a_mount_killed_while_filling_its_tier_reads_right_after_a_remount() {
    let mut env = Env::start(1);
    let (tier, file, _, want) =
        put_and_mount_with_tier(&mut env, "big.bin", (48 << 20) + 333, 71, &[]);
    // Read part of the file, so the tier holds some blocks, then kill -9
    // the mount while fills may still be queued or half written.
    {
        let mut f = File::open(&file).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..20 {
            f.read_exact(&mut buf).unwrap();
        }
    }
    env.mount.take().unwrap().kill9();
    let _ = lakecache_fuse::mount::force_unmount(&env.mountpoint());
    wait_mounted(&env.mountpoint(), false);
    // The remount adopts what checks out and fetches the rest.
    mount_with_tier(&mut env, &[]);
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert_eq!(sha_file(&file).unwrap().1, want, "read after kill -9");
    wait_for_tier(&tier);
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    assert_eq!(sha_file(&file).unwrap().1, want, "read from the whole tier");
}

/// A file written back and read while pending sits in the tier under its
/// cache version; once S3 has it (a new ETag), a new mount keeps the
/// tier's copy under that ETag instead of reading it again.
#[test]
fn a_written_back_file_read_while_pending_stays_in_the_tier_after_its_upload() {
    let mut env = Env::start(1);
    let flags = ["--local-cache-size", "1GiB", "--write-mode", "back"];
    let tier = mount_with_tier(&mut env, &flags);
    let file = env.mountpoint().join("ckpt.bin");
    let data = pattern((6 << 20) + 11, 5);
    let want = Sha256::digest(&data).to_vec();
    fs::write(&file, &data).unwrap();
    assert_eq!(sha_file(&file).unwrap().1, want, "read while pending");
    wait_for_tier(&tier);
    env.sync_bucket(60);
    assert_eq!(env.s3_get("ckpt.bin").as_deref(), Some(&data[..]));

    env.mount.take().unwrap().term();
    wait_mounted(&env.mountpoint(), false);
    mount_with_tier(&mut env, &flags);
    fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    let port = env.workers[0].0;
    let reads = worker_requests(port, "read");
    assert_eq!(sha_file(&file).unwrap().1, want, "read after the upload");
    assert_eq!(
        worker_requests(port, "read"),
        reads,
        "the uploaded file was read from the worker again"
    );
    assert_eq!(tier_files(&tier, "meta").len(), 1);
}
