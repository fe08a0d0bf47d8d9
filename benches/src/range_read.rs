//! Range-read throughput on loopback, all four paths in one run:
//! (a) warm reads through the worker's HTTP API, (b) the same page files
//! read straight from disk, (c) cold reads through the worker, (d) ranged
//! GETs straight to the S3 endpoint. Prints a Markdown table with the
//! ratios a/b and c/d.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Parser;
use common::{BenchS3, MIB};
use http_body_util::BodyExt;
use lakecache_protocol::{ObjectUri, WorkerClient};
use lakecache_worker::store::ObjectStore;
use lakecache_worker::{Metrics, RunningWorker};

#[derive(Parser)]
struct Args {
    /// Working directory (S3 data and caches); removed at the end
    #[arg(long, default_value = "benches/work")]
    dir: PathBuf,
    /// Size of each stream's object in MiB
    #[arg(long, default_value_t = 256)]
    object_mib: u64,
    /// Repetitions of each warm measurement (best is reported)
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Write the Markdown table here as well as to stdout
    #[arg(long)]
    out: Option<PathBuf>,
}

const PAGE: u64 = 4 * MIB;
const BUCKET: &str = "bench";

async fn start_worker(s3: &BenchS3, cache_dir: PathBuf) -> Result<RunningWorker> {
    let _ = std::fs::remove_dir_all(&cache_dir);
    let options = common::worker_options(cache_dir, 64 << 30)?;
    let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
    let store = lakecache_worker::s3_store(&s3.config, metrics.clone()).await;
    Ok(lakecache_worker::start_worker(options, store, metrics).await?)
}

fn object(i: usize) -> ObjectUri {
    ObjectUri::new(BUCKET, format!("shard-{i:03}.bin")).expect("valid uri")
}

/// Each stream reads its own object front to back in `req` requests.
async fn through_worker(addr: String, streams: usize, size: u64, req: u64) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..streams {
        let client = WorkerClient::new(&addr, Duration::from_secs(120))?;
        tasks.push(tokio::spawn(async move {
            let mut total = 0u64;
            let mut off = 0;
            while off < size {
                let end = (off + req).min(size);
                let resp = client.read_stream(&object(i), Some(off..end)).await?;
                let mut body = resp.into_body();
                while let Some(frame) = body.frame().await {
                    if let Ok(d) = frame?.into_data() {
                        total += d.len() as u64;
                    }
                }
                off = end;
            }
            anyhow::ensure!(total == size, "short read: {total} of {size}");
            anyhow::Ok(total)
        }));
    }
    let mut bytes = 0;
    for t in tasks {
        bytes += t.await??;
    }
    Ok(bytes as f64 / MIB as f64 / started.elapsed().as_secs_f64())
}

async fn direct_s3(
    store: Arc<dyn ObjectStore>,
    etags: Arc<Vec<String>>,
    streams: usize,
    size: u64,
    req: u64,
) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..streams {
        let (store, etags) = (store.clone(), etags.clone());
        tasks.push(tokio::spawn(async move {
            let mut total = 0u64;
            let mut off = 0;
            while off < size {
                let end = (off + req).min(size);
                total += store
                    .get_range(&object(i), off..end, &etags[i])
                    .await?
                    .len() as u64;
                off = end;
            }
            anyhow::Ok(total)
        }));
    }
    let mut bytes = 0;
    for t in tasks {
        bytes += t.await??;
    }
    Ok(bytes as f64 / MIB as f64 / started.elapsed().as_secs_f64())
}

/// Reads the worker's page files of each object with pread, like a
/// local-disk reader of the same bytes would.
fn from_disk(files: &[Vec<PathBuf>], streams: usize, req: u64) -> Result<f64> {
    let started = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = files[..streams]
            .iter()
            .map(|pages| {
                s.spawn(move || -> Result<u64> {
                    let mut buf = vec![0u8; req as usize];
                    let mut total = 0;
                    for path in pages {
                        let f = std::fs::File::open(path)?;
                        let len = f.metadata()?.len();
                        let mut off = 0;
                        while off < len {
                            let n = req.min(len - off) as usize;
                            f.read_exact_at(&mut buf[..n], off)?;
                            total += n as u64;
                            off += n as u64;
                        }
                    }
                    Ok(total)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread").unwrap_or(0))
            .sum()
    });
    Ok(total as f64 / MIB as f64 / started.elapsed().as_secs_f64())
}

fn page_files(cache_dir: &std::path::Path, uri: &ObjectUri, etag: &str, size: u64) -> Vec<PathBuf> {
    (0..size.div_ceil(PAGE))
        .map(|i| {
            let hex = lakecache_worker::pages::PageKey::new(&uri.to_string(), etag, i).hex();
            cache_dir.join("pages").join(&hex[..2]).join(hex)
        })
        .collect()
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let size = args.object_mib * MIB;
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    let setup = common::start_s3(args.dir.join("s3"), BUCKET).await?;
    let max_streams = 4;
    let mut etags = Vec::new();
    for i in 0..max_streams {
        let body: Vec<u8> = (0..size).map(|b| (b as usize * 31 + i * 7) as u8).collect();
        let uri = object(i);
        etags.push(
            setup
                .direct
                .put(&uri, Bytes::from(body), &Default::default())
                .await
                .context("uploading bench object")?,
        );
    }
    let etags = Arc::new(etags);
    let mut rows = Vec::new();
    for &streams in &[1usize, 4] {
        for &req in &[256 * 1024u64, 4 * MIB] {
            // (c) cold: fresh cache directory, every page comes from S3.
            let cache_dir = args.dir.join("cache");
            let worker = start_worker(&setup, cache_dir.clone()).await?;
            let addr = worker.addr().to_string();
            let cold = through_worker(addr.clone(), streams, size, req).await?;
            // (a) warm: the same reads again.
            let mut warm: f64 = 0.0;
            for _ in 0..args.reps {
                warm = warm.max(through_worker(addr.clone(), streams, size, req).await?);
            }
            // (b) the worker's own page files, straight from disk.
            let files: Vec<Vec<PathBuf>> = (0..max_streams)
                .map(|i| page_files(&cache_dir, &object(i), &etags[i], size))
                .collect();
            let mut disk: f64 = 0.0;
            for _ in 0..args.reps {
                disk = disk.max(from_disk(&files, streams, req)?);
            }
            // (d) direct ranged GETs to the S3 endpoint.
            let s3_direct =
                direct_s3(setup.direct.clone(), etags.clone(), streams, size, req).await?;
            worker.shutdown().await;
            eprintln!("streams={streams} req={}KiB warm={warm:.0} disk={disk:.0} cold={cold:.0} s3={s3_direct:.0} MiB/s", req / 1024);
            rows.push((streams, req, warm, disk, cold, s3_direct));
        }
    }
    setup.endpoint.shutdown().await;
    let _ = std::fs::remove_dir_all(&args.dir);

    let mut table = String::from(
        "| streams | request | (a) warm via worker MiB/s | (b) page files from disk MiB/s | a/b | (c) cold via worker MiB/s | (d) direct S3 GET MiB/s | c/d |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (streams, req, warm, disk, cold, s3d) in &rows {
        let req = if *req >= MIB {
            format!("{} MiB", req / MIB)
        } else {
            format!("{} KiB", req / 1024)
        };
        table.push_str(&format!(
            "| {streams} | {req} | {warm:.0} | {disk:.0} | {:.2} | {cold:.0} | {s3d:.0} | {:.2} |\n",
            warm / disk,
            cold / s3d
        ));
    }
    println!("{table}");
    if let Some(out) = args.out {
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}
