//! `lakecache`: one binary for the cache worker, the embedded S3 endpoint,
//! the single-node quick start and the client commands.

mod client_cmds;
mod cluster_args;
mod etcd_args;
mod free_cmd;
mod load_cmd;
mod mount_cmd;
mod mount_status;
mod ring_cmd;
mod s3_cmd;
mod sd_notify;
mod snapshot_cmd;
mod status_cmd;
mod sync_cmd;
mod token_cmd;
mod umount_cmd;
mod units;
mod up_cmd;
mod worker_cmd;
mod worker_config;
mod worker_ring;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "lakecache",
    version,
    about = "A distributed cache between GPU training clusters and S3 data lakes",
    long_about = "lakecache keeps S3 as the one source of truth and serves it from local \
                  NVMe pages. Run `lakecache up` to try it on one machine."
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. info or lakecache_worker=debug
    #[arg(long, global = true, env = "LAKECACHE_LOG", default_value = "info")]
    log: String,
    /// Export traces over OTLP/HTTP to this collector, e.g.
    /// http://127.0.0.1:4318 (spans go to /v1/traces); W3C traceparent
    /// links the mount's FUSE ops, the worker's requests and S3 calls
    #[arg(long, global = true, env = "LAKECACHE_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Fraction of new traces exported (a traced caller's decision is
    /// kept downstream); lower it on busy mounts
    #[arg(
        long,
        global = true,
        env = "LAKECACHE_OTLP_SAMPLE_RATIO",
        default_value_t = 1.0
    )]
    otlp_sample_ratio: f64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a cache worker in front of S3
    Worker(worker_cmd::WorkerCmd),
    /// Run the embedded S3-compatible endpoint (for tests, benches, trying out)
    S3Server(s3_cmd::S3ServerCmd),
    /// Start a single-node cluster: embedded S3 endpoint, bucket and worker
    Up(up_cmd::UpCmd),
    /// Write an object (or a byte range of it) to stdout through the cache
    Cat(client_cmds::CatCmd),
    /// Show an object's size, ETag and modification time through the cache
    Stat(client_cmds::StatCmd),
    /// Upload a file (or stdin) as an object through the cache
    Put(client_cmds::PutCmd),
    /// List objects and prefixes under s3://bucket/prefix through the cache
    Ls(client_cmds::LsCmd),
    /// Show cluster members, liveness, cache usage, hit ratio and write-back backlog
    Status(status_cmd::StatusCmd),
    /// Wait until everything written back under s3://bucket/prefix is in S3
    Sync(sync_cmd::SyncCmd),
    /// Print the owner of each of N keys (placement check across machines)
    Ring(ring_cmd::RingCmd),
    /// Signing keys and access tokens (keygen, create)
    Token(token_cmd::TokenCmd),
    /// Mount s3://bucket[/prefix] at a path through the cache (FUSE)
    Mount(mount_cmd::MountCmd),
    /// Unmount a mount; --abort ends one whose daemon is stuck
    Umount(umount_cmd::UmountCmd),
    /// Preload s3://bucket/prefix into the workers' caches, with progress
    Load(Box<load_cmd::LoadCmd>),
    /// Evict the cached pages under s3://bucket/prefix on every worker
    Free(free_cmd::FreeCmd),
    /// Dataset snapshots: a checked manifest of a prefix to pin mounts to
    Snapshot(snapshot_cmd::SnapshotCmd),
    /// Internal: started by `mount`; removes the mount if its client dies
    #[command(hide = true, name = "mount-guard")]
    MountGuard { mountpoint: std::path::PathBuf },
}

/// Logs to stderr by `--log`; with `--otlp-endpoint`, lakecache's own
/// spans (FUSE ops, worker requests, S3 calls) are exported as well.
fn init_tracing(cli: &Cli) -> Result<Option<lakecache_telemetry::trace::TraceExport>> {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|e| {
        eprintln!(
            "warning: invalid --log filter {:?} ({e}); using info",
            cli.log
        );
        tracing_subscriber::EnvFilter::new("info")
    });
    // Colours only on a terminal: a log file (`--daemon`, systemd, a
    // redirect) gets plain text that grep finds.
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let (otlp, export) = match (&cli.otlp_endpoint, &cli.command) {
        // The guard's job is to outlive the mount; it exports nothing.
        (Some(endpoint), cmd) if !matches!(cmd, Command::MountGuard { .. }) => {
            let (layer, export) = lakecache_telemetry::trace::otlp_layer(
                endpoint,
                service_name(cmd),
                cli.otlp_sample_ratio,
            )?;
            // Only lakecache's spans: never the exporter's own HTTP calls.
            let ours = Targets::new()
                .with_target("lakecache_fuse::adapter", LevelFilter::DEBUG)
                .with_target("lakecache", LevelFilter::INFO);
            lakecache_protocol::trace_context::set_source(
                lakecache_telemetry::trace::current_traceparent,
            );
            (Some(layer.with_filter(ours)), Some(export))
        }
        _ => (None, None),
    };
    tracing_subscriber::registry().with(fmt).with(otlp).init();
    Ok(export)
}

fn service_name(cmd: &Command) -> &'static str {
    match cmd {
        Command::Worker(_) => "lakecache-worker",
        Command::Mount(_) => "lakecache-mount",
        Command::S3Server(_) => "lakecache-s3",
        Command::Up(_) => "lakecache-up",
        _ => "lakecache-cli",
    }
}

fn main() {
    let cli = Cli::parse();
    let trace_export = match init_tracing(&cli) {
        Ok(export) => export,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    lakecache_protocol::memory::return_large_buffers_to_the_os();
    if let Command::MountGuard { mountpoint } = &cli.command {
        std::process::exit(lakecache_fuse::unmount_guard::run(mountpoint));
    }
    // Detach before any runtime threads exist.
    if let Command::Mount(cmd) = &cli.command {
        if cmd.wants_daemon() {
            if let Err(e) = cmd.daemonize() {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
            return;
        }
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result: Result<()> = runtime.block_on(async move {
        match cli.command {
            Command::Worker(cmd) => cmd.run().await,
            Command::S3Server(cmd) => cmd.run().await,
            Command::Up(cmd) => cmd.run().await,
            Command::Cat(cmd) => cmd.run().await,
            Command::Stat(cmd) => cmd.run().await,
            Command::Put(cmd) => cmd.run().await,
            Command::Ls(cmd) => cmd.run().await,
            Command::Status(cmd) => cmd.run().await,
            Command::Sync(cmd) => cmd.run().await,
            Command::Ring(cmd) => cmd.run().await,
            Command::Token(cmd) => cmd.run(),
            Command::Mount(cmd) => cmd.run().await,
            Command::Load(cmd) => cmd.run().await,
            Command::Free(cmd) => cmd.run().await,
            Command::Snapshot(cmd) => cmd.run().await,
            Command::Umount(cmd) => cmd.run(),
            // Ran and exited before the runtime started.
            Command::MountGuard { .. } => Ok(()),
        }
    });
    // Spans still queued go out before the process ends.
    drop(runtime);
    drop(trace_export);
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Resolves on Ctrl-C or SIGTERM.
/// How long a stopping worker keeps uploading its write-back backlog.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Uploads a stopping worker's write-back backlog (up to [`DRAIN_LIMIT`]
/// or a second signal); whatever is left stays journaled for the next start.
pub async fn drain_before_stop(worker: &lakecache_worker::RunningWorker) {
    let left = worker.drain_writeback(DRAIN_LIMIT, shutdown_signal()).await;
    if left.pending_objects > 0 {
        tracing::warn!(
            objects = left.pending_objects,
            bytes = left.pending_bytes,
            last_error = left.last_error.as_deref().unwrap_or(""),
            "stopping with write-back uploads pending; they stay staged and resume at the next start"
        );
    }
}

pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}
