use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_s3_endpoint::EndpointConfig;
use lakecache_worker::Metrics;

use crate::mount_cmd::FuseArgs;

/// What `up` writes back by default: checkpoints, where a stall idles GPUs.
const DEFAULT_WRITE_BACK_PREFIX: &str = "checkpoints/";
use crate::units::ByteSize;
use crate::worker_config::WorkerSettings;
use lakecache_fuse::local_tier::LocalTier;

#[derive(Args)]
pub struct UpCmd {
    /// Directory for the embedded S3 data and the cache
    #[arg(long, env = "LAKECACHE_UP_DIR", default_value = "./lakecache-data")]
    dir: PathBuf,
    /// Bucket to create
    #[arg(long, default_value = "lakecache")]
    bucket: String,
    /// Address of the embedded S3 endpoint
    #[arg(long, default_value = "127.0.0.1:9000")]
    s3_listen: SocketAddr,
    /// Address of the worker's HTTP API
    #[arg(long, default_value = "127.0.0.1:9500")]
    listen: SocketAddr,
    /// Disk space for cached pages, per worker
    #[arg(long, default_value = "10GiB")]
    cache_size: ByteSize,
    /// Workers to start (ports follow --listen: 9500, 9501, ...), sharing
    /// the cache through a static registry
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    workers: u16,
    /// Where to mount the bucket (FUSE)
    #[arg(long, default_value = "/mnt/data")]
    mount: PathBuf,
    /// Do not mount; serve S3 and the worker API only
    #[arg(long, conflicts_with = "mount")]
    no_mount: bool,
    /// Mount without the node-local tier (on by default for up, in
    /// <dir>/local-cache)
    #[arg(long, conflicts_with = "local_cache")]
    no_local_cache: bool,
    #[command(flatten)]
    fuse: FuseArgs,
}

impl UpCmd {
    pub async fn run(self) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let dir = self.dir.canonicalize().unwrap_or(self.dir.clone());
        if !self.listen.ip().is_loopback() {
            anyhow::bail!(
                "lakecache up serves plain HTTP and binds to loopback only (got --listen {}); for other addresses run `lakecache worker` with --tls-cert/--tls-key",
                self.listen
            );
        }
        let (keys_path, token_path, token) = self.credentials(&dir)?;
        let access_key = format!("LC{}", crate::s3_cmd::random_token(18).to_uppercase());
        let secret_key = crate::s3_cmd::random_token(40);
        let endpoint = lakecache_s3_endpoint::start(EndpointConfig {
            root: dir.join("s3"),
            listen: self.s3_listen,
            access_key: access_key.clone(),
            secret_key: secret_key.clone(),
            buckets: vec![self.bucket.clone()],
            list_without_etags: false,
        })
        .await
        .context("starting the embedded S3 endpoint")?;

        let mut workers = Vec::new();
        for i in 0..self.workers {
            let mut listen = self.listen;
            if listen.port() != 0 {
                listen.set_port(listen.port().saturating_add(i));
            }
            let cache_dir = if i == 0 {
                dir.join("cache")
            } else {
                dir.join(format!("cache-{i}"))
            };
            // The first worker serves this mount's short-circuit reads;
            // a directory too deep for a socket path only loses those.
            let socket = local_socket_of(&dir);
            let settings = WorkerSettings {
                listen: Some(listen),
                no_local_socket: Some(i > 0 || socket.is_none()),
                local_socket: socket.filter(|_| i == 0),
                cache_dir: Some(cache_dir),
                cache_size: Some(self.cache_size),
                s3_endpoint: Some(endpoint.url()),
                s3_path_style: Some(true),
                auth_keys: Some(keys_path.clone()),
                // Loopback only (checked above): nothing crosses a wire.
                insecure_http: Some(true),
                ..Default::default()
            };
            let (mut options, mut s3) = settings.resolve()?;
            // The ring is set once every worker is up.
            options.cache.writeback.await_ring = self.workers > 1;
            s3.static_credentials = Some((access_key.clone(), secret_key.clone()));
            let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
            let store = lakecache_worker::s3_store(&s3, metrics.clone()).await;
            match lakecache_worker::start_worker(options, store, metrics).await {
                Ok(w) => workers.push(w),
                Err(e) => {
                    for w in workers {
                        w.shutdown().await;
                    }
                    endpoint.shutdown().await;
                    return Err(e).with_context(|| format!("starting worker {i}"));
                }
            }
        }
        let addrs: Vec<String> = workers.iter().map(|w| w.addr().to_string()).collect();
        if workers.len() > 1 {
            let ring = lakecache_registry::ClusterClient::new(
                Arc::new(lakecache_registry::StaticMembership::new(&addrs)),
                lakecache_registry::ClusterOptions::default(),
                None,
            );
            for (w, addr) in workers.iter().zip(&addrs) {
                let placement = crate::worker_ring::RingPlacement::new(ring.clone(), addr.clone());
                w.cache().set_placement(Arc::new(placement));
            }
        }
        let first = addrs[0].clone();
        println!("lakecache is up (Ctrl-C to stop)");
        println!(
            "  S3 endpoint   {}  (path-style, region us-east-1)",
            endpoint.url()
        );
        // The secret goes to a private file, never to the terminal or logs.
        let creds_path = dir.join("s3-credentials");
        crate::token_cmd::write_private(
            &creds_path,
            &format!("AWS_ACCESS_KEY_ID={access_key}\nAWS_SECRET_ACCESS_KEY={secret_key}\n"),
        )?;
        println!(
            "  credentials   {}  (export $(cat {0}) for S3 tools)",
            creds_path.display()
        );
        println!("  bucket        s3://{}", self.bucket);
        for addr in &addrs {
            println!("  worker        http://{addr}  (metrics: http://{addr}/metrics)");
        }
        println!("  registry      static:{}", addrs.join(","));
        println!(
            "  token file    {}  (read/write s3://{}/; signing keys: {})",
            token_path.display(),
            self.bucket,
            keys_path.display()
        );
        println!("  data          {}", dir.display());
        let mut local_tier = None;
        let mut tier_routes = Vec::new();
        let mounted = if self.no_mount {
            None
        } else {
            match self.mount_bucket(&addrs, &token, &dir).await {
                Ok((m, tier, routes)) => {
                    local_tier = tier;
                    tier_routes = routes;
                    Some(m)
                }
                Err(e) => {
                    for w in workers {
                        w.shutdown().await;
                    }
                    endpoint.shutdown().await;
                    return Err(e.context("mounting (use --no-mount to run without FUSE)"));
                }
            }
        };
        let _mount_metrics = if mounted.is_some() {
            crate::mount_cmd::serve_mount_metrics(self.fuse.metrics_listen, tier_routes).await?
        } else {
            None
        };
        if let Some(m) = &mounted {
            println!(
                "  mount         {}  (s3://{})",
                m.mountpoint().display(),
                self.bucket
            );
            match &local_tier {
                Some(tier) => println!(
                    "  local cache   {}  ({} bytes; --no-local-cache to run without)",
                    tier.dir().display(),
                    tier.capacity()
                ),
                None => println!("  local cache   off"),
            }
            let back = &self.fuse.write_back_prefix;
            let mode = self.fuse.write_mode.unwrap_or_default();
            if mode == lakecache_protocol::WriteMode::Back {
                println!("  writes        back (close returns once durable in the cache; lakecache sync waits for S3)");
            } else if back.is_empty() && self.fuse.write_mode.is_none() {
                println!("  writes        {DEFAULT_WRITE_BACK_PREFIX} written back, the rest through to S3 (--write-mode, --write-back-prefix)");
            } else if !back.is_empty() {
                println!(
                    "  writes        {} written back, the rest through to S3",
                    back.join(", ")
                );
            } else {
                println!("  writes        through to S3");
            }
        }
        let token_flag = format!("--token-file {}", token_path.display());
        println!("try:");
        println!(
            "  echo hello | lakecache put s3://{}/hello.txt --registry static:{} {token_flag}",
            self.bucket,
            addrs.join(",")
        );
        println!(
            "  lakecache cat s3://{}/hello.txt --worker {first} {token_flag}",
            self.bucket
        );
        println!(
            "  lakecache status --registry static:{} {token_flag}",
            addrs.join(",")
        );
        println!(
            "  lakecache token create --keys {} --tenant team-a --allow s3://{}/datasets/ --ttl 30d   # more tokens",
            keys_path.display(),
            self.bucket
        );
        let mut mounted = mounted;
        match &mut mounted {
            Some(m) => {
                println!(
                    "  ls {}   # the bucket through the cache",
                    m.mountpoint().display()
                );
                tokio::select! {
                    () = crate::shutdown_signal() => {}
                    () = m.ended() => tracing::warn!("the mount was unmounted from outside"),
                }
            }
            None => crate::shutdown_signal().await,
        }
        println!("shutting down");
        if let Some(m) = mounted {
            if let Err(e) = m.unmount().await {
                eprintln!("warning: unmounting failed: {e}");
            }
        }
        crate::mount_cmd::flush_local_tier(&local_tier);
        // The embedded endpoint is S3 here: the backlog goes there first.
        for w in &workers {
            crate::drain_before_stop(w).await;
        }
        for w in workers {
            w.shutdown().await;
        }
        endpoint.shutdown().await;
        Ok(())
    }
}

impl UpCmd {
    /// The cluster's signing keys (kept across restarts, so tokens minted
    /// earlier stay valid) and a fresh read/write token for the bucket.
    fn credentials(&self, dir: &std::path::Path) -> Result<(PathBuf, PathBuf, String)> {
        use lakecache_protocol::token::{KeyRing, SigningKey};
        let keys_path = dir.join("keys");
        let keys = if keys_path.exists() {
            let text = std::fs::read_to_string(&keys_path)
                .with_context(|| format!("reading {}", keys_path.display()))?;
            KeyRing::parse(&text).with_context(|| format!("keys file {}", keys_path.display()))?
        } else {
            let id = format!("k{}", crate::s3_cmd::random_token(8));
            let keys = KeyRing::new(SigningKey::generate(&id), None);
            crate::token_cmd::write_private(&keys_path, &keys.to_file())?;
            keys
        };
        let scope = vec![format!("s3://{}/", self.bucket)];
        let token = crate::token_cmd::mint(
            &keys,
            "up",
            &scope,
            &scope,
            crate::units::Seconds(std::time::Duration::from_secs(30 * 86_400)),
            // Whoever runs `up` operates this cluster: `lakecache status`
            // with this token shows the whole write-back backlog.
            crate::token_cmd::Role::Operator,
        )?;
        let token_path = dir.join("token");
        crate::token_cmd::write_private(&token_path, &token)?;
        Ok((keys_path, token_path, token))
    }

    async fn mount_bucket(
        &self,
        workers: &[String],
        token: &str,
        dir: &std::path::Path,
    ) -> Result<(
        lakecache_fuse::Mounted,
        Option<Arc<LocalTier>>,
        lakecache_telemetry::JsonRoutes,
    )> {
        let membership = Arc::new(lakecache_registry::StaticMembership::new(workers));
        let cluster = lakecache_registry::ClusterClient::new(
            membership,
            lakecache_registry::ClusterOptions {
                token: Some(token.to_string()),
                local_socket: local_socket_of(dir),
                ..Default::default()
            },
            None,
        );
        let mut config = self.fuse.fs_config(&self.bucket, "")?;
        // Checkpoints are written back unless the user chose otherwise.
        if self.fuse.write_mode.is_none() && self.fuse.write_back_prefix.is_empty() {
            config
                .write_back_prefixes
                .push(DEFAULT_WRITE_BACK_PREFIX.into());
        }
        config.write_scopes = Some(vec![format!("s3://{}/", self.bucket)]);
        let mut fs = lakecache_fuse::Fs::new(cluster, config);
        let default_tier = dir.join("local-cache");
        let tier = if self.no_local_cache {
            anyhow::ensure!(
                self.fuse.local_cache_whole.is_empty(),
                "--local-cache-whole needs the node-local tier: drop --no-local-cache"
            );
            None
        } else {
            self.fuse.local_tier(Some(&default_tier))?
        };
        fs = match &tier {
            Some(tier) => fs.with_local_tier(tier.clone()),
            None => fs.with_client_plans(),
        };
        let routes = crate::mount_cmd::start_local_tier(&fs);
        let fs = Arc::new(fs);
        let mounted = lakecache_fuse::mount(
            fs,
            tokio::runtime::Handle::current(),
            &self.fuse.mount_options(&self.mount),
        )?;
        Ok((mounted, tier, routes))
    }
}

/// The first worker's local socket under `up`'s directory, when its path
/// fits a Unix socket address.
fn local_socket_of(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    let path = dir
        .join("cache")
        .join(crate::worker_config::LOCAL_SOCKET_NAME);
    (path.as_os_str().len() <= 107).then_some(path)
}
