//! Large directories through the mount: time to the first entry, `ls -l`
//! of 100,000 entries cold and warm (vs the same names on local disk), and
//! the mount's RSS idle, after listing 200,000 keys and after the kernel
//! drops its dentries and inodes (`echo 2 > /proc/sys/vm/drop_caches`).
//!
//! The S3 endpoint and the worker run in this process; the mount is the
//! `lakecache` binary given, in its own process, so its RSS is its own.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use futures::{stream, StreamExt};
use lakecache_protocol::ObjectUri;
use lakecache_worker::Metrics;

use common::{start_s3, worker_options};

#[derive(Parser)]
struct Args {
    /// The lakecache binary to mount with
    #[arg(long, default_value = "target/release/lakecache")]
    lakecache: PathBuf,
    /// Keys per directory (two directories are listed)
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Markdown report
    #[arg(long)]
    out: Option<PathBuf>,
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")
}

/// Seconds of one `ls -l DIR > /dev/null`.
fn time_ls(dir: &Path) -> Result<f64> {
    let started = Instant::now();
    let status = Command::new("ls")
        .arg("-l")
        .arg(dir)
        .stdout(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("ls -l {} failed", dir.display());
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Seconds from opendir to the first entry.
fn first_entry(dir: &Path) -> Result<f64> {
    let started = Instant::now();
    let mut entries = std::fs::read_dir(dir)?;
    entries.next().context("empty directory")??;
    Ok(started.elapsed().as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let tmp = tempfile::tempdir()?;
    let s3 = start_s3(tmp.path().join("s3"), "data").await?;
    let seeded = Instant::now();
    let names: Vec<String> = ["a", "b"]
        .iter()
        .flat_map(|d| (0..args.keys).map(move |i| format!("{d}/shard-{i:08}.bin")))
        .collect();
    let mut puts = stream::iter(names.iter().cloned())
        .map(|key| {
            let store = s3.direct.clone();
            async move {
                let uri = ObjectUri::new("data", &key)?;
                store
                    .put(&uri, Bytes::from_static(b"x"), &Default::default())
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(128);
    while let Some(r) = puts.next().await {
        r?;
    }
    eprintln!(
        "seeded {} keys in {:.1}s",
        names.len(),
        seeded.elapsed().as_secs_f64()
    );

    let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
    let store = lakecache_worker::s3_store(&s3.config, metrics.clone()).await;
    let worker = lakecache_worker::start_worker(
        worker_options(tmp.path().join("cache"), 1 << 30)?,
        store,
        metrics,
    )
    .await?;

    // The same names on local disk, for the ratio.
    let local = tmp.path().join("local");
    std::fs::create_dir_all(&local)?;
    for i in 0..args.keys {
        std::fs::write(local.join(format!("shard-{i:08}.bin")), b"x")?;
    }

    let mnt = tmp.path().join("mnt");
    std::fs::create_dir_all(&mnt)?;
    let mount = common::BenchMount::start(
        Command::new(&args.lakecache)
            .args(["mount", "s3://data", "--worker", &worker.addr().to_string()])
            .arg(&mnt)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit()),
        &mnt,
    )?;
    let pid = mount.child.id();
    std::thread::sleep(Duration::from_millis(500));
    let rss_idle = rss_kib(pid)?;

    let first = tokio::task::block_in_place(|| first_entry(&mnt.join("a")))?;
    let cold = tokio::task::block_in_place(|| time_ls(&mnt.join("b")))?;
    let warm = tokio::task::block_in_place(|| time_ls(&mnt.join("b")))?;
    tokio::task::block_in_place(|| time_ls(&mnt.join("a")))?;
    let rss_listed = rss_kib(pid)?;
    let local_cold = {
        std::fs::write("/proc/sys/vm/drop_caches", "3\n").ok();
        tokio::task::block_in_place(|| time_ls(&local))?
    };
    let local_warm = tokio::task::block_in_place(|| time_ls(&local))?;

    std::fs::write("/proc/sys/vm/drop_caches", "2\n").context("dropping the kernel's caches")?;
    // The kernel's FORGETs arrive in batches; give the mount a moment.
    std::thread::sleep(Duration::from_secs(3));
    let rss_dropped = rss_kib(pid)?;
    // Listings are kept for the entry TTL (60 s) so the next `ls` is warm.
    std::thread::sleep(Duration::from_secs(62));
    let rss_expired = rss_kib(pid)?;
    drop(mount);
    worker.shutdown().await;

    let command = format!(
        "{} --lakecache {} --keys {}",
        std::env::args().next().unwrap_or_default(),
        args.lakecache.display(),
        args.keys
    );
    let mib = |k: u64| k as f64 / 1024.0;
    let report = format!(
        "# Large directories through the mount\n\n\
         Command: `{command}` (run as root: it mounts and writes /proc/sys/vm/drop_caches)\n\n\
         Two directories of {n} one-byte objects each on the embedded S3 endpoint,\n\
         one worker, `lakecache mount` with default settings (entry and\n\
         attribute TTL 60 s). Local disk: the same {n} names in a plain directory.\n\n\
         | measurement | lakecache | local disk | ratio |\n|---|---|---|---|\n\
         | first entry of a cold {n}-entry directory (opendir + first readdir) | {first_ms:.1} ms | | |\n\
         | `ls -l` of {n} entries, cold (first listing) | {cold:.2} s | {local_cold:.2} s | {rc:.1}x |\n\
         | `ls -l` of {n} entries, warm (within the TTL) | {warm:.2} s | {local_warm:.2} s | {rw:.1}x |\n\n\
         | mount RSS | MiB |\n|---|---|\n\
         | idle, after mounting | {idle:.1} |\n\
         | after `ls -l` of both directories ({total} keys) | {listed:.1} |\n\
         | after `echo 2 > /proc/sys/vm/drop_caches` (+3 s; listings still cached) | {dropped:.1} |\n\
         | 62 s later (cached listings expired) | {expired:.1} |\n",
        n = args.keys,
        total = 2 * args.keys,
        first_ms = first * 1000.0,
        rc = cold / local_cold.max(1e-6),
        rw = warm / local_warm.max(1e-6),
        idle = mib(rss_idle),
        listed = mib(rss_listed),
        dropped = mib(rss_dropped),
        expired = mib(rss_expired),
    );
    print!("{report}");
    if let Some(out) = &args.out {
        std::fs::File::create(out)?.write_all(report.as_bytes())?;
    }
    Ok(())
}
