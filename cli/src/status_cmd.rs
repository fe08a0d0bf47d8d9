//! `lakecache status`: members, liveness and cache usage of the cluster.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use lakecache_protocol::WorkerClient;
use serde::Serialize;

use crate::cluster_args::ClusterArgs;
use crate::units::ByteSize;

#[derive(Args)]
pub struct StatusCmd {
    /// Print JSON instead of a table
    #[arg(long)]
    json: bool,
    /// Dollars per GB of S3 egress, for the egress-saved column (S3's
    /// internet egress list price by default)
    #[arg(long, env = "LAKECACHE_EGRESS_PRICE_PER_GB", default_value_t = lakecache_worker::metrics::DEFAULT_EGRESS_PRICE_PER_GB)]
    egress_price_per_gb: f64,
    /// Show a mount's node-local tier instead, object by object (whole
    /// or partial, bytes missing, completion): the address given to that
    /// mount's --metrics-listen, e.g. 127.0.0.1:9501
    #[arg(long, value_name = "ADDR")]
    mount: Option<std::net::SocketAddr>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

#[derive(Serialize)]
struct Row {
    id: String,
    address: String,
    live: bool,
    cache_used_bytes: Option<u64>,
    cache_capacity_bytes: Option<u64>,
    hit_ratio: Option<f64>,
    /// Write-back backlog: acknowledged, not yet in S3.
    writeback: Option<lakecache_protocol::WriteBackStatus>,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    buckets: std::collections::BTreeMap<String, lakecache_protocol::BucketTraffic>,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    tenants: std::collections::BTreeMap<String, lakecache_protocol::TenantUsage>,
    /// The worker's write-path deadlines (older workers do not say).
    #[serde(skip_serializing_if = "Option::is_none")]
    deadlines: Option<lakecache_protocol::WorkerDeadlines>,
    /// Workers in this worker's ring view; None when it knows no ring.
    ring_workers: Option<u64>,
    error: Option<String>,
}

/// Egress saved for one bucket over the whole cluster.
#[derive(Serialize)]
struct BucketSaving {
    bucket: String,
    /// Served from the workers' pages: S3 egress not paid.
    cache_bytes: u64,
    /// Fetched from S3.
    s3_bytes: u64,
    saved_dollars: f64,
}

fn savings(rows: &[Row], price_per_gb: f64) -> Vec<BucketSaving> {
    let mut by_bucket: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
    for r in rows {
        for (b, t) in &r.buckets {
            let e = by_bucket.entry(b).or_default();
            e.0 += t.hit_bytes;
            e.1 += t.miss_bytes;
        }
    }
    by_bucket
        .into_iter()
        .map(|(b, (cache, s3))| BucketSaving {
            bucket: b.to_string(),
            cache_bytes: cache,
            s3_bytes: s3,
            saved_dollars: cache as f64 / 1e9 * price_per_gb,
        })
        .collect()
}

impl StatusCmd {
    pub async fn run(self) -> Result<()> {
        if let Some(addr) = self.mount {
            return crate::mount_status::show(addr, self.json).await;
        }
        let registry = self.cluster.registry()?;
        let membership = registry
            .open(Duration::from_secs(5))
            .await
            .context("opening the cluster registry")?;
        let members = membership.subscribe().borrow().clone();
        let tls = self.cluster.tls()?;
        let token = self.cluster.token()?;
        let (tls, token) = (&tls, &token);
        let probes = members.iter().map(|m| async move {
            let client = WorkerClient::connect(
                &m.address,
                lakecache_protocol::Deadlines::uniform(Duration::from_secs(2)),
                tls.as_ref(),
            )
            .and_then(|c| c.with_token(token.as_deref()));
            let (health, writeback) = match client {
                Ok(c) => (
                    c.health()
                        .await
                        .map_err(|e| lakecache_protocol::Chain(&e).to_string()),
                    c.writeback_status(None).await.ok(),
                ),
                Err(e) => (Err(e.to_string()), None),
            };
            match health {
                Ok(h) => {
                    let total = h.hit_bytes + h.miss_bytes;
                    Row {
                        id: m.id.clone(),
                        address: m.address.clone(),
                        live: true,
                        cache_used_bytes: Some(h.cache_used_bytes),
                        cache_capacity_bytes: Some(h.cache_capacity_bytes),
                        hit_ratio: (total > 0).then(|| h.hit_bytes as f64 / total as f64),
                        writeback,
                        buckets: h.buckets,
                        tenants: h.tenants,
                        deadlines: h.deadlines,
                        ring_workers: h.ring_workers,
                        error: None,
                    }
                }
                Err(e) => Row {
                    id: m.id.clone(),
                    address: m.address.clone(),
                    live: false,
                    cache_used_bytes: None,
                    cache_capacity_bytes: None,
                    hit_ratio: None,
                    writeback: None,
                    buckets: Default::default(),
                    tenants: Default::default(),
                    deadlines: None,
                    ring_workers: None,
                    error: Some(e),
                },
            }
        });
        let rows = futures::future::join_all(probes).await;
        anyhow::ensure!(
            (0.0..=100.0).contains(&self.egress_price_per_gb),
            "--egress-price-per-gb must be 0..=100 dollars"
        );
        if rows.len() > 1 {
            for r in rows.iter().filter(|r| r.live && r.ring_workers.is_none()) {
                eprintln!(
                    "{}: knows no ring (started without --registry): its write-backs are not ordered with other workers' versions of the same object",
                    r.id
                );
            }
        }
        let saved = savings(&rows, self.egress_price_per_gb);
        if self.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "registry": membership.describe(),
                    "members": rows,
                    "egress_price_per_gb": self.egress_price_per_gb,
                    "egress_saved": saved,
                }))?
            );
            return Ok(());
        }
        println!(
            "registry: {}   members: {}",
            membership.describe(),
            rows.len()
        );
        println!(
            "{:<24} {:<22} {:<5} {:>10} {:>10} {:>6} {:>8} {:>10} {:>8} {:>7} {:>5}",
            "ID",
            "ADDRESS",
            "LIVE",
            "USED",
            "CAPACITY",
            "HIT%",
            "PENDING",
            "PEND-SIZE",
            "OLDEST",
            "COPIES",
            "RING"
        );
        let size = |v: Option<u64>| v.map_or("-".to_string(), |b| ByteSize(b).human());
        for r in &rows {
            let wb = r.writeback.as_ref();
            println!(
                "{:<24} {:<22} {:<5} {:>10} {:>10} {:>6} {:>8} {:>10} {:>8} {:>7} {:>5}",
                r.id,
                r.address,
                if r.live { "yes" } else { "NO" },
                size(r.cache_used_bytes),
                size(r.cache_capacity_bytes),
                r.hit_ratio
                    .map_or("-".to_string(), |h| format!("{:.1}", h * 100.0)),
                wb.map_or("-".to_string(), |w| w.pending_objects.to_string()),
                size(wb.map(|w| w.pending_bytes)),
                wb.map_or("-".to_string(), |w| format!(
                    "{:.0}s",
                    w.oldest_pending_ms as f64 / 1000.0
                )),
                // Copies of other workers' pending writes held here.
                wb.map_or("-".to_string(), |w| w.replica_objects.to_string()),
                // How many workers it sees; "none": it knows no ring.
                match (r.live, r.ring_workers) {
                    (false, _) => "-".to_string(),
                    (true, None) => "none".to_string(),
                    (true, Some(n)) => n.to_string(),
                },
            );
        }
        print_deadlines(&rows);
        if !saved.is_empty() {
            println!(
                "\n{:<32} {:>12} {:>12} {:>14}",
                "BUCKET",
                "FROM-CACHE",
                "FROM-S3",
                format!("SAVED@${}/GB", self.egress_price_per_gb)
            );
            for b in &saved {
                println!(
                    "{:<32} {:>12} {:>12} {:>14}",
                    b.bucket,
                    ByteSize(b.cache_bytes).human(),
                    ByteSize(b.s3_bytes).human(),
                    format!("${:.2}", b.saved_dollars)
                );
            }
        }
        let mut tenants: std::collections::BTreeMap<&str, (u64, u64, Option<u64>)> =
            Default::default();
        for r in &rows {
            for (t, u) in &r.tenants {
                let e = tenants.entry(t).or_default();
                e.0 += u.cache_bytes;
                e.1 += u.pending_bytes;
                // Quotas are per worker; the cluster's is their sum.
                e.2 = match (e.2, u.quota_bytes) {
                    (Some(a), Some(b)) => Some(a + b),
                    (a, b) => a.or(b),
                };
            }
        }
        if !tenants.is_empty() {
            println!(
                "\n{:<32} {:>12} {:>12} {:>12}",
                "TENANT", "CACHED", "PENDING", "QUOTA"
            );
            for (t, (cached, pending, quota)) in &tenants {
                println!(
                    "{:<32} {:>12} {:>12} {:>12}",
                    t,
                    ByteSize(*cached).human(),
                    ByteSize(*pending).human(),
                    quota.map_or("-".to_string(), |q| ByteSize(q).human())
                );
            }
        }
        for r in &rows {
            if let Some(e) = r.writeback.as_ref().and_then(|w| w.last_error.as_ref()) {
                eprintln!("{}: write-back uploads failing: {e}", r.id);
            }
        }
        for r in rows.iter().filter(|r| !r.live) {
            eprintln!("{}: {}", r.id, r.error.as_deref().unwrap_or("unreachable"));
        }
        Ok(())
    }
}

/// One line per worker: how long it waits on the write path.
fn print_deadlines(rows: &[Row]) {
    let secs = |ms: u64| format!("{}s", ms as f64 / 1000.0);
    let mut header = false;
    for r in rows {
        let Some(d) = &r.deadlines else { continue };
        if !header {
            println!("\nwrite-path deadlines");
            header = true;
        }
        let mut line = format!(
            "  {:<24} upload body idle {}, S3 upload stall {} + 1s/MiB",
            r.id,
            secs(d.body_idle_ms),
            secs(d.s3_stall_ms)
        );
        match (d.replica_progress_ms, d.staging_stall_ms) {
            (Some(progress), Some(stall)) => line.push_str(&format!(
                ", replica progress {}, write-back staging stall {}",
                secs(progress),
                secs(stall)
            )),
            _ => line.push_str(", write-back off"),
        }
        println!("{line}");
    }
}
