//! Directory-order prefetch through the kernel: a directory of small
//! files read once in listing order is fetched ahead of the reader, each
//! file once from S3, without evicting pinned data on the worker.

use super::local_tier::{worker_metric, worker_metric_baseline};
use super::tier_completion::mount_metric;
use super::*;

const FILE: usize = 100 << 10;

/// Mounts with a metrics listener and `extra` flags; the metrics port.
pub(super) fn mount_with_metrics(env: &mut Env, extra: &[&str]) -> u16 {
    let mut cmd = env.mount_command();
    cmd.args(["--metrics-listen", "127.0.0.1:0"])
        .args(["--entry-ttl", "3600", "--attr-ttl", "3600"])
        .args(extra);
    env.spawn_mount(&mut cmd);
    env.wait_mount_serving();
    env.mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30))
}

fn s3_get_bytes(port: u16) -> f64 {
    worker_metric(
        port,
        "lakecache_s3_transferred_bytes_total",
        "op=\"get_object\"",
    )
}

fn s3_gets(port: u16) -> f64 {
    worker_metric_baseline(port, "lakecache_s3_requests_total", "op=\"get_object\"")
}

/// `ls`, then every file read whole in listing order; checks contents.
fn read_in_listing_order(dir: &Path, seed: impl Fn(&str) -> u64) -> usize {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in &names {
        let got = fs::read(dir.join(name)).unwrap();
        assert!(got == pattern(FILE, seed(name)), "{name} read wrong bytes");
    }
    names.len()
}

#[test]
fn small_files_read_in_listing_order_are_prefetched_and_fetched_once_from_s3() {
    // A small worker cache with a pinned prefix: the prefetch goes
    // through the worker's eviction like any read.
    let mut env = Env::start_full(
        1,
        &[],
        &["--cache-size", "64MiB", "--policy", "s3://data/golden/ pin"],
    );
    let golden: Vec<Vec<u8>> = (0..4).map(|i| pattern(4 << 20, 1000 + i as u64)).collect();
    for (i, g) in golden.iter().enumerate() {
        env.put(&format!("golden/g{i}"), Bytes::from(g.clone()));
    }
    let n = 600; // 60 MiB of small files: more than the cache holds unpinned
    for i in 0..n {
        env.put(
            &format!("shards/s{i:04}"),
            Bytes::from(pattern(FILE, i as u64)),
        );
    }
    let metrics = mount_with_metrics(&mut env, &[]);
    let worker = env.workers[0].0;
    for (i, g) in golden.iter().enumerate() {
        assert!(fs::read(env.mountpoint().join(format!("golden/g{i}"))).unwrap() == *g);
    }
    let (bytes0, gets0) = (s3_get_bytes(worker), s3_gets(worker));
    let read = read_in_listing_order(&env.mountpoint().join("shards"), |name| {
        name[1..].parse().unwrap()
    });
    assert_eq!(read, n);
    let used = mount_metric(
        metrics,
        "lakecache_fuse_dir_prefetch_files_total",
        &[("outcome", "used")],
    );
    let fetched = s3_get_bytes(worker) - bytes0;
    let data = (n * FILE) as f64;
    println!(
        "{n} files in listing order: {used} opens found their file prefetched; S3 sent {:.3}x the data in {} GETs",
        fetched / data,
        s3_gets(worker) - gets0
    );
    assert!(
        used >= (n - 10) as f64,
        "only {used} of {n} opens were prefetched"
    );
    // The window may run a little past the last file read, never twice
    // over a file.
    assert!(fetched <= 1.05 * data, "S3 sent {fetched} bytes for {data}");
    // The pinned objects are still on the worker: reading them again
    // fetches nothing from S3.
    let gets = s3_gets(worker);
    let worker_reads = || {
        worker_metric(
            worker,
            "lakecache_request_duration_seconds_count",
            "op=\"read\"",
        )
    };
    let reads = worker_reads();
    for (i, g) in golden.iter().enumerate() {
        let path = env.mountpoint().join(format!("golden/g{i}"));
        // A new open of a file the kernel cached: drop its pages first.
        drop_page_cache(&path);
        assert!(fs::read(&path).unwrap() == *g);
    }
    assert!(
        worker_reads() >= reads + 4.0,
        "the re-reads did not reach the worker"
    );
    assert_eq!(s3_gets(worker), gets, "pinned objects were fetched again");
}

#[test]
fn with_the_window_off_each_file_is_fetched_when_opened() {
    let mut env = Env::start(1);
    let n = 100;
    for i in 0..n {
        env.put(
            &format!("shards/s{i:04}"),
            Bytes::from(pattern(FILE, i as u64)),
        );
    }
    let metrics = mount_with_metrics(&mut env, &["--dir-prefetch-window", "0"]);
    read_in_listing_order(&env.mountpoint().join("shards"), |name| {
        name[1..].parse().unwrap()
    });
    let text = reqwest_like_get(metrics, "/metrics");
    assert!(
        !text.contains("lakecache_fuse_dir_prefetch_files_total"),
        "prefetched with the window off:\n{text}"
    );
}

/// Drops the kernel's cached pages of `path` (POSIX_FADV_DONTNEED).
fn drop_page_cache(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = File::open(path).unwrap();
    // SAFETY: advice on an open descriptor; no memory is touched.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
}

#[test]
fn sizes_that_are_not_sizes_are_refused_before_mounting() {
    let env = Env::start(1);
    for (flag, value) in [
        ("--dir-prefetch-window", "lots"),
        ("--dir-prefetch-window", "-1"),
        ("--random-whole-max", "-1"),
        ("--random-whole-max", "2 GiB of it"),
    ] {
        let out = env
            .mount_command()
            .arg(format!("{flag}={value}"))
            .output_bounded()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && stderr.contains(&format!("invalid value '{value}' for '{flag}")),
            "{flag}={value}: {}\n{stderr}",
            out.status
        );
        assert!(!is_mounted(&env.mountpoint()), "{flag}={value} mounted");
    }
}

fn is_mounted(mountpoint: &Path) -> bool {
    fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(mountpoint.to_str().unwrap()))
}
