//! `lakecache sync s3://bucket/prefix`: waits until everything written
//! back under the prefix (acknowledged by any worker) is in S3.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use lakecache_protocol::{validate_bucket, WorkerClient, WriteBackStatus};

use crate::cluster_args::ClusterArgs;
use crate::units::ByteSize;

#[derive(Args)]
pub struct SyncCmd {
    /// s3://bucket/ or s3://bucket/prefix
    uri: String,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl SyncCmd {
    pub async fn run(self) -> Result<()> {
        let rest = self
            .uri
            .strip_prefix("s3://")
            .with_context(|| format!("{:?} must start with s3://", self.uri))?;
        let bucket = rest.split('/').next().unwrap_or("");
        validate_bucket(bucket).with_context(|| format!("bucket of {:?}", self.uri))?;
        let prefix = if rest.contains('/') {
            self.uri.clone()
        } else {
            format!("{}/", self.uri)
        };
        let registry = self.cluster.registry()?;
        let membership = registry
            .open(Duration::from_secs(5))
            .await
            .context("opening the cluster registry")?;
        let tls = self.cluster.tls()?;
        let token = self.cluster.token()?;
        let limit = Duration::from_secs(self.cluster.timeout.unwrap_or(3600));
        let start = Instant::now();
        let mut last_report = Instant::now();
        loop {
            let members = membership.subscribe().borrow().clone();
            let mut pending = WriteBackStatus::default();
            let mut unreachable = Vec::new();
            for m in members.iter() {
                let status = WorkerClient::connect(
                    &m.address,
                    lakecache_protocol::Deadlines::uniform(Duration::from_secs(5)),
                    tls.as_ref(),
                )
                .and_then(|c| c.with_token(token.as_deref()));
                let status = match status {
                    Ok(c) => c.writeback_status(Some(&prefix)).await,
                    Err(e) => Err(e),
                };
                match status {
                    Ok(s) => {
                        pending.pending_objects += s.pending_objects;
                        pending.pending_bytes += s.pending_bytes;
                        // A copy still held is a write whose primary has not
                        // confirmed its upload yet.
                        pending.replica_objects += s.replica_objects;
                        pending.oldest_pending_ms =
                            pending.oldest_pending_ms.max(s.oldest_pending_ms);
                        if s.last_error.is_some() {
                            pending.last_error = s.last_error;
                        }
                    }
                    Err(e) => unreachable.push(format!("{} ({e})", m.id)),
                }
            }
            if pending.pending_objects == 0
                && pending.replica_objects == 0
                && unreachable.is_empty()
            {
                println!(
                    "{prefix}: everything acknowledged is in S3 (waited {:.1}s)",
                    start.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            let describe = || {
                let mut s = format!(
                    "{} objects, {} pending, oldest {:.0}s",
                    pending.pending_objects,
                    ByteSize(pending.pending_bytes).human(),
                    pending.oldest_pending_ms as f64 / 1000.0
                );
                if pending.replica_objects > 0 {
                    s.push_str(&format!(
                        "; {} replica copies not yet confirmed by their primary",
                        pending.replica_objects
                    ));
                }
                if !unreachable.is_empty() {
                    s.push_str(&format!("; not answering: {}", unreachable.join(", ")));
                }
                if let Some(e) = &pending.last_error {
                    s.push_str(&format!("; last upload error: {e}"));
                }
                s
            };
            if start.elapsed() >= limit {
                bail!(
                    "{prefix}: not in S3 after {:?}: {}; the data stays staged in the cache",
                    limit,
                    describe()
                );
            }
            if last_report.elapsed() >= Duration::from_secs(2) {
                eprintln!("{prefix}: waiting: {}", describe());
                last_report = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
