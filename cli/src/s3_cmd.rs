use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_s3_endpoint::EndpointConfig;

#[derive(Args)]
pub struct S3ServerCmd {
    /// Directory that holds the objects (created if missing)
    #[arg(long, env = "LAKECACHE_S3_ROOT")]
    root: PathBuf,
    /// Address to serve S3 on
    #[arg(long, env = "LAKECACHE_S3_LISTEN", default_value = "127.0.0.1:9000")]
    listen: SocketAddr,
    /// Access key clients sign with (random when not given, and printed)
    #[arg(long, env = "LAKECACHE_S3_ACCESS_KEY")]
    access_key: Option<String>,
    /// Secret key clients sign with (random when not given, and printed)
    #[arg(long, env = "LAKECACHE_S3_SECRET_KEY", hide_env_values = true)]
    secret_key: Option<String>,
    /// Buckets to create at start (repeatable)
    #[arg(long = "bucket")]
    buckets: Vec<String>,
    /// Answer listings without ETags, as some S3-compatible stores do
    /// (for testing clients against that quirk)
    #[arg(long)]
    list_without_etags: bool,
}

pub fn random_token(len: usize) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    while out.len() < len {
        let _ = write!(out, "{:032x}", random_u128());
    }
    out.truncate(len);
    out
}

fn random_u128() -> u128 {
    let mut buf = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut buf);
    }
    u128::from_le_bytes(buf)
}

impl S3ServerCmd {
    pub async fn run(self) -> Result<()> {
        let generated = self.access_key.is_none() || self.secret_key.is_none();
        let access_key = self
            .access_key
            .unwrap_or_else(|| format!("LC{}", random_token(18).to_uppercase()));
        let secret_key = self.secret_key.unwrap_or_else(|| random_token(40));
        let endpoint = lakecache_s3_endpoint::start(EndpointConfig {
            root: self.root.clone(),
            listen: self.listen,
            access_key: access_key.clone(),
            secret_key: secret_key.clone(),
            buckets: self.buckets,
            list_without_etags: self.list_without_etags,
        })
        .await
        .context("starting the embedded S3 endpoint")?;
        eprintln!(
            "embedded S3 endpoint on {} (root {})",
            endpoint.url(),
            self.root.display()
        );
        if generated {
            eprintln!(
                "credentials: AWS_ACCESS_KEY_ID={access_key} AWS_SECRET_ACCESS_KEY={secret_key}"
            );
        }
        crate::shutdown_signal().await;
        endpoint.shutdown().await;
        Ok(())
    }
}
