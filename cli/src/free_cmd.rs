//! `lakecache free s3://bucket/prefix`: evicts the cached pages under a
//! prefix on every worker (pinned ones too; pending writes are kept).

use anyhow::{bail, Result};
use clap::Args;

use crate::cluster_args::ClusterArgs;
use crate::load_cmd::{parse_spec, Workers};
use crate::units::ByteSize;

#[derive(Args)]
pub struct FreeCmd {
    /// s3://bucket/prefix whose cached pages are evicted
    uri: String,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl FreeCmd {
    pub async fn run(self) -> Result<()> {
        let spec = parse_spec(&self.uri, None)?;
        let workers = Workers::open(&self.cluster).await?;
        let (mut pages, mut bytes, mut failed) = (0, 0, Vec::new());
        for (name, c) in &workers.clients {
            match c.free(&spec.bucket, &spec.prefix).await {
                Ok(r) => {
                    pages += r.pages;
                    bytes += r.bytes;
                }
                Err(e) => failed.push(format!("{name}: {}", lakecache_protocol::Chain(&e))),
            }
        }
        println!(
            "freed {} in {pages} pages under {} on {} of {} workers",
            ByteSize(bytes),
            self.uri,
            workers.clients.len() - failed.len(),
            workers.clients.len()
        );
        if !failed.is_empty() {
            bail!("some workers did not free: {}", failed.join("; "));
        }
        Ok(())
    }
}
