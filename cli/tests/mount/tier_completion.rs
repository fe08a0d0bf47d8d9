//! Completion of objects in the node-local tier, through the kernel: a
//! reader that shows it wants a whole object gets the rest fetched in the
//! background (then served by passthrough), even when fills were dropped
//! or the mount was killed; header and footer readers fetch no more than
//! they read.

use super::local_tier::{
    mount_with_tier, read_by_passthrough, tier_files, tier_objects, worker_metric,
    worker_metric_baseline,
};
use super::*;

pub(super) fn wait_until(what: &str, secs: u64, done: impl FnMut() -> bool) {
    common::wait_until(
        what,
        Duration::from_secs(secs),
        Duration::from_millis(100),
        done,
    );
}

fn tier_has_whole_object(tier: &Path) -> bool {
    tier_objects(tier).iter().any(|o| o.whole)
}

/// Reads the first `len` bytes of `file` and closes it.
fn read_prefix(file: &Path, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    File::open(file).unwrap().read_exact(&mut buf).unwrap();
    buf
}

/// A metric the mount exports, summed over the samples with `labels`;
/// fails when absent (a renamed metric never reads as 0).
pub(super) fn mount_metric(port: u16, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = reqwest_like_get(port, "/metrics");
    common::metric(&text, name, labels).unwrap_or_else(|e| panic!("mount metrics: {e}\n{text}"))
}

/// Objects the mount has asked to complete (a missing metric fails).
fn completion_requests(port: u16) -> f64 {
    mount_metric(
        port,
        "lakecache_fuse_local_tier_completion_requests_total",
        &[],
    )
}

/// Mounts with a tier and a metrics listener, with `env_vars` set for
/// the mount; returns the tier and the metrics port.
pub(super) fn mount_with_tier_and_metrics(
    env: &mut Env,
    env_vars: &[(&str, &str)],
) -> (PathBuf, u16) {
    let tier = env.dir.path().join("local-tier");
    let mut cmd = env.mount_command();
    cmd.arg("--local-cache")
        .arg(&tier)
        .args(["--metrics-listen", "127.0.0.1:0"])
        .envs(env_vars.iter().copied());
    env.spawn_mount(&mut cmd);
    env.wait_mount_serving();
    let port = env
        .mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30));
    (tier, port)
}

#[test]
fn a_half_read_object_becomes_whole_without_more_reads_and_is_then_read_by_passthrough() {
    let mut env = Env::start(1);
    let data = pattern((48 << 20) + 123, 81);
    let want = Sha256::digest(&data).to_vec();
    env.put("half.bin", Bytes::from(data.clone()));
    let tier = mount_with_tier(&mut env, &["--log", "lakecache_fuse=trace,info"]);
    let file = env.mountpoint().join("half.bin");
    assert_eq!(read_prefix(&file, 24 << 20), data[..24 << 20]);
    wait_until("the half-read object whole in the tier", 60, || {
        tier_has_whole_object(&tier)
    });
    let copy = tier_files(&tier, "data").remove(0);
    assert_eq!(
        Sha256::digest(fs::read(&copy).unwrap()).to_vec(),
        want,
        "the tier's copy"
    );
    read_by_passthrough(&env, &file, &want, "read after completion");
}

/// Under a training loader, the fill thread falls behind the reads; an
/// object wanted whole (`--local-cache-whole`) must still end whole from
/// its reader's own bytes, not from a second fetch epochs later (DLIO's
/// UNet3D: objects were not whole before its third epoch).
#[test]
fn an_object_wanted_whole_is_filled_by_its_reader_with_no_fill_dropped() {
    let mut env = Env::start(1);
    let data = pattern((40 << 20) + 7, 83);
    let want = Sha256::digest(&data).to_vec();
    env.put("shards/kept.bin", Bytes::from(data));
    let (tier, port) = mount_with_tier_and_metrics(
        &mut env,
        &[
            ("LAKECACHE_TIER_FILL_QUEUE_BYTES", "1"),
            ("LAKECACHE_LOCAL_CACHE_WHOLE", "shards/"),
            // read_by_passthrough follows the FUSE ops in the log.
            ("LAKECACHE_LOG", "lakecache_fuse=trace,info"),
        ],
    );
    let file = env.mountpoint().join("shards/kept.bin");
    assert_eq!(sha_file(&file).unwrap().1, want);
    wait_until("the object whole in the tier", 60, || {
        tier_has_whole_object(&tier)
    });
    let m = |name: &str| mount_metric(port, name, &[]);
    assert_eq!(
        m("lakecache_fuse_local_tier_fill_dropped_bytes_total"),
        0.0,
        "a fill of an object wanted whole was dropped"
    );
    assert_eq!(
        m("lakecache_fuse_local_tier_completion_fetched_bytes_total"),
        0.0,
        "completion fetched bytes its reader had already fetched"
    );
    let copy = tier_files(&tier, "data").remove(0);
    assert_eq!(Sha256::digest(fs::read(&copy).unwrap()).to_vec(), want);
    read_by_passthrough(&env, &file, &want, "read after its first read");
}

#[test]
fn with_every_background_fill_dropped_a_read_object_still_ends_whole() {
    let mut env = Env::start(1);
    let data = pattern((40 << 20) + 5, 82);
    let want = Sha256::digest(&data).to_vec();
    env.put("tiny-queue.bin", Bytes::from(data));
    let (tier, port) =
        // 0: every background fill is dropped (a queue of 1 byte still
        // took all of them on a fast CI machine, and this showed nothing).
        mount_with_tier_and_metrics(&mut env, &[("LAKECACHE_TIER_FILL_QUEUE_BYTES", "0")]);
    let file = env.mountpoint().join("tiny-queue.bin");
    assert_eq!(sha_file(&file).unwrap().1, want);
    wait_until("the object whole in the tier", 60, || {
        tier_has_whole_object(&tier)
    });
    let m = |name: &str, labels: &[(&str, &str)]| mount_metric(port, name, labels);
    assert!(
        m("lakecache_fuse_local_tier_fill_dropped_bytes_total", &[]) > 0.0,
        "the background lane, turned off, dropped no fill, so this test shows nothing"
    );
    assert!(
        m(
            "lakecache_fuse_local_tier_completion_fetched_bytes_total",
            &[]
        ) > 0.0
    );
    assert_eq!(
        m(
            "lakecache_fuse_local_tier_completions_total",
            &[("outcome", "whole")]
        ),
        1.0
    );
    assert_eq!(
        m("lakecache_fuse_local_tier_objects", &[("state", "whole")]),
        1.0
    );
    assert_eq!(m("lakecache_fuse_local_tier_missing_bytes", &[]), 0.0);
    let copy = tier_files(&tier, "data").remove(0);
    assert_eq!(Sha256::digest(fs::read(&copy).unwrap()).to_vec(), want);
    // What a user asks of the mount: the tier object by object.
    let addr = format!("127.0.0.1:{port}");
    let status = |args: &[&str]| {
        let out = Command::new(common::BIN)
            .args(["status", "--mount", &addr])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "status --mount failed: {text}{err}");
        text
    };
    let report: serde_json::Value = serde_json::from_str(&status(&["--json"])).unwrap();
    assert_eq!(report["whole"], 1, "{report}");
    assert_eq!(report["partial"], 0, "{report}");
    let object = &report["objects"][0];
    assert_eq!(
        object["uri"],
        format!("s3://{BUCKET}/tiny-queue.bin"),
        "{report}"
    );
    assert_eq!(object["state"], "whole");
    assert_eq!(object["missing_bytes"], 0);
    assert_eq!(object["wanted_whole"], true);
    assert_eq!(report["completion"]["completed"], 1, "{report}");
    let table = status(&[]);
    assert!(
        table.contains("1 whole, 0 partial") && table.contains("tiny-queue.bin"),
        "{table}"
    );
    // A wrong address is named with the hint, not a stack of errors.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = Command::new(common::BIN)
        .args(["status", "--mount", &closed.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--metrics-listen"), "{err}");
}

#[test]
fn completion_goes_on_after_the_mount_is_killed_and_mounted_again() {
    let mut env = Env::start(1);
    let data = pattern((64 << 20) + 9, 83);
    let want = Sha256::digest(&data).to_vec();
    env.put("resume.bin", Bytes::from(data));
    let tier = mount_with_tier(&mut env, &[]);
    let file = env.mountpoint().join("resume.bin");
    read_prefix(&file, 16 << 20);
    // Killed once completion has recorded that the object is wanted.
    wait_until("the object recorded as wanted whole", 30, || {
        tier_objects(&tier).iter().any(|o| o.wanted_whole)
    });
    env.mount.take().unwrap().kill9();
    let _ = lakecache_fuse::mount::force_unmount(&env.mountpoint());
    wait_mounted(&env.mountpoint(), false);
    let served_before = worker_metric_baseline(env.workers[0].0, "lakecache_served", "");
    mount_with_tier(&mut env, &[]);
    // No reads after the remount: the mount finishes on its own.
    wait_until("the object whole after the remount", 60, || {
        tier_has_whole_object(&tier)
    });
    let copy = tier_files(&tier, "data").remove(0);
    assert_eq!(Sha256::digest(fs::read(&copy).unwrap()).to_vec(), want);
    let served = worker_metric(env.workers[0].0, "lakecache_served", "") - served_before;
    assert!(
        served > 0.0 && served <= (64 << 20) as f64 + (1 << 20) as f64,
        "the remount fetched {served} bytes for a 64 MiB object"
    );
}

#[test]
fn a_header_and_footer_reader_fetches_about_what_it_read_and_no_completion() {
    let mut env = Env::start(1);
    let len: usize = 48 << 20;
    let data = pattern(len, 84);
    env.put("model.safetensors", Bytes::from(data.clone()));
    let (_tier, port) = mount_with_tier_and_metrics(&mut env, &[]);
    let worker = env.workers[0].0;
    let served_before = worker_metric_baseline(worker, "lakecache_served", "");
    let file = env.mountpoint().join("model.safetensors");
    let f = File::open(&file).unwrap();
    let mut head = vec![0u8; 64 << 10];
    f.read_exact_at(&mut head, 0).unwrap();
    let mut tail = vec![0u8; 64 << 10];
    f.read_exact_at(&mut tail, (len - (64 << 10)) as u64)
        .unwrap();
    drop(f);
    assert_eq!(head, data[..64 << 10]);
    assert_eq!(tail, data[len - (64 << 10)..]);
    // Asking for completion happens inside the read that crosses the
    // threshold, so with the reads done the count is final.
    assert_eq!(completion_requests(port), 0.0);
    let served = worker_metric(worker, "lakecache_served", "") - served_before;
    assert!(
        served <= 2.0 * (128 << 10) as f64,
        "read 128 KiB, fetched {served} bytes from the worker"
    );
}

#[test]
fn objects_under_a_whole_prefix_are_completed_after_a_header_read_and_others_are_not() {
    let mut env = Env::start(1);
    let len: usize = (24 << 20) + 7;
    let shard = pattern(len, 85);
    let want = Sha256::digest(&shard).to_vec();
    env.put("shards/part-0.bin", Bytes::from(shard));
    env.put("other/part-0.bin", Bytes::from(pattern(len, 86)));
    let (tier, port) =
        mount_with_tier_and_metrics(&mut env, &[("LAKECACHE_LOCAL_CACHE_WHOLE", "shards/")]);
    for name in ["shards/part-0.bin", "other/part-0.bin"] {
        read_prefix(&env.mountpoint().join(name), 64 << 10);
    }
    wait_until("the shard whole in the tier", 60, || {
        tier_has_whole_object(&tier)
    });
    let objects = tier_objects(&tier);
    let whole: Vec<_> = objects.iter().filter(|o| o.whole).collect();
    assert_eq!(whole.len(), 1, "only the shard: {objects:?}");
    assert!(whole[0].uri.ends_with("/shards/part-0.bin"), "{objects:?}");
    // Asked once, for the shard alone: the other header read asked nothing.
    assert_eq!(completion_requests(port), 1.0);
    let copy = tier_files(&tier, "data").into_iter().find(|p| {
        fs::metadata(p)
            .map(|m| m.len() == len as u64)
            .unwrap_or(false)
            && Sha256::digest(fs::read(p).unwrap()).to_vec() == want
    });
    assert!(copy.is_some(), "no tier file holds the shard's bytes");
}

/// `reads` reads of 4 KiB at pseudo-random offsets of `file`, each
/// checked against `data`.
fn read_randomly(file: &Path, data: &[u8], reads: usize) {
    read_randomly_from(file, data, reads, 0x2545_f491_4f6c_dd1d);
}

#[test]
fn a_random_reader_gets_the_whole_object_into_the_tier_for_about_its_size_from_s3() {
    let mut env = Env::start(1);
    let len: usize = 64 << 20;
    let data = pattern(len, 87);
    let want = Sha256::digest(&data).to_vec();
    env.put("shuffled.bin", Bytes::from(data.clone()));
    let (tier, port) = mount_with_tier_and_metrics(&mut env, &[]);
    let worker = env.workers[0].0;
    let s3_before = worker_metric_baseline(worker, "lakecache_s3_transferred", "");
    read_randomly(&env.mountpoint().join("shuffled.bin"), &data, 16);
    wait_until("the randomly read object whole in the tier", 60, || {
        tier_has_whole_object(&tier)
    });
    let copy = tier_files(&tier, "data").remove(0);
    assert_eq!(Sha256::digest(fs::read(&copy).unwrap()).to_vec(), want);
    let s3 = worker_metric(worker, "lakecache_s3_transferred", "") - s3_before;
    println!("S3 sent {:.3}x the object", s3 / len as f64);
    // Issue #32's bound. It held at 1.03-1.11x until the worker served a
    // request covering whole pages in 1 MiB block fetches when it took
    // the request for a random one (streams of one object interleave),
    // while its read-ahead fetched the same pages whole: 1.000x since.
    assert!(
        s3 <= 1.1 * len as f64,
        "S3 sent {s3} bytes for a {len}-byte object"
    );
    assert_eq!(completion_requests(port), 1.0);
}

#[test]
fn with_random_whole_fetch_off_a_random_reader_fetches_about_what_it_reads() {
    let mut env = Env::start(1);
    let len: usize = 64 << 20;
    let data = pattern(len, 88);
    env.put("shuffled.bin", Bytes::from(data.clone()));
    let (_tier, port) =
        mount_with_tier_and_metrics(&mut env, &[("LAKECACHE_RANDOM_WHOLE_MAX", "0")]);
    let worker = env.workers[0].0;
    let s3_before = worker_metric_baseline(worker, "lakecache_s3_transferred", "");
    read_randomly(&env.mountpoint().join("shuffled.bin"), &data, 16);
    assert_eq!(completion_requests(port), 0.0);
    // Each 4 KiB read costs at most its worker page from S3 (today's
    // per-read bound), far from the object.
    let s3 = worker_metric(worker, "lakecache_s3_transferred", "") - s3_before;
    assert!(
        s3 <= 16.0 * (1 << 20) as f64 / 4.0,
        "S3 sent {s3} bytes for 16 reads of 4 KiB"
    );
}

/// `reads` random 4 KiB reads of `file` at offsets drawn from `seed`,
/// each checked against `data`.
fn read_randomly_from(file: &Path, data: &[u8], reads: usize, seed: u64) {
    read_randomly_through(&File::open(file).unwrap(), data, reads, seed);
}

/// [`read_randomly_from`] through an open file.
fn read_randomly_through(f: &File, data: &[u8], reads: usize, seed: u64) {
    let mut x = seed | 1;
    let mut buf = vec![0u8; 4096];
    for _ in 0..reads {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % (data.len() as u64 / 4096)) * 4096;
        f.read_exact_at(&mut buf, at).unwrap();
        assert_eq!(buf, data[at as usize..at as usize + 4096], "at {at}");
    }
}

#[test]
fn without_a_tier_a_random_reader_gets_the_object_fetched_whole_into_the_worker() {
    let mut env = Env::start(1);
    let len: usize = 64 << 20;
    let data = pattern(len, 89);
    env.put("shuffled.bin", Bytes::from(data.clone()));
    let port = super::dir_prefetch::mount_with_metrics(&mut env, &[]);
    let worker = env.workers[0].0;
    let s3_before = worker_metric_baseline(worker, "lakecache_s3_transferred", "");
    let file = env.mountpoint().join("shuffled.bin");
    read_randomly_from(&file, &data, 16, 0x2545_f491_4f6c_dd1d);
    assert_eq!(
        mount_metric(port, "lakecache_fuse_worker_whole_fetches_total", &[]),
        1.0
    );
    wait_until("the object whole in the worker's cache", 60, || {
        worker_metric(worker, "lakecache_cache_used", "") >= len as f64
    });
    let s3 = worker_metric(worker, "lakecache_s3_transferred", "") - s3_before;
    println!("S3 sent {:.3}x the object", s3 / len as f64);
    assert!(
        s3 <= 1.1 * len as f64,
        "S3 sent {s3} bytes for a {len}-byte object"
    );
    // Reads anywhere in it now cost S3 nothing.
    let gets = worker_metric(worker, "lakecache_s3_requests", "op=\"get_object\"");
    read_randomly_from(&file, &data, 64, 0x9e37_79b9_7f4a_7c15);
    assert_eq!(
        worker_metric(worker, "lakecache_s3_requests", "op=\"get_object\""),
        gets
    );
}

/// FUSE `op` calls the mount has answered (a missing metric fails).
pub(super) fn mount_ops(port: u16, op: &str) -> f64 {
    mount_metric(
        port,
        "lakecache_fuse_op_duration_seconds_count",
        &[("op", op)],
    )
}

#[test]
fn a_random_readers_whole_object_reaches_the_page_cache_and_is_then_read_without_the_mount() {
    let mut env = Env::start(1);
    let len: usize = 64 << 20;
    let data = pattern(len, 93);
    env.put("shuffled.bin", Bytes::from(data.clone()));
    let (tier, port) = mount_with_tier_and_metrics(&mut env, &[]);
    let path = env.mountpoint().join("shuffled.bin");
    let file = File::open(&path).unwrap();
    read_randomly_through(&file, &data, 16, 0x9e37_79b9_7f4a_7c15);
    let pushed = || {
        mount_metric(
            port,
            "lakecache_fuse_page_cache_push_bytes_total",
            &[("outcome", "pushed")],
        )
    };
    wait_until("the object whole in the tier and pushed", 60, || {
        tier_has_whole_object(&tier) && pushed() >= len as f64
    });
    // 2,000 more random 4 KiB reads through the same handle: the kernel
    // answers them from the pages pushed, right bytes every one.
    let before = mount_ops(port, "read");
    read_randomly_through(&file, &data, 2000, 0x2545_f491_4f6c_dd1d);
    let asked = mount_ops(port, "read") - before;
    println!("{asked} of 2000 reads reached the mount after the push");
    // Without the push about 1,900 would (the pages not read before).
    assert!(asked <= 20.0, "{asked} of 2000 reads reached the mount");
    drop(file);
    // A new file written over it shows its own bytes, never pushed ones.
    let replaced = pattern(len / 2, 94);
    fs::write(&path, &replaced).unwrap();
    let got = fs::read(&path).unwrap();
    assert_eq!(got.len(), replaced.len());
    assert!(got == replaced, "the rewritten file reads other bytes");
}

#[test]
fn with_the_push_off_a_random_reader_still_gets_the_tier_and_every_read_asks_the_mount() {
    let mut env = Env::start(1);
    let len: usize = 16 << 20;
    let data = pattern(len, 95);
    env.put("shuffled.bin", Bytes::from(data.clone()));
    let (tier, port) =
        mount_with_tier_and_metrics(&mut env, &[("LAKECACHE_NO_PAGE_CACHE_PUSH", "true")]);
    let file = File::open(env.mountpoint().join("shuffled.bin")).unwrap();
    read_randomly_through(&file, &data, 16, 0x9e37_79b9_7f4a_7c15);
    wait_until("the object whole in the tier", 60, || {
        tier_has_whole_object(&tier)
    });
    let before = mount_ops(port, "read");
    read_randomly_through(&file, &data, 200, 0x2545_f491_4f6c_dd1d);
    assert!(
        mount_ops(port, "read") - before >= 150.0,
        "reads were answered without the mount"
    );
    assert_eq!(
        mount_metric(
            port,
            "lakecache_fuse_page_cache_push_bytes_total",
            &[("outcome", "pushed")]
        ),
        0.0
    );
}
