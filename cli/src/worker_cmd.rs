use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_worker::Metrics;

use crate::worker_config::WorkerSettings;

#[derive(Args)]
pub struct WorkerCmd {
    /// TOML file with the same settings as the flags (snake_case keys);
    /// flags and environment variables win over it
    #[arg(long, env = "LAKECACHE_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    settings: WorkerSettings,
}

impl WorkerCmd {
    pub async fn run(self) -> Result<()> {
        let file = match &self.config {
            Some(path) => WorkerSettings::from_file(path)?,
            None => WorkerSettings::default(),
        };
        let (options, s3) = self.settings.over(file).resolve()?;
        tracing::info!(?s3, "starting worker");
        let metrics = Arc::new(
            Metrics::new()
                .map_err(anyhow::Error::msg)
                .context("setting up metrics")?,
        );
        let store = lakecache_worker::s3_store(&s3, metrics.clone()).await;
        let worker = lakecache_worker::start_worker(options, store, metrics)
            .await
            .context("starting worker")?;
        eprintln!("lakecache worker listening on http://{}", worker.addr());
        crate::shutdown_signal().await;
        tracing::info!("shutting down");
        worker.shutdown().await;
        Ok(())
    }
}
