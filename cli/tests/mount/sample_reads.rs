//! A data loader's pattern: each sample a fresh open and one read at a
//! random offset inside a large shard (issue #35's bench found it slow).

use std::os::fd::AsRawFd;

use lakecache_protocol::tier_socket::TierChannel;

use super::local_tier::{worker_metric, worker_metric_baseline};
use super::*;

/// The kernel's read-ahead for the FUSE mount at `path`, in KiB.
fn read_ahead_kib(path: &Path) -> u32 {
    let want = path.to_string_lossy().to_string();
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let entry = info
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(&want))
        .unwrap_or_else(|| panic!("{want} is not in mountinfo"));
    let dev = entry.split(' ').nth(2).unwrap();
    fs::read_to_string(format!("/sys/class/bdi/{dev}/read_ahead_kb"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Reads the 1 MiB sample at `at` MiB of `file` as a loader that follows
/// the README does (a fresh open advised POSIX_FADV_RANDOM), and checks
/// it against `shard`.
fn read_advised_sample(file: &Path, shard: &[u8], at: u64) {
    let f = File::open(file).unwrap();
    // SAFETY: advice on a descriptor held open.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    assert_eq!(rc, 0, "posix_fadvise");
    let mut buf = vec![0u8; 1 << 20];
    f.read_exact_at(&mut buf, at << 20).unwrap();
    let want = &shard[(at << 20) as usize..((at + 1) << 20) as usize];
    assert!(buf == want, "sample at {at} MiB");
}

#[test]
fn one_mib_samples_read_at_random_offsets_cost_the_workers_their_own_bytes() {
    let mut env = Env::start(1);
    let shard = pattern(16 << 20, 35);
    env.put("shards/s.bin", Bytes::from(shard.clone()));
    // Over HTTP, so the worker's byte count is exactly what it sent.
    env.mount_with(&["--no-local-reads"]);
    let mnt = env.mountpoint().canonicalize().unwrap();
    // The kernel sends a 1 MiB read whole, not in 128 KiB pieces.
    assert_eq!(read_ahead_kib(&mnt), 1024);
    let file = mnt.join("shards/s.bin");
    let port = env.workers[0].0;
    let metric = "lakecache_served_bytes_total";
    let before = worker_metric_baseline(port, metric, "");
    let offsets = [9u64, 2, 14, 5, 11, 0, 7, 12];
    for &at in &offsets {
        let f = File::open(&file).unwrap();
        // Each sample new to the kernel's page cache too.
        // SAFETY: advice on a descriptor held open.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut buf = vec![0u8; 1 << 20];
        f.read_exact_at(&mut buf, at << 20).unwrap();
        let want = &shard[(at << 20) as usize..((at + 1) << 20) as usize];
        assert!(buf == want, "sample at {at} MiB");
    }
    let sent = worker_metric(port, metric, "") - before;
    let asked = (offsets.len() as f64) * (1u64 << 20) as f64;
    // Before the mount raised the kernel's read size, each sample came
    // as nine 128 KiB reads that started the mount's read-ahead: about
    // 7 times the bytes asked for. Now 11 MiB for these 8: without advice
    // the read at offset 0 makes the kernel read the next sample too,
    // and the mount takes those two reads for a stream starting (one
    // window ahead). Loaders avoid both with the advice (the next test).
    assert!(
        sent <= asked * 1.4,
        "the workers sent {sent} bytes for {asked} asked\n{}",
        env.log()
    );
}

/// The recipe the README gives loaders that read samples out of large
/// files through a mount: advise POSIX_FADV_RANDOM on each open, and the
/// kernel asks the mount for the samples and nothing more. Without the
/// advice (kernel 6.18) the read at offset 0 made the kernel read the
/// next sample too: 6 MiB for these 5 (benches/results/plan-epochs-1mib-fadvise.md).
#[test]
fn samples_read_with_random_advice_reach_the_mount_as_asked() {
    let mut env = Env::start(1);
    let shard = pattern(16 << 20, 36);
    env.put("shards/advised.bin", Bytes::from(shard.clone()));
    // Read once first, so the counter exists before the baseline.
    env.put("other.bin", Bytes::from_static(b"starts the read counter"));
    // Over HTTP, so the worker's byte count is exactly what it sent.
    env.mount_with(&["--metrics-listen", "127.0.0.1:0", "--no-local-reads"]);
    let port = env
        .mount
        .as_mut()
        .expect("mounted")
        .wait_for_port("mount metrics at http://", Duration::from_secs(30));
    fs::read(env.mountpoint().join("other.bin")).unwrap();
    let metric = "lakecache_fuse_read_bytes_total";
    let before = super::tier_completion::mount_metric(port, metric, &[]);
    let worker_port = env.workers[0].0;
    let served = "lakecache_served_bytes_total";
    let served_before = worker_metric_baseline(worker_port, served, "");
    let file = env.mountpoint().join("shards/advised.bin");
    // The shard's first sample, one far off, then its second.
    let offsets = [0u64, 7, 1, 12, 4];
    for &at in &offsets {
        read_advised_sample(&file, &shard, at);
    }
    let read = super::tier_completion::mount_metric(port, metric, &[]) - before;
    let asked = (offsets.len() as f64) * (1u64 << 20) as f64;
    assert!(
        read == asked,
        "the kernel asked the mount for {read} bytes, the loader for {asked}\n{}",
        env.log()
    );
    // Nor does the mount fetch ahead of a 1 MiB read at offset 0 (the
    // kernel's largest): it fetched the next sample too, which a plan's
    // worker took for a read of it (plan-epochs-first-read.md).
    let sent = worker_metric(worker_port, served, "") - served_before;
    assert!(
        sent == asked,
        "the workers sent {sent} bytes for {asked} asked\n{}",
        env.log()
    );
}

/// A loader that publishes its plan to a mount without a node-local tier
/// (through `--client-socket-dir`, as the Python client does) finds its
/// next samples in the mount's memory: the reads come from the kernel as
/// before, and the mount answers them without asking a worker, each
/// sample fetched from the workers once.
#[test]
fn a_plan_sent_to_a_mount_without_a_tier_has_its_samples_read_from_memory() {
    let mut env = Env::start(1);
    let shard = pattern(16 << 20, 37);
    env.put("shards/planned.bin", Bytes::from(shard.clone()));
    let sockets = env.dir.path().join("clients");
    let port = super::dir_prefetch::mount_with_metrics(
        &mut env,
        // Over HTTP, so the worker's byte count is exactly what it sent.
        &[
            "--client-socket-dir",
            sockets.to_str().unwrap(),
            "--no-local-reads",
        ],
    );
    let metric = |outcome: &str| {
        super::tier_completion::mount_metric(
            port,
            "lakecache_fuse_plan_ranges_total",
            &[("outcome", outcome)],
        )
    };
    let offsets = [9u64, 2, 14, 5, 11, 0, 7, 12];
    let uri = ObjectUri::new(BUCKET, "shards/planned.bin").unwrap();
    let entries: Vec<(ObjectUri, std::ops::Range<u64>)> = offsets
        .iter()
        .map(|&at| (uri.clone(), (at << 20)..((at + 1) << 20)))
        .collect();
    let worker_port = env.workers[0].0;
    let served_by_worker = "lakecache_served_bytes_total";
    let worker_before = worker_metric_baseline(worker_port, served_by_worker, "");
    let channel = TierChannel::connect(&sockets).unwrap_or_else(|e| panic!("{e}\n{}", env.log()));
    assert_eq!(
        channel.publish_plan("job/0", 60, &entries).unwrap(),
        offsets.len()
    );
    let file = env.mountpoint().join("shards/planned.bin");
    for (i, &at) in offsets.iter().enumerate() {
        // The plan's first samples are fetched before any read; later
        // ones as the reader's opens move it on. Each read here waits
        // until no fetch is in flight, so its sample is in memory.
        common::wait_until(
            "the next planned sample in memory",
            Duration::from_secs(30),
            Duration::from_millis(5),
            || {
                let fetched = metric("fetched");
                fetched >= (i + 1) as f64 && metric("ready") >= fetched
            },
        );
        read_advised_sample(&file, &shard, at);
    }
    let (served, dropped) = (metric("served"), metric("dropped"));
    assert!(
        served == 8.0 && dropped == 0.0,
        "{served} of 8 samples came from memory ({dropped} dropped)\n{}",
        env.log()
    );
    // Each sample was fetched from the worker once, by the plan.
    let sent = worker_metric(worker_port, served_by_worker, "") - worker_before;
    let asked = (offsets.len() as u64 * (1 << 20)) as f64;
    assert!(
        sent == asked,
        "the worker sent {sent} bytes for {asked} of samples"
    );
}
