//! How client commands find workers: `--registry` or a single `--worker`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_protocol::member_sig::MemberTrust;
use lakecache_registry::{ClusterClient, ClusterOptions, RegistryUrl, RingOptions};
use lakecache_worker::store::ObjectStore;
use lakecache_worker::{Metrics, S3Config};

use crate::units::{ByteSize, Seconds};

/// Where a worker with the default cache directory serves local reads.
pub const DEFAULT_LOCAL_WORKER_SOCKET: &str = "/var/cache/lakecache/local.sock";

#[derive(Args, Clone)]
pub struct ClusterArgs {
    /// Cluster membership: etcd://HOST:PORT[/prefix], static:ADDR,ADDR or
    /// file:/path (one ADDR per line, reloaded on change)
    #[arg(long, env = "LAKECACHE_REGISTRY")]
    pub registry: Option<RegistryUrl>,
    /// A single worker (HOST:PORT), used when --registry is not given
    #[arg(long, env = "LAKECACHE_WORKER", default_value = "127.0.0.1:9500")]
    pub worker: String,
    /// Timeout of whole uploads and copies towards a worker, in seconds
    /// [default: 60]; for `sync`, how long to wait for S3 [default: 3600]
    #[arg(long)]
    pub timeout: Option<u64>,
    /// A worker that sends nothing for this long during a read, stat or
    /// listing is skipped for the next replica or S3 (a hung worker costs
    /// this much), e.g. 2s or 500ms
    #[arg(long, env = "LAKECACHE_PROGRESS_TIMEOUT", default_value = "2s")]
    pub progress_timeout: Seconds,
    /// TCP connect timeout towards a worker, e.g. 500ms
    #[arg(long, env = "LAKECACHE_CONNECT_TIMEOUT", default_value = "500ms")]
    pub connect_timeout: Seconds,
    /// Placement segment size; must match the cluster's [default: 64MiB]
    #[arg(long, env = "LAKECACHE_SEGMENT_SIZE")]
    pub segment_size: Option<ByteSize>,
    /// Virtual nodes per worker; must match the cluster [default: 512]
    #[arg(long, env = "LAKECACHE_VNODES")]
    pub vnodes: Option<u32>,
    /// File holding the access token sent to workers that require one
    /// (`lakecache token create`)
    #[arg(long, env = "LAKECACHE_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// PEM CA that signs the workers' certificates: workers are then
    /// spoken to over HTTPS (plain HTTP is refused)
    #[arg(long, env = "LAKECACHE_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for workers that require one (mutual TLS)
    #[arg(long, env = "LAKECACHE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Private key of --tls-cert
    #[arg(long, env = "LAKECACHE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Local socket of a worker on this host (its CACHE_DIR/local.sock):
    /// that worker's cached pages are read from its page files, with no
    /// HTTP, TLS or copy through it [default: /var/cache/lakecache/local.sock
    /// when it exists]
    #[arg(long, env = "LAKECACHE_LOCAL_WORKER_SOCKET")]
    pub local_worker_socket: Option<std::path::PathBuf>,
    /// Read every byte over HTTP, even from a worker on this host (wins
    /// over --local-worker-socket)
    #[arg(long, env = "LAKECACHE_NO_LOCAL_READS",
          value_parser = clap::builder::BoolishValueParser::new(), num_args = 0..=1,
          default_missing_value = "true", default_value = "false")]
    pub no_local_reads: bool,
    #[command(flatten)]
    pub etcd: crate::etcd_args::EtcdArgs,
    /// Do not read straight from S3 when no worker can answer
    #[arg(long)]
    pub no_s3_fallback: bool,
    /// S3 endpoint for the fallback (default: AWS)
    #[arg(long, env = "LAKECACHE_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// S3 region for the fallback
    #[arg(long, env = "LAKECACHE_S3_REGION", default_value = "us-east-1")]
    pub s3_region: String,
    /// Path-style S3 addressing for the fallback
    #[arg(long, env = "LAKECACHE_S3_PATH_STYLE", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub s3_path_style: bool,
}

impl ClusterArgs {
    /// The registry, with etcd credentials and member trust: a client
    /// with a token believes only worker records signed by the key that
    /// signed its token.
    pub fn registry(&self) -> Result<RegistryUrl> {
        match &self.registry {
            Some(r @ RegistryUrl::Etcd { .. }) => {
                let trust = match self.token()? {
                    Some(token) => MemberTrust::from_token(&token).with_context(|| {
                        "the --token-file token carries no members key: mint it again with `lakecache token create`"
                    })?,
                    None => MemberTrust::AnyRecord,
                };
                Ok(r.clone().with_etcd_access(self.etcd.access(trust)?))
            }
            Some(r) => Ok(r.clone()),
            None => format!("static:{}", self.worker)
                .parse()
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("--worker {:?}", self.worker)),
        }
    }

    /// The token from --token-file, if given.
    pub fn token(&self) -> Result<Option<String>> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --token-file {}", path.display()))?;
        let token = text.trim().to_string();
        anyhow::ensure!(
            !token.is_empty(),
            "--token-file {} is empty",
            path.display()
        );
        Ok(Some(token))
    }

    /// HTTPS settings from --tls-ca and --tls-cert/--tls-key.
    pub fn tls(&self) -> Result<Option<lakecache_protocol::tls::ClientTls>> {
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(lakecache_protocol::tls::Identity {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        };
        match &self.tls_ca {
            None if identity.is_some() => {
                anyhow::bail!("--tls-cert needs --tls-ca (the CA of the workers' certificates)")
            }
            None => Ok(None),
            Some(ca) => Ok(Some(lakecache_protocol::tls::ClientTls::load(
                ca,
                identity.as_ref(),
            )?)),
        }
    }

    pub fn options(&self) -> ClusterOptions {
        ClusterOptions {
            ring: RingOptions {
                segment_size: self
                    .segment_size
                    .map_or(lakecache_registry::DEFAULT_SEGMENT_SIZE, |s| s.0),
                vnodes: self.vnodes.unwrap_or(lakecache_registry::DEFAULT_VNODES),
                ..RingOptions::default()
            },
            timeout: Duration::from_secs(self.timeout.unwrap_or(60)),
            progress_timeout: self.progress_timeout.0,
            connect_timeout: self.connect_timeout.0,
            s3_fallback: !self.no_s3_fallback,
            local_socket: self.local_socket(),
            ..ClusterOptions::default()
        }
    }

    fn local_socket(&self) -> Option<std::path::PathBuf> {
        if self.no_local_reads {
            return None;
        }
        if let Some(p) = &self.local_worker_socket {
            return Some(p.clone());
        }
        let default = std::path::Path::new(DEFAULT_LOCAL_WORKER_SOCKET);
        default.exists().then(|| default.to_path_buf())
    }

    /// The options, with the ring settings the cluster's first worker
    /// recorded in an etcd registry; flags that contradict them are an
    /// error, since every client must place data as the workers do.
    async fn ring_from(&self, registry: &RegistryUrl) -> Result<ClusterOptions> {
        let mut options = self.options();
        options.token = self.token()?;
        options.tls = self.tls()?;
        let Some(recorded) = registry
            .advertised_ring(Duration::from_secs(5))
            .await
            .context("reading the cluster's ring settings")?
        else {
            return Ok(options);
        };
        if let Some(s) = self.segment_size.filter(|s| s.0 != recorded.segment_size) {
            anyhow::bail!(
                "--segment-size {} differs from the cluster's {} bytes recorded in the registry; leave it out",
                s.0,
                recorded.segment_size
            );
        }
        if let Some(v) = self.vnodes.filter(|v| *v != recorded.vnodes) {
            anyhow::bail!(
                "--vnodes {v} differs from the cluster's {} recorded in the registry; leave it out",
                recorded.vnodes
            );
        }
        options.ring.segment_size = recorded.segment_size;
        options.ring.vnodes = recorded.vnodes;
        Ok(options)
    }

    pub async fn connect(&self) -> Result<Arc<ClusterClient>> {
        let registry = self.registry()?;
        let membership = registry
            .open(Duration::from_secs(5))
            .await
            .context("opening the cluster registry")?;
        let s3: Option<Arc<dyn ObjectStore>> = if self.no_s3_fallback {
            None
        } else {
            let config = S3Config {
                endpoint: self.s3_endpoint.clone(),
                region: self.s3_region.clone(),
                path_style: self.s3_path_style,
                ..S3Config::default()
            };
            let metrics = Arc::new(Metrics::new().map_err(anyhow::Error::msg)?);
            Some(lakecache_worker::s3_store(&config, metrics).await)
        };
        let options = self.ring_from(&registry).await?;
        let client = ClusterClient::new(membership, options, s3);
        anyhow::ensure!(
            !client.members().is_empty(),
            "no workers registered in {registry:?}"
        );
        Ok(client)
    }
}
