//! `lakecache worker` settings from flags, environment and a TOML file.
//! Precedence: flag, then environment variable, then file, then default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use lakecache_worker::store::RetryMode;
use lakecache_worker::{CacheConfig, HttpLimits, S3Config, WorkerOptions};
use serde::Deserialize;

use crate::units::{ByteSize, Seconds};
use lakecache_protocol::member_sig::{MemberSigner, MemberTrust};
use lakecache_protocol::tls::{server_config, ClientTls, Identity};

/// Every setting is optional here so that flags, environment and file can
/// be layered; defaults are applied in [`WorkerSettings::resolve`].
#[derive(Debug, Clone, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// Address of the HTTP API [default: 127.0.0.1:9500]
    #[arg(long, env = "LAKECACHE_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Directory for page files and the RocksDB index (created 0700)
    /// [default: /var/cache/lakecache]
    #[arg(long, env = "LAKECACHE_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Disk space for cached pages, e.g. 500GiB [default: 10GiB]
    #[arg(long, env = "LAKECACHE_CACHE_SIZE")]
    pub cache_size: Option<ByteSize>,
    /// Page size, 1MiB to 64MiB: also the size of one S3 GET of a
    /// sequential reader [default: 8MiB]
    #[arg(long, env = "LAKECACHE_PAGE_SIZE")]
    pub page_size: Option<ByteSize>,
    /// How long HEAD and LIST results are trusted; 0 revalidates every
    /// time [default: 60s]
    #[arg(long, env = "LAKECACHE_METADATA_TTL")]
    pub metadata_ttl: Option<Seconds>,
    /// Pages fetched ahead of a sequential reader; 0 disables [default: 2]
    #[arg(long, env = "LAKECACHE_READAHEAD_PAGES")]
    pub readahead_pages: Option<u32>,
    /// Concurrent page fetches from S3; bounds memory at this many pages
    /// [default: 32]
    #[arg(long, env = "LAKECACHE_FETCH_CONCURRENCY")]
    pub fetch_concurrency: Option<usize>,
    /// Eviction starts above this fraction of --cache-size [default: 0.95]
    #[arg(long, env = "LAKECACHE_HIGH_WATERMARK")]
    pub high_watermark: Option<f64>,
    /// Eviction stops at this fraction of --cache-size [default: 0.85]
    #[arg(long, env = "LAKECACHE_LOW_WATERMARK")]
    pub low_watermark: Option<f64>,
    /// Memory for upload parts and cold page fetches of all requests
    /// together; uploads beyond it wait (back-pressure on the client)
    /// [default: 1/4 of RAM, 256MiB to 8GiB]
    #[arg(long, env = "LAKECACHE_MEMORY_LIMIT")]
    pub memory_limit: Option<ByteSize>,
    /// Multipart part size for uploads, 5MiB to 5GiB; grows after every
    /// 1,000 parts so 10,000 parts reach 5TiB [default: 16MiB]
    #[arg(long, env = "LAKECACHE_PART_SIZE")]
    pub part_size: Option<ByteSize>,
    /// Dirty (acknowledged, not yet uploaded) write-back bytes this worker
    /// holds on disk before new write-back writes wait for uploads
    /// [default: half of --cache-size]
    #[arg(long, env = "LAKECACHE_WRITE_STAGING_LIMIT")]
    pub write_staging_limit: Option<ByteSize>,
    /// Spare page files (zeros) kept for write-back pages to be written
    /// over, up to the largest burst of write-back writes seen, or all of
    /// it once a write-back mount on this host has said so: direct writes
    /// into new files are slower on ext4. Written only while no
    /// write-back write is being taken; 0: none [default: 2GiB, at most
    /// an eighth of --cache-size]
    #[arg(long, env = "LAKECACHE_WRITE_SPARE")]
    pub write_spare: Option<ByteSize>,
    /// A write-back write waiting this long for staging space fails (the
    /// client sees EIO); what was acknowledged stays staged [default: 600s]
    #[arg(long, env = "LAKECACHE_WRITE_STALL_TIMEOUT")]
    pub write_stall_timeout: Option<Seconds>,
    /// A write-back copy whose worker takes no byte for this long while
    /// bytes wait, or says nothing that long after the body, and then
    /// does not answer a probe, is given up on and the copy goes to the
    /// next worker on the ring [default: 10s]
    #[arg(long, env = "LAKECACHE_REPLICA_PROGRESS_TIMEOUT")]
    pub replica_progress_timeout: Option<Seconds>,
    /// An upload part waits up to this long while write-back writes are
    /// being taken on this worker (until they pause for 200ms), so a
    /// checkpoint burst gets the disk and CPU first; never while writers
    /// wait for staging room or staging is over half full; 0s: uploads
    /// never wait [default: 2s]
    #[arg(long, env = "LAKECACHE_UPLOAD_GIVE_WAY")]
    pub upload_give_way: Option<Seconds>,
    /// An upload to S3 (a part, or a small object) not done within this
    /// plus a second per MiB is taken for stalled and sent again on a new
    /// connection, twice at most [default: 10s]
    #[arg(long, env = "LAKECACHE_S3_STALL_TIMEOUT")]
    pub s3_stall_timeout: Option<Seconds>,
    /// Workers that hold a write-back object durably before its write is
    /// acknowledged: this one and the next ones on the ring, 1..=8
    /// [default: 2 when the ring has 2 or more workers, else 1]
    #[arg(long, env = "LAKECACHE_WRITE_REPLICAS")]
    pub write_replicas: Option<usize>,
    /// Largest accepted upload body [default: 5TiB]
    #[arg(long, env = "LAKECACHE_MAX_BODY_SIZE")]
    pub max_body_size: Option<ByteSize>,
    /// Longest accepted request URI in bytes [default: 8192]
    #[arg(long, env = "LAKECACHE_MAX_URI_BYTES")]
    pub max_uri_bytes: Option<usize>,
    /// Largest accepted request head (request line + headers) in bytes
    /// [default: 65536]
    #[arg(long, env = "LAKECACHE_MAX_HEADER_BYTES")]
    pub max_header_bytes: Option<usize>,
    /// Open client connections at most; more wait to be accepted
    /// [default: 4096]
    #[arg(long, env = "LAKECACHE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Requests in flight per tenant (token); more wait up to 5 s, then
    /// get 429 [default: 1024]
    #[arg(long, env = "LAKECACHE_MAX_REQUESTS_PER_TENANT")]
    pub max_requests_per_tenant: Option<usize>,
    /// Abort an upload whose client sends nothing for this long (time the
    /// worker spends applying back-pressure does not count) [default: 60s]
    #[arg(long, env = "LAKECACHE_BODY_IDLE_TIMEOUT")]
    pub body_idle_timeout: Option<Seconds>,
    /// S3 endpoint URL for S3-compatible stores (default: AWS, from region)
    #[arg(long, env = "LAKECACHE_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// S3 region [default: us-east-1, or AWS_REGION]
    #[arg(long, env = "LAKECACHE_S3_REGION")]
    pub s3_region: Option<String>,
    /// Use path-style addressing (needed by most S3-compatible stores)
    #[arg(long, env = "LAKECACHE_S3_PATH_STYLE", num_args = 0..=1, default_missing_value = "true")]
    pub s3_path_style: Option<bool>,
    /// SDK retry mode: standard or adaptive (client-side rate limiting on
    /// throttling) [default: standard]
    #[arg(long, env = "LAKECACHE_S3_RETRY_MODE")]
    pub s3_retry_mode: Option<RetryMode>,
    /// Attempts per S3 request, first included [default: 5]
    #[arg(long, env = "LAKECACHE_S3_MAX_ATTEMPTS")]
    pub s3_max_attempts: Option<u32>,
    /// Resumptions of a GET whose body breaks mid-stream [default: 3]
    #[arg(long, env = "LAKECACHE_S3_MAX_RESUMES")]
    pub s3_max_resumes: Option<u32>,
    /// Send a CRC32C with every upload (`x-amz-checksum-crc32c`) for the
    /// store to check; `false` for S3-compatible stores that refuse the
    /// header [default: true]
    #[arg(long, env = "LAKECACHE_S3_CHECKSUMS", num_args = 0..=1, default_missing_value = "true")]
    pub s3_checksums: Option<bool>,
    /// Cluster registry to join: etcd://HOST:PORT[/prefix] registers this
    /// worker under a lease; static:/file: lists need no registration
    #[arg(long, env = "LAKECACHE_REGISTRY")]
    pub registry: Option<String>,
    /// HOST:PORT clients use to reach this worker [default: --listen]
    #[arg(long, env = "LAKECACHE_ADVERTISE")]
    pub advertise: Option<String>,
    /// The ring's placement segment size (read-ahead stops at segment
    /// ends, since the next segment belongs to another worker). With an
    /// etcd registry, the first worker records it and later workers must
    /// match [default: 64MiB]
    #[arg(long, env = "LAKECACHE_SEGMENT_SIZE")]
    pub segment_size: Option<ByteSize>,
    /// Virtual nodes per worker on the ring; recorded and checked like
    /// --segment-size [default: 512]
    #[arg(long, env = "LAKECACHE_VNODES")]
    pub vnodes: Option<u32>,
    /// Signing keys file (`lakecache token keygen`): every request must
    /// then carry a token signed with one of them [default: no tokens]
    #[arg(long, env = "LAKECACHE_AUTH_KEYS")]
    pub auth_keys: Option<PathBuf>,
    /// Only these buckets can be reached, whatever a token allows
    /// (repeatable) [default: every bucket the credentials reach]
    #[arg(
        long = "allow-bucket",
        env = "LAKECACHE_ALLOW_BUCKET",
        value_delimiter = ','
    )]
    pub allow_bucket: Option<Vec<String>>,
    /// Only objects under these s3://bucket/prefix scopes can be reached
    /// (repeatable; combines with --allow-bucket)
    #[arg(
        long = "allow-prefix",
        env = "LAKECACHE_ALLOW_PREFIX",
        value_delimiter = ','
    )]
    pub allow_prefix: Option<Vec<String>>,
    /// Require a token for /metrics and /v1/health too
    #[arg(long, env = "LAKECACHE_PROTECT_METRICS", num_args = 0..=1, default_missing_value = "true")]
    pub protect_metrics: Option<bool>,
    /// Serve without tokens: anyone who reaches the port may do anything
    /// the worker's S3 credentials allow. Only for loopback or trusted
    /// networks
    #[arg(long, env = "LAKECACHE_NO_AUTH", num_args = 0..=1, default_missing_value = "true")]
    pub no_auth: Option<bool>,
    /// PEM certificate chain the worker serves HTTPS with
    #[arg(long, env = "LAKECACHE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(long, env = "LAKECACHE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this PEM CA (mutual TLS)
    #[arg(long, env = "LAKECACHE_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// PEM CA that signs the other workers' certificates (page
    /// hand-offs) [default: --tls-client-ca]
    #[arg(long, env = "LAKECACHE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Serve plain HTTP: traffic, tokens included, is readable on the
    /// wire. Only for loopback or a network that is already encrypted
    #[arg(long, env = "LAKECACHE_INSECURE_HTTP", num_args = 0..=1, default_missing_value = "true")]
    pub insecure_http: Option<bool>,
    /// Unix socket where mounts on this host read cached pages straight
    /// from the page files (short-circuit reads; same user or root only,
    /// tokens checked as over HTTP) [default: CACHE_DIR/local.sock]
    #[arg(long, env = "LAKECACHE_LOCAL_SOCKET")]
    pub local_socket: Option<PathBuf>,
    /// Serve no local socket: mounts on this host read over HTTP too
    #[arg(long, env = "LAKECACHE_NO_LOCAL_SOCKET", num_args = 0..=1, default_missing_value = "true")]
    pub no_local_socket: Option<bool>,
    /// Stable id of this worker in the ring [default: the advertised address]
    #[arg(long, env = "LAKECACHE_WORKER_ID")]
    pub worker_id: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub etcd: crate::etcd_args::EtcdArgs,
    /// etcd lease TTL; a worker that stops heart-beating leaves every
    /// client's view within it [default: 10s]
    #[arg(long, env = "LAKECACHE_LEASE_TTL")]
    pub lease_ttl: Option<Seconds>,
    /// A cache rule for a prefix: "s3://bucket/prefix RULE..." with rules
    /// pin (never evicted), ttl=DURATION (evicted that long after being
    /// fetched), skip-cache (read from S3 every time, never stored) and
    /// max-age=DURATION (metadata revalidated after this age). The longest
    /// matching prefix applies (repeatable; ';' separates in the variable)
    #[arg(long = "policy", env = "LAKECACHE_POLICY", value_delimiter = ';')]
    pub policy: Option<Vec<String>>,
    /// Cache bytes a tenant may hold, as TENANT=SIZE (e.g. team-a=200GiB;
    /// repeatable, ',' separates in the variable). A tenant over it loses
    /// its own least-recently-used pages first; its pending write-back
    /// data counts but is never evicted
    #[arg(
        long = "tenant-quota",
        env = "LAKECACHE_TENANT_QUOTA",
        value_delimiter = ','
    )]
    pub tenant_quota: Option<Vec<String>>,
    /// S3 requests per second a tenant's reads and writes may cause, as
    /// TENANT=N (repeatable); over it, that tenant's requests wait
    #[arg(
        long = "tenant-s3-rps",
        env = "LAKECACHE_TENANT_S3_RPS",
        value_delimiter = ','
    )]
    pub tenant_s3_rps: Option<Vec<String>>,
    /// Dollars per GB of S3 egress, for the egress-saved figures in
    /// metrics [default: 0.09, S3's internet egress list price]
    #[arg(long, env = "LAKECACHE_EGRESS_PRICE_PER_GB")]
    pub egress_price_per_gb: Option<f64>,
    /// Bytes fetched ahead of one job's readers on this worker, in the
    /// order its published plan gives (capped at a quarter of the cache;
    /// 0 turns plan prefetch off) [default: 512MiB]
    #[arg(long, env = "LAKECACHE_PLAN_PREFETCH")]
    pub plan_prefetch: Option<ByteSize>,
    /// How far ahead of a planned reader, in time at its pace, pages are
    /// fetched [default: 2s]
    #[arg(long, env = "LAKECACHE_PLAN_LEAD")]
    pub plan_lead: Option<Seconds>,
}

/// `TENANT=VALUE` settings by tenant, each value checked by `parse`.
fn per_tenant<T>(
    values: Option<&[String]>,
    flag: &str,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<std::collections::BTreeMap<String, T>> {
    let mut out = std::collections::BTreeMap::new();
    for item in values
        .unwrap_or_default()
        .iter()
        .filter(|v| !v.trim().is_empty())
    {
        let (tenant, value) = item
            .split_once('=')
            .with_context(|| format!("{flag} {item:?}: expected TENANT=VALUE"))?;
        let tenant = tenant.trim();
        if tenant.is_empty() {
            bail!("{flag} {item:?}: the tenant name is empty");
        }
        let value = parse(value.trim()).map_err(|e| anyhow::anyhow!("{flag} {item:?}: {e}"))?;
        if out.insert(tenant.to_string(), value).is_some() {
            bail!("{flag} names tenant {tenant:?} twice");
        }
    }
    Ok(out)
}

/// Parses one `--policy` value.
pub fn parse_policy(text: &str) -> Result<lakecache_worker::policy::PrefixPolicy> {
    let mut words = text.split_whitespace();
    let prefix = words
        .next()
        .with_context(|| format!("empty --policy {text:?}"))?;
    let mut policy = lakecache_worker::policy::PrefixPolicy {
        prefix: prefix.to_string(),
        ..Default::default()
    };
    let duration = |v: &str| -> Result<std::time::Duration> {
        v.parse::<Seconds>()
            .map(|s| s.0)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("in --policy {text:?}"))
    };
    for word in words {
        match word.split_once('=') {
            None if word == "pin" => policy.pin = true,
            None if word == "skip-cache" => policy.skip_cache = true,
            Some(("ttl", v)) => policy.ttl = Some(duration(v)?),
            Some(("max-age", v)) => policy.max_age = Some(duration(v)?),
            _ => bail!(
                "unknown rule {word:?} in --policy {text:?}: use pin, skip-cache, ttl=DURATION or max-age=DURATION"
            ),
        }
    }
    Ok(policy)
}

/// Where and how a worker announces itself.
#[derive(Debug, Clone)]
pub struct Registration {
    pub registry: lakecache_registry::RegistryUrl,
    pub advertise: Option<String>,
    pub worker_id: Option<String>,
    pub lease_ttl: std::time::Duration,
    /// Placement settings, shared by the whole cluster.
    pub ring: lakecache_registry::RingOptions,
    /// Signs this worker's record with the cluster keys.
    pub signer: Option<MemberSigner>,
}

macro_rules! layer {
    ($top:expr, $under:expr, [$($field:ident),* $(,)?]) => {
        WorkerSettings {
            etcd: $top.etcd.over($under.etcd),
            $($field: $top.$field.or($under.$field)),*
        }
    };
}

impl WorkerSettings {
    /// Reads a TOML file of the same settings (snake_case keys).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config file {}", path.display()))
    }

    /// `self` wins over `under` field by field.
    pub fn over(self, under: WorkerSettings) -> WorkerSettings {
        layer!(
            self,
            under,
            [
                listen,
                cache_dir,
                cache_size,
                page_size,
                metadata_ttl,
                readahead_pages,
                fetch_concurrency,
                high_watermark,
                low_watermark,
                part_size,
                memory_limit,
                write_staging_limit,
                write_spare,
                write_stall_timeout,
                replica_progress_timeout,
                upload_give_way,
                s3_stall_timeout,
                write_replicas,
                max_body_size,
                max_uri_bytes,
                max_header_bytes,
                max_connections,
                max_requests_per_tenant,
                body_idle_timeout,
                s3_endpoint,
                s3_region,
                s3_path_style,
                s3_retry_mode,
                s3_max_attempts,
                s3_max_resumes,
                s3_checksums,
                registry,
                advertise,
                segment_size,
                vnodes,
                auth_keys,
                allow_bucket,
                allow_prefix,
                protect_metrics,
                no_auth,
                tls_cert,
                tls_key,
                tls_client_ca,
                tls_ca,
                insecure_http,
                local_socket,
                no_local_socket,
                worker_id,
                lease_ttl,
                policy,
                egress_price_per_gb,
                tenant_quota,
                tenant_s3_rps,
                plan_prefetch,
                plan_lead,
            ]
        )
    }

    /// The registry settings, validated; `None` without `--registry`.
    pub fn registration(&self) -> Result<Option<Registration>> {
        let Some(raw) = &self.registry else {
            return Ok(None);
        };
        let keys = self.key_ring()?;
        // Workers believe only records their own keys signed (any record
        // in a --no-auth cluster), and sign their own.
        let trust = keys
            .as_ref()
            .map_or(MemberTrust::AnyRecord, MemberTrust::from_ring);
        let registry = raw
            .parse::<lakecache_registry::RegistryUrl>()
            .map_err(|e: String| anyhow::anyhow!("--registry: {e}"))?
            .with_etcd_access(self.etcd.access(trust)?);
        let lease_ttl = self
            .lease_ttl
            .map_or(std::time::Duration::from_secs(10), |s| s.0);
        if lease_ttl < std::time::Duration::from_secs(1) {
            bail!("--lease-ttl must be at least 1s");
        }
        let vnodes = self.vnodes.unwrap_or(lakecache_registry::DEFAULT_VNODES);
        if !(1..=65_536).contains(&vnodes) {
            bail!("--vnodes must be 1..=65536, got {vnodes}");
        }
        Ok(Some(Registration {
            signer: keys.as_ref().map(MemberSigner::new),
            registry,
            advertise: self.advertise.clone(),
            worker_id: self.worker_id.clone(),
            lease_ttl,
            ring: lakecache_registry::RingOptions {
                vnodes,
                segment_size: self
                    .segment_size
                    .map_or(lakecache_registry::DEFAULT_SEGMENT_SIZE, |s| s.0),
                ..Default::default()
            },
        }))
    }

    /// Applies defaults and checks every value.
    pub fn resolve(self) -> Result<(WorkerOptions, S3Config)> {
        self.registration()?;
        let access = self.access_policy()?;

        const MIB: u64 = 1 << 20;
        // 8 MiB GETs: half the requests of 4 MiB (S3 bills and throttles
        // per request), and a quarter less CPU per GiB in an S3 endpoint
        // on the same machine (benches/results/cpu-split.md).
        let page_size = self.page_size.map_or(DEFAULT_PAGE_SIZE, |s| s.0);
        if !(MIB..=64 * MIB).contains(&page_size) || !page_size.is_multiple_of(256 * 1024) {
            bail!("--page-size must be between 1MiB and 64MiB in steps of 256KiB, got {page_size} bytes");
        }
        let capacity = self.cache_size.map_or(10 << 30, |s| s.0);
        if capacity < 2 * page_size {
            bail!(
                "--cache-size must hold at least two pages ({} bytes), got {capacity}",
                2 * page_size
            );
        }
        let high = self.high_watermark.unwrap_or(0.95);
        let low = self.low_watermark.unwrap_or(0.85);
        if !(0.0 < low && low < high && high <= 1.0) {
            bail!("watermarks must satisfy 0 < low < high <= 1, got low={low} high={high}");
        }
        let part_size = self.part_size.map_or(16 * MIB, |s| s.0);
        if !(5 * MIB..=5 << 30).contains(&part_size) {
            bail!("--part-size must be between 5MiB and 5GiB, got {part_size} bytes");
        }
        let segment_size = self
            .segment_size
            .map_or(lakecache_registry::DEFAULT_SEGMENT_SIZE, |s| s.0);
        if segment_size < page_size || !segment_size.is_multiple_of(page_size) {
            bail!("--segment-size must be a multiple of --page-size ({page_size} bytes), got {segment_size}");
        }
        let memory_limit = self.memory_limit.map_or_else(default_memory_limit, |s| s.0);
        if memory_limit < 2 * part_size.max(page_size) {
            bail!(
                "--memory-limit must hold two parts and two pages ({} bytes), got {memory_limit}",
                2 * part_size.max(page_size)
            );
        }
        lakecache_protocol::buffer_pool::limit_idle_to_share_of(memory_limit);
        let fetch_concurrency = self.fetch_concurrency.unwrap_or(32);
        if !(1..=1024).contains(&fetch_concurrency) {
            bail!("--fetch-concurrency must be 1..=1024, got {fetch_concurrency}");
        }
        if let Some(n) = self.write_replicas.filter(|n| !(1..=8).contains(n)) {
            bail!("--write-replicas must be 1..=8, got {n}");
        }
        let policies = self
            .policy
            .iter()
            .flatten()
            .filter(|p| !p.trim().is_empty())
            .map(|p| parse_policy(p))
            .collect::<Result<Vec<_>>>()?;
        let policies = lakecache_worker::policy::Policies::new(policies)?;
        let egress_price_per_gb = self
            .egress_price_per_gb
            .unwrap_or(lakecache_worker::metrics::DEFAULT_EGRESS_PRICE_PER_GB);
        if !(0.0..=100.0).contains(&egress_price_per_gb) {
            bail!("--egress-price-per-gb must be 0..=100 dollars, got {egress_price_per_gb}");
        }
        let tenant_quotas = per_tenant(self.tenant_quota.as_deref(), "--tenant-quota", |v| {
            v.parse::<ByteSize>().map(|s| s.0)
        })?;
        let tenant_s3_rps = per_tenant(self.tenant_s3_rps.as_deref(), "--tenant-s3-rps", |v| {
            v.parse::<u32>()
                .ok()
                .filter(|n| (1..=1_000_000).contains(n))
                .ok_or_else(|| "expected 1..=1000000 requests per second".to_string())
        })?;
        let max_attempts = self.s3_max_attempts.unwrap_or(5);
        if !(1..=20).contains(&max_attempts) {
            bail!("--s3-max-attempts must be 1..=20, got {max_attempts}");
        }
        let limits = HttpLimits {
            max_uri_bytes: self.max_uri_bytes.unwrap_or(8 * 1024),
            max_header_bytes: self.max_header_bytes.unwrap_or(64 * 1024),
            max_body_bytes: self.max_body_size.map_or(5 << 40, |s| s.0),
            max_connections: self.max_connections.unwrap_or(4096),
            max_requests_per_tenant: self.max_requests_per_tenant.unwrap_or(1024),
            body_idle_timeout: self
                .body_idle_timeout
                .map_or(std::time::Duration::from_secs(60), |s| s.0),
            ..HttpLimits::default()
        };
        if !(1..=1_000_000).contains(&limits.max_requests_per_tenant) {
            bail!(
                "--max-requests-per-tenant must be 1..=1000000, got {}",
                limits.max_requests_per_tenant
            );
        }
        if limits.body_idle_timeout < std::time::Duration::from_secs(1) {
            bail!("--body-idle-timeout must be at least 1s");
        }
        if let Some(t) = self.replica_progress_timeout {
            if !(std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(3600))
                .contains(&t.0)
            {
                bail!("--replica-progress-timeout must be 1s to 1h, got {:?}", t.0);
            }
        }
        if let Some(spare) = self.write_spare {
            if spare.0 > 1 << 40 {
                bail!("--write-spare must be at most 1TiB, got {} bytes", spare.0);
            }
        }
        if let Some(t) = self.upload_give_way {
            if t.0 > std::time::Duration::from_secs(60) {
                bail!("--upload-give-way must be 0s to 60s, got {:?}", t.0);
            }
        }
        let s3_stall_timeout = self
            .s3_stall_timeout
            .map_or(S3Config::default().stall_timeout, |t| t.0);
        if !(std::time::Duration::from_secs(1)..=std::time::Duration::from_secs(3600))
            .contains(&s3_stall_timeout)
        {
            bail!("--s3-stall-timeout must be 1s to 1h, got {s3_stall_timeout:?}");
        }
        if limits.max_uri_bytes < 256 || limits.max_header_bytes < 8192 {
            bail!("--max-uri-bytes must be >= 256 and --max-header-bytes >= 8192");
        }
        if !(1..=1_000_000).contains(&limits.max_connections) {
            bail!(
                "--max-connections must be 1..=1000000, got {}",
                limits.max_connections
            );
        }
        if let Some(ep) = &self.s3_endpoint {
            if !(ep.starts_with("http://") || ep.starts_with("https://")) {
                bail!("--s3-endpoint must be an http:// or https:// URL, got {ep:?}");
            }
        }
        let (tls, peer_tls) = self.transport(access.keys.is_some())?;
        let region = self
            .s3_region
            .or_else(|| std::env::var("AWS_REGION").ok())
            .unwrap_or_else(|| "us-east-1".into());
        let cache_dir = self
            .cache_dir
            .unwrap_or_else(|| "/var/cache/lakecache".into());
        let local_socket = match (self.no_local_socket.unwrap_or(false), self.local_socket) {
            (true, Some(_)) => bail!("--local-socket and --no-local-socket contradict each other"),
            (true, None) => None,
            (false, Some(p)) => Some(p),
            (false, None) => Some(cache_dir.join(LOCAL_SOCKET_NAME)),
        };
        if let Some(p) = &local_socket {
            // sockaddr_un holds 108 bytes with the terminating NUL.
            if p.as_os_str().len() > 107 {
                bail!(
                    "the local socket path {} is longer than 107 bytes: set a shorter one with --local-socket, or --no-local-socket",
                    p.display()
                );
            }
        }
        let options = WorkerOptions {
            listen: self.listen.unwrap_or(([127, 0, 0, 1], 9500).into()),
            local_socket,
            s3_stall_timeout,
            cache_dir,
            cache: CacheConfig {
                page_size,
                capacity,
                high_watermark: high,
                low_watermark: low,
                metadata_ttl: self
                    .metadata_ttl
                    .map_or(std::time::Duration::from_secs(60), |s| s.0),
                readahead_pages: self.readahead_pages.unwrap_or(DEFAULT_READAHEAD_PAGES),
                fetch_concurrency,
                part_size,
                copy_part_limit: lakecache_worker::store::MAX_COPY_BYTES,
                segment_size: Some(segment_size),
                memory_limit,
                policies,
                egress_price_per_gb,
                tenant_quotas,
                tenant_s3_rps,
                plan_prefetch: {
                    let default = lakecache_worker::cache::PlanPrefetchConfig::default();
                    lakecache_worker::cache::PlanPrefetchConfig {
                        budget_bytes: self.plan_prefetch.map_or(default.budget_bytes, |s| s.0),
                        lead: self.plan_lead.map_or(default.lead, |s| s.0),
                    }
                },
                writeback: lakecache_worker::writeback::WriteBackConfig {
                    staging_limit: self
                        .write_staging_limit
                        .map_or(capacity / 2, |s| s.0)
                        .max(page_size),
                    stall_timeout: self
                        .write_stall_timeout
                        .map_or(std::time::Duration::from_secs(600), |s| s.0),
                    replicas: self.write_replicas,
                    replica_progress: self
                        .replica_progress_timeout
                        .map_or(std::time::Duration::from_secs(10), |s| s.0),
                    upload_give_way: self.upload_give_way.map_or(
                        lakecache_worker::writeback::WriteBackConfig::default().upload_give_way,
                        |s| s.0,
                    ),
                    spare_most: self
                        .write_spare
                        .map_or(default_write_spare(capacity), |s| s.0),
                    ..Default::default()
                },
            },
            limits,
            access,
            tls,
            peer_tls,
        };
        let s3 = S3Config {
            endpoint: self.s3_endpoint,
            region,
            path_style: self.s3_path_style.unwrap_or(false),
            retry_mode: self.s3_retry_mode.unwrap_or(RetryMode::Standard),
            max_attempts,
            max_resumes: self.s3_max_resumes.unwrap_or(3),
            checksums: self.s3_checksums.unwrap_or(true),
            stall_timeout: s3_stall_timeout,
            ..S3Config::default()
        };
        Ok((options, s3))
    }
}

/// The worker's local socket in its cache directory, unless configured.
pub const LOCAL_SOCKET_NAME: &str = "local.sock";

type ServerTls = Option<std::sync::Arc<lakecache_protocol::tls::ServerConfig>>;

impl WorkerSettings {
    /// HTTPS settings, or plain HTTP when explicitly asked for; and the
    /// same refusal for serving without tokens.
    fn transport(&self, has_keys: bool) -> Result<(ServerTls, Option<ClientTls>)> {
        let no_auth = self.no_auth.unwrap_or(false);
        match (has_keys, no_auth) {
            (false, false) => bail!(
                "a worker needs --auth-keys FILE (create one with `lakecache token keygen`), or --no-auth to serve anyone who can reach it"
            ),
            (true, true) => bail!("--no-auth contradicts --auth-keys"),
            _ => {}
        }
        let insecure = self.insecure_http.unwrap_or(false);
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Identity {
                cert: cert.clone(),
                key: key.clone(),
            },
            (None, None) if insecure => {
                if self.tls_client_ca.is_some() {
                    bail!("--tls-client-ca needs --tls-cert and --tls-key");
                }
                return Ok((None, None));
            }
            (None, None) => bail!(
                "give --tls-cert and --tls-key to serve HTTPS, or --insecure-http to serve plain HTTP"
            ),
            _ => bail!("--tls-cert and --tls-key go together"),
        };
        if insecure {
            bail!("--insecure-http contradicts --tls-cert");
        }
        let server = server_config(&identity, self.tls_client_ca.as_deref())?;
        // Peers are verified against --tls-ca; where workers demand client
        // certificates this worker presents its own.
        let peer = match self.tls_ca.as_ref().or(self.tls_client_ca.as_ref()) {
            Some(ca) => Some(ClientTls::load(
                ca,
                self.tls_client_ca.as_ref().map(|_| &identity),
            )?),
            None => None,
        };
        Ok((Some(server), peer))
    }

    /// Signing keys, allow-list and metrics protection, checked.
    fn key_ring(&self) -> Result<Option<lakecache_protocol::token::KeyRing>> {
        let Some(path) = &self.auth_keys else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --auth-keys {}", path.display()))?;
        Ok(Some(
            lakecache_protocol::token::KeyRing::parse(&text)
                .with_context(|| format!("--auth-keys {}", path.display()))?,
        ))
    }

    fn access_policy(&self) -> Result<lakecache_worker::AccessPolicy> {
        use lakecache_protocol::token::validate_scope;
        let keys = self.key_ring()?;
        let mut allow = Vec::new();
        for bucket in self.allow_bucket.iter().flatten() {
            lakecache_protocol::validate_bucket(bucket)
                .map_err(|e| anyhow::anyhow!("--allow-bucket {bucket:?}: {e}"))?;
            allow.push(format!("s3://{bucket}/"));
        }
        for scope in self.allow_prefix.iter().flatten() {
            validate_scope(scope).map_err(|e| anyhow::anyhow!("--allow-prefix: {e}"))?;
            allow.push(scope.clone());
        }
        let protect_metrics = self.protect_metrics.unwrap_or(false);
        if protect_metrics && keys.is_none() {
            bail!("--protect-metrics needs --auth-keys");
        }
        Ok(lakecache_worker::AccessPolicy {
            keys,
            allow,
            protect_metrics,
        })
    }
}

/// The default page and read-ahead: 16 MiB ahead of a sequential reader.
const DEFAULT_PAGE_SIZE: u64 = 8 << 20;
const DEFAULT_READAHEAD_PAGES: u32 = 2;

/// A quarter of physical memory, between 256 MiB and 8 GiB.
fn default_memory_limit() -> u64 {
    (lakecache_protocol::memory::physical_memory() / 4).clamp(256 << 20, 8 << 30)
}

/// Spare page files take disk beside the cache: 2 GiB, but no more than
/// an eighth of a small cache (`lakecache up --cache-size 2GiB` spends
/// 256 MiB on them, not as much again as its cache).
fn default_write_spare(cache_size: u64) -> u64 {
    lakecache_worker::writeback::DEFAULT_SPARE_MOST.min(cache_size / 8)
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use lakecache_protocol::testing::fuzz_cases;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(fuzz_cases(100_000)))]

        /// Config files: any text is a settings value or a parse error,
        /// and any parsed settings resolve or fail with a message.
        #[test]
        fn config_files_parse_or_are_rejected(
            key in "(page_size|cache_size|metadata_ttl|listen|segment_size|vnodes|allow_bucket|memory_limit|max_connections|high_watermark)",
            value in prop_oneof![
                "\"[0-9a-zA-Z.:]{0,12}\"",
                "-?[0-9]{1,20}(\\.[0-9]{1,3})?",
                "\\[\"[a-z0-9.\\-]{0,12}\"\\]",
                "\\PC{0,20}",
            ],
        ) {
            let text = format!("{key} = {value}\n");
            if let Ok(settings) = toml::from_str::<WorkerSettings>(&text) {
                if let Err(e) = settings.resolve() {
                    prop_assert!(!e.to_string().is_empty());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_wins_over_file_and_defaults_fill_in() {
        let file: WorkerSettings = toml::from_str(
            "listen = \"127.0.0.1:7000\"\ncache_size = \"1GiB\"\npage_size = \"8MiB\"\nmetadata_ttl = 0\n",
        )
        .unwrap();
        let flags = WorkerSettings {
            listen: Some("127.0.0.1:8000".parse().unwrap()),
            insecure_http: Some(true),
            no_auth: Some(true),
            ..Default::default()
        };
        let (opts, s3) = flags.clone().over(file).resolve().unwrap();
        assert_eq!(opts.listen.port(), 8000);
        assert_eq!(opts.cache.capacity, 1 << 30);
        assert_eq!(opts.cache.page_size, 8 << 20);
        assert!(opts.cache.metadata_ttl.is_zero());
        assert_eq!(s3.max_attempts, 5);
        assert_eq!(
            opts.cache.writeback.spare_most,
            128 << 20,
            "spares of a 1 GiB cache: an eighth of it"
        );
        let big: WorkerSettings = toml::from_str("cache_size = \"100GiB\"\n").unwrap();
        let (opts, _) = flags.clone().over(big).resolve().unwrap();
        assert_eq!(opts.cache.writeback.spare_most, 2 << 30);
        let set: WorkerSettings =
            toml::from_str("cache_size = \"1GiB\"\nwrite_spare = \"512MiB\"\n").unwrap();
        let (opts, _) = flags.over(set).resolve().unwrap();
        assert_eq!(
            opts.cache.writeback.spare_most,
            512 << 20,
            "set, not capped"
        );
    }

    #[test]
    fn the_local_socket_defaults_into_the_cache_dir_and_bad_settings_are_refused() {
        let base = || WorkerSettings {
            insecure_http: Some(true),
            no_auth: Some(true),
            cache_dir: Some("/srv/cache".into()),
            ..Default::default()
        };
        let (opts, _) = base().resolve().unwrap();
        assert_eq!(opts.local_socket, Some("/srv/cache/local.sock".into()));
        let off = WorkerSettings {
            no_local_socket: Some(true),
            ..base()
        };
        assert_eq!(off.resolve().unwrap().0.local_socket, None);
        for (w, says) in [
            (
                WorkerSettings {
                    no_local_socket: Some(true),
                    local_socket: Some("/run/w.sock".into()),
                    ..base()
                },
                "contradict",
            ),
            (
                WorkerSettings {
                    local_socket: Some(format!("/run/{}.sock", "x".repeat(120)).into()),
                    ..base()
                },
                "longer than 107 bytes",
            ),
        ] {
            let err = format!("{:#}", w.resolve().unwrap_err());
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn policies_parse_from_toml_and_bad_rules_name_themselves() {
        let file: WorkerSettings = toml::from_str(
            "insecure_http = true\nno_auth = true\npolicy = [\"s3://data/golden/ pin\", \"s3://data/hourly/ ttl=1h max-age=30s\", \"s3://data/tmp/ skip-cache\"]\negress_price_per_gb = 0.02\n",
        )
        .unwrap();
        let (opts, _) = file.resolve().unwrap();
        let p = &opts.cache.policies;
        assert!(p.for_uri("s3://data/golden/x").unwrap().pin);
        let hourly = p.for_uri("s3://data/hourly/x").unwrap();
        assert_eq!(hourly.ttl, Some(std::time::Duration::from_secs(3600)));
        assert_eq!(hourly.max_age, Some(std::time::Duration::from_secs(30)));
        assert!(p.for_uri("s3://data/tmp/x").unwrap().skip_cache);
        assert_eq!(opts.cache.egress_price_per_gb, 0.02);
        let tenants = WorkerSettings {
            tenant_quota: Some(vec!["team-a=200GiB".into(), "scan=1TiB".into()]),
            tenant_s3_rps: Some(vec!["scan=500".into()]),
            insecure_http: Some(true),
            no_auth: Some(true),
            ..Default::default()
        };
        let (opts, _) = tenants.resolve().unwrap();
        assert_eq!(opts.cache.tenant_quotas["team-a"], 200 << 30);
        assert_eq!(opts.cache.tenant_s3_rps["scan"], 500);
        for (quota, rps, says) in [
            ("team-a", "", "expected TENANT=VALUE"),
            ("=1GiB", "", "tenant name is empty"),
            ("a=1GiB,a=2GiB", "", "twice"),
            ("a=lots", "", "--tenant-quota"),
            ("", "a=0", "1..=1000000"),
        ] {
            let split = |v: &str| (!v.is_empty()).then(|| v.split(',').map(String::from).collect());
            let w = WorkerSettings {
                tenant_quota: split(quota),
                tenant_s3_rps: split(rps),
                insecure_http: Some(true),
                no_auth: Some(true),
                ..Default::default()
            };
            let err = format!("{:#}", w.resolve().unwrap_err());
            assert!(err.contains(says), "{quota} {rps}: {err}");
        }
        for (rule, says) in [
            ("s3://data/x pinned", "unknown rule \"pinned\""),
            ("s3://data/x ttl=soon", "invalid duration"),
            ("s3://data/x pin skip-cache", "pin keeps pages"),
            ("data/x pin", "must look like s3://bucket/"),
            ("s3://data/x", "sets nothing"),
        ] {
            let w = WorkerSettings {
                policy: Some(vec![rule.to_string()]),
                insecure_http: Some(true),
                no_auth: Some(true),
                ..Default::default()
            };
            let err = format!("{:#}", w.resolve().unwrap_err());
            assert!(err.contains(says), "{rule}: {err}");
        }
    }

    #[test]
    fn the_deploy_example_and_etcd_keys_parse() {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/worker.example.toml");
        let settings = WorkerSettings::from_file(Path::new(example)).unwrap();
        assert!(settings.auth_keys.is_some() && settings.tls_cert.is_some());
        let etcd: WorkerSettings = toml::from_str(
            "etcd_user = \"lakecache\"\netcd_password_file = \"/p\"\netcd_ca = \"/ca\"\n",
        )
        .unwrap();
        assert_eq!(etcd.etcd.etcd_user.as_deref(), Some("lakecache"));
        let flags = WorkerSettings::default();
        assert_eq!(
            flags.over(etcd).etcd.etcd_ca.as_deref(),
            Some(Path::new("/ca"))
        );
        assert!(toml::from_str::<WorkerSettings>("etcd_usr = \"x\"\n").is_err());
    }

    #[test]
    fn rejects_bad_values_with_clear_errors() {
        let bad = |s: &str| {
            toml::from_str::<WorkerSettings>(s)
                .map_err(|e| e.to_string())
                .and_then(|w| w.resolve().map(|_| ()).map_err(|e| e.to_string()))
        };
        assert!(bad("page_size = \"128MiB\"")
            .unwrap_err()
            .contains("--page-size"));
        assert!(bad("cache_size = \"1MiB\"")
            .unwrap_err()
            .contains("--cache-size"));
        assert!(bad("high_watermark = 0.5\nlow_watermark = 0.6")
            .unwrap_err()
            .contains("watermarks"));
        assert!(bad("s3_endpoint = \"localhost:9000\"")
            .unwrap_err()
            .contains("--s3-endpoint"));
        assert!(bad("no_such_key = 1")
            .unwrap_err()
            .contains("unknown field"));
        assert!(bad("s3_retry_mode = \"sometimes\"").is_err());
        assert!(bad("insecure_http = true")
            .unwrap_err()
            .contains("--auth-keys"));
        assert!(bad("no_auth = true")
            .unwrap_err()
            .contains("--insecure-http"));
        assert!(bad("no_auth = true\ntls_cert = \"/x\"")
            .unwrap_err()
            .contains("go together"));
        let open = "no_auth = true\ninsecure_http = true\n";
        assert!(bad(&format!("{open}s3_stall_timeout = \"0s\""))
            .unwrap_err()
            .contains("--s3-stall-timeout must be 1s to 1h"));
        assert!(bad(&format!("{open}replica_progress_timeout = \"2h\""))
            .unwrap_err()
            .contains("--replica-progress-timeout must be 1s to 1h"));
        assert!(bad(&format!("{open}write_spare = \"2TiB\""))
            .unwrap_err()
            .contains("--write-spare must be at most 1TiB"));
    }
}
