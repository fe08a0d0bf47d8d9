//! A worker's place in the ring: the settings it must share with the
//! cluster, and its view of who owns which segment.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use lakecache_protocol::ObjectUri;
use lakecache_registry::{ClusterClient, ClusterOptions, RingSettings};
use lakecache_worker::Placement;

use crate::worker_config::Registration;

/// With an etcd registry: records this worker's ring settings if none are
/// recorded, else refuses to go on with different ones.
pub async fn check_ring_settings(reg: &Registration) -> Result<()> {
    let wanted = RingSettings::of(&reg.ring);
    let recorded = reg
        .registry
        .claim_ring(wanted, Duration::from_secs(5))
        .await
        .context("reading the cluster's ring settings from the registry")?;
    match recorded {
        Some(recorded) if recorded != wanted => bail!(
            "the cluster in {:?} places data with {recorded}, but this worker was started with {wanted}: \
             start it with --segment-size {} --vnodes {} (or use another registry prefix for a new cluster)",
            reg.registry,
            recorded.segment_size,
            recorded.vnodes
        ),
        _ => Ok(()),
    }
}

/// Owners from the worker's own view of the registry.
pub struct RingPlacement {
    cluster: Arc<ClusterClient>,
    me: String,
}

impl RingPlacement {
    /// `me` is the address the ring knows this worker by.
    pub async fn open(reg: &Registration, me: String) -> Result<Self> {
        let membership = reg
            .registry
            .open(Duration::from_secs(5))
            .await
            .context("opening the registry for the worker's ring view")?;
        let options = ClusterOptions {
            ring: reg.ring.clone(),
            s3_fallback: false,
            ..ClusterOptions::default()
        };
        Ok(Self::new(ClusterClient::new(membership, options, None), me))
    }

    pub fn new(cluster: Arc<ClusterClient>, me: String) -> Self {
        Self { cluster, me }
    }
}

impl Placement for RingPlacement {
    fn remote_owner(&self, uri: &ObjectUri, segment: u64) -> Option<String> {
        let offset = segment.checked_mul(self.cluster.segment_size())?;
        let owner = self.cluster.owner_of(uri, offset)?;
        (owner.address != self.me).then_some(owner.address)
    }

    fn replica_candidates(&self, uri: &ObjectUri) -> Vec<String> {
        self.cluster
            .replicas_of(uri, 0, usize::MAX)
            .into_iter()
            .map(|m| m.address)
            .filter(|a| *a != self.me)
            .collect()
    }

    fn me(&self) -> Option<String> {
        Some(self.me.clone())
    }

    fn ring_workers(&self) -> usize {
        self.cluster.members().len()
    }

    fn holds(&self, uri: &ObjectUri, segment: u64, copies: usize) -> bool {
        self.cluster
            .replicas_of(uri, segment, copies.max(1))
            .iter()
            .any(|m| m.address == self.me)
    }
}
