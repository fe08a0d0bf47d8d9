//! `lakecache load s3://bucket/prefix`: every worker fetches the segments
//! it owns under the prefix (work spread by the ring); this command
//! starts the job on each, shows progress and prints a summary.
//! `load status ID` and `load cancel ID` find a job started with
//! `--background`.

use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use lakecache_protocol::{validate_bucket, validate_load_id, LoadProgress, LoadSpec, WorkerClient};

use crate::cluster_args::ClusterArgs;
use crate::units::ByteSize;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct LoadCmd {
    #[command(subcommand)]
    action: Option<LoadAction>,
    /// s3://bucket/prefix to load into the cache
    uri: Option<String>,
    /// Only keys (after the prefix) matching this glob, e.g. '*.bin'
    #[arg(long)]
    include: Option<String>,
    /// Keep each segment on this many workers (its owner and the next on
    /// the ring), so reads stay warm when the owner is down
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=lakecache_protocol::MAX_LOAD_REPLICAS as i64))]
    replicas: u32,
    /// Start the job, print its id and return
    #[arg(long)]
    background: bool,
    /// The job's id [default: a new one]
    #[arg(long)]
    id: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

#[derive(Subcommand)]
enum LoadAction {
    /// Progress of a job (waits for it with --wait)
    Status {
        id: String,
        /// Follow the job until it ends
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Stop a job; what it loaded stays cached
    Cancel {
        id: String,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
}

/// The job as all workers report it.
#[derive(Default)]
struct Totals {
    objects: u64,
    owned: u64,
    fetched: u64,
    cached: u64,
    failed_bytes: u64,
    failed_objects: u64,
    listing_done: bool,
    finished: bool,
    failures: Vec<String>,
    unreachable: Vec<String>,
}

impl Totals {
    fn add(&mut self, p: &LoadProgress) {
        self.objects = self.objects.max(p.objects_listed);
        self.owned += p.bytes_owned;
        self.fetched += p.bytes_fetched;
        self.cached += p.bytes_cached;
        self.failed_bytes += p.bytes_failed;
        self.failed_objects += p.objects_failed;
        self.listing_done &= p.listing_done;
        self.finished &= p.state.is_finished();
        if let Some(e) = &p.error {
            self.failures.push(e.clone());
        }
        for f in &p.failures {
            self.failures.push(format!("{}: {}", f.key, f.reason));
        }
    }

    fn done(&self) -> u64 {
        self.fetched + self.cached + self.failed_bytes
    }
}

impl LoadCmd {
    pub async fn run(self) -> Result<()> {
        match self.action {
            Some(LoadAction::Status { id, wait, cluster }) => {
                validate_load_id(&id).map_err(anyhow::Error::msg)?;
                let workers = Workers::open(&cluster).await?;
                if wait {
                    return follow(&workers, &id).await;
                }
                let t = workers.poll(&id).await;
                println!("{}", line(&t, None));
                print_failures(&t);
                Ok(())
            }
            Some(LoadAction::Cancel { id, cluster }) => {
                validate_load_id(&id).map_err(anyhow::Error::msg)?;
                let workers = Workers::open(&cluster).await?;
                let mut cancelled = 0;
                for (name, c) in &workers.clients {
                    match c.load_cancel(&id).await {
                        Ok(_) => cancelled += 1,
                        Err(e) => eprintln!("{name}: {e}"),
                    }
                }
                if cancelled == 0 {
                    bail!("no worker knows load job {id}");
                }
                println!("cancelled load job {id} on {cancelled} worker(s)");
                Ok(())
            }
            None => self.start().await,
        }
    }

    async fn start(self) -> Result<()> {
        let uri = self
            .uri
            .context("give s3://bucket/prefix to load, or `load status ID` / `load cancel ID`")?;
        let mut spec = parse_spec(&uri, self.include)?;
        spec.replicas = (self.replicas > 1).then_some(self.replicas);
        let id = match self.id {
            Some(id) => {
                validate_load_id(&id).map_err(anyhow::Error::msg)?;
                id
            }
            None => format!("load-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
        };
        let workers = Workers::open(&self.cluster).await?;
        for (name, c) in &workers.clients {
            c.load_start(&id, &spec)
                .await
                .with_context(|| format!("starting load job {id} on worker {name}"))?;
        }
        if self.background {
            println!("{id}");
            eprintln!(
                "load job {id} started on {} worker(s); follow it with `lakecache load status {id} --wait`",
                workers.clients.len()
            );
            return Ok(());
        }
        tokio::select! {
            r = follow(&workers, &id) => r,
            _ = tokio::signal::ctrl_c() => {
                for (_, c) in &workers.clients {
                    let _ = c.load_cancel(&id).await;
                }
                bail!("interrupted: load job {id} cancelled; what it loaded stays cached, and a re-run resumes")
            }
        }
    }
}

pub(crate) fn parse_spec(uri: &str, include: Option<String>) -> Result<LoadSpec> {
    let rest = uri
        .strip_prefix("s3://")
        .with_context(|| format!("{uri:?} must start with s3://"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    validate_bucket(bucket).with_context(|| format!("bucket of {uri:?}"))?;
    if let Some(p) = &include {
        anyhow::ensure!(!p.is_empty(), "--include must not be empty");
    }
    Ok(LoadSpec {
        bucket: bucket.to_string(),
        prefix: prefix.to_string(),
        include,
        replicas: None,
    })
}

pub(crate) struct Workers {
    pub(crate) clients: Vec<(String, WorkerClient)>,
}

impl Workers {
    pub(crate) async fn open(cluster: &ClusterArgs) -> Result<Self> {
        let membership = cluster
            .registry()?
            .open(Duration::from_secs(5))
            .await
            .context("opening the cluster registry")?;
        let members = membership.subscribe().borrow().clone();
        let (tls, token) = (cluster.tls()?, cluster.token()?);
        let mut clients = Vec::new();
        for m in members.iter() {
            let c = WorkerClient::connect(
                &m.address,
                lakecache_protocol::Deadlines::uniform(Duration::from_secs(10)),
                tls.as_ref(),
            )
            .and_then(|c| c.with_token(token.as_deref()))
            .with_context(|| format!("worker {}", m.id))?;
            clients.push((m.id.to_string(), c));
        }
        anyhow::ensure!(!clients.is_empty(), "the cluster has no workers");
        Ok(Self { clients })
    }

    async fn poll(&self, id: &str) -> Totals {
        let mut t = Totals {
            listing_done: true,
            finished: true,
            ..Default::default()
        };
        for (name, c) in &self.clients {
            match c.load_status(id).await {
                Ok(p) => t.add(&p),
                Err(e) => {
                    t.unreachable.push(format!("{name} ({e})"));
                    t.finished = false;
                }
            }
        }
        t
    }
}

/// Polls until every worker has finished, drawing progress.
async fn follow(workers: &Workers, id: &str) -> Result<()> {
    let tty = std::io::stderr().is_terminal();
    let start = Instant::now();
    let mut last_line = Instant::now();
    let mut rate = Rate::default();
    loop {
        let t = workers.poll(id).await;
        let bps = rate.update(t.fetched + t.cached);
        if t.finished {
            if tty {
                eprint!("\r\x1b[2K");
            }
            let secs = start.elapsed().as_secs_f64().max(0.001);
            println!(
                "loaded {} objects: {} fetched from S3, {} already cached, {} failed ({} objects) in {:.1}s ({}/s)",
                t.objects,
                ByteSize(t.fetched).human(),
                ByteSize(t.cached).human(),
                ByteSize(t.failed_bytes).human(),
                t.failed_objects,
                secs,
                ByteSize((t.fetched as f64 / secs) as u64).human(),
            );
            print_failures(&t);
            if t.failed_objects > 0 || !t.failures.is_empty() {
                bail!("load job {id}: some objects were not loaded (above); a re-run retries only those");
            }
            return Ok(());
        }
        if tty {
            eprint!("\r\x1b[2K{}", line(&t, bps));
            let _ = std::io::stderr().flush();
        } else if last_line.elapsed() >= Duration::from_secs(2) {
            eprintln!("{}", line(&t, bps));
            last_line = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `[#####.....]  42% 1.2GiB/2.9GiB 120 objects 85.0MiB/s ETA 20s`
fn line(t: &Totals, bps: Option<f64>) -> String {
    let frac = if t.owned == 0 {
        if t.listing_done {
            1.0
        } else {
            0.0
        }
    } else {
        (t.done() as f64 / t.owned as f64).min(1.0)
    };
    let width = 24;
    let filled = (frac * width as f64).round() as usize;
    let mut s = format!(
        "[{}{}] {:3.0}% {}/{}{} {} objects",
        "#".repeat(filled),
        ".".repeat(width - filled),
        frac * 100.0,
        ByteSize(t.done()).human(),
        ByteSize(t.owned).human(),
        if t.listing_done { "" } else { "+ (listing)" },
        t.objects,
    );
    if let Some(bps) = bps.filter(|b| *b > 0.0) {
        s.push_str(&format!(" {}/s", ByteSize(bps as u64).human()));
        if t.listing_done && t.owned > t.done() {
            s.push_str(&format!(" ETA {:.0}s", (t.owned - t.done()) as f64 / bps));
        }
    }
    if t.failed_objects > 0 {
        s.push_str(&format!(" {} failed", t.failed_objects));
    }
    if !t.unreachable.is_empty() {
        s.push_str(&format!(" (not answering: {})", t.unreachable.join(", ")));
    }
    s
}

fn print_failures(t: &Totals) {
    for f in &t.failures {
        eprintln!("  failed: {f}");
    }
}

/// Bytes per second over the last few seconds.
#[derive(Default)]
struct Rate {
    samples: std::collections::VecDeque<(Instant, u64)>,
}

impl Rate {
    fn update(&mut self, done: u64) -> Option<f64> {
        let now = Instant::now();
        self.samples.push_back((now, done));
        while self.samples.len() > 2
            && now.duration_since(self.samples[0].0) > Duration::from_secs(5)
        {
            self.samples.pop_front();
        }
        let (t0, d0) = *self.samples.front()?;
        let secs = now.duration_since(t0).as_secs_f64();
        (secs > 0.2).then(|| done.saturating_sub(d0) as f64 / secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_come_from_s3_uris() {
        let s = parse_spec("s3://data/shards/", Some("*.bin".into())).unwrap();
        assert_eq!((s.bucket.as_str(), s.prefix.as_str()), ("data", "shards/"));
        assert_eq!(parse_spec("s3://data", None).unwrap().prefix, "");
        assert!(parse_spec("data/x", None).is_err());
        assert!(parse_spec("s3://BAD_bucket/x", None).is_err());
        assert!(parse_spec("s3://data/x", Some(String::new())).is_err());
    }

    #[test]
    fn the_progress_line_shows_share_bytes_and_objects() {
        let t = Totals {
            objects: 3,
            owned: 100,
            fetched: 40,
            cached: 10,
            listing_done: true,
            ..Default::default()
        };
        let l = line(&t, Some(10.0));
        assert!(l.contains(" 50%"), "{l}");
        assert!(l.contains("3 objects") && l.contains("ETA 5s"), "{l}");
    }
}
