//! Worker memory under concurrent uploads: N clients each stream a 1 GiB
//! object through one `lakecache worker` process (its own process, so its
//! RSS is its own) while this process samples the worker's RSS. Run once
//! per `--memory-limit`; the worker's budget should bound the peak.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use lakecache_protocol::{ObjectUri, WorkerClient};

use common::{start_s3, MIB};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "target/release/lakecache")]
    lakecache: PathBuf,
    #[arg(long, default_value_t = 16)]
    uploads: u64,
    #[arg(long, default_value_t = 1024)]
    object_mib: u64,
    /// Worker --memory-limit values to run with ("default" for none)
    #[arg(long, value_delimiter = ',', default_value = "default,512MiB")]
    limits: Vec<String>,
    #[arg(long)]
    out: Option<PathBuf>,
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Run {
    limit: String,
    idle_mib: f64,
    peak_mib: f64,
    seconds: f64,
}

/// One 1 MiB chunk of object `n`: its bytes differ per object and chunk.
fn chunk(n: u64, i: u64) -> Bytes {
    Bytes::from(vec![(n * 31 + i) as u8; MIB as usize])
}

async fn run_once(args: &Args, limit: &str) -> Result<Run> {
    let tmp = tempfile::tempdir()?;
    let s3 = start_s3(tmp.path().join("s3"), "data").await?;
    let port = free_port()?;
    let mut cmd = Command::new(&args.lakecache);
    cmd.args(["worker", "--insecure-http", "--no-auth"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--cache-dir")
        .arg(tmp.path().join("cache"))
        .args(["--cache-size", "2GiB", "--s3-endpoint", &s3.endpoint.url()])
        .arg("--s3-path-style")
        .env("AWS_ACCESS_KEY_ID", "bench")
        .env("AWS_SECRET_ACCESS_KEY", "bench-secret")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if limit != "default" {
        cmd.args(["--memory-limit", limit]);
    }
    let worker = Worker(cmd.spawn().context("starting the worker")?);
    let pid = worker.0.id();
    let addr = format!("127.0.0.1:{port}");
    let client = WorkerClient::new(&addr, Duration::from_secs(600))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while client.health().await.is_err() {
        if Instant::now() > deadline {
            bail!("the worker did not start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idle = rss_kib(pid).unwrap_or(0);

    let peak = Arc::new(AtomicU64::new(idle));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if let Some(r) = rss_kib(pid) {
                    peak.fetch_max(r, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let started = Instant::now();
    let uploads = (0..args.uploads).map(|n| {
        let client = client.clone();
        let chunks = args.object_mib;
        async move {
            let uri = ObjectUri::new("data", format!("up/{n}.bin"))?;
            let body = futures::stream::iter(0..chunks).map(move |i| {
                Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(chunk(n, i)))
            });
            let body = StreamBody::new(body).map_err(|e| match e {}).boxed();
            let stat = client.put(&uri, body, &Default::default()).await?;
            if stat.size != chunks * MIB {
                bail!("{uri}: stored {} bytes", stat.size);
            }
            anyhow::Ok(())
        }
    });
    let results = futures::future::join_all(uploads).await;
    let seconds = started.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    for r in results {
        r?;
    }
    drop(worker);
    s3.endpoint.shutdown().await;
    Ok(Run {
        limit: limit.to_string(),
        idle_mib: idle as f64 / 1024.0,
        peak_mib: peak.load(Ordering::Relaxed) as f64 / 1024.0,
        seconds,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let mut runs = Vec::new();
    for limit in &args.limits {
        let run = run_once(&args, limit).await?;
        eprintln!(
            "limit {}: peak RSS {:.0} MiB in {:.1}s",
            run.limit, run.peak_mib, run.seconds
        );
        runs.push(run);
    }
    let ram = lakecache_protocol::memory::physical_memory();
    let mut report = format!(
        "# Worker memory under concurrent uploads\n\n\
         Command: `{} --lakecache {} --uploads {} --object-mib {} --limits {}`\n\n\
         {} clients each stream a {} MiB object through one `lakecache worker`\n\
         process (16 MiB parts, up to 4 in flight per upload, 2 GiB cache) to the\n\
         embedded S3 endpoint on the same machine ({:.0} GiB RAM; the default\n\
         memory limit is a quarter of it). Peak RSS sampled every 20 ms.\n\n\
         | --memory-limit | idle RSS (MiB) | peak RSS (MiB) | total | time (s) | MiB/s |\n|---|---|---|---|---|---|\n",
        std::env::args().next().unwrap_or_default(),
        args.lakecache.display(),
        args.uploads,
        args.object_mib,
        args.limits.join(","),
        args.uploads,
        args.object_mib,
        ram as f64 / (1u64 << 30) as f64,
    );
    for r in &runs {
        let total = args.uploads * args.object_mib;
        report.push_str(&format!(
            "| {} | {:.0} | {:.0} | {} GiB | {:.1} | {:.0} |\n",
            r.limit,
            r.idle_mib,
            r.peak_mib,
            total / 1024,
            r.seconds,
            total as f64 / r.seconds
        ));
    }
    print!("{report}");
    if let Some(out) = &args.out {
        std::fs::File::create(out)?.write_all(report.as_bytes())?;
    }
    Ok(())
}
