//! Two shuffled epochs over a data set twice the cache's size (issue #35):
//! hit ratio and data wait per step with plans (eviction and prefetch by
//! the published read order), with recency alone (LRU), with no cache
//! (every sample from S3) and from local files (the reference that fixes
//! the compute time). S3 sits behind an in-process delaying proxy.
//!
//! The loader is modelled on PyTorch's: a map-style data set of fixed-size
//! samples, a seeded shuffle per epoch split across ranks as
//! DistributedSampler does, `--loader-workers` tasks per rank each
//! building whole batches (two in flight each, as `prefetch_factor=2`),
//! and a training loop that takes batches in order and "computes" for a
//! fixed time per step. Data wait is the loop's time blocked on its next
//! batch. A sample is a hit when the worker answered its read from cache
//! (`x-lakecache-cache: hit`: every byte cached when the read arrived; a
//! read that waited on a prefetch in flight is a miss).
//!
//! Ranks each read through their own cluster client, as separate nodes
//! would; with 2 ranks there are 2 workers, each holding half the cache,
//! and each rank's plan is split among the workers owning its ranges.
//!
//! `mounts` reads the same way through real `lakecache mount`s (kernel
//! FUSE), one per rank, each at its own mount point, with plans published
//! to the workers as above and to each rank's mount, which holds the
//! plan's next samples in memory; rank r's mount reads worker r's pages through
//! its local socket (the same node) and the other workers' over HTTP. The mount does not pass on a worker's
//! hit/miss per read, so its epoch hit ratio is counted at the workers:
//! the share of the bytes the mounts asked for that were cached when
//! asked (a read that waited on S3 or a prefetch in flight is a miss). The
//! kernel's page cache is dropped before each epoch, so epoch 2 measures
//! the cache, not this machine's RAM.

mod belady;
mod common;
mod delay;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use common::MIB;
use http_body_util::BodyExt;
use lakecache_protocol::tier_socket::TierChannel;
use lakecache_protocol::{ObjectUri, WorkerClient, CACHE_HEADER};
use lakecache_registry::{ClusterClient, ClusterOptions, RingOptions, StaticMembership};
use lakecache_worker::store::ObjectStore;
use lakecache_worker::Metrics;
use serde_json::json;
use tokio::sync::mpsc;

/// Compute time per step, fixed: local files show a data wait under 0.5%
/// of step time with it (checked and printed by every run).
const COMPUTE: Duration = Duration::from_millis(40);
/// Batches each loader worker keeps ready (PyTorch's `prefetch_factor`).
const PREFETCH_FACTOR: usize = 2;
const BUCKET: &str = "bench";
const EPOCHS: u64 = 2;
const GIB: f64 = (1u64 << 30) as f64;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "benches/work-plans")]
    dir: PathBuf,
    /// Shards in the data set
    #[arg(long, default_value_t = 64)]
    shards: u64,
    /// Size of each shard in MiB
    #[arg(long, default_value_t = 16)]
    shard_mib: u64,
    /// Sample size in KiB (a divisor of the page)
    #[arg(long, default_value_t = 1024)]
    sample_kib: u64,
    /// The workers' page size in KiB, as `lakecache worker --page-size`
    /// sets it (1-64 MiB in steps of 256 KiB, a multiple of the sample).
    /// A miss or prefetch fetches a whole page: pages the size of a
    /// sample fetch what the loader reads, 4 MiB pages of 1 MiB samples
    /// four times that (see benches/results/plan-epochs-1mib-pages.md)
    #[arg(long, default_value_t = 4096)]
    page_kib: u64,
    /// Samples per batch (per rank)
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Loader workers per rank (DataLoader's num_workers)
    #[arg(long, default_value_t = 2)]
    loader_workers: usize,
    /// Round trip added in front of the S3 endpoint
    #[arg(long, default_value_t = 10)]
    rtt_ms: u64,
    /// Repetitions; medians are reported
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Rank counts to run
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    ranks: Vec<usize>,
    /// Workers' plan prefetch budget in MiB (their default when absent;
    /// 0 turns prefetch off, leaving eviction by plan alone)
    #[arg(long)]
    plan_prefetch_mib: Option<u64>,
    /// Publish the plan once, before epoch 1 (it already runs on into
    /// epoch 2), instead of renewing it as each epoch starts, as a
    /// sampler does: shows what a renewal costs
    #[arg(long)]
    publish_once: bool,
    /// Readers to run (a subset is for trying changes; the table of
    /// record has them all)
    #[arg(
        long,
        value_enum,
        default_value = "local,no-cache,lru,plans,mounts,mounts-random",
        value_delimiter = ','
    )]
    modes: Vec<Mode>,
    /// The lakecache binary for `mounts` (default: beside this bench)
    #[arg(long)]
    lakecache: Option<PathBuf>,
    /// Readers through a mount advise POSIX_FADV_RANDOM on each open, as
    /// a loader can (`os.posix_fadvise`): the kernel then reads no more
    /// than each sample, where its read-ahead otherwise fetches the next
    /// sample of a shard along with the one at offset 0 (and cached
    /// samples' read-ahead marks fetch more)
    #[arg(long)]
    fadvise_random: bool,
    /// An extra flag for each `lakecache mount` (repeatable)
    #[arg(long, allow_hyphen_values = true)]
    mount_arg: Vec<String>,
    /// Where the table (plan-epochs.md) and per-step series (.json) go
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
enum Mode {
    Local,
    NoCache,
    Lru,
    Plans,
    Mounts,
    /// Mounts whose loaders advise POSIX_FADV_RANDOM on each open, as the
    /// README tells loaders reading samples out of large files to do.
    MountsRandom,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Local => "local files",
            Mode::NoCache => "no cache (S3)",
            Mode::Lru => "workers, LRU",
            Mode::Plans => "workers, plans",
            Mode::Mounts => "mounts, plans",
            Mode::MountsRandom => "mounts, plans, random advice",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::NoCache => "nocache",
            Mode::Lru => "lru",
            Mode::Plans => "plans",
            Mode::Mounts => "mounts",
            Mode::MountsRandom => "mounts-random",
        }
    }

    /// Whether ranks read through `lakecache mount`s.
    fn mounted(self) -> bool {
        matches!(self, Mode::Mounts | Mode::MountsRandom)
    }
}

/// Where samples are read from.
enum Source {
    Local(PathBuf),
    Direct(Arc<dyn ObjectStore>, HashMap<u64, String>),
    Cluster(Arc<ClusterClient>, HashMap<String, WorkerClient>),
    /// A `lakecache mount`'s view of the bucket; whether each open is
    /// advised POSIX_FADV_RANDOM.
    Mount(PathBuf, bool),
}

#[derive(Clone, Copy)]
struct Layout {
    sample: u64,
    per_shard: u64,
}

impl Layout {
    fn place(&self, sample: u64) -> (u64, u64) {
        (
            sample / self.per_shard,
            (sample % self.per_shard) * self.sample,
        )
    }
}

fn shard_uri(i: u64) -> ObjectUri {
    ObjectUri::new(BUCKET, format!("plans/shard-{i:04}.bin")).expect("a valid key")
}

/// Byte `at` of shard `i`: constant over each 4 KiB block, so a sample's
/// first byte tells whether the right bytes came back.
fn pattern(i: u64, at: u64) -> u8 {
    (i.wrapping_mul(7) ^ (at / 4096)) as u8
}

impl Source {
    /// Reads one sample; `Some(hit)` where a cache answered.
    async fn read(&self, layout: Layout, sample: u64) -> Result<Option<bool>> {
        let (shard, offset) = layout.place(sample);
        let range = offset..offset + layout.sample;
        let (bytes, hit) = match self {
            Source::Local(dir) | Source::Mount(dir, _) => {
                let path = dir.join(format!("shard-{shard:04}.bin"));
                let len = layout.sample as usize;
                let random = matches!(self, Source::Mount(_, true));
                let bytes = tokio::task::spawn_blocking(move || {
                    use std::os::fd::AsRawFd;
                    use std::os::unix::fs::FileExt;
                    let file = std::fs::File::open(&path)?;
                    if random {
                        // SAFETY: advice on a descriptor held open.
                        let rc = unsafe {
                            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM)
                        };
                        if rc != 0 {
                            return Err(std::io::Error::from_raw_os_error(rc));
                        }
                    }
                    let mut buf = vec![0u8; len];
                    file.read_exact_at(&mut buf, offset)?;
                    std::io::Result::Ok(Bytes::from(buf))
                })
                .await??;
                (bytes, None)
            }
            Source::Direct(store, etags) => {
                let etag = etags.get(&shard).context("no ETag for the shard")?;
                let bytes = store.get_range(&shard_uri(shard), range, etag).await?;
                (bytes, Some(false))
            }
            Source::Cluster(cluster, clients) => {
                let uri = shard_uri(shard);
                let owner = cluster
                    .owner_of(&uri, offset)
                    .context("no worker owns the sample")?;
                let client = clients
                    .get(&owner.address)
                    .with_context(|| format!("no client for {}", owner.address))?;
                let resp = client.read_stream(&uri, Some(range)).await?;
                let hit = resp
                    .headers()
                    .get(CACHE_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .with_context(|| format!("the worker's answer has no {CACHE_HEADER}"))?
                    == "hit";
                let bytes = resp.into_body().collect().await?.to_bytes();
                (bytes, Some(hit))
            }
        };
        if bytes.len() as u64 != layout.sample || bytes[0] != pattern(shard, offset) {
            bail!(
                "sample {sample} came back wrong ({} bytes, first byte {})",
                bytes.len(),
                bytes.first().copied().unwrap_or(0)
            );
        }
        Ok(hit)
    }
}

/// One training step as the loop saw it.
#[derive(Clone, Copy, Default)]
struct Step {
    wait: Duration,
    hits: u32,
    samples: u32,
}

/// A seeded permutation (splitmix64 driving Fisher-Yates).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut order: Vec<u64> = (0..n).collect();
    for i in (1..order.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// One rank's epoch: loader workers build batches, the loop takes them
/// in order and computes for [`COMPUTE`] each.
async fn run_epoch(
    source: Arc<Source>,
    layout: Layout,
    order: Vec<u64>,
    batch: usize,
    loader_workers: usize,
) -> Result<Vec<Step>> {
    let batches: Vec<Vec<u64>> = order.chunks(batch).map(<[u64]>::to_vec).collect();
    let batches = Arc::new(batches);
    let mut receivers = Vec::new();
    let mut loaders = Vec::new();
    for w in 0..loader_workers {
        let (tx, rx) = mpsc::channel::<Result<(u32, u32)>>(PREFETCH_FACTOR);
        receivers.push(rx);
        let (source, batches) = (source.clone(), batches.clone());
        loaders.push(tokio::spawn(async move {
            for b in (w..batches.len()).step_by(loader_workers) {
                let mut hits = 0;
                let mut result = Ok(());
                for &sample in &batches[b] {
                    match source.read(layout, sample).await {
                        Ok(hit) => hits += u32::from(hit.unwrap_or(false)),
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                let sent = result.map(|()| (hits, batches[b].len() as u32));
                if tx.send(sent).await.is_err() {
                    return;
                }
            }
        }));
    }
    let mut steps = Vec::with_capacity(batches.len());
    for b in 0..batches.len() {
        let started = Instant::now();
        let got = receivers[b % loader_workers]
            .recv()
            .await
            .context("a loader worker ended early")??;
        steps.push(Step {
            wait: started.elapsed(),
            hits: got.0,
            samples: got.1,
        });
        tokio::time::sleep(COMPUTE).await;
    }
    for l in loaders {
        l.await?;
    }
    Ok(steps)
}

/// CPU seconds process `pid` used so far (from /proc).
fn process_cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces): utime and
    // stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').context("unreadable /proc stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        Ok(fields.get(i).context("short /proc stat")?.parse::<f64>()?)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((ticks(11)? + ticks(12)?) / hz)
}

/// CPU seconds this process used so far (workers, endpoint, proxy and
/// loaders all run in it).
fn cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// One mode at one rank count: both epochs of every rank.
struct Outcome {
    /// `epochs[e][rank]`: that rank's steps.
    epochs: Vec<Vec<Vec<Step>>>,
    cpu_s: f64,
    bytes: u64,
    publish_s: f64,
    /// Bytes fetched from S3 by the workers (or the uncached reader).
    s3_bytes: Option<u64>,
    /// Per epoch, where hits were counted at the workers (`mounts`).
    worker_hit_ratio: Option<Vec<f64>>,
}

impl Outcome {
    fn hit_ratio(&self, epoch: usize) -> f64 {
        if let Some(ratios) = &self.worker_hit_ratio {
            return ratios[epoch];
        }
        let (h, n) = self.epochs[epoch]
            .iter()
            .flatten()
            .fold((0u64, 0u64), |(h, n), s| {
                (h + u64::from(s.hits), n + u64::from(s.samples))
            });
        h as f64 / n.max(1) as f64
    }
    /// Data wait as a share of step time (wait plus compute).
    fn wait_share(&self, epoch: usize) -> f64 {
        let steps: Vec<&Step> = self.epochs[epoch].iter().flatten().collect();
        let wait: f64 = steps.iter().map(|s| s.wait.as_secs_f64()).sum();
        wait / (wait + steps.len() as f64 * COMPUTE.as_secs_f64())
    }
}

struct Bench {
    args: Args,
    layout: Layout,
    samples: u64,
    s3: common::BenchS3,
    proxied: lakecache_worker::S3Config,
    etags: HashMap<u64, String>,
}

impl Bench {
    async fn run(&self, mode: Mode, ranks: usize, run: usize) -> Result<Outcome> {
        let dir = self
            .args
            .dir
            .join(format!("run-{run}-{}-{ranks}", mode.key()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut workers = Vec::new();
        let mut sources: Vec<Arc<Source>> = Vec::new();
        let mut clusters = Vec::new();
        let mut worker_metrics = Vec::new();
        match mode {
            Mode::Local => {
                let local = Arc::new(Source::Local(self.args.dir.join("local")));
                sources = vec![local; ranks];
            }
            Mode::NoCache => {
                let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
                worker_metrics.push(metrics.clone());
                let store = lakecache_worker::s3_store(&self.proxied, metrics).await;
                let direct = Arc::new(Source::Direct(store, self.etags.clone()));
                sources = vec![direct; ranks];
            }
            Mode::Lru | Mode::Plans | Mode::Mounts | Mode::MountsRandom => {
                // The cache holds half the data set, split among the workers.
                let capacity = self.samples * self.layout.sample / 2 / ranks as u64;
                for w in 0..ranks {
                    let mut options =
                        common::worker_options(dir.join(format!("cache-{w}")), capacity)?;
                    options.cache.page_size = self.args.page_kib * 1024;
                    if let Some(mib) = self.args.plan_prefetch_mib {
                        options.cache.plan_prefetch.budget_bytes = mib * MIB;
                    }
                    if mode.mounted() {
                        // Rank w's node: its mount reads this worker's
                        // pages from its page files, the others' over HTTP.
                        options.local_socket = Some(local_socket(&dir, w));
                    }
                    let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
                    let store = lakecache_worker::s3_store(&self.proxied, metrics.clone()).await;
                    worker_metrics.push(metrics.clone());
                    workers.push(lakecache_worker::start_worker(options, store, metrics).await?);
                }
                let addrs: Vec<String> = workers.iter().map(|w| w.addr().to_string()).collect();
                for _ in 0..ranks {
                    let membership = Arc::new(StaticMembership::new(&addrs));
                    let options = ClusterOptions {
                        ring: RingOptions {
                            segment_size: 16 * MIB,
                            ..Default::default()
                        },
                        ..Default::default()
                    };
                    let cluster = ClusterClient::new(membership, options, None);
                    let clients = addrs
                        .iter()
                        .map(|a| Ok((a.clone(), WorkerClient::new(a, Duration::from_secs(30))?)))
                        .collect::<Result<HashMap<_, _>>>()?;
                    clusters.push(cluster.clone());
                    sources.push(Arc::new(Source::Cluster(cluster, clients)));
                }
            }
        }
        let mut mounts = Vec::new();
        if mode.mounted() {
            let registry = format!(
                "static:{}",
                workers
                    .iter()
                    .map(|w| w.addr().to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
            sources.clear();
            for rank in 0..ranks {
                let (mount, view) = self.mount(&dir, rank, &registry)?;
                mounts.push(mount);
                let random = mode == Mode::MountsRandom || self.args.fadvise_random;
                sources.push(Arc::new(Source::Mount(view, random)));
            }
        }
        let traffic = || -> (u64, u64) {
            workers.iter().fold((0, 0), |(h, m), w| {
                let t = w.cache().traffic();
                let b = t.get(BUCKET);
                (
                    h + b.map_or(0, |b| b.hit_bytes),
                    m + b.map_or(0, |b| b.miss_bytes),
                )
            })
        };
        let mut worker_hit_ratio = Vec::new();
        let mounts_cpu = |mounts: &[common::BenchMount]| -> Result<f64> {
            mounts
                .iter()
                .map(|m| process_cpu_seconds(m.child.id()))
                .sum()
        };
        let cpu_before = cpu_seconds() + mounts_cpu(&mounts)?;
        let mut epochs = Vec::new();
        let mut publish_s = 0.0;
        // The same seed for every mode: they read the same order.
        let order = |epoch: u64| shuffled(self.samples, run_seed(run, epoch));
        let of_rank = |order: &[u64], rank: usize| -> Vec<u64> {
            order.iter().skip(rank).step_by(ranks).copied().collect()
        };
        for epoch in 0..EPOCHS {
            let this_epoch = order(epoch);
            let next_epoch = (epoch + 1 < EPOCHS).then(|| order(epoch + 1));
            for source in &sources {
                if let Source::Mount(view, _) = &**source {
                    self.forget_pages(view)?;
                }
            }
            let before = traffic();
            let mut tasks = Vec::new();
            for (rank, source) in sources.iter().enumerate() {
                let mine = of_rank(&this_epoch, rank);
                if (mode == Mode::Plans || mode.mounted())
                    && (epoch == 0 || !self.args.publish_once)
                {
                    // The sampler's next epoch is known too (its seed is
                    // the epoch's): the plan runs on into it, so the
                    // epoch's end keeps and fetches what the next starts
                    // with. It is published again when that epoch starts.
                    let mut planned = mine.clone();
                    if let Some(next) = &next_epoch {
                        planned.extend(of_rank(next, rank));
                    }
                    let entries: Vec<(ObjectUri, std::ops::Range<u64>)> = planned
                        .iter()
                        .map(|s| {
                            let (shard, off) = self.layout.place(*s);
                            (shard_uri(shard), off..off + self.layout.sample)
                        })
                        .collect();
                    let t = Instant::now();
                    if mode.mounted() {
                        // The rank's mount too, as the Python client does
                        // through the node's socket: it holds the plan's
                        // next samples in memory ahead of the reads.
                        let (socket_dir, entries) =
                            (client_socket_dir(&dir, rank), entries.clone());
                        let published = tokio::task::spawn_blocking(move || {
                            TierChannel::connect(&socket_dir)?
                                .publish_plan("bench/0", 600, &entries)
                        })
                        .await?;
                        // A mount told to hold none (`--plan-memory 0`)
                        // refuses it, as it would refuse a Python client.
                        if let Err(e) = published {
                            if epoch == 0 && rank == 0 && run == 0 {
                                eprintln!("the mount took no plan: {e}");
                            }
                        }
                    }
                    clusters[rank]
                        .publish_plan(&format!("bench/{rank}"), &entries, 600)
                        .await
                        .context("publishing a plan")?;
                    publish_s += t.elapsed().as_secs_f64();
                }
                tasks.push(tokio::spawn(run_epoch(
                    source.clone(),
                    self.layout,
                    mine,
                    self.args.batch,
                    self.args.loader_workers,
                )));
            }
            let mut per_rank = Vec::new();
            for t in tasks {
                per_rank.push(t.await??);
            }
            epochs.push(per_rank);
            if mode.mounted() {
                let (hit, miss) = traffic();
                let (hit, miss) = (hit - before.0, miss - before.1);
                if hit + miss == 0 {
                    bail!("the workers counted no bytes for the mounts' reads in epoch {epoch}");
                }
                worker_hit_ratio.push(hit as f64 / (hit + miss) as f64);
            }
        }
        let cpu_s = cpu_seconds() + mounts_cpu(&mounts)? - cpu_before;
        drop(mounts);
        let s3_bytes = match mode {
            Mode::Local => None,
            _ => Some(s3_fetched(&worker_metrics)?),
        };
        if std::env::var_os("PLAN_EPOCHS_METRICS").is_some() {
            for m in &worker_metrics {
                for line in m.render().lines() {
                    if !line.starts_with('#') && line.contains("lakecache_") {
                        eprintln!("  {line}");
                    }
                }
            }
        }
        for w in workers {
            w.shutdown().await;
        }
        let _ = std::fs::remove_dir_all(&dir);
        Ok(Outcome {
            epochs,
            cpu_s,
            bytes: 2 * self.samples * self.layout.sample,
            publish_s,
            s3_bytes,
            worker_hit_ratio: mode.mounted().then_some(worker_hit_ratio),
        })
    }

    /// Rank `rank`'s `lakecache mount` of the bucket, reading through
    /// `registry`'s workers; returns it and where the shards appear.
    fn mount(
        &self,
        dir: &std::path::Path,
        rank: usize,
        registry: &str,
    ) -> Result<(common::BenchMount, PathBuf)> {
        let bin = match &self.args.lakecache {
            Some(bin) => bin.clone(),
            None => std::env::current_exe()?.with_file_name("lakecache"),
        };
        let path = dir.join(format!("mnt-{rank}"));
        let log = dir.join(format!("mount-{rank}.log"));
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(["mount", &format!("s3://{BUCKET}")])
            .arg(&path)
            .args(["--registry", registry, "--segment-size", "16MiB"])
            .arg("--local-worker-socket")
            .arg(local_socket(dir, rank))
            .arg("--client-socket-dir")
            .arg(client_socket_dir(dir, rank))
            .args(["--no-s3-fallback", "--read-only"])
            .args(&self.args.mount_arg)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let mount = common::BenchMount::start(&mut cmd, &path).with_context(|| {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            format!(
                "mounting with {} (log {}):\n{text}",
                bin.display(),
                log.display()
            )
        })?;
        Ok((mount, path.join("plans")))
    }

    /// Drops the kernel's cached pages of every shard seen through a
    /// mount, so an epoch reads from the cache, not from this host's RAM.
    fn forget_pages(&self, view: &std::path::Path) -> Result<()> {
        use std::os::fd::AsRawFd;
        for shard in 0..self.args.shards {
            let path = view.join(format!("shard-{shard:04}.bin"));
            let file = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: advice on a descriptor we hold open.
            let rc =
                unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                bail!("posix_fadvise on {}: errno {rc}", path.display());
            }
        }
        Ok(())
    }
}

/// Bytes the stores behind `metrics` fetched from S3. Each fetched in
/// epoch 1 (every run starts cold), so a missing count is an error, not 0.
fn s3_fetched(metrics: &[Arc<Metrics>]) -> Result<u64> {
    const NAME: &str = "lakecache_s3_transferred_bytes_total{op=\"get_object\"}";
    let mut total = 0u64;
    for m in metrics {
        let text = m.render();
        let line = text
            .lines()
            .find(|l| l.starts_with(NAME))
            .with_context(|| format!("no {NAME} in a worker's metrics"))?;
        let value = line.rsplit(' ').next().unwrap_or_default();
        total += value
            .parse::<f64>()
            .with_context(|| format!("unreadable metric line {line:?}"))? as u64;
    }
    Ok(total)
}

/// The fewest bytes any eviction could fetch from S3 for run `run`'s two
/// epochs with the bench's cache (half the data set, all workers
/// together: a split cache does no better), fetching `unit` bytes at a
/// time (a page, or a sample).
fn least_fetched(bench: &Bench, run: usize, unit: u64) -> u64 {
    let seq: Vec<u64> = (0..EPOCHS)
        .flat_map(|e| shuffled(bench.samples, run_seed(run, e)))
        .map(|s| {
            let (shard, off) = bench.layout.place(s);
            shard * (bench.args.shard_mib * MIB).div_ceil(unit) + off / unit
        })
        .collect();
    let capacity = (bench.samples * bench.layout.sample / 2 / unit) as usize;
    let misses: usize = belady::min_misses(&seq, capacity, seq.len()).iter().sum();
    misses as u64 * unit
}

/// The shuffle seed of epoch `epoch` in run `run` (the same in every mode).
fn run_seed(run: usize, epoch: u64) -> u64 {
    0x1a4e_cac4e + run as u64 * 1000 + epoch
}

/// Worker `w`'s socket for mounts on its host.
/// Where rank `rank`'s mount takes plans (its node's client socket).
fn client_socket_dir(dir: &std::path::Path, rank: usize) -> PathBuf {
    dir.join(format!("clients-{rank}"))
}

fn local_socket(dir: &std::path::Path, w: usize) -> PathBuf {
    dir.join(format!("cache-{w}")).join("local.sock")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn write_data(args: &Args, s3: &common::BenchS3) -> Result<HashMap<u64, String>> {
    let local = args.dir.join("local");
    std::fs::create_dir_all(&local)?;
    let size = args.shard_mib * MIB;
    let mut etags = HashMap::new();
    for i in 0..args.shards {
        let body: Vec<u8> = (0..size).map(|at| pattern(i, at)).collect();
        std::fs::write(local.join(format!("shard-{i:04}.bin")), &body)?;
        let etag = s3
            .direct
            .put(&shard_uri(i), Bytes::from(body), &Default::default())
            .await?;
        etags.insert(i, etag);
    }
    Ok(etags)
}

fn check_args(args: &Args) -> Result<()> {
    let (sample, page) = (args.sample_kib * 1024, args.page_kib * 1024);
    if !(MIB..=64 * MIB).contains(&page) || !page.is_multiple_of(256 * 1024) {
        bail!(
            "--page-kib must be 1024 to 65536 in steps of 256, as the worker's --page-size (got {})",
            args.page_kib
        );
    }
    if sample == 0 || !page.is_multiple_of(sample) {
        bail!(
            "--sample-kib must divide the {} KiB page (got {})",
            args.page_kib,
            args.sample_kib
        );
    }
    if args.shard_mib == 0 || !(args.shard_mib * MIB).is_multiple_of(sample) {
        bail!("--shard-mib must be a positive multiple of the sample size");
    }
    if args.runs == 0 || args.batch == 0 || args.loader_workers == 0 || args.shards == 0 {
        bail!("--runs, --batch, --loader-workers and --shards must be at least 1");
    }
    if args.ranks.is_empty() || args.ranks.iter().any(|r| *r == 0 || *r > 8) {
        bail!("--ranks takes counts from 1 to 8");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    check_args(&args)?;
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    let s3 = common::start_s3(args.dir.join("s3"), BUCKET).await?;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = proxy.local_addr()?;
    let one_way = Duration::from_micros(args.rtt_ms * 500);
    tokio::spawn(delay::serve(proxy, s3.endpoint.addr(), one_way));
    let mut proxied = s3.config.clone();
    proxied.endpoint = Some(format!("http://{proxy_addr}"));
    let etags = write_data(&args, &s3).await?;
    let sample = args.sample_kib * 1024;
    let layout = Layout {
        sample,
        per_shard: args.shard_mib * MIB / sample,
    };
    let samples = args.shards * layout.per_shard;
    let bench = Bench {
        layout,
        samples,
        s3,
        proxied,
        etags,
        args,
    };
    let args = &bench.args;
    println!(
        "# Two shuffled epochs, data set {} MiB ({samples} samples of {} KiB), cache {} MiB in {} KiB pages, {} ms RTT to S3",
        samples * sample / MIB,
        args.sample_kib,
        samples * sample / 2 / MIB,
        args.page_kib,
        args.rtt_ms
    );
    println!(
        "compute {} ms per step, batch {}, {} loader workers per rank, median of {} runs\n",
        COMPUTE.as_millis(),
        args.batch,
        args.loader_workers,
        args.runs
    );
    let mut rows = Vec::new();
    let mut series = serde_json::Map::new();
    for &ranks in &args.ranks {
        for &mode in &args.modes {
            let mut outcomes = Vec::new();
            for run in 0..args.runs {
                let o = bench.run(mode, ranks, run).await.with_context(|| {
                    format!("{} with {ranks} rank(s), run {}", mode.name(), run + 1)
                })?;
                eprintln!(
                    "{} x{ranks} run {}: epoch-2 hits {:.3}, wait {:.2}%",
                    mode.name(),
                    run + 1,
                    o.hit_ratio(1),
                    o.wait_share(1) * 100.0
                );
                outcomes.push(o);
            }
            let hits2: Vec<f64> = outcomes.iter().map(|o| o.hit_ratio(1)).collect();
            let mid = median(hits2.clone());
            let median_run = outcomes
                .iter()
                .position(|o| o.hit_ratio(1) == mid)
                .unwrap_or(0);
            let o = &outcomes[median_run];
            let gib = o.bytes as f64 / (1u64 << 30) as f64;
            let row = json!({
                "ranks": ranks,
                "mode": mode.key(),
                "hit_ratio_epoch1": median(outcomes.iter().map(|o| o.hit_ratio(0)).collect()),
                "hit_ratio_epoch2": mid,
                "hit_ratio_epoch2_runs": hits2,
                "wait_share_epoch1": median(outcomes.iter().map(|o| o.wait_share(0)).collect()),
                "wait_share_epoch2": median(outcomes.iter().map(|o| o.wait_share(1)).collect()),
                "wait_share_epoch2_runs": outcomes.iter().map(|o| o.wait_share(1)).collect::<Vec<_>>(),
                "cpu_s_per_gib": median(outcomes.iter().map(|o| o.cpu_s / gib).collect()),
                "publish_s": median(outcomes.iter().map(|o| o.publish_s).collect()),
                "s3_gib": (mode != Mode::Local).then(|| {
                    median(outcomes.iter().map(|o| o.s3_bytes.unwrap_or(0) as f64 / GIB).collect())
                }),
            });
            let steps: Vec<serde_json::Value> = (0..2)
                .map(|e| {
                    let per_step: Vec<serde_json::Value> = (0..o.epochs[e][0].len())
                        .map(|s| {
                            let at: Vec<&Step> =
                                o.epochs[e].iter().filter_map(|r| r.get(s)).collect();
                            let hits: u32 = at.iter().map(|x| x.hits).sum();
                            let n: u32 = at.iter().map(|x| x.samples).sum();
                            let wait = at.iter().map(|x| x.wait.as_secs_f64()).fold(0.0, f64::max);
                            // A mount's reads carry no per-read hit.
                            let hit = (!mode.mounted()).then(|| hits as f64 / n.max(1) as f64);
                            json!([hit, wait * 1000.0])
                        })
                        .collect();
                    json!(per_step)
                })
                .collect();
            series.insert(format!("{}-{ranks}", mode.key()), json!(steps));
            rows.push(row);
        }
    }
    // Every run's order is its own; the median run's bound is shown.
    let least = |unit: u64| {
        median(
            (0..args.runs)
                .map(|run| least_fetched(&bench, run, unit) as f64 / GIB)
                .collect(),
        )
    };
    let bounds = (least(args.page_kib * 1024), least(bench.layout.sample));
    let table = render(&rows, args, bounds);
    print!("{table}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("plan-epochs.md"), &table)?;
    let doc = json!({
        "compute_ms": COMPUTE.as_millis() as u64,
        "rtt_ms": args.rtt_ms,
        "rows": rows,
        "least_s3_gib": {"whole_pages": bounds.0, "samples": bounds.1},
        "steps": series,
    });
    std::fs::write(
        args.out.join("plan-epochs.json"),
        serde_json::to_string_pretty(&doc)?,
    )?;
    bench.s3.endpoint.shutdown().await;
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(())
}

/// The table; `bounds`: the least GiB any eviction could fetch from S3,
/// fetching whole pages and fetching samples.
fn render(rows: &[serde_json::Value], args: &Args, bounds: (f64, f64)) -> String {
    let mut out = String::new();
    let pct = |v: &serde_json::Value| format!("{:.2}%", v.as_f64().unwrap_or(f64::NAN) * 100.0);
    let ratio = |v: &serde_json::Value| format!("{:.3}", v.as_f64().unwrap_or(f64::NAN));
    out.push_str(&format!(
        "Two shuffled epochs, {} KiB samples, cache half the data set in {} KiB pages, {} ms RTT, median of {} runs (`cargo run --release -p lakecache-bench --bin plan-epochs`).\n\n",
        args.sample_kib, args.page_kib, args.rtt_ms, args.runs
    ));
    out.push_str("| ranks | reader | epoch-1 hit ratio | epoch-2 hit ratio (runs) | epoch-1 data wait | epoch-2 data wait (runs) | CPU-s per GiB read | S3 GiB fetched | plan publish s |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let mode = <Mode as clap::ValueEnum>::value_variants()
            .iter()
            .find(|m| m.key() == r["mode"].as_str().unwrap_or(""))
            .copied()
            .unwrap_or(Mode::Local);
        let hit_cell = |v: &serde_json::Value| {
            if mode == Mode::Local {
                "n/a".to_string()
            } else {
                ratio(v)
            }
        };
        let runs = |v: &serde_json::Value, f: &dyn Fn(&serde_json::Value) -> String| {
            v.as_array()
                .map(|a| a.iter().map(f).collect::<Vec<_>>().join(", "))
                .unwrap_or_default()
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} ({}) | {} | {} ({}) | {:.2} | {} | {:.3} |\n",
            r["ranks"],
            mode.name(),
            hit_cell(&r["hit_ratio_epoch1"]),
            hit_cell(&r["hit_ratio_epoch2"]),
            if mode == Mode::Local {
                "n/a".into()
            } else {
                runs(&r["hit_ratio_epoch2_runs"], &ratio)
            },
            pct(&r["wait_share_epoch1"]),
            pct(&r["wait_share_epoch2"]),
            runs(&r["wait_share_epoch2_runs"], &pct),
            r["cpu_s_per_gib"].as_f64().unwrap_or(f64::NAN),
            r["s3_gib"]
                .as_f64()
                .map_or("n/a".to_string(), |g| format!("{g:.2}")),
            r["publish_s"].as_f64().unwrap_or(f64::NAN),
        ));
    }
    out.push_str(&format!(
        "\nS3 GiB fetched: over both epochs (the data set is {:.2} GiB, read twice). The least any eviction could fetch for these orders and this cache (Belady's rule, computed by the bench; median of the runs' orders): **{:.2} GiB** fetching whole {} KiB pages, **{:.2} GiB** fetching only the samples read. Workers fetch only the part of a page a plan reads there.\n",
        args.shards as f64 * args.shard_mib as f64 / 1024.0,
        bounds.0,
        args.page_kib,
        bounds.1
    ));
    let mounted = |m: Mode| rows.iter().any(|r| r["mode"] == m.key());
    if mounted(Mode::Mounts) || mounted(Mode::MountsRandom) {
        out.push_str("\n`mounts, plans`: each rank reads through its own `lakecache mount` (kernel FUSE); its hit ratio is counted at the workers, as the share of the bytes the mounts asked for that were cached when asked, and its CPU includes the mount processes. Each rank's plan also goes to its mount (through the node's client socket, as the Python client sends it), which holds the plan's next samples in memory (`--plan-memory`, 32 MiB here); the workers count those fetches too, when the mount makes them, so a sample a mount fetched before a worker had it counts as a miss even if its reader found it in the mount's memory.\n");
        if mounted(Mode::MountsRandom) {
            out.push_str("`random advice`: the same, with each open advised POSIX_FADV_RANDOM, as the README tells loaders that read samples out of large files to do: the kernel then asks the mount for each sample and no more (without it, a sample read at offset 0 is taken for a stream and the next sample is read too).\n");
        }
        if args.fadvise_random {
            out.push_str(
                "Every mount reader advised POSIX_FADV_RANDOM on each open (`--fadvise-random`).\n",
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shuffle_is_a_permutation_and_depends_on_its_seed() {
        let a = shuffled(1000, 1);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(a, shuffled(1000, 2));
        assert_eq!(a, shuffled(1000, 1));
    }

    #[test]
    fn samples_map_into_their_shards() {
        let l = Layout {
            sample: MIB,
            per_shard: 16,
        };
        assert_eq!(l.place(0), (0, 0));
        assert_eq!(l.place(17), (1, MIB));
    }
}
