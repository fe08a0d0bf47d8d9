//! `lakecache mount s3://bucket[/prefix] PATH`: the FUSE client.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use lakecache_fuse::{Fs, FsConfig, MountOptions};
use lakecache_protocol::{validate_bucket, validate_key};
use lakecache_registry::ClusterClient;

use crate::cluster_args::ClusterArgs;
use crate::units::ByteSize;

/// Set in the detached child of `--daemon`.
const DAEMON_CHILD_ENV: &str = "LAKECACHE_MOUNT_DAEMON_CHILD";

#[derive(Args, Clone)]
pub struct FuseArgs {
    /// Let other users access the mount (non-root mounts need
    /// `user_allow_other` in /etc/fuse.conf)
    #[arg(long)]
    pub allow_other: bool,
    /// Mount read-only
    #[arg(long)]
    pub read_only: bool,
    /// Seconds the kernel and the client trust file attributes
    #[arg(long, default_value_t = 60)]
    pub attr_ttl: u64,
    /// Seconds the kernel and the client trust names (and their absence)
    #[arg(long, default_value_t = 60)]
    pub entry_ttl: u64,
    /// Largest read-ahead window per open file
    #[arg(long, default_value = "64MiB")]
    pub readahead_max: ByteSize,
    /// Size of one read-ahead request
    #[arg(long, default_value = "8MiB")]
    pub readahead_chunk: ByteSize,
    /// Memory for read-ahead and queued upload data of all open files
    /// together; read-ahead backs off and writers wait beyond it
    /// [default: 1/8 of RAM, at most 4GiB]
    #[arg(long, env = "LAKECACHE_MEMORY_LIMIT")]
    pub memory_limit: Option<ByteSize>,
    /// Where files changed in place are copied until uploaded, and where
    /// a write beyond --memory-limit is kept until acknowledged (so a
    /// stalled write of any size can be sent to another worker); anonymous
    /// files, gone when closed [default: $TMPDIR/lakecache-spool]
    #[arg(long, env = "LAKECACHE_SPOOL_DIR")]
    pub spool_dir: Option<std::path::PathBuf>,
    /// Write-back files that the worker on this host (--local-worker-socket)
    /// owns are written by the kernel into a staged file in --spool-dir
    /// (FUSE passthrough) and committed by that worker from it at
    /// flush/fsync/close; false streams every write through the mount
    #[arg(long, env = "LAKECACHE_STAGED_WRITES",
          value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
          default_missing_value = "true", default_value = "true")]
    pub staged_writes: bool,
    /// A write whose worker takes no byte for this long (while bytes wait
    /// for it), or stays silent this long after the last byte, fails with
    /// EIO instead of hanging the writer as long as the worker hangs
    /// (1s to 1h)
    #[arg(long, env = "LAKECACHE_WRITE_PROGRESS_TIMEOUT", default_value = "10s")]
    pub write_progress_timeout: crate::units::Seconds,
    /// Owner shown for objects that carry none in their metadata
    /// [default: the mounting user]
    #[arg(long)]
    pub uid: Option<u32>,
    /// Group shown for objects that carry none [default: the mounting
    /// user's group]
    #[arg(long)]
    pub gid: Option<u32>,
    /// Permission bits of files that carry none, octal
    #[arg(long, default_value = "644", value_parser = parse_mode)]
    pub file_mode: u16,
    /// Permission bits of directories that carry none, octal
    #[arg(long, default_value = "755", value_parser = parse_mode)]
    pub dir_mode: u16,
    /// Read each object's mode, owner, times and type (symlinks, FIFOs,
    /// devices) from its S3 metadata, one HEAD per object the first time
    /// it is listed; `false`: listings alone, every object shows the
    /// defaults above (a faster `ls -l` of huge read-only datasets)
    #[arg(long, env = "LAKECACHE_POSIX_METADATA", default_value_t = true, action = clap::ArgAction::Set)]
    pub posix_metadata: bool,
    /// Largest file `truncate` to a non-zero size rewrites (it rewrites
    /// the object whole); larger ones get EOPNOTSUPP
    #[arg(long, default_value = "1GiB")]
    pub truncate_rewrite_max: ByteSize,
    /// Threads reading kernel requests
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub fuse_threads: u16,
    /// Keep whole objects on this node's disk as they are read (the
    /// node-local tier): a second read of a file is served from here
    #[arg(long, env = "LAKECACHE_LOCAL_CACHE")]
    pub local_cache: Option<PathBuf>,
    /// Disk space of the node-local tier
    #[arg(long, env = "LAKECACHE_LOCAL_CACHE_SIZE", default_value = "20GiB")]
    pub local_cache_size: ByteSize,
    /// Complete objects under this directory of the mount in the
    /// node-local tier as soon as they are opened, whatever the read
    /// pattern (e.g. shards/ read by a shuffling loader); elsewhere an
    /// object is completed once a reader reads 8 MiB of it in order
    /// (repeat for several; comma-separated in the environment)
    #[arg(long, env = "LAKECACHE_LOCAL_CACHE_WHOLE", value_delimiter = ',')]
    pub local_cache_whole: Vec<String>,
    /// Bytes of a published plan's next objects (a Python client's
    /// `publish_plan` with `local_cache`) fetched whole into the node-local
    /// tier ahead of its reader: about 2 s at the reader's pace, within
    /// this (all plans together, at most a quarter of --local-cache-size);
    /// 0 turns it off
    #[arg(
        long,
        env = "LAKECACHE_LOCAL_CACHE_PLAN_PREFETCH",
        default_value = "512MiB"
    )]
    pub local_cache_plan_prefetch: ByteSize,
    /// For a mount without --local-cache: bytes of a published plan's
    /// next samples held in this mount's memory ahead of its reader
    /// (about 2 s at the reader's pace, within this, all plans together,
    /// and at most a quarter of --memory-limit), so a loader's reads, an
    /// epoch's first batches above all, are answered from memory. An
    /// epoch's start asks for num_workers x batch size x prefetch_factor
    /// samples at once; 0 turns it off
    #[arg(long, env = "LAKECACHE_PLAN_MEMORY", default_value = "32MiB")]
    pub plan_memory: ByteSize,
    /// Directory for the socket other processes on this node (the Python
    /// client) publish plans and read through, for a mount without
    /// --local-cache (with one, the socket is in that directory)
    #[arg(long, env = "LAKECACHE_CLIENT_SOCKET_DIR")]
    pub client_socket_dir: Option<PathBuf>,
    /// A reader that jumps around an object of at most this size (3
    /// random reads in one open) gets the whole object fetched in the
    /// background: into the node-local tier when there is one (clamped to
    /// --local-cache-size), else into the workers' caches; its later
    /// reads skip the round trip to S3. 0 turns it off (each read fetches
    /// what it asks)
    #[arg(long, env = "LAKECACHE_RANDOM_WHOLE_MAX", default_value = "2GiB")]
    pub random_whole_max: ByteSize,
    /// Do not push a random reader's whole-fetched object into the
    /// kernel's page cache as it arrives (its reads then each ask the
    /// mount, which serves them from the node-local tier)
    #[arg(long, env = "LAKECACHE_NO_PAGE_CACHE_PUSH")]
    pub no_page_cache_push: bool,
    /// A reader that opens a directory's files one after another (in
    /// listing order, or numbered names in number order) gets the next
    /// files fetched whole before it opens them, up to this many bytes
    /// ahead (files up to 8 MiB; held in --memory-limit, clamped to half of
    /// it); 0 turns it off
    #[arg(long, env = "LAKECACHE_DIR_PREFETCH_WINDOW", default_value = "64MiB")]
    pub dir_prefetch_window: ByteSize,
    /// How files are written: `through` (close returns once S3 has the
    /// file) or `back` (close returns once the file is durable in the
    /// cache; S3 gets it in the background, in close order)
    /// [default: through; `up`: through, with checkpoints/ written back]
    #[arg(long, env = "LAKECACHE_WRITE_MODE")]
    pub write_mode: Option<lakecache_protocol::WriteMode>,
    /// Write files under this directory of the mount back, whatever
    /// --write-mode says (repeat for several; comma-separated in the
    /// environment), e.g. checkpoints/
    #[arg(long, env = "LAKECACHE_WRITE_BACK_PREFIXES", value_delimiter = ',')]
    pub write_back_prefix: Vec<String>,
    /// Serve the mount's Prometheus metrics (/metrics) and its operations
    /// in flight (/v1/inflight, JSON) and its local tier (/v1/local-tier,
    /// JSON; `lakecache status --mount ADDR`) on this address, e.g.
    /// 127.0.0.1:9501. Unauthenticated: bind loopback or a private network
    #[arg(long, env = "LAKECACHE_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

fn parse_mode(s: &str) -> Result<u16, String> {
    u16::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{s:?} is not an octal mode like 644"))
}

impl FuseArgs {
    pub fn fs_config(&self, bucket: &str, prefix: &str) -> Result<FsConfig> {
        let mut config = FsConfig::new(bucket, prefix);
        config.attr_ttl = Duration::from_secs(self.attr_ttl);
        config.entry_ttl = Duration::from_secs(self.entry_ttl);
        config.readahead_max = self.readahead_max.0;
        config.readahead_chunk = self.readahead_chunk.0;
        if config.readahead_chunk == 0 || config.readahead_max < config.readahead_chunk {
            bail!("--readahead-chunk must be non-zero and at most --readahead-max");
        }
        if let Some(limit) = self.memory_limit {
            if limit.0 < 16 << 20 {
                bail!(
                    "--memory-limit must be at least 16MiB, got {} bytes",
                    limit.0
                );
            }
            config.memory_limit = limit.0;
        }
        if let Some(dir) = &self.spool_dir {
            if !dir.is_absolute() {
                bail!(
                    "--spool-dir must be an absolute path, got {}",
                    dir.display()
                );
            }
            config.spool_dir = dir.clone();
        }
        config.staged_writes = self.staged_writes;
        lakecache_protocol::buffer_pool::limit_idle_to_share_of(config.memory_limit);
        if let Some(uid) = self.uid {
            config.uid = uid;
        }
        if let Some(gid) = self.gid {
            config.gid = gid;
        }
        config.file_mode = self.file_mode;
        config.dir_mode = self.dir_mode;
        config.posix_metadata = self.posix_metadata;
        config.truncate_rewrite_max = self.truncate_rewrite_max.0;
        let progress = self.write_progress_timeout.0;
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&progress) {
            bail!("--write-progress-timeout must be 1s to 1h, got {progress:?}");
        }
        config.write_progress_timeout = progress;
        config.random_whole_max = self.random_whole_max.0;
        config.push_page_cache = !self.no_page_cache_push;
        // Read-ahead and queued uploads share the budget.
        config.dir_prefetch_window = self.dir_prefetch_window.0.min(config.memory_limit / 2);
        if config.dir_prefetch_window < self.dir_prefetch_window.0 {
            tracing::info!(
                bytes = config.dir_prefetch_window,
                "--dir-prefetch-window clamped to half of --memory-limit"
            );
        }
        config.write_mode = self.write_mode.unwrap_or_default();
        for p in &self.write_back_prefix {
            let dir = mount_dir("--write-back-prefix", p, "checkpoints/")?;
            config
                .write_back_prefixes
                .push(format!("{}{dir}", config.prefix));
        }
        config.tier_plan_prefetch = self.local_cache_plan_prefetch.0;
        config.plan_memory = self.plan_memory.0.min(config.memory_limit / 4);
        if let Some(dir) = &self.client_socket_dir {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating --client-socket-dir {}", dir.display()))?;
            config.client_socket_dir = Some(dir.clone());
        }
        for p in &self.local_cache_whole {
            let dir = mount_dir("--local-cache-whole", p, "shards/")?;
            config
                .tier_whole_prefixes
                .push(format!("{}{dir}", config.prefix));
        }
        Ok(config)
    }

    /// Opens the node-local tier when one is configured, or at `default`.
    pub fn local_tier(
        &self,
        default: Option<&Path>,
    ) -> Result<Option<Arc<lakecache_fuse::local_tier::LocalTier>>> {
        let Some(dir) = self.local_cache.as_deref().or(default) else {
            anyhow::ensure!(
                self.local_cache_whole.is_empty(),
                "--local-cache-whole needs a node-local tier: add --local-cache DIR"
            );
            return Ok(None);
        };
        anyhow::ensure!(
            self.local_cache_size.0 >= 16 << 20,
            "--local-cache-size must be at least 16MiB"
        );
        let tier = lakecache_fuse::local_tier::LocalTier::open(dir, self.local_cache_size.0)
            .with_context(|| format!("opening the local cache {}", dir.display()))?;
        tracing::info!(dir = %dir.display(), bytes = self.local_cache_size.0, held = tier.used(), "node-local tier");
        Ok(Some(Arc::new(tier)))
    }

    pub fn mount_options(&self, mountpoint: &Path) -> MountOptions {
        MountOptions {
            mountpoint: mountpoint.to_path_buf(),
            allow_other: self.allow_other,
            read_only: self.read_only,
            threads: self.fuse_threads as usize,
            unmount_guard: std::env::current_exe().ok(),
        }
    }
}

#[derive(Args, Clone)]
pub struct MountCmd {
    /// What to mount: s3://bucket or s3://bucket/prefix
    source: String,
    /// Where to mount it (created if missing)
    mountpoint: PathBuf,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    fuse: FuseArgs,
    /// Pin the mount to a snapshot manifest (`lakecache snapshot create`):
    /// read-only, exactly the objects it lists, each read at its recorded
    /// ETag; an object changed since fails with both ETags named
    #[arg(long, env = "LAKECACHE_SNAPSHOT")]
    snapshot: Option<String>,
    /// Detach: return once the mount is ready, keep serving in the background
    #[arg(long)]
    daemon: bool,
    /// Log file of the detached process [default: /tmp/lakecache-mount-PID.log]
    #[arg(long)]
    log_file: Option<PathBuf>,
}

/// Splits `s3://bucket[/prefix]`; the prefix comes back with a trailing `/`.
pub fn parse_source(source: &str) -> Result<(String, String)> {
    let rest = source
        .strip_prefix("s3://")
        .with_context(|| format!("{source:?}: expected s3://bucket or s3://bucket/prefix"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    validate_bucket(bucket).with_context(|| format!("bucket in {source:?}"))?;
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return Ok((bucket.to_string(), String::new()));
    }
    let prefix = format!("{prefix}/");
    validate_key(&prefix).with_context(|| format!("prefix in {source:?}"))?;
    Ok((bucket.to_string(), prefix))
}

impl MountCmd {
    pub fn wants_daemon(&self) -> bool {
        self.daemon && std::env::var_os(DAEMON_CHILD_ENV).is_none()
    }

    pub async fn run(self) -> Result<()> {
        let (bucket, prefix) = parse_source(&self.source)?;
        let mut config = self.fuse.fs_config(&bucket, &prefix)?;
        if let Some(token) = self.cluster.token()? {
            // Writes the token cannot make fail at open, not at close.
            let claims = lakecache_protocol::token::peek_claims(&token)
                .context("--token-file does not hold a lakecache token")?;
            config.write_scopes = Some(claims.write);
        }
        let cluster = self.cluster.connect().await?;
        check_bucket(&cluster, &bucket, &prefix).await?;
        if config.writes_back_any() {
            tokio::spawn(warn_of_workers_without_ring(cluster.clone()));
        }
        let data: Arc<dyn lakecache_fuse::DataPlane> = match &self.snapshot {
            None => cluster,
            Some(manifest) => {
                let snap = crate::snapshot_cmd::load(&cluster, manifest).await?;
                if snap.bucket != bucket {
                    bail!(
                        "snapshot {manifest} is of s3://{}/{}; it cannot back a mount of {}",
                        snap.bucket,
                        snap.prefix,
                        self.source
                    );
                }
                tracing::info!(%manifest, objects = snap.objects.len(), checksum = %snap.checksum, "mount pinned to snapshot");
                Arc::new(lakecache_fuse::data_plane::SnapshotDataPlane::new(
                    cluster, snap,
                ))
            }
        };
        let mut fs = Fs::new(data, config);
        fs = match self.fuse.local_tier(None)? {
            Some(tier) => fs.with_local_tier(tier),
            None => fs.with_client_plans(),
        };
        let mut options = self.fuse.mount_options(&self.mountpoint);
        options.read_only |= self.snapshot.is_some();
        serve(Arc::new(fs), &options, self.fuse.metrics_listen).await
    }

    /// Starts this command again, detached, and returns once the mount
    /// is up (or the child failed).
    pub fn daemonize(&self) -> Result<()> {
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe().context("finding the lakecache binary")?;
        let log = self.log_file.clone().unwrap_or_else(|| {
            PathBuf::from(format!("/tmp/lakecache-mount-{}.log", std::process::id()))
        });
        let out = std::fs::File::create(&log)
            .with_context(|| format!("creating the log file {}", log.display()))?;
        let err = out.try_clone().context("duplicating the log file")?;
        let args: Vec<std::ffi::OsString> = std::env::args_os()
            .skip(1)
            .filter(|a| a != "--daemon")
            .collect();
        let mut command = std::process::Command::new(exe);
        command
            .args(args)
            .env(DAEMON_CHILD_ENV, "1")
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err);
        // SAFETY: setsid is async-signal-safe; it detaches the child from
        // the terminal's session so a closing shell does not kill it.
        unsafe {
            command.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = command.spawn().context("starting the mount process")?;
        let mountpoint = self
            .mountpoint
            .canonicalize()
            .unwrap_or_else(|_| self.mountpoint.clone());
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().context("waiting for the mount process")? {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                bail!(
                    "the mount process exited ({status}); its log ({}):\n{}",
                    log.display(),
                    tail.trim_end()
                );
            }
            let path = mountpoint
                .canonicalize()
                .unwrap_or_else(|_| mountpoint.clone());
            if lakecache_fuse::mount::is_mounted(&path) {
                println!(
                    "mounted {} at {} (pid {}, log {})",
                    self.source,
                    path.display(),
                    child.id(),
                    log.display()
                );
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        bail!(
            "the mount did not appear within 60 s; see {}",
            log.display()
        )
    }
}

/// Write-back versions of one file taken by different workers (the owner
/// was slow, so the next worker took the newer one) reach S3 in order only
/// when the workers know their ring. Says so at start when some do not;
/// the mount serves either way.
async fn warn_of_workers_without_ring(cluster: Arc<ClusterClient>) {
    let members = cluster.member_clients();
    if members.len() < 2 {
        return;
    }
    let total = members.len();
    let mut in_ring = 0;
    for (member, client) in members {
        match client.health().await {
            Ok(h) => match h.ring_workers {
                None => tracing::warn!(
                    worker = %member.address,
                    "this worker knows no ring (started without --registry): versions of one file \
                     written back through different workers may reach S3 out of order; start every \
                     worker with the same --registry as the mount"
                ),
                Some(n) if n != total as u64 => tracing::warn!(
                    worker = %member.address,
                    worker_sees = n,
                    mount_sees = total,
                    "this worker's ring differs from the mount's: give workers and mounts the same --registry"
                ),
                Some(_) => in_ring += 1,
            },
            Err(e) => {
                tracing::info!(worker = %member.address, error = %e, "ring check skipped: the worker did not answer")
            }
        }
    }
    if in_ring == total {
        tracing::info!(
            workers = total,
            "every worker knows the mount's ring: write-backs reach S3 in order"
        );
    }
}

/// Fails early, with the reason, when the bucket cannot be listed.
pub async fn check_bucket(cluster: &ClusterClient, bucket: &str, prefix: &str) -> Result<()> {
    cluster
        .list(bucket, prefix, Some("/"), None, Some(1))
        .await
        .with_context(|| format!("listing s3://{bucket}/{prefix} through the cache"))?;
    Ok(())
}

/// A directory inside the mount given to `flag`, as a key suffix ending
/// in `/` (`example` shows the form in the error).
fn mount_dir(flag: &str, p: &str, example: &str) -> Result<String> {
    let p = p.trim_start_matches('/');
    if p.is_empty() || p.split('/').any(|c| c == "..") {
        bail!("{flag} {p:?} must name a directory inside the mount, like {example}");
    }
    Ok(if p.ends_with('/') {
        p.to_string()
    } else {
        format!("{p}/")
    })
}

/// Starts the mount's metrics listener when an address was given, with
/// `routes` (the local tier's view) beside /metrics and /v1/inflight.
pub async fn serve_mount_metrics(
    addr: Option<std::net::SocketAddr>,
    routes: lakecache_telemetry::JsonRoutes,
) -> Result<Option<lakecache_telemetry::MetricsListener>> {
    let Some(addr) = addr else { return Ok(None) };
    let m = lakecache_fuse::metrics::global();
    let listener = lakecache_telemetry::serve_metrics(
        addr,
        m.registry.clone(),
        Some(m.inflight.clone()),
        routes,
    )
    .await
    .with_context(|| format!("listening for mount metrics on {addr}"))?;
    println!(
        "mount metrics at http://{0}/metrics, operations in flight at http://{0}/v1/inflight, \
         local tier at http://{0}{1} (lakecache status --mount {0})",
        listener.addr, LOCAL_TIER_PATH
    );
    Ok(Some(listener))
}

/// Where the mount's listener serves the local tier, object by object.
pub const LOCAL_TIER_PATH: &str = "/v1/local-tier";
/// Where it serves the settings that bound its writes.
pub const SETTINGS_PATH: &str = "/v1/settings";

/// The settings `lakecache status --mount` shows.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct MountSettings {
    pub write_mode: lakecache_protocol::WriteMode,
    pub write_progress_timeout_ms: u64,
    pub upload_timeout_ms: u64,
    pub memory_limit_bytes: u64,
    #[serde(default)]
    pub spool_dir: String,
    #[serde(default)]
    pub staged_writes: bool,
}

/// Exports the local tier's metrics and goes on completing what a
/// previous mount's readers wanted whole (on the runtime); returns the
/// tier's view for the mount's listener.
pub fn start_local_tier(fs: &Fs) -> lakecache_telemetry::JsonRoutes {
    let mut routes = lakecache_telemetry::JsonRoutes::new();
    let config = fs.config();
    let settings = serde_json::to_value(MountSettings {
        write_mode: config.write_mode,
        write_progress_timeout_ms: config.write_progress_timeout.as_millis() as u64,
        upload_timeout_ms: config.upload_timeout.as_millis() as u64,
        memory_limit_bytes: config.memory_limit,
        spool_dir: config.spool_dir.display().to_string(),
        staged_writes: config.staged_writes,
    })
    .unwrap_or_else(|e| serde_json::json!({ "error": format!("mount settings: {e}") }));
    routes.push((SETTINGS_PATH, Arc::new(move || settings.clone())));
    if let (Some(tier), Some(completer)) = (fs.local_tier(), fs.completer()) {
        lakecache_fuse::metrics::global().observe_local_tier(
            tier.clone(),
            completer.clone(),
            fs.kernel_cache().clone(),
        );
        let (tier, completer) = (tier.clone(), completer.clone());
        let view: lakecache_telemetry::JsonView = Arc::new(move || {
            serde_json::to_value(tier.report(Some(&completer))).unwrap_or_else(
                |e| serde_json::json!({ "error": format!("local tier report: {e}") }),
            )
        });
        routes.push((LOCAL_TIER_PATH, view));
    }
    fs.resume_completion();
    routes
}

/// Mounts and serves until SIGINT/SIGTERM or an external unmount.
pub async fn serve(
    fs: Arc<Fs>,
    options: &MountOptions,
    metrics_listen: Option<std::net::SocketAddr>,
) -> Result<()> {
    let fs_tier = fs.local_tier().cloned();
    let routes = start_local_tier(&fs);
    let _metrics = serve_mount_metrics(metrics_listen, routes).await?;
    let mut mounted = lakecache_fuse::mount(fs, tokio::runtime::Handle::current(), options)
        .context("mounting (needs /dev/fuse and fusermount3 from the fuse3 package)")?;
    println!(
        "mounted at {} (Ctrl-C or SIGTERM unmounts)",
        mounted.mountpoint().display()
    );
    crate::sd_notify::notify("READY=1\nSTATUS=mounted");
    tokio::select! {
        () = crate::shutdown_signal() => {
            tracing::info!("signal received; unmounting");
        }
        () = mounted.ended() => {
            tracing::info!("unmounted from outside");
        }
    }
    crate::sd_notify::notify("STOPPING=1");
    mounted.unmount().await.context("unmounting")?;
    flush_local_tier(&fs_tier);
    Ok(())
}

/// Records partially filled objects so a remount keeps their blocks.
pub fn flush_local_tier(tier: &Option<Arc<lakecache_fuse::local_tier::LocalTier>>) {
    if let Some(tier) = tier {
        if let Err(e) = tier.flush() {
            tracing::warn!(error = %e, "recording the local tier's partial objects failed");
        }
        let stats = tier.fill_stats();
        tracing::info!(
            filled_bytes = stats
                .filled_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
            skipped_bytes = stats
                .dropped_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
            "local tier fills (skipped: the fill thread was behind)"
        );
    }
}
