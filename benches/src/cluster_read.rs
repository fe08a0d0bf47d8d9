//! Aggregate warm read throughput of 1, 2 and 3 workers on this machine,
//! and the balance of bytes served per worker. Workers, the S3 endpoint
//! and the readers share the machine's cores: on a 2-core box the CPU, not
//! the worker count, bounds the aggregate.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use bytes::Bytes;
use clap::Parser;
use common::MIB;
use lakecache_protocol::{ObjectUri, WorkerClient};
use lakecache_registry::{ClusterClient, ClusterOptions, RingOptions, StaticMembership};
use lakecache_worker::Metrics;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "benches/work-cluster")]
    dir: std::path::PathBuf,
    /// Objects in the data set
    #[arg(long, default_value_t = 8)]
    objects: usize,
    /// Size of each object in MiB
    #[arg(long, default_value_t = 128)]
    object_mib: u64,
    /// Placement segment size in MiB
    #[arg(long, default_value_t = 16)]
    segment_mib: u64,
    /// Concurrent readers
    #[arg(long, default_value_t = 4)]
    readers: usize,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let _ = std::fs::remove_dir_all(&args.dir);
    let s3 = common::start_s3(args.dir.join("s3"), "bench").await?;
    let (s3_config, direct) = (s3.config.clone(), s3.direct.clone());
    let size = args.object_mib * MIB;
    let uris: Vec<ObjectUri> = (0..args.objects)
        .map(|i| ObjectUri::new("bench", format!("ds/shard-{i:03}.bin")).unwrap())
        .collect();
    for (i, uri) in uris.iter().enumerate() {
        let body: Vec<u8> = (0..size).map(|b| (b as usize * 13 + i) as u8).collect();
        direct
            .put(uri, Bytes::from(body), &Default::default())
            .await?;
    }
    println!("| workers | aggregate warm MiB/s | bytes served per worker (share) | busiest / mean |\n|---|---|---|---|");
    for n in 1..=3usize {
        let mut workers = Vec::new();
        for w in 0..n {
            let options =
                common::worker_options(args.dir.join(format!("cache-{n}-{w}")), 16 << 30)?;
            let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
            let store = lakecache_worker::s3_store(&s3_config, metrics.clone()).await;
            workers.push(lakecache_worker::start_worker(options, store, metrics).await?);
        }
        let addrs: Vec<String> = workers.iter().map(|w| w.addr().to_string()).collect();
        let membership = Arc::new(StaticMembership::new(&addrs));
        let options = ClusterOptions {
            ring: RingOptions {
                segment_size: args.segment_mib * MIB,
                ..Default::default()
            },
            ..Default::default()
        };
        let client = ClusterClient::new(membership, options, None);
        // Warm every page once, then measure.
        read_all(&client, &uris, size, args.readers).await?;
        let before = served(&addrs).await?;
        let started = Instant::now();
        let bytes = read_all(&client, &uris, size, args.readers).await?;
        let rate = bytes as f64 / MIB as f64 / started.elapsed().as_secs_f64();
        let after = served(&addrs).await?;
        let per: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        let total: u64 = per.iter().sum();
        let mean = total as f64 / n as f64;
        let busiest = *per.iter().max().unwrap_or(&0) as f64 / mean.max(1.0);
        let shares: Vec<String> = per
            .iter()
            .map(|b| {
                format!(
                    "{} MiB ({:.0}%)",
                    b / MIB,
                    *b as f64 * 100.0 / total.max(1) as f64
                )
            })
            .collect();
        println!("| {n} | {rate:.0} | {} | {busiest:.2} |", shares.join(", "));
        for w in workers {
            w.shutdown().await;
        }
    }
    s3.endpoint.shutdown().await;
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}

/// Every object read once, 4 MiB requests, `readers` objects at a time.
async fn read_all(
    client: &Arc<ClusterClient>,
    uris: &[ObjectUri],
    size: u64,
    readers: usize,
) -> Result<u64> {
    use futures::StreamExt;
    let results: Vec<Result<u64>> = futures::stream::iter(uris.iter().cloned())
        .map(|uri| {
            let client = client.clone();
            async move {
                let mut total = 0;
                let mut off = 0;
                while off < size {
                    let end = (off + 4 * MIB).min(size);
                    total += client.read(&uri, off..end, None).await?.len() as u64;
                    off = end;
                }
                anyhow::Ok(total)
            }
        })
        .buffer_unordered(readers)
        .collect()
        .await;
    results.into_iter().sum()
}

/// Bytes each worker served from its pages so far (hit + miss).
async fn served(addrs: &[String]) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for a in addrs {
        let h = WorkerClient::new(a, Duration::from_secs(5))?
            .health()
            .await?;
        out.push(h.hit_bytes + h.miss_bytes);
    }
    Ok(out)
}
