use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_registry::{EtcdRegistration, Member, RegistryUrl};
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
        let settings = self.settings.over(file);
        let registration = settings.registration()?;
        let (mut options, s3) = settings.resolve()?;
        // The ring is set below, after the worker starts.
        options.cache.writeback.await_ring = registration.is_some();
        let capacity = options.cache.capacity;
        let scheme = if options.tls.is_some() {
            "https"
        } else {
            "http"
        };
        if let Some(reg) = &registration {
            crate::worker_ring::check_ring_settings(reg).await?;
        }
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
        eprintln!("lakecache worker listening on {scheme}://{}", worker.addr());
        if let Some(reg) = &registration {
            let placed = match advertised_address(reg, worker.addr()) {
                Ok(me) => crate::worker_ring::RingPlacement::open(reg, me).await,
                Err(e) => Err(e),
            };
            match placed {
                Ok(placement) => worker.cache().set_placement(Arc::new(placement)),
                Err(e) => {
                    worker.shutdown().await;
                    return Err(e);
                }
            }
        }
        let joined = match registration {
            Some(reg) => match join_cluster(&reg, worker.addr(), capacity).await {
                Ok(joined) => joined,
                Err(e) => {
                    worker.shutdown().await;
                    return Err(e);
                }
            },
            None => None,
        };
        crate::sd_notify::notify("READY=1\nSTATUS=serving");
        crate::shutdown_signal().await;
        crate::sd_notify::notify("STOPPING=1");
        tracing::info!("shutting down");
        crate::drain_before_stop(&worker).await;
        if let Some(registration) = joined {
            // Leave the ring first so clients stop routing here.
            registration.stop().await;
        }
        worker.shutdown().await;
        Ok(())
    }
}

/// The address clients (and the ring) know this worker by.
fn advertised_address(
    reg: &crate::worker_config::Registration,
    bound: std::net::SocketAddr,
) -> Result<String> {
    match &reg.advertise {
        Some(a) => Ok(a.clone()),
        None if bound.ip().is_unspecified() => {
            anyhow::bail!(
                "--listen {bound} is a wildcard address: set --advertise HOST:PORT for clients"
            )
        }
        None => Ok(bound.to_string()),
    }
}

/// Registers in etcd (static and file registries need no registration).
async fn join_cluster(
    reg: &crate::worker_config::Registration,
    bound: std::net::SocketAddr,
    capacity: u64,
) -> Result<Option<EtcdRegistration>> {
    let RegistryUrl::Etcd {
        endpoints,
        prefix,
        access,
    } = &reg.registry
    else {
        return Ok(None);
    };
    let advertise = advertised_address(reg, bound)?;
    let member = Member {
        id: reg.worker_id.clone().unwrap_or_else(|| advertise.clone()),
        address: advertise,
        capacity,
    };
    let registration = EtcdRegistration::start(
        access.urls(endpoints),
        prefix.clone(),
        access.clone(),
        member.clone(),
        reg.signer.as_ref(),
        reg.lease_ttl,
        Duration::from_secs(5),
    )
    .await
    .with_context(|| format!("registering worker {} in etcd", member.id))?;
    eprintln!(
        "registered as {} ({}) in etcd://{}{}{}",
        member.id,
        member.address,
        endpoints.join(","),
        prefix,
        if reg.signer.is_some() { ", signed" } else { "" }
    );
    Ok(Some(registration))
}
